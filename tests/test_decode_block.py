"""The fused decode attention op (csrc/decode_block.cpp): rotary, the K/V
cache write and paged attention of a decode-only step's layer, identical to
the op-by-op path it replaces (decoder.py ``DecoderLayer._attention``)."""
from __future__ import annotations

import pytest
import torch

from carpool.model.attention import CpuPagedAttention, SeqSpan, build_metadata
from carpool.model.config import ModelConfig
from carpool.model.cpu_kernels import load_cpu_ops
from carpool.model.decoder import DecoderLayer, Rotary
from carpool.model.kernel_switch import SwitchingCpuAttention, SwitchingCpuOps

BLOCK, NUM_BLOCKS = 4, 48
CONFIG = ModelConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 6,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "vocab_size": 32, "eos_token_id": 2})


@pytest.fixture(scope="module")
def kernel():
    ops = load_cpu_ops()
    assert ops is not None, "the C++ kernels must build on the CI machine"
    return ops


def _step(spans_spec, dtype):
    """(qkv, rope, caches, meta) of one step: per sequence, (context before, new tokens)."""
    gen = torch.Generator().manual_seed(len(spans_spec))
    heads, kv_heads, dim = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    caches = (torch.randn(kv_heads, NUM_BLOCKS, dim, BLOCK, generator=gen).to(dtype),
              torch.randn(kv_heads, NUM_BLOCKS, BLOCK, dim, generator=gen).to(dtype))
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    spans = [SeqSpan(before, new, [free.pop() for _ in range(-(-(before + new) // BLOCK))])
             for before, new in spans_spec]
    meta = build_metadata(spans, BLOCK, torch.device("cpu"))
    tokens = meta.positions.shape[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    rope = Rotary.of(CONFIG, 256).tables(meta.positions, dtype)
    return qkv, rope, caches, meta


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits where not NaN (signed zeros told apart), NaN in the same
    places (whose payload and sign torch's own paths do not keep alike)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    as_int = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(as_int)[~nan], b.view(as_int)[~nan])


# 40 sequences: more tokens than one thread's share (the op splits tokens).
MANY = [(i % 3, 1) for i in range(40)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spans_spec", [[(0, 1)], [(9, 1), (30, 1), (3, 1)],
                                        [(120, 1), (64, 1)], MANY])
@pytest.mark.parametrize("special", [False, True])
def test_fused_decode_is_identical_to_op_by_op(kernel, dtype, spans_spec, special):
    layer = DecoderLayer(CONFIG)
    attention = CpuPagedAttention(kernel)
    qkv, rope, caches, meta = _step(spans_spec, dtype)
    if special:  # rounding at the ends of the range, signed zeros, NaN and inf
        values = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3e38, -3e38,
                               1e-40, 65504.0, 1.00390625])
        flat = qkv.view(-1)
        flat[::7] = values.to(dtype).repeat(flat[::7].numel() // len(values) + 1)[
            :flat[::7].numel()]
    op_caches = tuple(c.clone() for c in caches)
    fused = attention.decode_block(qkv, rope, caches, meta, CONFIG.num_heads,
                                   CONFIG.num_kv_heads, layer.scale)
    op_by_op = layer._attention(qkv, rope, op_caches, meta, attention, kernel)
    assert fused is not None and fused.shape == op_by_op.shape
    assert _same(fused, op_by_op)
    assert all(_same(a, b) for a, b in zip(caches, op_caches))


def test_steps_with_a_prefill_go_op_by_op(kernel):
    qkv, rope, caches, meta = _step([(5, 1), (0, 6)], torch.bfloat16)
    assert CpuPagedAttention(kernel).decode_block(qkv, rope, caches, meta, CONFIG.num_heads,
                                                  CONFIG.num_kv_heads, 0.125) is None


def test_switching_backend_fuses_only_once_the_kernels_are_active(kernel):
    class Build:
        module, started = kernel, 0.0

        def __init__(self) -> None:
            self.finished = False

        def done(self) -> bool:
            return self.finished

    build = Build()
    attention = SwitchingCpuAttention(SwitchingCpuOps(build))
    qkv, rope, caches, meta = _step([(7, 1)], torch.bfloat16)
    args = (qkv, rope, caches, meta, CONFIG.num_heads, CONFIG.num_kv_heads, 0.125)
    assert attention.decode_block(*args) is None
    build.finished = True
    attention.build_metadata([SeqSpan(7, 1, [0, 1])], BLOCK, torch.device("cpu"))  # latches
    assert attention.decode_block(*args) is not None


def test_fused_decode_refuses_a_slot_outside_the_cache(kernel):
    qkv, rope, caches, meta = _step([(3, 1)], torch.bfloat16)
    meta.slot_blocks = torch.tensor([NUM_BLOCKS + 5])
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        CpuPagedAttention(kernel).decode_block(qkv, rope, caches, meta, CONFIG.num_heads,
                                               CONFIG.num_kv_heads, 0.125)
