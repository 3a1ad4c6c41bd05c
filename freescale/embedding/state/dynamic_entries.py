"""A dynamic table's checkpoint entries: rows keyed by id, with the map beside them.

A dynamic table (`freescale.embedding.dynamic`) has no row order: each of W
ranks holds L slots and a map from id to slot. Its entries, under ``<table>.``:

- ``weight``, ``optimizer.<state>``: every slot's row and state, rank after
  rank (``[W * L, ...]``: rank r's slots are rows ``[r * L, (r + 1) * L)``;
  a slot holding no id: zeros and the state's initial value);
- ``dynamic.slot_ids`` / ``dynamic.occupied``: the id whose row each slot
  holds (the key of that row), ``dynamic.last_used`` / ``dynamic.uses``: its
  last call and use count; ``dynamic.pend_*``: ids waiting for admission and
  their sightings;
- ``dynamic.calls``: the map's call counter; ``dynamic.layout``: ``[W, L]``.

They hold the table as a synchronous run has it at this point: a prefetching
mode has mapped the next step's ids already, so its entries are taken as
before that call (`ShardStore.dynamic_entries`), and every mode writes the
same checkpoint. Like a static table's they are ``DTensor`` ``Shard(0)``
entries, whose chunk at W ranks is exactly a rank's slots (nothing travels at
save), or without torch.distributed whole tensors; DCP reshards them.
``optimizer.step`` is written by `freescale.embedding.state.state_dict` as for
every table. Without the weights (a fused optimizer's state) only
``optimizer.*``, ``dynamic.slot_ids``, ``dynamic.occupied`` and
``dynamic.layout`` are written.

Loaded at the same layout (W and L), every slot comes back where it was and
training continues bit for bit. At another layout the rows go by id: each held
id to its owner at the new world size (`owner_of`), where a shard's ids take
slots ``0, 1, ...`` in id order (`DynamicMap.install`). A shard given more ids
than slots keeps those its policy would evict last and drops the rest; rank 0
says how many in one line on stderr. Pending ids go the same way (beyond the
list's length the least recently seen are forgotten, as the map does); the
counter continues. Optimizer state alone loads by id into the slots the map
holds (ids not held: dropped).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding.dynamic.map import DynamicMap
from freescale.embedding.dynamic.spec import owner_of

if TYPE_CHECKING:
    from freescale.embedding.store import ShardStore

MAP = ("slot_ids", "occupied", "last_used", "uses", "pend_ids", "pend_seen", "pend_count",
       "pend_last")  # fmt: skip
KEYS = ("slot_ids", "occupied")  # what keys the optimizer state alone by id
LAYOUT, CALLS = "dynamic.layout", "dynamic.calls"


def per_slot(store: ShardStore, weights: bool, before: bool) -> dict[str, Tensor]:
    """This rank's per-slot entries of the dynamic table of ``store``, by entry
    name (copies); ``before``: as before a call mapped ahead of its step."""
    assert store.dynamic is not None
    held = store.dynamic_entries(before)
    fresh = DynamicMap(store.dynamic.map.spec, store.slots, store.dynamic.map.device).tensors()
    slots = held["slot"]
    for name, key in (("slot_ids", "id"), ("last_used", "last_used"), ("uses", "uses")):
        fresh[name][slots] = held[key]
    fresh["occupied"][slots] = True
    fresh.update({n: held[n] for n in MAP if n.startswith("pend_")})
    named = {}
    if weights:
        named["weight"] = torch.zeros_like(store.weight)
    for name, (_, init) in store.optimizer.state_specs(store.dim).items():
        named["optimizer." + name] = torch.full_like(getattr(store, name), init)
    for key, t in named.items():
        t[slots.to(t.device)] = held[key.removeprefix("optimizer.")].to(t.device)
    named.update({f"dynamic.{n}": fresh[n] for n in (MAP if weights else KEYS)})
    return named if not weights else {**named, CALLS: held["calls"].reshape(())}


def sized_at_save(name: str) -> bool:
    """Whether entry ``name`` (under a table) has a dynamic table's ``W * L`` rows."""
    if name.startswith("dynamic."):
        return name[len("dynamic.") :] in MAP
    return name == "weight" or (name.startswith("optimizer.") and name != "optimizer.step")


def save_dynamic(
    store: ShardStore,
    base: str,
    destination: dict,
    weights: bool,
    comm: Communicator,
    group: Any,
    before: bool,
) -> None:
    """Write the entries of the dynamic table of ``store`` under ``base``;
    ``group``: ``comm``'s torch process group (None: simulated ranks);
    ``before``: a call was mapped ahead of its step (`Mode.lookahead_mapped`)."""
    w, slots = comm.world_size, store.slots
    named = per_slot(store, weights, before)
    calls = named.pop(CALLS, None)
    for key, local in named.items():
        if group is None:  # simulated ranks: whole tensors (a collective)
            destination[base + key] = comm.all_gather(local.contiguous()).wait()
        else:  # rank r's chunk of [W * L] rows is its own slots: nothing travels
            destination[base + key] = _sharded(local, group, (w * slots, *local.shape[1:]))
    destination[base + LAYOUT] = torch.tensor([w, slots], dtype=torch.int64)
    if calls is not None:
        destination[base + CALLS] = calls.cpu()


