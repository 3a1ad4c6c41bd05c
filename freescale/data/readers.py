"""Readers for real interaction data: SASRec-style sequence files and MovieLens.

Both produce a `SequenceDataset`: one chronological history per user, item
ids remapped to ``[0, num_items)`` in order of first appearance.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataFormatError(ValueError):
    """A malformed input line; the message names the file and line number."""

    def __init__(self, path: Path | str, line_no: int, why: str) -> None:
        super().__init__(f"{path}:{line_no}: {why}")


@dataclass
class UserHistory:
    items: np.ndarray  # int64, remapped item ids, chronological
    actions: np.ndarray  # int64 (MovieLens: rating 1..5; SASRec: 0)
    timestamps: np.ndarray  # int64 (SASRec: position in the file)


@dataclass
class SequenceDataset:
    users: list[UserHistory]
    num_items: int
    num_actions: int
    name: str


class _Vocab:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, raw: str) -> int:
        return self.index.setdefault(raw, len(self.index))


def read_sasrec(path: str | Path) -> SequenceDataset:
    """A file of ``user item`` lines (whitespace separated), in chronological
    order per user (the format SASRec and its successors ship)."""
    path = Path(path)
    vocab, users = _Vocab(), {}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise DataFormatError(path, line_no, f"expected 'user item', got {line.strip()!r}")
            user, item = parts
            _check_int(path, line_no, "user", user)
            _check_int(path, line_no, "item", item)
            users.setdefault(user, []).append((vocab(item), 0, line_no))
    return _dataset(users, len(vocab.index), 1, path.name)


def read_movielens(path: str | Path) -> SequenceDataset:
    """MovieLens ``ratings.dat`` (``user::movie::rating::timestamp``) or
    ``ratings.csv`` (header ``userId,movieId,rating,timestamp``).
    Histories are sorted by timestamp (stable); the rating is the action."""
    path = Path(path)
    vocab, users = _Vocab(), {}
    with path.open(newline="") as f:
        if path.suffix == ".csv":
            rows = csv.reader(f)
            header = next(rows, None)
            if header is None or [h.strip() for h in header[:4]] != [
                "userId",
                "movieId",
                "rating",
                "timestamp",
            ]:
                raise DataFormatError(path, 1, f"expected the MovieLens csv header, got {header}")
            records = ((n, r) for n, r in enumerate(rows, 2))
        else:
            records = ((n, line.rstrip("\n").split("::")) for n, line in enumerate(f, 1))
        for line_no, fields in records:
            if fields == [""] or not fields:
                continue
            if len(fields) != 4:
                raise DataFormatError(path, line_no, f"expected 4 fields, got {len(fields)}")
            user, item, rating, ts = (x.strip() for x in fields)
            _check_int(path, line_no, "user", user)
            _check_int(path, line_no, "movie", item)
            _check_int(path, line_no, "timestamp", ts)
            try:
                action = round(float(rating))
            except ValueError:
                raise DataFormatError(path, line_no, f"rating {rating!r} is not a number") from None
            users.setdefault(user, []).append((vocab(item), action, int(ts)))
    for events in users.values():
        events.sort(key=lambda e: e[2])
    return _dataset(users, len(vocab.index), 6, path.name)


def _check_int(path: Path, line_no: int, what: str, text: str) -> None:
    if not text.lstrip("-").isdigit():
        raise DataFormatError(path, line_no, f"{what} {text!r} is not an integer")


def _dataset(
    users: dict[str, list[tuple[int, int, int]]], num_items: int, num_actions: int, name: str
) -> SequenceDataset:
    histories = []
    for events in users.values():
        arr = np.asarray(events, dtype=np.int64).reshape(-1, 3)
        histories.append(UserHistory(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()))
    return SequenceDataset(histories, num_items, num_actions, name)
