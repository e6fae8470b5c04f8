"""The cache classes of P0 (senders) and P1/workers (receivers), and their shared bases.

P0 input items are ``(Item, prompt_updates)`` or ``None`` (the caller believes the item is
cached); P0 output items are ``(Item | ShmHandle | None, prompt_updates)``.  Receivers
resolve :class:`~mmcache.items.Feature` ``data`` in place.

Mirroring (``lru`` mode): :class:`SenderCache` (P0) and :class:`ReceiverCache` (P1) apply the
same operations in the same order with the same size function (``getsizeof=``, by default
:func:`~mmcache.items.item_size`; an engine passes its own to match its accounting), so their
LRUs hold the same keys in the same recency order and P0 knows, without asking, which items
P1 holds.

A request cannot evict its own items, even when it is larger than the cache: an item the
request touched (``touch_sender_cache_item`` on P0, ``touch_receiver_cache_item`` on P1) is
protected until the request is done (the end of ``get_and_update`` /
``get_and_update_features``; or its own update, when items are updated one by one), and an
item that would fit only by evicting a protected one is served uncached (counted as
``full``).  Both sides see the same touches, sizes and updates, so they take the same
decisions and the mirror holds.  An engine that updates a request's items one call at a
time brackets them with :meth:`BaseCache.begin_request` / :meth:`BaseCache.end_request` so
the protection lasts the whole request, as it does on the receiver.

Threads: every cache may be called from several threads at once.  Each cache has one
re-entrant lock, held across each public call that reads or changes its state (a batched
call is one atomic step); a pure query of a structure that is atomic by itself (the LRU
caches' ``is_cached_item``: one lookup in a dict) takes no lock.  A request is the calling
thread's: the request a thread opened (:meth:`BaseCache.begin_request`) and the items it
touched are its own, and an item several requests touched stays protected until the last
of them is done.  In ``lru`` mode the mirror holds per request order: requests that reach
P1 in another order than P0's threads applied them are a drift, reported by P1's
:class:`CacheMissError` like any other; a retry that carries every item's data to P1
recovers it.
"""

from __future__ import annotations

import copy
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from mmcache.arguments import (
    GiB,
    capacity_bytes,
    check_feature_list,
    check_getsizeof,
    check_hash_list,
    check_item_list,
    check_mm_hash,
    feature_keys,
    receiver_type_error,
)
from mmcache.closing import ClosesOnExit
from mmcache.errors import CacheMissError
from mmcache.items import CachedItem, Item, ItemMetadata, ShmHandle, item_size
from mmcache.lru import CacheInfo, UnsynchronizedLRUCache
from mmcache.protection import ProtectedLRU, RequestState

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


def _gib(n_bytes: float) -> str:
    """``n_bytes`` in GiB, with enough digits to tell small sizes apart."""
    return f"{n_bytes / GiB:.4g}"


