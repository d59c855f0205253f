"""A thread-safe cache of values loaded on first use (soft prompts, LoRA adapters).

`get(key, load)` returns the cached value or runs `load()` once: a second caller of the same
key waits for the first load instead of repeating it, callers of other keys do not wait. Values
are kept within a byte budget (and an optional count), least recently used evicted first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoadedCache(Generic[T]):
    def __init__(
        self,
        what: str,
        size_of: Callable[[T], int],
        max_bytes: int,
        too_big: Callable[[str], Exception],
        max_items: int | None = None,
    ) -> None:
        self.what = what  # for log lines: "soft prompt", "LoRA adapter"
        self._size_of = size_of
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._too_big = too_big
        self._values: OrderedDict[str, T] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self.loads = self.evictions = 0

    def peek(self, key: str) -> T | None:
        """The cached value of `key` (now the most recently used), or None; never loads."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            return None

    def get(self, key: str, load: Callable[[], T]) -> T:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            try:
                with self._lock:
                    if key in self._values:
                        return self._values[key]
                value = load()
                self._admit(key, value)
                return value
            finally:
                with self._lock:
                    self._loading.pop(key, None)

    def _admit(self, key: str, value: T) -> None:
        size = self._size_of(value)
        if size > self.max_bytes:
            raise self._too_big(key)
        with self._lock:
            self.loads += 1
            while self._values and (
                self._used + size > self.max_bytes
                or (self.max_items is not None and len(self._values) >= self.max_items)
            ):
                evicted, old = self._values.popitem(last=False)
                self._used -= self._size_of(old)
                self.evictions += 1
                logger.info("%s %s evicted (least recently used)", self.what, evicted[:200])
            self._values[key] = value
            self._used += size

    def drop(self, key: str) -> None:
        """Forget `key`'s value (a holder of it keeps it); nothing if it is not cached."""
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._used -= self._size_of(value)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._values)
