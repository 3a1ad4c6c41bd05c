"""Readers for real interaction data: SASRec-style sequence files and MovieLens.

Both produce a `SequenceDataset`: one chronological history per user, item
ids remapped to ``[0, num_items)`` in order of first appearance, or, with
``raw`` (a dynamic item table takes them: `freescale.data.ids`), kept
as the file's own int64 ids. Raw ids are parsed as integers (``10`` and
``010`` are one id); a sign (but on an item kept raw), an id beyond int64,
a non-ASCII digit or a byte that is not UTF-8 is an error naming the file
and line.
The action count comes from the data (largest action + 1), so the model's
action table can never be too small for it.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freescale.jagged.schema import Feature

# MovieLens ratings: 0.5 to 5 stars in half-star steps (ml-latest); ml-1m/10m use
# whole stars. The action is the rating in half stars, 1..10, so no rating is lost.
RATING_RANGE = (0.5, 5.0)
INT64 = (-(2**63), 2**63 - 1)


class DataFormatError(ValueError):
    """A malformed input; the message names the file and the line (or row)."""

    def __init__(self, path: Path | str, where: int | str | None, why: str) -> None:
        at = f":{where}" if isinstance(where, int) else f": {where}" if where else ""
        super().__init__(f"{path}{at}: {why}")


@dataclass
class UserHistory:
    items: np.ndarray  # int64, remapped item ids, chronological
    actions: np.ndarray  # int64 (MovieLens: rating in half stars 1..10; SASRec: 0)
    timestamps: np.ndarray  # int64 (SASRec: position in the file)
    # the data's own uih-level features: one int64 value per event, aligned with items
    features: dict[str, np.ndarray] = field(default_factory=dict)
    # content-level columns while reading: (list length per event, the lists' values)
    content: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass
class SequenceDataset:
    """Histories plus, optionally, extra features (`freescale.data.columnar`):
    ``features`` declares them (``uih`` level: ``UserHistory.features``;
    ``candidates`` level: an attribute of the item, ``item_features[name]``
    holds its value for every item id; ``content`` level: a list per item,
    ``item_content[name]`` = (offsets by item id, values): a candidate's content)."""

    users: list[UserHistory]
    num_items: int
    num_actions: int
    name: str
    features: tuple[Feature, ...] = ()
    item_features: dict[str, np.ndarray] = field(default_factory=dict)
    item_content: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # the raw id of each item row (`freescale.data.ids`); None: ids were taken as given
    item_ids: np.ndarray | None = None
    # the histories hold those raw ids, not rows (`keep_raw_ids`); per-item
    # tables stay by row, i.e. by position in ``item_ids``
    raw_ids: bool = False


class _Vocab:
    """Raw id -> row, in order of first appearance; or, ``given`` a map (raw ids
    by row, `freescale.data.ids`), through it: an id it lacks is an error."""

    def __init__(self, path: Path | str = "", given: np.ndarray | None = None) -> None:
        self.index: dict[int, int] = {}
        self.path, self.fixed = path, given is not None
        if given is not None:
            self.index = {int(raw): row for row, raw in enumerate(given.tolist())}

    def __call__(self, raw: int, where: int | str | None = None) -> int:
        if self.fixed:
            row = self.index.get(raw)
            if row is None:
                why = f"item {raw} is not in the checkpoint's id map ({len(self.index)} items)"
                raise DataFormatError(self.path, where, why)
            return row
        return self.index.setdefault(raw, len(self.index))

    def raw_ids(self) -> np.ndarray:
        return np.fromiter(self.index, np.int64, len(self.index))


def check_file(path: str | Path) -> Path:
    """``path`` as a Path if it is a readable file, else a one-line ValueError."""
    path = Path(path)
    if not path.exists():
        raise DataFormatError(path, None, "no such file")
    if path.is_dir():
        raise DataFormatError(path, None, "is a directory, not a data file")
    return path


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file (a leading byte-order mark is skipped);
    bytes that are not UTF-8 raise a `DataFormatError` naming the line."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                why = f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                raise DataFormatError(path, line_no, why) from None
            if line_no == 1:
                text = text.removeprefix("\ufeff")
            yield line_no, text


def parse_id(path: Path, where: int | str, what: str, text: str, signed: bool = False) -> int:
    """A non-negative integer written with ASCII digits only (``signed``: an
    int64, a leading ``-`` allowed)."""
    digits = text[1:] if signed and text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        kind = "an integer" if signed else "a non-negative integer"
        raise DataFormatError(path, where, f"{what} {text!r} is not {kind}")
    value = int(text)
    if not INT64[0] <= value <= INT64[1]:
        raise DataFormatError(path, where, f"{what} {value} does not fit in int64")
    return value


def keep_raw_ids(dataset: SequenceDataset) -> SequenceDataset:
    """``dataset`` with its histories' item rows replaced by the raw ids they
    were read as (per-item tables stay by row: a row is a catalogue position)."""
    assert dataset.item_ids is not None
    for h in dataset.users:
        h.items = dataset.item_ids[h.items]
    dataset.raw_ids = True
    return dataset


def read_sasrec(
    path: str | Path, ids: np.ndarray | None = None, raw: bool = False
) -> SequenceDataset:
    """A file of ``user item`` lines (whitespace separated), in chronological
    order per user (the format SASRec and its successors ship); ``ids``: a map
    to remap through (`_Vocab`); ``raw``: keep the item ids as written."""
    path = check_file(path)
    vocab, users = _Vocab(path, ids), {}
    for line_no, line in text_lines(path):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise DataFormatError(path, line_no, f"expected 'user item', got {line.strip()!r}")
        user = parse_id(path, line_no, "user", parts[0])
        item = parse_id(path, line_no, "item", parts[1], raw)
        users.setdefault(user, []).append((vocab(item, line_no), 0, line_no))
    return _dataset(users, vocab, path.name, raw)


def read_movielens(
    path: str | Path, ids: np.ndarray | None = None, raw: bool = False
) -> SequenceDataset:
    """MovieLens ``ratings.dat`` (``user::movie::rating::timestamp``) or
    ``ratings.csv`` (header ``userId,movieId,rating,timestamp``).
    Histories are sorted by timestamp (stable); the action is the rating in
    half stars (``RATING_RANGE`` is checked: 3.5 stars -> action 7); ``ids``,
    ``raw``: as `read_sasrec`'s."""
    path = check_file(path)
    vocab, users = _Vocab(path, ids), {}
    lines = text_lines(path)
    if path.suffix == ".csv":
        header = next(lines, None)
        fields = next(csv.reader([header[1]])) if header else None
        if fields is None or [h.strip() for h in fields[:4]] != [
            "userId",
            "movieId",
            "rating",
            "timestamp",
        ]:
            raise DataFormatError(path, 1, f"expected the MovieLens csv header, got {fields}")
        records = ((n, next(csv.reader([text]), [])) for n, text in lines)
    else:
        records = ((n, text.rstrip("\r\n").split("::")) for n, text in lines)
    for line_no, fields in records:
        if not fields or fields == [""]:
            continue
        if len(fields) != 4:
            raise DataFormatError(path, line_no, f"expected 4 fields, got {len(fields)}")
        user, item, rating, ts = (x.strip() for x in fields)
        u = parse_id(path, line_no, "user", user)
        i = parse_id(path, line_no, "movie", item, raw)
        t = parse_id(path, line_no, "timestamp", ts)
        event = (vocab(i, line_no), rating_action(path, line_no, rating), t)
        users.setdefault(u, []).append(event)
    for events in users.values():
        events.sort(key=lambda e: e[2])
    return _dataset(users, vocab, path.name, raw)


def rating_action(path: Path, line_no: int, text: str) -> int:
    """A star rating in ``RATING_RANGE`` (half-star steps) -> its action, in half stars."""
    try:
        value = float(text)
    except ValueError:
        raise DataFormatError(path, line_no, f"rating {text!r} is not a number") from None
    lo, hi = RATING_RANGE
    half_stars = value * 2
    if not math.isfinite(value) or not lo <= value <= hi or half_stars != round(half_stars):
        raise DataFormatError(
            path, line_no, f"rating {text!r} is not a star rating in {lo}..{hi} (half steps)"
        )
    return round(half_stars)


def _dataset(
    users: dict[int, list[tuple[int, int, int]]], vocab: _Vocab, name: str, raw: bool = False
) -> SequenceDataset:
    histories, top_action = [], 0
    for events in users.values():
        arr = np.asarray(events, dtype=np.int64).reshape(-1, 3)
        histories.append(UserHistory(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()))
        top_action = max(top_action, int(arr[:, 1].max(initial=0)))
    ids = vocab.raw_ids()
    dataset = SequenceDataset(histories, ids.size, top_action + 1, name, item_ids=ids)
    return keep_raw_ids(dataset) if raw else dataset
