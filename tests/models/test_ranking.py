"""Ranking metrics against a slow reference (per sample, ties enumerated)."""

import math

import pytest
import torch

from freescale.models.ranking import ranking_metrics, ranking_sums
from freescale.testing.tolerance import reduction_tol

pytestmark = pytest.mark.numeric


def reference(scores, labels, lengths, k=10):
    """Plain Python: expected HR/NDCG over every tie order, AUC, NE."""
    hits = ndcg = auc = 0.0
    auc_users = 0
    bce = 0.0
    i = 0
    for n in lengths:
        s, y = scores[i : i + n], labels[i : i + n]
        i += n
        pos = s[y.index(1.0)]
        negs = [v for v, lab in zip(s, y, strict=True) if lab == 0.0]
        g = sum(v > pos for v in negs)
        t = sum(v == pos for v in negs)
        ranks = range(g, g + t + 1)  # equally likely positions of the positive
        hits += sum(r < k for r in ranks) / len(ranks)
        ndcg += sum(1 / math.log2(r + 2) for r in ranks if r < k) / len(ranks)
        if negs:
            auc += sum((v < pos) + 0.5 * (v == pos) for v in negs) / len(negs)
            auc_users += 1
        for v, lab in zip(s, y, strict=True):
            p = 1 / (1 + math.exp(-v))
            bce -= lab * math.log(p) + (1 - lab) * math.log(1 - p)
    users = len(lengths)
    pos_rate = users / sum(lengths)
    if pos_rate == 1.0:  # no negatives at all: NE is undefined
        h = math.nan
    else:
        h = -(pos_rate * math.log(pos_rate) + (1 - pos_rate) * math.log(1 - pos_rate))
    return {
        "hr@10": hits / users,
        "ndcg@10": ndcg / users,
        "auc": auc / max(auc_users, 1),
        "ne": bce / sum(lengths) / h,
    }


def random_case(gen, users, max_neg, levels):
    lengths = (torch.randint(0, max_neg + 1, (users,), generator=gen) + 1).tolist()
    lengths[0] = 1  # a sample with no negatives
    scores, labels = [], []
    for n in lengths:
        # few distinct values: many ties
        s = (torch.randint(0, levels, (n,), generator=gen).float() / levels * 4 - 2).tolist()
        y = [0.0] * n
        y[int(torch.randint(0, n, (1,), generator=gen))] = 1.0
        scores += s
        labels += y
    return scores, labels, lengths


@pytest.mark.parametrize(
    "seed,users,max_neg,levels", [(0, 1, 3, 2), (1, 7, 30, 5), (2, 40, 120, 1000)]
)
def test_ranking_matches_reference(seed, users, max_neg, levels):
    gen = torch.Generator().manual_seed(seed)
    scores, labels, lengths = random_case(gen, users, max_neg, levels)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = ranking_metrics(ranking_sums(torch.tensor(scores), torch.tensor(labels), offsets))
    want = reference(scores, labels, lengths)
    assert got["users"] == users
    # float64 both ways, in other orders: sums of one-signed per-candidate terms
    # (a few ops each: BCE's exp and log), then a ratio, so the bound is relative.
    rtol = reduction_tol(torch.float64, sum(lengths), 0.0, depth=3)["rtol"]
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=0.0, nan_ok=True), key


def test_split_batches_sum_to_the_whole():
    gen = torch.Generator().manual_seed(5)
    scores, labels, lengths = random_case(gen, 12, 20, 7)
    cut = sum(lengths[:5])
    whole = ranking_sums(
        torch.tensor(scores),
        torch.tensor(labels),
        torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    )
    a = ranking_sums(
        torch.tensor(scores[:cut]),
        torch.tensor(labels[:cut]),
        torch.tensor([0, *torch.tensor(lengths[:5]).cumsum(0).tolist()]),
    )
    b = ranking_sums(
        torch.tensor(scores[cut:]),
        torch.tensor(labels[cut:]),
        torch.tensor([0, *torch.tensor(lengths[5:]).cumsum(0).tolist()]),
    )
    empty = ranking_sums(torch.zeros(0), torch.zeros(0), torch.zeros(1, dtype=torch.int64))
    assert not empty.any()
    # float64 sums of one-signed per-sample terms, split in two: relative rounding.
    tol = reduction_tol(torch.float64, len(scores), 0.0, depth=3)
    torch.testing.assert_close(a + b + empty, whole, **tol)


def test_constant_scores_give_chance_values():
    labels = ([1.0] + [0.0] * 100) * 3
    got = ranking_metrics(
        ranking_sums(torch.zeros(303), torch.tensor(labels), torch.tensor([0, 101, 202, 303]))
    )
    assert got["hr@10"] == pytest.approx(10 / 101) and got["auc"] == pytest.approx(0.5)
