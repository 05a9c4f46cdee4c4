"""Runs our PyTorch model over one batch per step: ragged, or padded to a
rectangle for static / dynamic batching (``Padding``).

Padding really runs through the model: each stretch of pad tokens is an
extra dummy sequence from position 0, placed before / after its row's real
tokens in the flattened batch as the alignment says, whose K/V go to a few
scratch blocks past ``num_blocks`` (never in the scheduler's pool) and
whose outputs are discarded. Pad sequences attend only to themselves, so
real tokens never see them and results equal the ragged path's.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from carpool.config import CacheConfig, ModelSettings, capture_sizes, parse_size
from carpool.executor.base import BatchItem, Executor, Padding
from carpool.executor.cuda_graphs import CudaGraph, DecodeGraphs
from carpool.executor.expert_load import ExpertLoad
from carpool.executor.shapes import padded_rows
from carpool.model import huge_pages
from carpool.model.attention import SeqSpan
from carpool.model.backends import select_backend
from carpool.model.config import ModelConfig
from carpool.model.decoder import DecoderModel
from carpool.model.sampler import Sampler, SampleResult

log = logging.getLogger(__name__)  # carpool serve's log lines; silent offline at INFO

#: KV blocks past ``num_blocks`` that only pad tokens write to.
SCRATCH_BLOCKS = 2
PAD_TOKEN_ID = 0

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, cpu_isa: str = "auto") -> torch.dtype:
    """``auto``: bf16 on CUDA and where the CPU's kernel tier (``--cpu-isa``)
    has bf16 instructions (AVX512-BF16, AMX), else fp32."""
    if name != "auto":
        dtype = _DTYPES[name]
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use bfloat16 or float32")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16
    from carpool.kernel_plan import plan_kernels
    from carpool.machine import cpu_model_and_flags

    return _DTYPES[plan_kernels(cpu_model_and_flags()[1], cap=cpu_isa).dtype]


def free_memory(device: torch.device) -> int:
    """Bytes free for the KV pool now. CUDA: the device's free memory
    (``torch.cuda.mem_get_info``, after returning the caching allocator's
    unused blocks); CPU: ``MemAvailable`` of /proc/meminfo (what can be
    allocated without swapping)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    raise ValueError("cannot tell the free memory on this system (no /proc/meminfo): "
                     "size the KV cache with --kv-cache-memory")


@dataclass
class _Run:
    """A stretch of the flattened batch: an item's span, or padding (``item`` None)."""

    token_ids: Sequence[int]
    span: SeqSpan
    item: int | None = None


def _free_or_zero(device: torch.device) -> int:
    try:
        return free_memory(device)
    except ValueError:  # the system does not say: assume nothing to spare
        return 0


def _portable_only(config: ModelConfig) -> str | None:
    """Why attention must take the portable path's masks (which every
    backend but Triton's runs), or None."""
    if config.mla is not None:
        return "the model has latent attention (MLA)"
    if config.sliding_window is not None:
        return "the model has sliding-window layers"
    return None


