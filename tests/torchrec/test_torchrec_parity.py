"""Parity with TorchRec 1.8 (+ fbgemm-gpu-cpu): the same tables, inputs and loss through
TorchRec's row-wise sharded ``EmbeddingCollection`` with a fused optimizer and through a
swapped one; after 20 steps tables and optimizer state agree up to rounding.

Not bitwise: FBGEMM computes ``w - lr * g`` (and Adagrad's ``g / (sqrt(s) + eps)``)
in one fused expression, with its own order of summing duplicate ids' gradients;
ours rounds the product and the subtraction separately. The tolerance adds up,
step by step, the error of each row's duplicate sum (its terms and their
absolute sum, measured in our run) times what the optimizer makes of it
(`_drift`).
"""

import pytest
import torch
from torch import nn

from freescale.comm import TorchCommunicator
from freescale.embedding import ShardingPlan, swap
from freescale.testing import run_ranks
from freescale.testing.tolerance import SAFETY, eps_of, reduction_tol
from freescale.torchrec.fused_optimizer import from_fused_params, set_gradient_division
from tests.embedding._train import pack, unpack
from tests.torchrec._torchrec import row_wise_dmp

STEPS, BATCH = 20, 3
pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")


def _ec():
    import torchrec

    torch.manual_seed(0)
    return torchrec.EmbeddingCollection(
        tables=[
            torchrec.EmbeddingConfig(
                name="t1", embedding_dim=4, num_embeddings=13, feature_names=["f1", "f2"]
            ),
            torchrec.EmbeddingConfig(
                name="t2", embedding_dim=4, num_embeddings=6, feature_names=["f3"]
            ),
        ],
        device=torch.device("cpu"),
    )


def _batches(rank: int) -> list:
    """Per-rank KJTs with repeated ids, empty samples and int32 lengths."""
    import torchrec

    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (3 * BATCH,), generator=g, dtype=torch.int32)
        n = [int(lengths[k * BATCH : (k + 1) * BATCH].sum()) for k in range(3)]
        values = torch.cat(
            [
                torch.randint(0, 13, (n[0] + n[1],), generator=g),
                torch.randint(0, 6, (n[2],), generator=g),
            ]
        )
        kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=values, lengths=lengths)
        target = torch.randn(int(lengths.sum()), 4, generator=g)
        out.append((kjt, target))
    return out


def _loss(out: dict, target: torch.Tensor) -> torch.Tensor:
    emb = torch.cat([out[f].values() for f in ("f1", "f2", "f3")])
    return ((emb - target) ** 2).sum()


