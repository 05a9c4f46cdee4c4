"""Our C++ CPU kernels, compiled on first use with torch's extension builder.

The build needs a C++ compiler and ninja (a dependency); it is cached under
torch's extension directory, so only the first run on a machine pays for it
(~1 minute). Without a compiler the engine falls back to the portable torch
path, with a one-line warning.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

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
    from torch.utils.cpp_extension import load

    # A cached build loads in well under a second; say so when compiling.
    notice = threading.Timer(3.0, print, ["carpool: compiling the CPU kernels (first run on "
                                          "this machine, about a minute) ..."],
                             {"file": sys.stderr, "flush": True})
    notice.start()
    try:
        return load(name="carpool_cpu_ops", sources=_SOURCES,
                    # -ffast-math: tree reductions in the dot products and vector exp.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        notice.cancel()
