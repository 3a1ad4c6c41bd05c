"""One shard's id -> slot map of a dynamic table (`freescale.embedding.dynamic.spec`).

Per-slot tensors on the table's device (the id held, its last use, its use
count), an index sorted by id (`torch.searchsorted`) to find ids, and for
``admit_after`` > 1 a list of ids seen but not admitted yet. `DynamicMap.map`
decides a call's slots without changing anything, so every rank can agree
that no shard overflowed first; `commit` applies it. The choice of the slots
to evict is O(slots) (a histogram of last use or use count); the reference
twin (``reference=True``) sorts every slot, and tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from freescale.embedding.dynamic.spec import DynamicSpec


@dataclass
class MapResult:
    """What `DynamicMap.map` decided for one call's ids (nothing applied yet)."""

    slots: Tensor  # per id: its slot, -1 when not admitted
    new_slots: Tensor  # slots given to new ids (their rows and state start afresh)
    new_ids: Tensor
    evicted: int
    not_admitted: int
    needed: int  # rows this call and the one before it hold on the shard
    overflow: bool
    _commit: dict[str, Tensor] = field(default_factory=dict, repr=False)


_STATE = ("slot_ids", "occupied", "last_used", "uses")
_PENDING = ("pend_ids", "pend_seen", "pend_count", "pend_last")


