"""Which model an engine runs and how (``ModelSettings``, the ``model``
section of carpool's YAML), and the CUDA graph sizes it captures.

Pure Python (no torch), like the rest of ``carpool.config``, which
re-exports these names.
"""
from __future__ import annotations

from dataclasses import dataclass

#: CUDA graph batch sizes captured by default (vLLM's progression: 1, 2, 4,
#: then by 8 to 32, by 16 to 64, then by 32 and 64), capped at max_num_seqs.
CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(spec: str, max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture as CUDA graphs: ``auto``
    (``CUDA_GRAPH_SIZES`` below ``max_num_seqs``, and ``max_num_seqs``
    itself) or a comma list."""
    if spec == "auto":
        return sorted({s for s in CUDA_GRAPH_SIZES if s < max_num_seqs} | {max_num_seqs})
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"cuda_graph_sizes must be 'auto' or a comma list of batch sizes, "
                         f"got {spec!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {spec!r}")
    return sizes


#: ``--dtype`` spellings vLLM accepts for the same types.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32"}


@dataclass
class ModelSettings:
    """Which model to run and how."""

    model: str | None = None  # HF directory or .gguf file; None = the default model
    # The tokenizer's directory (or .gguf) when it is not the model's own (vLLM's --tokenizer).
    tokenizer: str | None = None
    # A Jinja chat template, as a file path or the template text itself
    # (vLLM's --chat-template); None = the model's own.
    chat_template: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # defaults to the model's context length
    attention_backend: str = "auto"  # auto | torch | sdpa | cpu | triton
    cache_dir: str | None = None  # defaults to $CARPOOL_CACHE or ~/.cache/carpool
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0  # seeds the per-request seeds of requests that give none
    # Each step's token rows are padded up to a multiple of this before the
    # linear layers (1: exact rows). The CPU matrix kernels are built per row
    # count on first use (5-18 ms each step with a new count, and ~0.7 MB
    # kept per kernel); 16 leaves budget/16 counts to build once.
    row_bucket: int = 16
    # CUDA: decode steps replay captured graphs (carpool/executor/cuda_graphs.py)
    # unless this is set, as vLLM's --enforce-eager; no effect on CPU.
    enforce_eager: bool = False
    # Decode batch sizes captured: auto (1, 2, 4, 8, 16, 24, ... up to
    # max_num_seqs) or a comma list, e.g. "1,2,4,8,16,32,64".
    cuda_graph_sizes: str = "auto"
    # Weight-only quantization (vLLM's --quantization): None, int8 or int4
    # (CPU: low-bit weights for decode steps of a few rows, carpool/model/quant.py).
    quantization: str | None = None
    # CPU bf16: decode steps of a few rows run our packed-weight kernel
    # (carpool/model/packed_linear.py; a second copy of the weights), and a
    # MoE model's experts run our fused kernel on packed weights (in place
    # of the plain ones: carpool/model/moe_cpu.py). auto: the copy where it
    # fits in a quarter of the available memory, the experts where the CPU
    # has AVX512-BF16 but no AMX; on; off.
    packed_decode: str = "auto"
    # CPU bf16: the linear layers' weights laid out once in oneDNN's blocked
    # format (carpool/model/blocked_linear.py): bit-identical results,
    # ~1.4x faster matrix products, no extra memory. auto (where oneDNN has
    # bf16 kernels) | on | off.
    blocked_weights: str = "auto"
    # Make a step's outputs (detokenizing, stop strings, per-request
    # outputs) while the executor runs the next step, as vLLM's async
    # scheduling and SGLang's overlap scheduler do: auto (on where the
    # executor waits on a device: CUDA; off on a CPU, whose forward needs
    # every core) | on | off. Outputs then come one step later.
    overlap: str = "auto"

    def validate(self) -> None:
        # vLLM's spellings of the same types.
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "sdpa", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto|torch|sdpa|cpu|triton, "
                             f"got {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(f"quantization must be int8, int4 or null (none), "
                             f"got {self.quantization!r}")
        if self.packed_decode not in ("auto", "on", "off"):
            raise ValueError(f"packed_decode must be auto|on|off, got {self.packed_decode!r}")
        if self.blocked_weights not in ("auto", "on", "off"):
            raise ValueError(f"blocked_weights must be auto|on|off, got {self.blocked_weights!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto|on|off, got {self.overlap!r}")
        if self.row_bucket < 1:
            raise ValueError(f"row_bucket must be >= 1 (1: exact rows), got {self.row_bucket}")
        capture_sizes(self.cuda_graph_sizes, 1)  # raises on a bad spec
