"""What crosses Ray Serve's handles and stats channels: msgspec bytes only.

The ingress sends an engine replica ``carpool.engine.wire.Add`` and a
``RouteHint`` (what the request router reads); the replica streams back
``StreamEvent``s (acceptance or refusal first, then the outputs' deltas);
it reports ``ReplicaReport`` as its routing stats and answers ``stats``
polls with ``StatsReply``. Every struct is encoded by msgspec (MessagePack),
typed on both ends: no pickle of carpool objects, whatever Ray does with
the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from carpool.config import EngineConfig
from carpool.engine.stats import EngineStats
from carpool.engine.wire import Delta, EngineInfo, Refusal
from carpool.server.config import ServerConfig

# The key of the routing-stats dict a replica reports (its value: ReplicaReport bytes).
REPORT_KEY = "carpool"


class RouteHint(msgspec.Struct, array_like=True):
    """What the request router needs of a request, computed by the ingress:
    its prompt's chained block hashes (the fleet secret's), its session and
    priority; ``waited_s``: seconds since the HTTP request came (the
    replica's admission counts them, on its own clock)."""

    request_id: str
    prompt_tokens: int
    block_hashes: list[int] = []
    session_id: str | None = None
    priority: int = 0
    waited_s: float = 0.0


class Routed(msgspec.Struct, array_like=True):
    """The request router's decision (``carpool.cluster.view.RouteDecision``'s
    fields), sent with the request to the replica, which returns it in
    ``Accepted``: how the ingress learns why its request went where it did."""

    replica: str
    cause: str
    cached_tokens: int = 0
    predicted_ttft: float | None = None


class Accepted(msgspec.Struct, tag=True, array_like=True):
    """The replica's engine took the request; ``replica``: which one;
    ``routed``: the router's decision, when a carpool router chose."""

    replica: str
    routed: Routed | None = None


class Refused(msgspec.Struct, tag=True, array_like=True):
    refusal: Refusal


class Outputs(msgspec.Struct, tag=True, array_like=True):
    """The request's deltas since the previous event (the last one finished):
    every output that was waiting when the replica sent the previous event,
    so a slow hop never queues one stream item per token."""

    deltas: list[Delta]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The replica's engine died or shut down under the request."""

    error: str


StreamEvent = Accepted | Refused | Outputs | Failed
stream_decoder = msgspec.msgpack.Decoder(StreamEvent)
# The keyword argument of the replica's ``generate`` the request router sets (``Routed`` bytes).
ROUTED_KWARG = "routed"


class ReplicaReport(msgspec.Struct, array_like=True):
    """A replica as the router's ``ReplicaView`` needs it: the polled half
    (waiting, running, KV), its engine limits, every block hash its prefix
    cache holds (a full snapshot: the stats channel may drop or repeat
    reports, so deltas would drift) and its recent steps' costs."""

    replica: str
    waiting: int
    running: int
    kv_usage: float
    free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    held: list[int] = []
    steps: list[tuple[int, int, float]] = []  # (tokens, seqs, seconds), oldest first
    waiting_tokens: int = 0  # prompt tokens waiting (every ingress's requests)


report_decoder = msgspec.msgpack.Decoder(ReplicaReport)


class StatsReply(msgspec.Struct, array_like=True):
    """A replica's stats snapshot, for the ingress's ``/metrics``."""

    replica: str
    stats: EngineStats
    info: EngineInfo
    pid: int = 0  # the replica's process (for /carpool/policy)


stats_decoder = msgspec.msgpack.Decoder(StatsReply)


@dataclass
class AppSettings:
    """Everything both deployments are built from (sent as msgspec bytes)."""

    engine: EngineConfig
    server: ServerConfig
    model_name: str
    slo_sources: dict[str, str] = field(default_factory=dict)
    replica_cpus: float = 1.0  # Ray CPUs each engine replica reserves
    ingress_cpus: float = 0.0

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "AppSettings":
        return msgspec.msgpack.decode(data, type=AppSettings)
