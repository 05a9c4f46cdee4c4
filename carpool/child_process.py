"""What a process carpool starts does first: end when its parent does."""
from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux for SIGKILL when the parent exits (an orphaned engine worker
    or tensor-parallel follower would hold its memory and ports forever);
    elsewhere a no-op: the callers' parent checks still end them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
