"""`GradSum` on gloo ranks: buckets fixed by registration, launched during
backward in their order, a sum over ranks whose bits do not depend on what the
reducer did before, zeros for a parameter a rank did not use, nothing reduced
outside an armed step, rank 0's weights broadcast, compiled regions alike."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from freescale.comm.grad_sum import GradSum, cut_buckets
from freescale.testing import run_ranks

SMALL = 64 * 4  # bytes: every bucket a few parameters


class _Net(nn.Module):
    """Layers registered in one order and used in another, so gradients
    arrive in neither registration order nor its reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 1)  # used by a rank only when it asks for it

    def forward(self, x: torch.Tensor, spare: bool = True) -> torch.Tensor:
        y = self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))
        return y.sum() + (self.spare(y).sum() if spare else 0.0)


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _step(net: _Net, sum_: GradSum, seed: int, spare: bool = True) -> list[torch.Tensor]:
    """One armed backward of this rank's batch ``seed``; the summed gradients."""
    torch.manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(16, 8, requires_grad=True)
    events: list[str] = []
    x.register_hook(lambda g: events.append("input gradient"))  # backward's last node
    sum_.on_launch = lambda: events.append("launch")
    sum_.arm()
    net(x, spare).backward()
    sum_.finish()
    # A bucket left before backward ended (not when the first one waits for
    # the parameter this rank left out: buckets leave in their order).
    assert events[0] == "launch" or not spare, events
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    return grads


def _local_grads(net: _Net, seed: int, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(seed * 100 + rank)
    net(torch.randn(16, 8, requires_grad=True)).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    return grads


def _scenarios(compiled: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    # Rank 0's weights win, as with DDP.
    net = _net(seed=rank)
    sum_ = GradSum(net.parameters(), first_bytes=SMALL, bucket_bytes=SMALL)
    out["weights"] = [p.detach().clone() for p in net.parameters()]
    out["buckets"] = len(sum_.buckets)
    out["views"] = all(
        p.grad is None or p.grad.data_ptr() == v.data_ptr()
        for b in sum_.buckets
        for p, v in zip(b.params, b.views, strict=True)
    )
    if compiled:
        for layer in (net.a, net.b, net.c):
            layer.compile(backend="aot_eager")
    # A backward outside an armed step reduces nothing (only rank 0 runs one:
    # a collective there would pair with the next step's and fail or hang).
    if rank == 0:
        net(torch.randn(2, 8)).backward()
        net.zero_grad(set_to_none=True)
    # Two steps; then a fresh reducer over the same weights runs the second.
    first = _step(net, sum_, seed=1)
    out["second"] = _step(net, sum_, seed=2)
    sum_.remove()
    again = _net(seed=rank)
    with torch.no_grad():
        for p, q in zip(again.parameters(), net.parameters(), strict=True):
            p.copy_(q)
    if compiled:
        for layer in (again.a, again.b, again.c):
            layer.compile(backend="aot_eager")
    fresh = GradSum(again.parameters(), first_bytes=SMALL, bucket_bytes=SMALL)
    out["second_fresh"] = _step(again, fresh, seed=2)
    # The plain sum of the ranks' local gradients (another order: close, not equal).
    local = torch.stack([torch.cat([g.reshape(-1) for g in _local_grads(again, 2, r)])
                         for r in range(world)]) if rank == 0 else None  # fmt: skip
    out["expected"] = None if local is None else local.sum(0)
    # A rank that leaves a parameter out adds zeros for it: no hang.
    out["spare"] = _step(again, fresh, seed=3, spare=rank != 1)[-2:]
    out["first"] = first
    return out


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_ranks(_scenarios, 3, False, timeout=120)


def test_buckets_are_cut_from_registration_order_alone():
    params = list(_net(0).parameters())  # a.w a.b b.w b.b c.w c.b spare.w spare.b
    sizes = [p.numel() * 4 for p in params]
    assert sizes == [256, 32, 256, 32, 256, 32, 32, 4]
    cut = cut_buckets(params, first_bytes=256, bucket_bytes=300)
    at = {id(p): i for i, p in enumerate(params)}
    names = [[at[id(p)] for p in b] for b in cut]
    # launched last-registered first; the first cut closes at 256 bytes
    assert names == [[7], [4, 5, 6], [1, 2, 3], [0]]
    assert [len(b) for b in cut_buckets(params)] == [8]  # DDP's caps: one bucket here
    half = [*params[:2], nn.Parameter(torch.zeros(3, dtype=torch.float64)), *params[2:]]
    assert [len(b) for b in cut_buckets(half)] == [6, 1, 2]  # a dtype change cuts


def test_rank_0_weights_are_broadcast(three_ranks):
    for r in three_ranks[1:]:
        for a, b in zip(three_ranks[0]["weights"], r["weights"], strict=True):
            assert torch.equal(a, b)


def test_the_sum_is_the_ranks_sum_and_the_same_on_every_rank(three_ranks):
    assert three_ranks[0]["buckets"] > 2 and three_ranks[0]["views"]
    got = torch.cat([g.reshape(-1) for g in three_ranks[0]["second_fresh"]])
    torch.testing.assert_close(got, three_ranks[0]["expected"], rtol=1e-5, atol=1e-6)
    for r in three_ranks[1:]:
        for key in ("first", "second", "second_fresh", "spare"):
            for a, b in zip(three_ranks[0][key], r[key], strict=True):
                assert torch.equal(a, b), key


def test_a_fresh_reducer_sums_bit_for_bit_as_one_that_ran_before(three_ranks):
    for r in three_ranks:
        for a, b in zip(r["second"], r["second_fresh"], strict=True):
            assert torch.equal(a, b)


def test_a_rank_without_a_parameter_adds_zeros(three_ranks):
    weight, bias = three_ranks[0]["spare"]
    assert weight.abs().sum() > 0 and bias.abs().sum() > 0  # ranks 0 and 2 used it


@pytest.mark.slow
def test_compiled_regions_are_summed_as_eager_ones(three_ranks):
    compiled = run_ranks(_scenarios, 3, True, timeout=240)
    for eager, comp in zip(three_ranks, compiled, strict=True):
        for key in ("first", "second", "second_fresh", "spare"):
            for a, b in zip(eager[key], comp[key], strict=True):
                assert torch.equal(a, b), key
