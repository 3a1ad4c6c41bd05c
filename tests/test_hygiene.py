"""Package hygiene: cheap imports and the layering of docs/architecture.md."""

import ast
import subprocess
import sys
from pathlib import Path

import freescale

ROOT = Path(freescale.__file__).parent
LAYERS = {
    "jagged": 1,
    "kernels": 1,
    "comm": 1,
    "balance": 2,
    "embedding": 2,
    "data": 2,
    "sim": 2,
    "config": 3,  # it checks the built-in model's options (`freescale.models.sequence`)
    "models": 3,
    "observe": 3,
    "state": 3,
    "pipeline": 3,
    "torchrec": 3,
    "serving": 3,
    "run": 4,
    "cli": 4,
    "testing": 5,
}


def test_every_subpackage_has_a_layer():
    subpackages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS)


def test_importing_freescale_initializes_nothing_heavy():
    """Every module imports without a CUDA context, a process group or Triton
    (Triton is imported lazily, only by the GPU path)."""
    code = """
import importlib, pkgutil, sys
import freescale
for m in pkgutil.walk_packages(freescale.__path__, 'freescale.'):
    if 'triton' in m.name.rsplit('.', 1)[-1]:
        continue  # the Triton path itself
    importlib.import_module(m.name)
import torch
assert not torch.cuda.is_initialized(), 'CUDA was initialized on import'
assert not torch.distributed.is_initialized(), 'a process group was created on import'
assert 'triton' not in sys.modules, 'triton was imported eagerly'
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def _imported_subpackages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("freescale.") and n.count(".") >= 1}


def test_lower_layers_never_import_higher_ones():
    violations = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2:
            continue
        own = LAYERS[rel[0]]
        for sub in _imported_subpackages(path):
            if LAYERS.get(sub, 0) > own:
                violations.append(
                    f"{'/'.join(rel)} (layer {own}) imports freescale.{sub} (layer {LAYERS[sub]})"
                )
    assert not violations, "\n".join(violations)


def test_layer_check_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from freescale.cli.main import main\nimport freescale.models.x\n")
    assert _imported_subpackages(bad) == {"cli", "models"}


def test_the_trainer_stays_a_loop_and_models_hold_model_math_only():
    """The trainer's shape: the loop in ≤ 250 lines, no mode branches in the
    collection (the mode is a constructor argument), no stream or graph code
    in model files, no benchmark patching what it measures."""
    train = (ROOT / "pipeline" / "train.py").read_text()
    assert len(train.splitlines()) <= 250
    # its construction: one readable function, each component given what exists
    init = next(
        node
        for node in ast.walk(ast.parse(train))
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    assert init.end_lineno - init.lineno + 1 <= 40
    assert not [n for n in ast.walk(init) if isinstance(n, ast.Lambda)]
    collection = (ROOT / "embedding" / "collection.py").read_text()
    assert not [w for w in ("_prio", "mode ==", "mode !=") if w in collection]
    graph_code = ("cuda.Stream", "CUDAGraph", "cuda.graph(", "stream(")
    for path in (ROOT / "models").glob("*.py"):
        text = path.read_text()
        assert not [w for w in graph_code if w in text], path
    for path in (ROOT.parent / "benchmarks").glob("*.py"):
        tree = ast.parse(path.read_text())
        patched = [
            ast.unparse(t)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Attribute) and t.attr.startswith("_")
        ]
        assert not patched and "setattr(" not in path.read_text(), (path, patched)


MAX_MODULES_PER_FOLDER = 20  # __init__.py counted
MAX_MODULE_LINES = 450


def test_rooms_stay_small():
    """No folder of freescale/ over 20 modules, no module over 450 lines."""
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir())]
        if (n := len(list(folder.glob("*.py")))) > MAX_MODULES_PER_FOLDER
    }
    long = {
        str(path.relative_to(ROOT)): n
        for path in ROOT.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not crowded and not long, (crowded, long)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules under ``root`` that ``path`` imports anywhere in it (inside
    functions too): ``from a.b import c`` is ``a.b.c`` when that is a module,
    else ``a.b``."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            named = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in named if t in modules] or [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_circles(root: Path) -> list[list[str]]:
    """Every set of modules under ``root`` that import each other in a circle
    (strongly connected components of the import graph, Tarjan's algorithm)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {m: _imports(p, root, set(paths)) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1:
                circles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_through_others():
    """The import graph of freescale/ has no circle, imports inside
    functions included (a lazy import hides a circle; it does not remove it)."""
    assert import_circles(ROOT) == []


def test_the_circle_check_finds_one(tmp_path):
    pkg = tmp_path / "freescale"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from freescale.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "sub" / "c.py").write_text("import freescale.sub.a\n")
    (pkg / "sub" / "d.py").write_text("from freescale.sub.a import y\n")
    assert import_circles(pkg) == [["freescale.sub.a", "freescale.sub.b", "freescale.sub.c"]]
