"""`find_problem` names the first problem of a batch: its kind, part, sample and value.

One small hand-built batch with awkward shapes (a sample without history,
one without candidates, a candidate without content), then one corruption per
problem kind `find_problem` knows. Each case asserts the whole report
``[code, part, local index, sample id, value]``: the local index must be the
sample that holds the bad value (through empty segments), not a position.
These run in milliseconds; the end-to-end agreement of all ranks on the error
is `tests/pipeline/test_input_errors.py`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.tensor import JaggedFeatures
from freescale.pipeline.inputs import ID_RANGE, NONFINITE, OFFSETS, PARTS, Limits, find_problem
from freescale.pipeline.inputs import message as problem_message
from freescale.testing.batches import random_batch

LIMITS = Limits(num_items=100, num_actions=4)


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def clean() -> SampleBatch:
    """Four samples, ids 40..43.

    - UIH lengths 2, 0, 3, 1: offsets [0, 2, 2, 5, 6];
    - candidates 1, 0, 2, 2: offsets [0, 1, 1, 3, 5] (candidate 1 is sample 2's);
    - content per candidate 2, 1, 0, 3, 1: offsets [0, 2, 3, 3, 6, 7].
    """
    uih = JaggedFeatures(
        _t([0, 2, 2, 5, 6]),
        {UIH_IDS: _t([5, 99, 0, 7, 8, 9]), UIH_ACTIONS: _t([0, 3, 1, 2, 3, 0])},
    )
    candidates = JaggedFeatures(_t([0, 1, 1, 3, 5]), {CAND_IDS: _t([1, 2, 3, 4, 99])})
    content = JaggedFeatures(_t([0, 2, 3, 3, 6, 7]), {CONTENT_IDS: _t([10, 11, 12, 13, 14, 15, 0])})
    return SampleBatch(
        uih=uih,
        candidates=candidates,
        labels=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]),
        content=content,
        sample_id=torch.arange(40, 44),
        dense=torch.zeros(4, 2),
    )


def _offsets(b: SampleBatch, group: str, offsets: list[int]) -> SampleBatch:
    jf = getattr(b, group)
    return replace(b, **{group: JaggedFeatures(_t(offsets), jf.features)})


def _ids(b: SampleBatch, group: str, name: str, pos: int, value: int) -> SampleBatch:
    jf = getattr(b, group)
    ids = jf.features[name].clone()
    ids[pos] = value
    return replace(b, **{group: JaggedFeatures(jf.offsets, {**jf.features, name: ids})})


def _label(b: SampleBatch, pos: int, value: float) -> SampleBatch:
    labels = b.labels.clone()
    labels[pos] = value
    return replace(b, labels=labels)


def _dense(b: SampleBatch, row: int, value: float) -> SampleBatch:
    assert b.dense is not None
    dense = b.dense.clone()
    dense[row, 1] = value
    return replace(b, dense=dense)


# name -> (corruption, expected [code, part, local index, sample id, value])
CASES = {
    # offsets: a start other than 0, a negative length (the total still matches), an overrun
    "uih_start": (lambda b: _offsets(b, "uih", [1, 2, 2, 5, 6]), [OFFSETS, 0, 0, 40, 1]),
    "uih_negative_length": (
        lambda b: _offsets(b, "uih", [0, 2, 4, 3, 6]),  # lengths 2, 2, -1, 3: sum 6
        [OFFSETS, 0, 2, 42, -1],
    ),
    "uih_overrun": (lambda b: _offsets(b, "uih", [0, 2, 2, 5, 8]), [OFFSETS, 0, 3, 43, 2]),
    "uih_short": (lambda b: _offsets(b, "uih", [0, 2, 2, 5, 5]), [OFFSETS, 0, 3, 43, -1]),
    "candidate_start": (
        lambda b: _offsets(b, "candidates", [2, 2, 2, 3, 5]),
        [OFFSETS, 1, 0, 40, 2],
    ),
    "candidate_negative_length": (
        lambda b: _offsets(b, "candidates", [0, 2, 1, 3, 5]),  # lengths 2, -1, 2, 2: sum 5
        [OFFSETS, 1, 1, 41, -1],
    ),
    "candidates_not_labels": (
        lambda b: _offsets(b, "candidates", [0, 1, 1, 3, 4]),  # 4 candidates, 5 labels
        [OFFSETS, 1, 3, 43, -1],
    ),
    # content segments are candidates: the report names the candidate's sample
    "content_start": (
        lambda b: _offsets(b, "content", [3, 3, 3, 3, 6, 7]),
        [OFFSETS, 2, 0, 40, 3],
    ),
    "content_negative_length": (
        lambda b: _offsets(b, "content", [0, 2, 1, 3, 6, 7]),  # candidate 1: sample 2
        [OFFSETS, 2, 2, 42, -1],
    ),
    "content_overrun": (
        lambda b: _offsets(b, "content", [0, 2, 3, 3, 6, 8]),  # candidate 4: sample 3
        [OFFSETS, 2, 3, 43, 1],
    ),
    # ids outside their tables, at both ends; the first bad position is reported
    "uih_item_at_table_size": (
        lambda b: _ids(b, "uih", UIH_IDS, 3, 100),
        [ID_RANGE, 3, 2, 42, 100],
    ),
    "uih_item_negative": (lambda b: _ids(b, "uih", UIH_IDS, 5, -1), [ID_RANGE, 3, 3, 43, -1]),
    # an action id inside the item table but outside the action table
    "action_at_table_size": (
        lambda b: _ids(b, "uih", UIH_ACTIONS, 4, 4),
        [ID_RANGE, 4, 2, 42, 4],
    ),
    "action_negative": (lambda b: _ids(b, "uih", UIH_ACTIONS, 0, -2), [ID_RANGE, 4, 0, 40, -2]),
    "candidate_item": (
        lambda b: _ids(b, "candidates", CAND_IDS, 2, 100),  # candidate 2: sample 2
        [ID_RANGE, 5, 2, 42, 100],
    ),
    "candidate_item_negative": (
        lambda b: _ids(b, "candidates", CAND_IDS, 0, -7),
        [ID_RANGE, 5, 0, 40, -7],
    ),
    "content_id": (
        lambda b: _ids(b, "content", CONTENT_IDS, 4, -3),  # content 4: candidate 3, sample 3
        [ID_RANGE, 6, 3, 43, -3],
    ),
    "content_id_at_table_size": (
        lambda b: _ids(b, "content", CONTENT_IDS, 2, 100),  # content 2: candidate 1, sample 2
        [ID_RANGE, 6, 2, 42, 100],
    ),
    # non-finite values
    "nan_label": (lambda b: _label(b, 1, float("nan")), [NONFINITE, 7, 2, 42, 0]),
    "inf_label": (lambda b: _label(b, 4, float("-inf")), [NONFINITE, 7, 3, 43, 0]),
    "inf_dense": (lambda b: _dense(b, 1, float("inf")), [NONFINITE, 8, 1, 41, 0]),
    "nan_dense": (lambda b: _dense(b, 3, float("nan")), [NONFINITE, 8, 3, 43, 0]),
}


def test_the_clean_batch_and_random_valid_batches_have_no_problem():
    assert find_problem(clean(), LIMITS) is None
    for seed in range(20):  # zero-length histories, no candidates, empty content
        assert find_problem(random_batch(seed, seed % 7, num_items=100), LIMITS) is None


@pytest.mark.parametrize("case", list(CASES))
def test_each_problem_is_named_with_its_sample_and_value(case):
    corrupt, want = CASES[case]
    got = find_problem(corrupt(clean()), LIMITS)
    assert got is not None, case
    assert got[:5] == want, (case, got)


def test_offsets_are_checked_before_what_they_index():
    """Ids, labels and dense rows are located through the offsets: a batch with
    bad offsets reports them, whatever else is wrong."""
    b = _ids(clean(), "uih", UIH_IDS, 0, -1)
    b = _label(_dense(b, 0, float("nan")), 0, float("nan"))
    b = _offsets(b, "candidates", [0, 2, 1, 3, 5])
    assert find_problem(b, LIMITS)[:5] == [OFFSETS, 1, 1, 41, -1]
    # then ids (uih, actions, candidates, content), then labels, then dense
    b = _ids(_ids(clean(), "content", CONTENT_IDS, 0, 100), "uih", UIH_ACTIONS, 5, 9)
    assert find_problem(_label(b, 0, float("nan")), LIMITS)[:5] == [ID_RANGE, 4, 3, 43, 9]
    b = _label(_dense(clean(), 0, float("nan")), 3, float("nan"))
    assert find_problem(b, LIMITS)[:5] == [NONFINITE, 7, 3, 43, 0]


def test_message_names_the_part_and_the_table_it_overran():
    row = [ID_RANGE, 4, 2, 42, 4]
    text = problem_message(1, 3, row, LIMITS)
    assert (
        text
        == "bad input on rank 1, step 3, sample 42 (local index 2): uih action id 4, outside [0, 4)"
    )
    assert problem_message(0, 0, [ID_RANGE, 6, 0, 7, -3], LIMITS).endswith(
        "content id -3, outside [0, 100)"
    )
    assert "malformed content offsets" in problem_message(0, 0, [OFFSETS, 2, 0, 7, 1])
    assert "non-finite dense feature" in problem_message(0, 0, [NONFINITE, 8, 0, 7, 0])
    assert len(PARTS) == 9
