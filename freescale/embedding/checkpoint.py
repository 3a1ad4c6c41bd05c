"""Save / load sharded tables and optimizer state with ``torch.distributed.checkpoint``.

Each rank writes only its own shard (state-dict keys carry the rank and world
size, see `freescale.embedding.store`); DCP writes replicated tensors of a
whole model once. Loading at the same world size restores every byte; at
another world size it fails with missing keys instead of scrambling rows.
Loading runs no code from the files: the index is read by
`freescale.embedding.dcp_safe`, which refuses anything but plain tensors.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn

from freescale.embedding.dcp_safe import SafeReader, read_metadata


def save(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Write ``module.state_dict()`` (all ranks call it) to the directory ``path``."""
    dcp.save(module.state_dict(), checkpoint_id=path, process_group=process_group)


def load(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Restore ``module`` in place from ``path`` (all ranks call it).

    Raises ValueError (on every rank: all read the same metadata) when the
    checkpoint holds state the module has no place for, e.g. Adagrad's
    ``sum_sq`` loaded into an SGD collection: dropping it silently would
    change the training that follows. A file that could run code on load
    is refused the same way (`freescale.embedding.dcp_safe`).
    """
    saved = read_metadata(path).state_dict_metadata
    state = module.state_dict()
    extra = sorted({_unranked(k) for k in saved} - {_unranked(k) for k in state})
    if extra:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} holds state this module lacks: {', '.join(extra)}"
            " (saved with another optimizer or other tables?)"
        )
    dcp.load(state, storage_reader=SafeReader(path), process_group=process_group)
    module.load_state_dict(state)


def _unranked(key: str) -> str:
    """``stores.0.weight.rank1of2`` -> ``stores.0.weight`` (same on every rank)."""
    head, dot, tail = key.rpartition(".")
    return head if dot and re.fullmatch(r"rank\d+of\d+", tail) else key
