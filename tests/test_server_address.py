"""``carpool serve`` on an address it cannot listen on: one clear line and
exit code 2 before any model is loaded (issue 21, item 1)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from carpool.server.launcher import address_problem


def test_a_busy_port_is_named_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "another server is listening" in address_problem("127.0.0.1", port)
        started = time.monotonic()
        # A model path that does not exist: were it loaded first, that would be the error.
        done = subprocess.run([sys.executable, "-m", "carpool.cli", "serve", "--model",
                               str(tmp_path / "no-such-model"), "--host", "127.0.0.1",
                               "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], done.stderr
    assert "loading the model" not in done.stderr
    assert time.monotonic() - started < 30


def test_free_ports_are_free():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert address_problem("127.0.0.1", port) is None
    assert address_problem("127.0.0.1", 0) is None
