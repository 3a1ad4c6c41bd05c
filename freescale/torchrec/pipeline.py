"""FreeScale's load balancer in front of TorchRec's training pipelines.

A TorchRec user keeps TorchRec's pipeline and data loader; batches travel as
`KJTBatch` (a TorchRec ``Pipelineable``: sparse features as one KJT in
`to_kjt`'s layout, plus labels, global sample ids and optional dense
features). Samples move between ranks so that every rank gets a similar
amount of sequence work (``LoadBalancer.balance``: all three stages back to
back), in one of two places:

- `balance_stage`: a ``PipelineStage`` of ``StagedTrainPipeline``;
- `balanced_batches`: wraps the batch iterator, for pipelines that take one
  and run the model themselves (``TrainPipelineSparseDist``,
  ``TrainPipelineBase``): each batch they pull is already balanced.

Both are collectives: every rank must run the pipeline over the same number
of batches (as with TorchRec's own sparse-data-dist stage). TorchRec is
imported only when one is built (it pulls in Triton).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from freescale.balance import BalancerConfig, LoadBalancer
from freescale.comm import Communicator
from freescale.jagged import SampleBatch
from freescale.jagged.interop import from_kjt, to_kjt

if TYPE_CHECKING:
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class KJTBatch:
    """One rank's batch in TorchRec form (TorchRec's ``Pipelineable`` methods)."""

    sparse_features: KeyedJaggedTensor
    labels: Tensor
    sample_id: Tensor
    dense: Tensor | None = None

    @classmethod
    def from_sample_batch(cls, batch: SampleBatch) -> KJTBatch:
        return cls(to_kjt(batch), batch.labels, batch.sample_id, batch.dense)

    def to_sample_batch(self) -> SampleBatch:
        """Checked (`from_kjt` raises, naming the key, on an inconsistent KJT)."""
        return from_kjt(self.sparse_features, self.labels, self.sample_id, self.dense)

    def to(self, device: torch.device, non_blocking: bool = False) -> KJTBatch:
        dense = self.dense.to(device, non_blocking=non_blocking) if self.dense is not None else None
        return KJTBatch(
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.sample_id.to(device, non_blocking=non_blocking),
            dense,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        if stream.device.type != "cuda":  # CPU tensors need no stream bookkeeping
            return
        self.sparse_features.record_stream(stream)
        for t in (self.labels, self.sample_id, self.dense):
            if t is not None:
                t.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self) -> KJTBatch:
        dense = self.dense.pin_memory() if self.dense is not None else None
        return KJTBatch(
            self.sparse_features.pin_memory(),
            self.labels.pin_memory(),
            self.sample_id.pin_memory(),
            dense,
        )


class BalanceRunnable:
    """``KJTBatch -> KJTBatch``: this rank's share of the balanced global step."""

    def __init__(self, balancer: LoadBalancer) -> None:
        self.balancer = balancer

    def __call__(self, batch: KJTBatch) -> KJTBatch:
        return KJTBatch.from_sample_batch(self.balancer.balance(batch.to_sample_batch()))


def _register_pipelineable() -> None:
    """Make ``isinstance(batch, Pipelineable)`` hold, as TorchRec's pipelines
    assert, without importing TorchRec with this module."""
    from torchrec.streamable import Pipelineable

    Pipelineable.register(KJTBatch)


def balanced_batches(
    comm: Communicator, batches: Iterable[KJTBatch], config: BalancerConfig | None = None
) -> Iterator[KJTBatch]:
    """This rank's balanced share of each global step, one per batch of ``batches``.

    Hand it to ``TrainPipelineSparseDist.progress``: the pipeline pulls batches
    ahead (to copy them and start their input dist early), and every rank
    pulls at the same points, so the balancer's collective lines up."""
    _register_pipelineable()
    runnable = BalanceRunnable(LoadBalancer(comm, config))
    return (runnable(batch) for batch in batches)


def balance_stage(
    comm: Communicator,
    config: BalancerConfig | None = None,
    stream: torch.Stream | None = None,
    name: str = "freescale_balance",
) -> PipelineStage:
    """A ``PipelineStage`` that load-balances each step's samples over ``comm``'s ranks.

    ``stream`` defaults to the current stream of ``comm``'s device (TorchRec's
    pipeline needs one, on the CPU too)."""
    if stream is None:
        dev = comm.device
        stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else torch.Stream(dev.type)
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage

    _register_pipelineable()
    runnable = BalanceRunnable(LoadBalancer(comm, config))
    return PipelineStage(name=name, runnable=runnable, stream=stream)  # type: ignore[arg-type]