def _with_enum(fused_params: dict) -> dict:
    """TorchRec's CPU kernels want the ``EmbOptimType`` (and ``WeightDecayMode``)
    itself, not its name."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    out = {**fused_params, "optimizer": EmbOptimType(fused_params["optimizer"])}
    if "weight_decay_mode" in out:
        out["weight_decay_mode"] = WeightDecayMode[out["weight_decay_mode"]]
    return out


def _torchrec_rank(fused_params: dict) -> bytes:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = nn.Sequential(_ec())
    dmp = row_wise_dmp(model, "0", ["t1", "t2"], _with_enum(fused_params))
    for kjt, target in _batches(rank):
        _loss(dmp(kjt), target).backward()
    # Each rank's row-wise shards of the tables and of the optimizer state.
    shards = {}
    for key, st in dmp.state_dict().items():
        shards[key] = [(s.metadata.shard_offsets[0], s.tensor) for s in st.local_shards()]
    for key, st in dmp.fused_optimizer.state_dict()["state"].items():
        for name, v in st.items():
            if hasattr(v, "local_shards"):
                shards[f"{key}.{name}"] = [
                    (s.metadata.shard_offsets[0], s.tensor) for s in v.local_shards()
                ]
    return pack(shards)


TABLE_OF = {"f1": ("t1", 13), "f2": ("t1", 13), "f3": ("t2", 6)}


def _drift(fused_params: dict, out: dict, target, kjt, coll) -> tuple[float, float]:
    """How far one step may move a weight and an accumulator of the two
    implementations apart: each row's gradient is a sum over its ids on both
    ranks of ``2 (e - target) / W`` (rounded in another order: `reduction_tol`
    of the busiest row's terms and absolute sum), which SGD scales by ``lr``
    and Adagrad by at most ``lr (1 + dim) / sqrt(s)`` (``g² / s <= dim``), ``s``
    the smallest accumulator of a row it updated; the accumulator moves by
    ``2 |g| Δg <= 2 S Δg``."""
    import torch.distributed as dist

    world = dist.get_world_size()
    emb = torch.cat([out[f].values() for f in ("f1", "f2", "f3")])
    terms = (2 * (emb.detach() - target) / world).abs().double()
    ids = kjt.values()
    step, state = 0.0, 0.0
    for name, rows in (("t1", 13), ("t2", 6)):
        pick = torch.cat([torch.full((out[f].values().shape[0],), TABLE_OF[f][0] == name)
                          for f in ("f1", "f2", "f3")])  # fmt: skip
        size = torch.zeros(rows, 4, dtype=torch.float64).index_add_(0, ids[pick], terms[pick])
        count = torch.bincount(ids[pick], minlength=rows).double()
        dist.all_reduce(size)
        dist.all_reduce(count)
        touched = count > 0
        if not touched.any():
            continue
        summed = float(size.max())
        dg = reduction_tol(torch.float32, int(count.max()), summed)["atol"]
        lr = fused_params["learning_rate"]
        if fused_params["optimizer"] == "exact_sgd":
            step = max(step, lr * dg)
            continue
        s = coll.full_optimizer_state(f"0.{name}")["sum_sq"]
        step = max(step, lr * (1 + 4) * dg / float(s[touched].min().sqrt()))
        state = max(state, 2 * summed * dg)
    return step, state


def _ours_rank(fused_params: dict) -> bytes:
    import torch.distributed as dist

    model = nn.Sequential(_ec())
    coll = swap(
        model,
        ShardingPlan(optimizer=from_fused_params(_with_enum(fused_params))),
        TorchCommunicator(),
    )
    set_gradient_division(coll, True)  # TorchRec's default
    drift = torch.zeros(2, dtype=torch.float64)  # weights, accumulators
    for kjt, target in _batches(dist.get_rank()):
        out = model(kjt)
        _loss(out, target).backward()
        drift += torch.tensor(_drift(fused_params, out, target, kjt, coll), dtype=torch.float64)
    out = {n: coll.full_table(f"0.{n}") for n in ("t1", "t2")}
    out["drift"] = drift
    for n in ("t1", "t2"):
        for k, v in coll.full_optimizer_state(f"0.{n}").items():
            out[f"{n}.{k}"] = v
    return pack(out)


def _assemble(per_rank: list[dict], key: str) -> torch.Tensor:
    pieces = sorted(p for r in per_rank for p in r[key])
    return torch.cat([t for _, t in pieces])


ADAGRAD = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.1, "eps": 1e-8}
CASES = [
    ({"optimizer": "exact_sgd", "learning_rate": 0.05}, None),
    (ADAGRAD, "sum_sq"),
    # FBGEMM's CPU kernels have both decays for row-wise Adagrad (its Adam has no
    # CPU kernel; Adam's decay is checked against torch.optim.AdamW instead).
    ({**ADAGRAD, "weight_decay": 0.2, "weight_decay_mode": "L2"}, "sum_sq"),
    ({**ADAGRAD, "weight_decay": 0.2, "weight_decay_mode": "DECOUPLE"}, "sum_sq"),
]


def _both_rank() -> bytes:
    """Both optimizers, TorchRec's and ours, in one process: TorchRec's import is slow."""
    return pack([(unpack(_torchrec_rank(fp)), unpack(_ours_rank(fp))) for fp, _ in CASES])


@pytest.mark.numeric
def test_parity_with_torchrec_rowwise_sharded_fused_optimizer_gloo():
    per_rank = [unpack(x) for x in run_ranks(_both_rank, 2, timeout=120)]
    initial = _ec()
    # Each step rounds the weights and accumulators (fused or not) a few times.
    rtol = SAFETY * eps_of(torch.float32) * 2 * STEPS
    tols = []
    for c, (_fused_params, state) in enumerate(CASES):
        theirs = [r[c][0] for r in per_rank]
        ours = per_rank[0][c][1]
        weight_drift, state_drift = (float(v) for v in ours["drift"])
        tols.append({"atol": weight_drift, "rtol": rtol})
        for n in ("t1", "t2"):
            w = _assemble(theirs, f"0.embeddings.{n}.weight")
            assert not torch.equal(w, initial.embeddings[n].weight.detach())  # it trained
            torch.testing.assert_close(ours[n], w, **tols[c])
            if state is None:
                continue
            (key,) = [k for k in theirs[0] if k.startswith(f"0.embeddings.{n}.weight.")]
            s_ours, s_theirs = ours[f"{n}.{state}"], _assemble(theirs, key).flatten()
            assert s_ours.max() > 1  # it accumulated
            torch.testing.assert_close(s_ours, s_theirs, atol=state_drift, rtol=rtol)
    # The decayed runs moved away from the undecayed one by more than rounding:
    # the decay was applied.
    plain = per_rank[0][1][1]["t1"]
    for c in (2, 3):
        decayed = per_rank[0][c][1]["t1"]
        with pytest.raises(AssertionError):
            torch.testing.assert_close(decayed, plain, **tols[c])
