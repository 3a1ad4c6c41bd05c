"""`swap(model, plan)`: replace embedding modules with sharded drop-ins, in place.

The model's code does not change: each ``nn.Embedding`` becomes a
`ShardedEmbedding` with the same call signature (``emb(ids) -> ids.shape + (D,)``),
and each TorchRec ``EmbeddingCollection`` becomes a `ShardedTorchRecCollection`
(``ec(kjt) -> {feature: JaggedTensor}``). All replaced tables live in one
`ShardedEmbeddingCollection` (returned; checkpoint it, the swapped modules hold
no state of their own) and start from the original modules' weights, so a
sharded run starts exactly where the unsharded one does.

In a prefetching mode (`freescale.embedding.modes`) the collection looks a
training step up in one call: a model that reads several swapped modules runs
inside ``collection.serving(features)`` (the trainer does), and a swapped
module called on its own there raises at the call, saying so.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn

from freescale.comm import Communicator
from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.config import ShardingPlan, TableConfig
from freescale.embedding.lookup import Timer, no_timer
from freescale.embedding.modes import Mode
from freescale.embedding.state.state_dict import load_tables, save_tables
from freescale.embedding.table_rows import TableRows
from freescale.jagged import JaggedTensor
from freescale.jagged.interop import embeddings_to_torchrec, kjt_to_features


class _Swapped(nn.Module):
    """What the drop-ins share: the collection, and the one-lookup-per-step rule."""

    def __init__(self, collection: ShardedEmbeddingCollection, path: str, siblings: int) -> None:
        super().__init__()
        # Held outside the module tree: several swapped modules share one
        # collection, whose state is saved once, through the collection.
        self.__dict__["collection"] = collection
        self.path, self.siblings = path, siblings

    def _lookup(self, features: dict[str, Any]) -> dict[str, Any]:
        c = self.collection
        if self.siblings > 1 and c.lookup_needs_serving():
            raise RuntimeError(
                f"{self.path!r} was called on its own, but its collection "
                f"(mode={type(c.mode).__name__}) looks up all {self.siblings} swapped modules "
                "of a training step in one call: run the model inside "
                "`with collection.serving(features):` (features: every module's "
                "lookup_features), or swap with mode=Sync()"
            )
        return c(features)


class ShardedEmbedding(_Swapped):
    """Drop-in for ``nn.Embedding``: ``forward(ids) -> ids.shape + (dim,)``."""

    def __init__(
        self, collection: ShardedEmbeddingCollection, table: str, siblings: int = 1
    ) -> None:
        super().__init__(collection, table, siblings)
        self.table = table
        cfg = collection.tables[table]
        self.num_embeddings, self.embedding_dim = cfg.rows, cfg.dim
        self.padding_idx = cfg.padding_idx

    def forward(self, input: Tensor) -> Tensor:
        return self._lookup({self.table: input})[self.table]

    def lookup_features(self, input: Tensor) -> dict[str, Tensor]:
        """The collection's features behind ``forward(input)`` (for `serving`, `prefetch`)."""
        return {self.table: input}

    def prefetch(self, input: Tensor) -> None:
        """Start the input distribution of a later ``forward(input)`` (sdd)."""
        self.collection.prefetch(self.lookup_features(input))

    def extra_repr(self) -> str:
        return f"{self.table!r}, {self.num_embeddings}, {self.embedding_dim}, sharded"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        save_tables(self.collection, {"": self.table}, prefix, destination)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        load_tables(self.collection, {"": self.table}, prefix, state_dict, *args)


class ShardedTorchRecCollection(_Swapped):
    """Drop-in for ``torchrec.EmbeddingCollection``: ``forward(kjt) -> {feature: JT}``."""

    def __init__(
        self,
        collection: ShardedEmbeddingCollection,
        prefix: str,
        need_indices: bool,
        siblings: int = 1,
    ) -> None:
        super().__init__(collection, prefix[:-1], siblings)
        self.prefix, self.need_indices = prefix, need_indices

    def lookup_features(self, features: Any) -> dict[str, JaggedTensor]:
        """The collection's features behind ``forward(features)`` (a KJT)."""
        return kjt_to_features(features, self.prefix)  # checked; int32 or int64 lengths

    def prefetch(self, features: Any) -> None:
        """Start the input distribution of a later ``forward(features)`` (sdd)."""
        self.collection.prefetch(self.lookup_features(features))

    def forward(self, features: Any) -> dict[str, Any]:
        ours = self.lookup_features(features)
        out = embeddings_to_torchrec(self._lookup(ours), ours, self.prefix)
        if self.need_indices:  # TorchRec returns the ids as the weights
            for key, jt in ours.items():
                out[key[len(self.prefix) :]]._weights = jt.values
        return out

    # Checkpoints the usual way: the tables and their optimizer state, under
    # this module's path, as resharding-friendly entries (`state_dict.py`).
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        save_tables(self.collection, self.table_names(), prefix + "embeddings.", destination)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        load_tables(self.collection, self.table_names(), prefix + "embeddings.", state_dict, *args)

    def table_names(self) -> dict[str, str]:
        """{name under ``embeddings.``: collection table} of this module."""
        n = len(self.prefix)
        return {t[n:]: t for t in self.collection.tables if t.startswith(self.prefix)}


def _torchrec_ec_type() -> type | None:
    # A model can only hold an EmbeddingCollection if torchrec was imported,
    # so never pay torchrec's import cost here.
    if "torchrec" not in sys.modules:
        return None
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return EmbeddingCollection


