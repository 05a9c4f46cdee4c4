"""``/carpool/prefixes`` (issue 42 item 4): an operator pins a system prompt,
which then serves its tenant's chats from the prefix cache after other
traffic cycled the whole pool, never another tenant's; /metrics counts the
hits per prefix; unpinning lets the blocks go. In process, on the tiny model."""
from __future__ import annotations

import asyncio
import time

import pytest
from server_utils import in_process_app
from starlette.testclient import TestClient

LOCAL = "http://127.0.0.1"
SYSTEM = ("You are a careful assistant. The quick brown fox jumps over the lazy dog. "
          "Continuous batching keeps the GPU busy while users get fast answers.")
OPS = {"Authorization": "Bearer sk-operator-0001"}
TENANT_A = {"Authorization": "Bearer sk-tenant-a-0001"}
TENANT_B = {"Authorization": "Bearer sk-tenant-b-0001"}


@pytest.fixture(scope="module")
def small_pool_engine(tiny_model_dir):
    """An ``AsyncEngine`` on the tiny model with a 40-block pool (640 tokens)."""
    from carpool.config import EngineConfig
    from carpool.engine.async_engine import AsyncEngine
    from carpool.engine.llm_engine import LLMEngine

    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                     "num_blocks": 40, "adaptive": False})
    engine = AsyncEngine(LLMEngine.from_config(config))
    yield engine
    engine.shutdown()


