"""Tensor parallelism (carpool/parallel): a model cut over 2 processes
(gloo on 127.0.0.1) says what the whole model says alone, token for token
and log-probability for log-probability, in fp32 on the CPU: dense Llama
(KV heads split), fewer KV heads than ranks (replicated), Qwen3's q/k
norms, Mixtral's experts, DeepSeek-V3's latent attention and shared
experts; and a config that cannot be cut is refused with what does not divide."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.model.config import ModelConfig
from carpool.parallel.shard import local_config, tensor_parallel_problem
from tests.arch_models import save_random_model

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "llama-gqa": ("llama", {}),
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek-v3": ("deepseek_v3", {
        "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(model_dir: Path, size: int, steps: int = 5, dtype: str = "float32",
              micro_batches: str = "off", expert_parallel: bool = False,
              capacity: float = 0.0) -> dict:
    """Every rank of a ``size``-way run as its own process; rank 0's JSON."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.tp_rank", "--model-dir", str(model_dir), "--rank",
         str(rank), "--size", str(size), "--port", str(port), "--steps", str(steps),
         "--dtype", dtype, "--micro-batches", micro_batches, "--expert-parallel",
         str(int(expert_parallel)), "--capacity", str(capacity)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in range(size)]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads(out) for out, _ in outputs]
    return {**results[0], "ranks": results}


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for name, (model_type, extra) in FAMILIES.items():
        path = tmp_path_factory.mktemp(name)
        save_random_model(path, tiny_model_dir, model_type, extra, seed=3)
        dirs[name] = path
    return dirs


