"""`freescale report`'s markdown and plot, on hand-written step records."""

import pytest

from freescale.observe.report import markdown, plot
from freescale.observe.timing import CATEGORIES


def _records(tflops: float | None, mfu: float | None) -> list[dict]:
    return [
        {
            "step": step, "step_ms": 100.0, "qps": 1000.0, "straggler_pct": 1.0, "ne": 0.9,
            "exposed_comm_ms": dict.fromkeys(CATEGORIES, 0.5),
            "step_tflop": None if tflops is None else tflops / 10, "tflops": tflops,
            "mfu_pct": mfu,
        }
        for step in range(4)
    ]  # fmt: skip


def test_markdown_shows_throughput_only_where_counted():
    text = markdown(_records(200.0, 20.22), warmup=1, title="t")
    assert "| model TFLOP per step (all ranks) | 20 |" in text
    assert "| TFLOP/s per GPU | 200 |" in text and "| MFU % | 20.22 |" in text
    cpu = markdown(_records(0.5, None), warmup=1, title="t")  # no peak: no MFU row
    assert "| TFLOP/s per GPU | 0.5 |" in cpu and "MFU" not in cpu
    uncounted = markdown(_records(None, None), warmup=1, title="t")
    assert "TFLOP" not in uncounted and "MFU" not in uncounted
    old = [
        {k: v for k, v in r.items() if k not in ("step_tflop", "tflops", "mfu_pct")}
        for r in _records(None, None)
    ]  # fmt: skip  (a file written before these fields)
    assert "TFLOP" not in markdown(old, warmup=1, title="t")


@pytest.mark.parametrize(("tflops", "mfu", "panels"), [(200.0, 20.2, 4), (0.5, None, 4),
                                                        (None, None, 3)])  # fmt: skip
def test_plot_adds_a_throughput_panel_where_counted(tmp_path, tflops, mfu, panels):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    (path,) = plot(_records(tflops, mfu), tmp_path)
    assert imread(path).shape[0] == 300 * panels  # 3 in per panel at 100 dpi
