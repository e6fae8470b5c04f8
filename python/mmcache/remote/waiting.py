"""The remote tier's two waiting rooms, each bounded by count and by bytes
(:func:`~mmcache.items.item_size`): the items waiting to be published (:class:`Publisher`, its
writer thread's queue) and the fetched items waiting for their update (:class:`Fetched`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from mmcache.items import Item, item_size
from mmcache.remote.store import RemoteStore

__all__ = ["Fetched", "Publisher"]

logger = logging.getLogger("mmcache")


class Publisher:
    """A daemon writer thread putting ``(key, record)`` pairs into the remote store from a
    queue bounded by ``capacity`` items and ``capacity_bytes`` (an item counts until its put
    returns); a key already queued is not queued twice.  The claims (held by ``owner``) on
    keys passed to :meth:`release_after_put` are dropped once the key's put returned,
    whatever the outcome.  Thread-safe."""

    def __init__(self, remote: RemoteStore, owner: str, capacity: int, capacity_bytes: int) -> None:
        self._remote = remote
        self._owner = owner
        self._queue: queue.Queue[tuple[str, Item] | None] = queue.Queue(maxsize=capacity)
        self._queued: dict[str, int] = {}  # key -> its bytes, until its put returns
        self._queued_bytes = 0
        self._releasing: set[str] = set()  # queued keys whose claim ends after their put
        self._capacity_bytes = capacity_bytes
        self._closed = False
        self._lock = threading.Lock()
        self.dropped = 0
        self.failed = 0  # only the writer thread counts it
        self._thread = threading.Thread(target=self._run, name="mmcache-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, record: Item, *, size: int | None = None) -> bool:
        """Queue ``record`` for ``key``, counting ``size`` bytes (default: the record's
        :func:`~mmcache.items.item_size`); whether this call queued it (never once closed)."""
        size = item_size(record) if size is None else size
        with self._lock:
            if self._closed or key in self._queued:
                return False
            if self._queued_bytes + size > self._capacity_bytes:
                self.dropped += 1
                return False
            try:
                self._queue.put_nowait((key, record))
            except queue.Full:
                self.dropped += 1
                return False
            self._queued[key] = size
            self._queued_bytes += size
            return True

    def release_after_put(self, keys: Sequence[str]) -> list[str]:
        """Have the claims on those of ``keys`` whose put is pending dropped once it returned;
        the others (whose claims the caller drops now)."""
        with self._lock:
            pending = {k for k in keys if k in self._queued}
            self._releasing |= pending
        return [k for k in keys if k not in pending]

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._publish(*job)
            except Exception:  # a bug must not end publishing for the life of the engine
                self.failed += 1
                if self.failed == 1:
                    logger.exception("publishing item %s to the remote tier failed", job[0])
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _publish(self, key: str, record: Item) -> None:
        try:
            self._remote.put(key, record)
        finally:  # after the put: a waiting host finds the item, not a gap
            with self._lock:
                self._queued_bytes -= self._queued.pop(key)
                release = key in self._releasing
                self._releasing.discard(key)
            if release:
                self._remote.release_claims([key], self._owner)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued item was put (at most ``timeout_s``); whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # A lock waits at most TIMEOUT_MAX (an infinite timeout_s: OverflowError).
                self._queue.all_tasks_done.wait(min(remaining, threading.TIMEOUT_MAX))
        return True

    def close(self, timeout_s: float) -> None:
        """Put what is queued (waiting at most ``timeout_s``: what is still queued then is
        dropped, counted, and its claims dropped now) and stop the writer thread; nothing is
        queued after (:meth:`submit` answers ``False``).  Idempotent."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        unput: list[str] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Emptied, so the sentinel below never waits for room behind a slow put (the
            # store closes next: these would never be put).  No sentinel is queued yet.
            with contextlib.suppress(queue.Empty):
                while (job := self._queue.get_nowait()) is not None:
                    self._queue.task_done()
                    self._queued_bytes -= self._queued.pop(job[0])
                    self.dropped += 1
                    if job[0] in self._releasing:
                        self._releasing.discard(job[0])
                        unput.append(job[0])
        self._remote.release_claims(unput, self._owner)
        self._queue.put(None)
        self._thread.join(min(max(0.0, deadline - time.monotonic()), threading.TIMEOUT_MAX))


class Fetched:
    """The items :meth:`TieredSenderCache.is_cached` fetched, waiting for their update, as
    ``(item, prompt_updates)``: at most ``limit`` items and ``limit_bytes`` of them, the
    oldest dropped first.  Used under the cache's lock (``in`` alone is atomic)."""

    class _Entry:
        __slots__ = ("record", "served", "size")

        def __init__(self, record: tuple[Item, Any], size: int) -> None:
            self.record = record
            self.size = size
            self.served = False  # whether an update has used it

    def __init__(self, limit: int, limit_bytes: int) -> None:
        self._entries: OrderedDict[str, Fetched._Entry] = OrderedDict()
        self._bytes = 0
        self._limit = limit
        self._limit_bytes = limit_bytes

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: str) -> tuple[Item, Any] | None:
        found = self._entries.get(mm_hash)
        return None if found is None else found.record

    def served(self, mm_hash: str) -> bool:
        """An update used ``mm_hash``'s item: whether it is the first (False when absent)."""
        found = self._entries.get(mm_hash)
        if found is None or found.served:
            return False
        found.served = True
        return True

    def pop(self, mm_hash: str) -> None:
        found = self._entries.pop(mm_hash, None)
        if found is not None:
            self._bytes -= found.size

    def add(self, mm_hash: str, record: tuple[Item, Any]) -> list[str]:
        """Keep ``record`` for ``mm_hash`` (unless one is kept already: the same item,
        verified); the hashes dropped to stay in bounds (``mm_hash`` itself, if its item
        alone is over them)."""
        if mm_hash in self._entries:
            return []
        entry = self._entries[mm_hash] = Fetched._Entry(record, item_size(record[0]))
        self._bytes += entry.size
        dropped: list[str] = []
        while len(self._entries) > self._limit or self._bytes > self._limit_bytes:
            h, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
            dropped.append(h)
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
