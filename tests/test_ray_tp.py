"""A sliced replica on Ray Serve (issue 46, item 5): ``tensor_parallel_size``
2 makes each engine replica one placement group of two bundles on one
node, rank 0 the Serve replica and rank 1 an actor in the second bundle
(carpool/ray_serve/tp_followers.py); the application answers what one
process answers, and its end leaves no rank actor alive."""
from __future__ import annotations

import time

import httpx
import ray
from ray import serve

from carpool import LLM, SamplingParams
from tests.ray_helpers import serving

PROMPTS = ["The quick brown fox", "def add(a, b):"]


def _rank_actors() -> list[dict]:
    return [actor for actor in ray.state.actors().values()
            if actor["ActorClassName"].endswith("RankActor")]


def test_a_sliced_replica_is_one_placement_group_of_one_actor_per_rank(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", num_blocks=64) as alone:
        expected = [out.text for out in alone.generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    with serving("carpool-tp", {
            "model": str(tiny_model_dir), "dtype": "float32", "num-blocks": 64,
            "attention-backend": "torch", "served-model-name": "tiny", "replicas": 1,
            "tensor-parallel-size": 2, "replica_cpus": 1.0, "ingress_cpus": 0.25}) as url:
        got = [httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()["choices"][0]["text"] for prompt in PROMPTS]
        assert got == expected
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] == "CREATED" and len(g["bundles"]) == 2]
        assert len(groups) == 1 and groups[0]["strategy"] == "STRICT_PACK"
        assert [b["CPU"] for b in groups[0]["bundles"].values()] == [0.5, 0.5]
        alive = [a for a in _rank_actors() if a["State"] == "ALIVE"]
        assert len(alive) == 1
        # Both bundles' CPUs are taken: the replica's (rank 0), the rank actor's.
        group_id = groups[0]["placement_group_id"]
        total, free = ray.cluster_resources(), ray.available_resources()
        for bundle in (0, 1):
            assert total[f"CPU_group_{bundle}_{group_id}"] == 0.5
            assert free.get(f"CPU_group_{bundle}_{group_id}", 0.0) == 0.0
        serve.delete("carpool-tp")  # the replica ends, and its rank with it
        deadline = time.monotonic() + 60
        while any(a["State"] == "ALIVE" for a in _rank_actors()):
            assert time.monotonic() < deadline, _rank_actors()
            time.sleep(0.5)
