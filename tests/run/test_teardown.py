"""A rank's process groups are freed when its run ends, not at interpreter exit.

Freed at exit (the last garbage collection of a finalizing interpreter), a gloo
worker thread that drops a finished collective's tensors cannot take the GIL
and the rank dies by SIGABRT after its work is done ("terminate called without
an active exception"; seen in 2 of ~275 two-rank CLI runs on a loaded 2-core
machine, torch 2.13). Run in a child process: a group of this test's own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import os, tempfile, time
    import torch.distributed as dist
    from freescale.comm.torch_backend import end_process_groups

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)

    class Holder:  # a trainer's reference cycle around its groups
        pass

    holder = Holder()
    holder.me, holder.groups = holder, [dist.group.WORLD, dist.new_group(backend="gloo")]
    del holder
    during = threads()
    {end}
    time.sleep(0.2)
    print(before, during, threads())
    """
)


def _threads(end: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(end=end)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [int(n) for n in done.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_ending_the_groups_joins_their_threads_while_the_interpreter_is_whole():
    before, during, after = _threads("end_process_groups()")
    assert during > before  # the groups' worker threads (the check can fail)
    assert after == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_destroy_alone_leaves_them_to_the_exit():
    """Why `end_process_groups` collects: torch's destroy only forgets them."""
    before, during, after = _threads("dist.destroy_process_group()")
    assert after == during > before
