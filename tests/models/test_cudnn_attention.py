"""The optional cuDNN attention backend (`freescale.kernels.attention.cudnn_sdpa`).

CPU: which implementation ``auto`` and ``cudnn`` resolve to with the frontend
missing or present (mocked), the one-line errors, the graphs' declaration (a
recording stand-in for the frontend), the graph cache's keys, and the
autograd plumbing through a stand-in plan that computes the reference
attention from the buffers cuDNN would be handed (their strides checked
against the graph's declaration). GPU (``cudnn`` importable, sm90+): cuDNN
against varlen on awkward jagged batches, the model with either, graph reuse.
"""

from __future__ import annotations

import itertools
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from freescale.config import build_config
from freescale.jagged.batch import UIH_IDS
from freescale.kernels.attention import cudnn_graphs as cg
from freescale.kernels.attention import cudnn_sdpa as ca
from freescale.models import ModelConfig, SequenceModel, bce_loss
from freescale.models import attention as att
from freescale.models.blocks import BlockStack, check_attention_device
from freescale.pipeline.graphs import GraphedStack, check_attention
from freescale.run.checks import check_launch
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import reduction_tol
from tests.models.test_layout_once import fake_varlen_attn

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fresh():
    """Forget cached imports, answers and graphs before and after."""
    ca.reset()
    yield
    ca.reset()


