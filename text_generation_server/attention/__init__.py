"""Paged attention for the tgis_native engine: the transformers hook (paged.py), the step layout
(layout.py) and the decode backends (backend.py: sdpa.py, cpu_kernel.py, triton.py), one picked
per engine, once, at load (`pick_backend`):
  - CPU, by CPU_ATTENTION: `kernel` (our C++ kernel; a build failure stops the shard), `sdpa`,
    or `auto` (the kernel where it builds, else SDPA with the reason as a warning);
  - CUDA, by GPU_ATTENTION: `triton` (our Triton kernel; refused where triton does not import),
    `sdpa`, or `auto` (Triton where it imports, else SDPA with a warning).
"""

from __future__ import annotations

import logging

import torch

from text_generation_server.attention.backend import AttentionBackend
from text_generation_server.attention.sdpa import SdpaBackend
from text_generation_server.kernels import cpu_kernels, paged_decode_triton

logger = logging.getLogger(__name__)


def pick_backend(cpu_attention: str, gpu_attention: str, device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        if gpu_attention == "sdpa":
            return SdpaBackend()
        if not paged_decode_triton.available():
            if gpu_attention == "triton":
                raise ValueError("GPU_ATTENTION=triton: the triton package does not import here")
            logger.warning(
                "GPU_ATTENTION=auto: decode attention runs on SDPA, because triton does not import"
            )
            return SdpaBackend()
        from text_generation_server.attention.triton import TritonBackend

        return TritonBackend()
    if cpu_kernels.use_kernel(cpu_attention, device):
        from text_generation_server.attention.cpu_kernel import CpuKernelBackend

        return CpuKernelBackend()
    return SdpaBackend()
