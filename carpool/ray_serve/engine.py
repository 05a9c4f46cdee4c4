"""RayEngine: the engine deployment behind one handle, with ``AsyncEngine``'s interface.

The ingress replica's FastAPI app (carpool's own, unchanged) is given this
object as its engine. ``add_request`` tokenizes, computes the prompt's
chained block hashes with the fleet's secret (the router's ``RouteHint``)
and calls the engine deployment with a streaming handle; carpool's request
router (``carpool.ray_serve.router``) picks the replica. The replica's
``StreamEvent``s become the same ``RequestStream`` of ``RequestOutput``s
that ``EngineClient`` returns. Aborting (the client went away) cancels the
handle's stream, which aborts the request on its replica.

P/D serving: the ingress holds one ``RayEngine`` per pool (the prefill and
the decode deployment) behind a ``PDFleet``, which adds each part with its
``Handoff``; a decode part's outputs go on from the prefill part's tokens,
text and logprobs, as ``EngineClient``'s do.

Per-replica stats for ``/metrics`` come from polling the deployment's
``stats`` method (the router spreads these polls over the replicas).

Pinned prefixes: Ray's handle cannot address every replica, so each
stats poll carries this ingress's pins (its ``PinRegistry``: the desired
state) and the polled replica pins what it lacks and drops what is no
longer there (``PinReconciler``); a replica started later, by Ray's
restarts or its autoscaler, is pinned at its first poll. A pin call
returns once every replica this ingress knows reports the pin held. The
ingress deployment runs one replica: a second ingress would hold pins of
its own, and the replicas would follow whichever polled last.

``/carpool/policy``'s routing section (policy, replicas, decisions with
causes, as the local fleet shows it) comes from ``self.router``: a
carpool ``Router`` that never chooses. Ray's request router runs inside
Ray's handle (its own object, maybe its own event loop), so rather than
reach into it, each decision travels with its request to the replica and
back in ``Accepted`` (``wire.Routed``), and is logged here on the
ingress's loop; the replicas' polled stats fill in the views.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from carpool.cluster.failover import MAX_ATTEMPTS
from carpool.cluster.router import Router
from carpool.cluster.view import ReplicaView, RouteDecision, RouteRequest
from carpool.config import EngineConfig
from carpool.engine.client import output_of, refusal_error
from carpool.engine.front import RequestIntake
from carpool.engine.outputs import TokenLogprob
from carpool.engine.pins import PinFailed, PinFront, PinRegistry
from carpool.engine.stats import EngineStats, merge_stats
from carpool.engine.step_log import StepLog
from carpool.engine.streams import EngineDeadError, RequestStream
from carpool.engine.wire import Add, Handoff
from carpool.fleet.local import routing_report
from carpool.ray_serve.wire import (
    Accepted,
    Failed,
    Refused,
    RouteHint,
    StatsReply,
    stats_decoder,
    stream_decoder,
)
from carpool.sampling_params import SamplingParams
from carpool.scheduler.kv_events import BlockKeyChain
from carpool.scheduler.pinned_prefixes import PinSpec

log = logging.getLogger("carpool.server")

STATS_POLL_S = 0.25  # between two stats polls (each answered by the next replica)
STATS_TIMEOUT_S = 5.0
STALE_S = 10.0  # a replica not heard of for this long has left (scaled in, died)
PIN_TIMEOUT_S = 120.0  # for every replica to report a new pin held


@dataclass
class LiveRequest:
    """A request's cumulative fields, as ``EngineClient`` keeps them, and
    what resends it: its ``Add``, its routing hint, the replicas tried."""

    prompt: list[int]
    ids: list[int]
    add: Add
    hint: RouteHint
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    attempts: int = 0
    accepted: bool = False

    @property
    def started(self) -> bool:
        return len(self.ids) > len(self.prompt)

    def resumed_add(self) -> Add:
        """As ``client.LiveRequest.resumed_add``: after the tokens the caller got."""
        if not self.started:
            return self.add
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return msgspec.structs.replace(self.add, handoff=Handoff(
            "resume", self.ids[len(self.prompt):], logprobs))


class RayEngine(PinFront, RequestIntake):
    """The engine deployment as one engine (see the module docstring)."""

    def __init__(self, handle, config: EngineConfig, first: StatsReply,
                 routing: str = "predicted-ttft") -> None:
        from carpool.model.tokenizer import Tokenizer

        self.handle = handle
        self.config = config
        self.info = first.info
        self.tokenizer = Tokenizer.from_description(first.info.tokenizer)
        self.step_log = StepLog()  # the replicas keep their own steps
        self.on_failure = None
        self.last_progress = time.monotonic()
        self._replicas: dict[str, tuple[float, EngineStats]] = {}
        self._pids: dict[str, int] = {}  # replica -> its process (its stats replies say)
        # The routing as this ingress saw it, in the local fleet's form (its
        # /carpool/policy section): a Router that never chooses, only told
        # the decisions Ray's request router made (returned by the replicas
        # with Accepted) and the replicas' polled stats.
        self.router = Router(routing)
        self.scaler = None  # the autoscaler runs in Ray's controller
        self.restarts = 0  # Ray Serve restarts replicas
        # Requests whose replica died, sent again before any output reached
        # the caller, or resumed after what did (``_pump``).
        self.rerouted = self.resumed = 0
        self._last_stats = first.stats
        self._record(first)
        self._chain = BlockKeyChain(config.cache.block_size,
                                    bytes.fromhex(config.cache.block_hash_key))
        self._encoder = msgspec.msgpack.Encoder()
        self._live: dict[str, asyncio.Task] = {}
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self.pins = PinRegistry()  # sent with every stats poll (module docstring)
        self._poller = asyncio.ensure_future(self._poll())

    @classmethod
    async def connect(cls, handle, config: EngineConfig,
                      routing: str = "predicted-ttft") -> "RayEngine":
        """Ask one replica what the engine is (its ``StatsReply``);
        ``routing``: the request router's policy (named in /carpool/policy)."""
        reply = stats_decoder.decode(await handle.stats.remote())
        return cls(handle, config, reply, routing)

    # -- AsyncEngine's interface ---------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The replicas' latest snapshots merged (the last merge while none answers)."""
        if self._replicas:
            self._last_stats = merge_stats([s for _, s in self._replicas.values()])
        return dataclasses.replace(self._last_stats, requests_rerouted=self.rerouted,
                                   requests_resumed=self.resumed)

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each replica's latest snapshot (``/metrics``' ``replica`` label)."""
        return {name: stats for name, (_, stats) in self._replicas.items()}

    @property
    def is_alive(self) -> bool:
        return not self._stopping

    @property
    def degraded(self) -> str | None:
        return None  # Ray Serve restarts replicas and routes around them

    @property
    def num_in_flight(self) -> int:
        return len(self._live)

    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          session_id: str | None = None, deadline: float | None = None,
                          max_wait: float | None = None, cache_salt: str | None = None,
                          received_at: float | None = None, handoff: Handoff | None = None,
                          delivered_text: str = "") -> RequestStream:
        """As ``AsyncEngine.add_request``, on the replica carpool's router picks.
        ``handoff``: a P/D part (``wire.Handoff``); a decode part's outputs
        count its prefill part's tokens, ``delivered_text`` and logprobs."""
        request_id, ids, params = self._intake(prompt, params, request_id, self._live)
        full_blocks = len(ids) // self.config.cache.block_size
        _, hashes = self._chain.keys(self._chain.root(cache_salt), ids, 0, full_blocks)
        waited = time.monotonic() - received_at if received_at is not None else 0.0
        add = Add(request_id, ids, params, priority, session_id, deadline, max_wait, cache_salt,
                  handoff=handoff)
        hint = RouteHint(request_id, len(ids), hashes, session_id, priority, max(0.0, waited))
        queue: asyncio.Queue = asyncio.Queue()
        live = LiveRequest(ids, list(ids), add, hint,
                           logprobs=[] if params.logprobs is not None else None)
        if handoff is not None and handoff.output_token_ids:  # a decode part goes on from them
            live.ids += handoff.output_token_ids
            live.text_parts.append(delivered_text)
            if live.logprobs is not None:
                live.logprobs += handoff.logprobs or ()
        self._live[request_id] = asyncio.ensure_future(self._pump(request_id, queue, live))
        try:
            accepted = await queue.get()  # None, or why it was refused
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(accepted, BaseException):
            raise accepted
        return RequestStream(self, request_id, queue)

    async def run_pin(self, spec: PinSpec) -> None:
        """Wait until every replica known reports ``spec`` held: the stats
        polls carry it to them (module docstring)."""
        deadline = time.monotonic() + PIN_TIMEOUT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(STATS_POLL_S)
            replicas = [stats for _, stats in self._replicas.values()]
            if replicas and all(any(p.pin_id == spec.pin_id and p.blocks for p in s.pinned)
                                for s in replicas):
                return
        raise PinFailed(f"the engine replicas did not report the pin held in "
                        f"{PIN_TIMEOUT_S:.0f} s")

    def drop_pin(self, pin_id: str) -> None:
        """The next polls carry the pins without it: each replica drops it."""

    def abort(self, request_id: str) -> None:
        """Cancel the request's stream: its replica aborts it."""
        task = self._live.get(request_id)
        if task is not None:
            task.cancel()

    def abort_without_lock(self, request_id: str) -> None:
        """``abort`` from any thread (a finalizer): done on the event loop."""
        try:
            self._loop.call_soon_threadsafe(self.abort, request_id)
        except RuntimeError:
            pass  # the loop is closed: the streams are gone with it

    def drop_handoff(self, ids: Sequence[int], cache_salt: str | None, parts_key: int,
                     replica_id: str | None = None) -> bool:
        """P/D's front drop of untaken handoff parts: not on Ray Serve (its
        replicas take no such order), where the decode part's own drops and
        the store's TTL remove them."""
        return False

    def first_token_seen(self, first_token_time: float) -> None:
        """Each replica measures its own delivery lag (its clock, its loop)."""

    def shutdown(self) -> None:
        self._stopping = True
        self._poller.cancel()
        for task in list(self._live.values()):
            task.cancel()

    async def wait_closed(self, timeout: float = 10.0) -> None:
        self.shutdown()
        await asyncio.wait([self._poller, *self._live.values()], timeout=timeout)

    # -- streams and stats ----------------------------------------------------------------

    async def _pump(self, request_id: str, queue: asyncio.Queue, live: LiveRequest) -> None:
        """The replica's events onto ``queue``: None when accepted, then
        outputs; an exception ends it (refused, or no replica left to try).
        A replica that dies (or fails) with the request sends it again to
        another, after what reached the caller (``LiveRequest.resumed_add``),
        up to ``MAX_ATTEMPTS`` replicas in all."""
        try:
            while True:
                live.attempts += 1
                if live.attempts > 1:  # after what reached the caller
                    live.add = live.resumed_add()
                add = live.add
                stream = self.handle.generate.options(stream=True).remote(
                    self._encoder.encode(add), self._encoder.encode(live.hint))
                try:
                    lost = await self._relay(request_id, stream, queue, live)
                except asyncio.CancelledError:
                    stream.cancel()  # reaches the replica: its generator is cancelled
                    raise
                if lost is None:
                    return
                stream.cancel()  # a replica that still holds it (not dead) lets it go
                self.router.finished(request_id, time.monotonic(), learn=False)  # routed anew
                if self._stopping or live.attempts >= MAX_ATTEMPTS:
                    more = ("" if self._stopping else
                            f" (tried on {MAX_ATTEMPTS} replicas: no more attempts)")
                    queue.put_nowait(EngineDeadError(f"{lost}{more}"))
                    return
                log.warning("request %s: %s; sending it to another replica", request_id, lost)
                if live.started:
                    self.resumed += 1
                else:
                    self.rerouted += 1
        finally:
            self._live.pop(request_id, None)
            self.router.finished(request_id, time.monotonic(), learn=False)

    async def _relay(self, request_id: str, stream, queue: asyncio.Queue,  # noqa: ANN001
                     live: LiveRequest) -> str | None:
        """One replica's events onto ``queue``; None when the request ended
        there (finished or refused), else why that replica lost it."""
        try:
            async for data in stream:
                event = stream_decoder.decode(data)
                if isinstance(event, Accepted):
                    self._accepted(request_id, len(live.prompt), event)
                    if not live.accepted:  # the caller saw one acceptance already
                        live.accepted = True
                        queue.put_nowait(None)
                elif isinstance(event, Refused):
                    queue.put_nowait(refusal_error(event.refusal))
                    return None
                elif isinstance(event, Failed):  # its engine loop failed
                    return f"the engine replica failed: {event.error}"
                else:
                    for delta in event.deltas:
                        queue.put_nowait(output_of(delta, live))
                        if delta.finished:
                            return None
            return "the engine replica ended the stream early"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Ray's errors: the replica died, ...
            log.error("request %s failed on its engine replica: %s", request_id, exc)
            return f"the engine replica failed: {type(exc).__name__}"

    def _accepted(self, request_id: str, prompt_tokens: int, event: Accepted) -> None:
        """Log where the request went and why (the router's own cause, unless
        Ray sent it to another replica than chosen: the choice was full)."""
        self._view(event.replica)
        routed = event.routed
        if routed is None:
            decision = RouteDecision(event.replica, "not routed by carpool's router")
        elif routed.replica != event.replica:
            decision = RouteDecision(event.replica, f"fallback: chosen {routed.replica} full")
        else:
            decision = RouteDecision(routed.replica, routed.cause, routed.cached_tokens,
                                     routed.predicted_ttft)
        self.router.assign(RouteRequest(request_id, prompt_tokens), decision, time.monotonic())

    def views(self) -> list[ReplicaView]:
        """The replicas as this ingress has seen them."""
        return list(self.router.views.values())

    def routing(self) -> dict:
        return routing_report(self.router, self.views(), self.replica_pid, None, self.restarts,
                              self.rerouted, self.resumed)

    def replica_pid(self, name: str) -> int | None:
        """The process of replica ``name`` as its latest stats reply said."""
        return self._pids.get(name) or None

    def _view(self, name: str) -> None:
        if name not in self.router.views:
            self.router.add_replica(ReplicaView(name))

    def _record(self, reply: StatsReply) -> None:
        now = time.monotonic()
        self._replicas[reply.replica] = (now, reply.stats)
        self._pids[reply.replica] = reply.pid
        self.last_progress = now
        stats = reply.stats
        self._view(reply.replica)
        self.router.update_stats(reply.replica, now, waiting=stats.num_waiting,
                                 running=stats.num_running, kv_usage=stats.kv_usage,
                                 free_blocks=stats.kv_num_blocks - stats.kv_used_blocks)
        for name, (seen, _) in list(self._replicas.items()):
            if now - seen > STALE_S:
                del self._replicas[name]
                self._pids.pop(name, None)
                self.router.remove_replica(name)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(STATS_POLL_S)
            try:
                reply = await asyncio.wait_for(self._ask_stats(), STATS_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next poll asks again
                log.warning("polling the engine replicas' stats failed: %s", exc)
                continue
            self._record(reply)

    async def _ask_stats(self) -> StatsReply:
        pins = self._encoder.encode(list(self.pins.specs.values()))
        return stats_decoder.decode(await self.handle.stats.remote(pins))
