"""A store's own state dict: this rank's slots as they lie, keys naming the rank.

`ShardStore` mixes this in. Keys carry the rank and world size
(``weight.rank0of2``): each rank saves and loads only its own shard, which
is what ``torch.distributed.checkpoint`` needs for per-rank tensors, and a
checkpoint read at another world size fails loudly (missing keys) instead of
silently scrambling rows. A ``layout`` tensor guards against a changed
assignment; a dynamic table's map travels beside its rows (``dynamic_*``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_KIND_CODE = {"block": 0, "hashed": 1}


class PerRankState:
    """The per-rank ``state_dict`` hooks of `ShardStore`, on its attributes."""

    def _tensors(self) -> dict[str, Tensor]:
        self.join_update()
        named = {"weight": self.weight, "steps": self.steps}
        named.update(self.optimizer_state())
        named["layout"] = self._layout()
        if self.dynamic is not None:
            named.update({f"dynamic_{k}": v for k, v in self.dynamic.map.tensors().items()})
        return named

    def _layout(self) -> Tensor:
        rows = [
            [s.rows, s.world_size, _KIND_CODE[s.kind], s.block_size, t.dim]
            for t, s in zip(self.tables, self.shardings, strict=True)
        ]
        return torch.tensor(rows, dtype=torch.int64)

    def _key(self, prefix: str, name: str) -> str:
        return f"{prefix}{name}.rank{self.rank}of{self.world_size}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.settle()  # the counters of skipped steps taken back
        for name, t in self._tensors().items():
            destination[self._key(prefix, name)] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        self.settle()
        tensors = self._tensors()
        for name, target in tensors.items():
            key = self._key(prefix, name)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            src = state_dict[key]
            if name == "layout":
                if not torch.equal(src.cpu(), target):
                    error_msgs.append(f"{key}: sharding layout {src.tolist()} != {target.tolist()}")
            elif src.shape != target.shape or src.dtype != target.dtype:
                error_msgs.append(
                    f"{key}: {src.dtype}{tuple(src.shape)} != expected "
                    f"{target.dtype}{tuple(target.shape)}"
                )
            elif src.data_ptr() != target.data_ptr():
                with torch.no_grad():
                    target.copy_(src)
                if self.tier is not None:
                    self.tier.drop()
        self._host_steps = [int(s) for s in self.steps.tolist()]
        if self.dynamic is not None:
            self.dynamic.map.load({})  # the index of the loaded slots
        # A store has no children: every other key under its prefix is foreign
        # (e.g. another rank's shard).
        ours = {self._key(prefix, n) for n in tensors}
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)
