"""Configuration layering and the ``carpool`` command line."""
from __future__ import annotations

import subprocess
import sys

import pytest

from carpool.cli import build_parser, engine_config_from_args
from carpool.config import EngineConfig, parse_size


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "carpool.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_cli_overrides_file_overrides_defaults(tmp_path):
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("scheduler: {max_num_seqs: 3, policy: priority}\n"
                           "cache: {block_size: 32}\nmax_num_batched_tokens: 99\n")
    args = build_parser().parse_args(
        ["generate", "hi", "--config", str(config_file), "--max-num-seqs", "7"])
    config = engine_config_from_args(args)
    assert config.scheduler.max_num_seqs == 7  # flag beats file
    assert config.scheduler.policy == "priority"  # file beats default
    assert config.cache.block_size == 32
    assert config.scheduler.max_num_batched_tokens == 99  # flat keys work too
    assert config.cache.kv_cache_memory == EngineConfig().cache.kv_cache_memory


def test_bad_config_values_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        EngineConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_dict({"block_size": 12}).validate()
    with pytest.raises(ValueError, match="policy"):
        EngineConfig.from_dict({"policy": "random"}).validate()
    assert parse_size("1GiB") == 2**30 and parse_size("512MB") == 512 * 10**6
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")


def test_missing_model_is_one_clear_line(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.gguf" in lines[0], result.stderr


def test_generate_and_chat_on_tiny_model(tiny_model_dir):
    result = run_cli("generate", "The quick brown fox", "--model", str(tiny_model_dir),
                     "--max-tokens", "8", "--raw")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    chat = run_cli("chat", "--model", str(tiny_model_dir), "--max-tokens", "4",
                   stdin="hello\n/reset\nagain\n")
    assert chat.returncode == 0, chat.stderr
    # two replies, one line each (prompts are shown only on a terminal)
    assert chat.stdout.count("\n") >= 2, chat.stdout


@pytest.mark.real_model
def test_generate_on_the_default_model(real_model_path):
    result = run_cli("generate", "What is the capital of France?", "--model",
                     str(real_model_path), "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_bench_throughput_runs_both_sides(tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli("bench", "throughput", "--model", str(tiny_model_dir), "--num-requests", "6",
                     "--input-len", "12", "--output-len", "5", "--hf-batch-sizes", "1,4",
                     "--hf-dtypes", "float32", "--hf-batches", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(out.read_text())
    systems = [r["system"] for r in report["results"]]
    assert systems == ["carpool (continuous)", "HF static b=1 float32", "HF static b=4 float32"]
    ours = report["results"][0]
    assert ours["requests"] == 6 and ours["output_tokens"] == 30 and ours["prompt_tokens"] == 72
    assert report["results"][2]["output_tokens"] == 4 * 5
    assert "carpool vs best static batching" in result.stdout


def test_bench_regimes_replays_one_workload_under_each_regime(tiny_model_dir, tmp_path):
    out = tmp_path / "regimes.json"
    result = run_cli("bench", "regimes", "--model", str(tiny_model_dir), "--attention-backend",
                     "torch", "--num-requests", "8", "--input-len", "12", "--output-len", "5",
                     "--rate", "40", "--preferred-batch-size", "3", "--max-wait", "0.02",
                     "--json", str(out))
    assert result.returncode == 0, result.stderr
    import json

    rows = json.loads(out.read_text())["results"]
    assert [r["regime"] for r in rows] == ["static", "dynamic", "continuous", "adaptive"]
    for row in rows:
        assert row["rejected_share"] == 0 and 0 < row["fill_rate"] <= 1.0
        assert row["requests"] == 8 and row["output_tokens"] == 8 * 5
        assert row["output_tok_s"] > 0 and row["ttft_p50"] <= row["e2e_p50"]
    assert [r["padding"] for r in rows] == ["right", "right", "none", "none"]
    assert rows[2]["fill_rate"] == rows[3]["fill_rate"] == 1.0  # continuous never pads
    assert rows[0]["batches"] >= 3 and rows[2]["batches"] == 0
    assert "continuous" in result.stdout


def test_bench_regimes_finds_the_peak_rate_under_an_slo(tiny_model_dir, tmp_path):
    out = tmp_path / "regimes.json"
    common = ["bench", "regimes", "--model", str(tiny_model_dir), "--attention-backend", "torch",
              "--num-requests", "6", "--input-len", "12", "--output-len", "4",
              "--regimes", "continuous"]
    result = run_cli(*common, "--rates", "20,40", "--slo", "e2e=60s", "--json", str(out))
    assert result.returncode == 0, result.stderr
    import json

    row = json.loads(out.read_text())["results"][0]
    assert sorted(float(r) for r in row["rates"]) == [20.0, 40.0]
    assert row["peak_rate_under_slo"] == 40.0  # a minute per request is met at both rates
    assert row["slo_attainment"] == 1.0 and row["ttft_mean"] <= row["e2e_mean"]
    assert "peak rate under SLO" in result.stdout
    missing_slo = run_cli(*common, "--rates", "20")
    assert missing_slo.returncode == 2 and "give --slo too" in missing_slo.stderr


def test_every_config_field_has_a_flag():
    """A setting without a flag can only be set from a file; a new field must
    come with its flag (bucket_tolerance, predictive_shedding, transition_steps,
    hysteresis_ticks, shed_on_ttft_target and seven server limits had none)."""
    import dataclasses

    from carpool.cli_flags import ENGINE_FLAGS, SERVER_FLAGS
    from carpool.config import (
        CacheConfig,
        ControllerConfig,
        ModelSettings,
        SchedulerConfig,
    )
    from carpool.server.config import ServerConfig

    # Secrets come from files and the environment only (a flag shows in ps).
    engine = {flag.key for flag in ENGINE_FLAGS} | set(CacheConfig.SECRET_FIELDS)
    server = {flag.key for flag in SERVER_FLAGS} | {"cors_origins", "allowed_hosts"}  # nargs
    for section in (ModelSettings, CacheConfig, SchedulerConfig, ControllerConfig):
        missing = [f.name for f in dataclasses.fields(section) if f.name not in engine]
        assert not missing, (section.__name__, missing)
    missing = [f.name for f in dataclasses.fields(ServerConfig) if f.name not in server]
    assert not missing, missing
    args = build_parser().parse_args(["serve", "--hysteresis-ticks", "3", "--predictive-shedding",
                                      "false", "--bucket-tolerance", "0.2", "--max-stop", "4",
                                      "--enforce-eager", "--cuda-graph-sizes", "1,8"])
    config = engine_config_from_args(args)
    assert config.model.enforce_eager and config.model.cuda_graph_sizes == "1,8"
    assert config.controller.hysteresis_ticks == 3 and config.scheduler.bucket_tolerance == 0.2
    assert config.scheduler.predictive_shedding is False
    assert args.server_max_stop == 4
    with pytest.raises(SystemExit):  # a misspelt boolean is an error, not a silent false
        build_parser().parse_args(["serve", "--predictive-shedding", "ture"])


def test_vllm_spellings(monkeypatch):
    """vLLM's spellings of the same settings (issue 21, item 4, in part)."""
    from carpool import __version__
    from carpool.server.config import ServerConfig

    done = subprocess.run([sys.executable, "-m", "carpool.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"carpool {__version__}"
    for given, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        args = build_parser().parse_args(["serve", "--dtype", given])
        assert engine_config_from_args(args).validate().model.dtype == dtype
    for flags, enabled in ((["--enable-prefix-caching"], True),
                           (["--no-enable-prefix-caching"], False),
                           (["--no-prefix-caching"], False), ([], True)):
        args = build_parser().parse_args(["serve", *flags])
        assert engine_config_from_args(args).cache.enable_prefix_caching is enabled
    monkeypatch.delenv("CARPOOL_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    config = ServerConfig()
    config.resolve_api_key()
    assert config.api_key == "from-vllm"
    monkeypatch.setenv("CARPOOL_API_KEY", "ours")
    config = ServerConfig()
    config.resolve_api_key()
    assert config.api_key == "ours"  # carpool's own variable wins


def test_a_bad_value_is_one_line_and_uvicorn_log_level_is_checked():
    done = subprocess.run([sys.executable, "-m", "carpool.cli", "serve", "--max-num-seqs", "abc"],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--max-num-seqs" in lines[0] and "'abc'" in lines[0] and "--help" in lines[0]
    from carpool.cli import server_config_from_args

    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "info"])
    assert server_config_from_args(args).validate().uvicorn_log_level == "info"
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "loud"])
    with pytest.raises(ValueError, match="uvicorn_log_level"):
        server_config_from_args(args).validate()


def test_prefill_and_decode_flags_are_checked():
    from carpool.cli import server_config_from_args
    from carpool.server.config import ServerConfig

    args = build_parser().parse_args(["serve", "--prefill", "2", "--decode", "3"])
    config = server_config_from_args(args).validate()
    assert (config.prefill, config.decode) == (2, 3)
    ServerConfig(prefill=1, decode=1, backend="ray").validate()  # Ray pools too
    for bad in ({"prefill": 1}, {"decode": 2}, {"prefill": -1, "decode": 1},
                {"prefill": 1, "decode": 1, "replicas": 2},
                {"prefill": 1, "decode": 1, "autoscale": "reactive"},
                {"prefill": 1, "decode": 1, "engine_process": False}):
        with pytest.raises(ValueError, match="prefill"):
            ServerConfig(**bad).validate()


def test_the_autoscaler_s_sizing_flags_reach_its_config():
    from carpool.cli import server_config_from_args
    from carpool.server.config import ServerConfig

    args = build_parser().parse_args([
        "serve", "--autoscale", "predictive", "--min-replicas", "0", "--max-replicas", "3",
        "--scale-target-utilization", "0.85", "--replica-concurrency", "24",
        "--forecast-horizon", "600", "--startup-s", "120", "--replica-start-delay", "5"])
    server = server_config_from_args(args).validate()
    scaling = server.autoscale_config()
    assert (scaling.min_replicas, scaling.max_replicas) == (0, 3)
    assert (scaling.target_utilization, scaling.replica_concurrency) == (0.85, 24)
    assert (scaling.forecast_horizon_s, scaling.startup_s) == (600, 120)
    assert server.replica_start_delay == 5
    for bad, words in (({"scale_target_utilization": 1.5}, "target_utilization"),
                       ({"replica_concurrency": 0}, "replica_concurrency"),
                       ({"replica_start_delay": -1}, "replica_start_delay"),
                       ({"min_replicas": 0, "backend": "ray"}, "scale to zero")):
        with pytest.raises(ValueError, match=words):
            ServerConfig(autoscale="reactive", **bad).validate()
