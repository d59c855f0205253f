"""Engine registry: DEPLOYMENT_FRAMEWORK name -> engine class, imported lazily.

An unknown name is an error listing the choices; an engine is never swapped for another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from text_generation_server.engines.base import ModelEngine

ENGINES: dict[str, str] = {
    "hf_transformers": "text_generation_server.engines.hf_transformers:HFTransformersEngine",
}


def get_engine_class(name: str) -> type[ModelEngine]:
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown deployment framework {name!r}; choose one of: {', '.join(sorted(ENGINES))}"
        ) from None
    module_name, _, class_name = target.partition(":")
    engine_class: type[ModelEngine] = getattr(importlib.import_module(module_name), class_name)
    return engine_class
