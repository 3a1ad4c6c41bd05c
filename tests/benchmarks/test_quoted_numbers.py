"""Every measured number quoted in README.md and docs/*.md has a report behind it.

The convention (docs/benchmarks.md, "Quoted numbers"): a quoted measurement is
a markdown link whose text is the number and whose target is the report that
holds it, ``[2.66](../benchmarks/results/fig8.md) %``. Checked here:

1. every link into ``benchmarks/results/`` resolves to a committed file;
2. every number in such a link's text occurs in that file;
3. every ``benchmarks/results/<file>`` path named in the text exists (a removed
   report is cited as ``git show aca6152:benchmarks/results/<file>``);
4. the "our measurement" column of docs/benchmarks.md's figure table holds no
   number with a unit (%, ms, GB/s, or × written as 2.5×) outside such a link.

docs/LOG.md, the experiment log, is history and is not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "LOG.md")]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*benchmarks/results/[^)\s]*)\)")
PATH = re.compile(r"(?<![:\w])benchmarks/results/([A-Za-z0-9_.\-]+\.[a-z]+)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
UNIT = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*(?:%|ms\b|GB/s)|×)")


def _target(doc: Path, href: str) -> Path:
    return (doc.parent / href.split("#")[0]).resolve()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_linked_reports_exist_and_hold_the_numbers(doc):
    text = doc.read_text()
    for label, href in LINK.findall(text):
        target = _target(doc, href)
        assert target.is_file(), f"{doc.name}: link to missing {href}"
        body = target.read_text(errors="replace")
        for number in NUMBER.findall(label):
            plain = number.replace(",", "")
            assert number in body or plain in body, (
                f"{doc.name}: [{label}]({href}) quotes {number}, which {target.name} does not hold"
            )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_result_files_exist(doc):
    for name in PATH.findall(doc.read_text()):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), (
            f"{doc.name} names benchmarks/results/{name}, which does not exist "
            "(a removed report: cite it as `git show aca6152:benchmarks/results/...`)"
        )


def test_measurement_column_quotes_only_linked_numbers():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("| figure | paper |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    col = next(i for i, c in enumerate(header) if c.startswith("our measurement"))
    rows = [x for x in lines[start + 2 :] if x.startswith("|")]
    assert rows
    for row in rows:
        cell = [c.strip() for c in row.strip("|").split("|")][col]
        unlinked = LINK.sub("", cell)
        assert not UNIT.findall(unlinked), f"unlinked measurement in: {cell[:80]}"


def test_the_checker_catches_a_bad_quote(tmp_path):
    """The rules above, on a made-up page: a number the report lacks is caught."""
    report = tmp_path / "benchmarks" / "results" / "fig8.md"
    report.parent.mkdir(parents=True)
    report.write_text("| none | 2.66 |\n")
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    page.write_text("[2.67](../benchmarks/results/fig8.md) %\n")
    ((label, href),) = LINK.findall(page.read_text())
    assert _target(page, href) == report.resolve()
    assert NUMBER.findall(label) == ["2.67"] and "2.67" not in report.read_text()
