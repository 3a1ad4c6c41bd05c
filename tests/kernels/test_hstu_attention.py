"""The fused HSTU attention kernels against their float32 twin (`hstu_attention.reference`).

On the CPU the kernels run in Triton's interpreter (reduced sizes); on a GPU
the same cases run compiled in bf16, plus long histories. Tolerances follow
from the dtype and the reduction length (`freescale.testing.tolerance`).
"""

from __future__ import annotations

import pytest
import torch

from freescale.kernels.attention import hstu as K
from freescale.testing.tolerance import assert_reordered_close

pytestmark = pytest.mark.numeric


@pytest.fixture(autouse=True)
def _one_config(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test but the long GPU ones runs each kernel's first config: the
    autotuner would compile and time every config at every new shape (minutes
    on a GPU), and `test_every_config_matches_the_twin` checks each config."""
    if "autotuned" not in request.keywords:
        monkeypatch.setattr(K, "_pick", lambda kind, *_: K.CONFIGS[kind][0])


# name: (history lengths, candidate counts)
CASES = {
    "awkward": ([0, 1, 37, 5, 0, 70, 16, 17], [2, 0, 3, 1, 0, 4, 1, 9]),
    "one_sample": ([33], [1]),
    "no_candidates": ([20, 3, 0, 40], [0, 0, 0, 0]),
    "empty_histories": ([0, 0, 0], [3, 1, 2]),
}


def _offsets(lengths: list[int], device: str) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out.to(device)


def _inputs(case: str, device: str, dtype: torch.dtype, heads: int, head_dim: int, seed: int):
    return _jagged_inputs(*CASES[case], device, dtype, heads, head_dim, seed)


def _jagged_inputs(uih: list[int], cand: list[int], device: str, dtype: torch.dtype, heads: int,
                   head_dim: int, seed: int, order: str = "chronological"):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    uo, co = _offsets(uih, device), _offsets(cand, device)
    n_u, n_c = sum(uih), sum(cand)

    def rows(n: int) -> torch.Tensor:
        x = torch.randn(n, heads, head_dim, generator=g) * 0.7
        return x.to(device=device, dtype=dtype).requires_grad_()

    # Timestamps: chronological with equal times and gaps up to ~2^35 units
    # (past the last time bucket); candidates far in the future or equal.
    gaps = torch.randint(0, 4, (n_u,), generator=g) * torch.randint(0, 2**12, (n_u,), generator=g)
    gaps[::7] = 2**33
    t_u = gaps.cumsum(0)
    if order == "smooth":  # about a minute apart: one bucket boundary in most tiles
        t_u = torch.randint(30, 90, (n_u,), generator=g).cumsum(0)
    perm = torch.randperm(n_u, generator=g)
    t_u = {"reversed": t_u.flip(0), "shuffled": t_u[perm]}.get(order, t_u).to(device)
    t_c = torch.randint(0, 2**34, (n_c,), generator=g).to(device)
    tables = [(torch.randn(32, generator=g) * 0.5).to(device).requires_grad_() for _ in range(2)]
    return uo, co, (rows(n_u), rows(n_u), rows(n_u), rows(n_c)), (t_u, t_c), tables


def _grads(out: tuple, weights: tuple, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
    loss = sum((o.float() * w).sum() for o, w in zip(out, weights, strict=False) if o is not None)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def _params() -> list:
    """Every case with bias and history outputs; the other three variants on the
    awkward case (the rest: slow, for the interpreter's sake)."""
    out = []
    for case in sorted(CASES):
        for bias in (True, False):
            for uih_out in (True, False):
                fast = (bias and uih_out) or case == "awkward"
                marks = () if fast else (pytest.mark.slow,)
                out.append(pytest.param(case, bias, uih_out, marks=marks))
    return out


@pytest.mark.parametrize(("case", "bias", "uih_out"), _params())
def test_kernels_match_the_twin(triton_device: str, case: str, bias: bool, uih_out: bool) -> None:
    head_dim = 64 if triton_device == "cuda" else 8
    _check_against_twin(*CASES[case], triton_device, bias, uih_out, 2, head_dim, seed=len(case))


# Long histories at the block sizes' edges and the preset's lengths, every head
# dim the kernels are tuned for (GPU only: the interpreter would take hours).
LONG = (
    [0, 1, 63, 64, 65, 127, 128, 129, 255, 2100, 4500, 9000],
    [3, 0, 1, 8, 2, 1, 0, 5, 1, 4, 2, 7],
)


@pytest.mark.gpu
@pytest.mark.autotuned
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("bias", [True, False])
def test_long_histories_match_the_twin_on_a_gpu(head_dim: int, bias: bool) -> None:
    """With the autotuner's pick, as training runs them."""
    _check_against_twin(*LONG, "cuda", bias, True, 4, head_dim, seed=head_dim)


@pytest.mark.parametrize("index", range(max(len(c) for c in K.CONFIGS.values())))
def test_every_config_matches_the_twin(
    triton_device: str, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Config ``index`` of each kernel (its last where it has fewer): the tile
    sizes change which rows and keys share a block, its edges and masks."""
    monkeypatch.setattr(
        K, "_pick", lambda kind, *_: K.CONFIGS[kind][min(index, len(K.CONFIGS[kind]) - 1)]
    )
    head_dim = 64 if triton_device == "cuda" else 8
    uih, cand = (
        ([300, 0, 140, 65], [2, 3, 1, 0]) if triton_device == "cuda" else ([300, 140], [2, 1])
    )
    _check_against_twin(uih, cand, triton_device, True, True, 1, head_dim, 21 + index, "smooth")


def _check_against_twin(uih: list[int], cand: list[int], device: str, bias: bool, uih_out: bool,
                        heads: int, head_dim: int, seed: int,
                        order: str = "chronological") -> None:  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    uo, co, qkv, times, tables = _jagged_inputs(
        uih, cand, device, dtype, heads, head_dim, seed, order
    )
    sched = K.Schedule(uo, co, qkv[0].shape[0], qkv[3].shape[0])
    extra = (*times, *tables) if bias else (None,) * 4
    got = K.hstu_attention(*qkv, sched, *extra, uih_out=uih_out)
    ref_leaves = [t.detach().float().requires_grad_() for t in (*qkv, *tables)]
    ref_extra = (*times, *ref_leaves[4:]) if bias else (None,) * 4
    want = K.reference(*ref_leaves[:4], uo, co, *ref_extra, uih_out=uih_out)
    assert (got[0] is None) == (not uih_out)
    weights = tuple(torch.randn_like(w) if w is not None else None for w in want)
    leaves = [*qkv, *tables] if bias else list(qkv)
    g_got = _grads(got, weights, leaves)
    g_want = _grads(want, weights, ref_leaves[: len(leaves)])
    # The kernels round the SiLU'd scores and dS to the operands' dtype before
    # the second product (and use a tanh.approx sigmoid, ~2^-11, on the GPU):
    # per-term roundings of sums of <= L + 1 terms, as reordered sums in that
    # dtype; gradients chain a second reduction, the bias tables' sum every pair.
    longest = max(uih) + 1
    pairs = sum(n * (n + 1) // 2 for n in uih) + sum(n * c for n, c in zip(uih, cand, strict=True))
    for name, a, e in zip(["out_u", "out_c"], got, want, strict=False):
        if e is not None:
            assert_reordered_close(a.float(), e, terms=longest, dtype=dtype, msg=name)
    for name, a, e in zip(
        ["dq_u", "dk", "dv", "dq_c", "dpos", "dtime"], g_got, g_want, strict=False
    ):
        if e is None or (name == "dq_u" and not uih_out):
            assert a is None or not a.abs().any(), name
            continue
        terms = max(1, pairs) if name in ("dpos", "dtime") else longest
        assert_reordered_close(a.float(), e, terms=terms, depth=2, dtype=dtype, msg=name)


@pytest.mark.parametrize("order", ["chronological", "reversed", "shuffled"])
def test_histories_in_any_time_order_match_the_twin(triton_device: str, order: str) -> None:
    """Several blocks per sample, time differences of either sign in one tile."""
    _check_against_twin([300, 140], [2, 1], triton_device, True, True, 1, 8, seed=11, order=order)


@pytest.mark.parametrize("uih_out", [True, False])
def test_tiles_with_one_boundary_match_the_twin(triton_device: str, uih_out: bool) -> None:
    """Histories long and smooth enough that most tiles off the diagonal hold one
    position or time bucket boundary (the kernels' loop-free path) and the rest
    several (their second pass)."""
    _check_against_twin([900, 260], [3, 1], triton_device, True, uih_out, 1, 8, 12, "smooth")


def test_backward_is_deterministic(triton_device: str) -> None:
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float32
    uo, co, qkv, times, tables = _inputs("one_sample", triton_device, dtype, 2, 16, seed=3)
    sched = K.Schedule(uo, co, qkv[0].shape[0], qkv[3].shape[0])
    runs = []
    for _ in range(2):
        out = K.hstu_attention(*qkv, sched, *times, *tables)
        runs.append(_grads(out, (1.0, 1.0), [*qkv, *tables]))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=False))


def test_strided_views_are_read_in_place(triton_device: str) -> None:
    """q/k/v as the HSTU layer makes them: chunks of one [T, 4·H·d] projection."""
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float32
    uo, co, _, times, tables = _inputs("awkward", triton_device, dtype, 2, 8, seed=5)
    n_u, n_c = int(uo[-1]), int(co[-1])
    proj_u = torch.randn(n_u, 4 * 16, device=triton_device).to(dtype)
    proj_c = torch.randn(n_c, 4 * 16, device=triton_device).to(dtype)
    _, v, q, k = (t.view(-1, 2, 8) for t in proj_u.chunk(4, dim=-1))
    q_c = proj_c.chunk(4, dim=-1)[2].view(-1, 2, 8)
    sched = K.Schedule(uo, co, n_u, n_c)
    strided = K.hstu_attention(q, k, v, q_c, sched, *times, *tables)
    dense = K.hstu_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), q_c.contiguous(), sched, *times, *tables
    )
    assert all(torch.equal(a, b) for a, b in zip(strided, dense, strict=False))


def test_bucket_starts_match_log_buckets() -> None:
    for scheme in (K.POSITION, K.TIME):
        starts = scheme.starts()
        x = torch.tensor(starts + [s - 1 for s in starts[1:]] + [scheme.cap, 2**40])
        want = torch.tensor([scheme.of(int(v)) for v in x], dtype=torch.int32)
        assert torch.equal(K.log_buckets(x, scheme), want)
        assert torch.equal(K.log_buckets(torch.tensor(starts), scheme), torch.arange(32).int())


def test_bad_inputs_fail_with_one_line() -> None:
    q = torch.zeros(3, 2, 8)
    sched = K.Schedule(torch.tensor([0, 3]), torch.tensor([0, 1]), 3, 1)
    with pytest.raises(ValueError, match="share a shape"):
        K.hstu_attention(q, q, q[:2], torch.zeros(1, 2, 8), sched)
    with pytest.raises(ValueError, match="both bias tables"):
        K.hstu_attention(q, q, q, torch.zeros(1, 2, 8), sched, pos_table=torch.zeros(32))


@pytest.mark.parametrize("cand_times", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_hstu_model_on_the_kernels_matches_its_reference(triton_device: str, cand_times):
    """The built-in HSTU model with ``attention=fused`` (float32) against its
    per-sample reference: logits and every parameter's gradient."""
    from freescale.testing.batches import random_batch
    from tests.models.test_hstu import CASES as MODEL_CASES
    from tests.models.test_hstu import DIM, LAYERS, _run, model, timed

    seed, b, max_uih, max_cand = MODEL_CASES["awkward"]
    batch = timed(random_batch(seed, b, max_uih, max_cand, num_items=100), seed, cand_times)
    ref_logits, ref_grads = _run(model("reference"), batch)
    logits, grads = _run(model("fused").to(triton_device), batch.to(triton_device))
    terms, depth = max(max_uih + 1, 4 * DIM), 2 * LAYERS + 1
    assert_reordered_close(logits, ref_logits, terms=terms, depth=depth)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        mag = float(ref_logits.numel()) if name == "head.1.bias" else None
        assert_reordered_close(grads[name], grad, terms=terms, depth=depth, magnitude=mag, msg=name)
