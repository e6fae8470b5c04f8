"""A size-aware LRU with hit statistics and protected entries, on top of ``cachetools.Cache``.

:class:`LRUCache` is thread-safe: every method holds its lock.  The caches keep their LRU
under a lock of their own, held across each of their calls, so they use the same LRU without
one (:class:`UnsynchronizedLRUCache`): taking a lock once per call, not once per LRU step,
keeps their hot paths cheap.
"""

from __future__ import annotations

import copy
import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, ItemsView, Iterable, Iterator, ValuesView
from typing import Any, NamedTuple

import cachetools

from mmcache.arguments import check_getsizeof, flag
from mmcache.items import item_size

__all__ = ["CacheInfo", "HitCounter", "LRUCache", "UnsynchronizedLRUCache"]


class CacheInfo(NamedTuple):
    """Lookup statistics: ``hits`` out of ``total`` lookups."""

    hits: int
    total: int

    @property
    def hit_ratio(self) -> float:
        """``hits / total``, or 0.0 before the first lookup."""
        return self.hits / self.total if self.total else 0.0

    def __sub__(self, other: object) -> CacheInfo:
        if not isinstance(other, CacheInfo):
            # Python's TypeError for the operands (a tuple's fields have no names to read).
            return NotImplemented
        return CacheInfo(self.hits - other.hits, self.total - other.total)


class HitCounter:
    """Counts lookups (``total``) and ``hits``; :meth:`info` reads them cumulatively or, with
    ``delta=True``, as the change since the previous delta read (the ``delta`` of the
    caches' ``make_stats``)."""

    def __init__(self) -> None:
        self.hits = 0
        self.total = 0
        self._last = CacheInfo(0, 0)

    def info(self, *, delta: bool = False) -> CacheInfo:
        info = CacheInfo(self.hits, self.total)
        if not delta:
            return info
        change, self._last = info - self._last, info
        return change

    def reset(self) -> None:
        """Back to zero, the last delta read included."""
        self.hits = self.total = 0
        self._last = CacheInfo(0, 0)


