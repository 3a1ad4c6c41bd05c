"""Save / load sharded tables and optimizer state with ``torch.distributed.checkpoint``.

Two forms of the same state:

- the collection itself: each rank writes its own slots as they lie (keys
  carry the rank and world size, see `freescale.embedding.store`). Loading
  at the same world size restores every byte; at another it fails with
  missing keys instead of scrambling rows.
- `TableEntries(collection)`: every table in logical row order, a ``DTensor``
  ``Shard(0)`` of contiguous row chunks (`freescale.embedding.state.state_dict`,
  the entries a swapped model's ``state_dict()`` holds). DCP reshards these:
  saved at W ranks, they load at any W' (the trainer's checkpoints use them);
  a dynamic table's rows are keyed by id, its map beside them
  (`freescale.embedding.state.dynamic_entries`);
  `WeightCopies`: the same weight entries of copies of the rows.

DCP writes replicated tensors of a whole model once. Loading runs no code
from the files: the index is read by `freescale.embedding.state.dcp_safe`, which
refuses anything but plain tensors.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from freescale.comm import Communicator, TorchCommunicator
from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.state.dcp_safe import SafeReader, read_metadata
from freescale.embedding.state.dynamic_entries import resized_as_saved
from freescale.embedding.state.state_dict import (
    load_copies,
    load_tables,
    save_copies,
    save_tables,
)


class TableEntries(nn.Module):
    """Every table of ``collection`` with its optimizer state, as entries any world
    size can load: ``<table>.weight``, ``<table>.optimizer.<state>`` (DTensors,
    contiguous row chunks) and ``<table>.optimizer.step`` (a replicated scalar).

    ``state_dict()`` and ``load_state_dict()`` are collectives (one AllToAll
    per tensor). Their rows travel over a torch process group: the collection's
    own when it has one, else (the SM-free backends) a `TorchCommunicator` on
    the default group, so each rank only ever holds its chunk, not whole tables.
    """

    def __init__(self, collection: ShardedEmbeddingCollection) -> None:
        super().__init__()
        self.__dict__["collection"] = collection  # its state is ours, not a child's
        self.names = {name: name for name in collection.tables}
        self.__dict__["comm"] = _exchange_comm(collection)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        save_tables(self.collection, self.names, prefix, destination, comm=self.comm)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        load_tables(self.collection, self.names, prefix, state_dict, *args, comm=self.comm)


class WeightCopies(nn.Module):
    """Copies of the tables' rows (``copies``: one tensor per store of
    ``collection``, shaped as its ``weight``) as ``<table>.weight`` entries that
    reshard exactly as `TableEntries`' do; no optimizer state. ``copies`` is read
    when the state is taken and written in place on load (a collective, too)."""

    def __init__(self, collection: ShardedEmbeddingCollection, copies: list[Tensor]) -> None:
        super().__init__()
        self.__dict__["collection"], self.__dict__["copies"] = collection, copies
        self.__dict__["comm"] = _exchange_comm(collection)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        save_copies(self.collection, self.copies, prefix, destination, self.comm)

    def _load_from_state_dict(
        self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool, *errors: Any
    ) -> None:
        load_copies(self.collection, self.copies, prefix, state_dict, *errors, comm=self.comm)


def _exchange_comm(collection: ShardedEmbeddingCollection) -> Communicator:
    comm = collection.comm
    if getattr(comm, "group", False) is not False or not dist.is_initialized():
        return comm  # a torch group, or thread-simulated ranks (whole tables then)
    return TorchCommunicator(device=collection.device)


def save(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Write ``module.state_dict()`` (all ranks call it) to the directory ``path``."""
    dcp.save(module.state_dict(), checkpoint_id=path, process_group=process_group)


def load(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Restore ``module`` in place from ``path`` (all ranks call it).

    Raises ValueError (on every rank: all read the same metadata) when the
    checkpoint holds state the module has no place for, e.g. Adagrad's
    ``sum_sq`` loaded into an SGD collection: dropping it silently would
    change the training that follows; likewise when it lacks state the
    module has (e.g. a static table saved, a dynamic one loading). A file
    that could run code on load is refused the same way
    (`freescale.embedding.state.dcp_safe`). A dynamic table's entries load
    at the row count they were saved with (`resized_as_saved`).
    """
    saved = read_metadata(path).state_dict_metadata
    state = module.state_dict()
    theirs, ours = {_unranked(k) for k in saved}, {_unranked(k) for k in state}
    for what, names in (("holds state this module lacks", theirs - ours),
                        ("lacks state this module has", ours - theirs)):  # fmt: skip
        if names:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r} {what}: {', '.join(sorted(names))}"
                " (saved with another optimizer or other tables?)"
            )
    resized_as_saved(state, saved)  # a dynamic table's rows: as many as were saved
    dcp.load(state, storage_reader=SafeReader(path), process_group=process_group)
    module.load_state_dict(state)


def _unranked(key: str) -> str:
    """``stores.0.weight.rank1of2`` -> ``stores.0.weight`` (same on every rank)."""
    head, dot, tail = key.rpartition(".")
    return head if dot and re.fullmatch(r"rank\d+of\d+", tail) else key
