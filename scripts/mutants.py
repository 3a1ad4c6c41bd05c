"""Mutation check: plant one realistic bug at a time and see whether the tests notice.

Each `Mutant` names a file, an exact snippet of it (which must occur exactly
once, else the entry is broken and the script says so), its replacement, the
test files a developer changing that code would run, and what the bug is.
The run works on a copy of the working tree in a temporary directory (the
checkout is never modified, not even on Ctrl-C): it first runs each distinct
test selection on the unmutated copy once (a selection that fails there makes
its mutants *broken*, not caught), then, per mutant, applies the replacement,
runs ``python -m pytest -x -q -p no:cacheprovider <tests> --timeout 120``
and restores the file. Outcomes:

- caught: the tests failed (an assertion or an error, not a timeout);
- survived: the tests passed;
- timeout: a test hit pytest's 120 s timeout or a rank timed out waiting
  for another (the bug was noticed, but only by waiting);
- broken: the snippet is not in the file exactly once, or the tests fail
  on the unmutated tree.

Score = caught / mutants. Subprocesses run with ``CI=1`` (Hypothesis
derandomized: the same examples every run) and without bytecode files (a
restored file is never run from a stale ``.pyc``).

    python scripts/mutants.py                  # everything (~25 min on 2 cores)
    python scripts/mutants.py --only metrics-step-mean,inputs-negative-length
    python scripts/mutants.py --list
    python scripts/mutants.py --tests-at a7827f9   # the mutants against older tests

``--tests-at REV`` replaces ``tests/`` in the copy by that revision's (test
files and test functions it lacks are dropped from a selection; a selection
left empty counts as survived): the score of the tests as they were. Each
mutant's line names the first failing test; a table follows, and the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120  # per test (pytest-timeout)
RUN_LIMIT_S = 900  # per pytest run, a guard against a hang pytest-timeout misses
TIMEOUT_MARKS = ("Failed: Timeout", "RankTimeout", "TimeoutError")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str


# ---- test selections, as a developer of each module would run them ------------------
# A module's own tests and its parity tests. Where a file is slow (Triton interpreted
# on CPU, multi-rank runs), the tests of the contract in question by node id, fast
# ones first (-x stops at the first failure).
T_OPTIM = (
    "tests/embedding/test_optim_formulas.py",
    "tests/embedding/test_weight_decay.py",
    "tests/embedding/test_config_optim.py",
)
T_STORE = (
    "tests/embedding/test_optim_formulas.py",
    "tests/embedding/test_store.py",
    "tests/embedding/test_nonfinite.py",
    "tests/embedding/test_parity.py",
)
_UPDATE = "tests/kernels/test_update.py::"
T_UPDATE = (
    _UPDATE + "test_triton_update_follows_the_optimizer_formula",
    _UPDATE + "test_triton_update_sums_every_piece_of_a_hot_row",
    _UPDATE + "test_skip_flag_leaves_rows_and_state_alone",
    _UPDATE + "test_triton_update_matches_reference",
)
T_PRIO = (
    "tests/embedding/test_collision_link.py",
    "tests/embedding/test_prioritized.py",
    "tests/embedding/test_nonfinite.py",  # the prioritized path of skipped steps
)
T_PART = ("tests/balance/test_partitioners.py",)
T_SCALE = ("tests/balance/test_costpart_scale.py",)
T_PLAN = ("tests/balance/test_plan.py", "tests/balance/test_balancer_fake.py")
_METRICS = "tests/observe/test_metrics.py::"
T_METRICS = (
    _METRICS + "test_step_summary_of_unequal_ranks_follows_the_definitions",
    _METRICS + "test_step_summary_of_an_idle_step_has_no_rates",
    _METRICS + "test_run_summary_averages_the_steps_after_warmup",
    _METRICS + "test_extra_compute_on_one_rank_is_its_straggler_share",
    _METRICS + "test_slow_loader_on_one_rank_is_data_wait_not_straggling",
)
T_INPUTS = (
    "tests/pipeline/test_find_problem.py",
    "tests/pipeline/test_input_errors.py::test_find_problem_names_sample_and_value",
)
T_INPUTS_RUN = ("tests/pipeline/test_find_problem.py", "tests/pipeline/test_input_errors.py")
T_RESUME = ("tests/state/test_resume.py",)
T_COMM = ("tests/comm/test_fake.py", "tests/comm/test_torch_backend.py")
T_SMFREE = ("tests/comm/test_smfree.py",)
T_PERMUTE = ("tests/kernels/test_permute.py", "tests/jagged/test_ops.py")
T_DISPATCH = ("tests/kernels/test_dispatch.py",)
T_COLLISION = ("tests/kernels/test_collision.py", "tests/embedding/test_collision_link.py")
T_SHARD = ("tests/kernels/test_shard.py",)


def M(id: str, file: str, old: str, new: str, tests: tuple[str, ...], what: str) -> Mutant:
    return Mutant(id, file, old, new, tests, what)


OPTIM = "freescale/embedding/optim.py"
STORE = "freescale/embedding/store.py"
UPDATE = "freescale/kernels/triton_update.py"
PRIO = "freescale/embedding/prioritized.py"
LINK = "freescale/embedding/collision_link.py"
METRICS = "freescale/observe/metrics.py"
INPUTS = "freescale/pipeline/inputs.py"
CKPT = "freescale/state/checkpoint.py"

# fmt: off
MUTANTS: list[Mutant] = [
    # ---- optimizers (freescale/embedding/optim.py) -------------------------------
    M("adagrad-eps-in-sqrt", OPTIM,
      "new = w - lr * g / (s.sqrt().unsqueeze(1) + self.eps)",
      "new = w - lr * g / (s + self.eps).sqrt().unsqueeze(1)",
      T_OPTIM,
      "row-wise Adagrad: g / sqrt(s + eps) instead of g / (sqrt(s) + eps)"),
    M("adagrad-accumulator-after-step", OPTIM,
      '        s = state["sum_sq"] + (g * g).mean(dim=1)\n        state["sum_sq"] = s\n',
      '        s = state["sum_sq"]\n        state["sum_sq"] = s + (g * g).mean(dim=1)\n',
      T_OPTIM, "row-wise Adagrad: the step divides by the accumulator before it is updated"),
    M("adagrad-l2-not-accumulated", OPTIM,
      '        if decay and mode == "l2":\n            g = g + decay * w\n'
      '        s = state["sum_sq"] + (g * g).mean(dim=1)\n',
      '        s = state["sum_sq"] + (g * g).mean(dim=1)\n'
      '        if decay and mode == "l2":\n            g = g + decay * w\n',
      T_OPTIM, "row-wise Adagrad L2: the decay term joins the gradient after the accumulator"),
    M("adagrad-decoupled-new-row", OPTIM,
      '        if decay and mode == "decoupled":\n            new = new - lr * decay * w\n',
      '        if decay and mode == "decoupled":\n            new = new - lr * decay * new\n',
      T_OPTIM, "row-wise Adagrad decoupled decay shrinks the new row instead of the old one"),
    M("adam-eps-in-sqrt", OPTIM,
      "denom = (v / bc[1]).sqrt() + self.eps",
      "denom = (v / bc[1] + self.eps).sqrt()",
      T_OPTIM, "Adam: eps under the square root"),
    M("adam-bias-correction-swapped", OPTIM,
      "denom = (v / bc[1]).sqrt() + self.eps",
      "denom = (v / bc[0]).sqrt() + self.eps",
      T_OPTIM, "Adam: the second moment corrected with the first moment's factor"),
    M("adam-bias-step-off-by-one", OPTIM,
      "return 1.0 - self.beta1**step, 1.0 - self.beta2**step",
      "return 1.0 - self.beta1 ** (step + 1), 1.0 - self.beta2 ** (step + 1)",
      T_OPTIM, "Adam: bias correction of the next step"),
    M("sgd-decay-sign", OPTIM,
      "            g = g + self.weight_decay * w\n        return w - lr * g",
      "            g = g - self.weight_decay * w\n        return w - lr * g",
      T_OPTIM, "SGD L2 decay with the wrong sign (weights grow)"),
    M("apply-rows-skip-state", OPTIM,
      "rows_state = {k: torch.where(skip, old_state[k], v) for k, v in rows_state.items()}",
      "rows_state = {k: v for k, v in rows_state.items()}",
      T_STORE,
      "a skipped (non-finite) step still writes the optimizer state"),
    # ---- the store (freescale/embedding/store.py) ---------------------------------
    M("store-frozen-rows-updated", STORE,
      "            keep = ~torch.isin(rows, self.frozen_slots.to(rows.device))\n"
      "            rows, summed = rows[keep], summed[keep]\n",
      "            pass\n",
      T_STORE,
      "padding rows (frozen slots) are updated by the torch path"),
    M("store-skipped-step-counted", STORE,
      "                    self.steps[t] -= 1\n",
      "                    pass\n",
      T_STORE, "a skipped step's count is not taken back from the device counter"),
    M("store-table-of-row", STORE,
      "table_of_row = torch.bucketize(rows, self.table_bounds.to(rows.device), right=True)",
      "table_of_row = torch.bucketize(rows, self.table_bounds.to(rows.device), right=False)",
      T_STORE,
      "a table's first row gets the previous table's lr and bias correction"),
    M("store-step-zero-based", STORE,
      "steps = [max(s, 1) for s in steps]",
      "steps = [max(s - 1, 1) for s in steps]",
      T_OPTIM, "hyperparameters of the step before (lr schedule, Adam bias correction)"),
    # ---- the Triton update kernel (interpreted on CPU) ----------------------------
    M("kernel-adagrad-eps-in-sqrt", UPDATE,
      "new = w - tl.div_rn(lr * g, tl.sqrt_rn(s) + eps)",
      "new = w - tl.div_rn(lr * g, tl.sqrt_rn(s + eps))",
      T_UPDATE, "Triton row-wise Adagrad: eps under the square root"),
    M("kernel-adam-v-linear", UPDATE,
      "(1.0 - beta2) * (g * g)",
      "(1.0 - beta2) * g",
      T_UPDATE, "Triton Adam: second moment of g instead of g^2"),
    M("kernel-hot-row-piece-skipped", UPDATE,
      "        p = p0 + CHUNK\n",
      "        p = p0 + 2 * CHUNK\n",
      T_UPDATE, "Triton update: a hot row's second piece of duplicates is not added"),
    M("kernel-decoupled-new-row", UPDATE,
      "new = new - lr * weight_decay * w",
      "new = new - lr * weight_decay * new",
      T_UPDATE, "Triton decoupled decay shrinks the new row"),
    # ---- prioritized updates and the collision split ------------------------------
    M("prio-stash-after-lookup", PRIO,
      "        self.check_can_prefetch()\n        self.flush()\n",
      "        self.check_can_prefetch()\n",
      T_PRIO, "the stash (X^(i-1)) is applied after the next step's rows are looked up"),
    M("prio-deferred-row", LINK,
      "now_mark = _in_sorted(slots_now, sorted_next)",
      "now_mark = _in_sorted(slots_now, sorted_next[1:])",
      T_PRIO, "one collision row (the smallest slot) is deferred (bitwise contract)"),
    M("prio-deferred-row-parity", LINK,
      "now_mark = _in_sorted(slots_now, sorted_next)",
      "now_mark = _in_sorted(slots_now, sorted_next[1:])",
      ("tests/embedding/test_prioritized.py",),
      "the same deferred row, against the bitwise freescale == sync test alone"),
    M("prio-unmarked-next-row", LINK,
      "next_mark = _in_sorted(slots_next, sorted_now)",
      "next_mark = _in_sorted(slots_next, sorted_now[:-1])",
      T_PRIO, "one collision row of step i+1 is not marked: its stale prefetched row is used"),
    M("prio-deferred-skip-dropped", PRIO,
      "self.stash.append(Deferred(store, slots_ex, work, steps, skip))",
      "self.stash.append(Deferred(store, slots_ex, work, steps))",
      T_PRIO,
      "a skipped (non-finite) step still applies its deferred exclusive part"),
    M("link-run-starts", LINK,
      "starts[1:] = sorted_x[1:] != sorted_x[:-1]",
      "starts[1:] = sorted_x[1:] == sorted_x[:-1]",
      T_PRIO, "collision stats count duplicates instead of distinct rows"),
    M("link-marked-first", LINK,
      "return torch.sort((~mark).to(torch.uint8), stable=True).indices",
      "return torch.sort(mark.to(torch.uint8), stable=True).indices",
      T_PRIO, "split_marked takes the unmarked rows as the marked part"),
    # ---- balancer -------------------------------------------------------------------
    M("fbs-zigzag-direction", "freescale/balance/fbs.py",
      "ranks = torch.where(rnd % 2 == 0, j, world_size - 1 - j)",
      "ranks = torch.where(rnd % 2 == 1, j, world_size - 1 - j)",
      T_PART, "FBS zig-zag starts in the wrong direction"),
    M("fbs-partial-round", "freescale/balance/fbs.py",
      "even = (num // world_size) % 2 == 0",
      "even = (num // world_size) % 2 == 1",
      T_PART, "FBS partial last round dealt in the wrong direction"),
    M("fbs-ascending", "freescale/balance/fbs.py",
      "return torch.sort(keys, descending=True, stable=True).indices",
      "return torch.sort(keys, descending=False, stable=True).indices",
      T_PART, "FBS sorts shortest first"),
    M("plan-equal-counts", "freescale/balance/plan.py",
      "return tuple(base + (1 if d < extra else 0) for d in range(world_size))",
      "return tuple(base + (1 if d <= extra else 0) for d in range(world_size))",
      T_PLAN, "equal_counts gives one rank too many an extra sample"),
    # (``seen > 1`` for ``seen != 1`` in check_plan is equivalent: with G indices in
    # [0, G), a lost sample forces a duplicate. Not listed.)
    M("plan-equal-promise-unchecked", "freescale/balance/plan.py",
      "if plan.equal_counts and plan.counts != equal_counts(total, world_size):",
      "if plan.equal_counts and sum(plan.counts) != total:",
      T_PLAN, "check_plan does not hold a plan to its equal-counts promise"),
    M("lpt-room-not-taken", "freescale/balance/lpt.py",
      "        room[d] -= 1\n        loads[d] += c\n",
      "        loads[d] += c\n",
      T_SCALE,
      "projected LPT: a placed sample does not use the rank's room"),
    M("lpt-floor-largest", "freescale/balance/lpt.py",
      "floor = float(x[-1]) if g and project else 0.0",
      "floor = float(x[0]) if g and project else 0.0",
      T_SCALE,
      "projected LPT projects with the largest cost instead of the smallest"),
    M("bounds-pigeonhole", "freescale/balance/bounds.py",
      "bound = max(bound, float(x[world_size - 1] + x[world_size]))",
      "bound = max(bound, float(x[world_size] + x[world_size]))",
      T_SCALE,
      "variable-count bound pairs the wrong samples (too low a bound)"),
    M("routing-recv-is-send", "freescale/balance/routing.py",
      "recv[level] = traffic[:, rank].tolist()",
      "recv[level] = traffic[rank].tolist()",
      T_PLAN,
      "a rank expects what it sends instead of what it receives"),
    M("refine-no-gain-check", "freescale/balance/refine.py",
      "if peak < loads[h] * (1.0 - 1e-12):",
      "if peak <= loads[h]:",
      T_SCALE,
      "refinement applies exchanges that gain nothing (plans differ across summation noise)"),
    # ---- metrics --------------------------------------------------------------------
    M("metrics-step-mean", METRICS,
      't_iter = max(col["step_ms"])',
      't_iter = _mean(col["step_ms"])',
      T_METRICS, "T_iter is the mean of the ranks' step times instead of the max"),
    M("metrics-straggler-step-max", METRICS,
      "slowest = max(compute)",
      'slowest = max(col["step_ms"])',
      T_METRICS, "straggler % measured from the slowest step instead of the slowest compute"),
    M("metrics-qps-samples", METRICS,
      '"qps": sum(col["items"]) / (t_iter / 1000.0)',
      '"qps": sum(col["samples"]) / (t_iter / 1000.0)',
      T_METRICS, "QPS counts samples instead of items"),
    M("metrics-collision-pct-swapped", METRICS,
      '_pct(sum(col["collision_rows"]), sum(col["rows_next"]))',
      '_pct(sum(col["rows_next"]), sum(col["collision_rows"]))',
      T_METRICS, "collision rows % with numerator and denominator swapped"),
    M("metrics-data-as-compute", "freescale/pipeline/recorder.py",
      "compute_ms=step_ms - sum(exposed.values()) - data_ms,",
      "compute_ms=step_ms - sum(exposed.values()),",
      T_METRICS, "data wait counted as compute"),
    M("metrics-warmup-off-by-one", METRICS,
      'measured = [s for s in self.steps if s["step"] >= self.warmup] or self.steps',
      'measured = [s for s in self.steps if s["step"] > self.warmup] or self.steps',
      T_METRICS,
      "the run summary drops the first measured step"),
    # ---- input checks ---------------------------------------------------------------
    M("inputs-negative-length", INPUTS,
      "    if lengths.numel() and bool((lengths < 0).any()):\n"
      "        seg = int((lengths < 0).nonzero()[0])\n"
      "        return seg, int(lengths[seg])\n",
      "",
      T_INPUTS, "offsets: the negative-segment-length check removed"),
    M("inputs-action-range", INPUTS,
      "        (4, batch.uih, UIH_ACTIONS, limits.num_actions, batch.uih.offsets),\n",
      "",
      T_INPUTS_RUN, "the action-id range check removed"),
    M("inputs-action-item-table", INPUTS,
      "(4, batch.uih, UIH_ACTIONS, limits.num_actions, batch.uih.offsets)",
      "(4, batch.uih, UIH_ACTIONS, limits.num_items, batch.uih.offsets)",
      T_INPUTS, "action ids checked against the item table"),
    M("inputs-range-off-by-one", INPUTS,
      "if values.min() >= 0 and values.max() < rows:",
      "if values.min() >= 0 and values.max() <= rows:",
      T_INPUTS, "an id equal to the table size passes"),
    M("inputs-content-sample", INPUTS,
      "return at(ID_RANGE, 6, _segment(batch.candidates.offsets, cand), int(ids[pos]))",
      "return at(ID_RANGE, 6, cand, int(ids[pos]))",
      T_INPUTS, "a bad content id names the candidate's index as the sample"),
    M("inputs-label-sample", INPUTS,
      "return at(NONFINITE, 7, _segment(batch.candidates.offsets, cand), 0)",
      "return at(NONFINITE, 7, cand, 0)",
      T_INPUTS, "a non-finite label names the candidate's index as the sample"),
    M("inputs-overrun-unchecked", INPUTS,
      "    if int(offsets[-1]) != total:\n",
      "    if int(offsets[-1]) > total:\n",
      T_INPUTS, "offsets that stop short of their values pass"),
    # ---- checkpoint -----------------------------------------------------------------
    M("ckpt-rng-not-restored", CKPT,
      "        set_rng_state(rng)\n",
      "        pass\n",
      T_RESUME, "RNG state read but not restored (another worker's test)"),
    M("ckpt-resume-step", CKPT,
      'return DataPosition(manifest["step"], manifest["samples_seen"], world, segments)',
      'return DataPosition(manifest["step"] + 1, manifest["samples_seen"], world, segments)',
      T_RESUME, "the resume step off by one"),
    M("ckpt-oldest", CKPT,
      "return max(done, key=_step, default=None)",
      "return min(done, key=_step, default=None)",
      T_RESUME, "resume picks the oldest complete checkpoint"),
    # ---- comm backends --------------------------------------------------------------
    M("fake-send-offset", "freescale/comm/fake.py",
      "start = sum(s.send[:rank])",
      "start = sum(s.send[: rank + 1]) - s.send[0]",
      T_COMM, "fake all_to_all_v reads the wrong slice of a sender's buffer"),
    M("smfree-recv-offsets-swapped", "freescale/comm/smfree.py",
      "so, ro, c = _offsets(send), _offsets(recv), t.chunk_bytes",
      "so, ro, c = _offsets(recv), _offsets(send), t.chunk_bytes",
      T_SMFREE, "SM-free all_to_all_v: send and receive offsets swapped"),
    M("smfree-last-chunk", "freescale/comm/smfree.py",
      "rounds = max([-(-send[p] // c) for p in peers] + [-(-recv[p] // c) for p in peers] + [0])",
      "rounds = max([send[p] // c for p in peers] + [recv[p] // c for p in peers] + [0])",
      T_SMFREE, "SM-free all_to_all_v drops a message's last partial chunk"),
    M("torch-comm-splits-swapped", "freescale/comm/torch_backend.py",
      "            output_split_sizes=recv,\n            input_split_sizes=send,\n",
      "            output_split_sizes=send,\n            input_split_sizes=recv,\n",
      T_COMM, "torch backend: input and output split sizes swapped"),
    M("protocol-count-sum", "freescale/comm/protocol.py",
      "if x.dim() < 1 or sum(send) != x.shape[0]:",
      "if x.dim() < 1 or sum(send) > x.shape[0]:",
      T_COMM, "check_counts accepts send counts that leave rows behind"),
    # ---- kernels and their torch twins ------------------------------------------------
    M("permute-triton-off-by-one", "freescale/kernels/triton_permute.py",
      "    src_rows += rows - tl.load(dst_offsets + lo)\n",
      "    src_rows += rows - tl.load(dst_offsets + lo) + 1\n",
      T_PERMUTE, "Triton permute (rows layout): source row off by one"),
    M("permute-torch-off-by-one", "freescale/jagged/ops.py",
      "positions = torch.arange(total, device=offsets.device) - new_offsets[seg] + starts[seg]",
      "positions = torch.arange(total, device=offsets.device) - new_offsets[seg] + starts[seg] - 1",
      T_PERMUTE, "torch permute twin: positions off by one"),
    M("dispatch-triton-off-by-one", "freescale/kernels/triton_dispatch.py",
      "    pos = (base + before).to(tl.int64)",
      "    pos = (base + before + 1).to(tl.int64)",
      T_DISPATCH, "Triton dispatch: every row placed one position late"),
    M("dispatch-torch-unstable", "freescale/kernels/dispatch.py",
      "order = torch.sort(dest, stable=True).indices",
      "order = torch.sort(dest, descending=True, stable=True).indices",
      T_DISPATCH, "torch dispatch twin: destinations in reverse rank order"),
    M("collision-positions-in", "freescale/kernels/collision.py",
      "return torch.where(hay[pos] == needles, pos, -1)",
      "return torch.where(hay[pos] >= needles, pos, -1)",
      T_COLLISION, "positions_in finds a row that is not there (the next larger one)"),
    M("shard-hashed-owner", "freescale/kernels/shard.py",
      "owner = (block + stripe_hash(stripe)) % self.world_size",
      "owner = (block + stripe_hash(stripe) + 1) % self.world_size",
      T_SHARD, "hashed sharding: the formula's owner disagrees with the kernels'"),
]
# fmt: on


# ---- running -------------------------------------------------------------------------
def check_entry(m: Mutant, root: Path) -> str | None:
    """Why ``m`` cannot be applied in ``root`` (None if it can)."""
    path = root / m.file
    if not path.is_file():
        return f"{m.file} does not exist"
    n = path.read_text().count(m.original)
    return None if n == 1 else f"snippet occurs {n} times in {m.file}"


def copy_tree(dest: Path, tests_at: str | None) -> None:
    """The checkout's files (tracked and untracked, not ignored) into ``dest``;
    with ``tests_at``, ``tests/`` from that revision instead."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        if tests_at and rel.startswith("tests/"):
            continue
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if tests_at:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", tests_at, "tests"],
            cwd=ROOT, check=True, capture_output=True,
        ).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")


