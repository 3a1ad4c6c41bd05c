"""Bad input on one rank is every rank's error, raised before anything changes;
empty local batches and samples without history simply train."""

import math
import time
from dataclasses import replace

import pytest
import torch

from freescale.config import build_config
from freescale.jagged.batch import UIH_ACTIONS
from freescale.jagged.tensor import JaggedFeatures
from freescale.pipeline.inputs import Limits, find_problem
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks
from freescale.testing.batches import random_batch

BAD_RANK, BAD_STEP = 1, 3
COMMON = ["run.steps=6", "run.warmup=1", "evaluation.every=0", "output.progress=false",
          "run.batch_size=8",
          "run.timeout_s=60"]  # fmt: skip


def _shift(jf: JaggedFeatures, delta: int, first: int = 1) -> JaggedFeatures:
    offsets = jf.offsets.clone()
    offsets[first:] += delta
    return JaggedFeatures(offsets, jf.features)


def _empty_history(b):
    zero = torch.zeros(b.batch_size + 1, dtype=torch.int64)
    return replace(b, uih=JaggedFeatures(zero, {k: v[:0] for k, v in b.uih.features.items()}))


def _action_oob(b):
    actions = b.uih[UIH_ACTIONS].clone()
    actions[-1] = 99
    return replace(b, uih=JaggedFeatures(b.uih.offsets, {**b.uih.features, UIH_ACTIONS: actions}))


def _nan_label(b):
    labels = b.labels.clone()
    labels[-1] = float("nan")
    return replace(b, labels=labels)


CORRUPT = {
    "empty_batch": lambda b: b.slice(0, 0),
    "empty_history": _empty_history,
    "content_offsets_too_long": lambda b: replace(b, content=_shift(b.content, 2, first=-1)),
    "action_id_beyond_table": _action_oob,
    "uih_offsets_off_by_3": lambda b: replace(b, uih=_shift(b.uih, 3)),
    "candidate_offsets_not_labels": lambda b: replace(
        b, candidates=_shift(b.candidates, 1, first=-1)
    ),
    "nan_label": _nan_label,
}


class Corrupted:
    """The run's source, with one rank's batch of one step corrupted."""

    def __init__(self, source, case: str) -> None:
        self.source, self.case = source, case
        self.num_items = source.num_items

    def batch(self, step, rank, world_size, batch_size):
        b = self.source.batch(step, rank, world_size, batch_size)
        return CORRUPT[self.case](b) if (step, rank) == (BAD_STEP, BAD_RANK) else b

    def num_steps(self, world_size, batch_size):
        return self.source.num_steps(world_size, batch_size)


def _snapshot(trainer: Trainer) -> dict:
    return {
        "table": trainer.embeddings.full_table("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
    }


def _cases_rank(setting: str) -> dict:
    mode = setting.split()
    out = {}
    for case in CORRUPT:
        trainer = Trainer(build_config("demo", [*COMMON, *mode]))
        trainer.source = Corrupted(trainer.source, case)
        start = time.perf_counter()
        try:
            trainer.run()
            out[case] = {"error": None, "losses": [s["loss"] for s in trainer.summary.steps]}
        except Exception as e:
            out[case] = {"error": f"{type(e).__name__}: {e}", "at_step": trainer.liveness.step,
                         "seconds": time.perf_counter() - start, **_snapshot(trainer)}  # fmt: skip
    # What the tables and weights are after the steps before the bad batch.
    steps = {r["at_step"] for r in out.values() if r["error"]}
    assert len(steps) == 1, steps
    # (with the balancer two steps ahead, the bad batch is refused when it is loaded)
    clean = Trainer(
        build_config("demo", [*COMMON, *mode, f"run.steps={steps.pop()}", "run.warmup=0"])
    )
    clean.run()
    out["clean"] = _snapshot(clean)
    return out


@pytest.fixture(
    scope="module",
    params=["run.mode=sync", "run.mode=sdd", "run.mode=freescale", "run.mode=sync balance=fbs"],
)
def results(request):
    return run_ranks(_cases_rank, 2, request.param, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["empty_batch", "empty_history"])
def test_empty_local_batches_and_histories_train(results, case):
    for per_rank in results:
        r = per_rank[case]
        assert r["error"] is None, r["error"]
        assert len(r["losses"]) == 6 and all(math.isfinite(x) for x in r["losses"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,what",
    [
        ("content_offsets_too_long", "malformed content offsets"),
        ("action_id_beyond_table", "uih action id 99, outside [0, 4)"),
        ("uih_offsets_off_by_3", "malformed uih offsets"),
        ("candidate_offsets_not_labels", "malformed candidate offsets"),
        ("nan_label", "non-finite label"),
    ],
)
def test_bad_input_on_one_rank_is_every_ranks_error_before_any_change(results, case, what):
    errors = [per_rank[case]["error"] for per_rank in results]
    assert errors[0] == errors[1], errors  # the same message on every rank
    assert errors[0].startswith(f"ValueError: bad input on rank {BAD_RANK}, step {BAD_STEP}")
    assert what in errors[0] and "sample " in errors[0]
    for per_rank in results:
        r = per_rank[case]
        print(f"{case}: rank error after {r['seconds']:.2f} s of the run")
        assert r["seconds"] < 10  # not the 60 s timeout
        # nothing changed beyond the steps before the bad batch
        assert torch.equal(r["table"], per_rank["clean"]["table"])
        for k, v in per_rank["clean"]["dense"].items():
            assert torch.equal(r["dense"][k], v), k


def test_find_problem_names_sample_and_value():
    limits = Limits(num_items=100, num_actions=4)
    batch = random_batch(0, 6, first_sample_id=40)
    assert find_problem(batch, limits) is None
    dense = batch.dense.clone()
    dense[4, 1] = float("inf")
    assert find_problem(replace(batch, dense=dense), limits)[:4] == [3, 8, 4, 44]
    assert find_problem(batch.slice(0, 0), limits) is None
