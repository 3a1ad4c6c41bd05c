"""`LoadBalancer` over real gloo process groups (one process per rank).

Every rank balances four global steps with each partitioner: two steps with
their stages interleaved as the pipeline will run them, then feedback from
(synthetic) measured times, then two one-call steps that use it. The test
process rebuilds every rank's input and checks the outputs sample by sample.
"""

import pytest
import torch

from freescale.balance import (
    FBS,
    BalancerConfig,
    CostModelConfig,
    LoadBalancer,
    Plan,
    RuntimeInfo,
    WorldLengths,
    equal_counts,
    identity,
)
from freescale.comm import TorchCommunicator
from freescale.jagged import SampleBatch
from freescale.testing import run_ranks
from tests.balance._helpers import check_balanced, rank_batches, reverse_partitioner

PARTITIONERS = {
    "none": "none",
    "fbs": "fbs",
    "vbs": "vbs",
    "cost": "cost",
    "user": reverse_partitioner,
}
SIZES = {
    1: [[6], [0], [3], [5]],
    2: [[0, 9], [4, 4], [7, 1], [3, 0]],
    4: [[5, 0, 7, 3], [2, 2, 2, 2], [0, 0, 1, 0], [9, 1, 0, 4]],
}
FAKE_COST = torch.tensor([0.5, 1e-2, 1e-4, 0.3, 0.02], dtype=torch.float64)


def _rank(sizes_per_step):
    comm = TorchCommunicator()
    out = {}
    for name, spec in PARTITIONERS.items():
        cfg = BalancerConfig(spec, verify_plans=True, cost_model=CostModelConfig(min_steps=1))
        lb = LoadBalancer(comm, cfg)
        batches = [rank_batches(s, seed=k)[comm.rank] for k, s in enumerate(sizes_per_step)]
        h0 = lb.stage2(lb.start_stage1(batches[0]))
        h1 = lb.start_stage1(batches[1])
        b0 = lb.stage3(h0)
        b1 = lb.stage3(lb.stage2(h1))
        for h in (h0, h1):  # what the pipeline measures, identical on every rank
            feats = h.rank_features()
            lb.observe((feats @ FAKE_COST).tolist(), feats)
        b2, b3 = lb.balance(batches[2]), lb.balance(batches[3])
        out[name] = {
            "outputs": [b0, b1, b2, b3],
            "plans": [(h0.plan.order, h0.plan.counts), (h1.plan.order, h1.plan.counts)],
            "shares": lb.autotune.shares,
        }
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_balancing_over_gloo_moves_every_sample_exactly_once(world_size):
    sizes = SIZES[world_size]
    per_rank = run_ranks(_rank, world_size, sizes, timeout=120)
    stateless = {"none": identity, "fbs": FBS(), "user": reverse_partitioner}
    for name in PARTITIONERS:
        res = [r[name] for r in per_rank]
        assert all(r["shares"] == res[0]["shares"] for r in res)
        for k, step_sizes in enumerate(sizes):
            inputs = rank_batches(step_sizes, seed=k)
            outputs = [r["outputs"][k] for r in res]
            world = WorldLengths.from_batches(inputs)
            if k < 2:  # the plan every rank reports, identical on all ranks
                order, counts = res[0]["plans"][k]
                assert all(torch.equal(r["plans"][k][0], order) for r in res)
                assert all(r["plans"][k][1] == counts for r in res)
                plan = Plan(order, counts)
            else:  # the plan the outputs realize (validity and contents checked below)
                plan = _plan_from_outputs(inputs, outputs)
            if name in stateless:
                expected = stateless[name](world, RuntimeInfo())
                assert torch.equal(plan.order, expected.order) and plan.counts == expected.counts
            check_balanced(inputs, plan, outputs)
            g, w = world.total, world_size
            if name in ("fbs", "cost"):
                assert plan.counts == equal_counts(g, w)
            if name == "vbs" and g >= w:
                assert min(plan.counts) >= 1


def _plan_from_outputs(inputs, outputs) -> Plan:
    """The plan the outputs realize: global index of each received sample id."""
    ids = SampleBatch.concat(list(inputs)).sample_id.tolist()
    pos = {s: g for g, s in enumerate(ids)}
    order = [pos[s] for o in outputs for s in o.sample_id.tolist()]
    return Plan(torch.tensor(order, dtype=torch.int64), tuple(o.batch_size for o in outputs))
