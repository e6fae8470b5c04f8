"""P0's cache with a shared remote tier behind it: ``TieredSenderCache(local, remote)``.

It wraps any P0 cache (``ProcessorOnlyCache``, ``SenderCache``, ``ShmSenderCache``) without
changing it, and slots into the engine's loop where the local cache already sits:

1. ``is_cached(hashes)`` answers from the local cache, then asks the remote tier - once, for
   all the request's local misses - and reports the items it found there as cached too (so
   the engine does not process them).  What it fetched waits, verified, until the update.
2. ``get_and_update(inputs, hashes)`` hands the local cache the fetched item wherever the
   engine passed ``None`` for a remote hit, so the local cache takes it in exactly as if P0
   had processed it (written into the ring, or sent to P1, as the mode does).
3. Every item P0 did process (data passed for a hash the local cache did not hold) is
   published to the remote tier by a writer thread after the update; the request never waits
   for it.  A full publishing queue drops the item (counted), never blocks.

Both waiting rooms are bounded by count and by bytes (:func:`~mmcache.items.item_size`): the
items waiting to be published (until their put returns) and the fetched items waiting for
their update.

The local tiers and their guarantees are unchanged: the local cache sees the same calls in the
same order as without the tier, only with data where the tier supplied it.  The remote record
of an item is the item and its prompt updates, stored as one item
(``{"item": ..., "prompt_updates": ...}``); prompt updates the item codec cannot encode keep
that item local (counted as ``remote_unencodable``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from mmcache.caches import BaseSenderCache, SenderInput, SenderOutput
from mmcache.items import Item, item_size
from mmcache.lru import CacheInfo
from mmcache.remote.store import RemoteStore, is_shareable_key

__all__ = ["TieredSenderCache"]

logger = logging.getLogger("mmcache")
MiB = 1 << 20


class _Publisher:
    """A daemon writer thread putting ``(key, record)`` pairs into the remote store from a
    queue bounded by ``capacity`` items and ``capacity_bytes`` (an item counts until its put
    returns); a key already queued is not queued twice."""

    def __init__(self, remote: RemoteStore, capacity: int, capacity_bytes: int) -> None:
        self._remote = remote
        self._queue: queue.Queue[tuple[str, Item] | None] = queue.Queue(maxsize=capacity)
        self._queued: dict[str, int] = {}  # key -> its bytes, until its put returns
        self._queued_bytes = 0
        self._capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="mmcache-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, record: Item) -> None:
        size = item_size(record)
        with self._lock:
            if key in self._queued:
                return
            if self._queued_bytes + size > self._capacity_bytes:
                self.dropped += 1
                return
            try:
                self._queue.put_nowait((key, record))
            except queue.Full:
                self.dropped += 1
                return
            self._queued[key] = size
            self._queued_bytes += size

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            key, record = job
            try:
                self._remote.put(key, record)
            except Exception:  # a bug must not end publishing for the life of the engine
                self.failed += 1
                if self.failed == 1:
                    logger.exception("publishing item %s to the remote tier failed", key)
            finally:
                with self._lock:
                    self._queued_bytes -= self._queued.pop(key)
                self._queue.task_done()
        self._queue.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued item was put (at most ``timeout_s``); whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout_s: float) -> None:
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)


class _Fetched:
    """The items :meth:`TieredSenderCache.is_cached` fetched, waiting for their update, as
    ``(item, prompt_updates)``: at most ``limit`` items and ``limit_bytes`` of them, the
    oldest dropped first."""

    def __init__(self, limit: int, limit_bytes: int) -> None:
        self._entries: OrderedDict[str, tuple[tuple[Item, Any], int]] = OrderedDict()
        self._bytes = 0
        self._limit = limit
        self._limit_bytes = limit_bytes

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._entries

    def get(self, mm_hash: str) -> tuple[Item, Any] | None:
        found = self._entries.get(mm_hash)
        return None if found is None else found[0]

    def pop(self, mm_hash: str) -> tuple[Item, Any] | None:
        found = self._entries.pop(mm_hash, None)
        if found is None:
            return None
        self._bytes -= found[1]
        return found[0]

    def add(self, mm_hash: str, entry: tuple[Item, Any]) -> int:
        """Keep ``entry`` for ``mm_hash``; how many entries were dropped to stay in bounds
        (``entry`` itself, if it alone is over them)."""
        self.pop(mm_hash)
        size = item_size(entry[0])
        self._entries[mm_hash] = (entry, size)
        self._bytes += size
        dropped = 0
        while len(self._entries) > self._limit or self._bytes > self._limit_bytes:
            self._bytes -= self._entries.popitem(last=False)[1][1]
            dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


class TieredSenderCache(BaseSenderCache):
    """``local`` (P0's cache of any mode) with the shared ``remote`` tier behind it (see the
    module's docstring).

    ``publish_queue`` (items) and ``publish_queue_mb`` bound the items waiting for the writer
    thread (beyond either, a processed item is not published: counted); ``prefetch_limit``
    (items) and ``prefetch_limit_mb`` bound the fetched items waiting for their update (the
    oldest is dropped first, e.g. of a request the engine abandoned).  :meth:`close` closes
    both tiers.
    """

    def __init__(
        self,
        local: BaseSenderCache,
        remote: RemoteStore,
        *,
        publish_queue: int = 64,
        prefetch_limit: int = 256,
        publish_queue_mb: float = 1024,
        prefetch_limit_mb: float = 1024,
    ) -> None:
        super().__init__()
        if publish_queue < 1 or prefetch_limit < 1:
            raise ValueError("publish_queue and prefetch_limit must be at least 1")
        if not (publish_queue_mb > 0 and prefetch_limit_mb > 0):
            raise ValueError("publish_queue_mb and prefetch_limit_mb must be positive")
        self.local = local
        self.remote = remote
        self._prefetched = _Fetched(prefetch_limit, int(prefetch_limit_mb * MiB))
        self._publisher = _Publisher(remote, publish_queue, int(publish_queue_mb * MiB))
        self._counts: Counter[str] = Counter()

    # -- lookups ---------------------------------------------------------------------------

    def is_cached(self, mm_hashes: Sequence[str]) -> list[bool]:
        """Cached locally, or found in the remote tier (one batched fetch for all local
        misses of the request; the fetched items wait for :meth:`get_and_update`)."""
        local = self.local.is_cached(mm_hashes)
        wanted = list(
            dict.fromkeys(
                h
                for h, hit in zip(mm_hashes, local, strict=True)
                if not hit and h not in self._prefetched and is_shareable_key(h)
            )
        )
        if wanted:
            self._counts["remote_lookups"] += len(wanted)
            for h, record in zip(wanted, self.remote.get_many(wanted), strict=True):
                entry = self._unwrap(h, record)
                if entry is not None:
                    self._prefetch(h, entry)
        return [hit or h in self._prefetched for h, hit in zip(mm_hashes, local, strict=True)]

    def is_cached_item(self, mm_hash: str) -> bool:
        """Cached locally, or fetched from the remote tier for the coming update (no network
        call: :meth:`is_cached` is the one that asks the remote tier)."""
        return self.local.is_cached_item(mm_hash) or mm_hash in self._prefetched

    def fetched(self, mm_hash: str) -> tuple[Item, Any] | None:
        """The ``(item, prompt_updates)`` :meth:`is_cached` fetched for ``mm_hash`` and the
        coming update will use, or ``None`` (to inspect or check it; do not modify it)."""
        return self._prefetched.get(mm_hash)

    # -- updates ---------------------------------------------------------------------------

    def get_and_update(
        self, items: Sequence[SenderInput], mm_hashes: Sequence[str]
    ) -> list[SenderOutput]:
        if len(items) != len(mm_hashes):
            raise ValueError(f"{len(items)} items but {len(mm_hashes)} mm_hashes")
        taken: dict[str, tuple[Item, Any]] = {}
        inputs = [self._input(item, h, taken) for item, h in zip(items, mm_hashes, strict=True)]
        fresh = self._fresh(items, mm_hashes)
        try:
            outputs = self.local.get_and_update(inputs, mm_hashes)
        except BaseException:
            for h, entry in taken.items():  # the retry may still use them
                self._prefetch(h, entry)
            raise
        self._counts["remote_served"] += len(taken)
        for h, (item, prompt_updates) in fresh.items():
            self._publish(h, item, prompt_updates)
        return outputs

    def get_and_update_item(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        taken: dict[str, tuple[Item, Any]] = {}
        local_input = self._input(item, mm_hash, taken)
        fresh = self._fresh([item], [mm_hash])
        try:
            output = self.local.get_and_update_item(local_input, mm_hash)
        except BaseException:
            for h, entry in taken.items():
                self._prefetch(h, entry)
            raise
        self._counts["remote_served"] += len(taken)
        for h, (data, prompt_updates) in fresh.items():
            self._publish(h, data, prompt_updates)
        return output

    def _input(
        self, item: SenderInput, mm_hash: str, taken: dict[str, tuple[Item, Any]]
    ) -> SenderInput:
        """What the local cache gets for one input: the fetched item where the engine passed
        ``None`` for a remote hit (a repeated hash gets it again)."""
        if item is not None or self.local.is_cached_item(mm_hash):
            return item
        if mm_hash in taken:
            return taken[mm_hash]
        entry = self._prefetched.pop(mm_hash)
        if entry is None:
            return None  # the local cache raises CacheMissError, as it would without the tier
        taken[mm_hash] = entry
        return entry

    def _fresh(
        self, items: Sequence[SenderInput], mm_hashes: Sequence[str]
    ) -> dict[str, tuple[Item, Any]]:
        """The items P0 processed for this update (data for a hash not cached locally)."""
        fresh: dict[str, tuple[Item, Any]] = {}
        for item, h in zip(items, mm_hashes, strict=True):
            if (
                isinstance(item, tuple | list)
                and len(item) == 2
                and isinstance(item[0], Mapping)
                and is_shareable_key(h)
                and not self.local.is_cached_item(h)
            ):
                fresh[h] = (item[0], item[1])
        return fresh

    def _publish(self, mm_hash: str, item: Item, prompt_updates: Any) -> None:
        self._counts["remote_published"] += 1
        self._publisher.submit(mm_hash, {"item": item, "prompt_updates": prompt_updates})

    def _prefetch(self, mm_hash: str, entry: tuple[Item, Any]) -> None:
        self._counts["remote_prefetch_dropped"] += self._prefetched.add(mm_hash, entry)

    def _unwrap(self, mm_hash: str, record: Item | None) -> tuple[Item, Any] | None:
        if record is None:
            return None
        item = record.get("item")
        if set(record) != {"item", "prompt_updates"} or not isinstance(item, Mapping):
            self._counts["remote_malformed"] += 1
            return None
        return item, record["prompt_updates"]

    # -- the rest of a P0 cache ------------------------------------------------------------

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self.local.touch_sender_cache_item(mm_hash)

    def release_sender_touches(self) -> None:
        self.local.release_sender_touches()

    def invalidate(self, mm_hash: str) -> None:
        """Forget ``mm_hash`` locally (the remote value stays: it is still that item)."""
        self._prefetched.pop(mm_hash)
        self.local.invalidate(mm_hash)

    def clear_cache(self) -> None:
        """Clear the local cache (the remote tier is shared: it is not cleared)."""
        self._prefetched.clear()
        self.local.clear_cache()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """The local cache's hit statistics."""
        return self.local.make_stats(delta=delta)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every published item has been put (at most ``timeout_s`` seconds);
        whether all were."""
        return self._publisher.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (waiting at most ``timeout_s``), then close the local cache
        and the remote store.  Idempotent."""
        self._publisher.close(timeout_s)
        self.local.close()
        self.remote.close()

    def stats(self) -> dict[str, int]:
        """The local cache's counters, this tier's (``remote_served``: items the remote tier
        supplied, ``remote_lookups``, ``remote_published``, ``remote_publish_dropped``,
        ``remote_publish_failed``, ``remote_prefetch_dropped``, ``remote_malformed``) and the
        store's counters as ``remote_*`` (its latencies: ``remote.stats()``)."""
        own = {
            **{
                k: self._counts[k]
                for k in (
                    "remote_served",
                    "remote_lookups",
                    "remote_published",
                    "remote_prefetch_dropped",
                    "remote_malformed",
                )
            },
            "remote_publish_dropped": self._publisher.dropped,
            "remote_publish_failed": self._publisher.failed,
        }
        store = {f"remote_{k}": int(v) for k, v in self.remote.stats(latencies=False).items()}
        return {**self.local.stats(), **store, **own}