class BaseCache(ClosesOnExit, ABC, Generic[InT, OutT]):
    """What every cache has: per-item and batched updates, clearing, closing, the request
    bracket (per thread), and the accounting of items served uncached (counted, logged once
    per reason).

    ``_lock`` (re-entrant) guards the cache's state: every public method that reads or
    changes it holds the lock, and a batched call holds it throughout.
    """

    def __init__(self) -> None:
        self._lock: AbstractContextManager[Any] = threading.RLock()
        self._request = RequestState()  # the calling thread's request
        self._uncached = {"oversize": 0, "full": 0, "saturated": 0, "no_space": 0}
        self._warned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its lock (a copy gets its own) and without requests in flight
        (each thread's, in this process), from a copy taken under the lock: pickle reads
        the state after this returns, while other threads may change the cache."""
        with self._lock:
            state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
            # Itself not copied: a bound method in the state (a getsizeof) names it.
            return copy.deepcopy(state, {id(self): self})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    @abstractmethod
    def get_and_update_item(self, item: InT, mm_hash: str) -> OutT:
        """Resolve one item against the cache and update the cache with it."""

    def get_and_update(self, items: Sequence[InT], mm_hashes: Sequence[str]) -> list[OutT]:
        """:meth:`get_and_update_item` for each ``(item, mm_hash)`` pair of one request, in
        order.  What the request touched stays protected until it is done (until
        :meth:`end_request` when called inside an open request); if it raises, whatever its
        earlier outputs hold is given back first."""
        items = check_item_list(items, "get_and_update")
        mm_hashes = check_hash_list(mm_hashes, "get_and_update")
        if len(items) != len(mm_hashes):
            raise ValueError(f"{len(items)} items but {len(mm_hashes)} mm_hashes")
        outputs: list[OutT] = []
        with self._lock, self._request_scope(mm_hashes):
            try:
                self._check_request(items, mm_hashes)
                for item, h in zip(items, mm_hashes, strict=True):
                    outputs.append(self.get_and_update_item(item, h))
            except BaseException:
                self._abandon(outputs)
                raise
        return outputs

    @contextmanager
    def _request_scope(self, keys: Sequence[str]) -> Iterator[None]:
        """One batched call is one request, unless it runs inside a request the calling
        thread opened with :meth:`begin_request` (which then ends the protection)."""
        opened_here = not self._request.open
        if opened_here:
            self.begin_request()
        try:
            yield
        finally:
            if opened_here:
                self._request.open = False
                self._end_request(keys)

    @property
    def in_request(self) -> bool:
        """Whether the calling thread has a request open (between :meth:`begin_request` and
        :meth:`end_request`)."""
        return self._request.open

    def begin_request(self) -> None:
        """Open a request whose items are updated one by one: until :meth:`end_request`,
        every item the request touches stays protected from eviction (not only until its
        own update), exactly as within one :meth:`get_and_update` call.

        For engines that touch every item of a request, then update the items one call at
        a time, then end the request (vLLM's P0 does): the protection then lasts as long
        as on the receiver, which resolves the request in one call, so a request larger
        than the cache keeps the two sides mirrored.

        The request is the calling thread's: several threads may each have one open at once,
        and each thread's touches, updates and :meth:`end_request` are its own request's.
        ``RuntimeError`` if this thread has a request open already.
        """
        if self._request.open:
            raise RuntimeError(
                f"{type(self).__name__}: a request is already open in this thread; call "
                "end_request() before beginning the next one"
            )
        with self._lock:
            self._request.open = True
            self._begin_request()

    def end_request(self) -> None:
        """Close the calling thread's open request: the items it touched may be evicted again
        (unless another open request touched them too; a pin of a touched item whose update
        never came is dropped too).  A no-op when this thread has no request open."""
        if self._request.open:
            with self._lock:
                self._request.open = False
                self._end_request(None)

    def _check_request(self, items: Sequence[InT], mm_hashes: Sequence[str]) -> None:
        """Raise before any item of the request is applied, if it cannot succeed."""

    def _begin_request(self) -> None:
        """The calling thread's request starts (protection now lasts until its end)."""

    def _end_request(self, keys: Sequence[str] | None) -> None:
        """The calling thread's request of ``keys`` is done (or failed): drop what protects
        its items (``None``: everything the request protects)."""

    def _abandon(self, outputs: Sequence[OutT]) -> None:
        """A request failed after producing ``outputs``: give back what they hold."""

    @abstractmethod
    def clear_cache(self) -> None:
        """Forget every cached item."""

    def close(self) -> None:
        """Release the resources the cache holds (nothing, unless it uses shared memory)."""

    def stats(self) -> dict[str, int]:
        """Counters; ``uncached_oversize`` / ``uncached_full`` / ``uncached_saturated`` /
        ``uncached_no_space`` count items served uncached (too large; no room beside
        protected items; a reader holding the most unread references to it that the ring can
        count; a ``/dev/shm`` others filled, with no page left for the ring's)."""
        with self._lock:
            return {f"uncached_{reason}": n for reason, n in self._uncached.items()}

    def _serve_uncached(self, reason: str, message: str) -> None:
        """Count an item served uncached; log the first one of each reason (lock held)."""
        self._uncached[reason] += 1
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning(
                "%s; serving it uncached. Further items served uncached for this reason are "
                "counted in stats()['uncached_%s'] and not logged.",
                message,
                reason,
            )

    def _cache_if_fits(self, store: ProtectedLRU, key: str, value: Any) -> None:
        """Store ``value`` under ``key``, or serve it uncached: when it exceeds the capacity
        (``oversize``), or when it fits only by evicting items that requests in flight
        protect (``full``).

        A value served uncached also drops what was stored under ``key``, so the stale entry
        can never be returned in place of the fresh data (a no-op when the sides are
        mirrored: both missed ``key``).
        """
        lru = store.lru
        if lru.put_if_fits(key, value):
            return
        store.pop(key)
        size, capacity = lru.getsizeof(value), lru.maxsize
        if size > capacity:
            self._serve_uncached(
                "oversize",
                f"item {key} is {_gib(size)} GiB, more than the cache's capacity_gb="
                f"{_gib(capacity)} (raise capacity_gb to cache items this large)",
            )
        else:
            self._serve_uncached(
                "full",
                f"item {key} ({_gib(size)} GiB) does not fit beside the "
                f"{_gib(lru.protected_bytes)} GiB of items the requests in flight still use "
                f"(capacity_gb={_gib(capacity)}; raise it to cache requests this large)",
            )


class BaseSenderCache(BaseCache[SenderInput, SenderOutput]):
    """A P0 cache.  P0 calls :meth:`touch_sender_cache_item` for every hash of a request,
    then :meth:`get_and_update` with all of its items (as P1 resolves them with one
    ``get_and_update_features`` call: in ``lru`` mode the mirror of a request larger than the
    cache depends on it), or :meth:`get_and_update_item` for each."""

    @abstractmethod
    def is_cached_item(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached; changes neither recency nor statistics."""

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        """:meth:`is_cached_item` for each hash."""
        mm_hashes = check_hash_list(mm_hashes)
        return [self.is_cached_item(h) for h in mm_hashes]

    @abstractmethod
    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Protect ``mm_hash`` while its request is assembled (see the subclasses)."""

    def release_sender_touches(self) -> None:
        """Drop the protection of touched items whose update will never come."""

    def give_up_claims(self) -> list[str]:
        """The calling thread's request gives up the single-flight claims it holds (a cache
        whose ``is_cached`` takes ``claim``); the hashes it held.  None here."""
        return []

    def _check_request(self, items: Sequence[SenderInput], mm_hashes: Sequence[str]) -> None:
        """``TypeError`` for an input that is neither ``(item, prompt_updates)`` nor ``None``,
        and ``CacheMissError`` listing every hash whose item is ``None`` but is not cached, in
        request order, before anything is applied or issued: a request P0 cannot assemble
        leaves the cache as it was (in ``lru`` mode, items its earlier inputs put would be in
        P0's mirror but never reach P1; after a miss the engine invalidates the reported
        hashes and resends the request with their data)."""
        missing = []
        for item, h in zip(items, mm_hashes, strict=True):
            check_mm_hash(h, "get_and_update(items, mm_hashes)")
            if item is not None:
                split_sender_input(item, h)
            elif not self.is_cached_item(h):
                missing.append(h)
        if missing:
            raise CacheMissError(missing)

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
        """Resolve every feature's ``data`` in place and return ``features`` (an iterable that
        is no sequence, a generator say, as a list).

        Touches every key first, then resolves each feature; a miss does not stop the others
        (healthy items are still ingested).  Raises one :class:`CacheMissError` listing every
        missing hash in request order (see :meth:`_not_held` for what else it lists).  Any
        other error (a forged handle, say) does not stop the others either — resolving a
        handle is what gives its reference back, so skipping the rest would pin them in the
        ring — and the first such error is raised once all are resolved.

        The request is one atomic step for the cache (other threads' calls wait for it),
        except in caches that hold no state of their own to guard
        (:class:`~mmcache.shm_receiver.ShmReceiverCache`, whose threads resolve in parallel).
        """
        check_feature_list(features)
        if not isinstance(features, Sequence):  # read twice below (keys, then data)
            features = list(features)
        keys = feature_keys(features)  # before anything is read: no reference is consumed

        def deliver(i: int, data: Any) -> None:
            features[i].data = data

        self._resolve_request([f.data for f in features], keys, deliver)
        return features

    def get_and_update(self, items: Sequence[Any], mm_hashes: Sequence[str]) -> list[Any]:
        """The resolved ``items``, as :meth:`get_and_update_features` resolves a request
        (every item, every miss in one :class:`CacheMissError`): stopping at the first miss,
        as the senders' batched call does, would leave the rest of the request unapplied
        here (and, in ``shm``, its handles unread, pinning their objects)."""
        items = check_item_list(items, "get_and_update")
        mm_hashes = check_hash_list(mm_hashes, "get_and_update")
        if len(items) != len(mm_hashes):
            raise ValueError(f"{len(items)} items but {len(mm_hashes)} mm_hashes")
        outputs = list(items)
        self._resolve_request(items, mm_hashes, outputs.__setitem__)
        return outputs

    def _resolve_request(
        self, items: Sequence[Any], keys: Sequence[str], deliver: Callable[[int, Any], None]
    ) -> None:
        """Touch every key, then resolve every item, handing the ``i``-th result to
        ``deliver(i, result)``; raise as :meth:`get_and_update_features` says."""
        missed: list[bool] = []
        failure: Exception | None = None
        with self._lock, self._request_scope(keys):
            for item, key in zip(items, keys, strict=True):
                self.touch_receiver_cache_item(key, item)
            for i, (item, key) in enumerate(zip(items, keys, strict=True)):
                try:
                    deliver(i, self.get_and_update_item(item, key))
                    missed.append(False)
                except CacheMissError:
                    missed.append(True)
                except Exception as exc:
                    missed.append(False)
                    failure = failure or exc
            if failure is not None:
                raise failure
            if any(missed):
                missing = [k for k, m in zip(keys, missed, strict=True) if m or self._not_held(k)]
                raise CacheMissError(missing)

    def _not_held(self, key: str) -> bool:
        """Whether a request that missed should also report ``key``, which it resolved but
        which this cache does not hold after it (so the sender must not count on it)."""
        return False


def split_sender_input(item: SenderInput, mm_hash: str) -> tuple[Item, Any]:
    """``(item, prompt_updates)`` of a P0 input; ``CacheMissError`` for ``None``,
    ``TypeError`` unless a pair whose item is a mapping (as the ring and P1's
    :class:`ReceiverCache` require: an item P1 refuses would be a drift).  ``mm_hash`` is
    the caller's to check."""
    if item is None:
        raise CacheMissError([mm_hash])
    # A tuple of types, not `tuple | list`: that union is built anew at each call (P0's put).
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise TypeError(
            f"P0 input for {mm_hash} must be (item, prompt_updates) or None, "
            f"not {type(item).__qualname__}"
        )
    data = item[0]
    # The exact type first: a check against the Mapping ABC costs more on P0's put.
    if type(data) is not dict and not isinstance(data, Mapping):
        raise TypeError(f"an item must be a mapping of field names, not {type(data).__name__}")
    return data, item[1]


class _LruSenderCache(BaseSenderCache):
    """A P0 cache over an LRU; subclasses choose what an entry keeps.

    ``getsizeof(item)`` is the size an item counts for (default :func:`item_size`); the
    receiver it mirrors must use the same function.
    """

    def __init__(self, capacity_gb: float, *, getsizeof: Callable[[Item], int] = item_size) -> None:
        super().__init__()
        check_getsizeof(getsizeof)  # (the LRU is given the entries' size function)
        self._item_size = getsizeof
        # Only ever used under the cache's lock.
        self._lru = UnsynchronizedLRUCache(capacity_bytes(capacity_gb), getsizeof=self._entry_size)
        self._protection = ProtectedLRU(self._lru, self._request)

    @abstractmethod
    def _entry(self, item: Item, prompt_updates: Any) -> Any:
        """What to store for a missed item."""

    @abstractmethod
    def _entry_size(self, entry: Any) -> int:
        """The size a stored entry counts for: that of its item."""

    @abstractmethod
    def _hit(self, entry: Any) -> SenderOutput:
        """What to return for a stored entry."""

    def get_and_update_item(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        """A hit returns the stored entry's output; a miss stores the item if it fits (see
        the module's docstring) and returns it as given.  ``CacheMissError`` for a miss
        without data."""
        call = "get_and_update_item(item, mm_hash)"
        # The type only, on a hit (a tenth of its time for the whole check): a key stored had
        # the whole check on its miss, the one path that stores.
        if type(mm_hash) is not str:
            check_mm_hash(mm_hash, call)
        with self._lock:
            entry = self._lru.get(mm_hash)
            if entry is not None:
                self._protection.updated(mm_hash)
                return self._hit(entry)
            check_mm_hash(mm_hash, call)
            data, prompt_updates = split_sender_input(item, mm_hash)
            self._cache_if_fits(self._protection, mm_hash, self._entry(data, prompt_updates))
            self._protection.updated(mm_hash)
            return data, prompt_updates

    def is_cached_item(self, mm_hash: str) -> bool:
        check_mm_hash(mm_hash, "is_cached_item(mm_hash)")  # as the ring's lookup does
        # No lock: one lookup in the LRU's dict, atomic by itself.
        return mm_hash in self._lru

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Make ``mm_hash`` most recent and protect it from the request's own insertions (a
        no-op when absent), exactly as the receiver's touch does."""
        check_mm_hash(mm_hash, "touch_sender_cache_item(mm_hash)")
        with self._lock:
            self._touch(mm_hash)

    def _touch(self, mm_hash: str) -> None:
        """Make ``mm_hash`` most recent and protect it (lock held)."""
        self._protection.touch(mm_hash)

    def release_sender_touches(self) -> None:
        """Drop this thread's protection of every item it touched (its request was
        abandoned)."""
        with self._lock:
            self._protection.release_all()

    def _end_request(self, keys: Sequence[str] | None) -> None:
        self._protection.end(keys)

    def invalidate(self, mm_hash: str) -> None:
        check_mm_hash(mm_hash, "invalidate(mm_hash)")
        with self._lock:
            self._protection.pop(mm_hash)

    def settle_recency(self, keys: Iterable[str]) -> None:
        """Make the cached keys among ``keys`` (one request's) the most recent
        (:meth:`~mmcache.lru.UnsynchronizedLRUCache.settle`), changing no statistics."""
        keys = check_hash_list(keys, "settle_recency")
        with self._lock:
            self._lru.settle(keys)

    def clear_cache(self) -> None:
        """Forget every item and reset the statistics."""
        with self._lock:
            self._protection.clear()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        with self._lock:
            return self._lru.stat(delta)  # (which checks delta)

    def stats(self) -> dict[str, int]:
        with self._lock:
            hits, total = self._lru.stat()
            return {**_lru_stats(self._lru), "hits": hits, "total": total, **super().stats()}

    def keys(self) -> list[Hashable]:
        """Cached hashes, least recently used first."""
        with self._lock:
            return self._lru.recency_order()


def _lru_stats(lru: UnsynchronizedLRUCache) -> dict[str, int]:
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

    def _entry_size(self, entry: CachedItem) -> int:
        return self._item_size(entry.item)

    def _hit(self, entry: CachedItem) -> SenderOutput:
        return entry.item, entry.prompt_updates


Moves: TypeAlias = tuple[dict[str, int], int]
"""What one request did to the recency of the items it found cached: each item's recency
stamp before the request, and the last stamp given when it ended (the request moved an item
it left between the two)."""


class SenderCache(_LruSenderCache):
    """P0 shadow of P1's :class:`ReceiverCache`: sizes and prompt updates, no data.

    A hit returns ``(None, prompt_updates)``: P1 holds the item, so nothing is sent.

    A request the engine rejects after it ended here never reaches P1, yet its touches made
    the items it found cached most recent here.  So each request opened with
    :meth:`begin_request` files, when it ends, what its touches moved, and
    :meth:`undo_recency` gives those items their earlier recency back: the two LRUs stay
    alike.
    """

    def __init__(self, capacity_gb: float, *, getsizeof: Callable[[Item], int] = item_size) -> None:
        super().__init__(capacity_gb, getsizeof=getsizeof)
        self._last_moves: dict[str, Moves] = {}
        """Each key -> the moves of the ended request that moved it last."""
        self._prune_at = 1024

    def _touch(self, mm_hash: str) -> None:
        before = self._protection.touch(mm_hash)
        if before is not None:
            request = self._request
            if request.open:
                request.moved.setdefault(mm_hash, before)

    def _end_request(self, keys: Sequence[str] | None) -> None:
        self._protection.end(keys)
        request = self._request
        if request.moved:  # file them (handed over, not copied)
            moves = (request.moved, self._lru.last_stamp)
            request.moved = {}
            last = self._last_moves
            for key in moves[0]:
                last[key] = moves
            if len(last) > self._prune_at:
                # Those that can no longer be undone dropped: keys evicted, or moved since.
                self._last_moves = {
                    k: m for k, m in last.items() if self._left_at(k, m) is not None
                }
                self._prune_at = 2 * len(self._last_moves) + 1024

    def _left_at(self, key: str, moves: Moves) -> int | None:
        """``key``'s recency stamp while it is where the request of ``moves`` left it, else
        ``None`` (lock held)."""
        stamp = self._lru.recency(key)
        return stamp if stamp is not None and moves[0][key] < stamp <= moves[1] else None

    def undo_recency(self, mm_hashes: Iterable[str]) -> bool:
        """The last ended request whose touches found exactly ``mm_hashes`` cached never
        reached P1 (the engine rejected it): give each of those items the recency it had
        before the request, unless something made it recent since.  Returns whether such a
        request was found (it is not, once undone, or once later requests moved all of its
        items).

        An item a later request moved from where this one left it stays there, but should
        that request be undone too, it goes back to where it was before both (in either
        order)."""
        keys = set(check_hash_list(mm_hashes, "undo_recency"))
        with self._lock:
            last = self._last_moves
            moves = next((m for k in keys if (m := last.get(k)) and m[0].keys() == keys), None)
            if moves is None:
                return False
            befores, end = moves
            for key, before in befores.items():
                latest = last.get(key)
                if latest is moves:
                    del last[key]
                elif latest is not None and before < latest[0][key] <= end:
                    # The later request moved it from where this one left it: had this one
                    # never happened, it moved it from where it was before.
                    latest[0][key] = before
                # (What moved it since, if anything, was undone.)
                if (stamp := self._left_at(key, moves)) is not None:
                    self._lru.restore_recency(key, before, since=stamp)
            befores.clear()  # undone: found no more
            return True

    def clear_cache(self) -> None:
        with self._lock:
            super().clear_cache()
            self._last_moves.clear()

    def _entry(self, item: Item, prompt_updates: Any) -> ItemMetadata:
        return ItemMetadata(self._item_size(item), prompt_updates)

    def _entry_size(self, entry: ItemMetadata) -> int:
        return entry.size

    def _hit(self, entry: ItemMetadata) -> SenderOutput:
        return None, entry.prompt_updates


class ReceiverCache(BaseReceiverCache):
    """P1 cache of full items, mirrored by P0's :class:`SenderCache`.

    Data present: stored if it fits (replacing any item with the same hash: the fresh
    payload wins) and returned.  ``None``: the stored item, or, within one request, the data
    an earlier feature of the request carried for the same hash; otherwise a
    :class:`CacheMissError`.

    ``getsizeof(item)`` is the size an item counts for (default :func:`item_size`); P0's
    :class:`SenderCache` must be built with the same function.

    Recovery in one retry: when a request misses, its :class:`CacheMissError` lists, in
    request order, the hashes that missed and also every other hash of the request this
    cache does not hold afterwards (items it could not keep).  Once the sender has
    invalidated them, every hash of the request that the sender still holds is held here
    too, and stays (touched, so protected) while the retry is resolved: the retry cannot
    miss, unless requests resolved between the miss and the retry reached this cache in
    another order than the sender's threads applied them (a new drift; a retry that carries
    every item's data cannot miss).
    """

    def __init__(self, capacity_gb: float, *, getsizeof: Callable[[Item], int] = item_size) -> None:
        super().__init__()
        # Only ever used under the cache's lock.
        self._lru = UnsynchronizedLRUCache(capacity_bytes(capacity_gb), getsizeof=getsizeof)
        self._protection = ProtectedLRU(self._lru, self._request)

    def get_and_update_item(self, item: Item | None, mm_hash: str) -> Item:
        check_mm_hash(mm_hash, "get_and_update_item(item, mm_hash)")
        with self._lock:
            if item is None:
                cached: Item | None = self._lru.get(mm_hash)
                if cached is None:
                    # The data this thread's request carried for mm_hash (by hash).
                    cached = self._request.carried.get(mm_hash)
                    if cached is None:
                        raise CacheMissError([mm_hash])
                self._protection.updated(mm_hash)
                return cached
            if not isinstance(item, Mapping):
                raise receiver_type_error(
                    "ReceiverCache", "an item (a mapping of field names) or None", item, mm_hash
                )
            self._cache_if_fits(self._protection, mm_hash, item)
            self._protection.updated(mm_hash)
            if self._request.open:
                # The sender may send None for a later feature with this hash (it kept the
                # item while this cache could not): resolve it from this payload.
                self._request.carried[mm_hash] = item
            return item

    def _not_held(self, key: str) -> bool:
        return key not in self._lru

    def settle_recency(self, keys: Iterable[str]) -> None:
        """Make the cached keys among ``keys`` (one request's) the most recent
        (:meth:`~mmcache.lru.UnsynchronizedLRUCache.settle`), changing no statistics."""
        keys = check_hash_list(keys, "settle_recency")
        with self._lock:
            self._lru.settle(keys)

    def touch_receiver_cache_item(self, mm_hash: str, item: Any = None) -> None:
        """Make ``mm_hash`` most recent and protect it from the request's own insertions (a
        no-op when absent), exactly as the sender's touch does."""
        check_mm_hash(mm_hash, "touch_receiver_cache_item(mm_hash)")
        with self._lock:
            self._protection.touch(mm_hash)

    def _begin_request(self) -> None:
        self._request.carried.clear()

    def _end_request(self, keys: Sequence[str] | None) -> None:
        self._protection.end(keys)
        self._request.carried.clear()

    def clear_cache(self) -> None:
        """Forget every item (P0's sender must be cleared too, or it will drift)."""
        with self._lock:
            self._protection.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**_lru_stats(self._lru), **super().stats()}

    def keys(self) -> list[Hashable]:
        """Cached hashes, least recently used first."""
        with self._lock:
            return self._lru.recency_order()