@pytest.fixture
def gpu_like(monkeypatch, fresh):
    """What `unavailable` asks, answered as an sm90 GPU with the frontend
    importable (a stand-in module); tests change one answer each."""
    state = SimpleNamespace(capability=(9, 0), module=SimpleNamespace(name="fake cudnn"))
    monkeypatch.setattr(ca, "import_cudnn", lambda: state.module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: state.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake A100")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return state


# ---- dispatch ------------------------------------------------------------------------------
def test_auto_picks_cudnn_only_where_it_runs(gpu_like):
    assert att.self_attention_impl("auto", CUDA0, 64) == "cudnn"
    assert att.self_attention_impl("auto", None, 64) == "reference"  # the CPU
    assert att.self_attention_impl("auto", torch.device("cpu"), 64) == "reference"
    assert att.self_attention_impl("auto", CUDA0, 64, cudnn=False) == "varlen"  # graphs
    assert att.self_attention_impl("varlen", CUDA0, 64) == "varlen"
    assert att.self_attention_impl("reference", CUDA0, 64) == "reference"
    for head_dim in (4, 36, 264):  # not a multiple of 8, or above 256
        ca.reset()
        assert att.self_attention_impl("auto", CUDA0, head_dim) == "varlen"
    gpu_like.capability = (8, 0)
    ca.reset()
    assert att.self_attention_impl("auto", CUDA0, 64) == "varlen"
    gpu_like.capability, gpu_like.module = (9, 0), None
    ca.reset()
    assert att.self_attention_impl("auto", CUDA0, 64) == "varlen"
    # The cross-attention never runs on cuDNN.
    assert att.resolve_impl("cudnn", True) == att.resolve_impl("auto", True) == "varlen"


@pytest.mark.parametrize(
    "change,device,head_dim,message",
    [
        ("module", CUDA0, 64, "needs the nvidia-cudnn-frontend package (pip install "
                              "'freescale[cudnn]')"),
        ("capability", CUDA0, 64, "needs an sm90+ GPU (Fake A100 is sm80)"),
        (None, torch.device("cpu"), 64, "needs a CUDA device"),
        (None, CUDA0, 36, "needs a head dim that is a multiple of 8 and at most 256 (got 36)"),
    ],
)  # fmt: skip
def test_explicit_cudnn_where_it_cannot_run_is_one_line(gpu_like, change, device, head_dim,
                                                        message):  # fmt: skip
    if change == "module":
        gpu_like.module = None
    elif change == "capability":
        gpu_like.capability = (8, 0)
    with pytest.raises(ValueError) as e:
        att.self_attention_impl("cudnn", device, head_dim)
    assert str(e.value) == "model.attention=cudnn " + message
    assert "\n" not in str(e.value)


def test_frontend_missing_here_is_reported_not_raised(fresh):
    # CI has no frontend (and no GPU): the question is answered, not raised.
    assert ca.unavailable(torch.device("cpu"), 64) == "a CUDA device"
    try:
        import cudnn  # noqa: F401
    except Exception:
        assert ca.package_problem() == "the nvidia-cudnn-frontend package " + f"({ca.INSTALL})"
        assert ca.import_error()


def test_config_and_launch_checks():
    assert ModelConfig(attention="cudnn").attention == "cudnn"  # the CPU config is fine
    with pytest.raises(ValueError, match="one of auto, reference, varlen, cudnn; got 'flash'"):
        ModelConfig(attention="flash")
    with pytest.raises(ValueError, match=r"multiple of 8 and at most 256 \(got 36\)"):
        ModelConfig(dim=72, heads=2, attention="cudnn")
    with pytest.raises(ValueError, match="attention impl must be auto, reference, varlen or cudnn"):
        att.self_attention_impl("flash", None, 64)
    with pytest.raises(ValueError, match=r"model\.attention=cudnn needs a CUDA device"):
        check_launch(build_config("demo", ["run.device=cpu", "model.attention=cudnn"]))
    # CUDA graphs run varlen: an explicit cudnn is refused, auto runs varlen there.
    with pytest.raises(ValueError, match=r"model\.attention=auto or varlen .*got cudnn"):
        check_attention("cudnn")
    m = SequenceModel(ModelConfig(num_items=10, dim=16, heads=2, layers=1))
    assert GraphedStack(m.blocks).cudnn_self_attention is False
    assert BlockStack.cudnn_self_attention is True


def test_launch_check_names_the_missing_package(gpu_like):
    gpu_like.module = None
    cfg = build_config("demo", ["run.device=cuda", "model.attention=cudnn"])
    with pytest.raises(ValueError, match=r"needs the nvidia-cudnn-frontend package"):
        check_launch(cfg)
    gpu_like.module = SimpleNamespace()
    check_launch(cfg)  # the package imports: the GPU is the rank's to check
    with pytest.raises(ValueError, match=r"dense\.graphs=true needs model\.attention=auto or"):
        check_launch(build_config("demo", ["run.device=cuda", "model.attention=cudnn",
                                           "dense.graphs=true"]))  # fmt: skip


def test_rank_check_at_start(gpu_like):
    m = SequenceModel(ModelConfig(num_items=10, dim=16, heads=2, layers=1, attention="cudnn"))
    check_attention_device(m, CUDA0)  # sm90, importable
    gpu_like.capability = (8, 6)
    ca.reset()
    with pytest.raises(ValueError, match=r"^model\.attention=cudnn needs an sm90\+ GPU"):
        check_attention_device(m, CUDA0)
    auto = SequenceModel(ModelConfig(num_items=10, dim=16, heads=2, layers=1))
    check_attention_device(auto, CUDA0)  # auto: varlen there, no error


# ---- sizes -------------------------------------------------------------------------------
@given(st.integers(0, 10**8))
def test_token_cap_is_an_eighth_octave_bound(n):
    cap = ca.token_cap(n)
    assert cap >= max(n, 1)
    assert cap - max(n, 1) <= max(n, 1) / 8  # at most 1/8 more rows of workspace
    assert ca.token_cap(cap) == cap and ca.token_cap(n + 1) >= cap  # stable, monotone


@given(st.integers(0, 10**6))
def test_seq_cap(n):
    s = ca.seq_cap(n)
    assert s >= max(n, 1) and s % ca.S_ALIGN == 0 and s < max(n, 1) + ca.S_ALIGN


def test_probe_batch_caps():
    # The probe's h200-21k batch: S = 9984 -> 10240, 140,488 rows -> 147,456.
    assert ca.seq_cap(9984) == 10240 and ca.token_cap(140_488) == 147_456


# ---- the graphs' declaration -------------------------------------------------------------
class _Rec:
    """A recording stand-in for a frontend graph tensor."""

    def __init__(self, name, **kw):
        self.name, self.kw = name, dict(kw)

    def __getattr__(self, attr):
        if not attr.startswith("set_"):
            raise AttributeError(attr)

        def setter(value):
            self.kw[attr[4:]] = value
            return self

        return setter


class _RecGraph:
    def __init__(self):
        self.calls = {}

    def tensor(self, name, **kw):
        return _Rec(name, **kw)

    def sdpa(self, **kw):
        self.calls["sdpa"] = kw
        return _Rec("o"), _Rec("stats")

    def sdpa_backward(self, **kw):
        self.calls["sdpa_backward"] = kw
        return _Rec("dq"), _Rec("dk"), _Rec("dv")


_FAKE_CUDNN = SimpleNamespace(
    data_type=SimpleNamespace(BFLOAT16="bf16", HALF="fp16", FLOAT="f32", INT32="i32", INT64="i64"),
    diagonal_alignment=SimpleNamespace(TOP_LEFT="top-left"),
)


@pytest.mark.parametrize("packed", [False, True])
def test_graph_declaration(packed):
    b, h, d, s = 5, 4, 64, 2048
    tok = (3 if packed else 1) * h * d
    spec = cg.GraphSpec(b, h, d, s, tok, "fp16")
    g = _RecGraph()
    t = cg.declare_forward(_FAKE_CUDNN, g, spec)
    cg.check_roles(t, cg.FWD_DATA)
    assert t["q"].kw == {"dim": [b, h, s, d], "stride": [s * tok, d, tok, 1], "data_type": "fp16",
                         "ragged_offset": t["q_off"]}  # fmt: skip
    assert t["o"].kw["stride"] == [s * h * d, d, h * d, 1] and t["o"].kw["output"] is True
    assert t["stats"].kw["stride"] == [s * h, 1, h, 1] and t["stats"].kw["data_type"] == "f32"
    assert t["stats"].kw["ragged_offset"] is t["stats_off"]
    assert t["q_off"].kw["data_type"] == "i64" and t["q_off"].kw["dim"] == [b + 1, 1, 1, 1]
    assert t["seq_q"].kw["data_type"] == "i32" and t["seq_q"].kw["dim"] == [b, 1, 1, 1]
    call = g.calls["sdpa"]
    assert call["generate_stats"] is True and call["use_padding_mask"] is True
    assert call["diagonal_alignment"] == "top-left" and call["diagonal_band_right_bound"] == 0
    assert call["attn_scale"] == 1 / math.sqrt(d)
    assert cg.offset_units(spec) == {"q_off": tok, "k_off": tok, "v_off": tok, "o_off": h * d,
                                     "stats_off": h}  # fmt: skip
    with pytest.raises(ValueError, match="t_cap"):
        cg.declare_backward(_FAKE_CUDNN, _RecGraph(), spec)
    g = _RecGraph()
    t = cg.declare_backward(_FAKE_CUDNN, g, cg.GraphSpec(b, h, d, s, tok, "fp16", t_cap=9000))
    cg.check_roles(t, cg.BWD_DATA)
    call = g.calls["sdpa_backward"]
    assert call["max_total_seq_len_q"] == call["max_total_seq_len_kv"] == 9000
    for grad, role in (("dq", "q_off"), ("dk", "k_off"), ("dv", "v_off")):  # laid out as q, k, v
        assert t[grad].kw["stride"] == [s * tok, d, tok, 1]
        assert t[grad].kw["ragged_offset"] is t[role]
    assert t["dO"].kw["ragged_offset"] is t["o_off"] is t["o"].kw["ragged_offset"]


# ---- the autograd plumbing, with a stand-in for the graphs -----------------------------------
class FakePlan:
    """Runs what a built graph would on the buffers it is handed, with the
    reference attention (float32, per sample), after checking them against
    the graph's declaration: strides, dtypes, offsets."""

    def __init__(self, spec: cg.GraphSpec, backward: bool):
        self.spec, self.backward, self.runs = spec, backward, 0

    def run(self, data, ragged):
        spec, self.runs = self.spec, self.runs + 1
        h, d = spec.heads, spec.head_dim
        assert ragged.samples == spec.samples and ragged.max_len <= spec.s_cap
        for role in ("q", "k", "v", "dq", "dk", "dv"):
            if role in data:
                assert data[role].stride() == (spec.token_stride, d, 1), role
                assert data[role].dtype == (torch.bfloat16 if spec.dtype == "bf16" else torch.half)
        for role in ("o", "dO"):
            if role in data:
                assert data[role].stride() == (h * d, d, 1), role
        assert data["stats"].shape == (data["q"].shape[0], h, 1) and data["stats"].is_contiguous()
        assert data["stats"].dtype == torch.float32
        for role, unit in cg.offset_units(spec).items():
            assert torch.equal(ragged.scaled(unit).flatten(), ragged.offsets * unit), role
        if self.backward:
            assert data["q"].shape[0] <= spec.t_cap
        bounds = ragged.offsets.tolist()
        for i in range(ragged.samples):
            a, b = bounds[i], bounds[i + 1]
            if a == b:
                continue
            q, k, v = (data[r][a:b].float().transpose(0, 1) for r in "qkv")
            if not self.backward:  # what `reference_attention` computes, and the LSE
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                data["o"][a:b] = o.transpose(0, 1).to(data["o"].dtype)
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
                mask = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
                lse = scores.masked_fill(mask, float("-inf")).logsumexp(-1)
                data["stats"][a:b] = lse.transpose(0, 1)[..., None]
                continue
            with torch.enable_grad():  # a backward runs without grad mode
                q, k, v = (x.requires_grad_() for x in (q, k, v))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                grads = torch.autograd.grad(o, (q, k, v), data["dO"][a:b].float().transpose(0, 1))
            for role, g in zip(("dq", "dk", "dv"), grads, strict=True):
                data[role][a:b] = g.transpose(0, 1).to(data[role].dtype)


@pytest.fixture
def fake_graphs(gpu_like, monkeypatch):
    """`CACHE` builds `FakePlan`s (and refuses the specs in ``refuse``)."""
    built, refuse = [], set()

    def build(self, cudnn, spec, backward, device):
        if (spec.token_stride, backward) in refuse:
            raise RuntimeError("not supported by this fake")
        built.append(FakePlan(spec, backward))
        return built[-1]

    monkeypatch.setattr(ca.GraphCache, "_build", build)
    return SimpleNamespace(built=built, refuse=refuse)


def _qkv(lengths, heads, head_dim, packed, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    if packed:
        leaf = torch.randn(rows, 3 * heads * head_dim, generator=g).bfloat16().requires_grad_()
        q, k, v = (x.view(rows, heads, head_dim) for x in leaf.chunk(3, dim=-1))
    else:
        leaf = torch.randn(3, rows, heads, head_dim, generator=g).bfloat16().requires_grad_()
        q, k, v = leaf.unbind(0)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return leaf, (q, k, v), offsets


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lengths", [[0, 1, 37, 5, 0, 29], [7], [1, 1, 1], [0, 0, 3]])
def test_autograd_plumbing_matches_reference(fake_graphs, packed, lengths):
    leaf, (q, k, v), offsets = _qkv(lengths, 2, 16, packed)
    assert ca.packed_qkv(q, k, v) is packed
    ragged = ca.Ragged(offsets, max(lengths))
    out = ca.causal_attention(q, k, v, ragged)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    (grad,) = torch.autograd.grad(out, leaf, do)
    leaf2 = leaf.detach().clone().requires_grad_()
    q2, k2, v2 = (x.view(q.shape) for x in leaf2.chunk(3, dim=-1)) if packed else leaf2.unbind(0)
    plan = fake_graphs.built[0]
    want = att.reference_attention(q2.float(), k2.float(), v2.float(), offsets, offsets, True)
    (want_grad,) = torch.autograd.grad(want, leaf2, do.float())
    assert torch.equal(out, want.bfloat16())  # the same float32 reference, rounded once
    assert torch.equal(grad, want_grad.bfloat16())
    assert plan.spec.token_stride == (3 if packed else 1) * 2 * 16
    assert [p.backward for p in fake_graphs.built] == [False, True]
    assert fake_graphs.built[1].spec.t_cap == ca.token_cap(sum(lengths))


def test_in_place_layout_refused_falls_back_to_copies(fake_graphs):
    fake_graphs.refuse.add((3 * 2 * 16, False))
    leaf, (q, k, v), offsets = _qkv([3, 9], 2, 16, packed=True)
    out = ca.causal_attention(q, k, v, ca.Ragged(offsets, 9))
    assert [p.spec.token_stride for p in fake_graphs.built] == [32, 32]  # contiguous copies
    torch.autograd.grad(out.sum(), leaf)
    assert fake_graphs.built[1].runs == 1


def test_no_grad_builds_no_backward_and_empty_batches_run_nothing(fake_graphs):
    _, (q, k, v), offsets = _qkv([4, 2], 1, 8, packed=False)
    with torch.no_grad():
        ca.causal_attention(q, k, v, ca.Ragged(offsets, 4))
    assert [p.backward for p in fake_graphs.built] == [False]
    _, (q, k, v), offsets = _qkv([0, 0], 1, 8, packed=False)
    out = ca.causal_attention(q, k, v, ca.Ragged(offsets, 0))
    assert out.shape == (0, 1, 8) and len(fake_graphs.built) == 1
    with pytest.raises(ca.Unsupported, match="bf16 or fp16"):
        ca.causal_attention(q.float(), k.float(), v.float(), ca.Ragged(offsets, 0))


def test_graph_cache_keys(fake_graphs):
    cache, cpu = ca.CACHE, torch.device("cpu")
    spec = cg.GraphSpec(8, 2, 64, ca.seq_cap(700), 128)
    assert cache.get(spec, False, cpu) is cache.get(spec, False, cpu)
    # The same B under the same caps: no new graph; another B, S_cap or T_cap: one.
    assert cache.get(cg.GraphSpec(8, 2, 64, ca.seq_cap(1000), 128), False, cpu)
    assert cache.builds == 1
    cache.get(cg.GraphSpec(9, 2, 64, 1024, 128), False, cpu)
    cache.get(cg.GraphSpec(8, 2, 64, 2048, 128), False, cpu)
    back = cg.GraphSpec(8, 2, 64, 1024, 128, t_cap=ca.token_cap(4000))
    assert back.t_cap == ca.token_cap(4050) == 4096  # one bucket
    cache.get(back, True, cpu)
    assert cache.builds == 4
    fake_graphs.refuse.add((96, False))
    refused = cg.GraphSpec(1, 1, 32, 1024, 96)
    for _ in range(2):  # remembered: built (and refused) once
        with pytest.raises(ca.Unsupported, match="cuDNN refused the forward attention graph"):
            cache.get(refused, False, cpu)
    assert cache.builds == 4 and len(cache.refused) == 1


# ---- the model's wiring (CPU: stand-ins for both kernels) --------------------------------------
def _cpu_cudnn(q, k, v, ragged):
    """The cuDNN path's contract on the CPU: per-sample causal SDPA."""
    return att.reference_attention(q, k, v, ragged.offsets, ragged.offsets, True)


def _blocks_run(m, batch, on_cuda, **maxima):
    layout = m.blocks.layouts(batch, on_cuda, **maxima)
    n_u = batch.uih[UIH_IDS].numel()
    rows = m.item_emb(m.embedding_inputs(batch)["item_emb"])
    uih = rows[:n_u]
    cand = rows[n_u : n_u + batch.num_candidates_total]
    last = len(m.blocks) - 1
    for i, block in enumerate(m.blocks):
        uih, cand = block(uih, cand, layout, uih_out=i < last)
    return layout, cand


def test_model_layouts_route_self_attention_to_cudnn(gpu_like, monkeypatch):
    import torch.nn.attention.varlen as varlen

    calls = []

    def counted(q, k, v, ragged):
        calls.append((q.shape[0], ragged.samples))
        return _cpu_cudnn(q, k, v, ragged)

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(ca, "causal_attention", counted)
    batch = random_batch(seed=3, batch_size=9, max_uih=12, max_candidates=3)
    outs = {}
    for attention in ("auto", "cudnn", "varlen"):
        torch.manual_seed(0)
        m = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=3,
                                      attention=attention))  # fmt: skip
        layout, outs[attention] = _blocks_run(m, batch, on_cuda=True)
        assert layout[1].impl == "varlen"  # the cross-attention
        assert layout[0].impl == ("varlen" if attention == "varlen" else "cudnn")
        if attention != "varlen":
            ragged = layout[0].q.ragged
            assert ragged is not None and ragged.fallback == (attention == "auto")
            # 9 samples, padded with 7 empty ones (one graph serves B = 9..16)
            assert ragged.samples == 16
            assert ragged.seq_len.flatten().tolist() == batch.uih_lengths().tolist() + [0] * 7
            assert ragged.offsets[9:].tolist() == [batch.uih_lengths().sum().item()] * 8
            assert layout[1].k is layout[0].k  # the cross-attention reads the same UIH segments
    assert len(calls) == 2 * 2  # two blocks update the UIH (the last does not), two models
    # The same per-sample attention either way: bit-identical candidates.
    assert torch.equal(outs["auto"], outs["varlen"]) and torch.equal(outs["cudnn"], outs["varlen"])


