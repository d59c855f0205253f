"""The Batch contract: the state of a group of requests that run their steps together.

A Batch owns its requests' device state (inputs, attention masks, KV cache, sampling state).
Its engine builds it from requests (each batch type's own `from_requests`, typed by what that
type needs: per-request errors beside it); the shard server keeps batches in a cache keyed by
batch id and only ever:
  - drops finished requests             (prune, without recomputing anything),
  - merges several into one             (Batch.concatenate, cached under the first id),
  - hands it to its engine for a step   (ModelEngine.generate_token), also ahead of the router's
                                        call while some request may still generate (remaining,
                                        ended).
Engines define the concrete classes (e.g. left-padded rectangles with a KV cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Self


class Batch(ABC):
    batch_id: int

    @classmethod
    @abstractmethod
    def concatenate(cls, batches: Sequence[Self]) -> Self:
        """Merge batches (row order: batches in order); the result keeps the first id."""

    @abstractmethod
    def prune(self, completed_ids: set[int]) -> Self | None:
        """Drop the given requests; returns None when nothing is left."""

    @abstractmethod
    def remaining(self) -> int:
        """The most tokens any request of the batch may still generate (0: all are done)."""

    @abstractmethod
    def done_ids(self) -> set[int]:
        """The requests that have had every token they may take (max_new_tokens): a step past
        them would write K/V beyond the length their request was admitted with."""

    def ended(self) -> bool:
        """Every request has had its last token for sure (max_new_tokens, or EOS where it ends
        the request): a step now is for nothing, as the router drops its tokens. Batch types
        that cannot tell say False."""
        return False

    def without_done(self) -> Self | None:
        """This batch without its `done_ids` rows (itself when there are none); None when no
        row is left. What a step taken before the router's next call runs on."""
        done = self.done_ids()
        return self.prune(done) if done else self

    @property
    @abstractmethod
    def request_ids(self) -> list[int]:
        """Request ids in row order."""

    def __len__(self) -> int:
        return len(self.request_ids)
