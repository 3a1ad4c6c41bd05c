"""The GPU lowering of every kernel body compiles for sm_90 (H200), on any machine."""

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import clean_env

SCRIPT = Path(__file__).with_name("aot_compile.py")


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    env = clean_env() | {"TRITON_CACHE_DIR": str(tmp_path)}  # a real compile, not a cache hit
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--ints", "i32", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 failures" in result.stdout
