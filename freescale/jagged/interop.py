"""Conversions between `SampleBatch` / `JaggedTensor` and TorchRec / torch.nested.

- `to_kjt` / `from_kjt`: a whole `SampleBatch` as one feature-major KJT.
- `kjt_to_features` reads a KJT (int32 or int64 lengths / offsets) into our
  ``{feature: JaggedTensor}`` (int64 offsets); `features_to_kjt` is its
  inverse. Both check the input on the host and raise a ``ValueError`` that
  names the offending key: a KJT that does not add up must never be split
  into shifted features. `embeddings_to_torchrec` wraps lookup outputs as
  TorchRec's ``Dict[str, JaggedTensor]`` (what ``EmbeddingCollection`` returns).
- `to_nested` / `from_nested`: ``torch.nested`` jagged tensors.

TorchRec is optional: it is imported only inside the functions that need it
(`is_kjt` never imports it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from freescale.jagged import ops
from freescale.jagged.batch import SampleBatch
from freescale.jagged.tensor import JaggedFeatures, JaggedTensor

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

UIH_PREFIX = "uih/"
CAND_PREFIX = "cand/"
CONTENT_PREFIX = "content/"
CONTENT_LENGTHS = "content_lengths"


def to_kjt(batch: SampleBatch) -> KeyedJaggedTensor:
    """Feature-major `KeyedJaggedTensor` of the batch's id features.

    Keys: ``uih/<name>`` (per-sample UIH), ``cand/<name>`` (per-sample
    candidates), ``content/<name>`` (per-sample concatenated candidate content)
    and ``content_lengths`` (per candidate, so the content can be split back).
    Labels, dense features and sample ids are not sparse features: pass them
    to `from_kjt` alongside. All features must share one integer dtype, as a
    KJT has a single values tensor.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, values, lengths = [], [], []
    n_cand = batch.num_candidates()
    per_sample_content = _per_sample_sums(batch.candidate_lengths(), batch.candidates.offsets)
    groups = [
        (UIH_PREFIX, batch.uih, batch.uih_lengths()),
        (CAND_PREFIX, batch.candidates, n_cand),
        (CONTENT_PREFIX, batch.content, per_sample_content),
    ]
    for prefix, feats, seg_lengths in groups:
        for name, t in feats.features.items():
            keys.append(prefix + name)
            values.append(t)
            lengths.append(seg_lengths)
    keys.append(CONTENT_LENGTHS)
    values.append(batch.candidate_lengths())
    lengths.append(n_cand)
    dtypes = {v.dtype for v in values[:-1]}
    if len(dtypes) > 1 or any(v.dtype.is_floating_point for v in values):
        raise ValueError(f"to_kjt needs one integer dtype for all features, got {dtypes}")
    dtype = dtypes.pop() if dtypes else torch.int64
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([v.to(dtype) for v in values]),
        lengths=torch.cat(lengths).to(torch.int32),
        stride=batch.batch_size,
    )


