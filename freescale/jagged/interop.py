"""Conversions between `SampleBatch` / `JaggedTensor` and TorchRec / torch.nested.

TorchRec is optional: it is imported only inside the functions that need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    """Inverse of `to_kjt`."""
    by_key = _split_kjt(kjt, sample_id.shape[0])
    if CONTENT_LENGTHS not in by_key:
        raise ValueError(f"KJT lacks the {CONTENT_LENGTHS!r} key written by to_kjt")
    groups: dict[str, dict[str, Tensor]] = {UIH_PREFIX: {}, CAND_PREFIX: {}, CONTENT_PREFIX: {}}
    offsets: dict[str, Tensor] = {}
    for key, (values, key_offsets) in by_key.items():
        if key == CONTENT_LENGTHS:
            continue
        prefix = next((p for p in groups if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"KJT key {key!r} has none of the prefixes {list(groups)}")
        groups[prefix][key[len(prefix) :]] = values
        offsets[prefix] = key_offsets
    content_lengths, cand_offsets = by_key[CONTENT_LENGTHS]
    empty = torch.zeros(sample_id.shape[0] + 1, dtype=torch.int64)
    return SampleBatch(
        uih=JaggedFeatures(offsets.get(UIH_PREFIX, empty), groups[UIH_PREFIX]),
        candidates=JaggedFeatures(cand_offsets, groups[CAND_PREFIX]),
        labels=labels,
        content=JaggedFeatures(ops.lengths_to_offsets(content_lengths), groups[CONTENT_PREFIX]),
        sample_id=sample_id,
        dense=dense,
    )


def _split_kjt(kjt: KeyedJaggedTensor, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Per key: (values, int64 offsets). Done by hand because TorchRec's
    ``to_dict`` cannot infer the stride of an empty batch."""
    keys = kjt.keys()
    lengths = kjt.lengths().to(torch.int64)
    if lengths.numel() != len(keys) * batch_size:
        raise ValueError(f"KJT has {lengths.numel()} lengths, expected {len(keys)} x {batch_size}")
    per_key_lengths = lengths.view(len(keys), batch_size)
    sizes = per_key_lengths.sum(dim=1).tolist()
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
