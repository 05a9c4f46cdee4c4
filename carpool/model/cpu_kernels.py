"""Our C++ CPU kernels, compiled on first use with torch's extension builder.

The build needs a C++ compiler and ninja (a dependency); it is cached under
carpool's cache (``<cache>/kernels/``, one folder per torch, Python, CPU and
source set: the sources' paths and contents and the compile flags), so only
the first run on a machine pays for it (~1 minute), and two checkouts, or
two versions of the kernels, never rebuild each other's.
Without a compiler the engine falls back to the portable torch path, with a
one-line warning.

A server need not wait for that minute: with ``background=True``
(``LLMEngine.from_config(..., kernels_in_background=True)``),
`load_cpu_ops` returns at once, while a child process compiles, a
`SwitchingCpuOps` (carpool/model/kernel_switch.py) that runs the portable
path until the kernels are built and then switches to them between steps.
The child, niced, holds the build lock itself: it finishes the build for the
next start even if this process exits first, and no later build races it.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from carpool.machine import cpu_model_and_flags
from carpool.paths import default_cache_dir

_SOURCES = tuple(str(Path(__file__).parent / "csrc" / name)
                 for name in ("paged_attention.cpp", "elementwise.cpp", "packed_linear.cpp",
                              "packed_int4.cpp", "decode_block.cpp", "moe_experts.cpp",
                              "int8_linear.cpp"))
_HEADERS = tuple(str(Path(__file__).parent / "csrc" / name)  # a change rebuilds too
                 for name in ("bf16.h", "packed_block.h"))
_NAME = "carpool_cpu_ops"
# -ffast-math: tree reductions in the dot products and vector exp.
# Tuples: torch's load() appends its libraries to the lists it is given.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
_LDFLAGS = ("-fopenmp",)
# A built extension loads in about a second; past this, serve without it.
_LOAD_WAIT_S = 10.0

log = logging.getLogger(__name__)  # carpool serve's log lines; silent offline at INFO


def load_cpu_ops(background: bool = False):  # -> ModuleType | SwitchingCpuOps | None
    """The compiled kernels (paged decode attention, RMSNorm, SwiGLU), or None
    (with a warning) if they cannot be built.

    ``background``: when the kernels are not built yet, return at once a
    `SwitchingCpuOps` (the portable path until a background build finishes,
    then the kernels) instead of compiling for a minute first.
    """
    if not background:
        return _load_or_warn()
    build = KernelBuild(kernel_build_dir(_torch_version()))
    module = build.wait(0 if build.compiling else _LOAD_WAIT_S)
    if build.done():
        return module
    from carpool.model.kernel_switch import SwitchingCpuOps

    log.info("compiling the CPU kernels in the background (first run of these kernels on "
             "this machine, about a minute); serving on the portable torch path meanwhile")
    return SwitchingCpuOps(build)


class KernelBuild:
    """The kernels built off the caller's thread: a niced child process
    compiles them (unless already built), then this process loads them."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = build_dir
        self.compiling = not is_built(build_dir)
        self.started = time.monotonic()
        self.module: ModuleType | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="carpool-cpu-kernels", daemon=True).start()

    def _run(self) -> None:
        try:
            if self.compiling:
                compile_in_child(self.build_dir)
            self.module = _build()
        except Exception as exc:  # noqa: BLE001 - any build problem means "fall back"
            _warn(exc)
        finally:
            self._done.set()

    def done(self) -> bool:
        """Whether the build ended (``module`` is then the kernels, or None)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> ModuleType | None:
        """The kernels once built (None: not yet, or they cannot be built)."""
        self._done.wait(timeout)
        return self.module


def is_built(build_dir: Path) -> bool:
    """Whether ``build_dir`` holds the extension, newer than its sources (torch
    decides for sure when loading; this only picks where to compile)."""
    built = build_dir / f"{_NAME}.so"
    try:
        return built.stat().st_mtime >= max(os.stat(src).st_mtime
                                             for src in _SOURCES + _HEADERS)
    except OSError:
        return False


def compile_in_child(build_dir: Path) -> None:
    """Build the kernels in a child process (``python -m carpool.model.cpu_kernels``),
    in its own session so a Ctrl-C of this process does not stop it, logging
    to ``build_dir/build.log``; RuntimeError with the log's last line if it fails."""
    build_dir.mkdir(parents=True, exist_ok=True)
    log_path = build_dir / "build.log"
    with open(log_path, "w") as log:
        code = subprocess.call([sys.executable, "-m", __name__], stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    if code != 0:
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"the build exited with status {code}")


def _torch_version() -> str:
    import torch

    return torch.__version__


def _load_or_warn() -> ModuleType | None:
    try:
        return _build()
    except Exception as exc:  # noqa: BLE001 - any build problem means "fall back"
        _warn(exc)
        return None


def _warn(exc: Exception) -> None:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    # Printed, not logged: offline too, where logging is not set up, the one
    # line that says why everything runs slower (tests/test_first_start.py).
    print(f"carpool: CPU kernels unavailable ({type(exc).__name__}: {first_line}); "
          "using the portable torch path", file=sys.stderr, flush=True)


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
        # A warning: a minute's wait is worth a line even where logging is not set up.
        notice = threading.Timer(3.0, log.warning, ["compiling the CPU kernels (first run of "
                                                    "these kernels on this machine, about a "
                                                    "minute) ..."])
        notice.start()
        try:
            return load(name=_NAME, sources=list(_SOURCES), build_directory=str(build_dir),
                        extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
                        verbose=False)
        finally:
            notice.cancel()


def kernel_build_dir(torch_version: str, sources: Sequence[str] | None = None,
                     flags: Sequence[str] | None = None) -> Path:
    """Where the kernels are built and cached: one folder per torch, Python,
    architecture and CPU (model and feature flags: the build uses
    ``-march=native``, so a cache shared with another CPU must not load it),
    and source set (``sources_key``; by default the kernels' own sources and
    headers and their compile and link flags)."""
    model, cpu_flags = cpu_model_and_flags()
    cpu = hashlib.sha256(" ".join([model, *sorted(cpu_flags)]).encode()).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = sources_key(_SOURCES + _HEADERS if sources is None else sources,
                      _CFLAGS + _LDFLAGS if flags is None else flags)
    return (default_cache_dir() / "kernels"
            / f"torch-{torch_version}-{python}-{platform.machine()}-{cpu}-{key}")


def sources_key(sources: Sequence[str], flags: Sequence[str]) -> str:
    """A short hash of the source files (each one's path and contents) and
    the compile flags. The paths count because torch's ninja file names the
    sources by path: two checkouts with equal sources sharing a folder would
    still rebuild each other's objects (the compile command changed)."""
    digest = hashlib.sha256()
    for source in sources:
        data = Path(source).read_bytes()
        digest.update(f"{os.path.abspath(source)}\0{len(data)}\0".encode())
        digest.update(data)
    digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:12]


def _lock(guard) -> bool:
    """Take an exclusive advisory lock on the open file ``guard``; False
    where fcntl is missing (torch's own baton then guards alone)."""
    try:
        import fcntl
    except ImportError:
        return False
    fcntl.flock(guard, fcntl.LOCK_EX)
    return True


if __name__ == "__main__":  # the background build's child process (compile_in_child)
    with contextlib.suppress(AttributeError, OSError):
        os.nice(19)  # the server being started comes first
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - reported through the exit status and log
        print((str(exc).strip().splitlines() or [type(exc).__name__])[0][:300])
        sys.exit(1)
