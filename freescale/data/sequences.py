"""Turn user histories into samples: a leave-one-out split, training targets, epochs.

The split (the protocol of SASRec and its successors): per user, the last
interaction is the test target, the one before it the validation target,
and training targets come only from the earlier prefix, so no held-out
interaction is ever a training input or target. Users with fewer than
``holdout + 1`` interactions have nothing to evaluate and are dropped.

Training order: position ``p`` of the stream is sample ``p mod N`` of epoch
``p // N`` (N training samples), through a permutation seeded by (seed,
epoch) when shuffling. Global step ``s`` reads positions
``[s * W * B, (s + 1) * W * B)`` and every sample is a pure function of
(seed, p): any world size, sharded or not, sees the same stream of samples (a
resumed run continues it where it stopped, at any world size:
`freescale.data.stream`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from freescale.data.ids import ITEMS, Catalogue
from freescale.data.readers import SequenceDataset, UserHistory
from freescale.data.stream import SampleStream
from freescale.data.synthetic import RawSample, samples_to_batch
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema

SPLITS = ("valid", "test")
ItemContent = dict[str, tuple[np.ndarray, np.ndarray]]  # per feature: (offsets, values) by item
EVAL_SEED = 0x5A5  # evaluation negatives: the same for every run, whatever its seed


@dataclass(frozen=True)
class SequenceSampling:
    """How histories become samples.

    Training sample at target position t: UIH = the (at most ``max_uih``)
    items before t; candidates = the ``num_positives`` items from t on
    (label 1) plus ``num_negatives`` items drawn uniformly from the
    catalogue (`freescale.data.ids`; label 0; an accidental hit on a
    real next item stays a negative, as in the usual sampled-softmax
    set-up), shuffled. Targets per
    user: the last allowed one, then every ``stride`` items earlier, at most
    ``samples_per_user`` of them (0: all the way to the first item).

    Evaluation sample of a split: UIH = the items before its target;
    candidates = the target plus ``eval_negatives`` distinct items the user
    never interacted with, drawn with a fixed seed (``EVAL_SEED``).
    """

    max_uih: int = 200
    num_positives: int = 1
    num_negatives: int = 4
    samples_per_user: int = 1
    stride: int = 1
    holdout: int = 2  # 2: leave-one-out validation + test; 0: train on whole histories
    shuffle: bool = False
    eval_negatives: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_uih < 1:
            raise ValueError(f"max_uih must be >= 1, got {self.max_uih}")
        if self.num_negatives < 0 or self.samples_per_user < 0:
            raise ValueError("num_negatives and samples_per_user must be >= 0")
        if self.num_positives < 1 or self.stride < 1 or self.eval_negatives < 1:
            raise ValueError("num_positives, stride and eval_negatives must be >= 1")
        if self.holdout not in (0, 2):
            raise ValueError(
                f"holdout must be 0 (no split) or 2 (leave-one-out), got {self.holdout}"
            )


class SequenceSource(SampleStream):
    """A `DataSource` over a `SequenceDataset`, cycling through epochs."""

    def __init__(self, dataset: SequenceDataset, sampling: SequenceSampling | None = None):
        self.dataset = dataset
        self.sampling = s = sampling or SequenceSampling()
        self.num_items = dataset.num_items
        self.num_actions = dataset.num_actions
        # raw ids: the items in the reader's order (positions index the per-item tables)
        raw = dataset.item_ids if dataset.raw_ids else None
        self.catalogue = Catalogue(dataset.num_items, raw)
        # the standard features plus the dataset's own (`freescale.data.columnar`)
        self.schema = DataSchema.standard(
            self.num_items, self.num_actions, dataset.features, raw_items=dataset.raw_ids
        )
        # the catalogue's own id of each row (`freescale.data.ids`), where the reader remapped
        remapped = dataset.item_ids is not None and not dataset.raw_ids
        self.id_maps = {ITEMS: dataset.item_ids} if remapped else {}
        index = []
        self.eval_users: list[int] = []
        self.users_dropped = 0  # too short for any training or evaluation sample
        for u, h in enumerate(dataset.users):
            n = h.items.size
            evaluated = bool(s.holdout) and n >= s.holdout + 1
            if evaluated:
                self.eval_users.append(u)
            targets = training_targets(n, s)
            index += [(int(h.timestamps[t]), u, t) for t in targets]
            self.users_dropped += not (evaluated or len(targets))
        index.sort()
        self.index = np.array([(u, t) for _, u, t in index], dtype=np.int64).reshape(-1, 2)
        self._order_cache: tuple[int, np.ndarray | None] = (-1, None)

    def __len__(self) -> int:
        return len(self.index)

    def num_steps(self, world_size: int, batch_size: int) -> int | None:
        return None  # epochs repeat: any number of steps

    def steps_per_epoch(self, world_size: int, batch_size: int) -> int:
        """Whole global batches in one pass over the training samples."""
        return len(self.index) // max(world_size * batch_size, 1)

    def split_counts(self) -> dict[str, int]:
        return {
            "users": len(self.dataset.users),
            "eval_users": len(self.eval_users),
            "train_samples": len(self.index),
            "users_dropped": self.users_dropped,
        }

    # ---- training ----------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray | None:
        if not self.sampling.shuffle:
            return None
        if self._order_cache[0] != epoch:  # positions are read in order: one epoch at a time
            rng = np.random.default_rng([self.sampling.seed, 0xE90C, epoch])
            self._order_cache = (epoch, rng.permutation(len(self)))
        return self._order_cache[1]

    def sample_at(self, p: int) -> tuple[int, int]:
        """(user, target) at stream position ``p``."""
        epoch, k = divmod(p, len(self.index))
        order = self._order(epoch)
        return tuple(self.index[k if order is None else order[k]].tolist())

    def raw_sample(self, p: int, max_uih: int | None = None) -> RawSample:
        u, t = self.sample_at(p)
        rng = np.random.default_rng([self.sampling.seed, p])
        return training_sample(
            self.dataset.users[u], t, self.sampling, self.catalogue, rng,
            self.dataset.item_features, max_uih, self.dataset.item_content,
        )  # fmt: skip

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch:
        first = self.first_position(step, rank, world_size, batch_size)
        if step < 0 or first < 0 or not 0 <= rank < world_size or batch_size < 0 or not len(self):
            raise ValueError(
                f"step {step} rank {rank}/{world_size} is outside this dataset "
                f"({len(self)} training samples)"
            )
        ids = torch.arange(first, first + batch_size, dtype=torch.int64)
        samples = [self.raw_sample(p) for p in range(first, first + batch_size)]
        return samples_to_batch(samples, ids, 0, self.dataset.features)

    # ---- evaluation --------------------------------------------------------
    def eval_steps(self, world_size: int, batch_size: int) -> int:
        """Global evaluation batches that hold every evaluated user once."""
        return math.ceil(len(self.eval_users) / max(world_size * batch_size, 1))

    def eval_target(self, split: str, j: int) -> tuple[int, int]:
        """(user, target position) of evaluated user ``j`` in ``split``."""
        u = self.eval_users[j]
        n = self.dataset.users[u].items.size
        return u, n - self.sampling.holdout + SPLITS.index(split)

    def eval_sample(self, split: str, j: int) -> RawSample:
        u, t = self.eval_target(split, j)
        h = self.dataset.users[u]
        return evaluation_sample(
            h, t, h.items, split, j, self.sampling, self.catalogue, self.dataset.item_features,
            self.dataset.item_content,
        )  # fmt: skip

    def eval_batch(
        self, split: str, step: int, rank: int, world_size: int, batch_size: int
    ) -> SampleBatch:
        """Rank ``rank``'s users of evaluation step ``step`` (empty past the last user)."""
        if split not in SPLITS or not self.sampling.holdout:
            raise ValueError(f"no {split!r} split (holdout={self.sampling.holdout})")
        first = (step * world_size + rank) * batch_size
        last = min(first + batch_size, len(self.eval_users))
        ids = torch.arange(first, max(first, last), dtype=torch.int64)
        samples = [self.eval_sample(split, j) for j in ids.tolist()]
        return samples_to_batch(samples, ids, 0, self.dataset.features)

    def popularity(self) -> np.ndarray:
        """Interactions per item over the training part of every history, by
        catalogue position."""
        counts = np.zeros(self.num_items, dtype=np.int64)
        for h in self.dataset.users:
            trained = h.items[: max(h.items.size - self.sampling.holdout, 0)]
            np.add.at(counts, self.catalogue.positions(trained), 1)
        return counts


