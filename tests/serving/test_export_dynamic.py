"""Export of a model with a dynamic table: the program takes raw 64-bit ids.

The built-in sequence model's item table trained dynamic (raw ids through a
random injective 64-bit map, fewer rows than items: some evicted) at 1 and 2
thread ranks; its held (ids, rows) (`dynamic_rows`) and dense weights go
into the plain model (`load_served`), which exports like any other. The
program then scores batches of raw ids, ids never seen and evicted ones
included (they read zeros), bit for bit as the run's own eval forward.
A checkpoint that keeps a dynamic table by slot is refused in one line,
never exported as if its slots were rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import freescale
from freescale.cli.main import main
from freescale.comm import run_threads
from freescale.config import build_config
from freescale.embedding import RowwiseAdagrad, ShardingPlan, Sync, swap
from freescale.embedding.dynamic import DynamicSpec
from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_IDS, SampleBatch
from freescale.jagged.schema import DataSchema
from freescale.models import sequence
from freescale.serving import export_model, load
from freescale.serving.checkpoint import dynamic_table_of
from freescale.serving.dynamic import DynamicEmbedding, load_served, serve_by_id
from freescale.serving.loader import read_manifest
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

DIM, ITEMS, UNSEEN, CAPACITY, STEPS = 16, 300, 40, 100, 8
SCHEMA = DataSchema.standard(ITEMS, 4)


def _raw_ids() -> torch.Tensor:
    """Distinct random int64 ids (the extremes among them) for rows 0..ITEMS+UNSEEN-1."""
    g = torch.Generator().manual_seed(61)
    raw = torch.unique(torch.randint(-(2**63), 2**63 - 1, (4 * (ITEMS + UNSEEN),), generator=g))
    raw = raw[torch.randperm(raw.numel(), generator=g)][: ITEMS + UNSEEN - 2]
    return torch.cat([raw, torch.tensor([-(2**63), 2**63 - 1])])


RAW = _raw_ids()


def raw(batch: SampleBatch) -> SampleBatch:
    """``batch`` with every item id replaced by its raw 64-bit id."""
    for level, name in (("uih", UIH_IDS), ("candidates", CAND_IDS), ("content", CONTENT_IDS)):
        features = getattr(batch, level).features
        features[name] = RAW[features[name]]
    return batch


def train_batch(step: int) -> SampleBatch:
    return raw(random_batch(step, 4, max_uih=10, num_items=ITEMS, dense_dim=None))


def eval_batches() -> list[SampleBatch]:
    """Varied shapes (one sample, empty histories, one candidate, many) over the
    trained items and UNSEEN ids no step ever looked up; the last is `example`."""
    shapes = [(1, 6, 1), (3, 0, 2), (7, 30, 5), (16, 12, 3), (2, 1, 1)]
    out = [random_batch(200 + i, b, max_uih=u, max_candidates=c, num_items=ITEMS + UNSEEN,
                        dense_dim=None) for i, (b, u, c) in enumerate(shapes)]  # fmt: skip
    return [raw(b) for b in [*out, example()]]


def example() -> SampleBatch:
    """The traced batch: 16 samples, every size at least 2."""
    return random_batch(100, 16, max_uih=30, max_candidates=5, num_items=ITEMS + UNSEEN,
                        dense_dim=None)  # fmt: skip


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return sequence.build(SCHEMA, dim=DIM, layers=1).state_dict()


def train_and_score(comm, start: dict[str, torch.Tensor], batches: list[SampleBatch]) -> dict:
    """Train the model with its item table dynamic (each rank the same batches),
    then its eval forward on ``batches``, the table's held (ids, rows) and the
    dense weights."""
    model = sequence.build(SCHEMA, dim=DIM, layers=1)
    model.load_state_dict(start)
    plan = ShardingPlan(optimizer=RowwiseAdagrad(lr=0.1), modules=("item_emb",),
                        table_dynamics={"item_emb": DynamicSpec(CAPACITY)})  # fmt: skip
    collection = swap(model, plan, comm, mode=Sync())
    dense = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        batch = train_batch(step)
        logits = model(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        dense.zero_grad()
        (loss / max(1, logits.numel())).backward()
        dense.step()
    evictions = collection.dynamic_counts()[3]
    model.eval()
    with torch.no_grad(), collection.prefetch_disabled():
        scores = [model(b) for b in batches]
    ids, rows, _ = collection.dynamic_rows("item_emb")
    with collection.tables_left_out():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"scores": scores, "ids": ids, "rows": rows, "state": state, "evictions": evictions}


@pytest.mark.parametrize("world", [1, 2])
def test_the_program_scores_raw_ids_as_the_run_s_eval_forward(world, tmp_path):
    batches = eval_batches()
    ranks = run_threads(train_and_score, world, initial_state(), batches)
    assert sum(r["evictions"] for r in ranks) > 0  # trained ids without a row: zeros too
    run = ranks[0]
    ids, rows = run["ids"], run["rows"]
    assert ids.numel() > 0 and torch.equal(ids, torch.sort(ids).values)
    looked_up = torch.cat([torch.cat([b.uih[UIH_IDS], b.candidates[CAND_IDS]]) for b in batches])
    held = torch.isin(looked_up, ids)
    assert held.any() and not held.all()  # served ids with rows and ids without
    assert torch.isin(looked_up, RAW[ITEMS:]).any()  # ids no step ever saw

    plain = load_served(sequence.build(SCHEMA, dim=DIM, layers=1), run["state"],
                        {"item_emb": (ids, rows)})  # fmt: skip
    out = export_model(plain.eval(), batches[-1], tmp_path / "out", schema=SCHEMA)
    manifest = read_manifest(out)
    assert manifest["dynamic_tables"] == {"item_emb": {"ids": ids.numel(), "dim": DIM}}
    served = load(out)
    for batch, expected in zip(batches, run["scores"], strict=True):
        assert torch.equal(served(batch), expected)
    program = torch.export.load(out / "model.pt2").module()  # plain torch serves it too
    flat = served.flatten(batches[2])
    assert torch.equal(program(*flat), run["scores"][2])


@pytest.mark.slow
def test_the_aoti_package_serves_raw_ids(tmp_path):
    """Inductor fuses and reorders: within the reordered-sum tolerance, as for
    every AOTInductor package (tests/serving/test_export.py)."""
    batches = eval_batches()
    run = run_threads(train_and_score, 1, initial_state(), batches)[0]
    plain = load_served(sequence.build(SCHEMA, dim=DIM, layers=1), run["state"],
                        {"item_emb": (run["ids"], run["rows"])})  # fmt: skip
    served = load(export_model(plain.eval(), batches[-1], tmp_path, aoti=True))
    assert served.kind == "aoti"
    for batch, expected in zip(batches, run["scores"], strict=True):
        assert_reordered_close(served(batch), expected, terms=4 * DIM, depth=2)


def test_dynamic_embedding_reads_rows_by_id_and_zeros_without_one():
    ids = torch.tensor([-(2**63), -5, 7, 2**63 - 1])
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1
    table = DynamicEmbedding(ids, rows)
    asked = torch.tensor([[7, 8], [-(2**63), 2**63 - 1], [-6, -5]])
    got = table(asked)
    want = torch.stack([rows[2], torch.zeros(3), rows[0], rows[3], torch.zeros(3), rows[1]])
    assert torch.equal(got, want.reshape(3, 2, 3))
    assert torch.equal(table(torch.tensor([7, -5], dtype=torch.int32)), rows[[2, 1]])
    assert set(table.state_dict()) == {"ids", "weight"}
    empty = DynamicEmbedding(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3))
    assert torch.equal(empty(asked), torch.zeros(3, 2, 3))


@pytest.mark.parametrize(("ids", "rows", "says"), [
    (torch.tensor([3, 1]), torch.zeros(2, 4), "sorted ascending without repeats"),
    (torch.tensor([1, 1]), torch.zeros(2, 4), "sorted ascending without repeats"),
    (torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2, 4), "ids must be int64"),
    (torch.tensor([1, 2]), torch.zeros(3, 4), "rows must be floating [2, dim]"),
])  # fmt: skip
def test_a_bad_id_table_is_one_line(ids, rows, says):
    with pytest.raises(ValueError) as e:
        DynamicEmbedding(ids, rows, "dynamic table 'items'")
    assert says in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("dynamic table 'items': ")


def test_only_an_nn_embedding_is_served_by_id():
    model = sequence.build(SCHEMA, dim=DIM, layers=1)
    table = (torch.tensor([1, 2]), torch.zeros(2, DIM))
    with pytest.raises(ValueError, match=r"^dynamic table 'head' is not an nn.Embedding"):
        serve_by_id(model, {"head": table})
    with pytest.raises(ValueError, match="rows of dim 4, the model's embedding has 16"):
        serve_by_id(model, {"item_emb": (table[0], torch.zeros(2, 4))})
    assert isinstance(serve_by_id(model, {"item_emb": table}).item_emb, DynamicEmbedding)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_s_slots_are_keyed_by_the_ids_they_hold(tmp_path):
    """`dynamic_table_of` reads the slots' rows with the id each one holds
    (`BY_ID`), all ranks' slots one after another: the held ones, by id."""
    import torch.distributed.checkpoint as dcp

    slot_ids = torch.tensor([40, 0, -3, 7, 0, 2**62])  # a free slot's id is stale
    occupied = torch.tensor([True, False, True, True, False, True])
    weight = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    entries = {"items.weight": weight, "items.dynamic.slot_ids": slot_ids,
               "items.dynamic.occupied": occupied, "other.weight": torch.zeros(2, 3)}  # fmt: skip
    dcp.save(entries, checkpoint_id=tmp_path / "tables", no_dist=True)
    ids, rows = dynamic_table_of(tmp_path, "latest", "items")
    assert ids.tolist() == [-3, 7, 40, 2**62]
    assert torch.equal(rows, weight[[2, 3, 0, 5]])
    with pytest.raises(ValueError, match=r"holds dynamic table 'other' by slot, without the id"):
        dynamic_table_of(tmp_path, "latest", "other")


