"""`ShardStore` bookkeeping of its side-stream update (CPU: the event is a stand-in)."""

import copy
import io
import threading

import torch

from freescale.embedding.config import TableConfig
from freescale.embedding.optim import RowwiseAdagrad
from freescale.embedding.store import ShardStore
from freescale.kernels.shard import RowSharding


def _store() -> ShardStore:
    tables = [TableConfig("a", 100, 8, torch.float32)]
    sharding = [RowSharding(100, 1)]
    return ShardStore(tables, sharding, RowwiseAdagrad(lr=0.05), 0, torch.device("cpu"))


def test_copies_pickles_and_moves_leave_the_update_event_behind():
    """A CUDA event can be neither pickled nor copied, and one of the old device
    means nothing after a move: deep copies, ``torch.save`` and ``.to()`` drop it."""
    store = _store()
    store._update_done = threading.Lock()  # unpicklable, as a torch.cuda.Event
    clone = copy.deepcopy(store)
    assert clone._update_done is None and torch.equal(clone.weight, store.weight)
    torch.save(store, io.BytesIO())
    assert store._update_done is not None  # the original keeps it until it moves
    store.to(torch.float64)
    assert store._update_done is None and store.weight.dtype == torch.float64
    store.join_update()  # no event: nothing to wait for
