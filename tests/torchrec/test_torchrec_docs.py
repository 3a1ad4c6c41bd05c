"""The snippets of docs/torchrec.md run, in order, on 2 gloo ranks."""

import re
from pathlib import Path

import pytest
import torch

from freescale.testing import run_ranks
from tests.embedding._train import pack, unpack
from tests.torchrec.test_torchrec_pipeline import SIZES, kjt_batches, mixed_dmp

DOC = Path(__file__).resolve().parents[2] / "docs" / "torchrec.md"
pytest.importorskip("torchrec")


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _docs_rank(snippets: list[str], checkpoint_dir: str) -> bytes:
    scope: dict = {"checkpoint_dir": checkpoint_dir}
    model_block, train_block, load_block, pipeline_block, sparse_dist_block = snippets
    exec(model_block, scope)
    before = scope["model"].ec.embeddings["item"].weight.detach().clone()
    exec(train_block, scope)
    collection = scope["collection"]
    trained = collection.full_table("ec.item")
    collection.set_table("ec.item", torch.zeros_like(trained))  # the load must restore it
    exec(load_block, scope)
    exec(pipeline_block, scope)
    import torch.distributed as dist

    from freescale.comm import TorchCommunicator

    scope["dmp"], _, scope["dense_optimizer"] = mixed_dmp(TorchCommunicator())
    scope["my_batches"] = kjt_batches(dist.get_rank())
    exec(sparse_dist_block, scope)
    return pack(
        {
            "before": before,
            "trained": trained,
            "loaded": collection.full_table("ec.item"),
            "lr": scope["fused_optimizer"].param_groups[0]["lr"],
            "keys": sorted(scope["state"]),
            "seen": torch.cat(scope["outputs"]),
        }
    )


def test_torchrec_doc_snippets_run(tmp_path):
    snippets = _snippets()
    assert len(snippets) == 5
    per_rank = [unpack(x) for x in run_ranks(_docs_rank, 2, snippets, str(tmp_path), timeout=180)]
    seen = torch.cat([r["seen"] for r in per_rank])  # the sparse-dist pipeline's outputs
    assert sorted(seen.tolist()) == list(range(sum(map(sum, SIZES))))
    for r in per_rank:
        assert not torch.equal(r["trained"], r["before"])
        assert torch.equal(r["loaded"], r["trained"])
        assert r["lr"] == 0.05
        assert r["keys"] == [
            "ec.embeddings.item.optimizer.step",
            "ec.embeddings.item.optimizer.sum_sq",
            "ec.embeddings.item.weight",
        ]
