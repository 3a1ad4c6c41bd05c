import json

from freescale.cli.main import main


def write_trace(path):
    def ev(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
                "args": args}  # fmt: skip

    events = [
        ev("kernel", "gemm", 0, 100, stream=7, device=0),
        ev("kernel", "gemm", 400, 100, stream=7, device=0),
        ev("kernel", "ncclDevKernel_AllReduce", 450, 100, stream=20, device=0),
        ev("cuda_runtime", "cudaStreamSynchronize", 90, 320),
    ]
    path.write_text(json.dumps({"traceEvents": events}))


def test_trace_prints_the_table(tmp_path, capsys):
    path = tmp_path / "trace.json"
    write_trace(path)
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 0.550 | 0.250 | 54.5 | 63.6 (stream 7) | 0.100 | 1 |" in out
    assert "| 0.300 | 0.100 | cudaStreamSynchronize |" in out


def test_trace_json_line(tmp_path, capsys):
    path = tmp_path / "trace.json"
    write_trace(path)
    assert main(["trace", str(path), "--json", "--min-gap-us", "500"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    summary = json.loads(line)
    assert summary["min_gap_us"] == 500
    [dev] = summary["devices"]
    assert (dev["busy_us"], dev["comm_us"], dev["gaps"]) == (250, 100, [])


def test_trace_missing_or_malformed_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["trace", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freescale: error:") and "no such trace file" in err
    assert len(err.splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    assert main(["trace", str(bad)]) == 2
    assert "not a JSON Chrome trace" in capsys.readouterr().err
