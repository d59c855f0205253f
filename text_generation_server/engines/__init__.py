"""Engine classes by DEPLOYMENT_FRAMEWORK name, imported lazily from the registry in
text_generation_common/engines.py (which also records each engine's capabilities).

An unknown name is an error listing the choices; an engine is never swapped for another.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from text_generation_common.engines import engine_spec

if TYPE_CHECKING:
    from text_generation_server.engines.base import ModelEngine


def get_engine_class(name: str) -> type[ModelEngine]:
    module_name, _, class_name = engine_spec(name).target.partition(":")
    engine_class: type[ModelEngine] = getattr(importlib.import_module(module_name), class_name)
    return engine_class
