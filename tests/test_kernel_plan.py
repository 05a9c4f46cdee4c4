"""The CPU kernels chosen per machine kind at start-up (carpool/kernel_plan.py):
every tier's plan from its flags, and the fallbacks run for real on this
machine by capping its tier (``--cpu-isa``)."""
from __future__ import annotations

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.config import ModelSettings
from carpool.kernel_plan import cpu_tier, plan_kernels
from carpool.machine import cpu_model_and_flags

# Flag sets of the machine kinds this project meets (as /proc/cpuinfo lists them).
XEON_AMX = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}
EPYC_AVX512 = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}
CASCADE_LAKE = {"avx2", "fma", "avx512f", "avx512_vnni"}
EPYC_AVX2 = {"avx2", "fma"}


def test_each_machine_kind_gets_its_own_plan():
    amx = plan_kernels(XEON_AMX)
    assert (amx.isa, amx.dtype, amx.w8a8) == ("amx", "bfloat16", True)
    assert "AMX" in amx.batched and amx.decode.startswith("packed bf16")
    epyc = plan_kernels(EPYC_AVX512)
    assert (epyc.isa, epyc.dtype) == ("avx512_bf16", "bfloat16")
    assert epyc.decode.startswith("packed bf16") and "AMX" not in epyc.batched
    assert plan_kernels(EPYC_AVX512, "w8a8").batched == "w8a8 (vpdpbusd)"
    vnni = plan_kernels(CASCADE_LAKE)  # VNNI without bf16: fp32, but W8A8 runs
    assert (vnni.isa, vnni.dtype, vnni.w8a8) == ("avx512_vnni", "float32", True)
    assert vnni.decode == "ATen float32"
    avx2 = plan_kernels(EPYC_AVX2, "w8a8")
    assert (avx2.isa, avx2.dtype, avx2.w8a8) == ("avx2", "float32", False)
    assert avx2.batched == "ATen float32"  # w8a8 asked for, not available: not planned
    assert cpu_tier(set()) == "portable"
    without = plan_kernels(EPYC_AVX512, kernels=False)  # no compiler: the portable path
    assert without.attention == "portable torch" and not without.w8a8
    assert without.decode == "oneDNN blocked bf16"
    assert plan_kernels(EPYC_AVX512, "int4").decode == "int4 (ours, vdpbf16ps)"
    assert plan_kernels(EPYC_AVX2, "int4").decode == "int4 (ATen)"


def test_a_tier_can_be_capped_below_the_cpu_but_never_above():
    assert cpu_tier(XEON_AMX, "avx512_bf16") == "avx512_bf16"
    assert plan_kernels(XEON_AMX, cap="avx2").dtype == "float32"
    assert not plan_kernels(EPYC_AVX512, "w8a8", cap="avx512").w8a8
    with pytest.raises(ValueError, match="lacks amx_bf16, amx_tile"):
        cpu_tier(EPYC_AVX512, "amx")
    with pytest.raises(ValueError, match="--cpu-isa must be"):
        cpu_tier(EPYC_AVX512, "sse2")
    with pytest.raises(ValueError, match="cpu_isa must be auto or one of"):
        ModelSettings(cpu_isa="avx1024").validate()
    labels = plan_kernels(EPYC_AVX512).labels()
    assert labels["isa"] == "avx512_bf16" and labels["w8a8"] == "true"
    assert all(isinstance(v, str) for v in labels.values())


def test_the_engine_follows_the_plan_and_its_avx2_fallback_runs_here(tiny_model_dir):
    """This machine's own plan, then the AVX2 machine kind's choices run on
    it: fp32, ATen's matrix kernels, no packed or blocked copies, and the
    tokens of a plain fp32 engine."""
    from carpool.model.blocked_linear import BlockedLinear
    from carpool.model.packed_linear import PackedDecodeLinear

    prompts, params = ["hello there", "one two three"], SamplingParams(max_tokens=8,
                                                                       temperature=0)
    native = LLM(str(tiny_model_dir))
    plan = native.engine.executor.kernel_plan
    assert plan.isa == cpu_tier(cpu_model_and_flags()[1])
    assert str(native.engine.executor.dtype) == f"torch.{plan.dtype}"
    capped = LLM(str(tiny_model_dir), cpu_isa="avx2")
    executor = capped.engine.executor
    assert executor.kernel_plan.isa == "avx2" and executor.dtype == torch.float32
    kinds = {type(m) for m in executor.model.modules()}
    assert not kinds & {PackedDecodeLinear, BlockedLinear}
    plain = LLM(str(tiny_model_dir), dtype="float32", packed_decode="off", blocked_weights="off")
    assert ([o.token_ids for o in capped.generate(prompts, params)]
            == [o.token_ids for o in plain.generate(prompts, params)])
    with pytest.raises(ValueError, match="w8a8 cannot run here: .*avx2.* has no AVX512-VNNI"):
        LLM(str(tiny_model_dir), cpu_isa="avx2", quantization="w8a8")