RUN = ["run.nproc=1", "run.steps=8", "run.warmup=0", "run.batch_size=4", f"model.dim={DIM}",
       "model.layers=1", f"data.num_items={ITEMS}", "data.max_uih=16", "evaluation.every=0",
       "output.progress=false", "checkpoint.every=8",
       f"embeddings.tables.item_emb.capacity={CAPACITY}"]  # fmt: skip


def test_the_cli_exports_a_checkpoint_s_dynamic_table_by_id(tmp_path):
    """``freescale export`` of a run whose item table is dynamic (evictions
    included): its program scores as the run's own weights (its full state
    dict, the table by id) in the plain model, ids it never saw as zeros."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    config = build_config("demo", [*RUN, f"checkpoint.dir={ck}"])
    result = freescale.train(config=config, state_dict=True)
    assert sum(s["dynamic_evictions"] for s in result.steps) > 0
    assert main(["export", str(ck), str(out)]) == 0
    state = dict(result.state_dict)
    tables = {"item_emb": (state.pop("item_emb.ids"), state.pop("item_emb.weight"))}
    dense = {k: v for k, v in state.items() if not k.startswith("item_emb.")}
    plain = load_served(sequence.build(SCHEMA, dim=DIM, layers=1), dense, tables).eval()
    served = load(out)
    for seed, size in enumerate((1, 3, 8, 16)):
        batch = random_batch(seed, size, max_uih=20, num_items=ITEMS + UNSEEN, dense_dim=None)
        with torch.no_grad():
            assert torch.equal(served(batch), plain(batch))
