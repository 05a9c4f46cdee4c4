"""The model an engine serves, loaded as its executor will run it, and
that executor: the model here, or a tensor-parallel replica's rank 0."""
from __future__ import annotations

from pathlib import Path

from carpool.config import EngineConfig
from carpool.executor.base import Executor
from carpool.executor.torch_executor import TorchExecutor, resolve_device, resolve_dtype
from carpool.model.loader import LoadedModel, load_model
from carpool.model_settings import ModelSettings
from carpool.paths import default_cache_dir


def load_served_model(settings: ModelSettings) -> tuple[LoadedModel, int]:
    """The model ``settings`` name, in the dtype it will run in (a GGUF file
    is converted to it; the settings' tokenizer and chat template replace the
    model's own), and the context length it is served at (``max_model_len``
    within the model's)."""
    cache_dir = Path(settings.cache_dir) if settings.cache_dir else default_cache_dir()
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device), settings.cpu_isa)
    loaded = load_model(settings.model, cache_dir, dtype, tokenizer=settings.tokenizer,
                        chat_template=settings.chat_template)
    max_len = loaded.config.max_position_embeddings
    if settings.max_model_len:
        max_len = min(max_len, settings.max_model_len)
    return loaded, max_len


def build_executor(config: EngineConfig, loaded: LoadedModel, max_len: int,
                   kernels_in_background: bool, start_followers=None) -> Executor:  # noqa: ANN001
    """The replica's executor: the model here, or (``--tensor-parallel-size``
    N > 1) rank 0's slice with the other ranks started by
    ``start_followers`` (a ``tensor_parallel.FollowerStarter``; None:
    processes of this machine)."""
    settings, tp, followers = config.model, None, []
    if settings.tensor_parallel_size > 1:
        from carpool.executor import tensor_parallel

        tp, followers = tensor_parallel.start_followers(config, start_followers)
    try:
        executor = TorchExecutor(loaded.config, loaded.weights, settings, config.cache, max_len,
                                 max_num_seqs=config.scheduler.max_num_seqs,
                                 kernels_in_background=kernels_in_background, tp=tp)
    except BaseException:
        for follower in followers:
            follower.kill()
        raise
    if tp is None:
        return executor
    from carpool.executor.tensor_parallel import TensorParallelExecutor

    return TensorParallelExecutor(executor, tp, followers, loaded.config)
