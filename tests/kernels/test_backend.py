import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freescale.kernels import backend, choose_impl, indexed_permute
from freescale.kernels.backend import IMPL_ENV

from .conftest import clean_env

KERNELS = Path(__file__).resolve().parents[2] / "freescale" / "kernels"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_picks_by_device(monkeypatch):
    monkeypatch.delenv(IMPL_ENV, raising=False)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert choose_impl(None, CPU) == "torch"
    assert choose_impl(None, CUDA) == "triton"
    assert choose_impl("auto", CUDA) == "triton"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert choose_impl(None, CUDA) == "torch"


def test_argument_beats_environment(monkeypatch):
    monkeypatch.setenv(IMPL_ENV, "eager")
    assert choose_impl(None, CPU) == "eager"
    assert choose_impl("torch", CPU) == "torch"
    monkeypatch.setenv(IMPL_ENV, "")
    assert choose_impl(None, CPU) == "torch"


def test_bad_choices(monkeypatch):
    with pytest.raises(ValueError, match="impl='fast'"):
        choose_impl("fast", CPU)
    monkeypatch.setenv(IMPL_ENV, "gpu")
    with pytest.raises(ValueError, match=IMPL_ENV):
        choose_impl(None, CPU)
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        choose_impl("triton", CPU)


def test_environment_forces_the_eager_path(monkeypatch):
    from freescale.jagged.tensor import JaggedTensor
    from freescale.kernels import permute

    calls = []
    original = permute.indexed_permute_eager
    monkeypatch.setattr(
        permute, "indexed_permute_eager", lambda *a: calls.append(1) or original(*a)
    )
    monkeypatch.setenv(IMPL_ENV, "eager")
    out = indexed_permute(JaggedTensor(torch.arange(3), torch.tensor([0, 1, 3])), torch.tensor([1]))
    assert calls == [1] and out.values.tolist() == [1, 2]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=120
    )


def test_import_does_not_import_triton():
    code = (
        "import sys, torch\n"
        "import freescale, freescale.kernels as k\n"
        "assert 'triton' not in sys.modules, 'import'\n"
        "from freescale.jagged.tensor import JaggedTensor\n"
        "jt = JaggedTensor(torch.arange(4), torch.tensor([0, 1, 4]))\n"
        "k.indexed_permute(jt, torch.tensor([1, 0]))\n"
        "k.ranged_dispatch_ids(torch.arange(4), k.RowSharding(4, 2, 'hashed'))\n"
        "k.collision_split(torch.arange(3), torch.arange(2, 5))\n"
        "assert 'triton' not in sys.modules, 'cpu ops'\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_forced_triton_on_cpu_without_interpreter_fails_clearly():
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from freescale.jagged.tensor import JaggedTensor\n"
        "from freescale.kernels import indexed_permute\n"
        "jt = JaggedTensor(torch.arange(4), torch.tensor([0, 1, 4]))\n"
        "indexed_permute(jt, torch.tensor([1, 0]), impl='triton')\n"
    )
    result = run_python(code)
    assert result.returncode != 0 and "TRITON_INTERPRET" in result.stderr, result.stderr


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_layering_kernels_import_only_jagged_and_libraries():
    allowed_roots = {"torch", "numpy", "triton", "cudnn", "__future__"}  # cudnn: optional extra
    stdlib = set(sys.stdlib_module_names)
    for path in sorted(KERNELS.rglob("*.py")):
        for name in imported_modules(path):
            root = name.split(".")[0]
            if root == "freescale":
                assert name.startswith(("freescale.jagged", "freescale.kernels")), (path, name)
            else:
                assert root in allowed_roots or root in stdlib, (path, name)
        if not path.name.startswith("triton_"):
            assert not any(n.split(".")[0] == "triton" for n in imported_modules(path)), path


def test_interpreted_kernels_work_when_triton_was_imported_first():
    """TorchRec imports Triton (compiled mode) before this folder turns the
    interpreter on; the kernels must not depend on Triton's own jit helpers."""
    pytest.importorskip("triton")
    code = (
        "import os, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from tests.kernels.conftest import _fix_interpreter_loop_bounds\n"
        "_fix_interpreter_loop_bounds()\n"
        "from freescale.kernels import triton_bucketize, triton_collision, triton_dispatch\n"
        "from freescale.kernels import triton_permute, triton_rows\n"
        "triton_permute.check('cpu', num_segments=40, mean_length=6)\n"
        "triton_rows.check('cpu', n=100, dim=3, world_size=4)\n"
        "triton_dispatch.check('cpu', n=200, world_size=5, dim=3)\n"
        "triton_bucketize.check('cpu', n=300)\n"
        "triton_collision.check('cpu', n=300)\n"
        "import torch\n"
        "from freescale.embedding.collision_link import owner_marks\n"
        "a, b = torch.randint(0, 50, (700,)), torch.randint(0, 50, (600,))\n"
        "got, want = owner_marks(a, b, impl='triton'), owner_marks(a, b, impl='torch')\n"
        "assert all(torch.equal(x, y) for x, y in zip(got, want))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=KERNELS.parents[1],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
