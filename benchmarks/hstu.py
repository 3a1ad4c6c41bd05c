"""HSTU: the jagged attention alone beside the peer kernel, and the fused path's parity.

``[params] kind`` picks one of two measures.

**attention** (scenario ``hstu-attention``). `freescale.models.hstu_attention`
alone, forward + backward, at each of ``points`` (max UIH, batch, heads x head
dim, length law), for each variant: ``ours`` (``hattn.layout(ours, ...)``)
with a random `RelativeBias`, ``ours-nobias`` (``bias=None``), ``padded``, and
the ``peer``: Meta generative-recommenders' ``triton_hstu_mha`` (commit
2e81fab), imported from ``peer`` (a folder holding ``generative_recommenders/``;
``FREESCALE_PEER`` overrides it; absent: one line, no peer rows). The peer
takes each sample as one packed sequence, history then targets
(``seq_offsets``, ``num_targets``: the same history-causal /
candidate-sees-history-and-itself pattern), divides by the batch's longest
sequence instead of our per-sample L + 1 (same work) and has no bias. Its
autotuner is keyed on the length bucket (``set_use_runtime_max_seq_len``):
tuned for each point, the strongest peer, at ~10 s of tuning per point.

Lengths: ``lengths = "h200-21k"``: the preset's synthetic source
(`SyntheticSource`, seed 0, global samples 0..B-1: the lognormal law, median
4,500, cap 17,000) truncated at the point's max UIH, with its timestamps and
1..8 candidates per sample. ``lengths = "beauty"``: users' history lengths of
Amazon Beauty (``scenarios/beauty-lengths.txt``, a histogram committed because
the GPU machine cannot read the data), drawn with seed 0, times ``scale``,
synthetic timestamps (60 s mean gaps) and candidates as the preset's.
Inputs: q, k, v and the output gradients random normal, contiguous ``[T, H, d]``,
fresh per point (seeded by its index); the peer gets the same values, packed.
bf16 (ours under autocast, as in training; its bias tables float32).

Numbers: ``ms`` the median fwd + bwd (``triton.testing.do_bench``: warm-up
25 ms, 100 ms of repeats) of ``attend`` + ``autograd.grad`` of every input
(bias tables included), the layout built beforehand (the model builds it once
per forward for all layers; ``layout_ms`` is its own median); ``peak_gib`` the
``max_memory_allocated`` rise over the inputs during one layout + fwd + bwd
(outputs and gradients included, as for the peer); ``tflops`` FlashAttention's
counting over causal pairs: forward 4·d·H·pairs FLOPs, pairs = Σ L(L+1)/2 +
Σ_candidates (L + 1), forward + backward = 3.5 x forward (the same count for
every variant, whatever it really computes). ``vs_peer`` = peer ms / ours;
``mem_vs_peer`` = ours / peer GiB; ``speed_ok``, ``memory_ok`` the issue's
targets (``targets``), null without a peer. An OOM is ``status = "oom"``.
Each point's rows are also appended to ``RAW/rows.jsonl`` as it ends (a run cut
short keeps them); ``FREESCALE_HSTU_POINTS=0,3`` runs only those points.

**parity** (scenario ``hstu-parity``). Training runs through `train.run_point`
(``freescale train``, world size 1): ``candidate`` seed 0 against ``baseline``
seeds 0 and 1 for ``steps`` steps, per-step losses from the step logs. Per
window of ``window`` steps (and over the last ``last`` steps), with m the
mean loss of a run over the window and d_t = loss_t(baseline 1) -
loss_t(baseline 0): **within the spread** when

    |m(candidate) - m(baseline 0)| <= |m(baseline 1) - m(baseline 0)| + 2·sd(d)/√n,

the seed spread plus twice the standard error of that spread's own window mean
(so a window where the two seeds happen to cross does not demand equality).
Then ``modes`` at the candidate with ``run.deterministic=true`` for
``mode_steps`` steps: ``bit_identical`` when the per-step losses equal sync's
exactly (JSON floats round-trip; ``loss_digest`` is their sha256).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import importlib
import json
import os
import statistics
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freescale.jagged.batch import UIH_TIMESTAMPS
from freescale.jagged.ops import lengths_to_offsets, segment_ids
from freescale.models import hstu_attention as hattn

from .kernels import time_fast
from .runner import Ctx, Result
from .scenario import SCENARIOS, Scenario

GIB = 1 << 30
BEAUTY = SCENARIOS / "beauty-lengths.txt"
ROOT = Path(__file__).resolve().parents[1]


# ---- lengths ---------------------------------------------------------------------------
@dataclass
class Jagged:
    """One batch's shape: history lengths, candidates per sample, history times."""

    uih_lengths: torch.Tensor  # [B] int64
    cand_counts: torch.Tensor  # [B] int64
    uih_times: torch.Tensor  # [Tu] int64

    @property
    def pairs(self) -> int:
        """Query-key pairs the pattern uses: causal history pairs + each candidate's L + 1."""
        lu, c = self.uih_lengths.double(), self.cand_counts.double()
        return int((lu * (lu + 1) / 2).sum() + (c * (lu + 1)).sum())