def test_refused_graph_falls_back_under_auto_only(gpu_like, monkeypatch):
    import torch.nn.attention.varlen as varlen

    def refuse(q, k, v, ragged):
        raise ca.Unsupported("cuDNN refused the forward attention graph (test)")

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(ca, "causal_attention", refuse)
    batch = random_batch(seed=4, batch_size=6, max_uih=9)
    torch.manual_seed(0)
    auto = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2))
    with pytest.warns(RuntimeWarning, match="model.attention=auto runs varlen there"):
        _, got = _blocks_run(auto, batch, on_cuda=True)
    torch.manual_seed(0)
    ref = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2, attention="varlen"))
    assert torch.equal(got, _blocks_run(ref, batch, on_cuda=True)[1])
    torch.manual_seed(0)
    explicit = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2,
                                         attention="cudnn"))  # fmt: skip
    with pytest.raises(ValueError, match="cuDNN refused"), warnings.catch_warnings():
        warnings.simplefilter("error")
        _blocks_run(explicit, batch, on_cuda=True)


def test_padding_rows_are_zeroed_like_varlen(gpu_like, monkeypatch):
    """A caller that pads (rows after the last sample): output 0 there and
    q/k/v gradient 0, whatever the kernel left in them."""

    def garbage(q, k, v, ragged):
        out = _cpu_cudnn(q, k, v, ragged)
        n = int(ragged.offsets[-1])
        return torch.cat([out[:n], torch.full_like(out[n:], float("nan"))])

    monkeypatch.setattr(ca, "causal_attention", garbage)
    offsets = torch.tensor([0, 3, 5])
    seg = att.segments(offsets, "cudnn", 3)
    pad = (torch.arange(8) >= 5)[:, None, None]
    layout = att.AttentionLayout("cudnn", seg, seg, True, None, q_pad=pad, k_pad=pad)
    q, k, v = (torch.randn(8, 1, 8, requires_grad=True) for _ in range(3))
    out = att.attend(q, k, v, layout)
    assert torch.equal(out[5:], torch.zeros(3, 1, 8)) and torch.isfinite(out).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(g[5:], torch.zeros(3, 1, 8)) for g in grads)


