"""Our C++ CPU kernels, compiled on first use with torch's extension builder.

The build needs a C++ compiler and ninja (a dependency); it is cached under
carpool's cache (``<cache>/kernels/``, one folder per torch version and
architecture), so only the first run on a machine pays for it (~1 minute).
Without a compiler the engine falls back to the portable torch path, with a
one-line warning.
"""
from __future__ import annotations

import hashlib
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

from carpool.machine import cpu_model_and_flags
from carpool.paths import default_cache_dir

_SOURCES = [str(Path(__file__).parent / "csrc" / name)
            for name in ("paged_attention.cpp", "elementwise.cpp")]


def load_cpu_ops() -> ModuleType | None:
    """The compiled kernels (paged decode attention, RMSNorm, SwiGLU), or None
    (with a warning) if they cannot be built."""
    try:
        return _build()
    except Exception as exc:  # noqa: BLE001 - any build problem means "fall back"
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        print(f"carpool: CPU kernels unavailable ({type(exc).__name__}: {first_line}); "
              "using the portable torch path", file=sys.stderr)
        return None


def _build() -> ModuleType:
    import torch
    from torch.utils.cpp_extension import load

    build_dir = kernel_build_dir(torch.__version__)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "carpool.lock", "w") as guard:
        # One build at a time; the OS releases the lock when its holder dies.
        # torch guards a build with a "lock" file that a killed build leaves
        # behind, and every later load then waits for it for ever. Under our
        # lock no other build runs, so a file left there is stale.
        if _lock(guard):
            (build_dir / "lock").unlink(missing_ok=True)
        # A cached build loads in well under a second; say so when compiling.
        notice = threading.Timer(3.0, print, ["carpool: compiling the CPU kernels (first run "
                                              "on this machine, about a minute) ..."],
                                 {"file": sys.stderr, "flush": True})
        notice.start()
        try:
            return load(name="carpool_cpu_ops", sources=_SOURCES, build_directory=str(build_dir),
                        # -ffast-math: tree reductions in the dot products and vector exp.
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                        extra_ldflags=["-fopenmp"], verbose=False)
        finally:
            notice.cancel()


def kernel_build_dir(torch_version: str) -> Path:
    """Where the kernels are built and cached: one folder per torch, Python,
    architecture and CPU (model and feature flags: the build uses
    ``-march=native``, so a cache shared with another CPU must not load it)."""
    model, flags = cpu_model_and_flags()
    cpu = hashlib.sha256(" ".join([model, *sorted(flags)]).encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return (default_cache_dir() / "kernels"
            / f"torch-{torch_version}-{python}-{platform.machine()}-{cpu}")


def _lock(guard) -> bool:
    """Take an exclusive advisory lock on the open file ``guard``; False
    where fcntl is missing (torch's own baton then guards alone)."""
    try:
        import fcntl
    except ImportError:
        return False
    fcntl.flock(guard, fcntl.LOCK_EX)
    return True
