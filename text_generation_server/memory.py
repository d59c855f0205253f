"""The batch-weight (memory) model the shard reports to the router.

The router sizes batches with TGIS's weight formulas (see proto/generate.proto,
MemoryScalingModel); this module chooses the coefficients and the limit (ESTIMATE_MEMORY):

  auto    analytic, in bytes: KV-cache bytes per input/output token measured on the loaded model,
          activation bytes per prefill token from its config, and a limit of the free memory
          (device memory on CUDA, MemAvailable on the host) minus BATCH_SAFETY_MARGIN percent.
          Improves on TGIS's empirical search, which needs a GPU and minutes of probing.
  manual  TGIS's abstract units: capacity about P^2 * max_sequence_length * max_batch_size
          tokens, P = (100 - margin) / 100.
  off     no limit but MAX_BATCH_SIZE.
Called by engines (facts) and server startup (estimate).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from text_generation_common.messages import MemoryScalingModel

logger = logging.getLogger(__name__)

MODES = ("auto", "manual", "off")
UNLIMITED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    """What one request costs on the loaded model, in bytes."""

    kv_bytes_per_input_token: int  # resident for the whole request (KV of prompt positions)
    kv_bytes_per_output_token: int  # resident per generated token
    prefill_bytes_per_token: int  # transient activations while a prompt token is prefilled
    free_bytes: int  # memory available for batches after the model was loaded


def estimate(
    mode: str, facts: MemoryFacts, *, max_sequence_length: int, max_batch_size: int, safety_margin: int
) -> MemoryScalingModel:
    if mode not in MODES:
        raise ValueError(f"unknown memory estimation mode {mode!r}; choose one of {', '.join(MODES)}")
    if not 0 <= safety_margin < 100:
        raise ValueError(f"batch safety margin must be in [0, 100), got {safety_margin}")
    usable = (100 - safety_margin) / 100
    if mode == "off":
        return MemoryScalingModel(0.0, 0.0, 0.0, 0.0, 0.0, UNLIMITED)
    if mode == "manual":
        per_token = 100 / (usable * max_sequence_length * max_batch_size)
        quadratic = 100 / (usable * max_sequence_length**2 * max_batch_size)
        return MemoryScalingModel(0.0, 0.0, quadratic, per_token, per_token, math.floor(usable * 100))
    model = MemoryScalingModel(
        prefill_linear_coef0=float(facts.prefill_bytes_per_token + facts.kv_bytes_per_input_token),
        prefill_quadratic_coef0=0.0,
        prefill_quadratic_coef1=0.0,
        nexttoken_linear_coef0=float(facts.kv_bytes_per_input_token),
        nexttoken_linear_coef1=float(facts.kv_bytes_per_output_token),
        weight_limit=math.floor(facts.free_bytes * usable),
    )
    per_token = max(facts.kv_bytes_per_input_token, facts.kv_bytes_per_output_token)
    logger.info(
        "memory model: %d KV bytes per token, %.1f GiB for batches (%d%% held back): about %d tokens",
        per_token,
        model.weight_limit / 2**30,
        safety_margin,
        model.weight_limit // max(per_token, 1),
    )
    return model


def cuda_available_bytes(device: torch.device, fraction: float) -> int:
    """What this process may still allocate on CUDA `device`: its CUDA_PROCESS_MEMORY_FRACTION
    share of the card less what it holds already, and never more than the card has free (other
    processes on the same card count against the free memory only)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, min(free, int(total * fraction) - torch.cuda.memory_allocated(device)))


def host_available_bytes() -> int:
    """MemAvailable of this host (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
