"""benchmarks/hstu.py: the lengths it draws, the peer's packed inputs, the FLOP count, the
targets and the parity rule. Fast: tiny shapes on the CPU; the peer is a torch stand-in
with the documented semantics of ``triton_hstu_mha`` (written here, not copied)."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

from benchmarks import hstu, runner
from benchmarks.runner import Ctx
from benchmarks.scenario import load
from freescale.config import build_config
from freescale.data.synthetic import SyntheticSource
from freescale.models import hstu_attention as hattn

FAKE_PEER = '''
import torch
import torch.nn.functional as F

RUNTIME = []


def set_use_runtime_max_seq_len(flag):
    RUNTIME.append(flag)


def triton_hstu_mha(N, alpha, q, k, v, seq_offsets, num_targets=None, *args):
    """Per sample: history causal, each target sees the history and itself; SiLU / N."""
    out = []
    for i in range(seq_offsets.numel() - 1):
        a, b = int(seq_offsets[i]), int(seq_offsets[i + 1])
        n, c = b - a, int(num_targets[i])
        pos = torch.arange(n)
        causal = pos[None, :] <= pos[:, None]
        target_keys = (pos[None, :] < n - c) | (pos[None, :] == pos[:, None])
        mask = torch.where(pos[:, None] < n - c, causal, target_keys)
        s = torch.einsum("qhd,khd->hqk", q[a:b] * alpha, k[a:b])
        out.append(torch.einsum("hqk,khd->qhd", F.silu(s) * mask / N, v[a:b]))
    return torch.cat(out)
'''


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    root = tmp_path / "peer"
    pkg = root / "generative_recommenders"
    (pkg / "ops" / "triton").mkdir(parents=True)
    for init in (pkg, pkg / "ops", pkg / "ops" / "triton"):
        (init / "__init__.py").write_text("")
    (pkg / "common.py").write_text(textwrap.dedent(FAKE_PEER))
    (pkg / "ops/triton/triton_hstu_attention.py").write_text(
        "from generative_recommenders.common import triton_hstu_mha  # noqa: F401\n"
    )
    monkeypatch.setenv("FREESCALE_PEER", str(root))
    yield root
    import sys

    for name in [m for m in sys.modules if m.startswith("generative_recommenders")]:
        del sys.modules[name]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(root)])


def test_synthetic_lengths_are_the_presets_truncated():
    shape = hstu.jagged({"max_uih": 300, "batch": 6}, "h200-21k")
    data = build_config("h200-21k", ["data.max_uih=300"]).data
    source = SyntheticSource(data.synthetic_configs(0)[0])
    want = [min(len(source.raw_sample(g, max_uih=10**9).uih_ids), 300) for g in range(6)]
    assert shape.uih_lengths.tolist() == want
    assert shape.uih_times.numel() == sum(want)
    assert shape.cand_counts.min() >= 1 and shape.cand_counts.max() <= data.max_candidates
    again = hstu.jagged({"max_uih": 300, "batch": 6}, "h200-21k")
    assert torch.equal(again.uih_times, shape.uih_times)


def test_beauty_lengths_come_from_the_committed_histogram():
    rows = [x.split() for x in hstu.BEAUTY.read_text().splitlines() if not x.startswith("#")]
    assert sum(int(c) for _, c in rows) == 22363  # the users of beauty.txt
    values = {int(v) for v, _ in rows}
    got = hstu.jagged({"max_uih": 21000, "batch": 50, "lengths": "beauty", "scale": 3}, "h200-21k")
    assert all(n % 3 == 0 and n // 3 in values for n in got.uih_lengths.tolist())
    capped = hstu.beauty_lengths(200, 40, 1000, np.random.default_rng(0))
    assert capped.max() == 1000
    with pytest.raises(ValueError, match="lengths"):
        hstu.jagged({"max_uih": 10, "batch": 2, "lengths": "zipf"}, "h200-21k")


def test_pairs_count_the_causal_history_and_each_candidates_keys():
    shape = hstu.Jagged(torch.tensor([3, 0, 5]), torch.tensor([2, 1, 0]), torch.zeros(8).long())
    assert shape.pairs == (6 + 0 + 15) + (2 * 4 + 1 * 1 + 0)


def test_peer_gets_the_same_values_packed_and_matches_the_reference(fake_peer):
    mha, line = hstu.load_peer("unused")
    assert mha is not None and str(fake_peer) in line
    shape = hstu.Jagged(torch.tensor([5, 0, 3]), torch.tensor([2, 1, 3]), torch.arange(8) * 7)
    x = hstu.make_inputs(shape, 2, 4, torch.float64, "cpu", seed=0)
    assert x.seq_offsets.tolist() == [0, 7, 8, 14]
    out = hstu.peer(mha, x).step(None)[0]
    zero = hattn.RelativeBias().double()  # zero tables: plain SiLU attention, as the peer's
    lay = hattn.layout("reference", x.uih_offsets, x.cand_offsets, x.uih_times, None, 6)
    out_u, out_c = lay.attend(zero, tuple(x.uih), tuple(x.cand))
    # The peer divides by N (the longest sequence, 7), ours by the sample's L + 1.
    n_u = torch.tensor([6.0] * 5 + [4.0] * 3, dtype=torch.float64).view(-1, 1, 1)
    n_c = torch.tensor([6.0, 6.0, 1.0, 4.0, 4.0, 4.0], dtype=torch.float64).view(-1, 1, 1)
    rows_u, rows_c = [0, 1, 2, 3, 4, 8, 9, 10], [5, 6, 7, 11, 12, 13]
    torch.testing.assert_close(out[rows_u] * 7 / n_u, out_u)
    torch.testing.assert_close(out[rows_c] * 7 / n_c, out_c)


@pytest.fixture
def quick_timing(monkeypatch):
    """One call instead of half a second of repeats per median."""
    monkeypatch.setattr(hstu, "time_fast", lambda fn, dev: (fn(), 1.0)[1])


def _small(peer: bool) -> object:
    s = load("hstu-attention").smoked()
    s.params["points"] = [{"max_uih": 12, "batch": 3, "heads": 1, "head_dim": 4}]
    s.params["peer"] = "somewhere" if peer else "/nonexistent"
    return s


def test_attention_measure_rows_and_targets(fake_peer, quick_timing, tmp_path):
    s = _small(peer=True)
    result = hstu.measure(s, Ctx(out=tmp_path / "r", raw=tmp_path))
    rows = {r["impl"]: r for r in result.rows}
    assert set(rows) == {"reference", "reference-nobias", "padded", "peer"}
    ref, peer = rows["reference"], rows["peer"]
    assert ref["status"] == "ok" and ref["finite"] and peer["status"] == "ok"
    assert ref["vs_peer"] == 1.0 and peer["ms"] == 1.0
    assert isinstance(ref["speed_ok"], bool) and ref["memory_ok"] is None  # no GPU: no GiB
    fwd = 4 * 4 * 1 * ref["pairs"]
    assert ref["tflops"] == pytest.approx(3.5 * fwd / (ref["ms"] * 1e-3) / 1e12)
    assert "speed_ok" not in rows["padded"] and any("Side by side" in x for x in result.sections)


def test_attention_measure_without_peer_says_so_and_judges_nothing(quick_timing, tmp_path):
    result = hstu.measure(_small(peer=False), Ctx(out=tmp_path / "r", raw=tmp_path))
    assert {r["impl"] for r in result.rows} == {"reference", "reference-nobias", "padded"}
    assert all(r.get("speed_ok") is None for r in result.rows)
    assert any("peer skipped" in x for x in result.sections)


def test_judge_applies_each_target():
    t = {"nobias_speedup": 1.5, "bias_speedup": 1.2, "memory_ratio": 1.1}

    def row(impl, ms, gib, status="ok"):
        return {"impl": impl, "ms": ms, "peak_gib": gib, "status": status}

    rows = [row("fused", 8.0, 1.0), row("fused-nobias", 7.0, 1.2), row("peer", 10.0, 1.0)]
    hstu.judge(rows, "fused", t)
    assert rows[0]["speed_ok"] and rows[0]["memory_ok"]  # 1.25x, 1.0x memory
    assert not rows[1]["speed_ok"] and not rows[1]["memory_ok"]  # 1.43x < 1.5, 1.2x memory
    failed = [row("fused", None, None, "oom"), row("peer", 10.0, 1.0)]
    hstu.judge(failed, "fused", t)
    assert failed[0]["speed_ok"] is False and failed[0]["memory_ok"] is False


def test_within_spread_rule():
    base0, base1 = [1.0, 1.2, 1.1, 1.3], [1.1, 1.3, 1.2, 1.4]  # seeds 0.1 apart, no noise
    got = hstu.within_spread([1.05, 1.25, 1.15, 1.35], base0, base1)
    assert got["spread"] == pytest.approx(0.1) and got["margin"] == pytest.approx(0.0, abs=1e-12)
    assert got["within_spread"]
    assert not hstu.within_spread([1.2, 1.4, 1.3, 1.5], base0, base1)["within_spread"]
    noisy = hstu.within_spread([1.0, 1.0], [1.0, 1.0], [1.1, 0.9])  # seeds cross: margin decides
    assert noisy["spread"] == 0.0
    assert noisy["margin"] == pytest.approx(2 * math.sqrt(0.02) / math.sqrt(2))


def test_checks_can_select_rows():
    rows = [{"max_uih": 2000, "mfu_pct": 5.0}, {"max_uih": 21000, "mfu_pct": 30.0}]
    spec = {"kind": "min", "metric": "mfu_pct", "limit": 25.0, "where": {"max_uih": 21000}}
    assert [c["pass"] for c in runner.check(spec, rows)] == [True]
    assert load("hstu-mfu").checks[0]["where"] == {"max_uih": 21000, "batch_size": 128}
