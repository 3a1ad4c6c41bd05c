"""FreeScale's balancer as a stage of TorchRec's StagedTrainPipeline (2 gloo ranks)."""

import pytest
import torch
from torch import nn

from freescale.testing import run_ranks
from freescale.testing.batches import random_batch
from tests.embedding._train import pack, unpack

pytest.importorskip("torchrec")
STEPS = 4
SIZES = ((7, 1), (2, 5), (0, 6), (4, 4))  # per step: rank 0's and rank 1's batch sizes


def _model():
    import torchrec

    torch.manual_seed(0)
    ec = torchrec.EmbeddingCollection(
        tables=[
            torchrec.EmbeddingConfig(
                name="item",
                embedding_dim=4,
                num_embeddings=100,
                feature_names=["uih/item_ids", "cand/item_ids"],
            )
        ],
        device=torch.device("cpu"),
    )
    return nn.Sequential(ec)


def _pipeline_rank() -> bytes:
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import StagedTrainPipeline

    from freescale.balance import BalancerConfig
    from freescale.comm import TorchCommunicator
    from freescale.embedding import SGD, ShardingPlan, swap
    from freescale.torchrec.pipeline import balance_stage

    rank = dist.get_rank()
    comm = TorchCommunicator()
    model = _model()
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=0.1)), comm)
    before = coll.full_table("0.item")

    # On the CPU TorchRec's pipeline needs a stream object with a device.
    pipeline = StagedTrainPipeline(
        [balance_stage(comm, BalancerConfig("fbs"))], compute_stream=torch.Stream("cpu")
    )
    seen, sizes = [], []
    it = kjt_batches(rank)
    while (batch := pipeline.progress(it)) is not None:
        features = batch.sparse_features
        keep = ["uih/item_ids", "cand/item_ids"]
        out = model(features.permute([features.keys().index(k) for k in keep]))
        sum(jt.values().sum() for jt in out.values()).backward()
        seen.append(batch.sample_id)
        sizes.append(batch.sample_id.numel())
    return pack(
        {"seen": torch.cat(seen), "sizes": sizes, "moved": coll.full_table("0.item") - before}
    )


@pytest.mark.slow
def test_balancer_stage_in_torchrec_staged_pipeline_sees_every_sample_once():
    per_rank = [unpack(x) for x in run_ranks(_pipeline_rank, 2, timeout=120)]
    seen = torch.cat([r["seen"] for r in per_rank])
    total = sum(sum(s) for s in SIZES)
    assert sorted(seen.tolist()) == list(range(total))  # each sample exactly once
    for step, sizes in enumerate(SIZES):
        got = [r["sizes"][step] for r in per_rank]
        assert sum(got) == sum(sizes)
        assert max(got) - min(got) <= 1  # FBS: equal counts, whatever came in
    assert per_rank[0]["moved"].abs().sum() > 0  # the model trained on them


class _Mixed(nn.Module):
    """A TorchRec model with one sequence table we swap and one TorchRec shards:
    ``TrainPipelineSparseDist`` fx-traces the model and needs a ``ShardedModule``
    beside ours (then our module is traced as a leaf; with none, tracing enters it
    and fails: "Proxy object cannot be iterated"). TorchRec's is an
    ``EmbeddingCollection``: its row-wise sharding takes per-rank batches of any
    size, which balanced batches are. (A row-wise ``EmbeddingBagCollection``
    wants equal ones: its backward fails on gloo with "ProcessGroupGloo::allgather:
    invalid tensor size" when they differ.)"""

    def __init__(self) -> None:
        import torchrec

        super().__init__()
        torch.manual_seed(0)
        cpu = torch.device("cpu")
        self.seq = torchrec.EmbeddingCollection(
            tables=[
                torchrec.EmbeddingConfig(
                    name="item", embedding_dim=4, num_embeddings=100, feature_names=["uih/item_ids"]
                )
            ],
            device=cpu,
        )
        self.theirs = torchrec.EmbeddingCollection(
            tables=[
                torchrec.EmbeddingConfig(
                    name="cand",
                    embedding_dim=4,
                    num_embeddings=100,
                    feature_names=["cand/item_ids"],
                )
            ],
            device=cpu,
        )
        self.head = nn.Linear(4, 1)

    def forward(self, batch):
        f = batch.sparse_features
        seq = self.seq(f.permute([f.keys().index("uih/item_ids")]))
        cand = self.theirs(f)  # straight from the batch: TorchRec pipelines its input dist
        loss = self.head(cand["cand/item_ids"].values()).sum() + seq["uih/item_ids"].values().sum()
        return loss, batch.sample_id


def mixed_dmp(comm):
    """``_Mixed`` with ours swapped and TorchRec's sharded row-wise by DMP; also
    returns our collection and the dense optimizer (the docs test uses it too)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from freescale.embedding import SGD, ShardingPlan, swap
    from tests.torchrec._torchrec import row_wise_dmp

    model = _Mixed()
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=0.1), modules=("seq",)), comm)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    dmp = row_wise_dmp(model, "theirs", ["cand"], fused)
    return dmp, coll, torch.optim.SGD(dmp.module.head.parameters(), lr=0.1)


def _sparse_dist_rank() -> bytes:
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from freescale.balance import BalancerConfig
    from freescale.comm import TorchCommunicator
    from freescale.torchrec.pipeline import balanced_batches

    comm = TorchCommunicator()
    dmp, coll, optimizer = mixed_dmp(comm)
    before = coll.full_table("seq.item")
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    batches = balanced_batches(comm, kjt_batches(dist.get_rank()), BalancerConfig("fbs"))
    seen = []
    while True:
        try:
            seen.append(pipeline.progress(batches))  # the model's output: sample ids
        except StopIteration:
            break
    return pack(
        {
            "seen": torch.cat(seen),
            "sizes": [s.numel() for s in seen],
            "moved": coll.full_table("seq.item") - before,
            "pipelined": len(pipeline._pipelined_modules),
        }
    )


def kjt_batches(rank: int):
    from freescale.torchrec.pipeline import KJTBatch

    first = 0
    for step, sizes in enumerate(SIZES):
        start = first + sum(sizes[:rank])
        b = random_batch(10 * step + rank, sizes[rank], first_sample_id=start)
        b.uih.features["item_ids"] %= 100
        b.candidates.features["item_ids"] %= 100
        first += sum(sizes)
        yield KJTBatch.from_sample_batch(b)


@pytest.mark.slow
def test_balanced_batches_in_front_of_torchrec_train_pipeline_sparse_dist():
    per_rank = [unpack(x) for x in run_ranks(_sparse_dist_rank, 2, timeout=180)]
    seen = torch.cat([r["seen"] for r in per_rank])
    total = sum(sum(s) for s in SIZES)
    assert sorted(seen.tolist()) == list(range(total))  # each sample exactly once
    for step, sizes in enumerate(SIZES):
        got = [r["sizes"][step] for r in per_rank]
        assert sum(got) == sum(sizes) and max(got) - min(got) <= 1  # balanced counts
    assert all(r["pipelined"] == 1 for r in per_rank)  # TorchRec's input dist ran ahead
    assert per_rank[0]["moved"].abs().sum() > 0  # our swapped table trained