def from_kjt(
    kjt: KeyedJaggedTensor,
    labels: Tensor,
    sample_id: Tensor,
    dense: Tensor | None = None,
) -> SampleBatch:
    """Inverse of `to_kjt`.

    The KJT is checked on the host (interop runs before the copy to the
    device): a ``ValueError`` naming the key is raised when a key is repeated
    or has no known prefix, when the stride is not ``len(sample_id)``, when a
    length is negative, when the lengths do not sum to the values, when
    features of one group (``uih/``; ``cand/`` with ``content_lengths``)
    disagree on per-sample lengths, when ``content_lengths`` is missing, or
    when ``content/`` features disagree with the sums of ``content_lengths``.
    """
    by_key = _split_kjt(kjt, sample_id.shape[0])
    if CONTENT_LENGTHS not in by_key:
        content = [k for k in by_key if k.startswith(CONTENT_PREFIX)]
        needed = f", which splits the content keys {content} per candidate" if content else ""
        raise ValueError(f"KJT lacks the {CONTENT_LENGTHS!r} key written by to_kjt{needed}")
    groups: dict[str, dict[str, Tensor]] = {UIH_PREFIX: {}, CAND_PREFIX: {}, CONTENT_PREFIX: {}}
    # Per group: the first key in KJT order and its offsets, which the group's
    # other keys must match. `content_lengths` has one entry per candidate, so
    # it belongs to the candidate group.
    offsets: dict[str, tuple[str, Tensor]] = {}
    for key, (values, key_offsets) in by_key.items():
        if key == CONTENT_LENGTHS:
            prefix: str | None = CAND_PREFIX
        else:
            prefix = next((p for p in groups if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"KJT key {key!r} has none of the prefixes {list(groups)}")
        if prefix in offsets:
            _check_same_lengths(key, key_offsets, *offsets[prefix])
        else:
            offsets[prefix] = (key, key_offsets)
        if key != CONTENT_LENGTHS:
            groups[prefix][key[len(prefix) :]] = values
    content_lengths, cand_offsets = by_key[CONTENT_LENGTHS]
    if bool((content_lengths < 0).any()):
        raise ValueError(f"KJT key {CONTENT_LENGTHS!r} holds a negative content length")
    content_offsets = ops.lengths_to_offsets(content_lengths)
    if CONTENT_PREFIX in offsets:
        # Per sample, the content keys hold the content of all its candidates.
        _check_same_lengths(
            *offsets[CONTENT_PREFIX], CONTENT_LENGTHS, content_offsets[cand_offsets]
        )
    empty = torch.zeros(sample_id.shape[0] + 1, dtype=torch.int64)
    uih_offsets = offsets[UIH_PREFIX][1] if UIH_PREFIX in offsets else empty
    return SampleBatch(
        uih=JaggedFeatures(uih_offsets, groups[UIH_PREFIX]),
        candidates=JaggedFeatures(cand_offsets, groups[CAND_PREFIX]),
        labels=labels,
        content=JaggedFeatures(content_offsets, groups[CONTENT_PREFIX]),
        sample_id=sample_id,
        dense=dense,
    )


def _check_same_lengths(key: str, key_offsets: Tensor, ref_key: str, ref_offsets: Tensor) -> None:
    """Raise, naming ``key``, unless its per-sample lengths equal ``ref_key``'s."""
    if torch.equal(key_offsets, ref_offsets):
        return
    lengths, ref = ops.offsets_to_lengths(key_offsets), ops.offsets_to_lengths(ref_offsets)
    i = int(torch.nonzero(lengths != ref)[0, 0])
    raise ValueError(
        f"KJT key {key!r} disagrees with {ref_key!r} on per-sample lengths: sample {i} has "
        f"{int(lengths[i])} in {key!r} but {int(ref[i])} in {ref_key!r}; the features of one "
        "group share one offsets"
    )


def _split_kjt(kjt: KeyedJaggedTensor, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Per key: (values, int64 offsets). Done by hand because TorchRec's
    ``to_dict`` cannot infer the stride of an empty batch."""
    keys = kjt.keys()
    if not keys:
        return {}
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"KJT key {key!r} appears more than once")
        seen.add(key)
    if kjt.variable_stride_per_key():
        raise ValueError(f"KJT keys {keys} have variable strides; to_kjt writes one stride")
    lengths = kjt.lengths().to(torch.int64)
    if kjt.stride() != batch_size or lengths.numel() != len(keys) * batch_size:
        raise ValueError(
            f"KJT stride {kjt.stride()} ({lengths.numel()} lengths for {len(keys)} keys) does "
            f"not match the batch size {batch_size} (len(sample_id)) for keys {keys}"
        )
    per_key_lengths = lengths.view(len(keys), batch_size)
    negative = torch.nonzero((per_key_lengths < 0).any(dim=1))
    if negative.numel():
        raise ValueError(f"KJT key {keys[int(negative[0, 0])]!r} has a negative length")
    sizes = per_key_lengths.sum(dim=1).tolist()
    n_values, total = kjt.values().shape[0], sum(sizes)
    if total != n_values:
        ends = torch.tensor(sizes).cumsum(0)
        k = int(torch.nonzero(ends > n_values)[0, 0]) if total > n_values else len(keys) - 1
        where = (
            "runs past the end of the values"
            if total > n_values
            else f"is the last key but {n_values - total} values remain after it"
        )
        raise ValueError(
            f"KJT lengths sum to {total} but it has {n_values} values: key {keys[k]!r} {where}"
        )
    values = torch.split(kjt.values(), sizes)
    return {
        key: (values[k], ops.lengths_to_offsets(per_key_lengths[k])) for k, key in enumerate(keys)
    }


def to_nested(jt: JaggedTensor) -> Tensor:
    """A `torch.nested` jagged-layout tensor sharing ``jt``'s storage."""
    return torch.nested.nested_tensor_from_jagged(jt.values, jt.offsets)


def from_nested(nt: Tensor) -> JaggedTensor:
    if not nt.is_nested:
        raise ValueError("from_nested expects a torch.nested tensor")
    return JaggedTensor(nt.values(), nt.offsets().to(torch.int64))


def _per_sample_sums(per_item: Tensor, offsets: Tensor) -> Tensor:
    """Sum of ``per_item`` over each segment of ``offsets``."""
    csum = ops.lengths_to_offsets(per_item)
    return csum[offsets[1:]] - csum[offsets[:-1]]


# ---- {feature: JaggedTensor} <-> KJT ----------------------------------------------
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
