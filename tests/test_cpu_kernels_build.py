"""Building the C++ CPU kernels survives a build killed half-way."""
from __future__ import annotations

import subprocess
import sys

import torch

from carpool.model.cpu_kernels import kernel_build_dir, load_cpu_ops

LOAD = ("import sys; from carpool.model.cpu_kernels import load_cpu_ops; "
        "sys.exit(0 if load_cpu_ops() is not None else 1)")


def test_a_stale_build_lock_does_not_hang_the_next_load():
    assert load_cpu_ops() is not None  # built (or cached) once
    build_dir = kernel_build_dir(torch.__version__)
    # What a build killed while compiling leaves: torch's baton file, which
    # made every later load wait for ever (a test run hung on it).
    (build_dir / "lock").write_text("")
    result = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert not (build_dir / "lock").exists()
