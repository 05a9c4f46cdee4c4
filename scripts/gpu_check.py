"""carpool's GPU path in one run: kernels, greedy equality, throughput, roofline.

On a CUDA machine (``scripts/gpu_check.sh``, about 5 minutes on one H200;
nothing is downloaded: weights are random with the real models' shapes):

1. kernels: the Triton paged decode / extend kernels against the portable
   torch path (fp32 math) on the GPU, ragged batches, bf16 / fp16 / fp32;
2. greedy: generation with SmolLM2-135M's shape, Triton + CUDA graphs vs
   SDPA eager, token for token (fp32: must be equal; bf16: agreement);
   sampler: random sampling on the GPU vs the CPU, same tokens, and time;
3. throughput: offline ``LLM.generate`` of B prompts of 128 tokens, 128
   output tokens each, B = 1 / 64 / 256, eager vs CUDA graphs, for a
   SmolLM2-135M-shaped and a Llama-3-8B-shaped model (bf16);
4. roofline: one decode step of B sequences at a 256-token context, eager
   vs graphs, against (weight bytes + KV bytes) / 4.8 TB/s;
5. parallel: tensor parallel size 2 against 1 on two GPUs (fp32 greedy
   tokens equal; step and collective times with and without two
   micro-batches); on one GPU it says it needs two.

``--dry-run`` runs every section on the CPU with a tiny model, Triton's
interpreter and eager "graphs" (the tests do this), to prove the script
before a GPU is spent on it. Results: one JSON file (``--out``), written
after every section, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
            tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
            rope_theta=10000.0, max_position_embeddings=512)
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet


def model_config(shape: dict):
    from carpool.model.config import ModelConfig

    return ModelConfig.from_hf_config(dict(shape, architectures=["LlamaForCausalLM"],
                                           model_type="llama", rms_norm_eps=1e-5,
                                           hidden_act="silu", bos_token_id=0, eos_token_id=1))


def random_weights(config, device, seed: int = 0) -> dict:
    """HF-named random weights (std 0.02, norms 1) made on ``device``."""
    import torch

    from carpool.model.hf_names import expected_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, device=device)
        else:
            weights[name] = torch.randn(shape, generator=gen, device=device).mul_(0.02) \
                .to(torch.bfloat16)
    return weights


def word_tokenizer(vocab_size: int):
    """A tokenizer with one word per id (prompts are given as ids here)."""
    import tokenizers

    from carpool.model.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    return Tokenizer(backend, eos_token_ids=[1])


def build_llm(shape: dict, ctx, **knobs):
    """An offline ``LLM`` over random weights; ``knobs``: EngineConfig fields."""
    import torch

    from carpool import LLM
    from carpool.config import EngineConfig
    from carpool.engine.llm_engine import LLMEngine
    from carpool.executor.cuda_graphs import EagerGraph
    from carpool.executor.torch_executor import TorchExecutor

    config = EngineConfig.from_dict(dict(ctx.engine_knobs, **knobs)).validate()
    mconfig = model_config(shape)
    max_len = 2048 if not ctx.dry_run else 512
    weights = random_weights(mconfig, ctx.device)
    graph_type = EagerGraph if ctx.dry_run and not config.model.enforce_eager else None
    executor = TorchExecutor(mconfig, weights, config.model, config.cache, max_len,
                             config.scheduler.max_num_seqs, graph_type=graph_type)
    del weights
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    engine = LLMEngine(config, word_tokenizer(mconfig.vocab_size), mconfig, executor, max_len)
    return LLM.from_engine(engine)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(count)]


def sync(ctx) -> None:
    import torch

    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


# -- 1. kernels -------------------------------------------------------------------------

def check_kernels(ctx) -> dict:
    """Triton vs the torch path on random ragged batches; max abs error per dtype."""
    import torch

    from carpool.model.attention import SeqSpan, TorchAttention
    from carpool.model.triton_attention import TritonAttention

    tolerance = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}
    cases = [(16, 3, 3, 64), (16, 8, 4, 128), (32, 2, 1, 64), (8, 4, 8, 128)]
    out = {}
    gen = torch.Generator().manual_seed(0)
    for dtype_name, tol in tolerance.items():
        dtype = getattr(torch, dtype_name)
        if ctx.dry_run and dtype == torch.bfloat16:
            continue  # the interpreter's bf16 dot products are wrong (triton_kernels.py)
        worst = 0.0
        for block_size, num_kv, group, dim in cases:
            lens = [(300, 1), (5, 1), (1000, 1), (0, 77), (130, 200)] if not ctx.dry_run \
                else [(40, 1), (3, 1), (0, 17), (20, 30)]
            spans, used = [], 0
            for start, n in lens:
                blocks = -(-(start + n) // block_size)
                spans.append(SeqSpan(start, n, list(range(used, used + blocks))[::-1]))
                used += blocks
            tokens, heads = sum(n for _, n in lens), num_kv * group
            q, k, v = (torch.randn(tokens, h, dim, generator=gen).to(dtype)
                       for h in (heads, num_kv, num_kv))
            kc = torch.randn(num_kv, used, dim, block_size, generator=gen).to(dtype)
            vc = torch.randn(num_kv, used, block_size, dim, generator=gen).to(dtype)
            dev = [t.to(ctx.device) for t in (q, k, v, kc, vc)]
            ref = TorchAttention()
            f32 = [t.float() for t in dev]
            expected = ref.forward(*f32, ref.build_metadata(spans, block_size, ctx.device),
                                   dim ** -0.5)
            tri = TritonAttention()
            got = tri.forward(*dev, tri.build_metadata(spans, block_size, ctx.device),
                              dim ** -0.5)
            worst = max(worst, (expected - got.float()).abs().max().item())
        out[dtype_name] = {"max_abs_error": worst, "tolerance": tol, "ok": worst <= tol}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# -- 2. greedy equality -------------------------------------------------------------------

def check_greedy(ctx) -> dict:
    """SmolLM2-135M's shape: Triton + graphs vs SDPA eager, greedy tokens."""
    from carpool import SamplingParams

    shape = TINY if ctx.dry_run else SMOL
    count, new_tokens = (16, 32) if not ctx.dry_run else (4, 8)
    prompts = random_prompts(count, 24, shape["vocab_size"], seed=1)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for dtype in ("float32", "bfloat16") if not ctx.dry_run else ("float32",):
        runs = {}
        for name, knobs in (("sdpa_eager", dict(attention_backend="sdpa", enforce_eager=True)),
                            ("triton_graphs", dict(attention_backend="triton"))):
            if ctx.dry_run and name == "sdpa_eager":
                knobs["attention_backend"] = "torch"
            llm = build_llm(shape, ctx, dtype=dtype, **knobs)
            runs[name] = [o.token_ids for o in llm.generate(prompts, params)]
            graphs = llm.engine.executor.graphs
            if graphs is not None:
                out[f"{dtype}_graph_replays"] = graphs.stats.replays
            del llm
        a, b = runs["sdpa_eager"], runs["triton_graphs"]
        same = sum(x == y for x, y in zip(a, b))
        agree = sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b))
        out[dtype] = {"sequences_equal": f"{same}/{len(a)}",
                      "token_agreement": agree / sum(len(x) for x in a)}
    out["ok"] = out["float32"]["sequences_equal"] == f"{len(prompts)}/{len(prompts)}"
    return out


