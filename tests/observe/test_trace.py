import gzip
import itertools
import json

import pytest

from freescale.observe.trace import (
    format_summary,
    format_threads,
    gpu_gaps,
    host_steps,
    load_trace,
    thread_ops,
)


def kernel(ts, dur, name="gemm", stream=7, device=0, cat="kernel"):
    args = {"stream": stream, "device": device}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": device,
            "tid": stream, "args": args}  # fmt: skip


def cpu(ts, dur, name, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 4242, "tid": 1}


def one_gpu_trace():
    """Busy [0,250) [600,720) [740,760) on GPU 0: one 350 µs bubble, one 20 µs."""
    return {
        "traceEvents": [
            kernel(0, 100),
            kernel(150, 100),
            kernel(600, 100),
            kernel(740, 20),
            kernel(50, 150, name="ncclDevKernel_AllReduce_Sum_f32", stream=20),  # overlaps
            kernel(700, 20, name="Memcpy HtoD", stream=9, cat="GPU_MEMCPY"),
            cpu(0, 1000, "train_step", cat="python_function"),
            cpu(245, 360, "aten::item"),
            cpu(250, 350, "cudaStreamSynchronize", cat="CUDA_RUNTIME"),
            cpu(590, 5, "cudaLaunchKernel", cat="cuda_runtime"),
            cpu(0, 300, "ProfilerStep#2", cat="user_annotation"),
            cpu(300, 500, "ProfilerStep#3", cat="user_annotation"),
            # The GPU mirror of a step annotation is neither busy time nor a step.
            {**kernel(0, 300, name="ProfilerStep#2"), "cat": "gpu_user_annotation"},
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        ]
    }


def test_one_gpu_busy_idle_nccl_and_compute_stream():
    s = gpu_gaps(one_gpu_trace())
    assert s.window_us == 760
    [d] = s.devices
    assert (d.device, d.start_us, d.window_us) == (0, 0, 760)
    assert (d.busy_us, d.idle_us) == (390, 370)
    assert d.idle_pct == pytest.approx(100 * 370 / 760)
    assert d.comm_us == 150
    # Stream 20 has more busy time than nothing but only NCCL: stream 7 is compute.
    assert (d.compute_stream, d.compute_busy_us) == (7, 320)
    assert d.compute_idle_pct == pytest.approx(100 * 440 / 760)


def test_gaps_name_the_cpu_work_innermost_first():
    [d] = gpu_gaps(one_gpu_trace()).devices
    [gap] = d.gaps  # the 20 µs gap is below the default 50 µs
    assert (gap.start_us, gap.dur_us) == (250, 350)
    # Equal overlaps: the shortest (innermost) event first; steps are never named.
    assert gap.cpu == ["cudaStreamSynchronize", "aten::item", "train_step"]
    [_, small] = gpu_gaps(one_gpu_trace(), min_gap_us=10).devices[0].gaps
    assert (small.start_us, small.dur_us, small.cpu) == (720, 20, ["train_step"])


def test_steps_intersect_the_cpu_step_span():
    [d] = gpu_gaps(one_gpu_trace()).devices
    rows = [(r.name, r.window_us, r.busy_us, r.idle_us) for r in d.steps]
    assert rows == [("ProfilerStep#2", 300, 250, 50), ("ProfilerStep#3", 500, 140, 360)]
    assert d.steps[1].idle_pct == pytest.approx(72.0)


def test_host_steps_subtract_waits_on_the_step_thread_only():
    trace = one_gpu_trace()
    # A wait on another thread (a loader's pinned copy, say) blocks no launch.
    trace["traceEvents"].append({**cpu(100, 50, "cudaMemcpyAsync", "cuda_runtime"), "tid": 2})
    rows = [(h.name, h.window_us, h.wait_us, h.host_us) for h in host_steps(trace)]
    # The 350 us cudaStreamSynchronize at 250 is split between the two steps.
    assert rows == [("ProfilerStep#2", 300, 50, 250), ("ProfilerStep#3", 500, 300, 200)]
    with pytest.raises(ValueError, match="traceEvents"):
        host_steps({"x": 1})