class UnsynchronizedLRUCache(cachetools.Cache):  # type: ignore[type-arg]
    """:class:`LRUCache` for an owner that serialises every call itself (not thread-safe).

    Least-recently-used cache bounded by the total size of its values.

    ``capacity_bytes`` bounds the sum of ``getsizeof(value)`` (by default :func:`item_size`).
    Only :meth:`get` counts towards the statistics; ``key in cache`` neither counts nor
    changes recency; ``cache[key]`` makes ``key`` most recent without counting.

    Inserting evicts the least recent entries that are not *protected* (:meth:`protect`)
    until the value fits.  A value that cannot fit beside the protected entries is refused
    before anything is evicted (:meth:`put_if_fits` returns False, :meth:`put` raises
    ``ValueError``), so eviction always terminates and never takes a protected entry.
    """

    def __init__(self, capacity_bytes: float, getsizeof: Callable[[Any], int] = item_size) -> None:
        try:
            valid = capacity_bytes >= 0  # False for NaN, which no size would ever fit
        except TypeError:
            raise TypeError(
                f"capacity_bytes must be a number of bytes, not {type(capacity_bytes).__name__}"
            ) from None
        if not valid:
            raise ValueError(
                f"capacity_bytes must be a number of bytes >= 0 (inf: unbounded), not "
                f"{capacity_bytes!r}"
            )
        check_getsizeof(getsizeof)
        super().__init__(capacity_bytes, getsizeof)
        # Every entry has a recency stamp (:meth:`recency`), larger when more recent, so a
        # key's earlier recency can be given back (:meth:`restore_recency`). The recency
        # order, least recent first (ascending stamps), is ``_parked`` then ``_order``, each
        # mapping its keys to their stamps. Eviction takes the least recent entry that is
        # not protected; a protected entry it passes at the front of ``_order`` is parked
        # (moved, in order, to the end of ``_parked``, so every parked key stays older than
        # every key of ``_order``) rather than passed again by every eviction after it: the
        # entries a long request protects drift to the front, and each insertion walked over
        # all of them (100 µs with 1,000 there, 2 ms with 10,000). A parked key no longer
        # protected waits in ``_free``, a heap of (stamp, key), to be evicted first; one
        # made recent again goes back to ``_order``.
        self._order: OrderedDict[Hashable, int] = OrderedDict()
        self._parked: dict[Hashable, int] = {}
        self._free: list[tuple[int, Hashable]] = []  # parked keys unprotected (some stale)
        self._stamp = 0  # the last stamp given
        self._protected: dict[Hashable, float] = {}  # protected key -> its value's size
        self._protected_bytes: float = 0
        self.evictions = 0
        """Entries evicted to make room (not those popped or cleared)."""
        self._lookups = HitCounter()

    # -- the mapping, kept in recency order -------------------------------------------------

    def __getitem__(self, key: Hashable) -> Any:
        """The value for ``key``, made most recent (``KeyError`` when absent); counts nothing."""
        value = super().__getitem__(key)
        self._make_recent(key)
        return value

    def _make_recent(self, key: Hashable) -> None:
        """Move ``key`` (present) to the most recent end."""
        self._stamp = stamp = self._stamp + 1
        order = self._order
        if not self._parked or self._parked.pop(key, None) is None:
            order.move_to_end(key)
        order[key] = stamp

    def _forget_order(self, key: Hashable) -> None:
        """Take ``key`` (present) out of the recency order."""
        if self._parked.pop(key, None) is None:
            del self._order[key]

    def _size_of(self, value: Any) -> float:
        """``getsizeof(value)``; ``ValueError`` for a size below 0 or NaN (it fits no cache:
        every item would be refused, as if the requests in flight held the room),
        ``TypeError`` for one that is no number, each naming ``getsizeof``."""
        size = self.getsizeof(value)
        try:
            valid = size >= 0
        except TypeError:
            raise TypeError(
                f"getsizeof must return a number of bytes, not {type(size).__name__}"
            ) from None
        if not valid:
            raise ValueError(f"getsizeof must return a number of bytes >= 0, not {size!r}")
        return size

    def __setitem__(self, key: Hashable, value: Any) -> None:
        size = self._size_of(value)
        if not self.fits(key, size):
            raise ValueError(
                f"a value of {size} bytes cannot fit in a cache of {self.maxsize} bytes "
                f"beside its {self._room_taken_by_others(key)} protected bytes"
            )
        if key in self:
            # The replaced value gives its room back before any eviction: cachetools before
            # 8.0 made room for the whole new size beside it, evicting more than needed and,
            # once only protected entries were left, failing in popitem().
            cachetools.Cache.__delitem__(self, key)  # its protection stays
            self._forget_order(key)
        super().__setitem__(key, value)  # evicts through popitem() as needed
        self._stamp += 1
        self._order[key] = self._stamp  # most recent
        if key in self._protected:  # a protected entry replaced in place: its new size
            self._protected_bytes += size - self._protected[key]
            self._protected[key] = size

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        self._forget_order(key)
        self.unprotect(key)

    # -- the cache's own operations ----------------------------------------------------------

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (made most recent) or ``default``; counts one lookup."""
        self._lookups.total += 1
        if key in self:
            self._lookups.hits += 1
            return self[key]
        return default

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or replace ``key`` as most recent (``ValueError`` if it cannot fit, alone
        or beside the protected entries)."""
        self[key] = value

    def fits(self, key: Hashable, size: float) -> bool:
        """Whether a value of ``size`` bytes can be stored under ``key`` now: it fits in the
        capacity beside every protected entry other than ``key`` itself (whatever it
        replaces under ``key`` is given back)."""
        return 0 <= size <= self.maxsize - self._room_taken_by_others(key)

    def put_if_fits(self, key: Hashable, value: Any) -> bool:
        """Insert like :meth:`put` and return True, or return False (changing nothing) when
        the value exceeds the capacity, alone or beside the protected entries."""
        if not self.fits(key, self._size_of(value)):
            return False
        self[key] = value
        return True

    def touch(self, key: Hashable) -> int | None:
        """Make ``key`` most recent; a no-op when it is absent (no entry is created).
        Returns its recency stamp before (:meth:`recency`), ``None`` when absent."""
        # Every entry is in one of the two: no lookup in cachetools' mapping.
        stamp = self._order.get(key)
        if stamp is None:
            stamp = self._parked.get(key)
            if stamp is None:
                return None
        self._make_recent(key)
        return stamp

    def settle(self, keys: Iterable[str]) -> None:
        """Make those of ``keys`` present the most recent, in sorted order: two caches that
        applied one request's items in different orders (vLLM's P0 updates them modality by
        modality, its P1 resolves them in prompt order) then end it with the same recency,
        so they evict alike. Changes no statistics."""
        for key in sorted(set(keys), key=str):
            self.touch(key)

    def protect(self, key: Hashable) -> bool:
        """Keep ``key`` from being evicted until :meth:`unprotect` (or until it is popped or
        cleared); a no-op when it is absent.  Protecting does not change recency.  Returns
        whether ``key`` is present (so now protected)."""
        if key not in self:
            return False
        if key not in self._protected:
            size = self.getsizeof(super().__getitem__(key))
            self._protected[key] = size
            self._protected_bytes += size
        return True

    def unprotect(self, key: Hashable) -> None:
        """Let ``key`` be evicted again; a no-op when it is not protected."""
        size = self._protected.pop(key, None)
        if size is not None:
            self._protected_bytes -= size
            parked = self._parked.get(key)
            if parked is not None:
                self._free_parked(parked, key)

    def _free_parked(self, parked: int, key: Hashable) -> None:
        """Parked ``key`` (stamp ``parked``) may be evicted again."""
        free = self._free
        heapq.heappush(free, (parked, key))
        if len(free) > 2 * len(self._parked) + 64:
            # Stale entries (keys evicted, made recent, protected again since) dropped.
            self._free = [entry for entry in free if self._is_free(*entry)]
            heapq.heapify(self._free)

    def _is_free(self, parked: int, key: Hashable) -> bool:
        """Whether a ``_free`` entry still names a parked key that is not protected."""
        return self._parked.get(key) == parked and key not in self._protected

    def unprotect_all(self) -> None:
        """Let every entry be evicted again."""
        self._protected.clear()
        self._protected_bytes = 0
        self._free = [(parked, key) for key, parked in self._parked.items()]  # in order

    def is_protected(self, key: Hashable) -> bool:
        return key in self._protected

    @property
    def protected_bytes(self) -> float:
        """Total size of the protected entries."""
        return self._protected_bytes

    def popitem(self) -> tuple[Hashable, Any]:
        """Evict the least recently used entry that is not protected (``KeyError`` when
        there is none); inserting calls this to make room."""
        key = self._least_recent_unprotected()
        value = super().__getitem__(key)
        del self[key]
        self.evictions += 1
        return key, value

    def _least_recent_unprotected(self) -> Hashable:
        """The least recently used key that is not protected (``KeyError`` when none is):
        a parked one freed since, else the first of ``_order`` that is not protected, the
        protected ones before it parked on the way."""
        free = self._free
        while free:
            parked, key = free[0]
            if self._is_free(parked, key):
                return key
            heapq.heappop(free)
        order, protected = self._order, self._protected
        while order:
            key = next(iter(order))
            if key not in protected:
                return key
            self._parked[key] = order.pop(key)
        raise KeyError(f"{type(self).__name__} has no entry that is not protected")

    def pop(self, key: Hashable, default: Any = None) -> Any:
        """Remove ``key`` (protected or not) and return its value, or ``default`` when
        absent; counts nothing."""
        if key not in self:
            return default
        value = super().__getitem__(key)
        del self[key]
        return value

    def clear(self) -> None:
        """Remove every entry, protected ones included, and reset the statistics
        (evictions included)."""
        # Unprotected first: before 7.0.2 cachetools clears by calling popitem() until it
        # raises KeyError, which ours does as soon as only protected entries are left.
        self.unprotect_all()
        super().clear()
        self._order.clear()
        self._parked.clear()
        self._free.clear()
        self.evictions = 0
        self._lookups.reset()

    def items(self) -> ItemsView[Hashable, Any]:
        """The entries as they are now (a copy, not a live view); reading them changes no
        recency."""
        return self._entries().items()

    def values(self) -> ValuesView[Any]:
        """The values as they are now (a copy, not a live view); reading them changes no
        recency."""
        return self._entries().values()

    def _entries(self) -> dict[Hashable, Any]:
        value = super().__getitem__  # cachetools' own: no recency change
        return {key: value(key) for key in list(super().__iter__())}

    def stat(self, delta: bool = False) -> CacheInfo:
        """Cumulative statistics, or with ``delta=True`` the change since the previous
        delta call."""
        return self._lookups.info(delta=flag("delta", delta))

    def recency_order(self) -> list[Hashable]:
        """Keys from least to most recently used (the order eviction follows); O(n)."""
        return [*self._parked, *self._order]

    @property
    def last_stamp(self) -> int:
        """The last recency stamp given (0 before any)."""
        return self._stamp

    def recency(self, key: Hashable) -> int | None:
        """``key``'s recency stamp (``None`` when absent): stamps grow as entries are made
        recent, so they order the entries as :meth:`recency_order` does, and each is given
        once (a key made recent again, or stored again, gets a new one)."""
        stamp = self._order.get(key)
        return self._parked.get(key) if stamp is None else stamp

    def restore_recency(self, key: Hashable, stamp: int, *, since: int) -> bool:
        """Give ``key`` back its earlier recency ``stamp`` (from :meth:`recency`), undoing
        what made it more recent since, provided its recency is still ``since`` (nothing
        made it recent again since); returns whether it did.  The other entries keep their
        order; no statistics change.

        For a mirror (P0 of P1's LRU): what made ``key`` recent never happened on the other
        side (a request that was rejected), so both sides order their entries alike again.
        """
        if self.recency(key) != since or not stamp < since:
            return False
        order = self._order
        if key in self._parked or (self._parked and stamp < next(reversed(self._parked.values()))):
            self._rebuild_order(key, stamp)
            return True
        # ``_order`` ascends by stamp: move the shorter run, the entries more recent than
        # ``stamp`` (from the end) or those less recent (from the front). A rejected
        # request's item was often the least recent one before: its run from the front is
        # short.
        del order[key]
        newer: list[Hashable] = []
        older: list[Hashable] = []
        for (back, back_stamp), (front, front_stamp) in zip(
            reversed(order.items()), order.items(), strict=True
        ):
            if back_stamp < stamp:
                order[key] = stamp
                for newer_key in reversed(newer):
                    order.move_to_end(newer_key)
                return True
            if front_stamp > stamp:
                order[key] = stamp
                order.move_to_end(key, last=False)
                for older_key in reversed(older):
                    order.move_to_end(older_key, last=False)
                return True
            newer.append(back)
            older.append(front)
        order[key] = stamp  # the only entry
        return True

    def _rebuild_order(self, key: Hashable, stamp: int) -> None:
        """Every entry in ``_order`` by stamp, ``key``'s now ``stamp``, none parked (eviction
        parks the protected ones again as it passes them): O(n), for a stamp that falls
        among the parked entries (rare: they are the protected entries that drifted to the
        least recent end)."""
        entries = [*self._parked.items(), *self._order.items()]
        entries = [(k, stamp if k == key else s) for k, s in entries]
        entries.sort(key=lambda entry: entry[1])
        self._order = OrderedDict(entries)
        self._parked.clear()
        self._free.clear()

    def _room_taken_by_others(self, key: Hashable) -> float:
        """Bytes of the protected entries other than ``key``."""
        return self._protected_bytes - self._protected.get(key, 0)


