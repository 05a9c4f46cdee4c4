"""Prefill/decode disaggregation in the simulator.

The fleet's first ``prefill_replicas`` replicas form the prefill pool, the
rest the decode pool; per arrival ``carpool.cluster.pd.PDPlanner`` (the
object a live fleet runs) keeps the request on a decode replica, which
then prefills it itself, or sends its prompt to a prefill replica first.
A remote prefill is a request of one output token on the prefill replica;
when it is done the decode leg is handed to the decode replica, whose
scheduler admits it with the prompt's KV coming over the link
(``TransferInbox``, the decode side of a KV connector: the request loads
for the part of the transfer the layer-by-layer send did not hide, then
computes the prompt's last token and decodes), as vLLM's P/D connector
does. The client's first token is the decode replica's. What is not
modelled: contention between transfers on one link.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from carpool.cluster import Router, RouteRequest
from carpool.cluster.pd import PD_MODES, KVShape, Link, PDPlan, PDPlanner
from carpool.scheduler import Request
from carpool.workload.stats import OK, RequestRecord
from carpool.workload.traces import TraceRequest


@dataclass(frozen=True)
class PDSettings:
    """A disaggregated fleet: how many replicas prefill, how the planner
    chooses (``conditional``: remote prefill only where it pays;
    ``always``), and the link between the pools."""

    prefill_replicas: int
    mode: str = "conditional"
    bandwidth: float = Link.bandwidth
    latency: float = Link.latency
    min_remote_tokens: int = 0
    # Links that differ from the pools' one: (prefill index, decode index,
    # bytes per second, latency seconds), e.g. a decode replica in another rack.
    links: tuple[tuple[int, int, float, float], ...] = ()
    # What a colocated prefill's stall of the decode replica's running
    # requests weighs against the request's own TTFT (PDPlanner).
    stall_weight: float = 0.0

    def validate(self, replicas: int) -> PDSettings:
        if not 1 <= self.prefill_replicas < replicas:
            raise ValueError(f"--prefill-replicas must be in 1..{replicas - 1} (the rest "
                             f"decode), got {self.prefill_replicas}")
        if self.mode not in PD_MODES:
            raise ValueError(f"--pd-mode must be one of {', '.join(PD_MODES)}, got {self.mode!r}")
        Link(self.bandwidth, self.latency)  # validates
        for prefill, decode, bandwidth, latency in self.links:
            if not (0 <= prefill < self.prefill_replicas <= decode < replicas):
                raise ValueError(f"--pd-link {prefill}:{decode}: needs a prefill replica "
                                 f"(0..{self.prefill_replicas - 1}) and a decode replica "
                                 f"({self.prefill_replicas}..{replicas - 1})")
            Link(bandwidth, latency)
        return self

    def link_table(self) -> dict[tuple[str, str], Link]:
        """``links`` as the planner takes them (replica ids are indices)."""
        return {(str(p), str(d)): Link(bandwidth, latency)
                for p, d, bandwidth, latency in self.links}


class TransferInbox:
    """A decode replica's ``ExternalKV``: the prompts prefill replicas
    computed for it, each loadable in full from when its handoff arrives,
    in the transfer time left then."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._ready_at: dict[str, float] = {}  # request id -> when its KV is all here

    def expect(self, request_id: str, ready_at: float) -> None:
        self._ready_at[request_id] = ready_at

    def loadable(self, request: Request, hashes: Sequence[int]) -> int:
        return len(hashes) if request.request_id in self._ready_at else 0

    def load(self, request: Request, hashes: Sequence[int], first: int = 0,
             block_ids: Sequence[int] = ()) -> float:
        return max(0.0, self._ready_at.pop(request.request_id) - self.clock())

    def save(self, request: Request, hashes: Sequence[int], first: int = 0,
             block_ids: Sequence[int] = ()) -> None:
        pass  # the decode pool writes nothing back

    def filling(self, request: Request, first: int, block_ids: Sequence[int],
                hashes: Sequence[int]) -> None:
        pass  # a prefill leg's transfer is priced by the planner

    def forget(self, request: Request) -> None:
        self._ready_at.pop(request.request_id, None)  # left (its load, if any, began)


