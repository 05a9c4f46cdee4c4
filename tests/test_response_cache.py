"""The emergency switch's last step: identical deterministic requests of one
tenant answered from a bounded, expiring cache (issue 42)."""
from __future__ import annotations

from carpool.sampling_params import SamplingParams
from carpool.server.response_cache import ResponseCache, cache_key, is_deterministic

GREEDY = [SamplingParams(max_tokens=4, temperature=0.0)]


def _body(text: str) -> dict:
    return {"id": "cmpl-old", "created": 1, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}


def test_only_greedy_or_seeded_calls_are_deterministic():
    assert is_deterministic(GREEDY)
    assert is_deterministic([SamplingParams(temperature=0.8, seed=7)])
    assert not is_deterministic([SamplingParams(temperature=0.8)])
    assert not is_deterministic([*GREEDY, SamplingParams(temperature=0.8)])


def test_keys_separate_tenants_routes_prompts_parameters_and_n():
    base = cache_key("alice", "completions", [[1, 2, 3]], GREEDY, 1)
    assert base == cache_key("alice", "completions", [[1, 2, 3]], GREEDY, 1)
    others = {cache_key("bob", "completions", [[1, 2, 3]], GREEDY, 1),
              cache_key("alice", "chat", [[1, 2, 3]], GREEDY, 1),
              cache_key("alice", "completions", [[1, 2, 4]], GREEDY, 1),
              cache_key("alice", "completions", [[1, 2, 3]],
                        [SamplingParams(max_tokens=5, temperature=0.0)], 1),
              cache_key("alice", "completions", [[1, 2, 3]], GREEDY, 2)}
    assert base not in others and len(others) == 5


def test_a_hit_is_a_copy_under_a_new_id_and_entries_expire():
    now = [0.0]
    cache = ResponseCache(max_entries=8, max_bytes=10_000, ttl=10.0, clock=lambda: now[0])
    cache.put("k", _body("hello"))
    hit = cache.get("k", "cmpl-new")
    assert hit["id"] == "cmpl-new" and hit["created"] > 1 and hit["choices"][0]["text"] == "hello"
    hit["choices"][0]["text"] = "changed"  # the caller's copy: the stored one stays
    assert cache.get("k", "x")["choices"][0]["text"] == "hello"
    assert (cache.hits, cache.misses) == (2, 0)
    now[0] = 10.5
    assert cache.get("k", "y") is None and len(cache) == 0 and cache.misses == 1


def test_entries_and_bytes_are_bounded_least_recently_used_first():
    cache = ResponseCache(max_entries=2, max_bytes=10_000, ttl=60.0)
    for key in "abc":
        cache.put(key, _body(key))
    assert len(cache) == 2 and cache.get("a", "i") is None  # a was the oldest
    cache.get("b", "i")  # b used: c is now the least recent
    cache.put("d", _body("d"))
    assert cache.get("c", "i") is None and cache.get("b", "i") is not None
    small = ResponseCache(max_entries=100, max_bytes=300, ttl=60.0)
    for i in range(10):
        small.put(str(i), _body("x" * 50))
    assert 0 < len(small) < 10 and small._bytes <= 300
    small.put("huge", _body("x" * 1000))  # larger than the bound: never stored
    assert small.get("huge", "i") is None
    assert len(ResponseCache(0, 10_000, 60.0).__dict__["_entries"]) == 0


def test_at_the_last_step_of_degrade_a_repeat_is_answered_from_the_cache(tiny_model_dir):
    """A live server whose emergency switch trips on one waiting request
    (queue threshold 1, 0.1 s sustain): while a long request holds the only
    slot and another waits, the switch goes to its last step, and a repeat of
    a greedy request answered before is served from the cache (a new id, the
    same text, counted on /metrics) at once, not behind the two long ones."""
    import re
    import time

    from server_utils import ServerProcess

    flags = [str(tiny_model_dir), "--attention-backend", "torch", "--kv-cache-memory", "16MiB",
             "--max-num-seqs", "1", "--max-queue-requests", "10", "--emergency-switch", "true",
             "--emergency-queue-share", "0.1", "--emergency-sustain", "0.1",
             "--emergency-host-cpu", "1.0"]
    body = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0}
    with ServerProcess(flags) as server, server.client() as c:
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert c.get("/carpool/policy").json()["admission"]["emergency"] == "normal"
        long = {"prompt": "a long story", "max_tokens": 450, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=long) as holder, \
                c.stream("POST", "/v1/completions", json=long) as waiter:
            lines = holder.iter_lines()
            next(lines)  # it runs; the other waits: the queue is at its threshold
            deadline = time.monotonic() + 10.0
            while (c.get("/carpool/policy").json()["admission"]["emergency"]
                   != "response_cache" and time.monotonic() < deadline):
                time.sleep(0.02)
            assert c.get("/carpool/policy").json()["admission"]["emergency"] == "response_cache"
            again = c.post("/v1/completions", json=body)
            for _ in lines:
                pass
            for _ in waiter.iter_lines():
                pass
        assert again.status_code == 200, again.text
        assert again.json()["id"] != first.json()["id"]
        assert again.json()["choices"] == first.json()["choices"]
        metrics = c.get("/metrics").text
        hits = re.search(r'^carpool:response_cache_hits_total\{[^}]*endpoint="completions"'
                         r'[^}]*\} (\S+)$', metrics, re.M)
        assert hits and float(hits.group(1)) == 1.0, metrics[-2000:]
