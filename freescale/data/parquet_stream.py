"""Streaming Parquet (``parquet-stream:PATH``): user histories far larger than memory.

PATH is a Parquet file, a directory of them (searched recursively; names
starting with ``_`` or ``.`` are skipped), a local glob (``logs/*/part-*.parquet``)
or a URL pyarrow's file systems read (``s3://bucket/logs/``). The layout is
the one `freescale.data.columnar` reads, one row per user with list columns,
and every row is checked by its code (`columnar._history`: equal list
lengths, actions in range, no negative id, events sorted by ``timestamps``),
with two differences:

- **Ids as given.** Item ids are not remapped (that needs a pass over all
  the data): they are integers in ``[0, num_items)``. ``num_items`` is the
  file metadata key ``freescale.num_items`` when the first file has it,
  else ``data.num_items``. Raw ids (``raw``: a dynamic item table takes
  them, `freescale.data.ids`) are any int64 instead, no ``num_items``
  needed: negatives are drawn from the ids the data has, found by one pass
  over every ``items`` column when first needed (each rank: memory 8 bytes
  per distinct item), which also gives ``num_items`` (their count).
  ``num_actions`` likewise: ``freescale.num_actions``,
  else the option ``data.num_actions``, else ``MAX_ACTIONS`` (1 without an
  ``actions`` column). Extra features (``data.features``) must be ``uih``
  level with ROWS given; candidates-level features need a per-item table,
  i.e. a pass over all the data, and are refused.
- **Order.** Samples are not sorted by time; they follow the stream below.

Pieces and epochs. The unit of reading is a row group ("piece"), numbered
in file order (files sorted by path). Epoch ``e`` permutes the pieces with
(seed, e) (``data.shuffle=false``: file order) and deals them round-robin:
rank ``r`` of ``W`` reads pieces ``perm[r::W]``, a disjoint share. A rank's
share is cut into windows of consecutive pieces of at least
``shuffle_buffer`` rows; the samples of a window are shuffled with (seed, e,
rank, window). Memory per rank is one window (plus its last row group),
whatever the size of the data. Each rank's stream runs on through its own
epochs: rank ``r``'s batch of global step ``s`` is samples ``[s*B, (s+1)*B)``
of its stream, a pure function of (seed, W, r, B, s). (A run resumed at
another world size: a function of its segments too, below.)

Samples of a row: the training targets of `sequences.training_targets` (the
same ``samples_per_user`` / ``target_stride`` / ``max_uih`` rules as the
in-memory sources, the last ``holdout`` = 2 events of each user held out),
negatives drawn with (seed, epoch, sample id). A sample's id is stable:
``file << 48 | row in file << 16 | target number`` (`split_sample_id`).

Resume: at the world size of the checkpoint, step ``n`` reads exactly what
the uninterrupted run read (the stream is a function of the step; reaching
step ``n`` reads the ``items`` column of the row groups before it to count
their samples). At another world size W' the run's epochs go on where they
stood (`freescale.data.stream_resume`): each old rank's unread samples, up
to the latest epoch any rank has begun, are dealt window by window (a
partly read one from where it stopped) round-robin to the W' new ranks,
which then read fresh epochs dealt over W'. Over the whole run and any
chain of resumes (the checkpoint records the world sizes by step), the
samples read in an epoch hold no repeat, and an epoch every rank has passed
was read whole. Finding where each old rank stood counts the samples of
the row groups every old rank read (their ``items`` column).
No held-out evaluation: ``evaluation.every`` is skipped with a note (a split
directory of ``freescale data split`` evaluates: `freescale.data.split_source`).

Checks: footers at construction (`parquet_files.scan_files`); then, before step 0, every
row (``data.check=on``, the default; `check_rows`, `freescale.data.stream_check`:
the rules of `columnar._history` and `_check_range`, `freescale.data.rows`, per row group,
the row groups shared between the ranks, the first problem in piece order
raised by every rank, one line ``PATH: row group G, row R: WHY``, CLI rc 2).
``data.check=off`` skips that pass: a bad row then fails at the step whose
window reads it, with the same line (`_histories`, the per-row reference).

Cost: piece sample counts are cached (a few integers per row group); with
``data.loader_workers`` > 1 each worker reads every window of its rank's
stream (Parquet decoding repeated per worker) and builds only its own steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from freescale.data.columnar import MAX_ACTIONS, _as_ints, _history, _pyarrow, parse_features
from freescale.data.ids import Catalogue
from freescale.data.parquet_files import ID_BITS, metadata_int, scan_files
from freescale.data.readers import DataFormatError, UserHistory
from freescale.data.rows import RowRules, first_bad_row, list_columns
from freescale.data.sequences import SequenceSampling, training_sample, training_targets
from freescale.data.stream_check import check_rounds
from freescale.data.stream_resume import SegmentedStream
from freescale.data.synthetic import samples_to_batch
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema, Feature

OPTIONS = ("features", "shuffle_buffer", "num_actions", "check")
DEFAULT_SHUFFLE_BUFFER = 10_000  # rows per shuffle window


def split_sample_id(sample_id: int) -> tuple[int, int, int]:
    """(file index, row in file, target number) of a streamed sample's id."""
    return sample_id >> 48, (sample_id >> 16) & (2**32 - 1), sample_id & (2**16 - 1)


