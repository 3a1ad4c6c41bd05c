"""Host operations per training step, by stage: a CPU proxy of the launch count.

At small batches the GPU idles because the host cannot launch fast enough
(benchmarks/overhead.py, host_profile.py). Every aten op the host dispatches
costs host time, and on a GPU most become one kernel launch, so the number of
aten ops per step is the quantity to cut; it does not need a GPU to count.

This runs the trainer at world size 1 on the CPU (the demo preset shaped like
the H200 model: dim 256, 4 heads, 4 layers; small table, short UIH), records
``torch.profiler`` CPU events for ``--steps`` steps after warm-up and counts,
per step, the aten ops (top level: no aten op above them, ~ kernel launches;
total: every nested aten op) by the stage that issued them. Stages are
``record_function`` ranges this script wraps around the trainer's stages (the
library is not changed for it): the model's layers, the embedding sections of
`freescale.pipeline.timing` (preflight, ids_a2a, lookup, update, ...), the
guard, the optimizer, the metrics. Ops under autograd's engine are backward
(``bwd/`` + the innermost stage, e.g. ``bwd/emb:update``).

The CPU attention is the per-sample reference (a loop of SDPA calls; one
varlen call per pattern on GPUs), so its group is shown but left out of the
"GPU-like" total.

    python benchmarks/host_ops.py --mode sync
    python benchmarks/host_ops.py --mode freescale --json-only
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

import freescale.embedding.collection as collection_mod
import freescale.embedding.input_dist as input_dist_mod
import freescale.models.sequence as sequence_mod
import freescale.pipeline.train as train_mod
from freescale.pipeline import timing
from freescale.pipeline.config import build_config
from freescale.pipeline.train import Trainer

ATTENTION = "fwd/attention(reference)"  # CPU only: one varlen call per pattern on GPUs
BACKWARD_PREFIX = "autograd::engine::evaluate_function"


def labelled(name: str, fn: Any) -> Any:
    """``fn`` inside a ``record_function(name)`` range."""

    @functools.wraps(fn)
    def run(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function(f"#{name}"):
            return fn(*a, **k)

    return run


def instrument(trainer: Trainer) -> None:
    """Wrap the trainer's stages in named ranges (this process only)."""
    t = trainer
    model = t.model
    for i, block in enumerate(model.blocks):
        block.forward = labelled(f"fwd/block{i}", block.forward)
    model.head.forward = labelled("fwd/head", model.head.forward)
    model.blocks.layouts = labelled("fwd/layout", model.blocks.layouts)
    model.item_emb.forward = labelled("fwd/embedding", model.item_emb.forward)
    model._pool_content = labelled("fwd/pool_content", model._pool_content)
    model.forward = labelled("fwd/model(other)", model.forward)
    t.dense.sync.ddp.forward = labelled("fwd/ddp", t.dense.sync.ddp.forward)
    t.schedule.upcoming = labelled("upcoming(next batch)", t.schedule.upcoming)
    t.schedule.after_forward = labelled("after_forward", t.schedule.after_forward)
    t.schedule.global_count = labelled("global_count", t.schedule.global_count)
    t.schedule.collision_counts = labelled("collision_counts", t.schedule.collision_counts)
    t.sparse.guard.begin_step = labelled("guard.begin_step", t.sparse.guard.begin_step)
    t.optimizer.step = labelled("optimizer.step", t.optimizer.step)
    t.optimizer.zero_grad = labelled("optimizer.zero_grad", t.optimizer.zero_grad)
    t._finish = labelled("metrics.finish(step-1)", t._finish)
    t._train_step = labelled("train_step(other)", t._train_step)
    # Module-level functions the trainer, the model and the collection call by name.
    for module, name, label in (
        (collection_mod, "make_request", "emb/request"),
        (input_dist_mod, "route", "emb/route"),
        (input_dist_mod, "start_preflight", "emb/preflight_start"),
    ):
        setattr(module, name, labelled(label, getattr(module, name)))
    sequence_mod.attend = labelled(ATTENTION, sequence_mod.attend)
    for name, label in (
        ("bce_loss_and_sum", "loss"),
        ("skip_flags", "skip_flags"),
        ("read_later", "metrics.read_later"),
    ):
        setattr(train_mod, name, labelled(label, getattr(train_mod, name)))


def label_sections() -> None:
    """The embedding and pipeline sections (`SectionTimer.section`) as ranges too."""
    original = timing.SectionTimer.section

    @contextlib.contextmanager
    def section(self: timing.SectionTimer, name: str) -> Any:
        with torch.profiler.record_function(f"#emb:{name}"), original(self, name):
            yield

    timing.SectionTimer.section = section  # type: ignore[method-assign]


def own_label(event: Any) -> tuple[str | None, bool, bool]:
    """(innermost stage range, under autograd's engine, top level) above one event."""
    label, backward, top = None, False, True
    parent = event.cpu_parent
    while parent is not None:
        name = parent.name
        if name.startswith("aten::"):
            top = False
        elif name.startswith("#") and label is None:
            label = name[1:]
        elif name.startswith(BACKWARD_PREFIX):
            backward = True
        parent = parent.cpu_parent
    return label, backward, top


