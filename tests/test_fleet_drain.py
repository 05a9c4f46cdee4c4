"""SIGTERM under load drains the whole fleet (issue 47, item 3): every
request the fleet accepted (running, or queued behind a full batch, on
every replica; under P/D between its two legs too) ends with its whole
answer, a request that comes during the drain is refused with 503, and
the server exits 0 with no worker left."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess

FLEETS = {
    "replicas": ["--replicas", "2", "--max-num-seqs", "2"],
    "pd": ["--prefill", "1", "--decode", "1", "--kv-store", "local", "--max-num-seqs", "2"],
}


@pytest.mark.parametrize("fleet", list(FLEETS))
def test_sigterm_under_load_finishes_everything_accepted(tiny_model_dir, fleet):
    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--adaptive", "false",
             "--served-model-name", "tiny", "--shutdown-timeout", "120", *FLEETS[fleet]]
    with ServerProcess(flags) as server, server.client() as http:
        workers = server.engine_workers()
        answers: list[httpx.Response] = []

        def ask(index: int) -> None:
            answers.append(httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": [index + 3] * (20 + index), "max_tokens": 120,
                "ignore_eos": True, "stream": index % 2 == 0}))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        # Signal once every request was accepted (most queue: 2 slots a
        # replica). Under P/D the first pair can finish its decode before the
        # last prompt reaches the decode replica, so answers already back
        # count as accepted; a request between its legs counts once it lands.
        deadline = time.monotonic() + 60
        while (in_flight := _in_flight(http)) + len(answers) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert in_flight >= 2, "the drain would have nothing left to finish"
        server.signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        for thread in threads:
            thread.join(300)
        assert late.status_code == 503
        assert len(answers) == 8 and all(a.status_code == 200 for a in answers)
        for answer in answers:
            if answer.headers["content-type"].startswith("text/event-stream"):
                assert answer.text.rstrip().endswith("data: [DONE]")
                assert '"finish_reason":"length"' in answer.text.replace(" ", "")
                assert '"error"' not in answer.text
            else:
                assert answer.json()["usage"]["completion_tokens"] == 120
        assert server.wait(120) == 0, server.text()
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists() or \
            "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def _in_flight(http: httpx.Client) -> int:
    metrics = http.get("/metrics").text
    return int(sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith(("carpool:num_requests_running{",
                                       "carpool:num_requests_waiting{"))))
