"""What MFU needs: the FLOPs of a rank's batch and the device's peak.

The FLOPs are the model's own count (the contract's optional ``flops(batch)``),
taken on the host where the batch's sizes already are, so a step never reads
anything back for it: in the loader (worker processes on GPUs) for a batch
straight from the data, on the balancer's helper thread for a balanced batch
(`sized_batch`: a batch of this rank's balanced sizes, built from the lengths
the balancer gathered). The peak is dense bf16 TFLOP/s per device from
`PEAK_TFLOPS` (or ``run.peak_tflops``); none on CPUs or unknown devices, and
then no MFU is reported (never a guessed number).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from freescale.jagged.batch import SampleBatch
from freescale.jagged.ops import lengths_to_offsets
from freescale.jagged.tensor import JaggedFeatures
from freescale.models.contract import RecModel

# Dense (no 2:4 sparsity) BF16 tensor-core peaks in TFLOP/s, matched against the
# words of `torch.cuda.get_device_name` (every word of an entry present; the first
# entry that matches wins, so the specific variants come first). Sources: NVIDIA's
# datasheets, which quote these "with sparsity", i.e. twice the dense figure:
# H100 SXM 1,979 / PCIe 1,513 / NVL 1,671; H200 SXM 1,979 / NVL 1,671; GH200 1,979;
# A100 (SXM and PCIe) 624; L40S 733; L40 362.1; L4 242; A10 250. FP16 peaks are
# the same. Devices not listed (B200, whose peak depends on its power limit in the
# system, AMD GPUs, ...) report no MFU unless ``run.peak_tflops`` names the peak.
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),  # SXM5: "NVIDIA H100 80GB HBM3"
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),  # SXM
    (("GH200",), 989.0),
    (("A100",), 312.0),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (("L40S",), 362.0),
    (("L40",), 181.0),
    (("L4",), 121.0),
    (("A10",), 125.0),
)


def table_peak(name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of the device called ``name`` (None: not in the table)."""
    words = set(re.split(r"[\s\-_]+", name.upper()))
    for keys, peak in PEAK_TFLOPS:
        if all(k.upper() in words for k in keys):
            return peak
    return None


def peak_tflops(device: torch.device, override: float = 0.0) -> float | None:
    """The peak MFU divides by: ``override`` when > 0 (any device), else the
    table's for a CUDA device; None on CPUs and unknown devices."""
    if override > 0:
        return float(override)
    if device.type != "cuda":
        return None
    return table_peak(torch.cuda.get_device_name(device))


def model_flops(model: Any) -> Callable[[SampleBatch], float | None] | None:
    """``model.flops`` when the model counts its FLOPs (None: no such method, or
    the contract's default, which knows nothing)."""
    flops = getattr(model, "flops", None)
    if not callable(flops) or getattr(type(model), "flops", None) is RecModel.flops:
        return None
    return flops


def count(flops: Callable[[SampleBatch], float | None] | None, batch: SampleBatch) -> float | None:
    """``flops(batch)`` as a float (None: no count)."""
    if flops is None:
        return None
    value = flops(batch)
    return None if value is None else float(value)


def sized_batch(
    like: SampleBatch, uih_lengths: Tensor, num_candidates: Tensor, content_lengths: Tensor
) -> SampleBatch:
    """A host batch of the given sizes and ``like``'s features, every value 0.

    Its tensors are expanded scalars (no memory): what a model's ``flops(batch)``
    reads (offsets, lengths, numel, shapes) is exact; the values are not data.
    """

    def jagged(lengths: Tensor, features: JaggedFeatures) -> JaggedFeatures:
        n = int(lengths.sum())
        return JaggedFeatures(
            lengths_to_offsets(lengths),
            {name: _zeros(t, n) for name, t in features.features.items()},
        )

    samples = uih_lengths.numel()
    return SampleBatch(
        uih=jagged(uih_lengths, like.uih),
        candidates=jagged(num_candidates, like.candidates),
        labels=_zeros(like.labels, content_lengths.numel()),
        content=jagged(content_lengths, like.content),
        sample_id=_zeros(like.sample_id, samples),
        dense=None if like.dense is None else _zeros(like.dense, samples),
    )


def _zeros(like: Tensor, rows: int) -> Tensor:
    """``rows`` rows shaped as ``like``'s, on the host, all 0, without memory."""
    return torch.zeros((), dtype=like.dtype).expand(rows, *like.shape[1:])
