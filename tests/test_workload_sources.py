"""Where traces come from: the packaged excerpts, the search order, and
``carpool traces download`` against a local HTTP server on 127.0.0.1."""
from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest

from carpool.cli import main
from carpool.workload import command, traces
from carpool.workload.command import add_workload_args, workload_spec
from carpool.workload.download import TraceDownloadError, Upstream, download_traces
from carpool.workload.spec import plan_workload
from carpool.workload.traces import (
    EXCERPTS_DIR,
    TRACE_FILES,
    TraceRequest,
    excerpt_note,
    excerpt_path,
    load_trace,
    resolve_trace,
)

LENGTHS = b"num_prefill_tokens,num_decode_tokens\n5,6\n7,8\n"


@pytest.fixture
def no_whole_traces(monkeypatch, tmp_path):
    """As on a bare clone: no $CARPOOL_TRACES, an empty cache, no ../shared."""
    monkeypatch.delenv("CARPOOL_TRACES", raising=False)
    monkeypatch.setattr(traces, "trace_dirs", lambda: [tmp_path / "cache" / "traces"])


@pytest.fixture
def file_server(tmp_path):
    """A static HTTP server on 127.0.0.1 over ``tmp_path / 'www'``; yields
    (base url, the folder, the list of paths requested)."""
    root = tmp_path / "www"
    root.mkdir()
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            requested.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root, requested
    finally:
        server.shutdown()
        server.server_close()


def _publish(root: Path, content: bytes, repo="someone/traces", commit="c" * 40,
             path="data/lengths.csv") -> Upstream:
    """Serve ``content`` as repo@commit:path; the Upstream entry pinning it."""
    target = root / repo / commit / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    return Upstream(repo, commit, path, hashlib.sha256(content).hexdigest(), len(content),
                    "MIT", "vidur_LICENSE")


@pytest.mark.parametrize("name", sorted(TRACE_FILES))
def test_every_trace_has_a_licensed_excerpt(name):
    path = excerpt_path(name)
    manifest = json.loads((EXCERPTS_DIR / "manifest.json").read_text())[name]
    requests = load_trace(path)
    assert len(requests) == manifest["rows"] >= 400
    assert manifest["of"] > manifest["rows"]
    if manifest["span_s"]:
        assert requests[0].arrival == 0.0 and requests[-1].arrival < manifest["span_s"]
    assert path.stat().st_size < 100_000
    from carpool.workload.download import UPSTREAM

    assert manifest["source_sha256"] == UPSTREAM[name].sha256
    assert (EXCERPTS_DIR / "licenses" / UPSTREAM[name].licence_file).stat().st_size > 500
    assert UPSTREAM[name].path.split("/")[-1] in (EXCERPTS_DIR / "README.md").read_text()
    assert traces.trace_attribution(path) == TRACE_FILES[name][2]


@pytest.mark.parametrize("name", sorted(TRACE_FILES))
def test_excerpts_are_the_first_rows_of_the_whole_traces(name):
    whole = resolve_trace(name)
    if excerpt_note(whole):
        pytest.skip(f"needs the whole {name} trace (carpool traces download {name})")
    excerpt = load_trace(excerpt_path(name))
    assert excerpt == load_trace(whole)[:len(excerpt)]


def test_a_bare_install_replays_the_excerpt(no_whole_traces):
    assert resolve_trace("azure-conv") == excerpt_path("azure-conv")
    assert load_trace("azure-conv")[0] == TraceRequest(0.0, 374, 44)
    note = excerpt_note(resolve_trace("azure-conv"))
    assert "first 900 s" in note and "carpool traces download azure-conv" in note
    import argparse

    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    plan = plan_workload(workload_spec(parser.parse_args(
        ["--workload", "mooncake-conv", "--arrival", "trace", "--num-requests", "20"])))
    assert len(plan) == 20
    too_far = parser.parse_args(["--workload", "azure-code", "--trace-start", "1000",
                                 "--num-requests", "10"])
    with pytest.raises(ValueError, match="carpool traces download azure-code"):
        plan_workload(workload_spec(too_far))