def _check_embedding(path: str, m: nn.Embedding) -> None:
    if m.max_norm is not None or m.scale_grad_by_freq:
        raise ValueError(f"{path}: max_norm / scale_grad_by_freq are not supported when sharded")


def _tables_of(path: str, m: nn.Module, plan: ShardingPlan, ec_type: type | None) -> list:
    """(TableConfig, initial weight) for each table a target module holds."""
    if isinstance(m, nn.Embedding):
        _check_embedding(path, m)
        w = m.weight
        cfg = TableConfig(
            path,
            m.num_embeddings,
            m.embedding_dim,
            w.dtype,
            plan.table_optimizers.get(path),
            padding_idx=m.padding_idx,
        )
        return [(cfg, w)]
    assert ec_type is not None and isinstance(m, ec_type)
    out = []
    for tc in m.embedding_configs():
        w = m.embeddings[tc.name].weight
        name = f"{path}.{tc.name}"
        features = tuple(f"{path}.{f}" for f in tc.feature_names)
        opt = plan.table_optimizers.get(name)
        out.append(
            (TableConfig(name, tc.num_embeddings, tc.embedding_dim, w.dtype, opt, features), w)
        )
    return out


def plain_table_rows(model: nn.Module, by_id: Collection[str] = ()) -> TableRows:
    """The rows each lookup feature of an unswapped model's ``sharded_modules``
    may index, named as `swap` names them. ``by_id``: paths of modules that
    take any int64 id (a dynamic table, served by id): they have no rows to keep
    ids inside, and are left out."""
    ec_type, plan = _torchrec_ec_type(), ShardingPlan()
    paths = [p for p in model.sharded_modules if p not in by_id]  # type: ignore[attr-defined]
    return TableRows.of(
        c for p in paths for c, _ in _tables_of(p, model.get_submodule(p), plan, ec_type)
    )


def plain_lookups(model: nn.Module, batch: Any, by_id: Collection[str] = ()) -> dict[str, Any]:
    """The lookup features an unswapped model makes of ``batch`` (`plain_table_rows`'
    names), those of the ``by_id`` modules left out as there."""
    out: dict[str, Any] = {}
    for path, value in model.embedding_inputs(batch).items():  # type: ignore[operator]
        if path in by_id:
            continue
        if isinstance(model.get_submodule(path), nn.Embedding):
            out[path] = value
        else:
            out.update(kjt_to_features(value, path + "."))
    return out


def _check_not_tied(model: nn.Module, targets: dict[int, tuple[str, nn.Module]]) -> None:
    owned = {id(p) for _, m in targets.values() for p in m.parameters()}
    target_paths = [path + "." for path, _ in targets.values()]
    for path, m in model.named_modules():
        if id(m) in targets or any(path.startswith(p) for p in target_paths):
            continue  # a target, or inside one (an EmbeddingCollection's own tables)
        for name, p in m.named_parameters(recurse=False):
            if id(p) in owned:
                raise ValueError(
                    f"{path}.{name} shares an embedding weight; tied weights cannot be sharded"
                )


def swap(
    model: nn.Module,
    plan: ShardingPlan,
    comm: Communicator | None = None,
    device: torch.device | str | None = None,
    *,
    mode: Mode | None = None,
    timer: Timer = no_timer,
    overlap_comm: Communicator | None = None,
    inputs_checked: bool = False,
) -> ShardedEmbeddingCollection:
    """Replace the embedding modules ``plan`` selects; return the collection behind them.

    Every rank must call it on an identical model. ``comm`` defaults to a
    `TorchCommunicator` on the default process group; the keyword arguments
    go to `ShardedEmbeddingCollection` (fixed for the collection's life).
    """
    if comm is None:
        from freescale.comm import TorchCommunicator

        comm = TorchCommunicator()
    ec_type = _torchrec_ec_type()
    kinds = (nn.Embedding,) if ec_type is None else (nn.Embedding, ec_type)
    if isinstance(model, kinds):
        raise ValueError("swap replaces submodules; wrap a bare embedding module in a parent")
    targets: dict[int, tuple[str, nn.Module]] = {}
    inside: list[str] = []  # selected EmbeddingCollections: their own tables are theirs
    for path, m in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, kinds) and plan.selects(path):
            targets[id(m)] = (path, m)
            if not isinstance(m, nn.Embedding):
                inside.append(path)
    if not targets:
        raise ValueError("swap found no nn.Embedding / EmbeddingCollection that the plan selects")
    _check_not_tied(model, targets)
    pairs = [pair for path, m in targets.values() for pair in _tables_of(path, m, plan, ec_type)]
    collection = ShardedEmbeddingCollection(
        [c for c, _ in pairs],
        comm,
        plan,
        device,
        mode=mode,
        timer=timer,
        overlap_comm=overlap_comm,
        inputs_checked=inputs_checked,
    )
    for cfg, weight in pairs:
        if collection.tables[cfg.name].dynamic is None:  # dynamic rows start by id
            collection.set_table(cfg.name, weight.detach())
    n = len(targets)
    replacements = {key: _replacement(collection, path, m, n) for key, (path, m) in targets.items()}
    for _, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])
    return collection


def _replacement(
    collection: ShardedEmbeddingCollection, path: str, m: nn.Module, siblings: int
) -> nn.Module:
    if isinstance(m, nn.Embedding):
        return ShardedEmbedding(collection, path, siblings)
    need_indices = bool(getattr(m, "_need_indices", False))
    return ShardedTorchRecCollection(collection, path + ".", need_indices, siblings)
