"""A first start does not wait for the C++ CPU kernels to compile: the engine
serves on the portable torch path while they build in the background, and
switches to them between two steps once they are built.

The kernels themselves are the real ones (built, or taken from the cache,
once: tests/test_attention.py needs them too); the build's progress is
played by the tests, so no test waits a minute for a compiler."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.model import cpu_kernels
from carpool.model.backends import select_backend
from carpool.model.cpu_kernels import kernel_build_dir, load_cpu_ops
from carpool.model.kernel_switch import SwitchingCpuAttention, SwitchingCpuOps
from carpool.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "def add(a, b):", "Numbers 12345 and", "Emoji and CJK"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def kernels():
    module = load_cpu_ops()
    assert module is not None, "the C++ kernels must build on the CI machine"
    return module


class FakeBuild:
    """A background build whose end the test decides (``finish``)."""

    compiling = True

    def __init__(self, module) -> None:
        self._kernels, self.module = module, None
        self.started = time.monotonic()
        self._done = threading.Event()

    def finish(self) -> None:
        self.module = self._kernels
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        self._done.wait(timeout)
        return self.module


class CountingKernels:
    """The kernels, counting calls by name."""

    def __init__(self, module) -> None:
        self._module, self.calls = module, []

    def __getattr__(self, name: str):
        function = getattr(self._module, name)

        def counted(*args):
            self.calls.append(name)
            return function(*args)

        return counted


def engine(tiny_model_dir, background: bool = False, **settings) -> LLMEngine:
    config = EngineConfig.from_dict({"model": str(tiny_model_dir), "dtype": "float32",
                                     "kv_cache_memory": "16MiB", **settings})
    return LLMEngine.from_config(config, kernels_in_background=background)


def run(llm: LLMEngine, prompts=PROMPTS) -> list[list[tuple[int, float]]]:
    """Each prompt's (token, logprob) pairs, greedy."""
    ids = [llm.add_request(prompt, PARAMS) for prompt in prompts]
    final = {}
    while llm.has_unfinished:
        for output in llm.step():
            if output.finished:
                final[output.request_id] = [(t.token_id, t.logprob) for t in output.logprobs]
    return [final[i] for i in ids]


def test_serving_starts_on_the_portable_path_and_switches_between_steps(
        tiny_model_dir, kernels, monkeypatch):
    build = FakeBuild(kernels)
    monkeypatch.setattr(cpu_kernels, "KernelBuild", lambda build_dir: build)
    switching = engine(tiny_model_dir, background=True)
    attention = switching.executor.attention
    assert isinstance(attention, SwitchingCpuAttention) and switching.kernels_pending
    # Before the switch: exactly the portable path (same ops, same order).
    assert run(switching) == run(engine(tiny_model_dir, attention_backend="torch"))
    build.finish()
    assert switching.kernels_pending  # until a step starts on them
    # After it: the kernels' results, to the tolerance the engine's tests
    # accept between equivalent paths, on a KV cache the portable path filled.
    after, compiled = run(switching), run(engine(tiny_model_dir))
    assert attention.ops.active and not switching.kernels_pending
    for mine, theirs in zip(after, compiled, strict=True):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


def test_a_build_ending_mid_step_switches_at_the_next_step(tiny_model_dir, kernels, monkeypatch):
    counting = CountingKernels(kernels)
    build = FakeBuild(counting)
    monkeypatch.setattr(cpu_kernels, "KernelBuild", lambda build_dir: build)
    llm = engine(tiny_model_dir, background=True)
    layers = llm.executor.model.layers
    # The build ends while the step's first layer runs.
    layers[0].register_forward_pre_hook(lambda module, args: build.finish())
    llm.add_request("The quick brown fox", SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()  # the prefill, with its first sampled token
    assert build.done() and counting.calls == [], "the step changed paths half-way"
    llm.step()  # a decode: every fused op on the kernels, the LM head's norm too
    assert counting.calls.count("rms_norm") == 2 * len(layers) + 1
    assert counting.calls.count("silu_and_mul") == len(layers)
    # Decode-only steps run rotary, the KV write and attention as one call.
    assert counting.calls.count("decode_attention_block") == len(layers)


def test_load_cpu_ops_waits_for_no_compiler_in_the_background(kernels, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(cpu_kernels, "is_built", lambda build_dir: False)
    monkeypatch.setattr(cpu_kernels, "compile_in_child", lambda build_dir: release.wait(60))
    monkeypatch.setattr(cpu_kernels, "_build", lambda: kernels)
    started = time.monotonic()
    ops = load_cpu_ops(background=True)
    assert time.monotonic() - started < 1.0
    assert isinstance(ops, SwitchingCpuOps) and not ops.latch()
    assert load_cpu_ops() is kernels  # not in the background: the kernels, waited for
    release.set()
    assert ops.wait() is kernels and ops.latch()


def test_the_build_runs_in_a_child_process(tmp_path, monkeypatch, capsys):
    # The real cache's build: the child finds it built and exits.
    build_dir = kernel_build_dir(torch.__version__)
    cpu_kernels.compile_in_child(build_dir)
    assert (build_dir / "build.log").is_file()
    # A build that cannot compile: one line, and the portable path for good.
    monkeypatch.setenv("CARPOOL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    build = cpu_kernels.KernelBuild(kernel_build_dir(torch.__version__))
    assert build.compiling and build.wait(120) is None and build.done()
    assert "carpool: CPU kernels unavailable (RuntimeError: Error building extension" \
        in capsys.readouterr().err
    ops = SwitchingCpuOps(build)
    assert not ops.latch()
    assert isinstance(select_backend("auto", torch.device("cpu"), ops), SwitchingCpuAttention)
    with pytest.raises(ValueError, match="attention_backend=cpu needs the C\\+\\+ kernels"):
        select_backend("cpu", torch.device("cpu"), ops)


def test_the_cpu_backend_waits_for_the_kernels(kernels):
    build = FakeBuild(kernels)
    threading.Timer(0.2, build.finish).start()
    attention = select_backend("cpu", torch.device("cpu"), SwitchingCpuOps(build))
    assert isinstance(attention, SwitchingCpuAttention) and attention.ops.active
