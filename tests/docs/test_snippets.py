"""The snippets of README.md and docs/ run as written.

- Every ```python block is saved as a script and run in a subprocess from the
  repository root (slow: most of them train for a few steps). A block that
  starts ranks as processes (``freescale.train`` with more than one rank)
  must call it under ``if __name__ == "__main__":``, since each rank imports
  the script again: checked without running anything.
- Every ``freescale ...`` command of a ```bash block parses: the CLI's own
  argument parser reads it (nothing runs); the ``--set`` keys of the pages
  are built into configs by tests/config/test_config.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
# docs/LOG.md is history: its commands are the ones that ran then.
# docs/torchrec.md's blocks are one program in parts, on 2 ranks beside a TorchRec
# model: tests/torchrec/test_torchrec_docs.py runs them, in order.
IN_PARTS = {"docs/torchrec.md"}
PAGES = [
    "README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md") if p.name != "LOG.md"),
]
CLI = re.compile(r"^(?:\S*/)?freescale$")


def _blocks(page: str, lang: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


SNIPPETS = [(p, i) for p in PAGES if p not in IN_PARTS for i in range(len(_blocks(p, "python")))]


@pytest.mark.slow
@pytest.mark.parametrize("page,index", SNIPPETS, ids=[f"{p}-{i}" for p, i in SNIPPETS])
def test_snippet_runs_as_a_script(page, index, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(_blocks(page, "python")[index])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # `examples` imports from the root
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"{page} snippet {index}:\n{script.read_text()}\n{proc.stderr}"


def _starts_ranks(code: str) -> bool:
    return "freescale.train(" in code and bool(re.search(r'"nproc":\s*([2-9]|\d\d)', code))


@pytest.mark.parametrize("page", PAGES)
def test_snippets_that_start_ranks_have_the_main_guard(page):
    for code in _blocks(page, "python"):
        if _starts_ranks(code):
            assert 'if __name__ == "__main__":' in code, f"{page}: no main guard in\n{code}"


def _commands(block: str) -> list[list[str]]:
    """The argument lists of every ``freescale`` command in a shell block."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", "|", ";", ">", ">>"):
                if command:
                    out.append(command)
                command = []
                continue
            if command or CLI.match(word):
                command.append(word)
            elif word == "freescale.cli.main":  # python -m / torchrun -m
                command = ["freescale"]
        out = [c for c in out if c]
    return [c[1:] for c in out]


@pytest.mark.parametrize("page", PAGES)
def test_cli_commands_parse(page):
    parser = build_parser()
    for block in _blocks(page, "bash"):
        for argv in _commands(block):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                assert e.code == 0, f"{page}: `freescale {shlex.join(argv)}` does not parse"


def test_the_command_extractor():
    block = (
        ".venv/bin/freescale train --set run.steps=3 \\\n    --set x=1  # a note\n"
        "python scripts/make_taste_data.py /tmp/t.txt && freescale data stats | head\n"
        "torchrun --nproc-per-node 8 -m freescale.cli.main train --preset h200-21k\n"
    )
    assert _commands(block) == [
        ["train", "--set", "run.steps=3", "--set", "x=1"],
        ["data", "stats"],
        ["train", "--preset", "h200-21k"],
    ]
    assert any(_commands(b) for p in PAGES for b in _blocks(p, "bash"))
