"""Host data path speed for file data at long UIHs, on one CPU core.

Writes a SASRec file with long histories (lognormal, median 4,500, cap
21,000: the shape of the paper's Fig. 2), then times on one core (affinity
and torch threads pinned): reading and splitting the file, and building
local batches (sample + collate) at max UIH 21,000, batch 128, with pinning
and the host-to-device copy when a GPU is present. Compares samples/s with a
given GPU step rate (default: the 1-H200 h200-21k step, 181 ms at batch 128).

    python benchmarks/loader_speed.py --users 600 --batches 20
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from freescale.data import SequenceSampling, SequenceSource, read_sasrec


def write_file(path: Path, users: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(np.exp(np.log(4500) + 0.55 * rng.standard_normal(users))), 4, 21000)
    with path.open("w") as f:
        for u, n in enumerate(lengths.astype(int)):
            items = rng.zipf(1.1, n) % 1_000_000
            f.write("".join(f"{u} {i}\n" for i in items))
    return int(lengths.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=600)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--max-uih", type=int, default=21000)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--gpu-step-ms", type=float, default=181.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long.txt"
        interactions = write_file(path, args.users, args.seed)
        t0 = time.perf_counter()
        ds = read_sasrec(path)
        t1 = time.perf_counter()
    sampling = SequenceSampling(max_uih=args.max_uih, samples_per_user=0, shuffle=True)
    src = SequenceSource(ds, sampling)
    t2 = time.perf_counter()
    src.batch(0, 0, 1, args.batch)  # the epoch permutation
    times, tokens = [], 0
    for step in range(1, args.batches + 1):
        start = time.perf_counter()
        b = src.batch(step, 0, 1, args.batch)
        if cuda:
            b = b.pin_memory().to("cuda", non_blocking=True)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        tokens += int(b.uih_lengths().sum())
    per_batch = float(np.median(times))
    rate = args.batch / per_batch
    gpu_rate = args.batch / (args.gpu_step_ms / 1000)
    out = {
        "interactions": interactions,
        "users": len(ds.users),
        "train_samples": len(src),
        "read_s": t1 - t0,
        "read_interactions_per_s": interactions / (t1 - t0),
        "split_s": t2 - t1,
        "batch_ms_median": 1000 * per_batch,
        "mean_uih": tokens / (args.batch * args.batches),
        "loader_samples_per_s": rate,
        "pin_and_copy": cuda,
        "gpu_samples_per_s": gpu_rate,
        "loader_over_gpu": rate / gpu_rate,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