def _exists(root: Path, test: str) -> bool:
    """Whether the test file (and the test, for a node id) is in ``root`` (older
    tests may lack it: ``--tests-at``)."""
    path, _, name = test.partition("::")
    file = root / path
    if not file.is_file():
        return False
    return not name or f"def {name.split('[')[0]}(" in file.read_text()


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[str, float, str]:
    """(outcome, seconds, last line) of the tests in ``root``: passed/failed/timeout/none."""
    present = [t for t in tests if _exists(root, t)]
    if not present:
        return "none", 0.0, "no test file of this selection exists here"
    env = {**os.environ, "CI": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(root)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *present,
           "--timeout", str(TIMEOUT_S)]  # fmt: skip
    start = time.perf_counter()
    # Its own process group: rank processes and forkservers end with it.
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, f"no result after {RUN_LIMIT_S} s"
    finally:
        _kill_group(proc)  # what the tests left running
    seconds = time.perf_counter() - start
    lines = [ln for ln in out.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    if failed:  # which test noticed, and the run's summary line
        last = f"{failed[0][:160]} | {last}"
    if proc.returncode == 0:
        return "passed", seconds, last
    # Only what failed counts (a traceback may quote a line that raises RankTimeout).
    if "+++ Timeout +++" in out or any(m in ln for m in TIMEOUT_MARKS for ln in failed):
        return "timeout", seconds, last
    return "failed", seconds, last


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(mutants: list[Mutant], tests_at: str | None, baseline: bool) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="freescale-mutants-") as tmp:
        root = Path(tmp)
        copy_tree(root, tests_at)
        clean: dict[tuple[str, ...], tuple[str, float, str]] = {}
        for m in mutants:
            why = check_entry(m, root)
            if why is not None:
                results.append(_result(m, "broken", 0.0, why))
                continue
            if baseline and m.tests not in clean:
                clean[m.tests] = run_tests(root, m.tests)
                outcome, seconds, last = clean[m.tests]
                print(f"  unmutated {' '.join(m.tests)}: {outcome} in {seconds:.0f} s", flush=True)
            if baseline and clean[m.tests][0] not in ("passed", "none"):
                results.append(_result(m, "broken", 0.0, "fails unmutated: " + clean[m.tests][2]))
                continue
            path = root / m.file
            original = path.read_text()
            try:
                path.write_text(original.replace(m.original, m.replacement))
                outcome, seconds, last = run_tests(root, m.tests)
            finally:
                path.write_text(original)
            result = {"passed": "survived", "failed": "caught", "none": "survived"}.get(
                outcome, outcome
            )
            results.append(_result(m, result, seconds, last))
            r = results[-1]
            print(f"  {m.id:34s} {r['result']:8s} {seconds:6.1f} s  {last}", flush=True)
    return results


