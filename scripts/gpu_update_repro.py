"""Is the CUDA sparse update bitwise reproducible? Two identical runs of the same
four Row-wise Adagrad steps (400k ids over a 301k-row store, as in
tests/embedding/test_gpu.py), inline on the current stream, compared row by row;
float temporaries are poisoned with NaN in the second run (an unwritten read
would show as NaN rows). Found 2026-12-02 on an H200: no NaN, but 1 row
differed (see docs/LOG.md, session 11). Run on a GPU from the repository root:

    PYTHONPATH=. python3 scripts/gpu_update_repro.py
"""

import sys

import torch

sys.path.insert(0, ".")
import freescale.embedding.store as sm
from tests.embedding.test_gpu import _store

real_empty = torch.empty


def poisoned(*a, **k):
    t = real_empty(*a, **k)
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


def run(poison, steps=4, seed=0, inline=True):
    st = _store()
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        slots = torch.randint(0, 300_999, (400_000,), generator=g).cuda()
        grads = torch.randn(400_000, 64, generator=g).cuda()
        if inline:
            sm._update_stream = torch.cuda.current_stream
        if poison:
            torch.empty = poisoned
        try:
            st.apply_gradients(slots, grads, [0, 1])
        finally:
            torch.empty = real_empty
        torch.cuda.synchronize()
        w = st.weight
        print(
            f"poison={poison} step {step}: nan rows {int(torch.isnan(w).any(1).sum())}", flush=True
        )
    return st.weight.clone()


a = run(False)
b = run(True)
print("equal ignoring poison:", torch.equal(a, b))
d = (a != b).any(1).nonzero().flatten()
print("rows differing", d.numel(), d[:10].tolist())
