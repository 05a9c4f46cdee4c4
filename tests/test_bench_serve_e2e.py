"""``carpool bench serve`` / ``sweep`` / ``compare`` end to end against a live
``carpool serve`` (real default model, 127.0.0.1), with a queue small
enough that a burst gets some 429s."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from server_utils import ServerProcess

pytestmark = pytest.mark.real_model

OUTPUT_CAP = 8


@pytest.fixture(scope="module")
def server(real_model_path):
    # Plain batching: the sweep's capacity is judged by its own loose SLO, which
    # a server shedding what misses its (tighter) targets would not reach.
    with ServerProcess([str(real_model_path), "--max-num-seqs", "4", "--max-queue-requests", "2",
                        "--kv-cache-memory", "256MiB", "--adaptive", "false"]) as proc:
        yield proc


def _bench(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "carpool.cli", "bench", *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _prefix_hits(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^carpool:prefix_cache_hits_total\{[^}]*\} (\S+)$", text,
                           re.MULTILINE).group(1))


def test_bench_serve_replays_mooncake_and_writes_json_and_html(server, tmp_path):
    hits_before = _prefix_hits(server)
    out = tmp_path / "serve.json"
    _bench("serve", "--base-url", server.url + "/v1", "--workload", "mooncake-conv",
           "--token-scale", "0.0625", "--max-output-len", str(OUTPUT_CAP), "--arrival",
           "constant", "--rate", "8", "--num-requests", "16", "--slo", "ttft=30s",
           "--label", "carpool e2e", "--json", str(out), "--html", str(tmp_path / "html"))
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert result["kind"] == "bench-serve" and result["label"] == "carpool e2e"
    workload = result["config"]["workload"]
    assert workload["token_scale"] == 0.0625 and workload["name"] == "mooncake-conv"
    assert summary["requests"] == 16 and summary["failed"] == 0
    assert summary["completed"] + summary["rejected"] == 16
    # At least one running and the two the queue holds; up to 4 run at once, but
    # on a slow CPU arrivals during a long first step find the queue full first.
    assert summary["completed"] >= 3
    # 16 requests in 2 s against 4 running + 2 queued: the rest are turned away
    assert summary["rejected"] >= 1 and set(summary["rejected_by_reason"]) == {"http_429"}
    refused = [r for r in result["requests"] if r["status"] == "rejected"]
    assert all('"code":"queue_full"' in r["error"].replace(" ", "") for r in refused), refused
    done = [r for r in result["requests"] if r["status"] == "ok"]
    for request in done:
        # exact prompt lengths on the server's tokenizer; ignore_eos: every token generated
        assert request["server_input_tokens"] == request["input_tokens"]
        assert request["output_tokens"] <= OUTPUT_CAP
        assert 0 < request["ttft"] <= request["e2e"]
        assert 0 <= request["cached_tokens"] < request["server_input_tokens"]
    assert summary["ttft"]["p50"] > 0 and summary["e2e"]["p99"] >= summary["ttft"]["p99"]
    assert summary["slo_attainment"] is not None and summary["peak_concurrency"] >= 2
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in done)
    assert summary["cache_reported"] == len(done)  # carpool's usage says what it cached
    # requests sharing leading hash ids share leading prompt text: the server reuses it
    assert _prefix_hits(server) > hits_before
    html = (tmp_path / "html" / "report.html").read_text()
    for png in ("latency_cdf.png", "timeseries.png"):
        assert f'src="{png}"' in html
        assert (tmp_path / "html" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "x0.0625" in html


def test_bench_sweep_and_compare(server, tmp_path):
    sweep = tmp_path / "sweep.json"
    printed = _bench("sweep", "--base-url", server.url + "/v1", "--num-requests", "6",
                     "--input-len", "32", "--output-len", "4", "--sync-requests", "2",
                     "--steps", "1", "--slo", "ttft=30s", "--no-progress",
                     "--json", str(sweep), "--html", str(tmp_path / "sweep")).stdout
    result = json.loads(sweep.read_text())
    assert [r["mode"] for r in result["runs"]] == ["synchronous", "throughput", "rate"]
    sync, top, middle = (r["rate"] for r in result["runs"])
    assert sync < middle < top
    assert result["capacity_rps"] == pytest.approx(middle)  # a 30 s TTFT limit is met
    assert "capacity:" in printed
    assert (tmp_path / "sweep" / "latency_vs_rate.png").is_file()
    serve = tmp_path / "serve.json"
    _bench("serve", "--base-url", server.url + "/v1", "--num-requests", "4", "--input-len",
           "32", "--output-len", "4", "--rate", "4", "--no-progress", "--json", str(serve))
    table = _bench("compare", str(serve), str(sweep), "--html", str(tmp_path / "cmp")).stdout
    assert "B/A" in table
    assert (tmp_path / "cmp" / "compare.html").is_file()


def test_bench_serve_records_the_prefix_cache_hits_of_a_repeated_prefix(server, tmp_path):
    # Three requests 1 s apart whose prompts share their first four Mooncake
    # blocks (ids no other test uses): x1/16 makes a block 32 tokens, a
    # prompt 160 tokens, 128 of them shared, then a tail of its own.
    trace = tmp_path / "repeated.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 2560,
                                         "output_length": 64,
                                         "hash_ids": [9100, 9101, 9102, 9103]}) + "\n"
                             for i in range(3)))
    out = tmp_path / "repeated.json"
    _bench("serve", "--base-url", server.url + "/v1", "--workload", str(trace),
           "--token-scale", "0.0625", "--arrival", "trace", "--num-requests", "3",
           "--no-progress", "--json", str(out))
    result = json.loads(out.read_text())
    requests = result["requests"]
    assert [r["status"] for r in requests] == ["ok"] * 3
    assert [r["server_input_tokens"] for r in requests] == [160] * 3
    # The first computes the prefix; the others find its 8 full 16-token blocks.
    assert [r["cached_tokens"] for r in requests] == [0, 128, 128]
    summary = result["summary"]
    assert summary["cached_tokens"] == 256
    assert summary["prefix_hit_rate"] == pytest.approx(256 / 480)
    printed = _bench("compare", str(out), str(out)).stdout
    assert next(line for line in printed.splitlines()
                if line.startswith("prefix hit %")).split()[3:5] == ["53.3", "53.3"]
