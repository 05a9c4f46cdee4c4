"""Pinned prefixes on the front side: what every engine behind a front holds.

The engine side is ``carpool.scheduler.pinned_prefixes`` (a pin's prefill,
its held blocks, its counters). A front (``AsyncEngine``, ``EngineClient``,
a fleet, ``RayEngine``) keeps the pins it was asked for in a
``PinRegistry``, which checks them against the engine's ``PinLimits`` once,
for all its engines, and makes pinning idempotent (the same prefix in the
same namespace is one pin, whoever asks and how often). ``PinFront`` gives
a front the operator's three calls over the two it implements:

- ``run_pin(spec)``: have its engine(s) compute and hold the prefix; return
  once held (``PinFailed`` if a prefill did not run to its end);
- ``drop_pin(pin_id)``: have its engine(s) let the blocks go.

A front that outlives its engines' processes (a fleet restarting a
replica, a Ray replica started later) pins the registry's prefixes on the
new engine again: the registry is the desired state, the engines follow.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from carpool.engine.streams import EngineDeadError
from carpool.sampling_params import SamplingParams
from carpool.scheduler.pinned_prefixes import PinError, PinLimits, PinSpec

# A pin's prefill: the prefix computed, one greedy token sampled, nothing else.
PIN_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
PIN_PRIORITY = -1  # the best class: an operator's call, not a tenant's load

log = logging.getLogger("carpool.server")


class PinFailed(RuntimeError):
    """A pin's prefill did not run to its end (aborted, rejected, engine gone)."""


def pin_request_id(spec: PinSpec, serial: int) -> str:
    """The engine request id of a pin's ``serial``-th prefill on a front."""
    return f"pin-{spec.pin_id}-{serial}"


async def finish_pin(stream) -> None:  # noqa: ANN001 - a RequestStream
    """Read a pin's prefill to its end; ``PinFailed`` unless it completed."""
    final = None
    async for final in stream:
        pass
    if final is None or final.finish_reason not in ("length", "stop"):
        reason = None if final is None else final.finish_reason
        raise PinFailed(f"the pinned prefix's prefill ended with {reason!r}")


class PinRegistry:
    """The pins a front serves (the desired state of its engines).

    Invariant: ``specs`` holds the pins asked for and not unpinned, each
    with a ``_ready`` future that is done once its engines hold it (or
    failed, and then it is removed)."""

    def __init__(self) -> None:
        self.specs: dict[str, PinSpec] = {}
        self._ready: dict[str, asyncio.Future] = {}

    async def pin(self, spec: PinSpec, limits: PinLimits | None,
                  run: Callable[[PinSpec], Awaitable[None]],
                  drop: Callable[[str], None]) -> tuple[PinSpec, bool]:
        """Pin ``spec`` with ``run`` unless pinned already: (the pin, whether
        it is new). ``PinError`` when the limits refuse it; what ``run``
        raises, with the pin forgotten again (and ``drop``ped wherever it
        got held)."""
        existing = self.specs.get(spec.pin_id)
        if existing is not None:
            await asyncio.shield(self._ready[spec.pin_id])
            return existing, False
        if limits is None:
            raise PinError("this engine does not pin prefixes", "full")
        limits.check(spec, self.specs)
        ready = asyncio.get_running_loop().create_future()
        self.specs[spec.pin_id], self._ready[spec.pin_id] = spec, ready
        try:
            await run(spec)
        except BaseException as exc:
            if self.specs.get(spec.pin_id) is spec:
                del self.specs[spec.pin_id]
                del self._ready[spec.pin_id]
                drop(spec.pin_id)
            ready.set_exception(PinFailed(f"pinning failed: {exc}"))
            ready.exception()  # retrieved: nobody else may be waiting
            raise
        ready.set_result(None)
        return spec, True

    def remove(self, pin_id: str) -> PinSpec | None:
        """Forget a pin (its engines must drop it); None: unknown."""
        self._ready.pop(pin_id, None)
        return self.specs.pop(pin_id, None)

    def ready(self) -> list[PinSpec]:
        """The pins whose engines hold them (a new engine must pin them too)."""
        return [spec for pin_id, spec in self.specs.items()
                if self._ready[pin_id].done() and not self._ready[pin_id].exception()]


class PinFront:
    """The operator's pin calls, for a front with ``pins`` (a
    ``PinRegistry``), ``info`` (its ``EngineInfo``), ``stats``, ``run_pin``
    and ``drop_pin`` (see the module docstring)."""

    pins: PinRegistry

    async def pin_prefix(self, spec: PinSpec) -> tuple[PinSpec, bool]:
        """Pin ``spec`` on every engine: (the pin, whether it is new); an
        equal prefix pinned already returns that pin."""
        return await self.pins.pin(spec, self.info.pin_limits, self.run_pin, self.drop_pin)

    def unpin_prefix(self, pin_id: str) -> bool:
        """Unpin everywhere; False if no such pin."""
        if self.pins.remove(pin_id) is None:
            return False
        self.drop_pin(pin_id)
        return True

    def pinned_prefixes(self) -> list[PinSpec]:
        return list(self.pins.specs.values())


async def run_pin_everywhere(engines: Iterable, spec: PinSpec) -> None:
    """``run_pin`` on each engine of a fleet at once. One that dies meanwhile
    is passed over (its restarted successor is pinned then: ``repin``);
    any other failure, or no engine left, raises."""
    engines = list(engines)
    results = await asyncio.gather(*(e.run_pin(spec) for e in engines),
                                   return_exceptions=True)
    held = sum(not isinstance(r, BaseException) for r in results)
    for result in results:
        if isinstance(result, BaseException) and not (
                isinstance(result, EngineDeadError) and held):
            raise result
    if not held:
        raise PinFailed("no engine is serving")


async def repin(engine, specs: list[PinSpec], name: str) -> None:  # noqa: ANN001
    """Pin ``specs`` on an engine that joined a fleet late (a restarted or
    added replica ``name``); a failure is logged, the others go on."""
    for spec in specs:
        try:
            await engine.run_pin(spec)
        except Exception as exc:  # noqa: BLE001 - logged: the replica serves regardless
            log.warning("replica %s: pinning prefix %s failed: %s", name, spec.name, exc)


class PinReconciler:
    """Keeps one engine's pins equal to a desired list sent now and then
    (a Ray replica, told its ingress's registry with each stats poll):
    pins what is missing, drops what is no longer wanted. ``engine``: an
    ``AsyncEngine``."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self._pins: dict[str, asyncio.Task] = {}

    def sync(self, desired: list[PinSpec]) -> None:
        wanted = {spec.pin_id: spec for spec in desired}
        for pin_id in [p for p in self._pins if p not in wanted]:
            self._pins.pop(pin_id).cancel()
            self.engine.drop_pin(pin_id)
        for pin_id, spec in wanted.items():
            task = self._pins.get(pin_id)
            if task is None or (task.done() and (task.cancelled() or task.exception())):
                self._pins[pin_id] = asyncio.ensure_future(self.engine.run_pin(spec))
