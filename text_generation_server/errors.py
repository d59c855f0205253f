"""Errors the shard raises on purpose; server.py maps each to one gRPC status code.

Per-request failures are not exceptions: they travel as `RequestError`s beside the batch.
"""

from __future__ import annotations


class ShardError(Exception):
    """A whole call failed because of its input; the shard itself is fine."""


class BatchNotFoundError(ShardError):
    """A batch id is not in the cache (NOT_FOUND)."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(f"Batch ID {batch_id} not found in cache.")


class InvalidBatchError(ShardError):
    """A call's batches or requests are malformed (INVALID_ARGUMENT)."""


class PrefixNotFoundError(ShardError):
    """A soft prompt or adapter does not exist (NOT_FOUND)."""

    def __init__(self, prefix_id: str, what: str = "prefix") -> None:
        super().__init__(f'{what} id "{prefix_id}" not found')


def is_out_of_memory(exc: BaseException) -> bool:
    """True for device or host allocation failures (reported as RESOURCE_EXHAUSTED)."""
    if isinstance(exc, MemoryError):
        return True
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in message or "can't allocate memory" in message
    )
