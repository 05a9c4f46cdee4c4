"""The emergency switch: sustained overload enters degrade mode, with hysteresis."""
from __future__ import annotations

import pytest

from carpool.scheduler.overload import BusyWindow, OverloadGuard


def test_busy_window_fraction():
    window = BusyWindow(window_s=10.0)
    for t in range(10):
        window.record(float(t), 0.5)
    assert window.fraction(9.0) == pytest.approx(0.5)
    assert window.fraction(30.0) == 0.0


def test_enters_only_when_sustained_and_leaves_with_hysteresis():
    guard = OverloadGuard(queue_threshold=100, busy_threshold=0.9, sustain_s=5.0)
    assert not guard.update(0.0, 150, 0.5)
    assert not guard.update(4.9, 150, 0.5) and not guard.degraded
    assert guard.update(5.0, 150, 0.5) and guard.degraded and "queue 150" in guard.reason
    # between the thresholds: stays degraded (no flapping)
    for t, queue in ((6.0, 80), (7.0, 60), (8.0, 99)):
        assert not guard.update(t, queue, 0.5) and guard.degraded
    assert guard.update(9.0, 40, 0.5) and not guard.degraded
    assert guard.switches == 2


def test_a_short_spike_does_not_switch():
    guard = OverloadGuard(queue_threshold=10, sustain_s=2.0)
    guard.update(0.0, 0, 0.95)
    guard.update(1.0, 0, 0.5)  # the spike ended: the clock restarts
    guard.update(2.5, 0, 0.95)
    assert not guard.update(4.0, 0, 0.95) and not guard.degraded
    assert guard.update(4.5, 0, 0.95) and "busy 95%" in guard.reason