def beauty_lengths(n: int, scale: int, max_uih: int, rng: np.random.Generator) -> np.ndarray:
    rows = [x.split() for x in BEAUTY.read_text().splitlines() if x and not x.startswith("#")]
    values, counts = (np.array([int(r[i]) for r in rows]) for i in (0, 1))
    return np.minimum(rng.choice(values, n, p=counts / counts.sum()) * scale, max_uih)


def jagged(point: dict[str, Any], preset: str, seed: int = 0) -> Jagged:
    """The lengths of ``point`` (see the module docstring), deterministic in ``seed``."""
    from freescale.config import build_config
    from freescale.data.synthetic import SyntheticSource

    b, law = point["batch"], point.get("lengths", preset)
    data = build_config(preset, [f"data.max_uih={point['max_uih']}"]).data
    if law == preset:
        batch = SyntheticSource(data.synthetic_configs(seed)[0]).batch(0, 0, 1, b)
        cands = batch.candidates.offsets.diff()
        return Jagged(batch.uih.offsets.diff(), cands, batch.uih[UIH_TIMESTAMPS])
    if law != "beauty":
        raise ValueError(f"lengths must be {preset!r} or 'beauty', got {law!r}")
    rng = np.random.default_rng([seed, 0xBEA])
    lengths = beauty_lengths(b, point.get("scale", 1), point["max_uih"], rng)
    cands = rng.integers(1, data.max_candidates + 1, b)
    times = np.concatenate([rng.exponential(60.0, n).cumsum() + i * 1e6 for i, n in
                            enumerate(lengths)] or [np.zeros(0)])  # fmt: skip
    return Jagged(*(torch.from_numpy(x).long() for x in (lengths, cands, times.astype(np.int64))))


# ---- inputs and variants -------------------------------------------------------------------
@dataclass
class Inputs:
    shape: Jagged
    uih_offsets: torch.Tensor
    cand_offsets: torch.Tensor
    uih_times: torch.Tensor
    seq_offsets: torch.Tensor  # the peer's: history + candidates per sample
    packed: list[torch.Tensor]  # q, k, v [T, H, d], history then candidates per sample
    uih: list[torch.Tensor]  # the same values, history rows [Tu, H, d]
    cand: list[torch.Tensor]  # candidate rows [Tc, H, d]
    douts: list[torch.Tensor]  # random output gradients: history, candidates, packed
    max_lengths: tuple[int, int]
    num_candidates: int