def evaluation_sample(
    h: UserHistory,
    t: int,
    seen: np.ndarray,
    split: str,
    j: int,
    s: SequenceSampling,
    items: Catalogue,
    item_features: dict[str, np.ndarray],
    item_content: ItemContent | None = None,
) -> RawSample:
    """Evaluated user ``j``'s sample of ``split``: UIH = the (at most ``max_uih``)
    events of ``h`` before its target ``t``; candidates = the target plus
    ``eval_negatives`` items of ``items`` not in ``seen`` (all the user's items),
    drawn with (``EVAL_SEED``, split, j). The in-memory and the split sources share it."""
    lo = max(0, t - s.max_uih)
    rng = np.random.default_rng([EVAL_SEED, SPLITS.index(split), j])
    neg = items.ids(eval_negatives(rng, items.positions(seen), items.size, s.eval_negatives))
    cand = np.concatenate([h.items[t : t + 1], neg])
    labels = np.zeros(cand.size)
    labels[0] = 1.0
    return history_sample(h, lo, t, cand, labels, item_features, item_content, items)


def training_targets(n: int, s: SequenceSampling) -> range:
    """The training target positions of a history of ``n`` events: the last
    allowed one, then every ``stride`` earlier, at most ``samples_per_user``."""
    targets = range(n - s.holdout - s.num_positives, 0, -s.stride)
    return targets[: s.samples_per_user] if s.samples_per_user else targets