def _chat(client: TestClient, headers: dict, user: str) -> int:
    """The cached tokens of one chat turn under ``SYSTEM``."""
    reply = client.post("/v1/chat/completions", headers=headers, json={
        "max_tokens": 1, "messages": [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": user}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _flood(client: TestClient, headers: dict, tag: int) -> None:
    """Distinct 250-token prompts: twice the pool through the LRU."""
    for i in range(5):
        ids = [(tag * 37 + i * 11 + k) % 390 + 5 for k in range(250)]
        reply = client.post("/v1/completions", headers=headers,
                            json={"prompt": ids, "max_tokens": 1})
        assert reply.status_code == 200, reply.text


def _eventually(read, want, timeout: float = 5.0):
    """``read()`` once it equals ``want`` (engine stats are published snapshots)."""
    deadline = time.monotonic() + timeout
    while (value := read()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _metric(client: TestClient, series: str) -> float | None:
    for line in client.get("/metrics", headers=OPS).text.splitlines():
        if line.startswith(series):
            return float(line.split()[-1])
    return None


def test_an_operator_pins_a_system_prompt_for_one_tenant(small_pool_engine, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n"
                    "  - {key: sk-tenant-a-0001, tenant: a}\n"
                    "  - {key: sk-tenant-b-0001, tenant: b}\n"
                    "  - {key: sk-operator-0001, tenant: ops, operator: true}\n")
    app = in_process_app(small_pool_engine, api_keys=str(keys))
    body = {"messages": [{"role": "system", "content": SYSTEM}], "tenant": "a", "name": "sys-a"}
    with TestClient(app, base_url=LOCAL) as client:
        for method, path in (("POST", "/carpool/prefixes"), ("GET", "/carpool/prefixes"),
                             ("DELETE", "/carpool/prefixes/x")):
            denied = client.request(method, path, headers=TENANT_A, json=body)
            assert denied.status_code == 403 and denied.json()["error"]["code"] == "forbidden"
        pinned = client.post("/carpool/prefixes", headers=OPS, json=body)
        assert pinned.status_code == 201, pinned.text
        pin = pinned.json()
        assert pin["name"] == "sys-a" and pin["blocks"] == pin["tokens"] // 16 >= 4
        again = client.post("/carpool/prefixes", headers=OPS, json=body)
        assert again.status_code == 200 and again.json()["id"] == pin["id"]  # idempotent
        for wrong, status in (({**body, "name": "bad name"}, 400),
                              ({"prompt": "hi", "name": "short"}, 400),
                              ({"prompt_token_ids": [5 + k % 390 for k in range(600)]}, 413),
                              ({"prompt_token_ids": list(range(5, 40)), "name": "sys-a"}, 409)):
            assert client.post("/carpool/prefixes", headers=OPS, json=wrong).status_code \
                == status, wrong
        # Other traffic cycles the whole pool; the pinned blocks stay.
        _flood(client, TENANT_A, 1)
        assert _chat(client, TENANT_A, "hello") >= pin["blocks"] * 16
        assert _chat(client, TENANT_B, "hello") == 0  # another tenant's namespace
        listed = _eventually(lambda: client.get("/carpool/prefixes", headers=OPS).json()
                             ["prefixes"][0]["hits"], 1)
        assert listed == 1
        series = 'carpool:pinned_prefix_hits_total{model_name="tiny",prefix="sys-a"}'
        assert _eventually(lambda: _metric(client, series), 1.0) == 1.0
        tokens = _metric(client, 'carpool:pinned_prefix_hit_tokens_total{model_name="tiny",'
                                 'prefix="sys-a"}')
        assert tokens >= pin["blocks"] * 16
        assert _metric(client, "carpool:pinned_prefix_lookups_total") >= 2
        # Unpinned: gone from the list and /metrics, and the next flood evicts it.
        assert client.delete(f"/carpool/prefixes/{pin['id']}", headers=OPS).status_code == 200
        assert client.delete(f"/carpool/prefixes/{pin['id']}", headers=OPS).status_code == 404
        assert client.get("/carpool/prefixes", headers=OPS).json()["prefixes"] == []
        assert _eventually(lambda: _metric(client, series), None) is None
        _flood(client, TENANT_A, 2)
        assert _chat(client, TENANT_A, "hello") == 0
        spec = client.get("/openapi.json", headers=OPS).json()
        assert "409" in spec["paths"]["/carpool/prefixes"]["post"]["responses"]


def test_concurrent_pins_of_one_prefix_are_one_pin(small_pool_engine):
    from carpool.scheduler.pinned_prefixes import PinSpec, pin_id_of

    tokens = tuple(range(7, 7 + 48))
    spec = PinSpec(pin_id_of(tokens, "tenant:c"), "c", tokens, "tenant:c")

    async def both():
        return await asyncio.gather(small_pool_engine.pin_prefix(spec),
                                    small_pool_engine.pin_prefix(spec))

    results = asyncio.run(both())
    assert sorted(created for _, created in results) == [False, True]
    assert small_pool_engine.pinned_prefixes() == [spec]
    assert small_pool_engine.unpin_prefix(spec.pin_id)
    assert not small_pool_engine.unpin_prefix(spec.pin_id)


def test_a_ray_replica_follows_the_pins_its_polls_carry(small_pool_engine):
    """``PinReconciler``: what a Ray engine replica does with the ingress's
    pins on each stats poll (pin what is missing, drop what is gone)."""
    from carpool.engine.pins import PinReconciler
    from carpool.scheduler.pinned_prefixes import PinSpec, pin_id_of

    tokens = tuple(range(9, 9 + 40))
    spec = PinSpec(pin_id_of(tokens, None), "polled", tokens)

    def held() -> int:
        return sum(p.blocks for p in small_pool_engine.stats.pinned if p.pin_id == spec.pin_id)

    async def polls():
        reconciler = PinReconciler(small_pool_engine)
        reconciler.sync([spec])
        reconciler.sync([spec])  # the next poll while it runs: nothing twice
        for _ in range(100):
            await asyncio.sleep(0.05)
            if held():
                break
        pinned = held()
        reconciler.sync([])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not held():
                break
        return pinned, held()

    assert asyncio.run(polls()) == (2, 0)


def test_pd_serving_pins_in_both_pools_or_in_neither():
    from types import SimpleNamespace

    from carpool.fleet.pd import PDFleet
    from carpool.scheduler.pinned_prefixes import PinError, PinSpec

    class Pool:
        def __init__(self, fail: bool) -> None:
            self.fail, self.pins = fail, []

        async def pin_prefix(self, spec):
            if self.fail:
                raise PinError("full", "full")
            self.pins.append(spec.pin_id)
            return spec, True

        def unpin_prefix(self, pin_id):
            self.pins.remove(pin_id)
            return True

        def pinned_prefixes(self):
            return self.pins

    spec = PinSpec("p1", "p1", (1, 2, 3))
    for prefill_fails in (False, True):
        pools = Pool(prefill_fails), Pool(not prefill_fails)
        for pool in pools:
            pool.config = pool.info = pool.tokenizer = pool.step_log = SimpleNamespace()
        fleet = PDFleet(*pools)
        with pytest.raises(PinError):
            asyncio.run(fleet.pin_prefix(spec))
        assert pools[0].pins == pools[1].pins == []
    pools = Pool(False), Pool(False)
    for pool in pools:
        pool.config = pool.info = pool.tokenizer = pool.step_log = SimpleNamespace()
    fleet = PDFleet(*pools)
    assert asyncio.run(fleet.pin_prefix(spec)) == (spec, True)
    assert pools[0].pins == pools[1].pins == ["p1"]
    assert fleet.unpin_prefix("p1") and pools[1].pins == []
