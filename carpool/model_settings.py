"""Which model an engine runs and how (``ModelSettings``, the ``model``
section of carpool's YAML), and the CUDA graph sizes it captures.

Pure Python (no torch), like the rest of ``carpool.config``, which
re-exports these names.
"""
from __future__ import annotations

from dataclasses import dataclass

from carpool.kernel_plan import TIERS
from carpool.settings_fields import setting

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

    # HF directory or .gguf file; None = the default model
    model: str | None = setting(
        None, "--model", "MODEL",
        "HF model directory, .gguf file or Hugging Face repo id (default: "
        "SmolLM2-135M-Instruct)")
    # The tokenizer's directory (or .gguf) when it is not the model's own (vLLM's --tokenizer).
    tokenizer: str | None = setting(
        None, "--tokenizer", "PATH",
        "tokenizer directory or .gguf when not the model's own (default: the model's)")
    # A Jinja chat template, as a file path or the template text itself
    # (vLLM's --chat-template); None = the model's own.
    chat_template: str | None = setting(
        None, "--chat-template", "TEMPLATE",
        "chat template: a Jinja file or the template text (default: the model's own)")
    # auto | float32 | bfloat16 | float16
    dtype: str = setting(
        "auto", "--dtype", "DTYPE",
        "auto | float32 (float) | bfloat16 | float16 (half); auto: bf16 on GPU and on CPUs "
        "with native bf16, else fp32")
    # auto | cpu | cuda
    device: str = setting(
        "auto", "--device", "DEVICE",
        "auto | cpu | cuda[:N]")
    # One replica over N processes (carpool/parallel, executor/tensor_parallel.py):
    # rank 0 schedules, every rank holds its slice of the weights and the KV
    # pool and runs the step's forward; gloo on the CPU, NCCL on CUDA (rank r
    # on cuda:r).
    tensor_parallel_size: int = setting(
        1, "--tensor-parallel-size", "N",
        "processes one replica's model is sliced over (heads, MLP features, experts' "
        "features, vocabulary); greedy output is the same as one process's", parse=int)
    # Expert parallelism (carpool/parallel/experts.py): the tensor-parallel
    # ranks hold whole experts (E / N each) instead of every expert's 1 / N
    # features; tokens go to their experts' ranks and back by all-to-all.
    enable_expert_parallel: bool = setting(
        False, "--enable-expert-parallel", None,
        "with --tensor-parallel-size N: spread the MoE layers' experts whole over the N "
        "ranks, each token's picks sent to their experts' ranks and back (all-to-all)",
        parse=bool)
    # Rows one rank's experts take per layer, at most ceil(F * picks / N); the
    # rest are dropped and counted. 0: no bound.
    expert_capacity_factor: float = setting(
        0.0, "--expert-capacity-factor", "F",
        "expert parallel: a rank takes at most ceil(F x picks / ranks) rows a layer, the "
        "rest dropped and counted (0: no bound, nothing dropped)", parse=float)
    # Two micro-batches per step (carpool/model/decoder.py
    # forward_micro_batches): one's tensor-parallel sums travel while the
    # other computes. auto: under tensor parallelism, for steps of two or
    # more sequences, each step shape the way its measured step times favour
    # (carpool/executor/micro_batch_choice.py); on: always then (one
    # process too: the same outputs); off: one batch.
    micro_batches: str = setting(
        "auto", "--micro-batches", "MODE",
        "split a step into two micro-batches whose tensor-parallel communication overlaps "
        "the other's compute: auto (with --tensor-parallel-size > 1, per step shape, by "
        "measured step times) | on | off")
    # defaults to the model's context length
    max_model_len: int | None = setting(
        None, "--max-model-len", "N",
        "context limit (default: the model's)", parse=int)
    # auto | torch | sdpa | cpu | triton
    attention_backend: str = setting(
        "auto", "--attention-backend", "BACKEND",
        "auto | torch | sdpa | cpu (our C++ decode kernel) | triton (our GPU kernels; auto on"
        " CUDA)")
    # defaults to $CARPOOL_CACHE or ~/.cache/carpool
    cache_dir: str | None = setting(
        None, "--cache-dir", "DIR",
        "where models are fetched and converted (default: $CARPOOL_CACHE or ~/.cache/carpool)")
    # torch intra-op threads on CPU; None = torch's default
    threads: int | None = setting(
        None, "--threads", "N",
        "torch CPU threads (default: torch's choice)", parse=int)
    # seeds the per-request seeds of requests that give none
    seed: int = setting(
        0, "--seed", "N",
        "seeds the per-request seeds of requests that give none", parse=int)
    # Each step's token rows are padded up to a multiple of this before the
    # linear layers (1: exact rows). The CPU matrix kernels are built per row
    # count on first use (5-18 ms each step with a new count, and ~0.7 MB
    # kept per kernel); 16 leaves budget/16 counts to build once.
    row_bucket: int = setting(
        16, "--row-bucket", "N",
        "pad each step's token rows to a multiple of this before the linear layers (1: exact "
        "rows)", parse=int)
    # CUDA: decode steps replay captured graphs (carpool/executor/cuda_graphs.py)
    # unless this is set, as vLLM's --enforce-eager; no effect on CPU.
    enforce_eager: bool = setting(
        False, "--enforce-eager", None,
        "CUDA: run every step eagerly (no CUDA graphs)", parse=bool)
    # Decode batch sizes captured: auto (1, 2, 4, 8, 16, 24, ... up to
    # max_num_seqs) or a comma list, e.g. "1,2,4,8,16,32,64".
    cuda_graph_sizes: str = setting(
        "auto", "--cuda-graph-sizes", "SIZES",
        "decode batch sizes captured as CUDA graphs: auto or a comma list, e.g. 1,2,4,8,16,32")
    # Quantization (vLLM's --quantization): None; int8 or int4 (weight-only,
    # CPU decode steps of a few rows: carpool/model/quant.py); w8a8 (INT8
    # weights and per-token INT8 activations on every step, AVX512-VNNI:
    # carpool/model/w8a8.py).
    quantization: str | None = setting(
        None, "--quantization", "METHOD",
        "CPU quantization: int8 (+50% weight memory) or int4 (groups of 32, +25%): weight-only, "
        "for decode steps of a few rows; w8a8: INT8 weights and per-token INT8 activations on "
        "every step (AVX512-VNNI; half the bf16 weights' memory) (default: none)")
    # CPU bf16: decode steps of a few rows run our packed-weight kernel
    # (carpool/model/packed_linear.py; a second copy of the weights), and a
    # MoE model's experts run our fused kernel on packed weights (in place
    # of the plain ones: carpool/model/moe_cpu.py). auto: the copy where it
    # fits in a quarter of the available memory, the experts where the CPU
    # has AVX512-BF16 but no AMX; on; off.
    packed_decode: str = setting(
        "auto", "--packed-decode", "MODE",
        "CPU bf16: decode steps of a few rows on a packed copy of the weights (our "
        "AVX512-BF16 kernel), and MoE experts on our fused kernel: auto (the copy where it "
        "fits in a quarter of the free memory; the experts where the CPU has AVX512-BF16 but "
        "no AMX) | on | off")
    # CPU: the tier of kernels to choose from (carpool/kernel_plan.py):
    # auto (the CPU's own) or a lower one, to run a lesser machine kind's
    # choices (dtype, packed decode, W8A8, MoE packing) on this one.
    cpu_isa: str = setting(
        "auto", "--cpu-isa", "TIER",
        "CPU: choose kernels as on this tier: auto (this CPU's) | amx | avx512_bf16 | "
        "avx512_vnni | avx512 | avx2 | portable (no higher than this CPU's)")
    # CPU bf16: the linear layers' weights laid out once in oneDNN's blocked
    # format (carpool/model/blocked_linear.py): bit-identical results,
    # ~1.4x faster matrix products, no extra memory. auto (where oneDNN has
    # bf16 kernels) | on | off.
    blocked_weights: str = setting(
        "auto", "--blocked-weights", "MODE",
        "CPU bf16: linear weights laid out once in oneDNN's blocked format (same results, "
        "faster matrix products): auto (where oneDNN has bf16 kernels) | on | off")
    # Make a step's outputs (detokenizing, stop strings, per-request
    # outputs) while the executor runs the next step, as vLLM's async
    # scheduling and SGLang's overlap scheduler do: auto (on where the
    # executor waits on a device: CUDA; off on a CPU, whose forward needs
    # every core) | on | off. Outputs then come one step later.
    overlap: str = setting(
        "auto", "--overlap", "MODE",
        "make a step's outputs (detokenizing, stop strings) while the executor runs the next "
        "step: auto (on for CUDA, off on CPU) | on | off")

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
        if self.quantization is not None and self.quantization not in ("int8", "int4", "w8a8"):
            raise ValueError(f"quantization must be int8, int4, w8a8 or null (none), "
                             f"got {self.quantization!r}")
        if self.cpu_isa != "auto" and self.cpu_isa not in dict(TIERS):
            raise ValueError(f"cpu_isa must be auto or one of {', '.join(dict(TIERS))}, "
                             f"got {self.cpu_isa!r}")
        if self.packed_decode not in ("auto", "on", "off"):
            raise ValueError(f"packed_decode must be auto|on|off, got {self.packed_decode!r}")
        if self.blocked_weights not in ("auto", "on", "off"):
            raise ValueError(f"blocked_weights must be auto|on|off, got {self.blocked_weights!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto|on|off, got {self.overlap!r}")
        if self.row_bucket < 1:
            raise ValueError(f"row_bucket must be >= 1 (1: exact rows), got {self.row_bucket}")
        if self.micro_batches not in ("auto", "on", "off"):
            raise ValueError(f"micro_batches must be auto|on|off, got {self.micro_batches!r}")
        if self.expert_capacity_factor < 0:
            raise ValueError(f"expert_capacity_factor must be >= 0 (0: no bound), got "
                             f"{self.expert_capacity_factor}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        capture_sizes(self.cuda_graph_sizes, 1)  # raises on a bad spec