class DynamicMap:
    """One shard's id -> slot map of ``capacity`` slots (see the module docstring).

    Tensors (all on ``device``; `tensors` names them for the state dict):
    ``slot_ids``/``occupied``: the id in each slot; ``last_used``: the last
    call that read it; ``uses``: how many calls read it since it came;
    ``pend_*``: ids seen but not yet admitted (``admit_after`` > 1), as many
    entries as slots, the least recently seen given up first; ``calls``: the
    number of calls mapped (a 1-element tensor, so it checkpoints).
    """

    def __init__(
        self, spec: DynamicSpec, capacity: int, device: torch.device, reference: bool = False
    ) -> None:
        self.spec, self.capacity, self.device = spec, capacity, torch.device(device)
        self.reference = reference  # sort every slot per call: the fast path's twin
        i64 = {"dtype": torch.int64, "device": self.device}
        self.slot_ids = torch.zeros(capacity, **i64)
        self.occupied = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.last_used = torch.full((capacity,), -1, **i64)
        self.uses = torch.zeros(capacity, **i64)
        self.pend_ids = torch.zeros(capacity, **i64)
        self.pend_seen = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self.pend_count = torch.zeros(capacity, **i64)
        self.pend_last = torch.full((capacity,), -1, **i64)
        self.calls = torch.zeros(1, **i64)
        # What the last `commit` changed, with the old values: the map as it was
        # before a call mapped ahead of its step (`before_last`, `find_before`).
        self.undo: dict[str, Tensor] | None = None
        self._held = 0  # slots holding an id (a host count: no full-table reduction)
        self._reindex()

    # ---- state ------------------------------------------------------------
    def tensors(self) -> dict[str, Tensor]:
        return {n: getattr(self, n) for n in (*_STATE, *_PENDING, "calls")}

    def load(self, tensors: dict[str, Tensor]) -> None:
        for name, t in tensors.items():
            getattr(self, name).copy_(t)
        self.undo = None
        self._reindex()

    def install(self, held: dict[str, Tensor], pending: dict[str, Tensor], calls: int) -> Tensor:
        """Replace the map by entries of another layout (a checkpoint of another
        world size or capacity): ``held`` (``slot_ids``, ``last_used``, ``uses``:
        distinct ids, any order) and ``pending`` (``pend_ids``, ``pend_count``,
        ``pend_last``), the counter at ``calls``. More ids than slots: those the
        map would evict first are dropped (least recently or frequently used,
        then the smaller id, as `_choose`); more pending ids than entries: the
        least recently seen (then by id). Kept ones take slots (entries)
        ``0, 1, ...`` in id order. Returns the positions in ``held`` of the kept
        ids, in slot order."""
        primary = held["last_used"] if self.spec.evict == "lru" else held["uses"]
        keep = _last_in_order(primary, held["slot_ids"], self.capacity)
        waiting = _last_in_order(pending["pend_last"], pending["pend_ids"], self.capacity)
        fresh = DynamicMap(self.spec, self.capacity, self.device)
        for names, src, at in ((_STATE, held, keep), (_PENDING, pending, waiting)):
            n = at.numel()
            getattr(fresh, names[1])[:n] = True  # occupied / pend_seen
            for name in (names[0], *names[2:]):
                getattr(fresh, name)[:n] = src[name][at].to(self.device)
        fresh.calls.fill_(calls)
        self.load(fresh.tensors())
        return keep

    def before_last(self, undo: bool = True) -> dict[str, Tensor]:
        """Copies of `tensors` as they were before the last call was mapped
        (``undo=False``: as they are)."""
        out = {k: v.clone() for k, v in self.tensors().items()}
        u = self.undo
        if u is None or not undo:
            return out
        out["last_used"][u["held"]] = u["last_used"]
        out["uses"][u["held"]] = u["uses"]
        out["slot_ids"][u["new"]] = u["old_ids"]
        out["occupied"][u["new"]] = u["old_occupied"]
        for name in _PENDING:
            out[name][u["pend"]] = u[name]
        out["calls"] -= 1
        return out

    def find_before(self, ids: Tensor) -> Tensor:
        """`find` as the map was before the last call: ids that call gave a
        row read -1, ids it evicted read ``-2 - k`` (k: their place in
        ``evicted_ids``, whose rows the store kept)."""
        slots = self.find(ids)
        u = self.undo
        if u is None:
            return slots
        slots = torch.where(torch.isin(slots, u["new"]), -1, slots)
        evicted = self.evicted_ids()
        order = torch.argsort(evicted)
        k = _find((evicted[order], order), ids)
        return torch.where(k >= 0, -2 - k, slots)

    def evicted_ids(self) -> Tensor:
        """The ids the last call evicted, in the order of its new slots."""
        u = self.undo
        if u is None:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return u["old_ids"][u["old_occupied"]]

    def _reindex(self) -> None:
        """The sorted index of the occupied slots (and of the pending ids)."""
        self._held = int(self.occupied.sum())
        self._index = _sorted_index(self.slot_ids, self.occupied)
        self._pend_index = _sorted_index(self.pend_ids, self.pend_seen)

    @property
    def occupancy(self) -> int:
        return self._held

    def held(self) -> tuple[Tensor, Tensor]:
        """(ids, slots) of the occupied slots, by id."""
        return self._index

    def find(self, ids: Tensor) -> Tensor:
        """Slot of each id, -1 where it has none (no change)."""
        return _find(self._index, ids)

    # ---- one call ---------------------------------------------------------
    def map(self, ids: Tensor) -> MapResult:
        """Decide the slots of a call's ids; `commit` applies it (after the
        ranks agreed that no shard overflowed)."""
        call = int(self.calls)
        uniq, inverse = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        found = _find(self._index, uniq)
        missing = found < 0
        new = uniq[missing]
        admit = torch.ones_like(new, dtype=torch.bool)
        pend_pos = torch.zeros(0, dtype=torch.int64, device=self.device)
        if self.spec.admit_after > 1 and new.numel():
            pend_pos = _find(self._pend_index, new)
            seen = torch.where(pend_pos >= 0, self.pend_count[pend_pos.clamp(min=0)], 0)
            admit = seen + 1 >= self.spec.admit_after
        admitted = new[admit]
        # Candidates: free slots by slot, then ids read by neither this call nor
        # the one before it, least recently / frequently used first, then by id.
        in_call = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        in_call[found[~missing]] = True
        before = self.occupied & (self.last_used == call - 1) & ~in_call
        n_new = admitted.numel()
        chosen, overflow = self._choose(n_new, self.occupied & ~(in_call | before))
        slot_of_uniq = found.clone()
        if not overflow and n_new:
            slot_of_uniq[missing.nonzero().squeeze(1)[admit]] = chosen
        result = MapResult(
            slots=slot_of_uniq[inverse] if not overflow else torch.full_like(ids, -1),
            new_slots=chosen if not overflow else chosen[:0],
            new_ids=admitted if not overflow else admitted[:0],
            evicted=int(self.occupied[chosen].sum()) if not overflow else 0,
            not_admitted=int((~admit).sum()),
            needed=int(in_call.sum()) + n_new + int(before.sum()),
            overflow=overflow,
        )
        result._commit = {
            "uniq": uniq,
            "slot_of_uniq": slot_of_uniq,
            "waiting": new[~admit],
            "waiting_pos": pend_pos[~admit] if pend_pos.numel() else pend_pos,
            "admitted_pos": pend_pos[admit] if pend_pos.numel() else pend_pos,
        }
        return result

    def commit(self, result: MapResult) -> None:
        """Apply ``result`` (from the last `map`): slots, use counts, pending ids."""
        assert not result.overflow
        call = int(self.calls)
        c = result._commit
        held = c["slot_of_uniq"][c["slot_of_uniq"] >= 0]
        new = result.new_slots
        self.undo = {
            "held": held,
            "last_used": self.last_used[held],
            "uses": self.uses[held],
            "new": new,
            "old_ids": self.slot_ids[new],
            "old_occupied": self.occupied[new],
        }  # fmt: skip (advanced indexing copies)
        self._held += result.new_slots.numel() - result.evicted
        if result.new_slots.numel():
            self.slot_ids[result.new_slots] = result.new_ids
            self.occupied[result.new_slots] = True
            self.uses[result.new_slots] = 0
        self.last_used[held] = call
        self.uses[held] += 1
        self.undo["pend"] = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.undo.update({n: getattr(self, n)[:0] for n in _PENDING})
        if self.spec.admit_after > 1:
            self._count_waiting(c["waiting"], c["waiting_pos"], c["admitted_pos"], call)
        self.calls += 1
        if self.reference:
            self._reindex()
        else:
            self._index = _index_replace(self._index, self.capacity, new, result.new_ids)

    def _choose(self, n: int, evictable: Tensor) -> tuple[Tensor, bool]:
        """The slots of ``n`` new ids (free slots by slot number, then the
        evictable ids by (last use or use count, id)) and whether they overflow.
        Selects in O(slots); the reference twin sorts every slot."""
        if self.reference:
            order = self._eviction_order()
            candidates = order[(~self.occupied | evictable)[order]]
            return candidates[:n], n > candidates.numel()
        free = (~self.occupied).nonzero().squeeze(1) if self._held < self.capacity else None
        free = free if free is not None else self.slot_ids.new_zeros(0)
        if n <= free.numel():
            return free[:n], False
        k = n - free.numel()
        if k > int(evictable.sum()):
            return free[:0], True
        primary = self.last_used if self.spec.evict == "lru" else self.uses
        picked = _k_smallest(primary, self.slot_ids, evictable, k)
        return torch.cat([free, _ordered(picked, primary, self.slot_ids)]), False

    def _entries_for(self, n: int, seen: Tensor, last: Tensor, call: int) -> Tensor:
        """Up to ``n`` entries of the waiting list for new ids: free ones by
        position, then those not seen in this call by (last seen, id)."""
        free = (~seen).nonzero().squeeze(1)
        reusable = seen & (last < call)
        if self.reference:
            everyone = torch.arange(self.capacity, device=self.device)
            return torch.cat([free, _ordered(everyone[reusable], last, self.pend_ids)])[:n]
        if n <= free.numel():
            return free[:n]
        k = min(n - free.numel(), int(reusable.sum()))
        picked = _k_smallest(last, self.pend_ids, reusable, k) if k else free[:0]
        return torch.cat([free, _ordered(picked, last, self.pend_ids)])

    def _eviction_order(self) -> Tensor:
        """Every slot, in the order they are given to new ids: free slots by
        slot number, then held ones by (last use or use count, id)."""
        slots = torch.arange(self.capacity, device=self.device)
        by_id = torch.argsort(self.slot_ids, stable=True)
        primary = self.last_used if self.spec.evict == "lru" else self.uses
        by_use = by_id[torch.argsort(primary[by_id], stable=True)]
        held = by_use[self.occupied[by_use]]
        return torch.cat([slots[~self.occupied], held])

    def _count_waiting(
        self, waiting: Tensor, pos: Tensor, admitted_pos: Tensor, call: int
    ) -> Tensor:
        """One more sighting of each waiting id; admitted ones leave the list;
        a new waiting id takes a free entry, else the least recently seen one
        not seen in this call (ties by id); if none is left it is not counted.
        Returns the entries it changes, their old values kept in ``undo``."""
        gone = admitted_pos[admitted_pos >= 0]
        known = pos[pos >= 0]
        seen = self.pend_seen.clone()
        seen[gone] = False
        last = self.pend_last.clone()
        last[known] = call
        fresh = waiting[pos < 0]
        free = self._entries_for(fresh.numel(), seen, last, call)
        fresh = fresh[: free.numel()]
        touched = torch.cat([gone, known, free])
        assert self.undo is not None
        self.undo["pend"] = touched
        self.undo.update({n: getattr(self, n)[touched] for n in _PENDING})
        self.pend_seen[gone] = False
        self.pend_count[known] += 1
        self.pend_last[known] = call
        self.pend_ids[free] = fresh
        self.pend_seen[free] = True
        self.pend_count[free] = 1
        self.pend_last[free] = call
        if not self.reference:
            self._pend_index = _index_replace(self._pend_index, self.capacity, free, fresh, gone)
        return touched


