"""Held-out evaluation of file data: each user once at any world size; train -> eval."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from freescale.data import SequenceSampling, SequenceSource, read_sasrec
from freescale.jagged.batch import CAND_IDS, UIH_IDS
from freescale.models.ranking import SUM_FIELDS, ranking_metrics, ranking_sums
from freescale.pipeline.evaluation import evaluate_split
from freescale.testing import run_ranks
from freescale.testing.tolerance import reduction_tol


class ScoreById(nn.Module):
    """A fixed scorer of (last UIH item, candidate) that logs the users it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, batch):
        self.seen += batch.sample_id.tolist()
        cand = batch.candidates[CAND_IDS].double()
        owner = torch.repeat_interleave(
            torch.arange(batch.batch_size), batch.num_candidates(), output_size=cand.numel()
        )
        last = batch.uih[UIH_IDS][(batch.uih.offsets[1:] - 1).clamp(min=0)].double()
        return torch.sin(cand * 0.37 + (last[owner] if owner.numel() else 0) * 0.11).float()


def write_data(path, users=23):
    gen = torch.Generator().manual_seed(0)
    lines = []
    for u in range(users):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        lines += [f"{u} {int(i)}\n" for i in torch.randint(0, 60, (n,), generator=gen)]
    path.write_text("".join(lines))


def _evaluate(path: str, world: int):
    src = SequenceSource(read_sasrec(path), SequenceSampling(eval_negatives=20))
    model = ScoreById()
    metrics = evaluate_split(model, src, "test", dist.get_rank(), world, 3, torch.device("cpu"))
    return metrics, model.seen


@pytest.mark.numeric
def test_each_user_once_and_same_metrics_at_world_1_2_4(tmp_path):
    path = tmp_path / "s.txt"
    write_data(path)
    src = SequenceSource(read_sasrec(path), SequenceSampling(eval_negatives=20))
    # reference: every evaluated user in one batch, one process
    batch = src.eval_batch("test", 0, 0, 1, len(src.eval_users))
    ref = ranking_metrics(ranking_sums(ScoreById()(batch), batch.labels, batch.candidates.offsets))
    assert ref["users"] == len(src.eval_users) < 23  # some users are too short
    # Per-user terms are the same; their float64 sums (one-signed, a few ops
    # per candidate) are split over batches and ranks: relative rounding.
    rtol = reduction_tol(torch.float64, batch.labels.numel(), 0.0, depth=3)["rtol"]
    for world in (1, 2, 4):
        results = run_ranks(_evaluate, world, str(path), world)
        seen = sorted(u for _, s in results for u in s)
        assert seen == list(range(len(src.eval_users))), world
        for metrics, _ in results:
            assert metrics == pytest.approx(ref, rel=rtol, abs=0.0), world
    assert len(SUM_FIELDS) == 8


def test_train_summary_has_split_metrics_and_eval_reloads_the_checkpoint(tmp_path, capsys):
    from freescale.cli.main import main

    path = tmp_path / "s.txt"
    write_data(path, users=60)
    ckpt = tmp_path / "ck"
    args = [
        "train", "--set", f"data=sasrec:{path}", "--set", "run.steps=6", "--set", "run.warmup=1",
        "--set", "run.batch_size=4", "--set", "data.samples_per_user=0",
        "--set", "evaluation.every=3",
        "--set", "data.eval_negatives=30", "--set", f"checkpoint.dir={ckpt}",
        "--set", "checkpoint.every=6", "--set", "output.progress=false",
    ]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = summary["eval"]
    users = final["data"]["eval_users"]
    assert final["test"]["users"] == final["valid"]["users"] == users > 0
    assert final["test"]["negatives_per_user"] == 30
    for key in ("hr@10", "ndcg@10", "auc", "ne"):
        assert 0 <= final["test"][key] < float("inf")
    assert set(final["popularity_test"]) >= {"hr@10", "ndcg@10", "auc"}
    assert main(["eval", str(ckpt)]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["command"] == "eval" and again["step"] == 6
    assert again["eval"]["test"] == final["test"]  # the same weights, the same evaluation


def test_movielens_top_rating_fits_the_action_table(tmp_path, capsys):
    """Rating 5 is action 10: the model's action table comes from the data (was 4 rows)."""
    from freescale.cli.main import main

    path = tmp_path / "ratings.dat"
    path.write_text(
        "".join(f"{u}::{(u * 7 + k) % 50 + 1}::5::{k}\n" for u in range(1, 30) for k in range(6))
    )
    args = [
        "train",
        "--set",
        f"data=movielens:{path}",
        "--set",
        "run.steps=3",
        "--set",
        "run.warmup=1",
    ]
    assert main([*args, "--set", "run.batch_size=4", "--set", "output.progress=false"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["eval"]["test"]["users"] == 29
