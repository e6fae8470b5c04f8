"""The cache classes of P0 (senders) and P1/workers (receivers), and their shared bases.

P0 input items are ``(Item, prompt_updates)`` or ``None`` (the caller believes the item is
cached); P0 output items are ``(Item | ShmHandle | None, prompt_updates)``.  Receivers
resolve :class:`~mmcache.items.Feature` ``data`` in place.

Mirroring (``lru`` mode): :class:`SenderCache` (P0) and :class:`ReceiverCache` (P1) apply the
same operations in the same order with the same size function, so their LRUs hold the same
keys in the same recency order and P0 knows, without asking, which items P1 holds.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeAlias, TypeVar

from mmcache.errors import CacheMissError
from mmcache.items import CachedItem, Item, ItemMetadata, ShmHandle
from mmcache.lru import CacheInfo, LRUCache

__all__ = [
    "BaseCache",
    "BaseReceiverCache",
    "BaseSenderCache",
    "FeatureLike",
    "ProcessorOnlyCache",
    "ReceiverCache",
    "SenderCache",
    "SenderInput",
    "SenderOutput",
]

logger = logging.getLogger("mmcache")

GiB = 1 << 30

SenderInput: TypeAlias = tuple[Item, Any] | None
"""What P0 passes per item: ``(item, prompt_updates)``, or ``None`` when it believes the
item is cached."""
SenderOutput: TypeAlias = tuple[Item | ShmHandle | None, Any]
"""What P0 gets back per item: ``(data to send, prompt_updates)``."""

InT = TypeVar("InT")
OutT = TypeVar("OutT")


class FeatureLike(Protocol):
    """What receivers need of a feature (:class:`~mmcache.items.Feature` or the engine's)."""

    data: Any
    mm_hash: str | None
    identifier: str


def capacity_bytes(capacity_gb: float) -> int:
    """``capacity_gb`` GiB as whole bytes (``ValueError`` if negative)."""
    if not capacity_gb >= 0:
        raise ValueError(f"capacity_gb must be a non-negative number, not {capacity_gb!r}")
    return int(capacity_gb * GiB)


class BaseCache(ABC, Generic[InT, OutT]):
    """What every cache has: per-item and batched updates, clearing, closing, and the
    accounting of items served uncached (counted, logged once per reason)."""

    def __init__(self) -> None:
        self._uncached = {"oversize": 0, "full": 0}
        self._warned: set[str] = set()

    @abstractmethod
    def get_and_update_item(self, item: InT, mm_hash: str) -> OutT:
        """Resolve one item against the cache and update the cache with it."""

    def get_and_update(self, items: Sequence[InT], mm_hashes: Sequence[str]) -> list[OutT]:
        """:meth:`get_and_update_item` for each ``(item, mm_hash)`` pair, in order."""
        if len(items) != len(mm_hashes):
            raise ValueError(f"{len(items)} items but {len(mm_hashes)} mm_hashes")
        return [self.get_and_update_item(item, h) for item, h in zip(items, mm_hashes)]

    @abstractmethod
    def clear_cache(self) -> None:
        """Forget every cached item."""

    def close(self) -> None:
        """Release the resources the cache holds (nothing, unless it uses shared memory)."""

    def stats(self) -> dict[str, int]:
        """Counters; ``uncached_oversize`` / ``uncached_full`` count items served uncached."""
        return {f"uncached_{reason}": n for reason, n in self._uncached.items()}

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _serve_uncached(self, reason: str, message: str) -> None:
        """Count an item served uncached; log the first one of each reason."""
        self._uncached[reason] += 1
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(
                "%s; serving it uncached. Further items served uncached for this reason are "
                "counted in stats()['uncached_%s'] and not logged.",
                message,
                reason,
            )

    def _cache_if_fits(self, lru: LRUCache, key: str, value: Any) -> None:
        """Store ``value`` under ``key``, or serve it uncached when it exceeds the capacity.

        An oversize value also drops what was stored under ``key``, so the stale entry can
        never be returned in place of the fresh data (a no-op when the sides are mirrored:
        both missed ``key``).
        """
        if lru.put_if_fits(key, value):
            return
        lru.pop(key)
        size, capacity = lru.getsizeof(value), lru.maxsize
        self._serve_uncached(
            "oversize",
            f"item {key} is {size / GiB:.3f} GiB, more than the cache's capacity_gb="
            f"{capacity / GiB:.3f} (raise capacity_gb to cache items this large)",
        )


class BaseSenderCache(BaseCache[SenderInput, SenderOutput]):
    """A P0 cache.  P0 calls :meth:`touch_sender_cache_item` for every hash of a request,
    then :meth:`get_and_update_item` for each item of it."""

    @abstractmethod
    def is_cached_item(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached; changes neither recency nor statistics."""

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        """:meth:`is_cached_item` for each hash."""
        return [self.is_cached_item(h) for h in mm_hashes]

    @abstractmethod
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Protect ``mm_hash`` while its request is assembled (see the subclasses)."""

    def release_sender_touches(self) -> None:
        """Drop the protection of touched items whose update will never come."""

    @abstractmethod
    def invalidate(self, mm_hash: str) -> None:
        """Forget ``mm_hash`` (after a receiver reported it missing); a no-op if absent."""

    @abstractmethod
    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """Hits out of lookups; with ``delta=True`` the change since the last delta call."""


class BaseReceiverCache(BaseCache[Any, Any]):
    """A P1 or worker cache: resolves the data of a request's features."""

    @abstractmethod
    def touch_receiver_cache_item(self, mm_hash: str, item: Any = None) -> None:
        """Called for every feature of a request before any is resolved."""

    def get_and_update_features(self, features: Sequence[FeatureLike]) -> Sequence[FeatureLike]:
        """Resolve every feature's ``data`` in place and return ``features``.

        Touches every key first, then resolves each feature; a miss does not stop the others
        (healthy items are still ingested).  Raises one :class:`CacheMissError` listing every
        missing hash in request order.
        """
        keys = [f.mm_hash or f.identifier for f in features]
        for feature, key in zip(features, keys):
            self.touch_receiver_cache_item(key, feature.data)
        missing: list[str] = []
        for feature, key in zip(features, keys):
            try:
                feature.data = self.get_and_update_item(feature.data, key)
            except CacheMissError as miss:
                missing.extend(miss.mm_hashes)
        if missing:
            raise CacheMissError(missing)
        return features


def split_sender_input(item: SenderInput, mm_hash: str) -> tuple[Item, Any]:
    """``(item, prompt_updates)`` of a P0 input; ``CacheMissError`` for ``None``."""
    if item is None:
        raise CacheMissError([mm_hash])
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise TypeError(
            f"P0 input for {mm_hash} must be (item, prompt_updates) or None, "
            f"not {type(item).__qualname__}"
        )
    return item[0], item[1]


class _LruSenderCache(BaseSenderCache):
    """A P0 cache over an :class:`LRUCache`; subclasses choose what an entry keeps."""

    def __init__(self, capacity_gb: float) -> None:
        super().__init__()
        self._lru = LRUCache(capacity_bytes(capacity_gb))

    @abstractmethod
    def _entry(self, item: Item, prompt_updates: Any) -> Any:
        """What to store for a missed item."""

    @abstractmethod
    def _hit(self, entry: Any) -> SenderOutput:
        """What to return for a stored entry."""

    def get_and_update_item(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        """A hit returns the stored entry's output; a miss stores the item if it fits and
        returns it as given.  ``CacheMissError`` for a miss without data."""
        entry = self._lru.get(mm_hash)
        if entry is not None:
            return self._hit(entry)
        data, prompt_updates = split_sender_input(item, mm_hash)
        self._cache_if_fits(self._lru, mm_hash, self._entry(data, prompt_updates))
        return data, prompt_updates

    def is_cached_item(self, mm_hash: str) -> bool:
        return mm_hash in self._lru

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Make ``mm_hash`` most recent (a no-op when absent), as the receiver does."""
        self._lru.touch(mm_hash)

    def invalidate(self, mm_hash: str) -> None:
        self._lru.pop(mm_hash)

    def clear_cache(self) -> None:
        """Forget every item and reset the statistics."""
        self._lru.clear()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        return self._lru.stat(delta)

    def stats(self) -> dict[str, int]:
        hits, total = self._lru.stat()
        return {**_lru_stats(self._lru), "hits": hits, "total": total, **super().stats()}

    def keys(self) -> list[Hashable]:
        """Cached hashes, least recently used first."""
        return self._lru.recency_order()


def _lru_stats(lru: LRUCache) -> dict[str, int]:
    return {
        "entries": len(lru),
        "evictions": lru.evictions,
        "used_bytes": int(lru.currsize),
        "capacity_bytes": int(lru.maxsize),
    }


class ProcessorOnlyCache(_LruSenderCache):
    """P0 cache of full items, for when nothing is cached downstream: saves re-processing.

    A hit returns the stored ``(item, prompt_updates)``.
    """

    def _entry(self, item: Item, prompt_updates: Any) -> CachedItem:
        return CachedItem(item, prompt_updates)

    def _hit(self, entry: CachedItem) -> SenderOutput:
        return entry.item, entry.prompt_updates


class SenderCache(_LruSenderCache):
    """P0 shadow of P1's :class:`ReceiverCache`: sizes and prompt updates, no data.

    A hit returns ``(None, prompt_updates)``: P1 holds the item, so nothing is sent.
    """

    def _entry(self, item: Item, prompt_updates: Any) -> ItemMetadata:
        return ItemMetadata.of(item, prompt_updates)

    def _hit(self, entry: ItemMetadata) -> SenderOutput:
        return None, entry.prompt_updates


class ReceiverCache(BaseReceiverCache):
    """P1 cache of full items, mirrored by P0's :class:`SenderCache`.

    Data present: stored (replacing any item with the same hash: the fresh payload wins)
    and returned.  ``None``: the stored item, or a :class:`CacheMissError`.
    """

    def __init__(self, capacity_gb: float) -> None:
        super().__init__()
        self._lru = LRUCache(capacity_bytes(capacity_gb))

    def get_and_update_item(self, item: Item | None, mm_hash: str) -> Item:
        if item is None:
            cached: Item | None = self._lru.get(mm_hash)
            if cached is None:
                raise CacheMissError([mm_hash])
            return cached
        if not isinstance(item, Mapping):
            raise TypeError(f"ReceiverCache got a {type(item).__qualname__} for {mm_hash}")
        self._cache_if_fits(self._lru, mm_hash, item)
        return item

    def touch_receiver_cache_item(self, mm_hash: str, item: Any = None) -> None:
        """Make ``mm_hash`` most recent (a no-op when absent), as the sender does."""
        self._lru.touch(mm_hash)

    def clear_cache(self) -> None:
        """Forget every item (P0's sender must be cleared too, or it will drift)."""
        self._lru.clear()

    def stats(self) -> dict[str, int]:
        return {**_lru_stats(self._lru), **super().stats()}

    def keys(self) -> list[Hashable]:
        """Cached hashes, least recently used first."""
        return self._lru.recency_order()
