"""The request a thread has open, and the keys the requests in flight protect.

Several threads may serve requests through one cache at once (an engine's pool of
preprocessing threads), so a request's state is per thread: :class:`RequestState` (whether a
request is open, what it protects, the data it carried).  A key that several requests touched
stays protected until the last of them lets go: :class:`Holds` counts them and protects the
key in the store (an LRU entry protected from eviction, a ring object pinned) only while the
count is positive.

A store can drop a key's protection on its own account (the key was popped, invalidated or
cleared); the cache then calls :meth:`Holds.forget`, and the requests that held the key find
their hold stale when they let go: they release nothing, so a request can never end the
protection another request took of a later entry under the same key.

:class:`ProtectedLRU` applies that to the LRU caches' store (P0's shadow and P1's LRU alike).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmcache.lru import UnsynchronizedLRUCache

__all__ = ["Hold", "Holds", "ProtectedLRU", "RequestState"]


class Hold:
    """One key's protection, shared by the requests that hold it: ``count`` of them.  Its
    identity tells a current protection from a stale one (the store dropped it since)."""

    __slots__ = ("count",)
    count: int


class RequestState(threading.local):
    """What one thread's request has: whether it is open (between ``begin_request`` and
    ``end_request``, or inside one batched call), the holds it took (key -> hold), the
    data its features carried (receivers), and the recency stamps the cached items it
    touched had before it (``lru`` mode's sender)."""

    def __init__(self) -> None:
        self.open = False
        self.holds: dict[str, Hold] = {}
        self.carried: dict[str, Any] = {}
        self.moved: dict[str, int] = {}

    def __reduce__(self) -> tuple[type[RequestState], tuple[()]]:
        # A pickled cache's copy has no request in flight: its threads have none yet.
        return RequestState, ()


class Holds:
    """The keys the requests in flight protect, counted across requests.

    ``protect(key) -> bool`` protects ``key`` in the store if it is there (and says whether
    it did); ``unprotect(key)`` ends that protection.  Each is called once per protection:
    when the first request takes the key and when the last one lets go.  The caller holds
    the cache's lock around every method.
    """

    def __init__(self, protect: Callable[[str], bool], unprotect: Callable[[str], None]) -> None:
        self._protect = protect
        self._unprotect = unprotect
        self._current: dict[str, Hold] = {}

    def take(self, mine: dict[str, Hold], key: str) -> None:
        """The request whose holds are ``mine`` protects ``key``: a no-op when it already
        does, or when ``key`` is not in the store."""
        hold = self._current.get(key)
        if hold is None:
            if not self._protect(key):
                return
            hold = self._current[key] = Hold()
            hold.count = 1
        elif mine.get(key) is not hold:
            hold.count += 1
        else:
            return
        mine[key] = hold

    def give(self, mine: dict[str, Hold], key: str) -> None:
        """The request lets go of ``key`` (a no-op when it holds it not, or its hold is
        stale); the last one to let go ends the protection."""
        hold = mine.pop(key, None)
        if hold is None or self._current.get(key) is not hold:
            return
        hold.count -= 1
        if hold.count == 0:
            del self._current[key]
            self._unprotect(key)

    def give_all(self, mine: dict[str, Hold]) -> None:
        """The request lets go of every key it holds."""
        for key in list(mine):
            self.give(mine, key)

    def forget(self, key: str) -> None:
        """The store dropped ``key``'s protection itself (popped, invalidated): the holds on
        it are stale."""
        self._current.pop(key, None)

    def forget_all(self) -> None:
        """The store dropped every protection (cleared)."""
        self._current.clear()


class ProtectedLRU:
    """An LRU whose entries the requests in flight keep from being evicted by their own
    insertions (nor by other requests'): the same rule on P0 and P1, so the mirror holds.

    An item a request touched (one present when touched) is protected until the request is
    done when the request is updated in one call, or until its own update when items are
    updated one by one; an item updated in the request without a touch is not protected.
    ``request`` is the owning cache's per-thread state, so "the request" is always the
    calling thread's.  The caller holds the cache's lock around every method.
    """

    def __init__(self, lru: UnsynchronizedLRUCache, request: RequestState) -> None:
        self.lru = lru
        self._request = request
        self._holds = Holds(lru.protect, lru.unprotect)
        lru.unprotect_all()  # no request holds anything yet (in a pickled copy too)

    def __reduce__(self) -> tuple[Any, ...]:
        # A pickled copy starts with no request in flight, so with nothing protected.
        return ProtectedLRU, (self.lru, self._request)

    def touch(self, key: str) -> int | None:
        """Make ``key`` most recent and protect it for this request; a no-op when absent.
        Returns its recency stamp before (``None`` when absent)."""
        before = self.lru.touch(key)
        if before is not None:
            self._holds.take(self._request.holds, key)
        return before

    def updated(self, key: str) -> None:
        """``key`` was updated: outside a request, this thread's protection of it ends now."""
        request = self._request
        if not request.open and request.holds:
            self._holds.give(request.holds, key)

    def end(self, keys: Sequence[str] | None) -> None:
        """This thread's request is over: let go of ``keys`` (``None``: of every key it
        protects)."""
        if keys is None:
            self.release_all()
            return
        for key in keys:
            self._holds.give(self._request.holds, key)

    def release_all(self) -> None:
        """This thread's request lets go of every key it protects."""
        self._holds.give_all(self._request.holds)

    def pop(self, key: str) -> None:
        """Remove ``key``, protected or not."""
        self.lru.pop(key)
        self._holds.forget(key)

    def clear(self) -> None:
        """Remove every entry and every protection, and reset the statistics."""
        self.lru.clear()
        self._holds.forget_all()