class FleetPD:
    """The P/D planner over a simulated fleet: routes arrivals, runs the
    prefill legs and hands their decode legs over (``handoffs``, which the
    event loop delivers)."""

    def __init__(self, settings: PDSettings, router: Router, kv: KVShape,
                 replica: Callable[[str], object]) -> None:
        self.settings = settings
        self.planner = PDPlanner(router, kv, Link(settings.bandwidth, settings.latency),
                                 settings.min_remote_tokens, always=settings.mode == "always",
                                 links=settings.link_table(),
                                 stall_weight=settings.stall_weight)
        self.replica = replica
        self.inboxes: dict[str, TransferInbox] = {}
        # Plan index -> (plan, request, its record, its prefill leg's record).
        self._waiting: dict[int, tuple[PDPlan, TraceRequest, RequestRecord, RequestRecord]] = {}
        self.handoffs: list[tuple[object, TraceRequest, RequestRecord]] = []
        self.disaggregated = self.colocated = 0
        self.exposed_seconds = 0.0  # transfer time that showed, summed

    def route(self, index: int, item: TraceRequest, record: RequestRecord,
              hashes: tuple[int, ...], now: float):
        """Plan request ``index``; returns (replica, what it receives, its record)."""
        plan = self.planner.plan(RouteRequest(str(index), item.input_len, hashes), now)
        if not plan.disaggregated:
            self.colocated += 1
            return self.replica(plan.decode.replica_id), item, record
        self.disaggregated += 1
        self.exposed_seconds += plan.exposed_s
        leg = RequestRecord(index, record.scheduled, item.input_len, 1)
        self._waiting[index] = (plan, item, record, leg)
        return self.replica(plan.prefill.replica_id), dataclasses.replace(item, output_len=1), leg

    def prefill_done(self, index: int, now: float, router: Router) -> None:
        """The prefill leg of ``index`` left its replica at ``now``: hand the
        decode leg over, or (the leg failed or was shed) end the request
        as the leg ended."""
        plan, item, record, leg = self._waiting.pop(index)
        if leg.status != OK:
            record.sent, record.finished = record.scheduled, now
            record.status, record.reason, record.error = leg.status, leg.reason, leg.error
            router.finished(str(index), now, learn=False)
            return
        record.cached_tokens = leg.cached_tokens  # the prompt's hit is where it was prefilled
        decode = plan.decode.replica_id
        self.inboxes[decode].expect(f"r{index}", now + plan.exposed_s)
        self.handoffs.append((self.replica(decode), item, record))

    def take_handoffs(self) -> list[tuple[object, TraceRequest, RequestRecord]]:
        handoffs, self.handoffs = self.handoffs, []
        return handoffs

    def report(self) -> dict:
        views = self.planner.router.views.values()
        return {"mode": self.settings.mode, "prefill_replicas": self.settings.prefill_replicas,
                "disaggregated": self.disaggregated, "colocated": self.colocated,
                "mean_exposed_transfer_s": self.exposed_seconds / max(1, self.disaggregated),
                # Requests the router still counts somewhere: 0 once a run is over.
                "in_flight_left": sum(v.in_flight for v in views),
                "handoffs_waiting": len(self._waiting)}


def pd_role(settings: PDSettings | None, index: int) -> str:
    """Replica ``index``'s role: the first ``prefill_replicas`` prefill."""
    if settings is None:
        return "mixed"
    return "prefill" if index < settings.prefill_replicas else "decode"


def kv_shape_of(cost) -> KVShape | None:
    """The KV layout an analytic cost model's model shape has (None for a
    measured model); MLA's is one latent row per layer."""
    model = getattr(cost, "model", None)
    if model is None:
        return None
    return KVShape(model.layers, model.cache_heads, model.cache_dim, cost.dtype_bytes,
                   tensors=model.cache_tensors)
