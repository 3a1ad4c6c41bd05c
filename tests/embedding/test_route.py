"""`route` at one rank skips the sort: the same send buffer and plan as sorting."""

import pytest
import torch

from freescale.embedding import TableConfig
from freescale.embedding.lookup import route
from freescale.embedding.optim import SGD
from freescale.embedding.preflight import make_request
from freescale.embedding.sharding import RowSharding
from freescale.embedding.store import ShardStore
from freescale.kernels import ranged_dispatch


@pytest.mark.parametrize("sizes", [(5, 0, 7), (0,), (1, 300)])
def test_one_rank_route_equals_the_sorted_dispatch(sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    tables = [TableConfig(f"t{i}", 50 + 10 * i, 4) for i in range(len(sizes))]
    shardings = [RowSharding(t.rows, 1, "hashed", 3) for t in tables]
    store = ShardStore(tables, shardings, SGD(lr=0.1), 0, torch.device("cpu"), 0)
    requests = [
        make_request(t.name, t, 0, i, torch.randint(0, t.rows, (n,), generator=g), None, "cpu")
        for i, (t, n) in enumerate(zip(tables, sizes, strict=True))
    ]
    call = route(store, requests, 1)
    slots = torch.cat([q.ids + store.starts[q.slot_table] for q in requests])
    send, plan = ranged_dispatch(slots, torch.zeros_like(slots), 1)
    assert torch.equal(call.send_slots, send)
    for name in ("counts", "offsets", "positions"):
        assert torch.equal(getattr(call.plan, name), getattr(plan, name)), name
