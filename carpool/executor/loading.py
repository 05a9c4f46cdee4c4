"""The model an engine serves, loaded as its executor will run it."""
from __future__ import annotations

from pathlib import Path

from carpool.executor.torch_executor import resolve_device, resolve_dtype
from carpool.model.loader import LoadedModel, load_model
from carpool.model_settings import ModelSettings
from carpool.paths import default_cache_dir


def load_served_model(settings: ModelSettings) -> tuple[LoadedModel, int]:
    """The model ``settings`` name, in the dtype it will run in (a GGUF file
    is converted to it; the settings' tokenizer and chat template replace the
    model's own), and the context length it is served at (``max_model_len``
    within the model's)."""
    cache_dir = Path(settings.cache_dir) if settings.cache_dir else default_cache_dir()
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    loaded = load_model(settings.model, cache_dir, dtype, tokenizer=settings.tokenizer,
                        chat_template=settings.chat_template)
    max_len = loaded.config.max_position_embeddings
    if settings.max_model_len:
        max_len = min(max_len, settings.max_model_len)
    return loaded, max_len
