"""Save / load sharded tables and optimizer state with ``torch.distributed.checkpoint``.

Each rank writes only its own shard (state-dict keys carry the rank and world
size, see `freescale.embedding.store`); DCP writes replicated tensors of a
whole model once. Loading at the same world size restores every byte; at
another world size it fails with missing keys instead of scrambling rows.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn


def save(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Write ``module.state_dict()`` (all ranks call it) to the directory ``path``."""
    dcp.save(module.state_dict(), checkpoint_id=path, process_group=process_group)


def load(module: nn.Module, path: str | os.PathLike, process_group: Any = None) -> None:
    """Restore ``module`` in place from ``path`` (all ranks call it)."""
    state = module.state_dict()
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    module.load_state_dict(state)