class ParquetStreamSource(SegmentedStream):
    """A `DataSource` that streams row groups of Parquet files (module docstring)."""

    no_evaluation = (
        "parquet-stream data without a held-out split: evaluation skipped "
        "(freescale data split writes one)"
    )

    def __init__(
        self,
        spec: str,
        sampling: SequenceSampling | None = None,
        num_items: int = 2_000,
        features: Any = None,
        shuffle_buffer: int | str = DEFAULT_SHUFFLE_BUFFER,
        num_actions: int | str | None = None,
        check: bool | str = True,
        raw: bool = False,
    ) -> None:
        self.check = _switch("data.check", check)
        self.raw = raw
        self.sampling = sampling or SequenceSampling()
        wanted = parse_features(features)
        for name, level, rows in wanted:
            if level != "uih" or rows is None:
                raise ValueError(
                    f"parquet-stream: data.features {name}:{level} must be uih-level with ROWS "
                    "given (NAME:uih:ROWS); candidates-level features need a pass over all data"
                )
        self.shuffle_buffer = _positive("data.shuffle_buffer", shuffle_buffer)
        self.extra = [name for name, _, _ in wanted]
        self.files = scan_files(spec, self.extra)
        self.spec = spec
        self._rows_catalogue = (
            None if raw else Catalogue(metadata_int(self.files, "num_items", num_items))
        )
        self._raw_catalogue: Catalogue | None = None
        given = None if num_actions is None else _positive("data.num_actions", num_actions)
        default = MAX_ACTIONS if "actions" in self.files.columns else 1
        self.num_actions = metadata_int(self.files, "num_actions", given) or default
        self.features = tuple(Feature(name, "uih", rows) for name, _, rows in wanted)
        self.rows = {name: rows for name, _, rows in wanted}
        self._counts: dict[int, int] = {}  # piece -> training samples (cached, small)
        # per stream (`rank_stream`'s key): where it was last read, the window in
        # memory (its key, its samples in stream order, their shuffled order)
        self._cursor: dict[tuple, tuple] = {}
        self._window: dict[tuple, tuple[tuple, list, np.ndarray]] = {}
        self._plans: dict[tuple, list] = {}  # the rank streams of each resumed run
        self._windows: dict[tuple[int, int], tuple[int, list[np.ndarray]]] = {}  # one epoch's

    # ---- the items -----------------------------------------------------------
    @property
    def catalogue(self) -> Catalogue:
        """Where negatives come from: rows below ``num_items``, or (raw ids) the
        ids the data has, sorted (one pass over the ``items`` columns, kept)."""
        if self._rows_catalogue is not None:
            return self._rows_catalogue
        if self._raw_catalogue is None:
            self._raw_catalogue = Catalogue(0, self._distinct_items())
        return self._raw_catalogue

    @property
    def num_items(self) -> int:
        return self.catalogue.size

    @property
    def schema(self) -> DataSchema:
        return DataSchema.standard(
            self.num_items, self.num_actions, self.features, raw_items=self.raw
        )

    def _distinct_items(self) -> np.ndarray:
        import pyarrow.compute as pc

        found = np.zeros(0, dtype=np.int64)
        for piece in range(self.files.piece_rows.size):
            items = self._read(piece, ["items"]).column("items")
            values = pc.list_flatten(items).drop_null().to_numpy(zero_copy_only=False)
            if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
                self._histories(piece)  # names the row, as the check does (data.check=off)
            found = np.union1d(found, values.astype(np.int64))
        return found

    # ---- the DataSource protocol -------------------------------------------
    def num_steps(self, world_size: int, batch_size: int) -> int | None:
        return None  # epochs repeat: any number of steps

    def check_world(self, world_size: int, batch_size: int) -> None:
        """Fail at start if ``world_size`` ranks (or those of an earlier segment
        of a resumed run) cannot each read a share."""
        pieces = self.files.piece_rows.size
        for world in {world_size, *(w for _, w in self.segments or ())}:
            if pieces < world:
                raise ValueError(
                    f"{self.spec}: {pieces} row groups for {world} ranks; every rank needs "
                    "one (write smaller row groups or more files)"
                )

    def steps_per_read(self, batch_size: int) -> int:
        """Consecutive steps a loader worker should build (`loader.steps_per_read`):
        about a window's samples, so a window is decoded by one or two workers
        rather than by every worker whose steps touch it."""
        return max(1, min(16, self.shuffle_buffer // max(1, batch_size)))

    def check_rows(self, rank: int, world_size: int) -> Any:
        """This rank's share of the check of every row before step 0, one yield per
        round (`freescale.data.stream_check`); nothing with ``data.check=off``."""
        return check_rounds(self, rank, world_size) if self.check else iter(())

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch:
        if step < 0 or not 0 <= rank < world_size or batch_size < 0:
            raise ValueError(f"bad batch request: step {step} rank {rank}/{world_size}")
        self.check_world(world_size, batch_size)
        key, stream, first = self.rank_stream(step, rank, world_size, batch_size)
        ids, samples = [], []
        for q in range(first, first + batch_size):
            sid, sample = self.sample(q, key, stream)
            ids.append(sid)
            samples.append(sample)
        return samples_to_batch(samples, torch.tensor(ids, dtype=torch.int64), 0, self.features)

    # ---- the stream ----------------------------------------------------------
    def share(self, epoch: int, rank: int, world_size: int) -> np.ndarray:
        """The pieces ``rank`` reads in ``epoch``, in reading order."""
        n = self.files.piece_rows.size
        if self.sampling.shuffle:
            order = np.random.default_rng([self.sampling.seed, 0x57EA, epoch]).permutation(n)
        else:
            order = np.arange(n)
        return order[rank::world_size]

    def windows(self, epoch: int, rank: int, world_size: int) -> list[np.ndarray]:
        """The share cut into runs of pieces of at least ``shuffle_buffer`` rows."""
        held = self._windows.get((rank, world_size))
        if held is not None and held[0] == epoch:
            return held[1]
        out, run, rows = [], [], 0
        for piece in self.share(epoch, rank, world_size).tolist():
            run.append(piece)
            rows += int(self.files.piece_rows[piece])
            if rows >= self.shuffle_buffer:
                out.append(np.array(run))
                run, rows = [], 0
        if run:
            out.append(np.array(run))
        self._windows[(rank, world_size)] = (epoch, out)
        return out

    def window_samples(self, epoch: int, rank: int, world_size: int, w: int) -> int:
        """Training samples of window ``w`` (their count only: the ``items`` column)."""
        return sum(self._count(p) for p in self.windows(epoch, rank, world_size)[w].tolist())

    def sample(self, q: int, key: tuple, stream: Any) -> tuple[int, Any]:
        """(id, `RawSample`) at position ``q`` of a rank's stream (`rank_stream`)."""
        (epoch, world_size, rank, w, start), first = self.locate(q, key, stream)
        window = (epoch, rank, world_size, w)
        held = self._window.get(key)
        if held is None or held[0] != window:
            items = self._load_window(*window)
            order = np.arange(len(items))
            if self.sampling.shuffle:
                rng = np.random.default_rng([self.sampling.seed, 0x5B0F, epoch, rank, w])
                order = rng.permutation(len(items))
            held = self._window[key] = (window, items, order)
        _, items, order = held
        sid, history, t = items[int(order[start + q - first])]
        rng = np.random.default_rng([self.sampling.seed, 0x57E, epoch, sid])
        return sid, training_sample(history, t, self.sampling, self.catalogue, rng, {})

    def sample_at(self, q: int, rank: int, world_size: int) -> tuple[int, Any]:
        """(id, `RawSample`) at position ``q`` of ``rank``'s stream in a run that
        started at ``world_size`` ranks (its first segment)."""
        key, stream, _ = self.rank_stream(0, rank, world_size, 1)
        return self.sample(q, key, stream)

    # ---- reading -------------------------------------------------------------
    def _read(self, piece: int, columns: list[str]) -> Any:
        pa = _pyarrow()
        import pyarrow.parquet as pq

        path = self.files.paths[self.files.piece_file[piece]]
        group = int(self.files.piece_group[piece])
        try:
            with self.files.filesystem.open_input_file(path) as f:
                return pq.ParquetFile(f).read_row_group(group, columns=columns)
        except (pa.ArrowException, OSError) as e:
            why = str(e).splitlines()[0]
            raise DataFormatError(path, f"row group {group}", why) from None

    def _count(self, piece: int) -> int:
        """Training samples of a piece (its ``items`` lengths only)."""
        if piece not in self._counts:
            import pyarrow.compute as pc

            lengths = pc.list_value_length(self._read(piece, ["items"]).column("items"))
            n = np.asarray(lengths.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
            s = self.sampling
            m = n - s.holdout - s.num_positives
            count = np.maximum(0, (m + s.stride - 1) // s.stride)
            if s.samples_per_user:
                count = np.minimum(count, s.samples_per_user)
            self._counts[piece] = int(count.sum())
        return self._counts[piece]

    def _load_window(self, epoch: int, rank: int, world_size: int, w: int) -> list:
        """The samples of window ``w`` as (id, history, target), in stream order."""
        out = []
        for piece in self.windows(epoch, rank, world_size)[w].tolist():
            file = int(self.files.piece_file[piece])
            for row, history in self._histories(piece):
                targets = training_targets(history.items.size, self.sampling)
                if len(targets) > 2 ** ID_BITS[2]:  # found before step 0 unless data.check=off
                    where = f"row group {int(self.files.piece_group[piece])}, row {row}"
                    raise DataFormatError(
                        self.files.paths[file], where,
                        f"items has {history.items.size} events, {len(targets)} training "
                        f"targets: a sample id holds {2 ** ID_BITS[2]} per row (set "
                        "data.samples_per_user or data.target_stride)",
                    )  # fmt: skip
                for k, t in enumerate(targets):
                    out.append(((file << 48) | (row << 16) | k, history, t))
        return out

    def _histories(self, piece: int) -> list[tuple[int, UserHistory]]:
        """(row in file, checked history) of every row of a piece: numpy slices of
        whole columns (`rows.first_bad_row` checks all rows at once); a record
        batch with a bad row goes through the per-row reference, whose error names it."""
        table = self._read(piece, self.files.columns)
        rules, first, out = RowRules.of(self), int(self.files.piece_first[piece]), []
        for batch in table.to_batches():
            columns = list_columns(batch, self.files.columns)
            if first_bad_row(columns, rules) is not None:
                return self._reference_histories(piece, table)
            out += _sliced_histories(columns, first + len(out), self.extra)
        return out

    def _reference_histories(self, piece: int, table: Any) -> list[tuple[int, UserHistory]]:
        """`_histories` row by row through the in-memory reader's checks."""
        path = self.files.paths[self.files.piece_file[piece]]
        group = int(self.files.piece_group[piece])
        first = int(self.files.piece_first[piece])
        columns = {c: table.column(c).to_pylist() for c in self.files.columns}
        out = []
        for r in range(table.num_rows):
            where = f"row group {group}, row {first + r}"
            lists = {c: _as_ints(path, where, c, v[r], False) for c, v in columns.items()}
            history = _history(path, where, lists, None, self.extra, raw=self.raw)
            self._check_range(path, where, history)
            out.append((first + r, history))
        return out

    def _check_range(self, path: str, where: str, h: UserHistory) -> None:
        """The bounds a streamed row cannot be remapped into: ids, actions, features."""
        checks = (
            []
            if self.raw
            else [("items", h.items, self.num_items, "data.num_items / freescale.num_items")]
        )
        checks.append(("actions", h.actions, self.num_actions, "freescale.num_actions"))
        checks += [(c, h.features[c], self.rows[c], f"data.features {c}") for c in self.extra]
        for column, values, limit, setting in checks:
            if values.size and int(values.max()) >= limit:
                raise DataFormatError(
                    path,
                    where,
                    f"{column} value {int(values.max())} is outside 0..{limit - 1} ({setting})",
                )


def _sliced_histories(columns: dict[str, Any], first: int, extra: list[str]) -> list:
    """(row, `UserHistory`) of checked rows: each a slice of its columns' values,
    sorted by timestamp (stably) only where a row is out of order, as `_history` does."""
    values = {c: np.asarray(col.values, dtype=np.int64) for c, col in columns.items()}
    offsets = columns["items"].offsets.tolist()
    stamps = values.get("timestamps")
    out = []
    for r in range(len(offsets) - 1):
        lo, hi = offsets[r], offsets[r + 1]
        n = hi - lo
        row = {c: v[lo:hi] for c, v in values.items()}
        if stamps is not None and n > 1 and (np.diff(row["timestamps"]) < 0).any():
            order = np.argsort(row["timestamps"], kind="stable")
            row = {c: v[order] for c, v in row.items()}
        history = UserHistory(
            row["items"],
            row["actions"] if "actions" in row else np.zeros(n, dtype=np.int64),
            row["timestamps"] if stamps is not None else np.arange(n, dtype=np.int64),
            {c: row[c] for c in extra},
        )
        out.append((first + r, history))
    return out


def _switch(name: str, value: bool | str) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "on", "off"):
        raise ValueError(f"{name} must be on or off, got {value!r}")
    return text in ("true", "on")


def _positive(name: str, value: int | str) -> int:
    text = str(value)
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(text)
