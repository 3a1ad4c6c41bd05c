"""Tables and optimizer state in ``model.state_dict()``, in logical row order.

Our row assignment is a hash: a rank's slots are not a contiguous block of
the table. A checkpoint that another world size can read must not depend on
it, so each table is presented as a global ``[rows, ...]`` tensor sharded in
*contiguous* chunks: a ``DTensor`` with ``Shard(0)`` placement (rank k holds
rows ``[k*c, (k+1)*c)``, ``c = ceil(rows / W)``, as ``torch.chunk`` cuts).
Saving moves every row from its owner to its chunk (one AllToAll per
tensor, `to_row_chunks`), loading moves it back (`from_row_chunks`), so
``torch.distributed.checkpoint`` reshards between any world sizes.

Without an initialized ``torch.distributed`` (thread-simulated ranks) the
entries are whole tables (gathered, a collective). Loading accepts either: a
plain ``[rows, ...]`` tensor (e.g. an unsharded model's weight) is sliced.

Being collectives, saving (and loading sharded entries) first checks that
every rank called it (`rank_agreement.agree`): one rank alone gets a
RuntimeError within seconds instead of a hang until the group's timeout.

Keys, under a swapped module's path: ``<table>.weight``,
``<table>.optimizer.<state>`` (e.g. Adagrad's ``sum_sq``) and
``<table>.optimizer.step`` (updates received; drives lr hooks and Adam).
A dynamic table's rows are keyed by id instead, its map beside them
(`freescale.embedding.state.dynamic_entries`).
`save_copies` / `load_copies` write and read the same ``<table>.weight``
entries for copies of the stores' rows, kept apart from the live tables.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding.rank_agreement import agree
from freescale.embedding.state.dynamic_entries import load_dynamic, save_dynamic
from freescale.kernels.shard import RowSharding

if TYPE_CHECKING:
    from freescale.embedding.collection import ShardedEmbeddingCollection
    from freescale.embedding.store import ShardStore


def chunk_bounds(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``rank``'s contiguous chunk (``torch.chunk`` sizes)."""
    c = -(-rows // world_size)
    return min(rank * c, rows), min((rank + 1) * c, rows)


def _chunk_of(ids: Tensor, rows: int, world_size: int) -> Tensor:
    return torch.div(ids, -(-rows // world_size), rounding_mode="floor")


def to_row_chunks(sharding: RowSharding, comm: Communicator, local: Tensor) -> Tensor:
    """This rank's contiguous chunk of the table whose owned slots are ``local``."""
    w, rank = comm.world_size, comm.rank
    gids = sharding.global_ids(rank, local.device)
    slots = torch.nonzero(gids >= 0).flatten()
    slots = slots[torch.argsort(gids[slots])]  # ascending ids: chunks are contiguous runs
    send_counts = torch.bincount(_chunk_of(gids[slots], sharding.rows, w), minlength=w)
    lo, hi = chunk_bounds(sharding.rows, w, rank)
    # Every rank can route every id: the ids each source sends us, in its order.
    recv_ids = []
    for src in range(w):
        ids = sharding.global_ids(src, local.device)
        recv_ids.append(torch.sort(ids[(ids >= lo) & (ids < hi)]).values)
    recv = torch.cat(recv_ids)
    counts = [int(r.numel()) for r in recv_ids]
    got = comm.all_to_all_v(local[slots].contiguous(), send_counts.tolist(), counts).wait()
    chunk = local.new_zeros((hi - lo, *local.shape[1:]))
    chunk[recv - lo] = got
    return chunk


def from_row_chunks(sharding: RowSharding, comm: Communicator, chunk: Tensor) -> Tensor:
    """Inverse of `to_row_chunks`: this rank's slots (padding slots zero)."""
    w, rank = comm.world_size, comm.rank
    lo, hi = chunk_bounds(sharding.rows, w, rank)
    if chunk.shape[0] != hi - lo:
        raise ValueError(f"chunk of rank {rank} has {chunk.shape[0]} rows, expected {hi - lo}")
    ids = torch.arange(lo, hi, dtype=torch.int64, device=chunk.device)
    owner, _ = sharding.locate(ids)
    order = torch.argsort(owner, stable=True)  # by owner, ascending ids within
    send_counts = torch.bincount(owner, minlength=w)
    mine = sharding.global_ids(rank, chunk.device)
    mine = torch.sort(mine[mine >= 0]).values
    recv_counts = torch.bincount(_chunk_of(mine, sharding.rows, w), minlength=w)
    got = comm.all_to_all_v(
        chunk[order].contiguous(), send_counts.tolist(), recv_counts.tolist()
    ).wait()
    local = chunk.new_zeros((sharding.local_rows, *chunk.shape[1:]))
    local[sharding.locate(mine)[1]] = got
    return local


# ---- DTensor presentation ---------------------------------------------------------
def _process_group(comm: Communicator) -> Any:
    """The torch process group of ``comm``, or None (simulated ranks)."""
    group = getattr(comm, "group", False)
    if group is False or not dist.is_available() or not dist.is_initialized():
        return None
    return group if group is not None else dist.group.WORLD


def _agree(comm: Communicator, what: str) -> None:
    """`agree` over ``comm``'s torch process group; nothing for other transports
    (thread-simulated ranks; smfree fails a silent peer by its own timeout)."""
    group = _process_group(comm)
    if group is not None:
        agree(group, what)


def _as_global(sharding: RowSharding, comm: Communicator, local: Tensor, gather: Any) -> Tensor:
    group = _process_group(comm)
    if group is None:
        return gather(local)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    chunk = to_row_chunks(sharding, comm, local)
    mesh = DeviceMesh.from_group(group, local.device.type)
    shape = torch.Size((sharding.rows, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(chunk, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _to_local(
    sharding: RowSharding, comm: Communicator, src: Tensor, key: str, errors: list[str]
) -> Tensor | None:
    """This rank's slots of a saved global tensor (DTensor or plain), or None (error)."""
    from torch.distributed.tensor import DTensor, Shard

    if src.shape[0] != sharding.rows:
        errors.append(f"{key}: saved with {src.shape[0]} rows, the table has {sharding.rows}")
        return None
    if isinstance(src, DTensor):
        if tuple(src.placements) == (Shard(0),) and src.device_mesh.size() == comm.world_size:
            return from_row_chunks(sharding, comm, src.to_local())
        src = src.full_tensor()  # another layout: a collective, then slice
    ids = sharding.global_ids(comm.rank, src.device)
    local = src.new_zeros((sharding.local_rows, *src.shape[1:]))
    valid = ids >= 0
    local[valid] = src[ids[valid]]
    return local


# ---- module hooks ------------------------------------------------------------------
def save_tables(
    collection: ShardedEmbeddingCollection,
    tables: Mapping[str, str],
    prefix: str,
    destination: dict,
    weights: bool = True,
    comm: Communicator | None = None,
) -> None:
    """Write ``tables`` ({local name: collection table}) under ``prefix`` (a collective);
    ``weights=False`` writes the optimizer state only. Nothing inside
    ``collection.tables_left_out()``. ``comm``: the exchanges' communicator
    (default the collection's; same ranks)."""
    if not collection.tables_in_state_dict:
        return
    comm = comm or collection.comm
    _agree(comm, f"state_dict() of the tables under {prefix!r}")
    collection.flush()
    for local_name, name in tables.items():
        base = prefix + (local_name + "." if local_name else "")
        store, t = collection._locate(name)
        step = torch.tensor(collection.step_of(name))
        if store.dynamic is not None:  # rows keyed by id, the map beside them
            before = collection.mode.lookahead_mapped()  # as a synchronous run has it
            save_dynamic(store, base, destination, weights, comm, _process_group(comm), before)
            destination[base + "optimizer.step"] = step
            continue
        sharding = store.shardings[t]

        def gather(x: Tensor, name: str = name) -> Tensor:
            return collection._gather(name, x)

        named = _named(store, weights)
        for key, tensor in named.items():
            local = store.table_slice(t, tensor).detach()
            destination[base + key] = _as_global(sharding, comm, local, gather)
        destination[base + "optimizer.step"] = step


def load_tables(
    collection: ShardedEmbeddingCollection,
    tables: Mapping[str, str],
    prefix: str,
    state_dict: Mapping[str, Any],
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
    weights: bool = True,
    comm: Communicator | None = None,
) -> None:
    """Read what `save_tables` wrote (or whole plain tables) back into the collection;
    nothing inside ``collection.tables_left_out()``. ``comm`` as in `save_tables`."""
    from torch.distributed.tensor import DTensor

    if not collection.tables_in_state_dict:
        return
    collection.mode.check_load()
    comm = comm or collection.comm
    if any(isinstance(v, DTensor) for k, v in state_dict.items() if k.startswith(prefix)):
        _agree(comm, f"load_state_dict() of sharded tables under {prefix!r}")
    collection.flush()
    ours: set[str] = set()
    for local_name, name in tables.items():
        base = prefix + (local_name + "." if local_name else "")
        store, t = collection._locate(name)
        ours.add(base + "optimizer.step")
        if store.dynamic is not None:
            ours |= load_dynamic(store, base, state_dict, weights, comm, missing_keys, error_msgs)
            named = {}
        else:
            named = _named(store, weights)
            ours.update(base + k for k in named)
        for key, target in named.items():
            if base + key not in state_dict:
                missing_keys.append(base + key)
                continue
            src = state_dict[base + key]
            _load_tensor(comm, store, t, target, src, base + key, error_msgs)
        step_key = base + "optimizer.step"
        if step_key in state_dict:
            store.set_step(t, int(state_dict[step_key]))
        else:
            missing_keys.append(step_key)
    # A swapped module has no children: any other key under it is foreign
    # (e.g. Adagrad state loaded into an SGD table).
    unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)


def save_copies(
    collection: ShardedEmbeddingCollection,
    copies: Sequence[Tensor],
    prefix: str,
    destination: dict,
    comm: Communicator,
) -> None:
    """``<table>.weight`` of every table as `save_tables` writes it, but read from
    ``copies`` (one tensor per store, shaped as its ``weight``: rows kept from
    an earlier step) instead of the stores; no optimizer state (a collective)."""
    _agree(comm, f"state_dict() of table copies under {prefix!r}")
    for store, copy, t, name in _copy_slots(collection, copies):
        local = store.table_slice(t, copy).detach()
        gather = partial(collection._gather, name)
        destination[f"{prefix}{name}.weight"] = _as_global(store.shardings[t], comm, local, gather)


def load_copies(
    collection: ShardedEmbeddingCollection,
    copies: Sequence[Tensor],
    prefix: str,
    state_dict: Mapping[str, Any],
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
    comm: Communicator,
) -> None:
    """Read what `save_copies` wrote into ``copies`` (the stores stay as they are)."""
    _agree(comm, f"load_state_dict() of table copies under {prefix!r}")
    ours: set[str] = set()
    for store, copy, t, name in _copy_slots(collection, copies):
        key = f"{prefix}{name}.weight"
        ours.add(key)
        if key in state_dict:
            _load_tensor(comm, store, t, copy, state_dict[key], key, error_msgs)
        else:
            missing_keys.append(key)
    unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)


def _copy_slots(
    collection: ShardedEmbeddingCollection, copies: Sequence[Tensor]
) -> Iterator[tuple[ShardStore, Tensor, int, str]]:
    """(store, its copy, table index in it, table name), in the same order on every rank."""
    for store, copy in zip(collection.stores, copies, strict=True):
        for t, table in enumerate(store.tables):
            yield store, copy, t, table.name


def _named(store: ShardStore, weights: bool) -> dict[str, Tensor]:
    state = store.optimizer_state()  # after the last update (`ShardStore.join_update`)
    named = {"weight": store.weight} if weights else {}
    named.update({"optimizer." + k: v for k, v in state.items()})
    return named


@torch.no_grad()
def _load_tensor(
    comm: Communicator,
    store: ShardStore,
    t: int,
    target: Tensor,
    src: Tensor,
    key: str,
    errors: list[str],
) -> None:
    dst = store.table_slice(t, target)
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        errors.append(f"{key}: row shape {tuple(src.shape[1:])} != {tuple(dst.shape[1:])}")
        return
    local = _to_local(store.shardings[t], comm, src, key, errors)
    if local is None:
        return
    valid = store.local_global_ids(t) >= 0
    dst[valid] = local.to(device=dst.device, dtype=dst.dtype)[valid]
