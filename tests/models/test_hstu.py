"""The HSTU-style model: its two attention paths agree, nothing leaks between
candidates, the history is causal, samples are independent, FLOPs add up."""

import pytest
import torch

from freescale.jagged.batch import UIH_TIMESTAMPS, SampleBatch
from freescale.jagged.tensor import JaggedFeatures
from freescale.models import hstu_attention as hattn
from freescale.models.hstu import CAND_TIMESTAMPS, HSTUConfig, HSTUModel
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import SAFETY, assert_reordered_close, eps_of

DIM, LAYERS = 16, 2


def model(attention: str, seed: int = 0, dense_dim: int = 2) -> HSTUModel:
    """A small model whose bias tables are random (they start at 0)."""
    torch.manual_seed(seed)
    cfg = HSTUConfig(
        num_items=100, dim=DIM, heads=2, layers=LAYERS, dense_dim=dense_dim, attention=attention
    )
    m = HSTUModel(cfg)
    with torch.no_grad():
        for layer in m.layers:
            layer.bias.position.weight.normal_(std=0.5)
            layer.bias.time.weight.normal_(std=0.5)
    return m


def timed(batch: SampleBatch, seed: int, cand_times: bool = False) -> SampleBatch:
    """``batch`` with chronological timestamps (gaps of 0..40 units: every time
    bucket up to a few thousand gets used), and optionally candidate times."""
    g = torch.Generator().manual_seed(seed)
    n_u = batch.uih[UIH_TIMESTAMPS].numel()
    batch.uih.features[UIH_TIMESTAMPS] = torch.randint(0, 41, (n_u,), generator=g).cumsum(0)
    if cand_times:
        n_c = batch.num_candidates_total
        late = batch.uih[UIH_TIMESTAMPS].max() if n_u else torch.tensor(0)
        batch.candidates.features[CAND_TIMESTAMPS] = late + torch.randint(0, 99, (n_c,))
    return batch


CASES = {
    # name: (seed, batch size, longest history, most candidates)
    "awkward": (4, 9, 7, 3),  # empty histories (with candidates), zero candidates
    "one_sample": (2, 1, 12, 3),
    "long": (7, 4, 300, 4),
    "no_candidates": (3, 4, 300, 4),
    "no_samples": (4, 0, 5, 2),
}


