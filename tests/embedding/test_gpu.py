"""GPU checks (run on the GPU machine; skipped without CUDA).

Two simulated ranks on two GPUs (fake backend, one thread per rank): parity with the CPU reference
and bit-identical repeats, which also checks that the duplicate sum and the
scatters are deterministic on CUDA.
"""

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding._ops import sum_duplicates
from freescale.testing.tolerance import random_sum_size, reduction_tol
from tests.embedding._train import parity_tol, reference, train_sharded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per thread-rank)")
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_cuda_parity_and_determinism(optimizer):
    ref = reference(optimizer, 20)
    devices = ["cuda:0", "cuda:1"]
    runs = [run_threads(train_sharded, 2, optimizer, 20, {}, device=devices)[0] for _ in range(2)]
    tol = parity_tol(optimizer, 20, ref["stats"])  # fp32 on CUDA too
    for name, table in ref["tables"].items():
        got = runs[0]["tables"][name]
        torch.testing.assert_close(got["weight"], table["weight"], **tol["weight"])
        for key, value in table["state"].items():
            torch.testing.assert_close(got["state"][key], value, **tol["state"])
            assert torch.equal(got["state"][key], runs[1]["tables"][name]["state"][key])
        assert torch.equal(got["weight"], runs[1]["tables"][name]["weight"])


def test_cuda_duplicate_sum_of_hot_rows_is_reproducible():
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.zeros(200_000, dtype=torch.int64), torch.randint(0, 5000, (50_000,))])
    rows = rows[torch.randperm(rows.numel(), generator=g)].cuda()
    grads = torch.randn(rows.numel(), 64, generator=g).cuda()
    unique, summed = sum_duplicates(rows, grads)
    for _ in range(3):
        assert torch.equal(sum_duplicates(rows, grads)[1], summed)
    expect = torch.zeros(5000, 64, dtype=torch.float64).index_add_(
        0, rows.cpu(), grads.cpu().double()
    )
    # fp32 sums of up to 200,000 randn terms (row 0) against float64 ones.
    terms = int(torch.bincount(rows.cpu()).max())
    tol = reduction_tol(torch.float32, terms, random_sum_size(terms, float(grads.std())))
    torch.testing.assert_close(summed.cpu().double(), expect[unique.cpu()], **tol)


def _store():
    from freescale.embedding.config import TableConfig
    from freescale.embedding.optim import RowwiseAdagrad
    from freescale.embedding.store import ShardStore
    from freescale.kernels.shard import RowSharding

    sizes = (("a", 300_000), ("b", 999))
    tables = [TableConfig(name, rows, 64, torch.float32) for name, rows in sizes]
    shardings = [RowSharding(t.rows, 1) for t in tables]
    return ShardStore(tables, shardings, RowwiseAdagrad(lr=0.05), 0, torch.device("cuda"), seed=3)


def test_cuda_update_on_its_side_stream_equals_it_inline_and_readers_wait(monkeypatch):
    """The fused update runs on a side stream (`ShardStore._apply_fused`): the
    same bits as run on the current stream, and a lookup queued right after
    it, a table view and the state dict see the updated rows."""
    import freescale.embedding.store as store_module

    side, inline = _store(), _store()
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        slots = torch.randint(0, 300_999, (400_000,), generator=g).cuda()
        grads = torch.randn(400_000, 64, generator=g).cuda()
        side.apply_gradients(slots, grads, [0, 1])
        got = side.lookup(slots[:1000])  # queued at once: must wait for the side stream
        monkeypatch.setattr(store_module, "_update_stream", torch.cuda.current_stream)
        inline.apply_gradients(slots, grads, [0, 1])
        monkeypatch.undo()
        assert torch.equal(got, inline.lookup(slots[:1000])), step
        assert torch.equal(side.table_slice(0, side.weight), inline.table_slice(0, inline.weight))
    assert side._update_done is not None
    want = inline.state_dict()
    for key, value in side.state_dict().items():
        assert torch.equal(value, want[key]), key
