"""A dynamic table as a served program holds it: rows keyed by raw id.

Training keeps a dynamic table (`freescale.embedding.dynamic`) as slots on
each rank and an id -> slot map beside them; a served program needs neither
the slots nor the ranks, only which id has which row. `DynamicEmbedding`
holds the held ids sorted ascending and their rows, and maps each id it is
given with `torch.searchsorted` and an equality check: exportable ops, no
host read, any batch shape. An id without a row (never seen, not admitted or
evicted) reads a zero vector, as the training run's eval lookup reads it.

`serve_by_id` puts one in place of each dynamic table's ``nn.Embedding`` in
the plain model the run's factory builds, before its other weights load.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

# (ids sorted ascending, int64 [n]; rows [n, dim]) of one dynamic table
IdRows = tuple[Tensor, Tensor]


class DynamicEmbedding(nn.Module):
    """``forward(ids) -> ids.shape + (dim,)`` (the ``nn.Embedding`` contract):
    the row of each id in ``ids`` (a sorted int64 [n] tensor, no repeats),
    zeros for an id that is not there. ``rows``: [n, dim], by ``ids``.

    State: ``ids`` and ``weight`` (the rows), under the module's path as an
    ``nn.Embedding``'s weight is."""

    def __init__(self, ids: Tensor, rows: Tensor, name: str = "dynamic table") -> None:
        super().__init__()
        check_id_rows(ids, rows, name)
        self.register_buffer("ids", ids.detach().clone())
        self.register_buffer("weight", rows.detach().clone())

    @property
    def embedding_dim(self) -> int:
        return int(self.weight.shape[1])

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype != torch.int64:  # a static choice: the traced program has no branch
            ids = ids.to(torch.int64)
        n = self.ids.shape[0]
        if n == 0:
            return self.weight.new_zeros((*ids.shape, self.weight.shape[1]))
        at = torch.searchsorted(self.ids, ids).clamp(max=n - 1)
        held = self.ids[at] == ids
        # where, not a product: exact zeros whatever the row holds (as training reads them)
        return torch.where(held.unsqueeze(-1), self.weight[at], self.weight.new_zeros(()))

    def extra_repr(self) -> str:
        return f"{self.ids.shape[0]} ids, dim {self.embedding_dim}, by id"


def check_id_rows(ids: Tensor, rows: Tensor, name: str) -> None:
    """One-line ValueError unless ``ids`` is int64 [n], strictly ascending, and
    ``rows`` a floating [n, dim]."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{name}: ids must be int64 [n], got {ids.dtype} {tuple(ids.shape)}")
    if rows.dim() != 2 or rows.shape[0] != ids.shape[0] or not rows.is_floating_point():
        raise ValueError(
            f"{name}: rows must be floating [{ids.shape[0]}, dim] (one per id), "
            f"got {rows.dtype} {tuple(rows.shape)}"
        )
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{name}: ids must be sorted ascending without repeats")


def embedding_at(model: nn.Module, path: str) -> nn.Embedding | None:
    """The ``nn.Embedding`` at ``path`` in ``model``, or None (no module there, or another kind)."""
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Embedding) else None


def serve_by_id(model: nn.Module, tables: Mapping[str, IdRows]) -> nn.Module:
    """``model`` (in place) with the ``nn.Embedding`` at each path of ``tables``
    replaced by a `DynamicEmbedding` of its (ids, rows); one-line ValueError if a
    path is not an ``nn.Embedding`` of the model or its dim differs."""
    for path, (ids, rows) in tables.items():
        module = embedding_at(model, path)
        if module is None:
            raise ValueError(
                f"dynamic table {path!r} is not an nn.Embedding of {type(model).__name__} "
                "(only those are served by id)"
            )
        served = DynamicEmbedding(ids, rows, f"dynamic table {path!r}")
        if served.embedding_dim != module.embedding_dim:
            raise ValueError(
                f"dynamic table {path!r}: rows of dim {served.embedding_dim}, the model's "
                f"embedding has {module.embedding_dim}"
            )
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, served)
    return model


def by_id_paths(model: nn.Module) -> list[str]:
    """The paths of ``model``'s `DynamicEmbedding` modules."""
    return [p for p, m in model.named_modules() if isinstance(m, DynamicEmbedding)]


def by_id_state(model: nn.Module) -> dict[str, Tensor]:
    """The state-dict entries of ``model``'s `DynamicEmbedding` modules (their
    ids and rows), to load beside the weights a checkpoint gives by row."""
    return {
        f"{path}.{key}": value
        for path in by_id_paths(model)
        for key, value in model.get_submodule(path).state_dict().items()
    }


def load_served(
    model: nn.Module, state: Mapping[str, Tensor], tables: Mapping[str, IdRows]
) -> nn.Module:
    """``model`` (as the factory builds it, in place) with each dynamic table of
    ``tables`` served by id (`serve_by_id`) and every other weight from ``state``
    (the dense weights and static tables; a strict load)."""
    serve_by_id(model, tables)
    model.load_state_dict({**state, **by_id_state(model)})
    return model
