"""vLLM users' habits (issue 21, items 3, 4 and 6): --gpu-memory-utilization,
boolean flags as --x / --no-x, flat vLLM-style YAML, --help with defaults
and metavars, the model name as given, timestamped log lines."""
from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import pytest

from carpool.cli import build_parser, engine_config_from_args, server_config_from_args
from carpool.cli_flags import ENGINE_FLAGS, SERVER_FLAGS, flag_bool
from carpool.config import CacheConfig, EngineConfig, ModelSettings
from carpool.server.config import ServerConfig


def _serve(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    if args.model_path:
        args.engine_model = args.model_path
    return args


# -- --gpu-memory-utilization -------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, math.nan, True, "half"])
def test_gpu_memory_utilization_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=bad).validate()
    CacheConfig(gpu_memory_utilization=1.0).validate()
    CacheConfig(gpu_memory_utilization=0.05).validate()


def test_gpu_memory_utilization_layers_with_kv_cache_memory(tmp_path):
    config = engine_config_from_args(_serve("--gpu-memory-utilization", "0.8"))
    assert config.cache.gpu_memory_utilization == 0.8
    with pytest.raises(ValueError, match="both size the KV cache"):
        engine_config_from_args(_serve("--gpu-memory-utilization", "0.8",
                                       "--kv-cache-memory", "2GiB"))
    both = tmp_path / "both.yaml"
    both.write_text("gpu-memory-utilization: 0.5\ncache: {kv_cache_memory: 2GiB}\n")
    with pytest.raises(ValueError, match="both size the KV cache"):
        engine_config_from_args(_serve("--config", str(both)))
    # A higher layer's choice replaces a lower one's, either way round.
    util = tmp_path / "util.yaml"
    util.write_text("gpu_memory_utilization: 0.5\n")
    flag_wins = engine_config_from_args(_serve("--config", str(util),
                                               "--kv-cache-memory", "256MiB"))
    assert flag_wins.cache.gpu_memory_utilization is None
    assert flag_wins.cache.kv_cache_memory == "256MiB"
    # the throughput profile sets kv_cache_memory: 2GiB; the flag still sizes the pool
    profile = engine_config_from_args(_serve("--profile", "throughput",
                                             "--gpu-memory-utilization", "0.3"))
    assert profile.cache.gpu_memory_utilization == 0.3
    assert profile.cache.kv_cache_memory == "2GiB"  # kept, unused


def _pool_blocks(tiny_model_dir, **cache) -> int:
    from carpool.engine.llm_engine import LLMEngine

    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "attention_backend": "torch",
                                     "dtype": "float32", "device": "cpu", **cache})
    return LLMEngine.from_config(config.validate()).executor.num_blocks


def test_gpu_memory_utilization_sizes_the_pool_from_free_memory(tiny_model_dir, monkeypatch):
    from carpool.executor import torch_executor

    # tiny model: 2 layers x 2 KV heads x head_dim 16, K and V, fp32, 16 tokens a block
    per_block = 2 * 2 * 16 * 2 * 16 * 4
    assert per_block == 8192
    monkeypatch.setattr(torch_executor, "free_memory", lambda device: 100 * 2**20)
    assert _pool_blocks(tiny_model_dir, gpu_memory_utilization=0.25) == 25 * 2**20 // 8192
    assert _pool_blocks(tiny_model_dir, gpu_memory_utilization=1.0) == 100 * 2**20 // 8192
    # --num-blocks overrides both; without the fraction, kv_cache_memory sizes it
    assert _pool_blocks(tiny_model_dir, gpu_memory_utilization=0.25, num_blocks=7) == 7
    assert _pool_blocks(tiny_model_dir, kv_cache_memory="1MiB") == 2**20 // 8192
    monkeypatch.setattr(torch_executor, "free_memory", lambda device: 4096)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.5 of 0 MiB free holds "
                                         r"no KV block \(8192 bytes each\)"):
        _pool_blocks(tiny_model_dir, gpu_memory_utilization=0.5)


