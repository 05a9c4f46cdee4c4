"""The scheduler's control plane: what sets the knobs the core loop reads.

The core loop (``carpool.scheduler``: scheduler, step, queues, request, KV
manager, block pool) runs each step under the live knobs (``knobs``); this
package decides them and guards the door: the adaptive controller
(``controller``, its ``modes``, ``slo_policy``, ``alpha_policy``,
``step_budget``, the ``cost_model`` fitted online and the ``live_window``
it reads), ``admission`` and predictive ``shedding``, the emergency switch
(``overload``), ``sessions``, request-level ``regimes`` and the
time-of-day ``live_settings``. Pure Python like the core: no torch, time
from the injected clock.
"""
