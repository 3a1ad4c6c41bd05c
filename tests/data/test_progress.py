"""Progress of long data work: a tqdm bar on a terminal, few plain lines elsewhere."""

import io

from freescale.data.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_that_ends_at_the_total():
    out = Terminal()
    progress = Progress(stream=out, unit="user")
    for done in range(1, 11):
        progress("data convert: 1/1 files", done=done, total=10)
    progress("data convert: done", force=True)
    text = out.getvalue()
    assert "\r" in text and "10/10" in text and "user" in text  # redrawn in place
    assert text.rstrip().endswith("data convert: done")


def test_elsewhere_plain_lines_at_most_every_few_seconds():
    out = io.StringIO()
    progress = Progress(stream=out, every=3600.0)
    for done in range(1, 1001):
        progress(f"data split: {done}/1000 row groups", done=done, total=1000)
    progress("data split: done", force=True)
    assert out.getvalue().splitlines() == ["data split: done"]  # no bar, no flood
    lines = []
    Progress(say=lines.append, every=0.0)("step 1", done=1, total=2)
    assert lines == ["step 1"]  # a caller's say gets the plain lines
