"""The `tgis_native` engine: ragged batches over a paged KV cache (engine.py), the model runner
that packs inputs and runs the forward passes (runner.py), and the CUDA graphs of its
decode-only steps (graphs.py)."""

from text_generation_server.engines.tgis_native.engine import (
    SUPPORTED_MODEL_TYPES,
    RequestState,
    TgisNativeEngine,
    sliding_window,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "RequestState", "TgisNativeEngine", "sliding_window"]