def test_free_memory_on_the_cpu_is_memavailable():
    import os

    import torch

    from carpool.executor.torch_executor import free_memory

    with open("/proc/meminfo", encoding="utf-8") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    free = free_memory(torch.device("cpu"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= total
    # the same figure, give or take what other processes did in between
    assert abs(free - fields["MemAvailable"]) < 0.25 * total


# -- boolean flags ------------------------------------------------------------------

BOOLEANS = [f for f in [*ENGINE_FLAGS, *SERVER_FLAGS] if f.kind in (bool, flag_bool)]


def _dest(flag) -> str:
    return ("server_" if flag in SERVER_FLAGS else "engine_") + flag.key


@pytest.mark.parametrize("flag", BOOLEANS, ids=lambda f: f.flag)
def test_every_boolean_has_its_no_form(flag):
    for name in (flag.flag, *flag.aliases):
        assert getattr(_serve(name), _dest(flag)) is True
        assert getattr(_serve("--no-" + name[2:]), _dest(flag)) is False
    assert getattr(_serve(), _dest(flag)) is None  # not given: the file or default decides
    if flag.kind is flag_bool:  # the value form keeps working
        assert getattr(_serve(flag.flag, "false"), _dest(flag)) is False
        assert getattr(_serve(f"{flag.flag}=off"), _dest(flag)) is False
        assert getattr(_serve(flag.flag, "true"), _dest(flag)) is True
        with pytest.raises(SystemExit):
            _serve(flag.flag, "ture")
    else:  # a switch never takes the model argument for its value
        args = _serve(flag.flag, "some/model")
        assert getattr(args, _dest(flag)) is True and args.model_path == "some/model"


def test_every_boolean_setting_is_a_boolean_flag():
    from carpool.config import ControllerConfig, SchedulerConfig

    sections = (ModelSettings, CacheConfig, SchedulerConfig, ControllerConfig, ServerConfig)
    # annotations are strings here (from __future__ import annotations)
    fields = {f.name for cls in sections for f in dataclasses.fields(cls)
              if f.type in ("bool", "bool | None")}
    assert fields == {f.key for f in BOOLEANS}
    config = engine_config_from_args(_serve("--no-enforce-eager", "--no-calibrate",
                                            "--enable-prefix-caching", "--adaptive"))
    assert config.model.enforce_eager is False and config.controller.calibrate is False
    assert config.cache.enable_prefix_caching is True and config.controller.adaptive is True
    server = server_config_from_args(_serve("--special-tokens-in-content"))
    assert server.special_tokens_in_content is True


# -- flat vLLM-style YAML -------------------------------------------------------------

VLLM_YAML = """\
model: some/model
max-num-seqs: 64
max_num_batched_tokens: 512
enable-prefix-caching: false
dtype: half
scheduling-policy: priority
ttft-target: 500ms
calibrate: "false"
port: 8001
served-model-name: x
uvicorn-log-level: info
cache: {block_size: 32}
server: {max_n: 4}
"""


def test_flat_vllm_yaml_sets_engine_and_server(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text(VLLM_YAML)
    args = _serve("--config", str(path), "--max-num-seqs", "8")
    engine = engine_config_from_args(args)
    assert engine.model.model == "some/model" and engine.model.dtype == "float16"
    assert engine.scheduler.max_num_seqs == 8  # the flag beats the file
    assert engine.scheduler.max_num_batched_tokens == 512 and engine.scheduler.policy == "priority"
    assert engine.cache.enable_prefix_caching is False and engine.cache.block_size == 32
    assert engine.controller.ttft_target == 0.5 and engine.controller.calibrate is False
    server = server_config_from_args(args)
    assert (server.port, server.served_model_name, server.max_n) == (8001, "x", 4)
    assert server.uvicorn_log_level == "info"
    assert server_config_from_args(_serve("--config", str(path), "--port", "9")).port == 9


def test_an_unknown_key_is_one_line_naming_it(tmp_path):
    path = tmp_path / "vllm.yaml"
    path.write_text("max-num-seqs: 4\npipeline-parallel-size: 2\n")
    with pytest.raises(ValueError, match="unknown config key 'pipeline-parallel-size'"):
        engine_config_from_args(_serve("--config", str(path)))
    done = subprocess.run([sys.executable, "-m", "carpool.cli", "generate", "hi", "--config",
                           str(path)], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "pipeline-parallel-size" in lines[0] and str(path) in lines[0]
    path.write_text("max-num-seqs: lots\n")
    with pytest.raises(ValueError, match="max-num-seqs"):
        engine_config_from_args(_serve("--config", str(path)))


# -- --help ---------------------------------------------------------------------------


def _help(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping to match across
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def test_help_shows_metavars_and_dataclass_defaults(capsys, monkeypatch):
    from carpool.cli_flags import engine_defaults, server_defaults

    text = _help(capsys, monkeypatch, "serve")
    assert "ENGINE_" not in text and "SERVER_" not in text
    assert text.startswith("usage: carpool serve [options] [MODEL]")
    lines: dict[str, str] = {}  # each flag's entry: its line and the help under it
    for line in text.splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            lines[name] = line
        elif line.startswith("    ") and lines:
            lines[name] += " " + line.strip()
    defaults = {**engine_defaults(), **server_defaults()}
    for flag in [*ENGINE_FLAGS, *SERVER_FLAGS]:
        line = lines[flag.flag]
        if flag.metavar:
            shown = f"[{flag.metavar}]" if flag.kind is flag_bool else flag.metavar
            assert f"{flag.flag} {shown}" in line
        default = defaults.get(flag.key)
        if default is not None and flag.key not in ("max_batch_tokens", "log_format"):
            shown = str(default).lower() if isinstance(default, bool) else f"{default:g}" \
                if isinstance(default, float) else str(default)
            assert f"(default: {shown})" in line, line
    assert "--max-num-seqs N " in text and f"(default: {EngineConfig().scheduler.max_num_seqs})" \
        in lines["--max-num-seqs"]
    assert "--dtype DTYPE" in text and "--kv-cache-memory SIZE" in text
    assert "--calibrate [BOOL], --no-calibrate" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "(default: %(asctime)s carpool: %(message)s)" in lines["--log-format"]
    generate = _help(capsys, monkeypatch, "generate")
    assert "--max-tokens N" in generate and "(default: 256)" in generate


def test_top_level_help_lists_every_command(capsys, monkeypatch):
    parser = build_parser()
    text = _help(capsys, monkeypatch)
    assert "``" not in text and ":class:" not in text
    commands = next(a for a in parser._actions if a.dest == "command").choices
    described = {line.split()[0] for line in text.split("commands:")[1].splitlines()
                 if line.startswith("  ") and not line.startswith("   ")}
    assert set(commands) <= described, set(commands) - described
    assert re.search(r"^  serve +OpenAI-compatible HTTP server", text, re.M)
    assert re.search(r"^  bench serve +replay a workload", text, re.M)


# -- the served name and the log lines ---------------------------------------------------


def test_served_name_is_the_model_argument_as_given():
    from carpool.server.launcher import model_name

    given = "./path/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_name(EngineConfig.from_dict({"model": given}), ServerConfig()) == given
    assert model_name(EngineConfig(), ServerConfig()) == "SmolLM2-135M-Instruct"
    assert model_name(EngineConfig.from_dict({"model": given}),
                      ServerConfig(served_model_name="mine")) == "mine"


def test_a_bad_log_format_is_refused():
    ServerConfig(log_format="[%(levelname)s] %(message)s").validate()
    for bad in ("no fields", "%(nope)s", "%(message"):
        with pytest.raises(ValueError, match="log_format"):
            ServerConfig(log_format=bad).validate()


STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d carpool: ", re.M)


def test_served_name_log_lines_and_pool_on_a_live_server(tiny_model_dir, tmp_path):
    """The tiny model served from a flat vLLM YAML (its port is overridden by
    the test's --port 0), under the path as typed; every status line stamped;
    the pool sized from the real MemAvailable."""
    from server_utils import ServerProcess

    settings = tmp_path / "serve.yaml"
    settings.write_text("attention-backend: torch\ndtype: float32\nadaptive: false\n"
                        "gpu-memory-utilization: 0.002\nstatus-interval: 0.2\nport: 1\n")
    with ServerProcess([str(tiny_model_dir), "--config", str(settings)],
                       startup_timeout=240) as server:
        with server.client() as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [str(tiny_model_dir)]
            reply = c.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 4,
                                                    "model": str(tiny_model_dir)}).json()
            assert reply["model"] == str(tiny_model_dir), reply
            assert server.wait_for_output("tok/s | busy", timeout=20), server.text()
    text = server.text()
    serving = re.search(r"^(\S+ \S+) carpool: serving '(.*)' on http://\S+ \(context \d+ tokens, "
                        r"KV cache (\d+) blocks, (\d+) bytes per token\)$", text, re.M)
    assert serving and serving.group(2) == str(tiny_model_dir), text
    assert int(serving.group(4)) == 2 * 2 * 2 * 16 * 4  # layers x K,V x KV heads x dim x fp32
    for needle in ("loading the model", "adaptive controller off", "running "):
        line = next(x for x in text.splitlines() if needle in x)
        assert STAMPED.match(line), line
    with open("/proc/meminfo", encoding="utf-8") as f:
        available = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable"))
    blocks = int(serving.group(3))
    expected = 0.002 * available / 8192  # fp32 tiny model: 8192 bytes a block
    assert 0.5 * expected < blocks < 2 * expected, (blocks, expected)
