"""The architectures carpool serves, in one registry: to add a family, write
its module here (an ``Architecture``: how its config reads), list it in
``ARCHITECTURES``, and give the decoder (carpool/model/decoder.py) any
part it lacks. Plain Python: no torch."""
from __future__ import annotations

import types

from carpool.model.arch.base import Architecture
from carpool.model.arch.deepseek import DEEPSEEK_V3
from carpool.model.arch.gemma3 import GEMMA3, GEMMA3_TEXT
from carpool.model.arch.llama import LLAMA, MISTRAL, QWEN2
from carpool.model.arch.moe_families import MIXTRAL, QWEN3_MOE
from carpool.model.arch.qwen3 import QWEN3

ARCHITECTURES = types.MappingProxyType({a.model_type: a for a in (
    LLAMA, QWEN2, MISTRAL, QWEN3, GEMMA3_TEXT, GEMMA3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)})
_BY_CLASS = types.MappingProxyType({a.hf_class: a for a in ARCHITECTURES.values()})


def architecture_of(d: dict) -> Architecture:
    """The architecture a HF config dict names (``model_type``, else its
    ``architectures`` classes); ValueError naming what is supported."""
    model_type = d.get("model_type")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    classes = d.get("architectures") or []
    for cls in classes:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    raise ValueError(
        f"unsupported model architecture (model_type={model_type!r}, architectures={classes!r}); "
        f"supported: {', '.join(sorted(_BY_CLASS))}")


__all__ = ["ARCHITECTURES", "Architecture", "architecture_of"]
