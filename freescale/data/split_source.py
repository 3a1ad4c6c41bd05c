"""``parquet-stream:DST`` on a split directory (`freescale.data.split`): train and evaluate.

Training streams ``DST/train`` (a `ParquetStreamSource` with ``holdout`` 0:
its histories already lack the two held-out events, so the training targets
are those of the whole histories with ``holdout`` 2, the in-memory ones).
Evaluation reads ``DST/validation`` and ``DST/test`` with the in-memory
source's interface (`eval_steps`, `eval_batch`, `popularity`,
`split_counts`), so `freescale.pipeline.evaluator` runs on it unchanged:
evaluation step ``k`` gives rank ``r`` the rows ``[(k * W + r) * B, ... + B)``
of the split (rows numbered over the files in name order), each rank reading
only the row groups that hold them (one in memory); the sample of row ``j``
is `sequences.evaluation_sample` of the in-memory evaluated user ``j``, byte
for byte. The popularity baseline counts the items of ``train/`` (one pass
over its ``items`` column, at the first call, with the training sample count).

`open_stream` is the ``parquet-stream`` factory: a split directory gives this
source, anything else the plain stream (which refuses one part of a split).
A split's ids are below its ``freescale.num_items`` (``data split`` checks
every one): raw ids (`freescale.data.ids`) change nothing here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freescale.data.columnar import _pyarrow
from freescale.data.ids import LAYOUT_IDS, read_maps
from freescale.data.parquet_files import scan_files
from freescale.data.parquet_stream import ParquetStreamSource
from freescale.data.readers import DataFormatError, UserHistory
from freescale.data.rows import ListColumn, RowRules, first_bad_row, list_columns
from freescale.data.sequences import SPLITS, SequenceSampling, evaluation_sample
from freescale.data.split import LATER, MARKER, PARTS, join, read_marker
from freescale.data.synthetic import samples_to_batch
from freescale.jagged.batch import SampleBatch


def open_stream(
    spec: str,
    sampling: SequenceSampling | None = None,
    num_items: int = 2_000,
    raw: bool = False,
    **options: Any,
) -> ParquetStreamSource:
    """``parquet-stream:spec``: a `SplitStreamSource` on a split directory, else the
    stream (``raw``: its item ids are any int64, `ParquetStreamSource`)."""
    if read_marker(spec) is not None:
        source = SplitStreamSource(spec, sampling, num_items, **options)
        source.id_maps = read_maps(spec, LAYOUT_IDS)  # written by data convert, kept by split
        return source
    source = ParquetStreamSource(spec, sampling, num_items, raw=raw, **options)
    source.id_maps = read_maps(spec, LAYOUT_IDS) if Path(spec).is_dir() else {}
    part = source.files.metadata.get("freescale.split")
    if part:
        raise ValueError(
            f"{spec}: {source.files.paths[0]} is the {part} part of a split (freescale data "
            f"split): give parquet-stream the split directory (the one with {MARKER}; a split "
            "without it was interrupted: run data split again)"
        )
    return source


class HeldOut:
    """The rows of ``validation/`` or ``test/``, by global row number (one row group held),
    checked as the stream checks its rows (``rules``: the training stream's)."""

    def __init__(self, spec: str, rules: RowRules, later: bool) -> None:
        self.files = scan_files(spec, [*rules.extra, *([LATER] if later else [])])
        self.rules, self.extra, self.later = rules, rules.extra, later
        self.starts = np.concatenate([[0], np.cumsum(self.files.piece_rows)]).astype(np.int64)
        self.rows = int(self.starts[-1])
        self._held: tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None

    def row(self, j: int) -> tuple[UserHistory, np.ndarray]:
        """Row ``j``: (its history, target last; every item of the user)."""
        piece = int(np.searchsorted(self.starts, j, side="right")) - 1
        if self._held is None or self._held[0] != piece:
            self._held = (piece, self._load(piece))
        lists, r = self._held[1], j - int(self.starts[piece])

        def cut(column: str) -> np.ndarray:
            offsets, values = lists[column]
            return values[offsets[r] : offsets[r + 1]]

        items = cut("items")
        n = items.size
        history = UserHistory(
            items,
            cut("actions") if "actions" in lists else np.zeros(n, dtype=np.int64),
            cut("timestamps") if "timestamps" in lists else np.arange(n, dtype=np.int64),
            {c: cut(c) for c in self.extra},
        )
        return history, np.concatenate([items, cut(LATER)]) if self.later else items

    def _load(self, piece: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every list column of a row group as (offsets, int64 values), checked."""
        pa = _pyarrow()
        import pyarrow.parquet as pq

        path = self.files.paths[self.files.piece_file[piece]]
        group = int(self.files.piece_group[piece])
        try:
            with self.files.filesystem.open_input_file(path) as f:
                table = pq.ParquetFile(f).read_row_group(group, columns=self.files.columns)
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(path, f"row group {group}", str(e).splitlines()[0]) from None
        first = int(self.files.piece_first[piece])

        def fail(row: int, why: str) -> DataFormatError:
            return DataFormatError(path, f"row group {group}, row {first + row}", why)

        columns = list_columns(table, self.files.columns)  # items first
        later = columns.pop(LATER, None)
        found = first_bad_row(columns, self.rules)
        if found is not None:
            raise fail(*found)
        empty = columns["items"].lengths() == 0
        if empty.any():
            raise fail(
                int(np.argmax(empty)), "items has 0 values: not a row of freescale data split"
            )
        if later is not None:
            r = _not_one_item(later, self.rules.num_items)
            if r is not None:
                why = f"{LATER} is not one item id in 0..{self.rules.num_items - 1}"
                raise fail(r, f"{why}: not a row of freescale data split")
            columns[LATER] = later
        return {
            c: (col.offsets, col.values.astype(np.int64, copy=False)) for c, col in columns.items()
        }


def _not_one_item(later: ListColumn, num_items: int) -> int | None:
    """The first row of a ``later_items`` column that is not one item id, else None."""
    bad = later.lengths() != 1
    if later.null_rows is not None:
        bad |= later.null_rows
    flags = (later.values < 0) | (later.values >= num_items)
    if later.null_values is not None:
        flags |= later.null_values
    row = later.row_of(flags)
    if row is not None:
        bad[row] = True
    return int(np.argmax(bad)) if bad.any() else None


class SplitStreamSource(ParquetStreamSource):
    """Streamed training on ``DST/train``, evaluation on ``DST/validation`` and
    ``DST/test`` (module docstring)."""

    no_evaluation = ""  # the evaluator runs

    def __init__(
        self,
        spec: str,
        sampling: SequenceSampling | None = None,
        num_items: int = 2_000,
        **options: Any,
    ) -> None:
        sampling = sampling or SequenceSampling()
        if not sampling.holdout:
            raise ValueError(f"{spec}: a split holds out 2 events per user; holdout=0 reads SRC")
        super().__init__(
            join(spec, PARTS["train"]), replace(sampling, holdout=0), num_items, **options
        )
        self.split_spec = spec
        self.heldout = {
            split: HeldOut(join(spec, PARTS[split]), RowRules.of(self), split == "valid")
            for split in SPLITS
        }
        rows = {split: h.rows for split, h in self.heldout.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"{spec}: validation and test rows differ ({rows}): not one split")
        for split, h in self.heldout.items():
            got = h.files.metadata.get("freescale.num_items")
            if got != str(self.num_items):
                raise ValueError(
                    f"{spec}: {PARTS[split]}/ has freescale.num_items={got}, train/ "
                    f"{self.num_items}: not one split"
                )
        self._train_pass: tuple[np.ndarray, dict[str, int]] | None = None

    # ---- evaluation: the in-memory source's interface ------------------------
    def eval_steps(self, world_size: int, batch_size: int) -> int:
        """Global evaluation batches that hold every evaluated user once."""
        return math.ceil(self.heldout["test"].rows / max(world_size * batch_size, 1))

    def eval_batch(
        self, split: str, step: int, rank: int, world_size: int, batch_size: int
    ) -> SampleBatch:
        """Rank ``rank``'s users of evaluation step ``step`` (empty past the last user)."""
        if split not in SPLITS:
            raise ValueError(f"no {split!r} split")
        held = self.heldout[split]
        first = (step * world_size + rank) * batch_size
        last = min(first + batch_size, held.rows)
        ids = torch.arange(first, max(first, last), dtype=torch.int64)
        samples = []
        for j in ids.tolist():
            h, seen = held.row(j)
            t = h.items.size - 1  # the row's last event is its target
            s, items = self.sampling, self.catalogue
            samples.append(evaluation_sample(h, t, seen, split, j, s, items, {}))
        return samples_to_batch(samples, ids, 0, self.features)

    def popularity(self) -> np.ndarray:
        """Interactions per item over ``train/`` (the training part of every history)."""
        return self._train_totals()[0]

    def split_counts(self) -> dict[str, int]:
        return self._train_totals()[1]

    def _train_totals(self) -> tuple[np.ndarray, dict[str, int]]:
        """One pass over ``train/``'s items: item counts, users, training samples."""
        if self._train_pass is None:
            import pyarrow.compute as pc

            counts = np.zeros(self.num_items, dtype=np.int64)
            for piece in range(self.files.piece_rows.size):
                items = self._read(piece, ["items"]).column("items")
                values = pc.list_flatten(items).to_numpy(zero_copy_only=False)
                counts += np.bincount(values.astype(np.int64), minlength=self.num_items)
            users = int(self.files.piece_rows.sum())
            evaluated = self.heldout["test"].rows
            self._train_pass = (
                counts,
                {
                    "users": users,
                    "eval_users": evaluated,
                    "train_samples": sum(self._count(p) for p in range(self.files.piece_rows.size)),
                    "users_dropped": users - evaluated,
                },
            )
        return self._train_pass


def stream_counts(source: ParquetStreamSource) -> dict[str, int]:
    """`SequenceSource.split_counts` of streamed data, in one pass over the
    ``items`` lengths (a split directory: its own counts)."""
    if hasattr(source, "split_counts"):
        return source.split_counts()
    import pyarrow.compute as pc

    s = source.sampling
    users = evaluated = dropped = 0
    for piece in range(source.files.piece_rows.size):
        items = source._read(piece, ["items"]).column("items")
        n = pc.list_value_length(items).fill_null(0).to_numpy(zero_copy_only=False)
        held = (n >= s.holdout + 1) if s.holdout else np.zeros(n.size, dtype=bool)
        has_targets = n - s.holdout - s.num_positives >= 1
        users += n.size
        evaluated += int(held.sum())
        dropped += int((~held & ~has_targets).sum())
    samples = sum(source._count(p) for p in range(source.files.piece_rows.size))
    return {
        "users": users,
        "eval_users": evaluated,
        "train_samples": samples,
        "users_dropped": dropped,
    }
