"""Pure-Python scheduling layer: requests, queues, KV block bookkeeping,
admission control, sessions, the token-budget scheduler and the engine
core (``core.EngineCore``: the step both drivers run). Never imports torch;
time comes from an injected clock, so the live engine and the simulator run
exactly this code."""
from carpool.scheduler.admission import RejectedError
from carpool.scheduler.kv_manager import KVCacheManager, KVCacheStats
from carpool.scheduler.request import Request, RequestStatus
from carpool.scheduler.scheduler import Scheduler
from carpool.scheduler.sessions import SessionStats
from carpool.scheduler.step import ScheduledSpan, SchedulerOutput

__all__ = ["KVCacheManager", "KVCacheStats", "RejectedError", "Request", "RequestStatus",
           "ScheduledSpan", "Scheduler", "SchedulerOutput", "SessionStats"]
