"""carpool: an LLM inference server whose scheduler carpools requests.

``from carpool import LLM, SamplingParams`` for offline generation,
``AsyncEngine`` for streaming. Heavy modules (torch) load on first use, so
``import carpool.scheduler`` stays torch-free for the simulator.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "EngineConfig", "LLMEngine", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "carpool.engine.llm",
    "LLMEngine": "carpool.engine.llm_engine",
    "AsyncEngine": "carpool.engine.async_engine",
}

if TYPE_CHECKING:
    from carpool.engine.async_engine import AsyncEngine
    from carpool.engine.llm import LLM
    from carpool.engine.llm_engine import LLMEngine


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
