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
    from freescale.embedding.torchrec_pipeline import KJTBatch, balance_stage

    rank = dist.get_rank()
    comm = TorchCommunicator()
    model = _model()
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=0.1)), comm)
    before = coll.full_table("0.item")

    def batches():
        first = 0
        for step, sizes in enumerate(SIZES):
            start = first + sum(sizes[:rank])
            b = random_batch(10 * step + rank, sizes[rank], first_sample_id=start)
            b.uih.features["item_ids"] %= 100
            b.candidates.features["item_ids"] %= 100
            first += sum(sizes)
            yield KJTBatch.from_sample_batch(b)

    # On the CPU TorchRec's pipeline needs a stream object with a device.
    pipeline = StagedTrainPipeline(
        [balance_stage(comm, BalancerConfig("fbs"))], compute_stream=torch.Stream("cpu")
    )
    seen, sizes = [], []
    it = batches()
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