def _sharded(local: Tensor, group: Any, shape: tuple[int, ...]) -> Tensor:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, local.device.type)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def load_dynamic(
    store: ShardStore,
    base: str,
    state_dict: Mapping[str, Any],
    weights: bool,
    comm: Communicator,
    missing_keys: list[str],
    error_msgs: list[str],
) -> set[str]:
    """Read what `save_dynamic` wrote (at any layout) into ``store``; return its keys."""
    assert store.dynamic is not None
    local = _row_shapes(store, weights)
    keys = [*local, LAYOUT, *((CALLS,) if weights else ())]
    ours = {base + k for k in keys}
    absent = [base + k for k in keys if base + k not in state_dict]
    if absent:
        missing_keys.extend(absent)
        return ours
    layout = state_dict[base + LAYOUT]
    if tuple(layout.shape) != (2,) or int(layout.min()) < 1:
        error_msgs.append(f"{base}{LAYOUT}: {layout.tolist()} is no [world size, slots]")
        return ours
    saved_w, saved_slots = (int(x) for x in layout.tolist())
    rows = saved_w * saved_slots
    wrong = [
        f"{base}{key}: saved {tuple(state_dict[base + key].shape)}, expected "
        f"{(rows, *shape)} ({saved_w} ranks of {saved_slots} slots)"
        for key, shape in local.items()
        if tuple(state_dict[base + key].shape) != (rows, *shape)
    ]
    if wrong:
        error_msgs.extend(wrong)
        return ours
    parts, chunked = _parts({k: state_dict[base + k] for k in local}, comm)
    if not weights:
        _state_by_id(store, parts, chunked, comm)
    elif (saved_w, saved_slots) == (comm.world_size, store.slots):
        if not chunked:  # whole tensors: this rank's slots
            lo = comm.rank * store.slots
            parts = {k: v[lo : lo + store.slots] for k, v in parts.items()}
        calls = state_dict[base + CALLS].reshape(1)
        held = {n: parts[f"dynamic.{n}"] for n in MAP}
        opt = {k[len("optimizer.") :]: v for k, v in parts.items() if k.startswith("optimizer.")}
        _restore(store, {**held, "calls": calls}, parts["weight"], opt)
    else:
        _install(store, base, parts, chunked, comm, int(state_dict[base + CALLS]), saved_w)
    return ours


def _row_shapes(store: ShardStore, weights: bool) -> dict[str, tuple[int, ...]]:
    """The per-slot entries `per_slot` writes, with the shape of one slot's value."""
    shapes = {"weight": (store.dim,)} if weights else {}
    for name, (shape, _) in store.optimizer.state_specs(store.dim).items():
        shapes["optimizer." + name] = tuple(shape)
    shapes.update({f"dynamic.{n}": () for n in (MAP if weights else KEYS)})
    return shapes


def _parts(entries: dict[str, Tensor], comm: Communicator) -> tuple[dict[str, Tensor], bool]:
    """This rank's chunk of every entry (True) when all are ``DTensor`` chunks
    of this world size, else every entry whole (False; a collective per DTensor)."""
    from torch.distributed.tensor import DTensor, Shard

    def chunk(t: Tensor) -> bool:
        return (
            isinstance(t, DTensor)
            and tuple(t.placements) == (Shard(0),)
            and t.device_mesh.size() == comm.world_size
        )

    if all(chunk(t) for t in entries.values()):
        return {k: t.to_local() for k, t in entries.items()}, True
    whole = {k: t.full_tensor() if isinstance(t, DTensor) else t for k, t in entries.items()}
    return whole, False


def _mine(parts: dict[str, Tensor], held: str, chunked: bool, comm: Communicator) -> dict:
    """The entries of ``parts`` where the bool entry ``held`` is true whose id
    (``dynamic.slot_ids`` / ``dynamic.pend_ids``) this rank owns now; from a chunk
    the others' travel to them (an AllToAll per entry)."""
    keep = parts[held].bool()
    ids_key = "dynamic.pend_ids" if held == "dynamic.pend_seen" else "dynamic.slot_ids"
    ids = parts[ids_key][keep]
    owner = owner_of(ids, comm.world_size)
    names = [k for k in parts if k != held and (k == ids_key or _goes_with(k, held))]
    if not chunked:
        mine = owner == comm.rank
        return {k: parts[k][keep][mine] for k in names}
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=comm.world_size).to(torch.int64)
    every = comm.all_gather(send.to(comm.device)).wait().cpu().reshape(comm.world_size, -1)
    recv = every[:, comm.rank].tolist()
    out = {}
    for k in names:
        x = parts[k][keep][order].contiguous()
        out[k] = comm.all_to_all_v(x.to(comm.device), send.tolist(), recv).wait()
    return out


def _goes_with(key: str, held: str) -> bool:
    pending = key.startswith("dynamic.pend_")
    return pending if held == "dynamic.pend_seen" else not pending