def test_host_steps_count_waits_of_autograd_engine_threads():
    """Backward runs on autograd's device thread while the step's thread blocks
    in ``backward()``: a wait there is the step's wait too."""
    trace = one_gpu_trace()
    engine = "autograd::engine::evaluate_function: ShardedLookupBackward"
    trace["traceEvents"] += [
        {**cpu(320, 200, engine), "tid": 3},
        {**cpu(330, 120, "cudaEventSynchronize", "cuda_runtime"), "tid": 3},
        {**cpu(100, 50, "cudaMemcpyAsync", "cuda_runtime"), "tid": 2},  # a loader's
    ]
    rows = [(h.name, h.wait_us, h.host_us) for h in host_steps(trace)]
    # Step 3: the stream synchronize [300, 600) already covers [330, 450).
    assert rows == [("ProfilerStep#2", 50, 250), ("ProfilerStep#3", 300, 200)]
    trace["traceEvents"].append({**cpu(700, 50, "cudaEventSynchronize", "cuda_runtime"), "tid": 3})
    assert [h.wait_us for h in host_steps(trace)] == [50, 350]


def test_two_devices_reported_separately():
    events = [
        kernel(0, 10, device=0),
        kernel(100, 10, device=0, stream=3),
        # No args: the device comes from pid and the stream from tid.
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 45, "pid": 1, "tid": 3},
    ]
    s = gpu_gaps({"traceEvents": events})
    assert [d.device for d in s.devices] == [0, 1]
    d0, d1 = s.devices
    assert (d0.window_us, d0.busy_us, d0.idle_us) == (110, 20, 90)
    assert [(g.start_us, g.dur_us, g.cpu) for g in d0.gaps] == [(10, 90, [])]
    assert (d1.start_us, d1.window_us, d1.busy_us, d1.idle_pct, d1.gaps) == (5, 45, 45, 0.0, [])
    assert (d1.compute_stream, d1.compute_idle_pct) == (3, 0.0)
    assert s.window_us == 110


@pytest.mark.parametrize("events", [[], [cpu(0, 10, "aten::add")]])
def test_no_gpu_events_is_an_empty_window(events):
    s = gpu_gaps({"traceEvents": events})
    assert (s.window_us, s.devices) == (0.0, [])
    assert "No GPU events" in format_summary(s)


def test_format_summary_table():
    text = format_summary(gpu_gaps(one_gpu_trace()))
    assert "| 0 | 0.760 | 0.390 | 48.7 | 57.9 (stream 7) | 0.150 | 1 |" in text
    assert "| 0.350 | 0.250 | cudaStreamSynchronize, aten::item, train_step |" in text
    assert "| ProfilerStep#3 | 0.500 | 0.140 | 72.0 |" in text


def test_format_lists_the_ten_largest_gaps():
    events = [kernel(1000 * i, 100 + i) for i in range(13)]  # 12 gaps, shrinking
    text = format_summary(gpu_gaps({"traceEvents": events}))
    lines = text.splitlines()
    start = lines.index("| --- | --- | --- |") + 1
    gap_rows = list(itertools.takewhile(bool, lines[start:]))  # up to the next table
    assert len(gap_rows) == 10
    assert gap_rows[0].startswith("| 0.900 | 0.100 |")  # the largest first


