"""A size-aware LRU with hit statistics, on top of ``cachetools.LRUCache``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import cachetools

from mmcache.items import item_size

__all__ = ["CacheInfo", "LRUCache"]


class CacheInfo(NamedTuple):
    """Lookup statistics: ``hits`` out of ``total`` lookups."""

    hits: int
    total: int

    @property
    def hit_ratio(self) -> float:
        """``hits / total``, or 0.0 before the first lookup."""
        return self.hits / self.total if self.total else 0.0

    def __sub__(self, other: CacheInfo) -> CacheInfo:
        return CacheInfo(self.hits - other.hits, self.total - other.total)


class LRUCache(cachetools.LRUCache):  # type: ignore[type-arg]
    """Least-recently-used cache bounded by the total size of its values.

    ``capacity_bytes`` bounds the sum of ``getsizeof(value)`` (by default :func:`item_size`).
    Only :meth:`get` counts towards the statistics; ``key in cache`` neither counts nor
    changes recency; ``cache[key]`` makes ``key`` most recent without counting.  Inserting
    evicts least-recent entries until the value fits; since the recency order only ever
    holds keys that are in the cache, eviction always terminates.
    """

    def __init__(
        self, capacity_bytes: float, getsizeof: Callable[[Any], int] = item_size
    ) -> None:
        super().__init__(capacity_bytes, getsizeof)
        self.evictions = 0
        """Entries evicted to make room (not those popped or cleared)."""
        self._hits = 0
        self._total = 0
        self._last = CacheInfo(0, 0)

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (made most recent) or ``default``; counts one lookup."""
        self._total += 1
        if key in self:
            self._hits += 1
            return self[key]
        return default

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or replace ``key`` as most recent (``ValueError`` if it can never fit)."""
        self[key] = value

    def put_if_fits(self, key: Hashable, value: Any) -> bool:
        """Insert like :meth:`put` and return True, or return False (inserting nothing)
        when the value alone exceeds the capacity."""
        if self.getsizeof(value) > self.maxsize:
            return False
        self[key] = value
        return True

    def touch(self, key: Hashable) -> None:
        """Make ``key`` most recent; a no-op when it is absent (no entry is created)."""
        if key in self:
            self[key]  # noqa: B018  (cachetools' __getitem__ moves the key to the end)

    def popitem(self) -> tuple[Hashable, Any]:
        """Evict the least recently used entry (cachetools calls this to make room)."""
        evicted = super().popitem()
        self.evictions += 1
        return evicted

    def pop(self, key: Hashable, default: Any = None) -> Any:
        """Remove ``key`` and return its value, or ``default`` when absent; counts nothing."""
        return super().pop(key, default)

    def clear(self) -> None:
        """Remove every entry and reset the statistics (evictions included)."""
        super().clear()
        self.evictions = 0
        self._hits = 0
        self._total = 0
        self._last = CacheInfo(0, 0)

    def stat(self, delta: bool = False) -> CacheInfo:
        """Cumulative statistics, or with ``delta=True`` the change since the previous
        delta call."""
        info = CacheInfo(self._hits, self._total)
        if not delta:
            return info
        change, self._last = info - self._last, info
        return change

    def recency_order(self) -> list[Hashable]:
        """Keys from least to most recently used (the order eviction follows); O(n)."""
        # cachetools exposes the order only through popitem(); pop from a shallow copy.
        shadow = copy.copy(self)
        return [shadow.popitem()[0] for _ in range(len(shadow))]
