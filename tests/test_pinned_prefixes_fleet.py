"""``carpool serve --replicas 2``: a pinned prefix reaches both replicas,
each serves it from its cache, /metrics sums their hits, and a replica
restarted after a crash holds the pin again (issue 42 item 4)."""
from __future__ import annotations

import os
import signal
import time

from server_utils import ServerProcess

PREFIX = [5 + (7 * k) % 380 for k in range(64)]  # 4 blocks of 16


def _listed(http) -> dict:
    [pin] = http.get("/carpool/prefixes").json()["prefixes"]
    return pin


def _wait(read, done, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return value


def test_a_pin_reaches_every_replica_and_a_restarted_one(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), "--attention-backend", "torch", "--adaptive",
                        "false", "--replicas", "2", "--routing", "round-robin",
                        "--served-model-name", "tiny"]) as server, server.client() as http:
        pinned = http.post("/carpool/prefixes", json={"prompt_token_ids": PREFIX,
                                                      "name": "snippet"})
        assert pinned.status_code == 201, pinned.text
        assert pinned.json()["blocks"] == 4
        # Every replica holds it (the listing sums the replicas' reports).
        assert _wait(lambda: _listed(http)["held_blocks"], lambda b: b == 8) == 8
        # Round robin: one request on each replica, each a hit of its own copy.
        for tail in (1, 2):
            reply = http.post("/v1/completions", json={"prompt": PREFIX + [tail, 3],
                                                       "max_tokens": 1})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        replicas = {d["replica"] for d in http.get("/carpool/policy").json()["routing"]
                    ["decisions"][-2:]}
        assert replicas == {"r0", "r1"}
        series = 'carpool:pinned_prefix_hits_total{model_name="tiny",prefix="snippet"}'

        def hits() -> float:
            lines = http.get("/metrics").text.splitlines()
            return next((float(line.split()[-1]) for line in lines
                         if line.startswith(series)), 0.0)

        assert _wait(hits, lambda h: h == 2.0, 10.0) == 2.0
        # A replica that crashes comes back holding the pin.
        pids = {v["replica"]: v["pid"] for v in http.get("/carpool/policy").json()
                ["routing"]["replicas"]}
        os.kill(pids["r1"], signal.SIGKILL)
        assert _wait(lambda: http.get("/carpool/policy").json()["routing"]["restarts"],
                     lambda n: n == 1) == 1
        assert _wait(lambda: _listed(http)["held_blocks"], lambda b: b == 8) == 8
        assert http.delete(f"/carpool/prefixes/{pinned.json()['id']}").status_code == 200
        assert _wait(lambda: http.get("/carpool/prefixes").json()["prefixes"],
                     lambda p: p == [], 5.0) == []
        assert _wait(hits, lambda h: h == 0.0, 10.0) == 0.0  # the series is gone
