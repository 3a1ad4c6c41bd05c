"""TorchRec ``KeyedJaggedTensor`` <-> ``{feature: JaggedTensor}``, checked.

`kjt_to_features` reads a KJT (int32 or int64 lengths / offsets) into our
`JaggedTensor`s (int64 offsets); `features_to_kjt` is its inverse. Both check
the input on the host and raise a ``ValueError`` that names the offending key:
a KJT that does not add up must never be split into shifted features.
`embeddings_to_torchrec` wraps lookup outputs as TorchRec's
``Dict[str, JaggedTensor]`` (what ``EmbeddingCollection`` returns).

TorchRec is optional: it is imported only by the functions that build its types.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from freescale.jagged import JaggedTensor, ops

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def is_kjt(x: object) -> bool:
    """True for a TorchRec ``KeyedJaggedTensor`` (without importing TorchRec)."""
    if "torchrec" not in sys.modules:
        return False
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return isinstance(x, KeyedJaggedTensor)


def kjt_to_features(kjt: KeyedJaggedTensor, prefix: str = "") -> dict[str, JaggedTensor]:
    """``{prefix + key: JaggedTensor(values, int64 offsets)}`` in KJT key order."""
    keys = list(kjt.keys())
    _check_unique(keys)
    if not keys:
        return {}
    if kjt.variable_stride_per_key():
        raise ValueError(f"KJT key {keys[0]!r}: variable strides per key are not supported")
    values = kjt.values()
    if values.dim() != 1:
        raise ValueError(f"KJT key {keys[0]!r}: values must be 1-D, got {tuple(values.shape)}")
    lengths = _lengths(kjt, keys)
    stride = lengths.numel() // len(keys)
    if lengths.numel() != len(keys) * stride or stride != kjt.stride():
        raise ValueError(
            f"KJT key {keys[-1]!r}: {lengths.numel()} lengths for {len(keys)} keys "
            f"do not make stride {kjt.stride()}"
        )
    per_key = lengths.view(len(keys), stride)
    negative = torch.nonzero((per_key < 0).any(dim=1)).flatten().tolist()
    if negative:
        raise ValueError(f"KJT key {keys[negative[0]]!r} has a negative length")
    sizes = per_key.sum(dim=1).tolist()
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()
    if ends[-1] != values.shape[0]:
        k = next((i for i, e in enumerate(ends) if e > values.shape[0]), len(keys) - 1)
        raise ValueError(
            f"KJT key {keys[k]!r}: lengths sum to {ends[-1]} but the KJT has "
            f"{values.shape[0]} values"
        )
    pieces = torch.split(values, sizes)
    return {
        prefix + key: JaggedTensor(pieces[k], ops.lengths_to_offsets(per_key[k]))
        for k, key in enumerate(keys)
    }


def features_to_kjt(features: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
    """One KJT of ``features`` (keys in mapping order; int64 lengths and offsets).

    Every feature must be a `JaggedTensor` of 1-D values with the same number
    of samples and one values dtype (a KJT has one values tensor and one stride).
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(features)
    ref: tuple[str, int, torch.dtype] | None = None
    for key, jt in features.items():
        if not isinstance(jt, JaggedTensor):
            raise ValueError(f"feature {key!r}: expected a JaggedTensor, got {type(jt).__name__}")
        if jt.values.dim() != 1:
            raise ValueError(f"feature {key!r}: values must be 1-D, got {tuple(jt.values.shape)}")
        jt.validate(f"feature {key!r}")
        if ref is None:
            ref = (key, jt.num_segments, jt.values.dtype)
        elif (jt.num_segments, jt.values.dtype) != ref[1:]:
            raise ValueError(
                f"feature {key!r} has {jt.num_segments} samples of {jt.values.dtype} but "
                f"{ref[0]!r} has {ref[1]} of {ref[2]}: a KJT holds one stride and one dtype"
            )
    if ref is None:
        return KeyedJaggedTensor(
            keys=[],
            values=torch.empty(0, dtype=torch.int64),
            lengths=torch.empty(0, dtype=torch.int64),
            stride=0,
        )
    jts = [features[k] for k in keys]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt.values for jt in jts]),
        lengths=torch.cat([jt.lengths() for jt in jts]),
        stride=ref[1],
    )


def embeddings_to_torchrec(
    embeddings: Mapping[str, Any], features: Mapping[str, JaggedTensor], prefix: str = ""
) -> dict[str, Any]:
    """``{key: torchrec JaggedTensor}`` of lookup outputs ``embeddings[prefix + key]``."""
    from torchrec.sparse.jagged_tensor import JaggedTensor as TorchRecJagged

    out = {}
    for key, jt in features.items():
        name = key[len(prefix) :]
        emb = embeddings[key]
        values = emb.values if isinstance(emb, JaggedTensor) else emb
        out[name] = TorchRecJagged(values=values, lengths=jt.lengths(), offsets=jt.offsets)
    return out


def _check_unique(keys: list[str]) -> None:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"KJT key {key!r} appears more than once")
        seen.add(key)


def _lengths(kjt: KeyedJaggedTensor, keys: list[str]) -> Tensor:
    """int64 lengths; when the KJT holds both lengths and offsets, they must agree."""
    lengths, offsets = kjt.lengths_or_none(), kjt.offsets_or_none()
    for name, t in (("lengths", lengths), ("offsets", offsets)):
        if t is not None and (t.dim() != 1 or t.dtype.is_floating_point or t.is_complex()):
            raise ValueError(f"KJT key {keys[0]!r}: {name} must be a 1-D integer tensor")
    if offsets is not None:
        if offsets.numel() < 1 or int(offsets[0]) != 0:
            raise ValueError(f"KJT key {keys[0]!r}: offsets must start at 0")
        from_offsets = ops.offsets_to_lengths(offsets.to(torch.int64))
        if lengths is not None and not torch.equal(lengths.to(torch.int64), from_offsets):
            n = min(lengths.numel(), from_offsets.numel())
            bad = torch.nonzero(lengths[:n].to(torch.int64) != from_offsets[:n]).flatten()
            i = int(bad[0]) if bad.numel() else n
            stride = max(kjt.stride(), 1)
            key = keys[min(i // stride, len(keys) - 1)]
            raise ValueError(f"KJT key {key!r}: its lengths and offsets disagree")
        return from_offsets
    assert lengths is not None
    return lengths.to(torch.int64)