def test_jagged_attention_takes_cudnn(gpu_like, monkeypatch):
    monkeypatch.setattr(ca, "causal_attention", _cpu_cudnn)
    offsets = torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"model\.attention=cudnn needs a CUDA device"):
        att.jagged_attention(*(torch.randn(4, 1, 8) for _ in range(3)), offsets, offsets, True,
                             impl="cudnn")  # fmt: skip


# ---- GPU --------------------------------------------------------------------------------------
def _cudnn_here() -> bool:
    if not torch.cuda.is_available():
        return False
    ca.reset()
    return ca.unavailable(torch.device("cuda"), 64) is None


CUDNN = _cudnn_here()

AWKWARD = [
    [0, 1, 37, 300, 5, 0, 129],  # empty samples, length 1, lengths not multiples of 64
    [1],  # one sample of one row
    [700],  # B = 1
    [1] * 50,  # lengths 1
    [5000, 3, 0, 17],  # one long sample (S_cap 5120)
    [1024, 1025, 0],  # around an S_ALIGN boundary
    [0, 0, 5],
]


def _gpu_qkv(lengths, heads, head_dim, packed, seed):
    leaf, (q, k, v), offsets = _qkv(lengths, heads, head_dim, packed, seed)
    leaf = leaf.detach().cuda().requires_grad_()
    if packed:
        q, k, v = (x.view(q.shape) for x in leaf.chunk(3, dim=-1))
    else:
        q, k, v = leaf.unbind(0)
    return leaf, (q, k, v), offsets.cuda()