def training_sample(
    h: UserHistory,
    t: int,
    s: SequenceSampling,
    items: Catalogue,
    rng: np.random.Generator,
    item_features: dict[str, np.ndarray],
    max_uih: int | None = None,
    item_content: ItemContent | None = None,
) -> RawSample:
    """The training sample of ``h`` at target ``t`` (`SequenceSampling`), its
    negatives drawn from ``items`` with ``rng``."""
    lo = max(0, t - (s.max_uih if max_uih is None else max_uih))
    pos = h.items[t : t + s.num_positives]
    neg = items.draw(rng, s.num_negatives)
    order = rng.permutation(pos.size + neg.size)
    cand = np.concatenate([pos, neg])[order]
    labels = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])[order]
    return history_sample(h, lo, t, cand, labels, item_features, item_content, items)


def history_sample(
    h: UserHistory,
    lo: int,
    t: int,
    cand: np.ndarray,
    labels: np.ndarray,
    item_features: dict[str, np.ndarray],
    item_content: ItemContent | None = None,
    items: Catalogue | None = None,
) -> RawSample:
    """The sample of history ``h``: UIH = events ``[lo, t)``, every per-event
    feature sliced with the items; a candidate's features are its item's, and
    so is its content (``item_content``: each content feature's (offsets,
    values) by item; ``content_ids`` then names the candidate's own item once
    per content item, so every content feature shares one segment per candidate).
    Per-item tables are by catalogue position (``items``; None: ids are positions)."""
    cand = cand.astype(np.int64)
    at = cand if items is None or not (item_features or item_content) else items.positions(cand)
    lengths, gathered = np.zeros(cand.size, dtype=np.int64), {}
    for name, (offsets, values) in (item_content or {}).items():
        lengths = offsets[at + 1] - offsets[at]
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        gathered[name] = values[np.repeat(offsets[at], lengths) + within]
    return RawSample(
        uih_ids=h.items[lo:t],
        actions=h.actions[lo:t],
        timestamps=h.timestamps[lo:t],
        cand_ids=cand,
        labels=labels.astype(np.float32),
        content_lengths=lengths,
        content_ids=np.repeat(cand, lengths),
        dense=np.zeros(0, dtype=np.float32),
        uih_features={name: values[lo:t] for name, values in h.features.items()},
        cand_features={name: table[at] for name, table in item_features.items()},
        content_features=gathered,
    )


def eval_negatives(
    rng: np.random.Generator, history: np.ndarray, num_items: int, count: int
) -> np.ndarray:
    """``count`` distinct items of ``0..num_items-1`` not in ``history`` (all of
    them if fewer exist); catalogue positions, for raw ids (`evaluation_sample`)."""
    seen = np.unique(history)
    if num_items - seen.size <= count:
        return np.setdiff1d(np.arange(num_items), seen)
    picked = np.zeros(0, dtype=np.int64)
    while picked.size < count:
        draw = rng.integers(0, num_items, 2 * count + 8)
        draw = draw[~np.isin(draw, seen)]
        both = np.concatenate([picked, draw])
        _, first = np.unique(both, return_index=True)
        picked = both[np.sort(first)]
    return picked[:count]
