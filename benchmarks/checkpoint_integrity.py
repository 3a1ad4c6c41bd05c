"""What a checkpoint's integrity checks cost on the h200-21k tables.

A row-wise table of ``--rows`` x ``--dim`` fp32 (h200-21k: 10 M x 256, 10.2 GB)
and its row-wise Adagrad state (one fp32 per row) are written as one rank
writes them (`freescale.pipeline.checkpoint.Checkpointer.save`: DCP tables,
plain ``.pt`` files, then the SHA-256 of every file into the manifest), and
checked as a resume checks them (`freescale.pipeline.checkpoint_files.read_checked`:
sizes, SHA-256 of every file, the tables' index and chunk pickles, the plain
loads). Timed:

- save: all of ``Checkpointer.save``; hash: its digest step alone (the files
  were just written, so mostly in the page cache);
- verify, cold: after evicting the files from the page cache
  (``posix_fadvise(DONTNEED)``), as on a fresh resume; verify, warm: again;
- sha256 in memory: the hashing speed without any disk;
- load (``--load``; it holds the table twice, 2 x 10 GB at full size): the
  restore itself, checks included, for scale.

One process. With W ranks each hashes about 1/W of the bytes at save and at
the ranks' check; the launcher's check (before the ranks start) hashes all.

    PYTHONPATH=. python benchmarks/checkpoint_integrity.py                 # 10 M rows
    PYTHONPATH=. python benchmarks/checkpoint_integrity.py --rows 1000000 --load
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

from freescale.pipeline.checkpoint import Checkpointer, read_manifest
from freescale.pipeline.checkpoint_files import MANIFEST, list_files, read_checked


class RowwiseTable(nn.Module):
    """The bytes the trainer's table checkpoint holds: weights and per-row Adagrad state."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.empty(rows, dim).normal_(generator=gen), False)
        self.register_buffer("sum_sq", torch.rand(rows, generator=gen))


def _evict(directory: Path) -> None:
    """Drop the checkpoint's pages from the page cache (they are clean: fsynced)."""
    for name in [*list_files(directory), MANIFEST]:
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def _verify(path: Path) -> None:
    manifest = read_manifest(path)
    read_checked(path, manifest, [0], manifest["files"])


def _sha256_gbps(nbytes: int = 1 << 30) -> float:
    data = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - start) / 1e9


def _machine() -> tuple[str, str]:
    """(short name for the file, one line describing it)."""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"cpu{os.cpu_count()}", f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--dir", default="/tmp/freescale-checkpoint-integrity")
    p.add_argument("--load", action="store_true", help="also time the restore (2x memory)")
    p.add_argument("--out", default="", help="report path (default: benchmarks/results/...)")
    args = p.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    times: dict[str, float] = {}
    try:
        (tables, times["init"]) = _timed(RowwiseTable, args.rows, args.dim)
        dense = nn.Linear(8, 1)
        replicated = {"model": dense, "optimizer": torch.optim.Adam(dense.parameters())}
        checkpoints = Checkpointer(str(work), every=1, keep=1, config={"steps": 1})
        digest = checkpoints._digests

        def timed_digests(directory: Path) -> dict:
            out, times["hash"] = _timed(digest, directory)
            return out

        checkpoints._digests = timed_digests  # type: ignore[method-assign]
        path, times["save"] = _timed(checkpoints.save, 1, tables, replicated, 0)
        files = list_files(path)
        nbytes = sum(files.values())
        _evict(path)
        _, times["verify_cold"] = _timed(_verify, path)
        _, times["verify_warm"] = _timed(_verify, path)
        if args.load:
            _, times["load"] = _timed(checkpoints.load, path, tables, replicated)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gbps = _sha256_gbps()
    short, machine = _machine()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    gb = nbytes / 1e9
    rows = [
        ("save (Checkpointer.save, all of it)", times["save"]),
        ("  of which hash (SHA-256 of every file)", times["hash"]),
        ("verify, cold page cache (launcher check)", times["verify_cold"]),
        ("verify, warm page cache", times["verify_warm"]),
    ]
    if "load" in times:
        rows.append(("load (Checkpointer.load, checks included)", times["load"]))
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    command = f"{env}python " + " ".join(sys.argv)
    lines = [
        f"# Checkpoint integrity cost, {args.rows:,} rows x {args.dim} fp32 + row-wise Adagrad",
        "",
        f"- machine: {machine}; disk: {work.parent} ({_fs(work.parent)})",
        f"- date: {date.today()}; commit: {commit}",
        f"- command: `{command}`",
        f"- checkpoint: {gb:.2f} GB in {len(files) + 1} files; sha256 in memory: {gbps:.2f} GB/s",
        "",
        "| step | s | GB/s |",
        "|---|---:|---:|",
        *(f"| {name} | {s:.2f} | {gb / s:.2f} |" for name, s in rows),
        "",
        f"Hashing at save adds {100 * times['hash'] / (times['save'] - times['hash']):.0f}% to"
        " the save without it; with W ranks each hashes about 1/W of the bytes.",
    ]
    report = Path(args.out or f"benchmarks/results/checkpoint-integrity-{short}-{date.today()}"
                  f"-{commit}.md")  # fmt: skip
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    result = {"rows": args.rows, "dim": args.dim, "bytes": nbytes, "seconds": times}
    print(json.dumps({**result, "sha256_gbps_memory": gbps, "report": str(report)}))
    return 0


def _fs(directory: Path) -> str:
    out = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True).stdout
    parts = out.splitlines()[-1].split() if out else []
    return f"{parts[1]} on {parts[0]}" if len(parts) > 1 else "unknown filesystem"


if __name__ == "__main__":
    sys.exit(main())