def backward_node(event: Any) -> Any:
    """The autograd engine's ``evaluate_function`` range above ``event`` (or None)."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(BACKWARD_PREFIX):
        parent = parent.cpu_parent
    return parent


def grouped(events: Any, main_thread: int) -> list[tuple[str, bool, str]]:
    """(stage, top level, op name) of every aten op. A backward op without a
    stage range of its own takes the stage of the forward op that created its
    autograd node (linked by ``sequence_nr``): ``bwd/<forward stage>``."""
    created: dict[int, str] = {}
    out = []
    for e in events:
        label, backward, top = own_label(e)
        if e.thread != main_thread:
            label = "loader thread"
        label = label or "loop(other)"
        if not backward and e.sequence_nr >= 0:  # aten ops and custom autograd Functions
            created.setdefault(e.sequence_nr, label)
        if e.name.startswith("aten::"):
            out.append((e, label, backward, top))
    result = []
    for e, label, backward, top in out:
        if backward and not label.startswith("emb:"):
            node = backward_node(e)
            kind = node.name[len(BACKWARD_PREFIX) + 2 :] if node is not None else "engine"
            seq = node.sequence_nr if node is not None else -1
            if kind.endswith("CopySlices"):  # numbered right after the in-place op it records
                seq -= 1
            label = created.get(seq, f"unlinked:{kind}")
            if kind.endswith("LookupBackward"):  # the embedding's own backward, outside sections
                label = "emb(other)"
        result.append(("bwd/" + label if backward else label, top, e.name))
    return result


def count_ops(mode: str, steps: int, warm: int, overrides: list[str]) -> dict[str, Any]:
    """Per-step aten op counts by stage for one run of ``mode``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free port: several runs may go in parallel
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    total_steps = warm + 1 + steps + 1  # warm-up, profiler warm-up, active, one to close
    cfg = build_config(
        "demo",
        [
            f"mode={mode}", "nproc=1", "device=cpu", f"steps={total_steps}", "warmup=1",
            "dim=256", "item_dim=256", "heads=4", "layers=4", "batch_size=32",
            "eval_every=0", "progress=false", "loader_workers=0", *overrides,
        ],
    )  # fmt: skip
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        label_sections()
        done: list[Any] = []
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=warm, warmup=1, active=steps, repeat=1),
            on_trace_ready=done.append,
        )
        trainer = Trainer(cfg, profiler=prof)
        instrument(trainer)
        trainer.run()
    finally:
        dist.destroy_process_group()
    events = done[0].events()
    main = Counter(e.thread for e in events if e.name.startswith("#fwd")).most_common(1)[0][0]
    total: Counter[str] = Counter()
    top: Counter[str] = Counter()
    names: dict[str, Counter[str]] = {}
    for group, is_top, name in grouped(events, main):
        total[group] += 1
        top[group] += is_top
        if is_top:
            names.setdefault(group, Counter())[name] += 1
    groups = sorted(total, key=lambda g: -top[g])
    per = {g: {"top": top[g] / steps, "total": total[g] / steps} for g in groups}
    gpu_like = sum(v["top"] for g, v in per.items() if ATTENTION not in g)
    return {
        "mode": mode,
        "steps": steps,
        "groups": per,
        "top": sum(top.values()) / steps,
        "total": sum(total.values()) / steps,
        "top_without_reference_attention": gpu_like,
        "ops": {g: {n: c / steps for n, c in names[g].most_common(12)} for g in names},
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"mode {result['mode']}: aten ops per step (mean of {result['steps']} steps)",
        f"| {'stage':40} | {'top level':>9} | {'total':>8} |",
        f"|{'-' * 42}|{'-' * 11}:|{'-' * 9}:|",
    ]
    for g, v in result["groups"].items():
        lines.append(f"| {g:40} | {v['top']:9.1f} | {v['total']:8.1f} |")
    lines.append(f"| {'ALL':40} | {result['top']:9.1f} | {result['total']:8.1f} |")
    gpu_like = result["top_without_reference_attention"]
    lines.append(f"| {'ALL but the reference attention':40} | {gpu_like:9.1f} | {'':8} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="sync", choices=("sync", "sdd", "freescale"))
    p.add_argument("--steps", type=int, default=4, help="profiled steps")
    p.add_argument("--warm", type=int, default=3, help="steps before profiling")
    p.add_argument("--set", action="append", default=[], help="extra key=value")
    p.add_argument("--json-only", action="store_true")
    p.add_argument("--detail", action="store_true", help="top op names of each stage")
    args = p.parse_args()
    if args.steps < 1 or args.warm < 1:
        print("host_ops: --steps and --warm must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    result = count_ops(args.mode, args.steps, args.warm, args.set)
    ops = result.pop("ops")
    if not args.json_only:
        print(table(result))
    if args.detail:
        for group, counts in ops.items():
            print(f"{group}: " + ", ".join(f"{n[6:]} {c:g}" for n, c in counts.items()))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