class LRUCache(UnsynchronizedLRUCache):
    """Least-recently-used cache bounded by the total size of its values (see
    :class:`UnsynchronizedLRUCache` for the semantics), safe to call from several threads.

    Every method holds :attr:`lock` (re-entrant: hold it to make several calls one atomic
    step), except ``key in cache`` and ``len(cache)``: one operation on the underlying dict,
    atomic by itself (under the GIL, and under free-threaded CPython, whose dicts lock
    themselves).
    """

    def __init__(self, capacity_bytes: float, getsizeof: Callable[[Any], int] = item_size) -> None:
        super().__init__(capacity_bytes, getsizeof)
        self.lock = threading.RLock()
        """Held by every method."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its lock (a copy gets its own), from a copy taken under the
        lock: pickle reads the state after this returns, while other threads may change the
        cache."""
        with self.lock:
            state = {k: v for k, v in self.__dict__.items() if k != "lock"}
            # Itself not copied: a bound method in the state (a getsizeof) names it.
            return copy.deepcopy(state, {id(self): self})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def __getitem__(self, key: Hashable) -> Any:
        with self.lock:
            return super().__getitem__(key)

    def __setitem__(self, key: Hashable, value: Any) -> None:
        with self.lock:
            super().__setitem__(key, value)

    def __delitem__(self, key: Hashable) -> None:
        with self.lock:
            super().__delitem__(key)

    def __iter__(self) -> Iterator[Hashable]:
        """The keys (in insertion order) as they were when iteration began."""
        with self.lock:
            return iter(list(super().__iter__()))

    def _entries(self) -> dict[Hashable, Any]:
        with self.lock:
            return super()._entries()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self.lock:
            return super().get(key, default)

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        with self.lock:
            return super().setdefault(key, default)

    def fits(self, key: Hashable, size: float) -> bool:
        with self.lock:
            return super().fits(key, size)

    def put_if_fits(self, key: Hashable, value: Any) -> bool:
        with self.lock:
            return super().put_if_fits(key, value)

    def touch(self, key: Hashable) -> int | None:
        with self.lock:
            return super().touch(key)

    def settle(self, keys: Iterable[str]) -> None:
        with self.lock:  # one step: no other thread's keys among these
            super().settle(keys)

    def protect(self, key: Hashable) -> bool:
        with self.lock:
            return super().protect(key)

    def unprotect(self, key: Hashable) -> None:
        with self.lock:
            super().unprotect(key)

    def unprotect_all(self) -> None:
        with self.lock:
            super().unprotect_all()

    def popitem(self) -> tuple[Hashable, Any]:
        with self.lock:
            return super().popitem()

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self.lock:
            return super().pop(key, default)

    def clear(self) -> None:
        with self.lock:
            super().clear()

    def stat(self, delta: bool = False) -> CacheInfo:
        with self.lock:
            return super().stat(delta)

    def recency_order(self) -> list[Hashable]:
        with self.lock:
            return super().recency_order()

    @property
    def last_stamp(self) -> int:
        """The last recency stamp given (0 before any)."""
        return self._stamp

    def recency(self, key: Hashable) -> int | None:
        with self.lock:
            return super().recency(key)

    def restore_recency(self, key: Hashable, stamp: int, *, since: int) -> bool:
        with self.lock:
            return super().restore_recency(key, stamp, since=since)