def make_inputs(shape: Jagged, heads: int, dim: int, dtype: torch.dtype, dev: str,
                seed: int) -> Inputs:  # fmt: skip
    lu, c = shape.uih_lengths.to(dev), shape.cand_counts.to(dev)
    uo, co, so = lengths_to_offsets(lu), lengths_to_offsets(c), lengths_to_offsets(lu + c)
    n_u, n_c = int(uo[-1]), int(co[-1])
    su, sc = segment_ids(uo, n_u), segment_ids(co, n_c)
    uih_rows = so[su] + torch.arange(n_u, device=dev) - uo[su]
    cand_rows = so[sc] + lu[sc] + torch.arange(n_c, device=dev) - co[sc]
    g = torch.Generator(dev).manual_seed(seed)
    packed = [torch.randn(n_u + n_c, heads, dim, generator=g, device=dev, dtype=dtype)
              for _ in range(4)]  # fmt: skip
    douts = [packed[3][uih_rows], packed[3][cand_rows], packed.pop()]
    max_lengths = (int(shape.uih_lengths.max()), int(shape.cand_counts.max()))
    return Inputs(shape, uo, co, shape.uih_times.to(dev), so, packed,
                  [x[uih_rows] for x in packed], [x[cand_rows] for x in packed], douts,
                  max_lengths, n_c)  # fmt: skip


def leaves(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.detach().requires_grad_() for x in xs]


@dataclass
class Variant:
    """``prepare() -> state`` (the layout), ``step(state) -> outputs + gradients``."""

    name: str
    prepare: Callable[[], Any]
    step: Callable[[Any], list[torch.Tensor]]
    has_layout: bool = True