def test_the_cache_comes_before_the_shared_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("CARPOOL_TRACES", raising=False)
    monkeypatch.setenv("CARPOOL_CACHE", str(tmp_path))
    dirs = traces.trace_dirs()
    assert dirs[0] == tmp_path / "traces"
    assert dirs[1:] and all(d.name == "traces" and d.parent.name == "shared" for d in dirs[1:])
    relative = TRACE_FILES["sharegpt"][0]
    (tmp_path / "traces" / relative).parent.mkdir(parents=True)
    (tmp_path / "traces" / relative).write_bytes(LENGTHS)
    assert resolve_trace("sharegpt") == tmp_path / "traces" / relative
    assert load_trace("sharegpt") == [TraceRequest(None, 5, 6), TraceRequest(None, 7, 8)]


def test_download_checks_and_keeps_the_pinned_file(file_server, tmp_path):
    base, root, requested = file_server
    good = _publish(root, LENGTHS)
    dest = tmp_path / "dest"
    [path] = download_traces(["sharegpt"], dest, base, progress=False,
                             upstream={"sharegpt": good})
    assert path == dest / TRACE_FILES["sharegpt"][0] and path.read_bytes() == LENGTHS
    assert (dest / "licenses" / "vidur_LICENSE").is_file()
    download_traces(["sharegpt"], dest, base, progress=False, upstream={"sharegpt": good})
    assert len(requested) == 1  # already there with the pinned sha256: not fetched again
    download_traces(["sharegpt"], dest, base, force=True, progress=False,
                    upstream={"sharegpt": good})
    assert len(requested) == 2


@pytest.mark.parametrize("case", ["tampered", "longer", "missing", "no server"])
def test_a_bad_download_leaves_nothing_behind(file_server, tmp_path, case):
    base, root, _ = file_server
    pinned = _publish(root, LENGTHS)
    if case == "tampered":
        _publish(root, LENGTHS.replace(b"5,6", b"9,9"))
    elif case == "longer":
        _publish(root, LENGTHS + b"1,1\n")
    elif case == "missing":
        pinned = Upstream(pinned.repo, pinned.commit, "data/gone.csv", pinned.sha256,
                          pinned.size, "MIT", "vidur_LICENSE")
    else:
        base = "http://127.0.0.1:9"  # discard port: nothing listens
    dest = tmp_path / "dest"
    message = {"tampered": "not the pinned", "longer": "larger than the pinned",
               "missing": "HTTP 404", "no server": "failed"}[case]
    with pytest.raises(TraceDownloadError, match=message):
        download_traces(["sharegpt"], dest, base, progress=False, upstream={"sharegpt": pinned},
                        timeout=5)
    leftovers = [p for p in dest.rglob("*") if p.is_file()] if dest.exists() else []
    assert leftovers == []


def test_traces_download_command(file_server, tmp_path, monkeypatch, capsys):
    base, root, _ = file_server
    monkeypatch.setattr(command, "UPSTREAM", {"sharegpt": _publish(root, LENGTHS)})
    dest = tmp_path / "mine"
    argv = ["traces", "download", "sharegpt", "--dir", str(dest), "--base-url", base,
            "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "licence MIT" in out and "attribution:" in out and f"CARPOOL_TRACES={dest}" in out
    monkeypatch.setenv("CARPOOL_TRACES", str(dest))
    assert load_trace("sharegpt") == [TraceRequest(None, 5, 6), TraceRequest(None, 7, 8)]
    assert main(["traces", "download", "no-such-trace", "--dir", str(dest)]) == 2
    assert "unknown trace 'no-such-trace'" in capsys.readouterr().err
    monkeypatch.setattr(command, "UPSTREAM", {"sharegpt": Upstream(
        "someone/traces", "c" * 40, "data/lengths.csv", "0" * 64, len(LENGTHS), "MIT",
        "vidur_LICENSE")})
    assert main(argv + ["--force"]) == 1
    assert "not the pinned" in capsys.readouterr().err


def test_traces_list_names_every_trace(capsys, no_whole_traces):
    assert main(["traces", "list"]) == 0
    out = capsys.readouterr().out
    for name in TRACE_FILES:
        assert name in out and str(excerpt_path(name)) in out
