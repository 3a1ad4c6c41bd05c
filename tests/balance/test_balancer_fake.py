"""`LoadBalancer` on in-process fake ranks (threads): stages, capacity growth,
overlapped steps, runtime feedback and the errors that must not hang a job."""

from collections.abc import Sequence

import pytest
import torch

from freescale.balance import BalancerConfig, LoadBalancer, Plan, WorldLengths
from freescale.comm import FakeWorld, run_threads
from freescale.jagged import SampleBatch
from tests.balance._helpers import check_balanced, rank_batches, reverse_partitioner


class Counting:
    """A Communicator that records the collectives it forwards."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def all_gather(self, x):
        self.calls.append("all_gather")
        return self.inner.all_gather(x)

    def all_to_all_v(self, x, send_counts: Sequence[int], recv_counts: Sequence[int]):
        self.calls.append("all_to_all_v")
        return self.inner.all_to_all_v(x, send_counts, recv_counts)


def _two_steps_overlapped(comm, meta_world, sizes, partitioner):
    """Step 0's stage III runs after step 1's stage I, as in the pipeline; the
    lengths go over a separate meta communicator."""
    data, meta = Counting(comm), Counting(meta_world.communicator(comm.rank))
    lb = LoadBalancer(data, BalancerConfig(partitioner, capacity=1, verify_plans=True), meta)
    b0 = rank_batches(sizes[0], seed=10)[comm.rank]
    b1 = rank_batches(sizes[1], seed=11)[comm.rank]
    h0 = lb.stage2(lb.start_stage1(b0))
    h1 = lb.start_stage1(b1)
    out0 = lb.stage3(h0)
    lb.observe([10.0 + comm.world_size - r for r in range(comm.world_size)], h0.rank_features())
    h1 = lb.stage2(h1)
    out1 = lb.finish(lb.start_stage3(h1))
    totals = (h0.total_candidates, h1.total_candidates)
    return (
        out0,
        out1,
        h0.plan,
        h1.plan,
        data.calls,
        meta.calls,
        lb._capacity,
        lb.autotune.shares,
        totals,
    )


@pytest.mark.parametrize("partitioner", ["none", "fbs", "vbs", "cost", reverse_partitioner])
def test_overlapped_steps_balance_exactly(partitioner):
    sizes = ([3, 0, 5], [2, 4, 1])
    res = run_threads(_two_steps_overlapped, 3, FakeWorld(3), sizes, partitioner, timeout=30)
    for step in (0, 1):
        plans = [r[2 + step] for r in res]
        assert all(p.digest() == plans[0].digest() for p in plans)
        check_balanced(rank_batches(sizes[step], seed=10 + step), plans[0], [r[step] for r in res])
    for r in res:
        data_calls, meta_calls, capacity, shares, totals = r[4:]
        assert totals == tuple(
            SampleBatch.concat(rank_batches(sizes[k], seed=10 + k)).num_candidates_total
            for k in (0, 1)
        )
        assert set(data_calls) <= {"all_to_all_v"}  # lengths never go over the data comm
        # per step: stage I, stage II, plan check; step 0 overflowed capacity 1 and
        # re-gathered once, step 1 started after the growth and fit
        assert meta_calls == ["all_gather"] * (4 + 3)
        assert capacity == 5
        assert shares[0] < shares[-1]  # rank 0 reported the longest time


def _steps(comm, sizes_per_step, partitioner):
    lb = LoadBalancer(comm, BalancerConfig(partitioner, capacity=8, verify_plans=True))
    counting = Counting(comm)
    lb.meta = counting
    outs = []
    for k, sizes in enumerate(sizes_per_step):
        outs.append(lb.balance(rank_batches(sizes, seed=20 + k)[comm.rank]))
    return outs, counting.calls


def test_empty_worlds_and_batches_without_candidates():
    steps = [[0, 0], [0, 3], [2, 0]]
    res = run_threads(_steps, 2, steps, "fbs", timeout=30)
    for k, sizes in enumerate(steps):
        outs = [r[0][k] for r in res]
        assert [o.batch_size for o in outs] == [sum(sizes) - sum(sizes) // 2, sum(sizes) // 2]
        world = SampleBatch.concat(rank_batches(sizes, seed=20 + k))
        assert torch.equal(
            torch.sort(torch.cat([o.sample_id for o in outs])).values, world.sample_id
        )
    # step 0 has no candidates anywhere: no stage-II gather (1 + 0 + 1 plan check)
    assert res[0][1][:2] == ["all_gather", "all_gather"]


def test_world_size_one_sends_nothing():
    res = run_threads(_steps, 1, [[4], [0]], "fbs", timeout=30)
    ((outs, _),) = res
    assert outs[0].equal(rank_batches([4], seed=20)[0].select(torch.tensor([0, 1, 2, 3])))


def _mismatched_schema(comm):
    batch = rank_batches([2, 2], seed=1)[comm.rank]
    if comm.rank == 1:
        batch = SampleBatch(
            batch.uih, batch.candidates, batch.labels, batch.content, batch.sample_id, None
        )
    lb = LoadBalancer(comm)
    return lb.balance(batch)


def test_mismatched_batches_raise_on_every_rank_instead_of_hanging():
    with pytest.raises(ValueError, match="different features"):
        run_threads(_mismatched_schema, 2, timeout=20)


def _bad_partitioner(world: WorldLengths, runtime) -> Plan:
    return Plan(torch.zeros(world.total, dtype=torch.int64), (world.total, 0))


def test_a_user_plan_that_duplicates_samples_is_rejected():
    with pytest.raises(ValueError, match="loses samples"):
        run_threads(_steps, 2, [[2, 2]], _bad_partitioner, timeout=20)


def _misuse(comm):
    lb = LoadBalancer(comm)
    h = lb.start_stage1(rank_batches([1], seed=0)[0])
    errors = []
    for call in (lb.start_stage3, lb.finish):
        try:
            call(h)
        except RuntimeError as exc:
            errors.append(str(exc))
    lb.stage3(lb.stage2(h))
    try:
        lb.stage2(h)
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_stages_must_run_in_order():
    (errors,) = run_threads(_misuse, 1, timeout=20)
    assert len(errors) == 3 and all("needs a handle" in e for e in errors)


def test_config_and_arguments_are_validated():
    with pytest.raises(ValueError):
        BalancerConfig(partitioner="nope")
    with pytest.raises(ValueError):
        BalancerConfig(capacity=-1)
    world = FakeWorld(2)
    lb = LoadBalancer(world.communicator(0))
    with pytest.raises(ValueError, match="meta_comm"):
        LoadBalancer(world.communicator(0), meta_comm=FakeWorld(3).communicator(0))
    with pytest.raises(ValueError, match="one-rank"):
        lb.start_stage1(
            rank_batches([2], seed=0)[0], WorldLengths.from_batches(rank_batches([1, 1], seed=0))
        )
    with pytest.raises(ValueError):
        lb.observe([1.0, 2.0, 3.0])


def test_a_state_of_another_world_size_keeps_the_cost_model_only():
    """A resumed run with more or fewer ranks: the cost model's rows (per-rank
    observations) and fit carry over; AutoTune's per-rank shares start afresh."""
    lb = LoadBalancer(FakeWorld(2).communicator(0))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        features = torch.rand(2, 5, generator=g, dtype=torch.float64) * 100
        lb.observe((features[:, 1] * 0.3 + 1.0).tolist(), features)
    state = lb.state_dict()
    assert lb.cost_model.fitted and lb.autotune.shares != (0.5, 0.5)
    for world in (1, 4):
        other = LoadBalancer(FakeWorld(world).communicator(0))
        other.load_state_dict(state)
        assert other.cost_model.coefficients == lb.cost_model.coefficients
        assert len(other.cost_model.state_dict()["rows"]) == 4
        assert other.autotune.shares == tuple([1.0 / world] * world)
        assert other.last_times_ms is None
    same = LoadBalancer(FakeWorld(2).communicator(1))
    same.load_state_dict(state)
    assert same.autotune.shares == lb.autotune.shares and same.last_times_ms == lb.last_times_ms
