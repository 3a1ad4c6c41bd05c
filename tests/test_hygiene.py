"""Package hygiene: cheap imports and the layering of DESIGN §2."""

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
    "models": 3,
    "pipeline": 3,
    "torchrec": 3,
    "serving": 3,
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
    """Issue 30's shape: the loop in ≤ 250 lines, no mode branches in the
    collection (the mode is a constructor argument), no stream or graph code
    in model files, no benchmark patching what it measures."""
    assert len((ROOT / "pipeline" / "train.py").read_text().splitlines()) <= 250
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
