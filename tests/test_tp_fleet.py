"""A sliced replica is one replica to the fleet (issue 46, item 5), live:
``carpool serve --replicas 2 --tensor-parallel-size 2`` routes over two
replicas of two processes each, and P/D serving with sliced replicas hands
each prompt's blocks from the prefill replica's ranks to the decode
replica's through the store; both answer what one process answers, and a
stop ends every rank."""
from __future__ import annotations

import time
from pathlib import Path

import openai

from carpool import LLM, SamplingParams
from tests.server_utils import ServerProcess
from tests.test_tensor_parallel import _followers

PROMPTS = [[(i * m + m) % 380 + 5 for i in range(n)] for m, n in ((41, 70), (43, 40), (47, 9))]


def _expected(model_dir: Path) -> list[str]:
    with LLM(str(model_dir), dtype="float32", num_blocks=64) as alone:
        return [out.text for out in alone.generate(
            PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]


def _answers(server: ServerProcess) -> list[str]:
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return [api.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0.0,
                                   extra_body={"ignore_eos": True}).choices[0].text
            for prompt in PROMPTS]


def _loaded(http) -> float:
    return sum(float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
               if line.startswith("carpool:kv_store_blocks_loaded_total{"))


def _stopped_with_its_ranks(server: ServerProcess) -> None:
    followers = [f for worker in server.engine_workers() for f in _followers(worker)]
    assert len(followers) == len(server.engine_workers())  # one follower per replica
    server.signal()
    assert server.wait(90) == 0, server.text()
    for pid in followers:
        assert not Path(f"/proc/{pid}").exists() or \
            "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_two_sliced_replicas_are_two_replicas_to_the_router(tiny_model_dir):
    expected = _expected(tiny_model_dir)
    flags = [str(tiny_model_dir), "--replicas", "2", "--tensor-parallel-size", "2", "--dtype",
             "float32", "--num-blocks", "64", "--served-model-name", "m", "--routing",
             "round-robin"]
    with ServerProcess(flags) as server, server.client() as http:
        assert len(server.engine_workers()) == 2
        assert _answers(server) == expected
        routing = http.get("/carpool/policy").json()["routing"]
        assert sorted(r["replica"] for r in routing["replicas"]) == ["r0", "r1"]
        _stopped_with_its_ranks(server)


def test_pd_between_sliced_replicas_hands_every_rank_s_blocks_over(tiny_model_dir):
    expected = _expected(tiny_model_dir)
    flags = [str(tiny_model_dir), "--prefill", "1", "--decode", "1", "--kv-store", "local",
             "--tensor-parallel-size", "2", "--dtype", "float32", "--num-blocks", "64",
             "--served-model-name", "m", "--attention-backend", "torch", "--adaptive", "false"]
    with ServerProcess(flags) as server, server.client() as http:
        assert _answers(server) == expected
        pd = http.get("/carpool/policy").json()["pd"]
        assert pd["handoffs"] == len(PROMPTS) and pd["colocated"] == 0
        blocks = sum(len(p) // 16 for p in PROMPTS)  # the decode replica loaded them all
        deadline = time.monotonic() + 10
        while (loaded := _loaded(http)) < blocks and time.monotonic() < deadline:
            time.sleep(0.2)  # replicas' stats are polled
        assert loaded == blocks
        _stopped_with_its_ranks(server)