def grad_atol(q, k, v, do, o_a, o_b, offsets) -> dict[str, float]:
    """``atol`` of dq, dk, dv between two bf16 flash-style backwards whose
    forward outputs were ``o_a`` and ``o_b``, from a float32 reference per sample.

    dV_j = Σ_i P_ij dO_i; dQ_i = s Σ_j dS_ij K_j; dK_j = s Σ_i dS_ij Q_i with
    dS_ij = P_ij (dP_ij - D_i), dP = dO·Vᵀ, D_i = Σ_d dO_id O_id. Each side
    rounds P (dV) or dS (dQ, dK) to bf16 before its matmul: a relative error
    of at most eps/2 per term, so at most eps·S apart, S the absolute sum of
    the terms (`reduction_tol` with one term of size S: SAFETY·eps·S). And
    dP - D differs by δ_i: D reads each side's own O (|Σ_d dO_id (o_a - o_b)_id|,
    measured) and both are float32 sums of D terms (`reduction_tol` in float32);
    it enters dQ_i as s·δ_i·Σ_j P_ij|K_j| <= s·δ_i·max|K|, and dK_j as
    s·Σ_i P_ij δ_i |Q_i| <= s·max|Q|·max δ·max_j Σ_i P_ij."""
    scale = 1 / math.sqrt(q.shape[-1])
    size = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    dk_extra, dq_extra = 0.0, 0.0
    for a, b in itertools.pairwise(offsets.tolist()):
        if a == b:
            continue
        qi, ki, vi, di, oa, ob = (x[a:b].float().transpose(0, 1) for x in (q, k, v, do, o_a, o_b))
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        p = (qi @ ki.transpose(-1, -2) * scale).masked_fill(mask, float("-inf")).softmax(-1)
        dp = di @ vi.transpose(-1, -2)
        ds = (p * (dp - (di * (p @ vi)).sum(-1, keepdim=True))).abs()
        size["dv"] = max(size["dv"], float((p.transpose(-1, -2) @ di.abs()).max()))
        size["dk"] = max(size["dk"], scale * float((ds.transpose(-1, -2) @ qi.abs()).max()))
        size["dq"] = max(size["dq"], scale * float((ds @ ki.abs()).max()))
        fp32 = reduction_tol(torch.float32, qi.shape[-1], 1.0)["atol"]  # per unit of S
        terms = di.abs() * (vi.abs().amax(1, keepdim=True) + oa.abs() + ob.abs())
        delta = (di * (oa - ob)).sum(-1).abs() + 2 * fp32 * terms.sum(-1)  # [H, L]
        dq_extra = max(dq_extra, scale * float(delta.max()) * float(ki.abs().max()))
        col = float(p.sum(1).max())  # max_j Σ_i P_ij
        dk_extra = max(dk_extra, scale * float(delta.max()) * float(qi.abs().max()) * col)
    bf16 = {n: reduction_tol(torch.bfloat16, 1, x)["atol"] for n, x in size.items()}
    return {"dv": bf16["dv"], "dq": bf16["dq"] + dq_extra, "dk": bf16["dk"] + dk_extra}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDNN, reason="needs CUDA, sm90+ and nvidia-cudnn-frontend")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads,head_dim", [(4, 64), (2, 128), (1, 32)])