def test_load_trace_json_gz_and_bare_list(tmp_path):
    trace = one_gpu_trace()
    (tmp_path / "t.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump(trace, f)
    (tmp_path / "list.json").write_text(json.dumps(trace["traceEvents"]))
    assert load_trace(tmp_path / "t.json") == trace
    assert load_trace(tmp_path / "t.json.gz") == trace
    assert load_trace(tmp_path / "list.json") == trace


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such trace file"), ("{not json", "not a JSON"), ('{"a": 1}', "no traceEvents")],
)
def test_load_trace_errors(tmp_path, content, message):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_trace(path)
    gz = tmp_path / "bad.json.gz"
    gz.write_text("plain text")
    with pytest.raises(ValueError, match="not a JSON"):
        load_trace(gz)


def test_gpu_gaps_rejects_a_non_trace():
    with pytest.raises(ValueError, match="traceEvents"):
        gpu_gaps({"events": []})


def test_real_cpu_profiler_trace_has_no_gpu_window(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "cpu.json"
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            x = torch.randn(16, 16)
            (x @ x).relu().sum()
            prof.step()
    prof.export_chrome_trace(str(path))
    s = gpu_gaps(load_trace(path))
    assert (s.window_us, s.devices) == (0.0, [])


def test_host_waits_name_their_enclosing_ops():
    events = [
        kernel(0, 10),
        {**cpu(100, 5000, "ShardedLookupBackward"), "tid": 1},
        {**cpu(200, 4000, "aten::item"), "tid": 1},
        {**cpu(300, 3000, "cudaStreamSynchronize", cat="cuda_runtime"), "tid": 1},
        {**cpu(300, 3500, "other thread op"), "tid": 2},  # another thread: not enclosing
        {**cpu(6000, 200, "cudaMemcpyAsync", cat="cuda_runtime"), "tid": 1},  # too short
    ]
    waits = gpu_gaps({"traceEvents": events}).host_waits
    assert len(waits) == 1
    w = waits[0]
    assert (w.start_us, w.dur_us, w.call) == (300, 3000, "cudaStreamSynchronize")
    assert w.inside == ["ShardedLookupBackward", "aten::item"]
    assert len(gpu_gaps({"traceEvents": events}, min_wait_us=100).host_waits) == 2
    text = format_summary(gpu_gaps({"traceEvents": events}))
    assert "| 3.000 | 0.300 | cudaStreamSynchronize | ShardedLookupBackward > aten::item |" in text


def test_thread_ops_count_outermost_ops_per_step_and_thread():
    trace = one_gpu_trace()  # steps 2 and 3 span [0, 800) on thread 1
    engine = "autograd::engine::evaluate_function: MmBackward0"
    trace["traceEvents"] += [
        {**cpu(400, 100, engine), "tid": 3},
        {**cpu(410, 50, "aten::mm"), "tid": 3},  # nested: counted in its parent only
        {**cpu(900, 100, engine), "tid": 3},  # after the last step: not counted
    ]
    by_tid = {t.tid: t for t in thread_ops(trace)}
    main = by_tid[1]  # train_step [0, 1000) is outermost; aten::item etc. inside it
    assert main.by_name == [("train_step", 500.0, 0.5)]
    assert by_tid[3].by_name == [(engine, 50.0, 0.5)] and by_tid[3].ops == 0.5
    text = format_threads(thread_ops(trace), top=5)
    assert "Thread 1: 0.500 ms of outermost ops per step" in text
    assert thread_ops({"traceEvents": []}) == []


def test_idle_is_split_by_gap_length():
    """Gaps of 1, 5, 20 and 350 µs land in their buckets; together they are the idle time."""
    ends = [(0, 10), (11, 20), (25, 30), (50, 60), (410, 420)]
    s = gpu_gaps({"traceEvents": [kernel(a, b - a) for a, b in ends]})
    [d] = s.devices
    got = [(x.below_us, x.count, x.idle_us) for x in d.gap_sizes]
    assert got == [(2.0, 1, 1.0), (10.0, 1, 5.0), (100.0, 1, 20.0), (float("inf"), 1, 350.0)]
    assert sum(x.idle_us for x in d.gap_sizes) == d.idle_us
    text = format_summary(s)
    assert "idle by gap length" in text and "| >= 100 us | 1 | 0.350 |" in text
