"""CUDA graphs of the block stack (`freescale.pipeline.graphs`, `padded_blocks`), applied from
outside the model: `install_graphs` replaces its `block_stack`.

The capture needs CUDA; the padding it relies on does not. On the CPU the
padded stack (`PaddedBlocks`, the body a graph captures) runs eagerly through
a stand-in for flash varlen attention that leaves key-less rows NaN and
checks that every segment fits the maxima it is given (the flash grid), and
is compared with the unpadded eager stack. The GPU tests compare the
captured graphs with eager training.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.config import build_config
from freescale.jagged.batch import UIH_ACTIONS, UIH_IDS
from freescale.models import ModelConfig, SequenceModel, bce_loss
from freescale.pipeline.graphs import BlockGraphs, GraphedStack, check_attention, install_graphs
from freescale.pipeline.padded_blocks import (
    SIZES_PER_OCTAVE,
    Bucket,
    PaddedBlocks,
    _segment_masks,
    bucket,
    padded_inputs,
)
from freescale.run.checks import check_launch
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import adam_drift, assert_reordered_close, steps_tol
from tests.models.test_layout_once import BLOCK_DEPTH, fake_varlen_attn


def stack_tol(batch, uih, cand, layers: int, dim: int) -> tuple[dict, dict]:
    """`assert_reordered_close` arguments for the output and the gradients of
    two orders of a block stack: the forward reduces over features and keys,
    the weight gradients over every token; each block chains `BLOCK_DEPTH`."""
    keys = int(batch.uih_lengths().max()) + int(batch.num_candidates().max())
    widest = 2 * dim  # the MLP's hidden width
    out = dict(terms=max(widest, keys), depth=BLOCK_DEPTH * layers)
    grads = dict(terms=max(widest, uih.shape[0] + cand.shape[0]), depth=2 * BLOCK_DEPTH * layers)
    return out, grads


@given(st.integers(1, 10**9))
def test_bucket_pads_at_most_an_eighth_and_is_stable(n):
    b = bucket(n)
    assert b >= n
    assert b - n <= n / SIZES_PER_OCTAVE
    assert bucket(b) == b  # a bucket is its own bucket
    assert bucket(n + 1) >= b  # monotone


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.one_of(
        st.lists(st.integers(0, 40), min_size=1, max_size=30),
        st.lists(st.integers(0, 5), min_size=20, max_size=90),  # many short samples
    ),
    cands=st.data(),
)
def test_padded_offsets_keep_samples_and_mask_padding(lengths, cands):
    n_cand = cands.draw(st.lists(st.integers(0, 9), min_size=len(lengths), max_size=len(lengths)))
    _check_padded_offsets(lengths, n_cand)


def test_padding_rows_are_masked_and_padded_candidates_have_no_keys():
    b, (_, _, cu_u, cu_c) = padded_inputs(
        torch.zeros(132, 2), torch.zeros(66, 2), torch.arange(0, 133, 4), torch.arange(0, 67, 2)
    )
    pad_u, pad_c, no_keys = _segment_masks(cu_u, cu_c, b.tokens, b.candidates)
    assert (b.tokens, b.candidates) == (144, 128)
    assert pad_u.flatten().tolist() == [False] * 132 + [True] * 12
    assert pad_c.flatten().tolist() == [False] * 66 + [True] * 62
    assert no_keys.flatten().tolist() == [False] * 66 + [True] * 62


def _check_padded_offsets(lengths: list[int], n_cand: list[int]) -> Bucket:
    uo = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    co = torch.tensor([0, *torch.tensor(n_cand).cumsum(0).tolist()])
    n_u, n_c = int(uo[-1]), int(co[-1])
    b, (u, c, cu_u, cu_c) = padded_inputs(torch.zeros(n_u, 2), torch.zeros(n_c, 2), uo, co)
    assert cu_u.dtype == cu_c.dtype == torch.int32
    assert u.shape[0] == b.tokens >= n_u and c.shape[0] == b.candidates >= n_c
    assert cu_u.numel() == cu_c.numel() == b.segments + 1 and b.segments % 8 == 0
    # Real samples unchanged, then empty ones; padding rows in no segment.
    assert cu_u[: len(lengths) + 1].tolist() == uo.tolist()
    assert cu_c[: len(lengths) + 1].tolist() == co.tolist()
    assert set(cu_u[len(lengths) :].tolist()) == {n_u}
    assert set(cu_c[len(lengths) :].tolist()) == {n_c}
    pad_u, pad_c, no_keys = _segment_masks(cu_u, cu_c, b.tokens, b.candidates)
    assert int(pad_u.sum()) == b.tokens - n_u and int(pad_c.sum()) == b.candidates - n_c
    per_cand = torch.repeat_interleave(torch.tensor(lengths) == 0, torch.tensor(n_cand))
    assert no_keys.flatten().tolist() == per_cand.tolist() + [True] * (b.candidates - n_c)
    again = Bucket.of(b.tokens, b.candidates, b.segments, torch.float32)
    assert again == b  # the bucket depends on the sizes, never on where padding falls
    return b


class _GarbageGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, first_outside):
        ctx.first_outside = first_outside
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[ctx.first_outside :] = float("nan")
        return grad, None


def garbage_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """`fake_varlen_attn` (NaN outputs outside every segment), and NaN in the
    q/k/v gradients of those rows: what flash leaves there is unwritten memory."""
    q = _GarbageGrad.apply(q, int(cu_q[-1]))
    k, v = (_GarbageGrad.apply(t, int(cu_k[-1])) for t in (k, v))
    return fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size)


def _model(layers=2, dim=16, heads=2, attention="varlen", seed=0):
    torch.manual_seed(seed)
    return SequenceModel(
        ModelConfig(num_items=100, dim=dim, heads=heads, layers=layers, attention=attention)
    )


def _inputs(m: SequenceModel, batch):
    """The block stack's inputs as the model's forward builds them (leaves here)."""
    n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
    with torch.no_grad():
        rows = m.item_emb(m.embedding_inputs(batch)["item_emb"])
        uih = rows[:n_u] + m.action_emb(batch.uih[UIH_ACTIONS])
        cand = rows[n_u : n_u + n_c] + m._pool_content(rows[n_u + n_c :], batch)
    return uih.requires_grad_(), cand.requires_grad_()


def _eager(m, batch, uih, cand):
    layout = m.attention_layouts(batch, False)
    for block in m.blocks:
        uih, cand = block(uih, cand, layout)
    return cand


def _padded(m, batch, uih, cand, pad_value=0.0):
    maxu = int(batch.uih_lengths().max())
    maxc = int(batch.num_candidates().max())
    _, (u, c, cu_u, cu_c) = padded_inputs(uih, cand, batch.uih.offsets, batch.candidates.offsets)
    if pad_value:  # padding rows with other (finite) values change no real number
        with torch.no_grad():
            u[uih.shape[0] :] = pad_value
            c[cand.shape[0] :] = pad_value
    out = PaddedBlocks(m.blocks, bucket(maxu), bucket(maxc), impl="varlen")(u, c, cu_u, cu_c)
    return out[: cand.shape[0]]


def _grads(m, out, uih, cand, weight):
    m.zero_grad(set_to_none=True)
    uih.grad = cand.grad = None
    (out * weight).sum().backward()
    return [
        torch.zeros_like(t) if t.grad is None else t.grad.clone()
        for t in (uih, cand, *m.blocks.parameters())
    ]


BATCHES = [
    dict(seed=1, batch_size=9, max_uih=40, max_candidates=6),
    dict(seed=2, batch_size=1, max_uih=30, max_candidates=3),  # one sample
    dict(seed=3, batch_size=6, max_uih=0, max_candidates=3),  # every UIH empty
    dict(seed=4, batch_size=8, max_uih=50, max_candidates=9),  # a multiple of 8 samples
    dict(seed=5, batch_size=13, max_uih=200, max_candidates=20),
    dict(seed=6, batch_size=70, max_uih=4, max_candidates=2),  # padding > longest sample
]


@pytest.mark.numeric
@pytest.mark.parametrize("spec", BATCHES)
def test_padded_stack_equals_the_eager_stack(monkeypatch, spec):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", garbage_varlen_attn)
    m = _model()
    batch = random_batch(num_items=100, **spec)
    if batch.uih_lengths().max() == 0 and spec["max_uih"]:
        pytest.skip("no UIH drawn")
    uih, cand = _inputs(m, batch)
    weight = torch.randn(cand.shape[0], cand.shape[1], generator=torch.Generator().manual_seed(9))
    eager = _eager(m, batch, uih, cand)
    ref = _grads(m, eager, uih, cand, weight)
    # Padding changes the GEMM shapes (so the order of their sums), nothing else.
    out_tol, grad_tol = stack_tol(batch, uih, cand, layers=2, dim=16)
    for pad_value in (0.0, 3.0):
        out = _padded(m, batch, uih, cand, pad_value)
        assert_reordered_close(out, eager, **out_tol)
        got = _grads(m, out, uih, cand, weight)
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert torch.isfinite(a).all()
            assert_reordered_close(a, b, **grad_tol)


@pytest.mark.numeric
def test_last_block_skips_the_unread_uih_update_bit_for_bit():
    """``uih_out=False`` leaves the UIH rows as they were and the candidates'
    output (and its gradients) exactly as the full block computes them."""
    m = _model(layers=1, attention="reference")
    batch = random_batch(seed=8, batch_size=6, max_uih=20, num_items=100)
    uih, cand = _inputs(m, batch)
    layout = m.attention_layouts(batch, False)
    weight = torch.randn(cand.shape, generator=torch.Generator().manual_seed(3))
    full = m.blocks[0](uih, cand, layout)[1]
    skipped_uih, skipped = m.blocks[0](uih, cand, layout, uih_out=False)
    assert skipped_uih is uih
    assert torch.equal(skipped, full)
    got, want = _grads(m, skipped, uih, cand, weight), _grads(m, full, uih, cand, weight)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.numeric
def test_graphs_are_off_the_cpu_path_bit_for_bit():
    """Installed graphs change nothing where no graph can run (CPU, no grad),
    and keep the model's parameters and state dict keys."""
    batch = random_batch(seed=7, batch_size=5, max_uih=9)
    out = []
    for graphs in (False, True):
        torch.manual_seed(0)
        m = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2))
        keys, params = list(m.state_dict()), list(m.parameters())
        if graphs:
            install_graphs(m, two_streams=True, own_grads=False)
        assert isinstance(m.blocks, GraphedStack) == graphs
        assert list(m.state_dict()) == keys
        # the same parameters in the same order: the gradient sum's buckets
        assert all(a is b for a, b in zip(m.parameters(), params, strict=True))
        logits = m(batch)
        loss = bce_loss(logits, batch.labels, batch.labels.numel())
        loss.backward()
        out.append([logits.detach()] + [p.grad for p in m.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_graphs_are_refused_without_cuda_varlen_or_a_block_stack():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_launch(build_config("demo", ["run.device=cpu", "dense.graphs=true"]))
    with pytest.raises(ValueError, match=r"model\.attention=auto or varlen"):
        check_attention("reference")
    m = SequenceModel(ModelConfig(num_items=10, dim=8, heads=2, layers=1, attention="reference"))
    with pytest.raises(ValueError, match=r"model\.attention=auto or varlen"):
        install_graphs(m, two_streams=True, own_grads=False)
    with pytest.raises(ValueError, match=r"dense\.graph_streams must be 1 or 2"):
        build_config("demo", ["dense.graph_streams=3"])
    with pytest.raises(ValueError, match="needs a model with a block_stack"):
        install_graphs(torch.nn.Linear(2, 2), two_streams=True, own_grads=False)


# ---- GPU: the captured graphs against eager training ---------------------------------
def _train(graphs: bool, amp: bool, steps: int = 6, seed: int = 0):
    torch.manual_seed(seed)
    # varlen: the graphs run it, so eager runs it too (auto may pick cuDNN eagerly)
    cfg = ModelConfig(num_items=500, dim=64, heads=2, layers=2, dense_dim=2, attention="varlen")
    m = SequenceModel(cfg).cuda()
    runner = install_graphs(m, two_streams=True, own_grads=False) if graphs else None
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    losses, logits_all, tokens = [], [], []
    # Several buckets, one revisited (the third batch repeats the first's shape).
    specs = [(11, 32), (12, 40), (11, 32), (13, 300), (14, 0), (15, 37)]
    for step in range(steps):
        s, max_uih = specs[step % len(specs)]
        batch = random_batch(seed=s, batch_size=24, max_uih=max_uih, num_items=500).to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = m(batch)
        loss = bce_loss(logits, batch.labels, max(1, batch.labels.numel()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        logits_all.append(logits.detach().float())
        tokens.append(batch.uih[UIH_IDS].numel() + batch.num_candidates_total)
    return m, losses, logits_all, tokens, runner


LR, STEPS = 1e-3, 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", [False, True])
def test_graphed_training_tracks_eager_training(amp):
    eager, l_e, o_e, tokens, _ = _train(False, amp)
    graphed, l_g, o_g, _, g = _train(True, amp)
    # Padding changes GEMM shapes (reordered sums); the attention runs in bf16
    # (so does the rest under autocast). Step s's logits come from parameters
    # trained s steps (`steps_tol`); a forward and a backward of 2 blocks each.
    for s, (a, b) in enumerate(zip(o_g, o_e, strict=True)):
        n = max(tokens[: s + 1])
        tol = steps_tol(torch.bfloat16, n, n**0.5 * float(b.abs().max()), s + 1, 4 * BLOCK_DEPTH)
        torch.testing.assert_close(a, b, **tol)
        # BCE is 1-Lipschitz in each logit: the mean loss moves no more than they do.
        assert abs(l_g[s] - l_e[s]) <= tol["atol"] + tol["rtol"] * float(b.abs().max())
    # Adam moves a weight by at most ~lr per step whatever its gradient's size,
    # so a near-zero gradient of another sign parts two runs by up to 2 lr per step.
    for p, q in zip(graphed.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=adam_drift(LR, STEPS))
    # The repeated batch replays its graph; the empty-UIH one ran eagerly.
    assert g is not None and 1 <= len(g.graphs) <= g.captures <= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_its_own_eager_padded_stack():
    """Replaying a graph gives the numbers of running its padded body eagerly
    (same kernels, same shapes), for a new bucket and a revisited one."""
    m = _model(layers=2, dim=64, heads=2, attention="auto").cuda()
    graphs = BlockGraphs(m.blocks)
    for k, seed in enumerate((21, 22, 21)):
        before = graphs.captures
        batch = random_batch(seed=seed, batch_size=16, max_uih=64, num_items=100).to("cuda")
        uih, cand = _inputs(m, batch)
        maxu, maxc = int(batch.uih_lengths().max()), int(batch.num_candidates().max())
        weight = torch.randn_like(cand)
        out = graphs.run(uih, cand, batch.uih.offsets, batch.candidates.offsets, maxu, maxc)
        got = [out.detach().clone(), *_grads(m, out, uih, cand, weight)]
        _, args = padded_inputs(uih, cand, batch.uih.offsets, batch.candidates.offsets)
        cap = next(reversed(graphs.graphs.values()))  # the graph just replayed
        body = PaddedBlocks(m.blocks, cap.max_uih, cap.max_candidates)
        ref_out = body(*args)[: cand.shape[0]]
        ref = [ref_out.detach().clone(), *_grads(m, ref_out, uih, cand, weight)]
        assert torch.equal(got[0], ref[0])
        # The flash backward accumulates atomically (in another order each run);
        # its bf16 gradients then flow back through both blocks.
        _, grad_tol = stack_tol(batch, uih, cand, layers=2, dim=64)
        for a, r in zip(got[1:], ref[1:], strict=True):
            assert_reordered_close(a, r, **grad_tol, dtype=torch.bfloat16)
        if k == 2:
            assert graphs.captures == before  # a bucket seen before replays its graph
    assert 1 <= graphs.captures <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lent_gradients_accumulate_like_autograd_bit_for_bit():
    """``own_grads``: the graphs set the block parameters' ``.grad`` to their own
    memory instead of autograd copying it in. Each ``.grad`` must be what
    AccumulateGrad would hold: the graph gradient of a lone backward, the sum
    (in order) over backwards of revisited and new buckets, after
    ``zero_grad`` dropped it or zeroed it in place, never rewritten by a
    later replay. (Two runs cannot be compared bit for bit: the attention's
    backward accumulates atomically.)"""
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=500, dim=64, heads=2, layers=2, dense_dim=2)
    m = SequenceModel(cfg).cuda()
    graphs = install_graphs(m, two_streams=True, own_grads=True)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    steps = [[(11, 32), (12, 300)], [(11, 32)], [(13, 40), (11, 32), (13, 40)], [(12, 300)]]
    lent = 0
    for k, backwards in enumerate(steps):
        want: dict[torch.nn.Parameter, torch.Tensor] = {}
        for seed, max_uih in backwards:
            batch = random_batch(seed=seed, batch_size=24, max_uih=max_uih, num_items=500)
            batch = batch.to("cuda")
            bce_loss(m(batch), batch.labels, batch.labels.numel()).backward()
            for param, graph_grad in graphs.lent:  # this replay's gradients
                lent += param.grad.data_ptr() == graph_grad.data_ptr()
                if param not in want:  # zero_grad left zeros (odd k) or nothing
                    want[param] = torch.zeros_like(graph_grad) if k % 2 else None
                if want[param] is None:
                    want[param] = graph_grad.clone()
                else:
                    want[param].add_(graph_grad)
        assert want and set(want) == {p for p in m.blocks.parameters() if p.grad is not None}
        for param, g in want.items():
            assert torch.equal(param.grad.view(torch.int32), g.view(torch.int32))
        opt.step()
        opt.zero_grad(set_to_none=k % 2 == 1)
    assert lent > 0  # some gradients were the graph's memory, not copies


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", [False, True])
def test_side_stream_stack_equals_one_stream(amp):
    """The candidate path on a side stream runs the same kernels as one stream:
    the output is bit for bit the same, the gradients too up to the flash
    backward's atomic accumulation. Repeated runs would expose memory handed
    to one stream while the other still reads it."""
    m = _model(layers=3, dim=64, heads=2, attention="auto").cuda()
    for seed in (31, 32, 33):
        batch = random_batch(seed=seed, batch_size=16, max_uih=300, num_items=100).to("cuda")
        uih, cand = _inputs(m, batch)
        maxu, maxc = int(batch.uih_lengths().max()), int(batch.num_candidates().max())
        weight = torch.randn_like(cand)
        runs = []
        for two_streams in (False, True, True, True):
            _, args = padded_inputs(uih, cand, batch.uih.offsets, batch.candidates.offsets)
            body = PaddedBlocks(m.blocks, bucket(maxu), bucket(maxc), two_streams=two_streams)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                out = body(*args)[: cand.shape[0]]
            runs.append([out.detach().clone(), *_grads(m, out, uih, cand, weight)])
        ref = runs[0]
        _, grad_tol = stack_tol(batch, uih, cand, layers=3, dim=64)
        for got in runs[1:]:
            assert torch.equal(got[0], ref[0])
            for a, r in zip(got[1:], ref[1:], strict=True):
                assert_reordered_close(a, r, **grad_tol, dtype=torch.bfloat16)


def test_graphs_run_eagerly_above_the_token_limit():
    from freescale.pipeline.dense import graphs_skipped

    # h200 presets: 2k x 32 tokens per batch keep graphs, 8k x 32 and 2k x 128 run eagerly
    section = build_config("h200-21k", ["dense.graphs=true"]).dense
    assert graphs_skipped(section, 2_000 * 32) == ""
    assert graphs_skipped(section, 8_000 * 32).startswith("eager: 256000 tokens per batch")
    assert graphs_skipped(section, 2_000 * 128) != ""
    unlimited = build_config("h200-21k", ["dense.graphs=true", "dense.graph_max_tokens=0"]).dense
    assert graphs_skipped(unlimited, 21_000 * 128) == ""
    assert graphs_skipped(build_config("h200-21k", []).dense, 21_000 * 128) == ""  # not asked
    with pytest.raises(ValueError, match=r"dense\.graph_max_tokens must be >= 0"):
        build_config("demo", ["dense.graph_max_tokens=-1"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("limit", [0, 100])
def test_graph_token_limit_picks_the_path_and_the_summary_says_which(limit):
    import freescale

    sets = ["run.device=cuda", "run.nproc=1", "run.steps=4", "run.warmup=1", "run.batch_size=8",
            "data.max_uih=48", "data.loader_workers=0", "evaluation.every=0",
            "output.progress=false", "dense.graphs=true",
            f"dense.graph_max_tokens={limit}"]  # fmt: skip
    result = freescale.train(config=build_config("demo", sets))
    assert result is not None and len(result.steps) == 4
    if limit:  # 8 x 48 = 384 tokens > 100: eager, nothing captured
        assert result.summary["dense_graphs"].startswith("eager: 384 tokens")
        assert "dense_graphs_captured" not in result.summary
    else:
        assert result.summary["dense_graphs"] == "on"
        assert result.summary["dense_graphs_captured"] >= 1