@pytest.mark.parametrize("lengths", AWKWARD)
@pytest.mark.usefixtures("fresh")
def test_cudnn_matches_varlen_on_gpu(lengths, heads, head_dim, packed):
    got, want = {}, {}
    _, (q, k, v), offsets = _gpu_qkv(lengths, heads, head_dim, packed, seed=sum(lengths))
    do = torch.randn(q.shape, device="cuda").bfloat16()
    for impl, into in (("cudnn", got), ("varlen", want)):
        qs = att.segments(offsets, impl, max(lengths))
        layout = att.attention_layout(qs, qs, True, q.shape[0])
        assert layout.impl == impl
        out = att.attend(q, k, v, layout)
        into["o"] = out.detach()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        into.update(dq=dq, dk=dk, dv=dv)
    for name, x in got.items():
        assert torch.isfinite(x).all(), name
    # Forward: each side rounds the attention weights to bf16 before weighting
    # the values (weights that sum to one: a rounding of max|v| at most) and
    # the output once more: as varlen against the float32 reference
    # (test_model.py), here twice over, which SAFETY covers.
    tol = reduction_tol(torch.bfloat16, 1, float(v.float().abs().max()), output=torch.bfloat16)
    torch.testing.assert_close(got["o"].float(), want["o"].float(), **tol)
    # Backward: `grad_atol`, and each side's output rounding to bf16.
    atol = grad_atol(q, k, v, do, got["o"], want["o"], offsets)
    rtol = reduction_tol(torch.bfloat16, 1, 0.0, output=torch.bfloat16)["rtol"]
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(
            got[name].float(), want[name].float(), atol=atol[name], rtol=rtol, msg=name
        )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDNN, reason="needs CUDA, sm90+ and nvidia-cudnn-frontend")
