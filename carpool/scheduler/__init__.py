"""Pure-Python scheduling layer, the core loop: requests, queues, KV block
bookkeeping (block pool, KV manager) and the token-budget scheduler; its
control plane (the adaptive controller, admission, sessions...) is
``scheduler.control``. The step both drivers run is ``carpool.engine.core``.
Never imports torch; time comes from an injected clock, so the live engine
and the simulator run exactly this code."""
from carpool.scheduler.control.admission import RejectedError
from carpool.scheduler.control.sessions import SessionStats
from carpool.scheduler.kv_manager import KVCacheManager, KVCacheStats
from carpool.scheduler.request import Request, RequestStatus
from carpool.scheduler.scheduler import Scheduler
from carpool.scheduler.step import ScheduledSpan, SchedulerOutput

__all__ = ["KVCacheManager", "KVCacheStats", "RejectedError", "Request", "RequestStatus",
           "ScheduledSpan", "Scheduler", "SchedulerOutput", "SessionStats"]
