"""A profiler trace of chosen steps, from the ``output`` section."""

from __future__ import annotations

from typing import Any

import torch

from freescale.config import OutputSection, trace_window


def make_profiler(section: OutputSection, rank: int, device: torch.device) -> Any:
    """A started ``torch.profiler`` over ``trace_steps`` writing ``trace_path``
    (one file per rank); None when no trace is asked for. Call ``.step()``
    after each step and ``.stop()`` at the end."""
    if not section.trace_path:
        return None
    first, last = trace_window(section.trace_steps or "2-3")
    path = section.trace_path.replace("{rank}", str(rank))
    if rank and "{rank}" not in section.trace_path:  # one file per rank
        stem, dot, ext = path.partition(".json")
        path = f"{stem}.rank{rank}{dot}{ext}"

    def save(prof: Any) -> None:
        prof.export_chrome_trace(path)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities,
        # The step before the window warms the profiler up: the first traced
        # step otherwise carries its start-up cost (idle % of 40+ vs ~20).
        schedule=torch.profiler.schedule(
            wait=max(first - 1, 0), warmup=min(first, 1), active=last - first + 1, repeat=1
        ),
        on_trace_ready=save,
    )
    prof.start()
    return prof
