"""Run ``carpool serve`` in a subprocess on a free loopback port, for tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

_READY = re.compile(r"serving '.*' on (http://[0-9.]+:\d+)")


class ServerProcess:
    """``with ServerProcess([...flags]) as server:`` -> ``server.url``.

    Output is drained by threads (so pipes never fill) and kept in
    ``server.output`` for assertions and failure messages.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0) -> None:
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.output: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        self._new_line = threading.Condition()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "carpool.cli", "serve", *self.args,
               "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("carpool serve did not start:\n" + self.text())
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.output.append(line)
                self._new_line.notify_all()
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.url = match.group(1)
                self._ready.set()

    def text(self) -> str:
        return "".join(self.output)

    def wait_for_output(self, needle: str, timeout: float = 10.0) -> bool:
        """Whether ``needle`` shows up in the server's output within ``timeout``."""
        with self._new_line:
            return self._new_line.wait_for(lambda: needle in self.text(), timeout)

    def client(self, api_key: str | None = None, timeout: float = 120.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def engine_workers(self) -> list[int]:
        """Pids of this server's children that run an engine worker."""
        assert self.proc is not None
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(child) for child in children
                if "carpool.engine.worker" in Path(f"/proc/{child}/cmdline").read_text()]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def in_process_app(engine, **server_settings):
    """The ASGI app of ``carpool serve`` on an ``AsyncEngine``, for Starlette's
    TestClient (``server_settings``: ``ServerConfig`` fields)."""
    from carpool.server.app import build_app
    from carpool.server.config import ServerConfig
    from carpool.server.metrics import Metrics
    from carpool.server.serving import ServerContext

    config = ServerConfig(**server_settings).validate()
    metrics = Metrics("tiny", lambda: engine.stats)
    ctx = ServerContext(engine, engine.tokenizer, "tiny", engine.info.max_model_len,
                        config, metrics)
    return build_app(ctx)