def _install(
    store: ShardStore,
    base: str,
    parts: dict[str, Tensor],
    chunked: bool,
    comm: Communicator,
    calls: int,
    saved_w: int,
) -> None:
    held = _mine(parts, "dynamic.occupied", chunked, comm)
    pending = _mine(parts, "dynamic.pend_seen", chunked, comm)
    assert store.dynamic is not None
    fresh = DynamicMap(store.dynamic.map.spec, store.slots, store.dynamic.map.device)
    keep = fresh.install(
        {n: held[f"dynamic.{n}"] for n in ("slot_ids", "last_used", "uses")},
        {n: pending[f"dynamic.{n}"] for n in ("pend_ids", "pend_count", "pend_last")},
        calls,
    )
    # kept ids take slots 0, 1, ...; every other slot starts empty
    rows = torch.zeros_like(store.weight)
    rows[: keep.numel()] = held["weight"][keep].to(rows.device, rows.dtype)
    state = {}
    for name, (_, init) in store.optimizer.state_specs(store.dim).items():
        state[name] = torch.full_like(getattr(store, name), init)
        state[name][: keep.numel()] = held["optimizer." + name][keep].to(state[name].device)
    _restore(store, fresh.tensors(), rows, state)
    dropped = int(held["dynamic.slot_ids"].numel() - keep.numel())
    counts = torch.tensor([dropped, int(held["dynamic.slot_ids"].numel())], dtype=torch.int64)
    total = comm.all_gather(counts.to(comm.device)).wait().cpu().reshape(-1, 2).sum(0).tolist()
    if comm.rank == 0 and total[0]:
        name = base.rstrip(".")
        print(
            f"freescale: dynamic table {name!r} saved by {saved_w} ranks, loaded by "
            f"{comm.world_size} of {store.slots} slots each: {total[0]} of its {total[1]} "
            "ids did not fit their new shard and were dropped (the least recently/"
            "frequently used, as the table evicts)",
            file=sys.stderr,
            flush=True,
        )


@torch.no_grad()
def _restore(
    store: ShardStore, tensors: dict[str, Tensor], rows: Tensor, state: dict[str, Tensor]
) -> None:
    """This shard of a dynamic table, slot for slot: the map's ``tensors``,
    ``rows`` and the optimizer ``state`` (written through `table_slice`, which
    waits for the last update and drops a host tier's staged rows)."""
    assert store.dynamic is not None
    store.table_slice(0, store.weight).copy_(rows)
    for name, target in store.optimizer_state().items():
        store.table_slice(0, target).copy_(state[name])
    store.dynamic.map.load(tensors)  # (nothing left to look behind)


@torch.no_grad()
def _state_by_id(
    store: ShardStore, parts: dict[str, Tensor], chunked: bool, comm: Communicator
) -> None:
    """Optimizer state alone: into the slots that hold its ids now."""
    assert store.dynamic is not None
    held = _mine(parts, "dynamic.occupied", chunked, comm)
    slots = store.dynamic.map.find(held["dynamic.slot_ids"].to(store.dynamic.map.device))
    found = slots >= 0
    for name, target in store.optimizer_state().items():
        src = held["optimizer." + name][found.to(held["optimizer." + name].device)]
        target[slots[found].to(target.device)] = src.to(target.device)
    if store.tier is not None:
        store.tier.drop()


def rows_by_id(entries: Mapping[str, Tensor], base: str) -> tuple[Tensor, Tensor, dict]:
    """(ids ascending, their rows, their optimizer state) of the dynamic table
    whose whole entries (plain tensors, as DCP loads them without ranks) are
    under ``base`` in ``entries``."""
    held = entries[base + "dynamic.occupied"].bool()
    ids = entries[base + "dynamic.slot_ids"][held]
    order = torch.argsort(ids)
    state = {k[len(base) + len("optimizer.") :]: v[held][order] for k, v in entries.items()
             if k.startswith(base + "optimizer.") and sized_at_save(k[len(base) :])}  # fmt: skip
    return ids[order], entries[base + "weight"][held][order], state


def resized_as_saved(state: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Load targets of dynamic tables in ``state`` (a module's ``state_dict()``)
    given the row count the checkpoint index ``saved`` has for them (another
    world size or capacity: `load_dynamic` then goes by id)."""
    bases = [k[: -len(LAYOUT)] for k in state if k.endswith(LAYOUT)]
    for base in bases:
        for key, target in list(state.items()):
            if not key.startswith(base) or not sized_at_save(key[len(base) :]):
                continue
            meta = saved.get(key)
            size = getattr(meta, "size", None)
            if size is not None and tuple(size) != tuple(target.shape):
                state[key] = _zeros_sized(target, torch.Size(size))


def _zeros_sized(like: Tensor, size: torch.Size) -> Tensor:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(like, DTensor):
        return like.new_zeros(size)
    mesh = like.device_mesh
    c = -(-size[0] // mesh.size())  # the chunks of torch.chunk, as DCP cuts them
    lo = min(mesh.get_coordinate()[0] * c, size[0])
    hi = min(lo + c, size[0])
    local = like.to_local().new_zeros((hi - lo, *size[1:]))
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=size, stride=stride)