@pytest.mark.parametrize("amp", [False, True])
def test_model_cudnn_matches_varlen_on_gpu(amp, fresh):
    """One forward and backward of the model, same weights, same batch:
    logits and every gradient close to the varlen model's."""
    batch = random_batch(seed=7, batch_size=16, max_uih=600, num_items=500).to("cuda")
    runs = []
    for attention in ("cudnn", "varlen"):
        torch.manual_seed(0)
        cfg = ModelConfig(num_items=500, dim=128, heads=2, layers=3, dense_dim=2,
                          attention=attention)  # fmt: skip
        m = SequenceModel(cfg).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = m(batch)
        loss = bce_loss(logits, batch.labels, max(1, batch.labels.numel()))
        loss.backward()
        runs.append([logits.detach().float()] + [p.grad for p in m.parameters()])
    assert ca.CACHE.builds >= 2  # the cuDNN model ran cuDNN graphs
    # The two attentions differ by bf16 roundings relative to their inputs
    # (above); through the blocks they stay relative: norm-wise, as the GPU
    # model against the CPU reference (test_model.py), a rounding per block
    # forward (logits) and twice that with the backward (gradients).
    (got, *g_got), (want, *g_want) = runs
    assert torch.isfinite(got).all()
    logits_rtol = reduction_tol(torch.bfloat16, 1, 1.0, depth=2 * cfg.layers)["rtol"]
    grads_rtol = reduction_tol(torch.bfloat16, 1, 1.0, depth=4 * cfg.layers)["rtol"]
    assert _rel(got, want) <= logits_rtol, _rel(got, want)
    for i, (a, b) in enumerate(zip(g_got, g_want, strict=True)):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.isfinite(a).all() and _rel(a, b) <= grads_rtol, (i, _rel(a, b))


