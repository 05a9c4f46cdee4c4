"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests (``HF_ENDPOINT``).

It answers the routes ``huggingface_hub`` downloads through: the repo's
revision info (``/api/models/{repo}/revision/{rev}``, with its file list),
its file tree (``/api/models/{repo}/tree/{rev}``) and each file
(``HEAD``/``GET /{repo}/resolve/{rev}/{path}``, with the ``X-Repo-Commit``,
``ETag`` and ``Content-Length`` headers the client checks), and refuses
unknown or gated repos the way the Hub does (``X-Error-Code``).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_API = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/?]+)")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class FakeHub:
    """``with FakeHub({"owner/name": {"path/in/repo": b"bytes"}}) as hub:``
    -> ``hub.url``; ``hub.requests`` lists (method, path) as served;
    ``gated`` repos answer 403 GatedRepo."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = ()) -> None:
        self.repos, self.gated = repos, gated
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def from_dir(path: Path) -> dict[str, bytes]:
        """A repo's files: those of a local model directory."""
        return {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = request.path.split("?", 1)[0]
        self.requests.append((request.command, path))
        api, resolve = _API.match(path), _RESOLVE.match(path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo is None or repo not in self.repos:
            return _send(request, 404, b'{"error": "Repository not found"}', body,
                         {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        if repo in self.gated:
            return _send(request, 403, b'{"error": "gated"}', body,
                         {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is "
                          "restricted: you must accept its conditions"})
        files = self.repos[repo]
        if api and api.group(2) == "revision":
            info = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "gated": False,
                    "siblings": [{"rfilename": name} for name in sorted(files)]}
            return _send(request, 200, json.dumps(info).encode(), body)
        if api:
            tree = [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                    for name, data in sorted(files.items())]
            return _send(request, 200, json.dumps(tree).encode(), body)
        name = resolve.group(3)
        if name not in files:
            return _send(request, 404, b"not found", body, {"X-Error-Code": "EntryNotFound"})
        return _send(request, 200, files[name], body,
                     {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(files[name])}"'})


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _send(request: BaseHTTPRequestHandler, status: int, data: bytes, body: bool,
          headers: dict[str, str] | None = None) -> None:
    request.send_response(status)
    request.send_header("Content-Length", str(len(data)))
    request.send_header("Content-Type", "application/json" if data[:1] in b"[{" else
                        "application/octet-stream")
    for key, value in (headers or {}).items():
        request.send_header(key, value)
    request.end_headers()
    if body:
        request.wfile.write(data)
