"""Fast-forward skips ``Scheduler.schedule``, so it must not skip anything
that acts every step: every such feature is a step hook, ``schedule`` runs
exactly the hooks, and fast-forward refuses while there is any."""
from __future__ import annotations

import inspect

import pytest
from test_scheduler_properties import make_scheduler, run_step

from carpool.scheduler import Request, Scheduler
from carpool.scheduler.fast_forward import decode_run_limit


def _decoding(scheduler: Scheduler) -> Scheduler:
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3 + i], 20, 0.0))
    for _ in range(2):
        run_step(scheduler)  # prefill, then a first decode
    return scheduler


class CountingHook:
    def __init__(self) -> None:
        self.calls = 0

    def before_step(self, now: float, scheduler) -> None:
        self.calls += 1


def test_a_new_per_step_hook_stops_fast_forward():
    scheduler = _decoding(make_scheduler(num_blocks=64, max_seqs=4, budget=64, policy="fcfs"))
    assert scheduler.step_hooks == () and decode_run_limit(scheduler) > 2
    hook = CountingHook()
    scheduler.step_hooks += (hook,)
    assert decode_run_limit(scheduler) == 0  # by construction, no list of features to update
    scheduler.schedule()
    assert hook.calls == 1  # and schedule() runs it


@pytest.mark.parametrize("config", [{"batching": "dynamic"}, {"emergency_switch": True}])
def test_built_in_per_step_features_are_hooks(config):
    scheduler = _decoding(make_scheduler(num_blocks=64, max_seqs=4, budget=64, policy="fcfs",
                                         **config))
    assert scheduler.step_hooks and decode_run_limit(scheduler) == 0


def test_every_component_with_a_step_hook_is_registered():
    """A component the scheduler holds that has a ``before_step`` but is not
    in ``step_hooks`` would never run: a feature half added."""
    from carpool.config import CacheConfig, ControllerConfig, SchedulerConfig

    config = SchedulerConfig(batching="dynamic", emergency_switch=True)
    scheduler = Scheduler(config, CacheConfig(), 64, lambda: 0.0, ControllerConfig(adaptive=True))
    hooked = [value for value in vars(scheduler).values()
              if callable(getattr(value, "before_step", None)) and not inspect.isclass(value)]
    assert len(hooked) == 2  # the overload guard and the controller
    assert all(any(value is hook for hook in scheduler.step_hooks) for value in hooked)
    assert len(scheduler.step_hooks) == 3  # and the batch gate's hook
