"""scripts/ holds only the scripts its README lists, each named where its README
says, and no living text names a script that is neither there nor listed as
removed (research probes must not grow back into scripts/)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
README = SCRIPTS / "README.md"

# Where a command may be named. docs/LOG.md and the reports under
# benchmarks/results/ are history: they keep the commands they ran.
TEXT_ROOTS = ["README.md", "pyproject.toml", ".ci", "docs", "benchmarks", "freescale",
              "tests", "examples", "scripts"]  # fmt: skip
HISTORY = {ROOT / "docs" / "LOG.md"}
SUFFIXES = {".py", ".md", ".sh", ".toml", ""}
REFERENCE = re.compile(r"(?<![\w./-])scripts/([\w-]+(?:\.[\w-]+)*)")


def _table(section: str) -> list[list[str]]:
    """The rows (cells) of the table under ``## section`` of scripts/README.md."""
    text = README.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]  # past the header and its rule


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def listed() -> dict[str, list[str]]:
    """Each listed script -> the files its README row says name it."""
    return {_names(row[0])[0]: _names(row[2]) for row in _table("Scripts")}


def removed() -> set[str]:
    return {name for row in _table("Removed") for name in _names(row[0])}


def _living_texts():
    for top in TEXT_ROOTS:
        path = ROOT / top
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in paths:
            results = ROOT / "benchmarks" / "results"
            if p in HISTORY or (p.is_relative_to(results) and p.name != "README.md"):
                continue
            if p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                yield p


def test_scripts_holds_exactly_the_listed_files():
    present = {p.name for p in SCRIPTS.iterdir() if p.name not in ("README.md", "__pycache__")}
    assert present == set(listed()), (
        "scripts/ and scripts/README.md's table differ: add a row saying who runs a "
        "new script (or put a probe elsewhere), or remove the row of a deleted one"
    )
    assert not set(listed()) & removed()


def test_each_script_is_named_where_its_row_says():
    for name, places in listed().items():
        assert places, name
        for place in places:
            assert f"scripts/{name}" in (ROOT / place).read_text(), (name, place)


def test_no_text_names_an_unknown_script():
    known = set(listed()) | removed() | {"README.md"}
    dangling = [
        f"{p.relative_to(ROOT)}: scripts/{m.group(1)}"
        for p in _living_texts()
        for m in REFERENCE.finditer(p.read_text(errors="replace"))
        if m.group(1).rstrip(".") not in known
    ]
    assert not dangling, "\n".join(dangling)


def test_the_reference_pattern():
    text = "run `bash scripts/test.sh -x`, see scripts/README.md. Not benchmarks/scripts/x.py."
    assert [m.group(1).rstrip(".") for m in REFERENCE.finditer(text)] == ["test.sh", "README.md"]
