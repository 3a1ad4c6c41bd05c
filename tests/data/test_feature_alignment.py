"""Extra features of a file stay aligned with their items through every transform.

Random Parquet files (empty and one-event users among them, rows out of time
order) with a per-event feature and a per-item category: after the sort by
timestamp, the leave-one-out split, the training prefixes, truncation to
``max_uih``, the sampled candidates, evaluation samples and the balancer's
regrouping of samples, every value must still be the one written beside
its event (uih) or its item (candidates).
"""

import numpy as np
import pytest
import torch

from freescale.data import SequenceSampling, SequenceSource
from freescale.data.columnar import read_columns
from freescale.jagged.batch import CAND_IDS, UIH_IDS, UIH_TIMESTAMPS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FEATURES = "ev:uih,cat:uih,cat:candidates"


def random_file(tmp_path, seed):
    """A file of random users, and what each event and item must carry."""
    rng = np.random.default_rng(seed)
    cat_of = rng.integers(0, 20, 60)  # raw item -> category
    lengths = [0, 1, 2, 3, *rng.integers(0, 25, 30).tolist()]
    rng.shuffle(lengths)
    rows, event = {"items": [], "timestamps": [], "ev": [], "cat": []}, {}
    for u, n in enumerate(lengths):
        items = rng.integers(0, 60, n)
        stamps = rng.permutation(1000)[:n]  # distinct, out of order
        ev = rng.integers(0, 50, n)
        rows["items"].append(items.tolist())
        rows["timestamps"].append(stamps.tolist())
        rows["ev"].append(ev.tolist())
        rows["cat"].append(cat_of[items].tolist())
        for i, t, e in zip(items, stamps, ev, strict=True):
            event[(u, int(t))] = (int(i), int(e))
    pq.write_table(pa.table(rows), tmp_path / "r.parquet")
    raw = list(dict.fromkeys(i for r in rows["items"] for i in r))  # remapped id -> raw id
    return tmp_path / "r.parquet", event, cat_of, raw


def check_batch(batch, user_of, event, cat_of, raw):
    """Every sample's uih and candidate features against what was written."""
    for k, sid in enumerate(batch.sample_id.tolist()):
        u = user_of(sid)
        lo, hi = batch.uih.offsets[k : k + 2].tolist()
        items = batch.uih[UIH_IDS][lo:hi].tolist()
        stamps = batch.uih[UIH_TIMESTAMPS][lo:hi].tolist()
        assert stamps == sorted(stamps)
        for i, t, e, c in zip(items, stamps, batch.uih["ev"][lo:hi].tolist(),
                              batch.uih["cat"][lo:hi].tolist(), strict=True):  # fmt: skip
            assert event[(u, t)] == (raw[i], e) and c == cat_of[raw[i]]
        lo, hi = batch.candidates.offsets[k : k + 2].tolist()
        cands = batch.candidates[CAND_IDS][lo:hi].tolist()
        assert batch.candidates["cat"][lo:hi].tolist() == [cat_of[raw[i]] for i in cands]
        assert "ev" not in batch.candidates.features


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_uih,num_positives", [(3, 1), (200, 2)])
def test_features_stay_aligned_with_their_items(tmp_path, seed, max_uih, num_positives):
    path, event, cat_of, raw = random_file(tmp_path, seed)
    sampling = SequenceSampling(max_uih=max_uih, num_positives=num_positives, num_negatives=3,
                                samples_per_user=0, shuffle=True, seed=seed)  # fmt: skip
    src = SequenceSource(read_columns(path, features=FEATURES), sampling)
    n = len(src)
    batch = src.batch(0, 0, 1, 2 * n)  # two epochs: every training sample twice
    assert batch.uih_lengths().max() <= max_uih
    check_batch(batch, lambda p: src.sample_at(p)[0], event, cat_of, raw)
    dest = torch.randint(0, 3, (batch.batch_size,), generator=torch.Generator().manual_seed(seed))
    for piece in batch.split_by_dest(dest, 3):  # the balancer's regrouping
        check_batch(piece, lambda p: src.sample_at(p)[0], event, cat_of, raw)
    for split in ("valid", "test"):
        for step in range(src.eval_steps(2, 4) + 1):  # + 1: an empty batch past the end
            for rank in range(2):
                b = src.eval_batch(split, step, rank, 2, 4)
                assert {"ev", "cat"} <= set(b.uih.features) and "cat" in b.candidates.features
                check_batch(b, lambda j, s=split: src.eval_target(s, j)[0], event, cat_of, raw)
