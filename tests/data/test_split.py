"""Leave-one-out split, training targets per user, epochs, evaluation samples."""

import numpy as np
import pytest
import torch

from freescale.data import SequenceSampling, SequenceSource
from freescale.data.readers import SequenceDataset, UserHistory
from freescale.data.sequences import eval_negatives
from freescale.jagged.batch import CAND_IDS, UIH_IDS


def unique_item_dataset(lengths, extra_items=50):
    """Every interaction is its own item id, so an id names one (user, position)."""
    users, nxt = [], 0
    for n in lengths:
        items = np.arange(nxt, nxt + n, dtype=np.int64)
        nxt += n
        users.append(UserHistory(items, np.zeros(n, dtype=np.int64), items.copy()))
    return SequenceDataset(users, nxt + extra_items, 1, "unique")


LENGTHS = [1, 2, 3, 4, 5, 9, 17, 30, 6, 3]


@pytest.mark.parametrize("num_positives", [1, 2])
@pytest.mark.parametrize("samples_per_user,stride", [(0, 1), (3, 2), (1, 1)])
def test_no_held_out_item_in_training_inputs_or_targets(num_positives, samples_per_user, stride):
    ds = unique_item_dataset(LENGTHS)
    src = SequenceSource(
        ds,
        SequenceSampling(
            max_uih=8, num_positives=num_positives, num_negatives=3, shuffle=True,
            samples_per_user=samples_per_user, stride=stride,
        ),
    )  # fmt: skip
    held_out = {int(u.items[-1]) for u in ds.users if u.items.size >= 3}
    held_out |= {int(u.items[-2]) for u in ds.users if u.items.size >= 3}
    assert len(src) > 0
    for p in range(2 * len(src)):  # two epochs
        s = src.raw_sample(p)
        positives = s.cand_ids[s.labels == 1]
        assert positives.size == num_positives
        assert not held_out & set(s.uih_ids.tolist())
        assert not held_out & set(positives.tolist())
    for split in ("valid", "test"):
        for j in range(len(src.eval_users)):
            s = src.eval_sample(split, j)
            user = ds.users[src.eval_users[j]].items
            target = user[-2] if split == "valid" else user[-1]
            assert s.cand_ids[s.labels == 1].tolist() == [target]
            assert s.uih_ids.tolist() == user[: user.tolist().index(target)][-8:].tolist()


def test_targets_per_user_and_dropped_users():
    ds = unique_item_dataset(LENGTHS)
    every = SequenceSource(ds, SequenceSampling(samples_per_user=0))
    # targets 1 .. n-3 per user: sum(max(n - 3, 0))
    assert len(every) == sum(max(n - 3, 0) for n in LENGTHS)
    last_two = SequenceSource(ds, SequenceSampling(samples_per_user=2, stride=3))
    targets = {}
    for u, t in last_two.index.tolist():
        targets.setdefault(u, set()).add(t)
    # n=30: last target 27 (28, 29 held out), then 3 earlier; n=4: only 1; n<=3: none
    assert targets == {3: {1}, 4: {2}, 5: {6, 3}, 6: {14, 11}, 7: {27, 24}, 8: {3}}
    assert every.split_counts() == {
        "users": 10,
        "eval_users": 8,  # n >= 3
        "train_samples": len(every),
        "users_dropped": 2,  # n = 1, 2: nothing to train on or evaluate
    }


def test_epochs_are_permutations_and_pure_functions_of_position():
    ds = unique_item_dataset(LENGTHS)
    sampling = SequenceSampling(samples_per_user=0, shuffle=True, seed=3)
    src = SequenceSource(ds, sampling)
    n = len(src)
    epoch0 = [src.sample_at(p) for p in range(n)]
    epoch1 = [src.sample_at(p) for p in range(n, 2 * n)]
    base = sorted(map(tuple, src.index.tolist()))
    assert sorted(epoch0) == base and sorted(epoch1) == base and epoch0 != epoch1
    fresh = SequenceSource(ds, sampling)  # another process, reading out of order
    for p in [2 * n - 1, 5, n + 2, 0]:
        assert fresh.sample_at(p) == src.sample_at(p)
        a, b = fresh.raw_sample(p), src.raw_sample(p)
        assert np.array_equal(a.cand_ids, b.cand_ids) and np.array_equal(a.uih_ids, b.uih_ids)


@pytest.mark.parametrize("world,local", [(1, 8), (2, 4), (4, 2)])
def test_global_batches_do_not_depend_on_the_world_size(world, local):
    ds = unique_item_dataset(LENGTHS)
    src = SequenceSource(ds, SequenceSampling(samples_per_user=0, shuffle=True, num_negatives=2))
    for step in (0, 3, 11):  # 11 * 8 > one epoch: crosses into epoch 1
        parts = [src.batch(step, r, world, local) for r in range(world)]
        ref = src.batch(step, 0, 1, 8)
        assert torch.equal(torch.cat([b.uih[UIH_IDS] for b in parts]), ref.uih[UIH_IDS])
        assert torch.equal(
            torch.cat([b.candidates[CAND_IDS] for b in parts]), ref.candidates[CAND_IDS]
        )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_eval_batches_hold_every_user_once(world):
    ds = unique_item_dataset(LENGTHS)
    src = SequenceSource(ds, SequenceSampling(eval_negatives=5))
    seen = []
    for k in range(src.eval_steps(world, 3)):
        for r in range(world):
            b = src.eval_batch("test", k, r, world, 3)
            b.validate()
            assert b.labels.sum().item() == b.batch_size
            seen += b.sample_id.tolist()
    assert sorted(seen) == list(range(len(src.eval_users)))


def test_eval_negatives_are_distinct_unseen_and_fixed():
    rng = np.random.default_rng(0)
    history = np.array([0, 3, 3, 7, 9])
    neg = eval_negatives(rng, history, 1000, 100)
    assert neg.size == 100 and np.unique(neg).size == 100 and not np.isin(neg, history).any()
    again = eval_negatives(np.random.default_rng(0), history, 1000, 100)
    assert np.array_equal(neg, again)
    # fewer unseen items than asked for: all of them
    assert eval_negatives(rng, history, 12, 100).tolist() == [1, 2, 4, 5, 6, 8, 10, 11]
