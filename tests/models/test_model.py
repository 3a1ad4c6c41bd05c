import pytest
import torch

from freescale.data import LengthDistribution, SyntheticConfig, SyntheticSource
from freescale.jagged import SampleBatch
from freescale.models import ModelConfig, SequenceModel, bce_loss, normalized_entropy
from freescale.models.attention import jagged_attention, reference_attention
from freescale.models.loss import bce_sum
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close, reduction_tol
from tests.models.test_layout_once import BLOCK_DEPTH

CFG = ModelConfig(num_items=100, num_actions=4, dim=16, heads=2, layers=2, dense_dim=2)


def model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return SequenceModel(cfg)


def test_one_logit_per_candidate_including_awkward_samples():
    batch = random_batch(seed=1, batch_size=9, max_uih=5, max_candidates=3, max_content=2)
    assert (batch.uih_lengths() == 0).any() and (batch.num_candidates() == 0).any()
    logits = model()(batch)
    assert logits.shape == batch.labels.shape
    assert torch.isfinite(logits).all()
    loss = bce_loss(logits, batch.labels, batch.labels.numel())
    loss.backward()


@pytest.mark.numeric
def test_samples_are_independent_of_their_batch_mates():
    """A sample's logits must not depend on which samples share its batch:
    load balancing moves samples between ranks and the math must not change."""
    batch = random_batch(seed=2, batch_size=8, max_uih=6, max_candidates=3)
    m = model()
    full = m(batch)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    moved = m(batch.select(perm))
    halves = torch.cat([m(p) for p in batch.split_by_dest(torch.arange(8) % 2, 2)])
    order = torch.sort(torch.arange(8) % 2, stable=True).indices
    expect_moved = batch.select(perm)  # candidates follow their samples
    expect_halves = batch.select(order)
    lookup = {(int(s), k): v for s, k, v in _per_candidate(batch, full)}
    # Other batch mates change the GEMM shapes (so the order of the sums), not
    # the math: the forward's reductions run over features and keys, chained
    # through the blocks and the head.
    keys = int(batch.uih_lengths().max()) + int(batch.num_candidates().max())
    tol = dict(terms=max(2 * CFG.dim, keys), depth=BLOCK_DEPTH * CFG.layers + 2)
    for b, out in ((expect_moved, moved), (expect_halves, halves)):
        for s, k, v in _per_candidate(b, out):
            want = lookup[(int(s), k)]
            assert_reordered_close(v, want, **tol, magnitude=tol["terms"] ** 0.5 * peak(full))


def peak(logits) -> float:
    return float(logits.detach().abs().max())


def _per_candidate(batch: SampleBatch, logits):
    offs = batch.candidates.offsets.tolist()
    for i, sid in enumerate(batch.sample_id):
        for k in range(offs[i + 1] - offs[i]):
            yield sid, k, logits[offs[i] + k]


def test_causal_self_attention_ignores_the_future():
    q = torch.randn(7, 2, 4)
    off = torch.tensor([0, 4, 7])
    out = reference_attention(q, q, q, off, off, causal=True)
    changed = q.clone()
    changed[3] += 1.0  # last token of sample 0
    out2 = reference_attention(changed, changed, changed, off, off, causal=True)
    assert torch.equal(out[:3], out2[:3]) and torch.equal(out[4:], out2[4:])


def test_query_without_keys_gets_zero():
    q = torch.randn(3, 1, 4)
    k = torch.randn(2, 1, 4)
    out = reference_attention(q, k, k, torch.tensor([0, 2, 3]), torch.tensor([0, 0, 2]), False)
    assert torch.equal(out[:2], torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match="impl"):
        jagged_attention(q, k, k, torch.tensor([0, 3]), torch.tensor([0, 2]), False, impl="x")


@pytest.mark.slow
def test_learning_beats_the_base_rate():
    """Short version of the demo: NE on held-out data falls below 0.95."""
    torch.manual_seed(0)
    data = SyntheticConfig(
        num_items=500,
        max_uih=32,
        max_candidates=4,
        max_content=1,
        lengths=LengthDistribution(median=16, sigma=0.6, cap=32),
    )
    src = SyntheticSource(data)
    m = SequenceModel(ModelConfig(num_items=500, dim=16, heads=1, layers=1))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    held_out = [src.batch(100_000 + i, 0, 1, 64) for i in range(3)]

    def ne() -> float:
        with torch.no_grad():
            s = sum(bce_sum(m(b), b.labels) for b in held_out)
        pos = sum(float(b.labels.sum()) for b in held_out)
        return normalized_entropy(s, pos, sum(b.labels.numel() for b in held_out))

    before = ne()
    for step in range(120):
        b = src.batch(step, 0, 1, 32)
        opt.zero_grad()
        bce_loss(m(b), b.labels, b.labels.numel()).backward()
        opt.step()
    after = ne()
    assert after < 0.95 and after < before - 0.05, (before, after)


@pytest.mark.numeric
def test_normalized_entropy_definition():
    assert normalized_entropy(0.0, 1, 2) == 0.0
    # predicting the base rate exactly gives NE = 1
    p = torch.full((4,), 0.25)
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    logits = torch.log(p / (1 - p))
    # fp32 logits and BCE terms (a few roundings each), summed: relative error.
    rel = reduction_tol(torch.float32, 4, 1.0, depth=3)["rtol"]
    assert abs(normalized_entropy(bce_sum(logits, y), 1, 4) - 1.0) <= rel