# -- sampler on the device ----------------------------------------------------------------

class _Allowed:
    """A structured-output constraint allowing a fixed token set (a bitmask row)."""

    def __init__(self, bits) -> None:  # noqa: ANN001
        self.bits = bits

    def fill(self, bitmask, row: int) -> None:  # noqa: ANN001
        bitmask[row] = self.bits

    def accept(self, token: int) -> bool:
        return bool((int(self.bits[token // 32]) >> (token % 32)) & 1)


def check_sampler(ctx) -> dict:
    """The sampler on the logits' device vs on the CPU: same tokens (each
    row's uniforms are drawn on the CPU either way), and the time of one
    batch of 256 rows over Llama 3's vocabulary, a quarter of them under a
    structured-output mask (each must draw an allowed token)."""
    import torch

    from carpool.model.sampler import Sampler, SamplingRow
    from carpool.sampling_params import SamplingParams

    vocab, batch = (128256, 256) if not ctx.dry_run else (1000, 16)
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_k=50),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, min_p=0.05),
             dict(temperature=0.9, top_p=0.3, repetition_penalty=1.2),
             dict(temperature=0.0, logprobs=5)]
    bits = torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(**kinds[i % len(kinds)]), seed=i, step=3,
                        prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5],
                        constraint=_Allowed(bits) if i % 4 == 0 else None)
            for i in range(batch)]
    logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
              ).to(torch.bfloat16)
    sampler = Sampler(vocab)
    timings, tokens = {}, {}
    for where in ("cpu", ctx.device.type):
        on = logits.to(where)
        sampler.sample(on, rows)
        sync(ctx)
        start = time.perf_counter()
        tokens[where] = [r.token_id for r in sampler.sample(on, rows)]
        sync(ctx)
        timings[where] = (time.perf_counter() - start) * 1e3
    same = sum(a == b for a, b in zip(tokens["cpu"], tokens[ctx.device.type]))
    allowed = all(r.constraint.accept(tokens[ctx.device.type][i])
                  for i, r in enumerate(rows) if r.constraint is not None)
    return {"rows": batch, "vocab": vocab, "same_tokens": f"{same}/{batch}",
            "masked_rows": batch // 4, "masked_tokens_allowed": allowed,
            "cpu_ms": timings["cpu"], "device_ms": timings[ctx.device.type],
            "ok": same >= 0.9 * batch and allowed}