def fwd_bwd(outs: list[torch.Tensor], inputs: list[torch.Tensor],
            douts: list[torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
    """Outputs and the gradients of ``inputs`` (``douts`` cast to each output's dtype:
    under autocast the padded path's outputs are float32)."""
    douts = [d.to(o.dtype) for o, d in zip(outs, douts, strict=True)]
    return [*outs, *torch.autograd.grad(outs, inputs, douts)]


def ours(name: str, impl: str, x: Inputs, bias: torch.nn.Module | None) -> Variant:
    uih, cand = leaves(x.uih), leaves(x.cand)
    params = list(bias.parameters()) if bias is not None else []
    dev = x.uih_offsets.device.type
    amp = x.packed[0].dtype == torch.bfloat16

    def prepare() -> Any:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            return hattn.layout(impl, x.uih_offsets, x.cand_offsets, x.uih_times, None,
                                x.num_candidates, x.max_lengths)  # fmt: skip

    def step(lay: Any) -> list[torch.Tensor]:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            out_u, out_c = lay.attend(bias, tuple(uih), tuple(cand), True)
        return fwd_bwd([out_u, out_c], [*uih, *cand, *params], x.douts[:2])

    return Variant(name, prepare, step)


def load_peer(folder: str) -> tuple[Callable | None, str]:
    """(``triton_hstu_mha`` or None, a line saying where it came from or why not)."""
    path = Path(os.environ.get("FREESCALE_PEER") or folder)
    path = path if path.is_absolute() else ROOT / path
    if not (path / "generative_recommenders").is_dir():
        return None, f"peer: no generative_recommenders/ in {path}: peer skipped"
    sys.path.insert(0, str(path))
    try:
        mod = importlib.import_module("generative_recommenders.ops.triton.triton_hstu_attention")
        importlib.import_module("generative_recommenders.common").set_use_runtime_max_seq_len(True)
    except Exception as e:  # a broken peer is reported, not fatal
        return None, f"peer: import from {path} failed ({type(e).__name__}: {e}): peer skipped"
    return mod.triton_hstu_mha, f"peer: triton_hstu_mha from {path} (autotune per length bucket)"


def peer(mha: Callable, x: Inputs) -> Variant:
    q, k, v = leaves(x.packed)
    n = int((x.shape.uih_lengths + x.shape.cand_counts).max())
    targets = x.cand_offsets.diff()
    alpha = q.shape[-1] ** -0.5

    def step(_: Any) -> list[torch.Tensor]:
        return fwd_bwd([mha(n, alpha, q, k, v, x.seq_offsets, targets)], [q, k, v], x.douts[2:])

    return Variant("peer", lambda: None, step, has_layout=False)


# ---- measuring -----------------------------------------------------------------------------
def free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed(v: Variant, dev: str, out: dict[str, Any]) -> None:
    """One layout + fwd + bwd (peak memory, finiteness), then the medians."""
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    state = v.prepare()
    got = v.step(state)
    if dev == "cuda":
        torch.cuda.synchronize()
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    out["finite"] = all(bool(t.isfinite().all()) for t in got)
    got.clear()
    out["ms"] = time_fast(functools.partial(v.step, state), dev)
    state = None  # the layout timing holds one layout at a time, as the measured run did
    out["layout_ms"] = time_fast(v.prepare, dev) if v.has_layout else None


def run_variant(v: Variant, dev: str) -> dict[str, Any]:
    """status (ok, oom, error: ...), ms, layout_ms, peak_gib, finite."""
    out: dict[str, Any] = dict.fromkeys(("ms", "layout_ms", "peak_gib", "finite"))
    out["status"] = "ok"
    free(dev)
    try:
        timed(v, dev, out)
    except torch.OutOfMemoryError:
        out["status"] = "oom"
    except Exception as e:  # one variant failing must not lose the others
        out["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    free(dev)
    return out


def judge(rows: list[dict[str, Any]], ours_name: str, targets: dict[str, float]) -> None:
    """``vs_peer``, ``mem_vs_peer``, ``speed_ok``, ``memory_ok`` of one point's rows."""
    peer_row = next((r for r in rows if r["impl"] == "peer" and r["status"] == "ok"), None)
    for r in rows:
        if r["impl"] == "peer" or peer_row is None:
            continue
        ok = r["status"] == "ok"
        r["vs_peer"] = peer_row["ms"] / r["ms"] if ok else None
        if ok and r["peak_gib"] is not None and peer_row["peak_gib"]:
            r["mem_vs_peer"] = r["peak_gib"] / peer_row["peak_gib"]
        if r["impl"] in (ours_name, f"{ours_name}-nobias"):
            goal = targets["nobias_speedup" if r["impl"].endswith("-nobias") else "bias_speedup"]
            r["speed_ok"] = ok and r["vs_peer"] >= goal
            mem = r.get("mem_vs_peer")
            r["memory_ok"] = (
                False if not ok else None if mem is None else mem <= targets["memory_ratio"]
            )


SHOWN = ("max_uih", "batch", "heads", "head_dim", "lengths", "impl", "status", "ms", "peak_gib",
         "tflops")  # fmt: skip


def point_rows(point: dict[str, Any], x: Inputs, variants: list[Variant], dev: str) -> list[dict]:
    """One row per variant at ``point``."""
    law = point["lengths"] + (f" x{point['scale']}" if point.get("scale", 1) != 1 else "")
    fwd = 4 * point["head_dim"] * point["heads"] * x.shape.pairs
    rows = []
    for v in variants:
        got = run_variant(v, dev)
        tflops = 3.5 * fwd / (got["ms"] * 1e-3) / 1e12 if got["ms"] else None
        rows.append({**point, "lengths": law, "impl": v.name, "point": {**point, "impl": v.name},
                     "tokens": x.packed[0].shape[0], "longest": x.max_lengths[0],
                     "pairs": x.shape.pairs, **got, "tflops": tflops})  # fmt: skip
        print(json.dumps({k: rows[-1][k] for k in SHOWN}), flush=True)
    return rows


def attention(s: Scenario, ctx: Ctx) -> Result:
    p = s.params
    dev = "cuda" if s.device == "cuda" else "cpu"
    dtype = getattr(torch, p.get("dtype", "bfloat16"))
    name, preset = p.get("ours", "fused"), p.get("preset", "h200-21k")
    mha, peer_line = load_peer(p.get("peer", ".peer"))
    print(peer_line, flush=True)
    rows: list[dict[str, Any]] = []
    only = os.environ.get("FREESCALE_HSTU_POINTS")  # "0,3,4": a part of the points (long runs)
    picked = [int(i) for i in only.split(",")] if only else range(len(p["points"]))
    for i in picked:
        point = {"lengths": preset, **p["points"][i]}
        x = make_inputs(jagged(point, preset), point["heads"], point["head_dim"], dtype, dev, i)
        bias = hattn.RelativeBias().to(dev)
        for t in bias.parameters():
            torch.nn.init.normal_(t, std=0.5)
        variants = [ours(name, name, x, bias), ours(f"{name}-nobias", name, x, None)]
        variants += [ours("padded", "padded", x, bias)] if p.get("padded", True) else []
        variants += [peer(mha, x)] if mha is not None and point.get("peer", True) else []
        here = point_rows(point, x, variants, dev)
        judge(here, name, p.get("targets", {}))
        rows += here
        with (ctx.raw / "rows.jsonl").open("a") as f:  # kept if the run is cut short
            f.writelines(json.dumps(r) + "\n" for r in here)
        del x, variants, bias
        free(dev)
    return Result(rows, attention_sections(rows, name, peer_line, p.get("targets", {})))


def _f(v: Any, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def _cell(r: dict | None) -> str:
    if r is None:
        return "–"
    return f"{r['ms']:.3g} ms, {_f(r['peak_gib'])} GiB" if r["status"] == "ok" else r["status"][:40]


def attention_sections(rows: list[dict], name: str, peer_line: str, t: dict) -> list[str]:
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["max_uih"], r["batch"], f"{r['heads']} × {r['head_dim']}", r["lengths"])
        by_point.setdefault(key, {})[r["impl"]] = r
    lines = ["## Side by side", "",
             f"| max UIH | batch | H × d | lengths | {name} | {name} no bias | padded | peer "
             f"| peer / {name} | peer / no bias | {name} TFLOP/s |", "|" + "---|" * 11]  # fmt: skip
    for key, got in by_point.items():
        bias, nob = got.get(name) or {}, got.get(f"{name}-nobias") or {}
        cells = [*key, *(_cell(got.get(k)) for k in (name, f"{name}-nobias", "padded", "peer")),
                 _f(bias.get("vs_peer"), ".2f"), _f(nob.get("vs_peer"), ".2f"),
                 _f(bias.get("tflops"), ".0f")]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return [*lines, "", peer_line, "",
            "TFLOP/s: FlashAttention's counting over the causal pairs the pattern uses: forward "
            "4·d·H·pairs, pairs = Σ L(L+1)/2 + Σ_candidates (L + 1); forward + backward = 3.5 × "
            "forward. ms: median fwd + bwd of `attend` (layout built beforehand; its own median "
            "is `layout_ms`); GiB: peak allocation rise over the inputs during layout + fwd + bwd.",
            "", f"Targets: no bias ≥ {t.get('nobias_speedup')} × the peer's speed, "
            f"with bias ≥ {t.get('bias_speedup')} ×, peak memory ≤ {t.get('memory_ratio')} × "
            "the peer's (`speed_ok`, `memory_ok`: null without a peer); TFLOP/s: the checks.",
            ]  # fmt: skip


# ---- parity --------------------------------------------------------------------------------
def losses(raw: Path, row: dict[str, Any]) -> list[float]:
    lines = [json.loads(x) for x in (raw / row["steps_file"]).read_text().splitlines() if x]
    return [x["loss"] for x in lines if "loss" in x and "step" in x]


def within_spread(cand: list[float], base0: list[float], base1: list[float]) -> dict[str, Any]:
    """The window verdict of the module docstring (equal-length windows of three runs)."""
    m = [statistics.fmean(x) for x in (cand, base0, base1)]
    d = [b - a for a, b in zip(base0, base1, strict=True)]
    margin = 2 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    gap, spread = abs(m[0] - m[1]), abs(m[2] - m[1])
    return {"candidate": m[0], "baseline_s0": m[1], "baseline_s1": m[2], "gap": gap,
            "spread": spread, "margin": margin,
            "within_spread": gap <= spread + margin}  # fmt: skip


def digest(xs: list[float]) -> str:
    return hashlib.sha256(struct.pack(f"{len(xs)}d", *xs)).hexdigest()[:16]


def parity(s: Scenario, ctx: Ctx) -> Result:
    from .train import run_point

    p = s.params
    cand, base = p.get("candidate", "fused"), p.get("baseline", "padded")
    runs = {}
    for att, seed in ((cand, 0), (base, 0), (base, 1)):
        row = run_point(s, {"nproc": 1, "model_attention": att, "seed": seed}, ctx.raw)
        runs[f"{att} seed {seed}"] = (row, losses(ctx.raw, row))
        print(f"{att} seed {seed}: step_ms {row['step_ms']}", flush=True)
    curves = [runs[k][1] for k in (f"{cand} seed 0", f"{base} seed 0", f"{base} seed 1")]
    n, w, last = len(curves[0]), p.get("window", 20), p.get("last", 50)
    spans = [(a, min(a + w, n)) for a in range(0, n, w)] + [(max(0, n - last), n)]
    rows = [{"part": "loss", "run": k, "step_ms": r["step_ms"], "steps": len(xs),
             "loss_mean_last": statistics.fmean(xs[-last:]), "loss_digest": digest(xs)}
            for k, (r, xs) in runs.items()]  # fmt: skip
    for i, (a, b) in enumerate(spans):
        label = f"last {b - a}" if i == len(spans) - 1 else f"{a}-{b - 1}"
        rows.append({"part": "window", "window": label,
                     **within_spread(*(c[a:b] for c in curves))})  # fmt: skip
    modes = dataclasses.replace(s, params={**p, "steps": p.get("mode_steps", 50)},
                                set={**s.set, "deterministic": True})  # fmt: skip
    ref = None
    for mode in p.get("modes", ["sync", "sdd", "freescale"]):
        row = run_point(
            modes, {"nproc": 1, "mode": mode, "model_attention": cand, "seed": 0}, ctx.raw
        )
        xs = losses(ctx.raw, row)
        ref = xs if ref is None else ref
        rows.append({"part": "modes", "run": f"{cand} {mode} deterministic", "mode": mode,
                     "steps": len(xs), "step_ms": row["step_ms"], "loss_digest": digest(xs),
                     "bit_identical": None if xs is ref else xs == ref})  # fmt: skip
    return Result(rows, parity_sections(rows, cand, base))


def parity_sections(rows: list[dict], cand: str, base: str) -> list[str]:
    from .report import table

    return [
        "## Runs", "", *table([r for r in rows if r["part"] != "window"],
                              ["run", "steps", "step_ms", "loss_mean_last", "loss_digest",
                               "bit_identical"]), "",
        f"## Loss windows: {cand} seed 0 against {base} seeds 0 and 1", "",
        f"Within the spread: |{cand} − {base} s0| ≤ |{base} s1 − {base} s0| + 2·sd(s1 − s0 per "
        "step)/√n over the window (the seed spread plus twice the standard error of its own "
        "window mean).", "",
        *table([r for r in rows if r["part"] == "window"],
               ["window", "candidate", "baseline_s0", "baseline_s1", "gap", "spread", "margin",
                "within_spread"]),
        "", "Modes: the first mode is the reference; `bit_identical`: every step's loss equal.",
    ]  # fmt: skip


def measure(s: Scenario, ctx: Ctx) -> Result:
    kind = s.params.get("kind", "attention")
    if kind not in ("attention", "parity"):
        raise ValueError(f"{s.name}: hstu kind must be attention or parity, got {kind!r}")
    return attention(s, ctx) if kind == "attention" else parity(s, ctx)