def test_bad_model_config_raises():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(dim=10, heads=3)
    with pytest.raises(ValueError, match="layers"):
        ModelConfig(layers=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_reference_on_gpu(causal):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 37, 300, 5, 0, 129])
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    q_len = lengths if causal else torch.tensor([3, 0, 2, 1, 4, 2, 1])
    q_off = (
        off if causal else torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)]).cuda()
    )
    tq, tk = int(q_off[-1]), int(off[-1])
    q = torch.randn(tq, 4, 64, generator=g).cuda().bfloat16()
    k = torch.randn(tk, 4, 64, generator=g).cuda().bfloat16()
    v = torch.randn(tk, 4, 64, generator=g).cuda().bfloat16()
    ref = jagged_attention(q.float(), k.float(), v.float(), q_off, off, causal, impl="reference")
    out = jagged_attention(q, k, v, q_off, off, causal, impl="varlen")
    # Same bf16 inputs; flash rounds the attention weights to bf16 before
    # weighting the values (weights that sum to one: at most a rounding of
    # max|v|) and the output once more (fp32 accumulation otherwise).
    tol = reduction_tol(torch.bfloat16, 1, float(v.float().abs().max()), output=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_gpu_matches_cpu_reference():
    batch = SyntheticSource(
        SyntheticConfig(num_items=100, max_uih=200, lengths=LengthDistribution(median=80))
    ).batch(0, 0, 1, 16)
    cfg = ModelConfig(num_items=100, dim=64, heads=2, layers=2)
    m = model(cfg=cfg)
    ref = m(batch)
    out = m.cuda()(batch.to("cuda")).cpu()
    # The GPU's attention runs in bf16 (q, k, v, weights, output rounded: a
    # few bf16 roundings relative to the activations each block), the CPU
    # reference in fp32; norm-wise, as the rounding is relative.
    err = (out - ref).norm() / ref.norm()
    assert err <= reduction_tol(torch.bfloat16, 1, 1.0, depth=2 * cfg.layers)["rtol"], float(err)


@pytest.mark.parametrize(
    ("cross", "attention", "on_cuda", "head_dim", "want"),
    [
        ("auto", "auto", False, 64, "reference"),
        ("auto", "auto", True, 64, "triton"),
        ("auto", "cudnn", True, 64, "triton"),
        ("auto", "auto", True, 8, "varlen"),  # a head dim the kernel does not take
        ("auto", "varlen", True, 64, "varlen"),  # varlen: both patterns, the old path
        ("auto", "reference", True, 64, "reference"),
        ("varlen", "auto", True, 64, "varlen"),
        ("triton", "reference", False, 64, "triton"),
    ],
)
def test_cross_attention_impl_choice(cross, attention, on_cuda, head_dim, want):
    from freescale.models.attention import cross_attention_impl

    assert cross_attention_impl(cross, attention, on_cuda, head_dim) == want
    if want == "triton" and cross == "auto":  # a graphed stack keeps varlen
        assert cross_attention_impl(cross, attention, on_cuda, head_dim, False) == "varlen"


def test_bad_cross_attention_config_raises():
    with pytest.raises(ValueError, match="cross_attention must be one of"):
        ModelConfig(cross_attention="flash")
    with pytest.raises(ValueError, match="cross_attention=triton needs a head dim"):
        ModelConfig(dim=24, heads=1, cross_attention="triton")


def test_cross_layouts_follow_the_option():
    """The cross layout carries the Triton plan only where the kernel runs; an
    explicit cross path gets the key segments it reads."""
    batch = random_batch(seed=0, batch_size=5, max_uih=9)
    for cross, impl in (("triton", "triton"), ("reference", "reference"), ("auto", "reference")):
        m = model(cfg=ModelConfig(num_items=100, dim=32, heads=2, layers=1, cross_attention=cross))
        _, layout = m.attention_layouts(batch, on_cuda=False)
        assert layout.impl == impl and (layout.plan is not None) == (impl == "triton")
        assert layout.k.offsets is batch.uih.offsets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_gpu_default_cross_attention_is_triton_and_matches_cpu_reference():
    batch = SyntheticSource(
        SyntheticConfig(num_items=100, max_uih=200, lengths=LengthDistribution(median=80))
    ).batch(0, 0, 1, 16)
    cfg = ModelConfig(num_items=100, dim=64, heads=2, layers=2)
    m = model(cfg=cfg)
    ref = m(batch)
    m = m.cuda()
    _, layout = m.attention_layouts(batch.to("cuda"), on_cuda=True)
    assert layout.impl == "triton"
    out = m(batch.to("cuda")).cpu()
    # As test_model_gpu_matches_cpu_reference: the self-attention runs in bf16
    # (varlen or cuDNN), the Triton cross-attention in fp32 here.
    err = (out - ref).norm() / ref.norm()
    assert err <= reduction_tol(torch.bfloat16, 1, 1.0, depth=2 * cfg.layers)["rtol"], float(err)
