"""Hypothesis strategies for jagged kernel inputs, with the awkward cases made likely:
no segments, all segments empty, one segment, ids at the table bounds."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from freescale.jagged.ops import lengths_to_offsets
from freescale.jagged.tensor import JaggedFeatures

NUM_ROWS = 1000
ID_DTYPES = (torch.int32, torch.int64)


def lengths(max_segments: int = 6, max_len: int = 6) -> st.SearchStrategy[list[int]]:
    """Segment lengths: often zero, sometimes all zero or a single segment."""
    one = st.one_of(st.just(0), st.integers(0, max_len))
    return st.one_of(
        st.lists(one, max_size=max_segments),
        st.lists(st.just(0), max_size=max_segments),
        st.lists(st.integers(0, 3 * max_len), min_size=1, max_size=1),
    )


def ids_tensor(n: int, seed: int, dtype: torch.dtype, num_rows: int = NUM_ROWS) -> torch.Tensor:
    """Random ids in ``[0, num_rows)`` whose first entries are the table bounds."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (n,), generator=g)
    ids[: min(n, 2)] = torch.tensor([num_rows - 1, 0])[: min(n, 2)]
    return ids.to(dtype)


def feature_set(total: int, seed: int, id_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Ids, an int16, an fp32 and an fp32 [N, 3] feature (several word shapes)."""
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "ids": ids_tensor(total, seed, id_dtype),
        "actions": torch.randint(-5, 5, (total,), generator=g).to(torch.int16),
        "weights": torch.randn(total, generator=g),
        "vectors": torch.randn(total, 3, generator=g),
    }


@st.composite
def jagged_features(draw, max_segments: int = 6, max_len: int = 6) -> JaggedFeatures:
    lens = draw(lengths(max_segments, max_len))
    seed = draw(st.integers(0, 2**16))
    id_dtype = draw(st.sampled_from(ID_DTYPES))
    offsets = lengths_to_offsets(torch.tensor(lens, dtype=torch.int64))
    return JaggedFeatures(offsets, feature_set(sum(lens), seed, id_dtype))


@st.composite
def selections(draw, num_segments: int, max_size: int = 8) -> torch.Tensor:
    """Indices into ``num_segments`` segments: any order, repeats allowed."""
    if num_segments == 0:
        return torch.zeros(0, dtype=torch.int64)
    idx = draw(st.lists(st.integers(0, num_segments - 1), max_size=max_size))
    return torch.tensor(idx, dtype=torch.int64)


def rows_tensor(n: int, kind: str, seed: int) -> torch.Tensor:
    """Rows to move: 1-D ids, 1-D fp32, or fp32 embedding rows [N, 5]."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ids32":
        return ids_tensor(n, seed, torch.int32)
    if kind == "ids64":
        return ids_tensor(n, seed, torch.int64)
    if kind == "fp32":
        return torch.randn(n, generator=g)
    return torch.randn(n, 5, generator=g)


ROW_KINDS = ("ids32", "ids64", "fp32", "emb")


def to_device(feats: JaggedFeatures, device: str) -> JaggedFeatures:
    return feats.map(lambda t: t.to(device))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality across devices (a CUDA result vs a CPU reference)."""
    return torch.equal(a.cpu(), b.cpu())