def _same(result: dict, reference: dict) -> None:
    assert result["tokens"] == reference["tokens"]
    for mine, theirs in zip(result["logprobs"], reference["logprobs"]):
        assert mine == pytest.approx(theirs, abs=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_say_what_one_process_says(family, family_dirs):
    """Two ranks with their steps in two micro-batches (auto's choice under
    tensor parallelism) against the whole model in one batch."""
    alone = run_ranks(family_dirs[family], 1)
    split = run_ranks(family_dirs[family], 2, micro_batches="auto")
    # The ranks hold halves (a KV head shared by both when there is one).
    assert split["heads"] * 2 == alone["heads"]
    assert split["vocab_rows"] == -(-alone["vocab_rows"] // 2)
    assert split["kv_pool_heads"] == max(1, alone["kv_pool_heads"] // 2)
    _same(split, alone)


@pytest.mark.parametrize("family", ["llama-gqa", "mixtral"])
def test_micro_batches_change_no_output_alone_or_split(family, family_dirs):
    """One batch per step on two ranks, two micro-batches in one process:
    the same tokens as the whole model in one batch."""
    alone = run_ranks(family_dirs[family], 1)
    _same(run_ranks(family_dirs[family], 2, micro_batches="off"), alone)
    _same(run_ranks(family_dirs[family], 1, micro_batches="on"), alone)


def test_a_config_that_does_not_divide_is_refused_naming_what(family_dirs):
    config = ModelConfig.from_hf_config(
        json.loads((family_dirs["llama-gqa"] / "config.json").read_text()))
    assert tensor_parallel_problem(config, 2) is None
    local = local_config(config, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    assert local_config(config, 4).num_kv_heads == 1  # 2 KV heads over 4 ranks: replicated
    problem = tensor_parallel_problem(config, 3)
    assert "4 attention heads" in problem and "2 KV heads" in problem
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        local_config(config, 3)


def _followers(worker_pid: int) -> list[int]:
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(child) for child in children
            if "carpool.executor.tp_follower" in Path(f"/proc/{child}/cmdline").read_text()]


def test_carpool_serve_with_two_ranks_answers_as_one_process_and_stops_them(tiny_model_dir):
    """The official client against `carpool serve --tensor-parallel-size 2`:
    the completions one process gives; a graceful stop ends the follower."""
    import openai

    from carpool import LLM, SamplingParams
    from tests.server_utils import ServerProcess

    prompts = ["The quick brown fox", "def add(a, b):", "café 😀"]
    with LLM(str(tiny_model_dir), dtype="float32", num_blocks=64) as alone:
        expected = [out.text for out in alone.generate(
            prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]
    flags = [str(tiny_model_dir), "--tensor-parallel-size", "2", "--dtype", "float32",
             "--num-blocks", "64"]
    with ServerProcess(flags) as server:
        (worker,) = server.engine_workers()
        (follower,) = _followers(worker)
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        got = [api.completions.create(model=str(tiny_model_dir), prompt=prompt, max_tokens=10,
                                      temperature=0.0, extra_body={"ignore_eos": True}
                                      ).choices[0].text for prompt in prompts]
        assert got == expected
        assert "1 engine replica serves" in server.text()  # the serving line's neighbour
        server.signal()
        assert server.wait(60) == 0, server.text()
    assert not Path(f"/proc/{follower}").exists() or \
        "zombie" in Path(f"/proc/{follower}/status").read_text().lower()


@pytest.mark.parametrize("family", ["mixtral", "deepseek-v3"])
def test_experts_spread_whole_over_two_ranks_say_what_one_process_says(family, family_dirs):
    """--enable-expert-parallel: each rank 2 of the 4 experts, every pick
    sent to its expert's rank and back; with micro-batches too."""
    alone = run_ranks(family_dirs[family], 1)
    spread = run_ranks(family_dirs[family], 2, expert_parallel=True)
    _same(spread, alone)
    assert sum(spread["expert_rows"]) > 0 and sum(spread["dropped"]) == 0
    _same(run_ranks(family_dirs[family], 2, micro_batches="on", expert_parallel=True), alone)


def test_a_capacity_drops_the_rows_past_it_and_counts_them(family_dirs):
    """The first MoE layer of the first step sees the same picks either way:
    each is computed or counted as dropped (the layers after see other
    inputs once rows were dropped)."""
    bounded = run_ranks(family_dirs["mixtral"], 2, steps=1, expert_parallel=True, capacity=0.25)
    unbounded = run_ranks(family_dirs["mixtral"], 2, steps=1, expert_parallel=True)
    assert bounded["dropped"][0] > 0 and unbounded["dropped"] == [0] * len(unbounded["dropped"])
    assert bounded["expert_rows"][0] + bounded["dropped"][0] == unbounded["expert_rows"][0]
    # Rank 0 knows every rank's drops (what /metrics shows): each rank's own count.
    for layer, seen_by_first in enumerate(bounded["rank_dropped"]):
        assert seen_by_first == [rank["dropped"][layer] for rank in bounded["ranks"]]
    assert unbounded["rank_dropped"] == [[0, 0]] * len(unbounded["rank_dropped"])


def test_each_ranks_expert_load_is_on_metrics(family_dirs):
    """`carpool serve --tensor-parallel-size 2 --enable-expert-parallel`: the
    ranks' loads on /metrics add up to the experts' tokens."""
    import re

    from tests.server_utils import ServerProcess

    model = str(family_dirs["mixtral"])
    flags = [model, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--dtype",
             "float32", "--num-blocks", "64", "--expert-capacity-factor", "0.5"]
    with ServerProcess(flags) as server, server.client() as http:
        reply = http.post("/v1/completions", json={"model": model, "prompt": "hello there",
                                                   "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        text = http.get("/metrics").text

    def counts(name: str, label: str) -> dict[str, float]:
        pattern = rf'^carpool:{name}_total{{.*{label}="(\d+)".*}} ([0-9.e+]+)$'
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}

    ranks, experts = counts("moe_rank_tokens", "rank"), counts("moe_expert_tokens", "expert")
    assert set(ranks) == {"0", "1"} and len(experts) == 4
    assert sum(ranks.values()) == sum(experts.values()) > 0
    assert ranks["0"] == experts["0"] + experts["1"]
    dropped = counts("moe_rank_dropped", "rank")  # a capacity of half the fair share
    assert set(dropped) == {"0", "1"} and sum(dropped.values()) > 0
