"""Host values to device tensors without waiting for the device.

`torch.tensor(values, device=cuda)` copies from pageable memory: the host waits until the copy,
and so every kernel queued before it (a step's forward), is done. A chooser built while a
forward runs (a prompt that completes in this step) would wait for it there. `to_device`
stages the values in pinned memory and copies them non-blocking: the copy is queued on the
current stream before any kernel that reads the tensor, and torch's pinned-memory allocator
keeps the staging block until the copy has run. On CPU it is a plain tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor of `values` (numbers, or nested sequences of them) on `device`."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
