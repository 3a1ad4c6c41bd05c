"""`sync_debug`'s wait timing, on the CPU with a stand-in for a CUDA event."""

import types

import pytest
import torch

from freescale.jagged.ops import wait_for_copy
from freescale.observe import sync_debug
from freescale.observe.sync_debug import MIN_WAIT_S, timed_waits


class _PendingCopy:
    """A copy whose event is not done yet: ``wait_for_copy`` synchronizes it."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        torch.cuda.Event.synchronize(self)  # the (timed) class method, as a real event


@pytest.mark.parametrize("wait_s, counted", [(4 * MIN_WAIT_S, True), (MIN_WAIT_S / 2, False)])
def test_timed_waits_names_the_call_site_and_restores_synchronize(monkeypatch, wait_s, counted):
    # A fake clock that only the stand-in synchronize advances: no real timing.
    clock = [0.0]
    monkeypatch.setattr(sync_debug, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def synchronize(self) -> None:
        clock[0] += wait_s

    monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)
    with timed_waits() as waits:
        assert torch.cuda.Event.synchronize is not synchronize
        wait_for_copy(_PendingCopy(), "sync_debug test")
        wait_for_copy(_PendingCopy(), "sync_debug test")
    assert torch.cuda.Event.synchronize is synchronize
    if not counted:  # below MIN_WAIT_S: bookkeeping, not a wait
        assert waits == {}
        return
    [(site, (count, total))] = waits.items()
    assert site.startswith("jagged/ops.py:") and "wait_for_copy" in site
    assert count == 2 and total == pytest.approx(2 * wait_s)