def _run(
    m: HSTUModel, batch: SampleBatch, amp: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of a weighted sum of them (on the CPU)."""
    m.zero_grad(set_to_none=True)
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = m(batch)
    weights = torch.linspace(-1, 1, logits.numel(), device=logits.device)
    (logits.float() * weights).sum().backward()
    grads = {k: p.grad.float().cpu() for k, p in m.named_parameters() if p.grad is not None}
    return logits.detach().float().cpu(), grads


@pytest.mark.parametrize("cand_times", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_path_matches_the_reference(case, cand_times):
    seed, b, max_uih, max_cand = CASES[case]
    batch = timed(random_batch(seed, b, max_uih, max_cand, num_items=100), seed, cand_times)
    if case == "awkward":
        lengths, counts = batch.uih_lengths(), batch.num_candidates()
        assert (counts == 0).any() and ((lengths == 0) & (counts > 0)).any()
    ref_logits, ref_grads = _run(model("reference"), batch)
    out_logits, out_grads = _run(model("padded"), batch)
    terms = max(max_uih + 1, 4 * DIM)  # longest reduction: the keys of a query, or f1's input
    depth = 2 * LAYERS + 1  # the layers' forward, their backward, the head
    assert_reordered_close(out_logits, ref_logits, terms=terms, depth=depth)
    for name, grad in ref_grads.items():
        assert_reordered_close(out_grads[name], grad, terms=terms, depth=depth, msg=name)
    for name in out_grads.keys() - ref_grads.keys():  # outside the reference's graph: 0
        assert not out_grads[name].any(), name
    if batch.num_candidates_total:  # the bias tables were trained through both paths
        assert ref_grads["layers.0.bias.time.weight"].abs().sum() > 0


@pytest.mark.parametrize("attention", ["reference", "padded"])
def test_candidates_see_neither_each_other_nor_labels(attention):
    """Changing one candidate (its id, its content) and every label changes no
    other candidate's logit, bit for bit: nothing leaks between a sample's targets."""
    batch = timed(random_batch(5, 6, 10, 4, num_items=100), 5)
    m = model(attention)
    before = m(batch)
    sample = next(i for i, n in enumerate(batch.num_candidates().tolist()) if n >= 2)
    first = int(batch.candidates.offsets[sample])
    ids = batch.candidates.features["item_ids"]
    ids[first] = (ids[first] + 1) % 100
    lo, hi = batch.content.offsets[first : first + 2].tolist()
    batch.content.features["content_ids"][lo:hi] = 0
    batch.labels[:] = 1 - batch.labels
    after = m(batch)
    others = torch.arange(before.numel()) != first
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[first], after[first])


@pytest.mark.parametrize("attention", ["reference", "padded"])
def test_history_attention_is_causal(attention):
    """A history event's output never depends on later events of its sample."""
    torch.manual_seed(0)
    offsets, cand_offsets = torch.tensor([0, 4, 4, 9]), torch.tensor([0, 1, 3, 5])
    times = torch.arange(9) * 7
    q, k, v = (torch.randn(9, 2, 4) for _ in range(3))
    qc, kc, vc = (torch.randn(5, 2, 4) for _ in range(3))
    bias = hattn.RelativeBias()
    lay = hattn.layout(attention, offsets, cand_offsets, times, None, 5)
    out, _ = lay.attend(bias, (q, k, v), (qc, kc, vc))
    k2, v2 = k.clone(), v.clone()
    k2[3] += 1.0  # the last event of sample 0
    v2[3] -= 1.0
    out2, out_c2 = lay.attend(bias, (q, k2, v2), (qc, kc, vc))
    assert torch.equal(out[:3], out2[:3]) and torch.equal(out[4:], out2[4:])
    assert not torch.equal(out[3], out2[3])
    _, out_c = lay.attend(bias, (q, k, v), (qc, kc, vc))
    assert torch.equal(out_c[1:], out_c2[1:])  # sample 0's candidate does see it
    assert not torch.equal(out_c[0], out_c2[0])


@pytest.mark.parametrize("attention", ["reference", "padded"])
def test_samples_are_independent_of_their_batch_mates(attention):
    """Load balancing moves samples between ranks: a sample's logits must not
    depend on which samples share its batch (padding to another longest
    history only reorders additions)."""
    batch = timed(random_batch(6, 8, 40, 3, num_items=100), 6)
    m = model(attention)
    full = m(batch)
    dest = torch.arange(8) % 2
    halves = torch.cat([m(part) for part in batch.split_by_dest(dest, 2)])
    off = batch.candidates.offsets.tolist()
    order = torch.sort(dest, stable=True).indices.tolist()
    rows = [r for i in order for r in range(off[i], off[i + 1])]  # candidates follow samples
    assert_reordered_close(halves, full[rows], terms=4 * DIM, depth=LAYERS + 1)


def test_missing_timestamps_count_as_time_zero():
    batch = timed(random_batch(7, 5, 9, 3, num_items=100), 7)
    del batch.uih.features[UIH_TIMESTAMPS]
    out = model("padded")(batch)
    assert_reordered_close(out, model("reference")(batch), terms=4 * DIM, depth=LAYERS + 1)


def test_log_buckets():
    x = torch.tensor([0, 1, 7, 8, 11, 12, 16, -16, 10**9])
    # below 8 exact; 8..11 -> 8 (log2 < 0.5), 12..15 -> 9, 16 -> 10; |x|; the rest clamps
    assert hattn.position_buckets(x).tolist() == [0, 1, 7, 8, 8, 9, 10, 10, 31]
    assert hattn.time_buckets(torch.tensor([0, 1, 2, 3, 4, 2**40])).tolist() == [0, 1, 2, 2, 3, 31]
    # exact next to powers of two, where float32 log2 rounds up: 2^24 - 1 is in 2^23's bucket
    assert hattn.time_buckets(torch.tensor([2**24 - 1, 2**24])).tolist() == [24, 25]


def test_flops_of_a_small_batch_by_hand():
    """One sample, L = 3 events, 2 candidates, D = 16, 2 layers, no dense."""
    batch = SampleBatch.concat([_sample(3, 2)])
    m = model("padded", dense_dim=0)
    d, tokens = DIM, 3 + 2
    f1 = 2 * d * 4 * d * tokens * LAYERS
    cand = (2 * d * d * 2 + 4 * d * 2 * (3 + 1)) * LAYERS  # 2 candidates, 4 keys each
    hist = (2 * d * d * 3 + 4 * d * (1 + 2 + 3)) * (LAYERS - 1)  # 6 causal pairs
    assert m.flops(batch) == 3 * (f1 + cand + hist + 2 * d * 2)


def test_flops_add_over_samples():
    """The count is a sum over samples (the balancer moves them between ranks)."""
    m = model("padded", dense_dim=0)
    a, b = _sample(100, 2), _sample(7, 1)
    assert m.flops(SampleBatch.concat([a, b])) == m.flops(a) + m.flops(b)


def _sample(length: int, candidates: int) -> SampleBatch:
    """One sample with ``length`` events and ``candidates`` candidates (no content)."""
    g = torch.Generator().manual_seed(length)
    uih = JaggedFeatures(
        torch.tensor([0, length]),
        {
            "item_ids": torch.randint(0, 100, (length,), generator=g),
            "actions": torch.randint(0, 4, (length,), generator=g),
            UIH_TIMESTAMPS: torch.arange(length),
        },
    )
    cands = JaggedFeatures(torch.tensor([0, candidates]), {"item_ids": torch.arange(candidates)})
    content = JaggedFeatures(
        torch.zeros(candidates + 1, dtype=torch.int64), {"content_ids": torch.zeros(0).long()}
    )
    return SampleBatch(uih, cands, torch.zeros(candidates), content, torch.tensor([length]))


def test_bad_configs_are_one_line():
    with pytest.raises(ValueError, match="divisible"):
        HSTUConfig(dim=10, heads=3)
    with pytest.raises(ValueError, match="auto, reference, padded or fused"):
        HSTUConfig(attention="flash")
    with pytest.raises(ValueError, match="layers"):
        HSTUConfig(layers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["padded", "fused"])
@pytest.mark.parametrize("case", ["long", "awkward"])
def test_gpu_paths_match_the_cpu_reference(attention, case):
    """fp32 on CUDA (the Triton backward of the bias tables included) against
    the CPU loop, to rounding; bf16 autocast within a few bf16 roundings per layer."""
    seed, b, max_uih, max_cand = CASES[case]
    batch = timed(random_batch(seed, b, max_uih, max_cand, num_items=100), seed, True)
    ref_logits, ref_grads = _run(model("reference"), batch)
    logits, grads = _run(model(attention).cuda(), batch.to("cuda"))
    terms, depth = max(max_uih + 1, 4 * DIM), 2 * LAYERS + 1
    assert_reordered_close(logits, ref_logits, terms=terms, depth=depth)
    for name, grad in ref_grads.items():
        # The head's bias gradient is Σ w_i over the logits, which cancels to ~0
        # (w spans [-1, 1]): its rounding follows its terms' size Σ|w_i| <= n.
        mag = float(ref_logits.numel()) if name == "head.1.bias" else None
        assert_reordered_close(grads[name], grad, terms=terms, depth=depth, magnitude=mag, msg=name)
    logits, grads = _run(model(attention).cuda(), batch.to("cuda"), amp=True)
    bound = SAFETY * eps_of(torch.bfloat16) * depth  # relative, in norm
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < bound
    for name in ("item_emb.weight", "layers.0.f1.weight", "layers.0.bias.time.weight"):
        err = (grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()
        assert float(err) < bound, name
