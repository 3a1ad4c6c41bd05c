"""The Python snippets of the user docs run as written (from the repository root)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["docs/your-model.md", "docs/serving.md", "docs/balance.md", "docs/embedding.md"]


def _snippets(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize(
    "page,index",
    [(p, i) for p in PAGES for i in range(len(_snippets(p)))],
)
@pytest.mark.slow
def test_snippet_runs(page, index):
    code = _snippets(page)[index]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{page} snippet {index}:\n{code}\n{proc.stderr}"


def test_every_page_has_snippets():
    assert all(_snippets(p) for p in PAGES)