# -- 3 and 4. throughput and roofline ------------------------------------------------------

def bench_model(ctx, label: str, shape: dict) -> dict:
    """Offline throughput and decode-step time vs the bandwidth roofline,
    eager and with graphs, on one engine (its graphs switched off and on)."""
    from carpool import SamplingParams

    batches = (1, 64, 256) if not ctx.dry_run else (1, 4)
    prompt_len, out_len, context = (128, 128, 256) if not ctx.dry_run else (16, 4, 24)
    # No prefix caching: both modes run the same prompts, and the step
    # timing below writes into free (possibly cached) blocks.
    llm = build_llm(shape, ctx, dtype="bfloat16" if not ctx.dry_run else "float32",
                    attention_backend="triton", max_num_seqs=max(batches),
                    enable_prefix_caching=False)
    executor = llm.engine.executor
    graphs = executor.graphs
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(4, prompt_len, shape["vocab_size"], 7), params)  # compile
    rows = []
    for batch in batches:
        prompts = random_prompts(batch, prompt_len, shape["vocab_size"], seed=batch)
        for mode in ("eager", "graphs"):
            executor.graphs = graphs if mode == "graphs" else None
            sync(ctx)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync(ctx)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            step_s = decode_step_seconds(ctx, executor, batch, context,
                                         repeats=20 if not ctx.dry_run else 2)
            rows.append({"model": label, "batch": batch, "mode": mode, "wall_s": wall,
                         "output_tok_per_s": tokens / wall, "decode_step_ms": step_s * 1e3,
                         "roofline_ms": roofline_s(executor, batch, context) * 1e3})
            print(json.dumps(rows[-1]), flush=True)
    executor.graphs = None  # profile eager steps: the same kernels, each visible
    profiles = {batch: profile_decode(ctx, executor, batch, context) for batch in (1, batches[-1])}
    executor.graphs = graphs
    waste = graphs.stats.padding_waste if graphs is not None else None
    del llm, executor, graphs
    return {"rows": rows, "graph_padding_waste": waste, "eager_decode_profile": profiles}


def profile_decode(ctx, executor, batch: int, context: int, steps: int = 5) -> dict:
    """Device time per kernel over eager decode steps (torch.profiler): where
    a step's time goes, and device busy time against the wall."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    decode_step_seconds(ctx, executor, batch, context, repeats=1)  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        decode_step_seconds(ctx, executor, batch, context, repeats=steps)
        wall = time.perf_counter() - start
    attr = "device_time_total" if ctx.device.type == "cuda" else "cpu_time_total"
    kernels = [(e.key, getattr(e, attr, 0.0), e.count) for e in prof.key_averages()
               if ctx.device.type != "cuda" or getattr(e, "device_type", None)
               == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda k: -k[1])
    total_us = sum(k[1] for k in kernels) if ctx.device.type == "cuda" else float("nan")
    per_step = steps + 1  # decode_step_seconds runs one untimed step first
    return {"wall_ms_per_step": wall / per_step * 1e3,
            "device_busy_ms_per_step": total_us / per_step / 1e3,
            "kernels_per_step": sum(k[2] for k in kernels) / per_step,
            "top": [{"name": name[:80], "ms_per_step": us / per_step / 1e3,
                     "calls_per_step": count / per_step} for name, us, count in kernels[:10]]}


def decode_step_seconds(ctx, executor, batch: int, context: int, repeats: int = 20) -> float:
    """Mean seconds of one decode step of ``batch`` sequences at ``context``
    (the executor alone: no scheduler), blocks laid out contiguously."""
    from carpool.executor.base import BatchItem
    from carpool.model.sampler import SamplingRow
    from carpool.sampling_params import SamplingParams

    per_seq = -(-(context + 1) // executor.block_size)
    if batch * per_seq > executor.num_blocks:
        return float("nan")
    row = SamplingRow(SamplingParams(temperature=0.0), seed=0, step=0)
    items = [BatchItem(str(i), [2] * (context + 1), context, 1,
                       list(range(i * per_seq, (i + 1) * per_seq)), row) for i in range(batch)]
    executor.execute(items)
    sync(ctx)
    start = time.perf_counter()
    for _ in range(repeats):
        executor.execute(items)
    sync(ctx)
    return (time.perf_counter() - start) / repeats


def roofline_s(executor, batch: int, context: int) -> float:
    """(weights read once + the batch's K/V) / HBM bandwidth."""
    model = executor.model
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if "embed_tokens" not in name or model.lm_head is None)
    config = model.config
    kv_bytes = (batch * (context + 1) * config.num_layers * 2 * config.num_kv_heads
                * config.head_dim * executor.kv_caches[0][0].element_size())
    return (weight_bytes + kv_bytes) / HBM_BYTES_PER_S