def _result(m: Mutant, result: str, seconds: float, detail: str) -> dict:
    return {"id": m.id, "result": result, "seconds": round(seconds, 1), "detail": detail}


def table(results: list[dict], mutants: dict[str, Mutant]) -> str:
    rows = [f"{'mutant':34s} {'result':8s} {'s':>6s}  description"]
    for r in results:
        desc = mutants[r["id"]].description
        rows.append(f"{r['id']:34s} {r['result']:8s} {r['seconds']:6.1f}  {desc}")
    return "\n".join(rows)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant ids")
    parser.add_argument("--list", action="store_true", help="list the mutants and check them")
    parser.add_argument("--tests-at", default=None, help="run against tests/ of this revision")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated runs (development only)"
    )
    args = parser.parse_args(argv)
    by_id = {m.id: m for m in MUTANTS}
    if len(by_id) != len(MUTANTS):
        raise SystemExit("duplicate mutant ids")
    chosen = MUTANTS
    if args.only:
        unknown = [i for i in args.only.split(",") if i not in by_id]
        if unknown:
            raise SystemExit(f"unknown mutant ids: {unknown}")
        chosen = [by_id[i] for i in args.only.split(",")]
    if args.list:
        bad = 0
        for m in chosen:
            why = check_entry(m, ROOT)
            bad += why is not None
            print(f"{m.id:34s} {m.file:40s} {why or 'ok':10s} {m.description}")
            print(f"{'':34s} tests: {' '.join(m.tests)}")
        print(json.dumps({"mutants": len(chosen), "broken": bad}))
        return 1 if bad else 0
    # SIGTERM unwinds like Ctrl-C: the temporary copy is removed either way.
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.perf_counter()
    results = run(chosen, args.tests_at, baseline=not args.no_baseline)
    total = time.perf_counter() - start
    print(table(results, by_id))
    counts = {k: sum(r["result"] == k for r in results) for k in
              ("caught", "survived", "timeout", "broken")}  # fmt: skip
    summary = {
        "mutants": len(results),
        **counts,
        "score": round(counts["caught"] / max(len(results), 1), 3),
        "seconds": round(total),
        "tests_at": args.tests_at or "worktree",
        "not_caught": {r["id"]: r["result"] for r in results if r["result"] != "caught"},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
