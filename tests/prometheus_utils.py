"""A real Prometheus (Debian's ``prometheus`` package) on a free loopback
port, scraping a live server every second, for tests. Tests that use it
skip only when the binary is absent (``.ci/run`` installs it)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus on a free loopback port, storing in ``workdir``, scraping
    ``target`` (host:port) and evaluating ``rule_files`` every second;
    stopped on exit."""

    def __init__(self, target: str, workdir: Path, rule_files: tuple[Path, ...] = ()) -> None:
        self.target = target
        self.workdir = workdir
        self.rule_files = rule_files
        self.url = ""
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prometheus":
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path.resolve()) for path in self.rule_files],
            "scrape_configs": [{"job_name": "carpool", "scrape_interval": "1s",
                                "static_configs": [{"targets": [self.target]}]}]}))
        address = f"127.0.0.1:{free_port()}"
        self.url = f"http://{address}"
        self.log = (self.workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
             f"--web.listen-address={address}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_for(lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200,
                          30, "Prometheus to be ready")
        except BaseException:
            self.__exit__()  # never leave it running
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}: {self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        self.log.flush()
        return (self.workdir / "prometheus.log").read_text()[-2000:]

    def query(self, promql: str) -> list[float]:
        """The values of an instant query at the present moment."""
        reply = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = reply.json()
        assert body["status"] == "success", (promql, body)
        data = body["data"]
        if data["resultType"] == "scalar":
            return [float(data["result"][1])]
        return [float(item["value"][1]) for item in data["result"]]

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params = {"match[]": match} if match else {}
        reply = httpx.get(f"{self.url}/api/v1/label/{label}/values", params=params, timeout=10)
        return reply.json()["data"]

    def alerts(self) -> list[dict]:
        """The alerts pending or firing now (``/api/v1/alerts``)."""
        body = httpx.get(self.url + "/api/v1/alerts", timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["alerts"]

    def rule_groups(self) -> list[dict]:
        """The rule groups loaded (``/api/v1/rules``), with each rule's health."""
        body = httpx.get(self.url + "/api/v1/rules", timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["groups"]