def _rel(a, b) -> float:
    """‖a - b‖ / ‖b‖ (0 when both are 0)."""
    diff, norm = float((a.float() - b.float()).norm()), float(b.float().norm())
    return diff / norm if norm else diff


@pytest.mark.gpu
@pytest.mark.skipif(not CUDNN, reason="needs CUDA, sm90+ and nvidia-cudnn-frontend")
def test_graphs_are_reused_under_the_caps(fresh):
    """A second batch of the same B under the same S_cap and T_cap builds no
    graph; a longer sample (S_cap), more rows (T_cap) or another B (rounded up
    to a multiple of 8) does."""

    def step(lengths, packed=True):
        leaf, (q, k, v), offsets = _gpu_qkv(lengths, 4, 64, packed, seed=len(lengths))
        ragged = ca.Ragged(offsets, max(lengths))
        out = ca.causal_attention(q, k, v, ragged)
        torch.autograd.grad(out.float().sum(), leaf)
        return ca.CACHE.builds

    assert step([1000, 500, 1000, 500] * 2) == 2  # 6000 rows: fwd + bwd
    assert ca.token_cap(6000) == ca.token_cap(6120) == 6144
    assert step([950, 650, 1000, 460] * 2) == 2  # 6120 rows, longest 1000: both reused
    assert step([1025, 600, 900, 500] * 2) == 4  # longest 1025: S_cap 2048, both new
    assert step([1000, 1000, 1000, 1000] * 2) == 5  # 8000 rows: a new backward only
    assert step([1000, 500, 1000, 500, 1000, 1000, 1000]) == 5  # B = 7: padded to 8
    assert step([1000, 500, 500] * 3) == 7  # B = 9: padded to 16
    assert step([1000, 500, 1000, 500] * 2, packed=False) == 9  # another q/k/v layout
    assert ca.CACHE.refused == {}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDNN, reason="needs CUDA, sm90+ and nvidia-cudnn-frontend")
def test_cudnn_forward_is_deterministic(fresh):
    _, (q, k, v), offsets = _gpu_qkv([0, 1, 37, 3000, 129], 4, 64, True, seed=5)
    ragged = ca.Ragged(offsets, 3000)
    with torch.no_grad():
        first = ca.causal_attention(q, k, v, ragged)
        assert torch.equal(first, ca.causal_attention(q, k, v, ragged))