class TorchExecutor(Executor):
    """Holds the model weights and one preallocated KV pool.

    The pool is ``num_blocks`` blocks per layer for K and for V, sized by
    ``_num_blocks`` (``cache.num_blocks``, ``gpu_memory_utilization`` or
    ``kv_cache_memory``), plus
    ``SCRATCH_BLOCKS`` scratch blocks for padding.
    """

    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor],
                 settings: ModelSettings, cache: CacheConfig, max_model_len: int,
                 max_num_seqs: int = 256, graph_type: type | None = None,
                 kernels_in_background: bool = False, tp=None) -> None:  # noqa: ANN001
        """``graph_type``: how decode steps are captured (``CudaGraph`` by
        default on CUDA unless ``settings.enforce_eager``; tests pass
        ``EagerGraph`` to drive the same path on the CPU); None: no graphs
        on the CPU. ``kernels_in_background``: do not wait for the CPU
        kernels' first build (``load_cpu_ops``). ``tp``: this process's
        tensor-parallel group (``carpool.parallel.group``): the model is cut
        to its rank's slice and the KV pool holds that slice's heads."""
        threads = settings.threads
        if not threads and tp is not None:  # the ranks share the host's cores
            threads = max(1, (os.cpu_count() or 1) // tp.size)
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device, settings.cpu_isa)
        # A GPU's step is mostly waiting on the device (the engine's overlap, auto).
        self.overlaps_host = self.device.type == "cuda"
        self.block_size = cache.block_size
        self.row_bucket = settings.row_bucket
        # Built on the device: an 8B model's init never runs on the host. A
        # sliced replica's is built and cut on the host, so a device holds
        # only its rank's slice (the model may not fit one device whole).
        with torch.device(self.device if tp is None else "cpu"):
            self.model = DecoderModel(model_config, max_model_len)
        self.model.load_hf_weights(weights)
        self.tp = tp
        self.micro_batches = settings.micro_batches
        self.split_next: bool | None = None
        if tp is not None:  # the whole model's print, before the cut (see Executor)
            from carpool.kv_transfer.blocks import weights_fingerprint

            self.unsharded_fingerprint = weights_fingerprint(
                self.model, f"{model_config!r} {self.dtype}", self.dtype)
            model_config = self._shard(model_config, settings)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        # Rotary tables stay fp32 whatever the weights' dtype.
        for rotary in self.model.rotaries():
            rotary.float()
        self.cpu_ops = None
        if self.device.type == "cpu" and settings.attention_backend in ("auto", "cpu"):
            from carpool.model.cpu_kernels import load_cpu_ops

            self.cpu_ops = load_cpu_ops(background=kernels_in_background)
        self.attention = select_backend(settings.attention_backend, self.device, self.cpu_ops,
                                        model_config.head_dim, portable_only=_portable_only(
                                            model_config))
        self.model.ops = self.cpu_ops
        self.kernel_plan = self._prepare_weights(settings)
        if self.attention.name == "triton":  # fused norm, rotary and SwiGLU kernels too
            from carpool.model.triton_ops import TritonOps

            self.model.ops = TritonOps()
        self.num_blocks = self._num_blocks(model_config, cache)
        if tp is not None:  # one pool for the scheduler: what every rank's memory holds
            self.num_blocks = tp.smallest(self.num_blocks)
        self.kv_caches = self._kv_caches(model_config)
        self.sampler = Sampler(model_config.vocab_size)
        if self.cpu_ops is not None and self.device.type == "cpu":
            self.sampler.row_argmax = self.cpu_ops.row_argmax
            self.sampler.apply_bitmask = self.cpu_ops.apply_token_bitmask
        moe_blocks = [layer.moe for layer in self.model.layers if layer.moe is not None]
        self.expert_load = ExpertLoad(moe_blocks) if moe_blocks else None
        if self.expert_load is not None and tp is not None and settings.enable_expert_parallel:
            self.expert_load.ranks = tp.size
        self.graphs = self._capture_graphs(settings, max_model_len, max_num_seqs, graph_type)

    def block_io(self):  # noqa: ANN201 - a KVBlockIO
        from carpool.kv_transfer.blocks import KVBlockIO

        return KVBlockIO(self.kv_caches)

    def _shard(self, config: ModelConfig, settings: ModelSettings) -> ModelConfig:
        """Cut the loaded model to this rank's slice; the slice's config."""
        from carpool.parallel.shard import local_config, shard_model

        if settings.quantization is not None:
            raise ValueError("--quantization does not combine with tensor parallelism yet")
        expert_parallel = settings.enable_expert_parallel
        shard_model(self.model, self.tp, expert_parallel, settings.expert_capacity_factor)
        return local_config(config, self.tp.size, expert_parallel)

    def _kv_caches(self, config: ModelConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V); layouts: see carpool/model/attention.py (K blocks
        are stored transposed). MLA: one latent tensor in V's layout, given
        as both (``KVBlockIO`` and attention know it by ``K is V``)."""
        heads, dim = config.cache_heads, config.cache_dim
        total = self.num_blocks + SCRATCH_BLOCKS
        v_shape = (heads, total, self.block_size, dim)
        if config.mla is not None:
            return [(latent, latent) for latent in
                    (self._cache_tensor(v_shape) for _ in range(config.num_layers))]
        k_shape = (heads, total, dim, self.block_size)
        return [(self._cache_tensor(k_shape), self._cache_tensor(v_shape))
                for _ in range(config.num_layers)]

    def _cache_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's K or V cache, zeroed; on huge pages on CPU, where
        scattered block reads would otherwise miss the TLB."""
        if self.device.type == "cpu":
            return huge_pages.zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _capture_graphs(self, settings: ModelSettings, max_model_len: int, max_num_seqs: int,
                        graph_type: type | None) -> DecodeGraphs | None:
        """One decode graph per bucket size, when the device and the
        attention backend allow it (see ``carpool/executor/cuda_graphs.py``)."""
        if graph_type is None and self.device.type == "cuda" and not settings.enforce_eager:
            graph_type = CudaGraph
        if graph_type is None or not self.attention.graph_safe:
            return None
        if self.expert_load is not None:  # expert GEMMs are sized by each step's routing
            return None
        if self.tp is not None:  # collectives inside a captured graph: not yet
            return None

        def forward(ids: torch.Tensor, meta) -> torch.Tensor:  # noqa: ANN001
            return self.model(ids, meta, self.kv_caches, self.attention)

        with torch.inference_mode():
            return DecodeGraphs(forward, capture_sizes(settings.cuda_graph_sizes, max_num_seqs),
                                table_width=-(-max_model_len // self.block_size),
                                scratch_block=self.num_blocks, device=self.device,
                                graph_type=graph_type)

    def _prepare_weights(self, settings: ModelSettings):  # noqa: ANN202 - a KernelPlan or None
        """On a CPU: this machine kind's kernel plan, logged, and the weights
        laid out for it (carpool/executor/cpu_weights.py)."""
        if self.device.type != "cpu":
            if settings.quantization is not None:
                raise ValueError(f"--quantization {settings.quantization} cannot run here: it "
                                 f"is a CPU path (device {self.device})")
            return None
        from carpool.executor.cpu_weights import cpu_plan, prepare_cpu_weights

        plan = cpu_plan(settings, self.cpu_ops is not None)
        log.info("%s", plan.describe())
        prepare_cpu_weights(self.model, plan, self.cpu_ops, settings, self.dtype,
                            _free_or_zero(self.device))
        return plan

    def _num_blocks(self, config: ModelConfig, cache: CacheConfig) -> int:
        """The pool's blocks: ``num_blocks``, else ``gpu_memory_utilization``
        of the memory free now (the weights are loaded), else ``kv_cache_memory``."""
        if cache.num_blocks is not None:
            return cache.num_blocks
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = self.block_size * config.kv_bytes_per_token(elem)
        if cache.gpu_memory_utilization is not None:
            free = free_memory(self.device)
            budget = int(free * cache.gpu_memory_utilization)
            source = (f"gpu_memory_utilization {cache.gpu_memory_utilization} of "
                      f"{free / 2**20:.0f} MiB free")
        else:
            budget = parse_size(cache.kv_cache_memory)
            source = f"kv_cache_memory {cache.kv_cache_memory}"
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"{source} holds no KV block ({per_block} bytes each)")
        return int(num_blocks)

    @torch.inference_mode()
    def execute(self, items: Sequence[BatchItem],
                padding: Padding | None = None) -> list[SampleResult]:
        return self.launch(items, padding)()

    def launch(self, items: Sequence[BatchItem], padding: Padding | None = None,
               ) -> Callable[[], list[SampleResult]]:
        """The forward and the LM head are queued (on a GPU they run on
        after this returns); the wait samples, which reads the logits."""
        runs = self._runs(items, padding)
        bucket = self._graph_bucket(runs) if padding is None else None
        if bucket is not None:  # pad the batch to its graph's size
            runs += [pad for _ in range(bucket - len(runs)) for pad in self._pad_run(1)]
        groups = self._micro_batches(runs, padding, bucket)
        runs = [run for group in groups for run in group]
        sample_rows: list[int] = []  # rows of the flattened batch to sample
        sampled_items: list[int] = []  # their indices in `items`
        row = 0
        for run in runs:
            row += len(run.token_ids)
            if run.item is not None and items[run.item].sampling is not None:
                sample_rows.append(row - 1)
                sampled_items.append(run.item)
        if len(groups) > 1:
            hidden = torch.cat(self.model.forward_micro_batches(
                [self._batch(group, None) for group in groups], self.kv_caches, self.attention))
        elif bucket is not None:
            hidden = self.graphs.replay(*self._batch(runs, bucket), len(items))
        else:
            hidden = self.model(*self._batch(runs, None), self.kv_caches, self.attention)
        if self.expert_load is not None:
            self.expert_load.record()
        if not sampled_items:
            return list
        # The LM head's rows are bucketed too: the last sampled row repeated.
        num_sampled = len(sample_rows)
        sample_rows += sample_rows[-1:] * (padded_rows(num_sampled, self.row_bucket)
                                           - num_sampled)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])[:num_sampled]

        def sample() -> list[SampleResult]:
            results = self.sampler.sample(logits, [items[i].sampling for i in sampled_items])
            # Back to item order (indices are unique, so results are never compared).
            return [result for _, result in sorted(zip(sampled_items, results))]
        return sample

    def _batch(self, runs: list[_Run], bucket: int | None):  # noqa: ANN202
        """(token ids, attention metadata) of ``runs``; outside a graph's
        bucket the ids are padded to a row bucket: the same kernels serve
        every step of a bucket (shapes.py)."""
        input_ids = [token for run in runs for token in run.token_ids]
        meta = self.attention.build_metadata([run.span for run in runs], self.block_size,
                                             self.device)
        if bucket is None:
            input_ids += [PAD_TOKEN_ID] * (padded_rows(len(input_ids), self.row_bucket)
                                           - len(input_ids))
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), meta

    def _micro_batches(self, runs: list[_Run], padding: Padding | None,
                       bucket: int | None) -> list[list[_Run]]:
        """The step as two micro-batches (every other run: each keeps decodes
        first) where ``micro_batches`` asks for them and both get work, else
        as one. auto: under tensor parallelism, whose sums the split hides;
        there rank 0 chooses each step's way (``split_next``: set for the
        next step only; ``micro_batch_choice``) and every rank follows."""
        mode = self.micro_batches
        wanted, self.split_next = self.split_next, None  # a sliced replica's rank 0 chose
        if wanted is None:
            wanted = mode == "on" or (mode == "auto" and self.tp is not None)
        if not wanted or padding is not None or bucket is not None or len(runs) < 2:
            return [runs]
        return [runs[0::2], runs[1::2]]

    def _graph_bucket(self, runs: list[_Run]) -> int | None:
        """The captured batch size a step of decodes only replays in, else None."""
        if self.graphs is None or not runs or any(r.span.num_tokens != 1 for r in runs):
            return None
        longest = max(r.span.start for r in runs) + 1
        return self.graphs.bucket(len(runs), -(-longest // self.block_size))

    def _runs(self, items: Sequence[BatchItem], padding: Padding | None) -> list[_Run]:
        """The batch's stretches in flattened order."""
        runs = [_Run(item.token_ids[item.start:item.start + item.num_tokens],
                     SeqSpan(item.start, item.num_tokens, item.block_table), index)
                for index, item in enumerate(items)]
        if padding is not None:
            runs = self._pad(runs, padding)
        # Decodes first: attention batches them together (see attention.py).
        # The sort is stable, so rows and each row's alignment keep their order.
        return sorted(runs, key=lambda run: run.span.num_tokens > 1)

    def _pad(self, runs: list[_Run], padding: Padding) -> list[_Run]:
        """Each row padded up to the rectangle's width, then the missing rows."""
        num_rows, cols = padding.shape([run.span.num_tokens for run in runs])
        padded: list[_Run] = []
        for run in runs:
            before, after = padding.split(run.span.num_tokens, cols)
            padded += [*self._pad_run(before), run, *self._pad_run(after)]
        for _ in range(num_rows - len(runs)):
            padded += self._pad_run(cols)
        return padded

    def _pad_run(self, length: int) -> list[_Run]:
        """``length`` pad tokens as a dummy sequence (none when ``length`` is 0)."""
        if length <= 0:
            return []
        # Cycling over a few scratch blocks makes long pad runs overwrite their
        # own slots; harmless: the compute is the same (every token, every
        # attended position) and pad outputs are discarded.
        table = [self.num_blocks + j % SCRATCH_BLOCKS for j in range(-(-length // self.block_size))]
        return [_Run([PAD_TOKEN_ID] * length, SeqSpan(0, length, table))]
