"""Leaving Ray Serve cleanly from a driver process.

A ``DeploymentHandle`` used in the driver (``handle.stats.remote()``)
starts Ray Serve's router: an asyncio loop on a daemon thread that never
ends by itself (ray 2.60, ``SingletonThreadRouter._asyncio_loop``), with an
event-loop monitor waking it every few seconds to record Ray metrics. After
``ray.shutdown`` those wake-ups call into a core worker that is gone, and a
daemon thread in native code when the interpreter finalizes can take the
process down with it (a test run that passed every test ended with SIGSEGV).
``stop_driver_router`` ends that thread before Ray shuts down.
"""
from __future__ import annotations

import threading

_ROUTER_THREAD = "(_run_router_event_loop)"  # the target in the thread's default name


def stop_driver_router(timeout: float = 5.0) -> bool:
    """Stop this process's Ray Serve router loop and wait for its thread;
    False when there was none (or this Ray keeps it elsewhere)."""
    try:
        from ray.serve._private.router import SingletonThreadRouter
    except ImportError:
        return False
    lock = getattr(SingletonThreadRouter, "_asyncio_loop_creation_lock", None)
    if lock is None:
        return False
    with lock:  # a handle made after this starts a fresh loop
        loop = getattr(SingletonThreadRouter, "_asyncio_loop", None)
        monitor = getattr(SingletonThreadRouter, "_event_loop_monitor", None)
        SingletonThreadRouter._asyncio_loop = None
        SingletonThreadRouter._event_loop_monitor = None
    if loop is None or loop.is_closed():
        return False
    if monitor is not None:
        loop.call_soon_threadsafe(monitor.stop)
    loop.call_soon_threadsafe(loop.stop)
    for thread in threading.enumerate():
        if thread.name.endswith(_ROUTER_THREAD):
            thread.join(timeout)
    return True