def _ordered(picked: Tensor, key: Tensor, ids: Tensor) -> Tensor:
    """``picked`` positions by (key, id)."""
    by_id = picked[torch.argsort(ids[picked], stable=True)]
    return by_id[torch.argsort(key[by_id], stable=True)]


def _k_smallest(key: Tensor, ids: Tensor, among: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` smallest (key, id) of the positions ``among``
    (keys >= -1: call numbers or use counts), in no order: one histogram of
    the keys finds the threshold key, then the ties at it go by id."""
    values = key[among] + 1
    counts = torch.bincount(values).cumsum(0)
    threshold = int(torch.searchsorted(counts, k))  # the k-th smallest key (+1)
    below = (among & (key < threshold - 1)).nonzero().squeeze(1)
    tied = (among & (key == threshold - 1)).nonzero().squeeze(1)
    ties = tied[torch.topk(ids[tied], k - below.numel(), largest=False).indices]
    return torch.cat([below, ties])


def _index_replace(
    index: tuple[Tensor, Tensor], size: int, positions: Tensor, keys: Tensor,
    removed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``index`` with whatever ``positions`` (and ``removed``) held taken out
    and ``keys`` (sorted, absent from it) put in at ``positions``: a merge in
    O(index), no sort of the index."""
    held, at = index
    if not positions.numel() and (removed is None or not removed.numel()):
        return index
    gone = torch.zeros(size, dtype=torch.bool, device=at.device)
    gone[positions] = True
    if removed is not None:
        gone[removed] = True
    keep = ~gone[at]
    held, at = held[keep], at[keep]
    n = held.numel() + keys.numel()
    dest = torch.searchsorted(held, keys) + torch.arange(keys.numel(), device=at.device)
    old_place = torch.ones(n, dtype=torch.bool, device=at.device)
    old_place[dest] = False
    old_dest = old_place.nonzero().squeeze(1)  # the old entries keep their order
    out_keys, out_at = held.new_empty(n), at.new_empty(n)
    out_keys[dest], out_at[dest] = keys, positions
    out_keys[old_dest], out_at[old_dest] = held, at
    return out_keys, out_at


def _last_in_order(primary: Tensor, ids: Tensor, n: int) -> Tensor:
    """Positions of the last ``n`` entries by (``primary``, id), returned in id order."""
    order = _ordered(torch.arange(ids.numel(), device=ids.device), primary, ids)
    kept = order[max(0, order.numel() - n) :]
    return kept[torch.argsort(ids[kept])]


def _sorted_index(keys: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    positions = present.nonzero().squeeze(1)
    held = keys[positions]
    order = torch.argsort(held)
    return held[order], positions[order]


def _find(index: tuple[Tensor, Tensor], ids: Tensor) -> Tensor:
    keys, positions = index
    if not keys.numel():
        return torch.full_like(ids, -1, dtype=torch.int64)
    at = torch.searchsorted(keys, ids).clamp(max=keys.numel() - 1)
    hit = keys[at] == ids
    return torch.where(hit, positions[at], -1)
