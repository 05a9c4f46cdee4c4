"""``carpool serve --backend ray`` as a user runs it: the CLI in a subprocess.

The command starts its own Ray (127.0.0.1, no dashboard), deploys the
application with two engine replicas on the tiny model, serves the
official ``openai`` client's streams through Ray Serve's proxy on a free
port, shows the routing decisions in ``/carpool/policy`` (as the local
fleet does), and on SIGTERM deletes the application and stops every Ray
process it started (its raylet, GCS server and workers).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
from server_utils import ServerProcess


def _descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid`` (pid -> its command name)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue  # the task ended meanwhile
            for child in map(int, children):
                try:
                    found[child] = Path(f"/proc/{child}/comm").read_text().strip()
                except OSError:
                    continue
                todo.append(child)
    return found


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited (its parent has not reaped it yet)
            alive.append(pid)
    return alive


def test_carpool_serve_backend_ray_streams_routes_and_stops_its_ray(tiny_model_dir):
    args = [str(tiny_model_dir), "--backend", "ray", "--replicas", "2",
            "--attention-backend", "torch", "--adaptive", "false",
            "--served-model-name", "tiny", "--shutdown-timeout", "5"]
    with ServerProcess(args, env={"RAY_USAGE_STATS_ENABLED": "0"},
                       startup_timeout=150) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                            timeout=60)
        for turn in range(3):  # one session: every turn on its home replica
            chunks = list(api.chat.completions.create(
                model="tiny", max_tokens=6, stream=True, temperature=0,
                messages=[{"role": "user", "content": f"turn {turn}"}],
                extra_headers={"x-session-id": "cli-session"}))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert [c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].finish_reason] == ["length"]
        with server.client(timeout=30) as http:
            routing = http.get("/carpool/policy").json()["routing"]
        assert routing["policy"] == "predicted-ttft"
        assert len(routing["replicas"]) == 2
        decisions = routing["decisions"]
        assert len(decisions) == 3 and len({d["replica"] for d in decisions}) == 1, decisions
        assert all(d["cause"] for d in decisions)
        assert decisions[-1]["cause"] == "session home", decisions
        assert sum(routing["causes"].values()) == 3
        ray_processes = _descendants(server.proc.pid)
        assert {"raylet", "gcs_server"} <= set(ray_processes.values()), ray_processes
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0, server.text()[-3000:]
    deadline = time.monotonic() + 20
    while _alive(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: ray_processes[pid] for pid in _alive(ray_processes)}
    assert not left, f"Ray processes left behind: {left}"