def check_throughput(ctx) -> dict:
    models = [("tiny", TINY)] if ctx.dry_run else [("SmolLM2-135M", SMOL),
                                                    ("Llama-3-8B", LLAMA3_8B)]
    return {label: bench_model(ctx, label, shape) for label, shape in models}


def check_parallel(ctx) -> dict:
    """Tensor parallel size 2 against 1 (fp32: the same greedy tokens) and
    the step time with one batch and with two micro-batches, waiting on
    collectives included (scripts/tp_step_bench.py). Rank r runs on cuda:r:
    with one GPU this says so and runs nothing (NCCL takes one rank per GPU)."""
    import subprocess
    import tempfile

    import torch

    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if ctx.device.type == "cuda" and gpus < 2:
        return {"skipped": f"{gpus} GPU here: tensor parallel size 2 needs two"}
    layers, steps = (2, 3) if ctx.dry_run else (8, 20)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("tp_step_bench.py")),
                        "--device", ctx.device.type, "--dtype", "float32", "--layers",
                        str(layers), "--steps", str(steps), "--json", str(out)],
                       check=True, timeout=600)
        rows = json.loads(out.read_text())
    alone = rows["TP 1"]
    same = all(rows[name][kind]["tokens"] == alone[kind]["tokens"]
               for name in rows for kind in ("decode", "prefill"))
    timings = {name: {kind: {k: round(v, 2) for k, v in row[kind].items() if k != "tokens"}
                      for kind in ("decode", "prefill")} for name, row in rows.items()}
    return {"gpus": gpus, "tokens_equal": same, "timings_ms": timings, "ok": same}


def environment(ctx) -> dict:
    import torch

    info = {"torch": torch.__version__, "device": str(ctx.device), "dry_run": ctx.dry_run,
            "date": time.strftime("%Y-%m-%d")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if ctx.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


class Context:
    def __init__(self, dry_run: bool) -> None:
        import torch

        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.engine_knobs = {"device": self.device.type, "max_num_batched_tokens": 8192,
                             "kv_cache_memory": "24GiB" if not dry_run else "64MiB"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="results JSON path")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny model, Triton interpreter, eager graphs")
    parser.add_argument("--only", default="", help="comma list of sections to run")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ctx = Context(args.dry_run)
    sections = {"environment": environment, "kernels": check_kernels, "greedy": check_greedy,
                "sampler": check_sampler, "throughput": check_throughput,
                "parallel": check_parallel}
    # The dry run proves "parallel" alone (--only parallel): by default it
    # keeps to one process, as its test expects.
    wanted = [s for s in args.only.split(",") if s] or [
        s for s in sections if not (args.dry_run and s == "parallel")]
    results: dict = {}
    for name in wanted:
        start = time.perf_counter()
        try:
            results[name] = sections[name](ctx)
        except Exception as exc:  # noqa: BLE001 - keep the other sections' results
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        results[name]["seconds"] = round(time.perf_counter() - start, 1) \
            if isinstance(results[name], dict) else None
        print(f"== {name}: {json.dumps(results[name])[:2000]}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    failed = [n for n in wanted if isinstance(results[n], dict) and results[n].get("ok") is False]
    print("gpu_check:", "FAILED " + ",".join(failed) if failed else "ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
