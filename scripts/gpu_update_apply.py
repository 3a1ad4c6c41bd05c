"""Which launch of the update's apply kernel is not reproducible? (GPU only.)

`scripts/gpu_update_repro.py` found the piece sums reproducible and equal to a
float32 reference, but `_apply_kernel` run twice from equal copies gave a
different row in ~5 % of trials (H200, 2026-12-03). This repeats the apply
per optimizer kind and warp count and describes the first differing row.

    PYTHONPATH=. python3 scripts/gpu_update_apply.py [TRIALS [KIND:WARPS ...]]
"""

import sys

import torch

from freescale.kernels import triton_update as tu
from scripts.gpu_update_repro import ROWS, D, N, sums


def apply(sorted_slots, partial, weight, s1, s2, kind, warps):
    tu._apply_kernel[(N,)](
        sorted_slots, N, sorted_slots, 0, sorted_slots, partial, weight, s1, s2,
        partial, partial, partial, sorted_slots, 0, 0.05, 0.9, 0.99, 1e-8, 0.9, 0.999, 0.0,
        D, float(D), KIND=kind, DECAY=0, PER_ROW=False, SKIP=False, CHUNK=tu.CHUNK,
        BLOCK_D=D, FAN=tu.fan(D), num_warps=warps,
    )  # fmt: skip


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    cases = [tuple(int(x) for x in c.split(":")) for c in sys.argv[2:]]
    dev = torch.device("cuda")
    for kind, warps in cases or [(k, w) for k in (0, 1, 2) for w in (1, 2, 4)]:
        bad, note = 0, ""
        for trial in range(trials):
            g = torch.Generator().manual_seed(trial)
            slots = torch.randint(0, ROWS, (N,), generator=g).to(dev)
            grads = torch.randn(N, D, generator=g).to(dev)
            sorted_slots, order = torch.sort(slots.to(torch.int32), stable=True)
            p = sums(sorted_slots, order, grads, 0.0)
            w0 = torch.randn(ROWS, D, generator=g).to(dev)
            shape = (ROWS,) if kind == 1 else (ROWS, D)
            a0, b0 = torch.rand(shape, generator=g).to(dev), torch.rand(ROWS, D).to(dev)
            outs = []
            for _ in range(2):
                w, a, b = w0.clone(), a0.clone(), b0.clone()
                apply(sorted_slots, p, w, a, b, kind, warps)
                outs.append((w, a, b))
            (w1, a1, b1), (w2, a2, b2) = outs
            if torch.equal(w1, w2) and torch.equal(a1, a2) and torch.equal(b1, b2):
                continue
            bad += 1
            if not note:
                rows = (w1 != w2).any(1).nonzero().flatten()
                r = int(rows[0]) if rows.numel() else -1
                if r >= 0:
                    cols = (w1[r] != w2[r]).nonzero().flatten().tolist()
                    st = (a1[r] != a2[r]).sum().item()
                    note = (
                        f"trial {trial}: {rows.numel()} rows, row {r}: cols {cols[:8]} "
                        f"({len(cols)} of {D}), state elems differing {st}, "
                        f"w1-w2 max {float((w1[r] - w2[r]).abs().max()):.3g}"
                    )
                else:
                    note = f"trial {trial}: weights equal, state differs"
        print(f"kind {kind} warps {warps}: {bad}/{trials} trials differ  {note}", flush=True)


if __name__ == "__main__":
    main()
