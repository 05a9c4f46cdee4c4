"""Pure-Python scheduling layer: requests, queues, KV block bookkeeping and
the token-budget scheduler. Never imports torch; time comes from an injected
clock, so the live engine and the simulator run exactly this code."""
from carpool.scheduler.kv_manager import KVCacheManager, KVCacheStats
from carpool.scheduler.request import Request, RequestStatus
from carpool.scheduler.scheduler import ScheduledSpan, Scheduler, SchedulerOutput

__all__ = ["KVCacheManager", "KVCacheStats", "Request", "RequestStatus", "ScheduledSpan",
           "Scheduler", "SchedulerOutput"]
