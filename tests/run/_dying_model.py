"""A model whose rank dies, for the launcher's liveness tests.

``--set model=tests.run._dying_model:build --set model.die=HOW``, with
``model.die_rank`` (default 1), ``model.die_step`` (the process's training
forward that dies, counted from 0: the step of a run that starts at 0; -1:
while the model is built, before the first step) and
``model.die_attempt`` (only in that torchrun attempt, ``TORCHELASTIC_RESTART_COUNT``;
-1: in any). With ``die`` empty it is the built-in model. HOW:

- ``kill``: SIGKILL itself (an OOM kill);
- ``abort``: ``os.abort()`` (SIGABRT, as a failed C assertion);
- ``segv``: a null pointer read through ctypes (SIGSEGV, as a broken extension);
- ``exit``: ``os._exit(3)`` (a library calling ``exit``).

``FREESCALE_TEST_EXIT_AT_IMPORT=<rank>``: importing this module in that rank
prints a line to stderr and exits with code 1 (the launcher imports it too,
with no RANK set, and goes on). ``FREESCALE_TEST_HANG_AT_IMPORT=1``: every
rank hangs while importing it (ranks that never start).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import torch.distributed as dist
from torch import nn

from freescale import DataSchema
from freescale.models.sequence import SequenceModel
from freescale.models.sequence import build as build_sequence

if os.environ.get("FREESCALE_TEST_EXIT_AT_IMPORT", "x") == os.environ.get("RANK"):
    sys.exit("_dying_model: libexample.so: cannot open shared object file")

if os.environ.get("FREESCALE_TEST_HANG_AT_IMPORT") and os.environ.get("RANK"):
    time.sleep(600)  # a rank that never starts (the launcher's SIGTERM must still end the run)


def die_now(how: str) -> None:
    print(f"_dying_model: rank dies ({how})", file=sys.stderr, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "abort":
        os.abort()
    elif how == "segv":
        ctypes.string_at(0)
    elif how == "exit":
        os._exit(3)
    raise ValueError(f"model.die={how!r}: kill|abort|segv|exit")


class DieAt:
    """A forward pre-hook: the ``at``-th training forward of this process dies."""

    def __init__(self, how: str, at: int) -> None:
        self.how, self.at, self.calls = how, at, 0

    def __call__(self, model: nn.Module, args: object) -> None:
        if model.training:
            if self.calls == self.at:
                die_now(self.how)
            self.calls += 1


def build(
    schema: DataSchema,
    die: str = "",
    die_rank: int = 1,
    die_step: int = 0,
    die_attempt: int = -1,
    **options: object,
) -> SequenceModel:
    """The built-in model (drawn from the same RNG), dying as asked."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    how = die if rank == die_rank and die_attempt in (-1, attempt) else ""
    if how and die_step < 0:
        die_now(how)  # before the first step
    model = build_sequence(schema, **options)
    if how:
        model.register_forward_pre_hook(DieAt(how, die_step))
    return model
