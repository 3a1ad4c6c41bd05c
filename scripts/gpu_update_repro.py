"""Where is the CUDA sparse update not bitwise reproducible? (GPU only.)

Session 11 saw one row of four Row-wise Adagrad steps differ between two
identical runs (400k ids over a 301k-row store; docs/LOG.md). This runs the
two stages of `freescale.kernels.triton_update` separately on fresh random
inputs, many times, and counts per stage:

- ``sums``: `_piece_sums_kernel` twice on the same inputs; the piece sums at
  every run start equal each other and a torch reference (the same float32
  additions in position order);
- ``apply``: `_apply_kernel` twice from equal copies of weights and state;
- ``full``: `sparse_update` twice, the way the store calls it.

The first mismatch of each stage is printed with its run's positions and
programs. Run from the repository root on a GPU:

    PYTHONPATH=. python3 scripts/gpu_update_repro.py [TRIALS]
"""

import os
import sys

import torch

from freescale.kernels import triton_update as tu

N, ROWS, D = (int(x) for x in os.environ.get("REPRO_SHAPE", "400000,301000,64").split(","))


def piece_reference(sorted_slots, order, grads):
    """Sequential float32 sums of each run (every run here is shorter than CHUNK)."""
    n = sorted_slots.numel()
    starts = torch.ones(n, dtype=torch.bool, device=grads.device)
    starts[1:] = sorted_slots[1:] != sorted_slots[:-1]
    first = starts.nonzero().flatten()
    ends = torch.cat([first[1:], torch.tensor([n], device=grads.device)])
    lengths = ends - first
    assert int(lengths.max()) < tu.CHUNK, "a run spans two pieces: reference needs pieces"
    acc = torch.zeros(first.numel(), grads.shape[1], dtype=torch.float32, device=grads.device)
    for j in range(int(lengths.max())):
        live = lengths > j
        pos = (first + j).clamp(max=n - 1)
        acc = torch.where(live[:, None], acc + grads[order[pos]].float(), acc)
    return first, acc


def sums(sorted_slots, order, grads, fill):
    partial = torch.full((N, D), fill, dtype=torch.float32, device=grads.device)
    tu._piece_sums_kernel[(tu.cdiv(N, tu.CHUNK),)](
        order, sorted_slots, grads, partial, N, D, CHUNK=tu.CHUNK, BLOCK_D=D
    )
    return partial


def apply(sorted_slots, partial, weight, state):
    tu._apply_kernel[(N,)](
        sorted_slots, N, sorted_slots, 0, sorted_slots, partial, weight, state, weight,
        partial, partial, partial, sorted_slots, 0, 0.05, 1.0, 1.0, 1e-8, 0.0, 0.0, 0.0,
        D, float(D), KIND=1, DECAY=0, PER_ROW=False, SKIP=False, CHUNK=tu.CHUNK,
        BLOCK_D=D, FAN=tu.fan(D),
    )  # fmt: skip


def describe(stage, trial, sorted_slots, pos):
    pos = int(pos)
    row = int(sorted_slots[pos])
    lo, hi = pos, pos
    while lo > 0 and int(sorted_slots[lo - 1]) == row:
        lo -= 1
    while hi + 1 < N and int(sorted_slots[hi + 1]) == row:
        hi += 1
    print(
        f"  first {stage} mismatch, trial {trial}: row {row}, run positions {lo}..{hi} "
        f"(piece programs {lo // tu.CHUNK}..{hi // tu.CHUNK})",
        flush=True,
    )


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":  # a CPU dry run of this script
        from tests.kernels.conftest import _fix_interpreter_loop_bounds

        _fix_interpreter_loop_bounds()
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = {"sums-twice": 0, "sums-vs-ref": 0, "apply": 0, "full": 0}
    shown = set()
    for trial in range(trials):
        g = torch.Generator().manual_seed(trial)
        slots = torch.randint(0, ROWS, (N,), generator=g).to(dev)
        grads = torch.randn(N, D, generator=g).to(dev)
        sorted_slots, order = torch.sort(slots.to(torch.int32), stable=True)
        p1 = sums(sorted_slots, order, grads, float("nan"))
        p2 = sums(sorted_slots, order, grads, 0.0)
        first, ref = piece_reference(sorted_slots, order, grads)
        a, b, r = p1[first], p2[first], ref
        diff = (a != b).any(1)
        if diff.any():
            bad["sums-twice"] += 1
            if "sums-twice" not in shown:
                shown.add("sums-twice")
                describe("sums-twice", trial, sorted_slots, first[diff.nonzero()[0, 0]])
        diff = (a != r).any(1)
        if diff.any():
            bad["sums-vs-ref"] += 1
            if "sums-vs-ref" not in shown:
                shown.add("sums-vs-ref")
                describe("sums-vs-ref", trial, sorted_slots, first[diff.nonzero()[0, 0]])
        w0 = torch.randn(ROWS, D, generator=g).to(dev)
        s0 = torch.rand(ROWS, generator=g).to(dev)
        w1, s1, w2, s2 = w0.clone(), s0.clone(), w0.clone(), s0.clone()
        apply(sorted_slots, p1, w1, s1)
        apply(sorted_slots, p1, w2, s2)
        if not (torch.equal(w1, w2) and torch.equal(s1, s2)):
            bad["apply"] += 1
            if "apply" not in shown:
                shown.add("apply")
                rows = (w1 != w2).any(1).nonzero().flatten()
                print(f"  first apply mismatch, trial {trial}: rows {rows[:5].tolist()}")
        w1, s1, w2, s2 = w0.clone(), s0.clone(), w0.clone(), s0.clone()
        for w, s in ((w1, s1), (w2, s2)):
            tu.sparse_update(w, [s], slots, grads, "rowwise_adagrad", 0.05, (1.0, 1.0), eps=1e-8)
        if not (torch.equal(w1, w2) and torch.equal(s1, s2)):
            bad["full"] += 1
            if "full" not in shown:
                shown.add("full")
                rows = (w1 != w2).any(1).nonzero().flatten()
                print(f"  first full mismatch, trial {trial}: rows {rows[:5].tolist()}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"trials {trials}: trials with a mismatch per stage: {bad}", flush=True)


if __name__ == "__main__":
    main()
