"""P0's three caches: vLLM's processor-cache interface over mmcache's senders.

vLLM's P0 touches every hash of a request, updates the items one call at a time, then calls
``release_sender_touches()``.  The first touch begins an mmcache request (a touch after the
request's updates begins the next one) and the release ends it, so a touched item stays
protected for the whole request, as on the receiver.  A request whose updates did not all
happen (it raised part-way) is abandoned: the handles it was issued are given back.  Each
thread brackets its own request (vLLM's renderer runs ``--renderer-num-workers`` threads).

A request vLLM rejects after the cache issued its handles (a prompt replacement that fails,
a prompt too long) never reaches the workers: vLLM's frontend runs each render in
:func:`rendering`, and the handles of the requests a render completed are given back when
it raises (:mod:`mmcache.vllm.frontend` wraps vLLM's methods).  In ``lru`` mode P1 never
sees such a request, nor one that raised part-way: P0 forgets the items it stored (as it
applies invalidations, below) and gives the items it found cached the recency they had
before it (:meth:`~mmcache.caches.SenderCache.undo_recency`), so the two LRUs stay alike.

Invalidations (a receiver reported items missing) never land inside a request that found
the item cached: one that arrives from another thread while such a request is between its
lookup (``is_cached``) and its release is queued, and applied once no request that found the
item cached is there any more.  Only those requests hold it back: under load renderer
threads overlap, some request is always between its lookup and its release, and an
invalidation that waited for none to be there would never land (the retry of the request that
missed would find the item cached again, and miss again).  vLLM 0.33's renderer queues them
itself and drains them, in its own thread, before its next lookup; vLLM 0.32's frontend calls
``invalidate`` from its output handler while the renderer's thread may be processing a
request that found the item cached, which would then miss it.

Sizes are vLLM's own (:func:`~mmcache.vllm.wire.vllm_item_size`), passed to the LRU caches
as their ``getsizeof``, so capacities mean what they mean in vLLM.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from typing import Any

from vllm.config import ModelConfig, VllmConfig
from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache
from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache
from vllm.multimodal.cache.shm import ShmObjectStoreSenderCache
from vllm.utils.cache import CacheInfo as VllmCacheInfo

from mmcache._core import WriterHandle
from mmcache.arguments import check_hash_list, check_item_list, check_mm_hash
from mmcache.caches import BaseSenderCache, ProcessorOnlyCache, SenderCache
from mmcache.errors import ShmTooSmallError
from mmcache.items import ShmHandle
from mmcache.shm import ShmSenderCache
from mmcache.vllm.errors import invalid_handle, vllm_errors
from mmcache.vllm.prompt_codec import PROMPT_UPDATES_CODEC
from mmcache.vllm.publish import publish, published_writer_handle, withdraw
from mmcache.vllm.wire import (
    handle_as_item,
    handle_from_item,
    item_from_mmcache,
    item_to_mmcache,
    vllm_item_size,
)

__all__ = [
    "CLAIM_WAIT_ENV",
    "CLAIM_WAIT_S",
    "KeysView",
    "MmcacheLruSenderCache",
    "MmcacheProcessorOnlyCache",
    "MmcacheShmSenderCache",
    "capacity_gb",
    "claim_wait_s",
    "join_ring",
    "make_ring",
    "rendering",
    "shares_one_ring",
]

logger = logging.getLogger(__name__)

_render = threading.local()
"""This thread's render (:func:`rendering`): ``issued``, the adapters whose requests it
completed, the outputs those requests were issued, the hashes whose outputs carried data
and those they found cached (``None`` outside a render)."""


@contextmanager
def rendering() -> Iterator[None]:
    """One render of vLLM's frontend in this thread (its requests to the processor cache).

    If the render raises after a request of it ended (vLLM failed the prompt's replacement,
    say), nothing of it reaches the workers: the handles its requests were issued are given
    back (in ``lru`` mode, the items they stored are forgotten: P1 never gets them, and
    the items they found cached get their earlier recency back).  Every lookup the render
    opened is closed (:meth:`_SenderAdapter.is_cached`).
    """
    issued: list[tuple[_SenderAdapter, list[Any], list[str], Set[str]]] = []
    outer, _render.issued = getattr(_render, "issued", None), issued
    try:
        yield
    except BaseException:
        for cache, handles, sent, found in issued:
            cache._abandon(handles, sent, found)
        for cache in {id(entry[0]): entry[0] for entry in issued}.values():
            # A render that failed before vLLM's release (its processor raised, say) still
            # holds what its lookup claimed: another API server may be waiting for it.
            cache._sender.release_sender_touches()
        raise
    else:
        if outer is not None:  # a render inside a render: the outer one may still fail
            outer += issued
    finally:
        _render.issued = outer
        for cache in {id(entry[0]): entry[0] for entry in issued}.values():
            cache._end_lookup()


class _Bracket(threading.local):
    """One thread's request as vLLM brackets it (renderer threads each run their own): the
    touches and updates it made so far and the outputs it was issued."""

    def __init__(self) -> None:
        self.touches = 0
        self.updates = 0
        self.issued: list[Any] = []
        self.sent: list[str] = []
        """The hashes whose outputs carried data (the items the request stored)."""
        self.keys: list[str] = []
        self.found: Set[str] = frozenset()
        """The hashes the request's lookup found cached (set as the request begins)."""


class _SenderAdapter:
    """vLLM's P0 cache interface over an mmcache sender (``self._sender``), with vLLM's
    request bracket mapped onto ``begin_request`` / ``end_request`` (see the module)."""

    _sender: BaseSenderCache

    def _adopt(self, sender: BaseSenderCache) -> None:
        self._sender = sender
        self._bracket = _Bracket()
        self._invalidation_lock = threading.Lock()
        self._looking_up: dict[int, set[str]] = {}
        """Threads whose request is between its lookup and its release, and the hashes that
        request found cached (while a lookup runs: every hash it looks up)."""
        self._pending_invalidations: list[str] = []

    def _to_mmcache(self, mm_item: Any) -> Any:
        """vLLM's input item as the sender takes it."""
        return mm_item

    def _to_vllm(self, data: Any, mm_item: Any) -> Any:
        """What the sender returned for ``mm_item``, as vLLM expects it."""
        return data

    def _abandon(
        self, issued: list[Any], sent: Sequence[str] = (), found: Set[str] = frozenset()
    ) -> None:
        """A request failed part-way, or was rejected after it (it has ended): give back
        what its outputs (``issued``) hold; ``sent`` are the hashes whose outputs carried
        data, ``found`` those it found cached."""

    def is_cached_item(self, mm_hash: str) -> bool:
        return self._sender.is_cached_item(mm_hash)

    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        """vLLM's lookup of a request's items: applies the invalidations queued so far that
        no other request holds back, then holds back those of the items it finds cached
        until this request is released (see the module)."""
        if type(mm_hashes) is not list:
            # Read once, here (a generator): the lookup's record below reads them first.
            mm_hashes = list(check_hash_list(mm_hashes))
        me = threading.get_ident()
        bracket = self._bracket
        with self._invalidation_lock:
            # vLLM looks a request up once per modality: a lookup with no touch since this
            # thread's last one is of the same request.  After touches, the earlier lookup's
            # request never got its release: this is the next request.
            if me not in self._looking_up or bracket.touches or bracket.updates:
                self._looking_up[me] = set()
            found = self._looking_up[me]
            found_before = list(found)  # what this request's earlier lookups found cached
            # What no other request holds back lands before this lookup (what this thread's
            # earlier request held back included); the rest waits, and so does what arrives
            # while the lookup runs (it may find any of these hashes cached)...
            self._apply_pending_invalidations()
            try:
                looking = [h for h in mm_hashes if h not in found]
            except TypeError:  # an unhashable one: the sender's error names it
                check_hash_list(mm_hashes)
                raise
            found.update(looking)
        if (issued := getattr(_render, "issued", None)) is not None:
            issued.append((self, [], [], frozenset()))  # so that the render closes this lookup
        cached: list[bool] = []
        try:
            cached = self._look_up(mm_hashes, found_before)
        finally:
            with self._invalidation_lock:
                # ... and afterwards only those it found cached hold invalidations back.
                hits = {h for h, c in zip(mm_hashes, cached, strict=False) if c}
                if self._looking_up.get(me) is found:
                    found.difference_update(h for h in looking if h not in hits)
                self._apply_pending_invalidations()
        return cached

    def _look_up(self, mm_hashes: list[str], found_before: Sequence[str]) -> list[bool]:
        """The sender's lookup of a request's items (``found_before``: the hashes the
        request's earlier lookups found cached)."""
        return self._sender.is_cached(mm_hashes)

    def _end_lookup(self) -> None:
        """This thread's request is released: apply what waited for it."""
        with self._invalidation_lock:
            self._looking_up.pop(threading.get_ident(), None)
            self._apply_pending_invalidations()

    def _held_back(self, mm_hash: str, *, but: int | None = None) -> bool:
        """Whether a request (of a thread other than ``but``) between its lookup and its
        release found ``mm_hash`` cached (invalidation lock held)."""
        return any(mm_hash in found for t, found in self._looking_up.items() if t != but)

    def _apply_pending_invalidations(self) -> None:
        """Apply the queued invalidations no request that found their item cached holds
        back any more (invalidation lock held)."""
        waiting = []
        for mm_hash in self._pending_invalidations:
            if self._held_back(mm_hash):
                waiting.append(mm_hash)
            else:
                self._sender.invalidate(mm_hash)
        self._pending_invalidations = waiting

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Protect ``mm_hash`` until the request ends; the first touch of a request (a touch
        after the open request's updates) begins it."""
        if self._bracket.updates or not self._sender.in_request:
            self._end_request()
            self._sender.begin_request()
            # What this request's lookup found cached (its lookups precede its touches).
            self._bracket.found = self._looking_up.get(threading.get_ident(), frozenset())
        self._bracket.touches += 1
        self._bracket.keys.append(mm_hash)
        self._sender.touch_sender_cache_item(mm_hash)

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        with vllm_errors():
            data, prompt_updates = self._sender.get_and_update_item(
                self._to_mmcache(mm_item), mm_hash
            )
        if self._sender.in_request:
            bracket = self._bracket
            bracket.updates += 1
            bracket.issued.append(data)
            bracket.keys.append(mm_hash)
            if data is not None:
                bracket.sent.append(mm_hash)
        return self._to_vllm(data, mm_item), prompt_updates

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: Sequence[str]) -> list[Any]:
        """One request: every item is updated or none (a miss lists every missing hash)."""
        # Before the conversion iterates them (and read into lists: both are read again).
        mm_items = check_item_list(mm_items, "get_and_update")
        mm_hashes = check_hash_list(mm_hashes, "get_and_update")
        with vllm_errors():
            outputs = self._sender.get_and_update(
                [self._to_mmcache(item) for item in mm_items], mm_hashes
            )
        if self._sender.in_request:
            bracket = self._bracket
            bracket.updates += len(outputs)
            bracket.issued += [data for data, _ in outputs]
            bracket.keys += mm_hashes
            sent = zip(outputs, mm_hashes, strict=True)
            bracket.sent += [h for (data, _), h in sent if data is not None]
        return [
            (self._to_vllm(data, item), updates)
            for (data, updates), item in zip(outputs, mm_items, strict=True)
        ]

    def release_unsent(self, items: Sequence[Any], mm_hashes: Sequence[str | None] = ()) -> None:
        """Give back what vLLM items this cache output for a request that will never be sent
        (vLLM rejected it after rendering it) hold: their handles, and, in ``lru`` mode, the
        items they stored and the recency it moved (``mm_hashes``: each item's hash, where
        known)."""
        handles = [handle_from_item(item, "") for item in items if item is not None]
        # (No hashes, or fewer: only the handles are given back.)
        known = list(zip(items, mm_hashes, strict=False))
        sent = [h for item, h in known if item is not None and h is not None]
        found: Set[str] = frozenset()
        if len(mm_hashes) == len(items) and None not in mm_hashes:
            # In lru mode a hit's output is None (and a repeat of an item the request
            # stored is one too).
            found = {h for item, h in known if item is None and h is not None} - set(sent)
        self._abandon([handle for handle in handles if handle is not None], sent, found)

    def release_sender_touches(self) -> None:
        """End the request vLLM assembled (vLLM calls this whether or not it succeeded)."""
        self._end_request()
        self._end_lookup()

    def _end_request(self) -> None:
        bracket = self._bracket
        if self._sender.in_request:
            failed = bracket.updates < bracket.touches
            if not failed:
                # P1 resolves the request in prompt order, not in the order vLLM updated
                # it here: both sides end it with the same recency (see settle_recency).
                settle = getattr(self._sender, "settle_recency", None)
                if settle is not None:
                    settle(bracket.keys)
                if (issued := getattr(_render, "issued", None)) is not None:
                    issued.append((self, bracket.issued, bracket.sent, bracket.found))
            self._sender.end_request()
            if failed:
                self._abandon(bracket.issued, bracket.sent, bracket.found)
        bracket.touches = bracket.updates = 0
        bracket.issued = []
        bracket.sent = []
        bracket.keys = []

    def invalidate(self, mm_hash: str) -> None:
        """Forget ``mm_hash`` now, or, while another thread's request that found it cached
        is between its lookup and its release, once no such request is (see the module)."""
        # Checked now, whatever other threads do: a hash held back is checked only when it
        # lands (a list raised "unhashable type" from the check of whether it is held back).
        check_mm_hash(mm_hash, "invalidate(mm_hash)")
        with self._invalidation_lock:
            if self._held_back(mm_hash, but=threading.get_ident()):
                if mm_hash not in self._pending_invalidations:
                    self._pending_invalidations.append(mm_hash)
            else:
                self._sender.invalidate(mm_hash)

    def clear_cache(self) -> None:
        self._sender.clear_cache()

    def make_stats(self, *, delta: bool = False) -> Any:
        return VllmCacheInfo(*self._sender.make_stats(delta=delta))

    def close(self) -> None:
        self._sender.close()


class KeysView:
    """What vLLM's LRU caches expose as ``_cache`` and its tests inspect: membership and
    ``order`` (keys, least recently used first).  Read-only."""

    def __init__(self, keys: Callable[[], list[Any]]) -> None:
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    @property
    def order(self) -> dict[Any, None]:
        return dict.fromkeys(self._keys())


def capacity_gb(model_config: Any) -> float:
    """``--mm-processor-cache-gb``: every cache's capacity, in GiB."""
    return float(model_config.get_multimodal_config().mm_processor_cache_gb)


class MmcacheProcessorOnlyCache(_SenderAdapter, MultiModalProcessorOnlyCache):  # type: ignore[misc]
    """vLLM's P0 cache when nothing is cached downstream, on :class:`ProcessorOnlyCache`."""

    def __init__(self, model_config: ModelConfig) -> None:
        # Not vLLM's constructor: it would build the store this class replaces.
        sender = ProcessorOnlyCache(capacity_gb(model_config), getsizeof=vllm_item_size)
        self._adopt(sender)
        self._cache = KeysView(sender.keys)


class MmcacheLruSenderCache(_SenderAdapter, LruKeyReplicatedSenderCache):  # type: ignore[misc]
    """vLLM's P0 cache in ``lru`` mode, on :class:`SenderCache` (P1's mirror)."""

    def __init__(self, model_config: ModelConfig) -> None:
        sender = SenderCache(capacity_gb(model_config), getsizeof=vllm_item_size)
        self._adopt(sender)
        self._mirror = sender
        self._cache = KeysView(sender.keys)

    def _abandon(
        self, issued: list[Any], sent: Sequence[str] = (), found: Set[str] = frozenset()
    ) -> None:
        """The request never reaches P1: the items it stored are forgotten, so that P0
        sends them with their data next time (kept, the next request with one of them would
        miss at P1), and the items it found cached get the recency they had before it
        (kept most recent, they made P0 evict other items than P1 next).

        Forgotten as invalidations are (:meth:`invalidate`): another thread's request that
        found such an item cached since keeps it until its release (forgotten inside it,
        its update of the item would raise at P0, failing it for good; kept, the request
        misses at P1, and one retry recovers it)."""
        if found:
            self._mirror.undo_recency(found)
        for mm_hash in sent:
            self.invalidate(mm_hash)


def shares_one_ring(vllm_config: VllmConfig) -> bool:
    """Whether this is an engine whose several API servers share one ring: a multimodal
    model with a ``shm`` processor cache, several API processes and one engine (what vLLM
    itself serves processor-only, for want of one ring; see :mod:`mmcache.vllm.launcher`)."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if not model_config.supports_multimodal_inputs:
        return False
    mm_config = model_config.get_multimodal_config()
    return bool(
        mm_config.mm_processor_cache_gb > 0
        and mm_config.mm_processor_cache_type == "shm"
        and parallel._api_process_count > 1
        and (parallel.data_parallel_size == 1 or parallel.data_parallel_external_lb)
    )


def make_ring(vllm_config: VllmConfig, *, max_writers: int = 1) -> ShmSenderCache | None:
    """A ring of ``mm_processor_cache_gb`` with one reader slot per worker and
    ``max_writers`` writer slots, this one included; ``None``, with one warning, when
    ``/dev/shm`` cannot hold it, or when ``mm_shm_cache_max_object_size_mb`` is 0."""
    mm_config = vllm_config.model_config.get_multimodal_config()
    size_gb = capacity_gb(vllm_config.model_config)
    if mm_config.mm_shm_cache_max_object_size_mb <= 0:
        # vLLM takes 0 (its own ring then serves every item uncached, through IPC): the
        # fallback does the same without a ring no item could enter.
        logger.warning(
            "mmcache: --mm-shm-cache-max-object-size-mb=%s lets no item into the shared-memory "
            "ring; serving multi-modal items through IPC with a processor-only cache instead. "
            "Set it above 0 to use the shared-memory cache.",
            mm_config.mm_shm_cache_max_object_size_mb,
        )
        return None
    try:
        return ShmSenderCache(
            size_gb,
            max_object_size_mb=mm_config.mm_shm_cache_max_object_size_mb,
            n_readers=vllm_config.parallel_config.world_size,
            max_writers=max_writers,
            prompt_updates_codec=PROMPT_UPDATES_CODEC,
        )
    except ShmTooSmallError as exc:
        logger.warning(
            "mmcache: no shared-memory ring of %.4g GiB (%s); serving multi-modal items "
            "through IPC with a processor-only cache instead. Give /dev/shm more room "
            "(e.g. docker run --shm-size) or lower --mm-processor-cache-gb to use the "
            "shared-memory cache.",
            size_gb,
            exc,
        )
        return None


def join_ring(writer_handle: WriterHandle) -> ShmSenderCache:
    """One more writer of the ring ``writer_handle`` names, whose prompt updates it reads."""
    return ShmSenderCache.join(writer_handle, prompt_updates_codec=PROMPT_UPDATES_CODEC)


CLAIM_WAIT_ENV = "MMCACHE_VLLM_CLAIM_WAIT_S"
"""Seconds an API server's lookup waits for an item another API server is processing
(single flight on a shared ring; ``0`` turns it off). Default :data:`CLAIM_WAIT_S`."""

CLAIM_WAIT_S = 10.0


def claim_wait_s() -> float:
    """:data:`CLAIM_WAIT_ENV`'s value (:data:`CLAIM_WAIT_S` when unset)."""
    text = os.environ.get(CLAIM_WAIT_ENV, "")
    try:
        wait_s = float(text) if text.strip() else CLAIM_WAIT_S
    except ValueError:
        wait_s = math.nan
    if not 0 <= wait_s < math.inf:
        raise ValueError(f"{CLAIM_WAIT_ENV} must be a number of seconds >= 0, not {text!r}")
    return wait_s


class MmcacheShmSenderCache(_SenderAdapter, ShmObjectStoreSenderCache):  # type: ignore[misc]
    """vLLM's P0 cache in ``shm`` mode, on :class:`ShmSenderCache`: a writer of a ring of
    ``mm_processor_cache_gb`` with one reader slot per worker (``world_size``).

    With one API server, P0 builds the ring and publishes its ``ReaderHandle`` to the
    processes it starts later (see :mod:`mmcache.vllm.publish`).  With several
    (``--api-server-count``), each joins, as one writer, the ring the launcher made for them
    (see :mod:`mmcache.vllm.launcher`); their items and prompt updates are every server's,
    and their lookups take single-flight claims: an item another API server is processing
    is waited for (at most :data:`CLAIM_WAIT_ENV` seconds) instead of processed again.
    When ``/dev/shm`` cannot hold the ring, or ``mm_shm_cache_max_object_size_mb`` is 0 (no
    item fits it), it logs one warning and runs as a :class:`ProcessorOnlyCache` instead
    (items then always travel with their data and the workers pass them through): a small
    container never stops the frontend.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.world_size = vllm_config.parallel_config.world_size
        self._published = ""
        self._claim_wait_s = 0.0
        if shares_one_ring(vllm_config):
            self._claim_wait_s = claim_wait_s()  # before joining: a bad value holds no slot
            writer_handle = published_writer_handle()
            ring = None if writer_handle is None else join_ring(writer_handle)
        else:
            ring = make_ring(vllm_config)
            self._published = publish(None if ring is None else ring.handle())
        self._ring = ring
        size_gb = capacity_gb(vllm_config.model_config)
        self._adopt(ring or ProcessorOnlyCache(size_gb, getsizeof=vllm_item_size))
        self._shm_cache = self._sender

    @property
    def ring(self) -> ShmSenderCache | None:
        """The shared-memory sender, or ``None`` when running without a ring."""
        return self._ring

    def _look_up(self, mm_hashes: list[str], found_before: Sequence[str]) -> list[bool]:
        if self._ring is not None and self._claim_wait_s > 0:
            # This lookup may wait (seconds) for another server's items, and vLLM touches the
            # request's items only after its last lookup: what its earlier lookups found
            # cached is pinned now (the touch then finds it pinned), or the other servers'
            # puts meanwhile could evict it and its update would miss.
            for mm_hash in found_before:
                self._ring.touch_sender_cache_item(mm_hash)
            return self._ring.is_cached(mm_hashes, claim=True, wait_s=self._claim_wait_s)
        return self._sender.is_cached(mm_hashes)

    def _to_mmcache(self, mm_item: Any) -> Any:
        if self._ring is None or not (
            isinstance(mm_item, tuple | list)
            and len(mm_item) == 2
            and isinstance(mm_item[0], Mapping)
        ):
            return mm_item  # None, or no (item, prompt_updates): the sender's to refuse
        item, prompt_updates = mm_item
        return item_to_mmcache(item), prompt_updates

    def _to_vllm(self, data: Any, mm_item: Any) -> Any:
        if isinstance(data, ShmHandle):
            return handle_as_item(data)
        if self._ring is None:
            return data
        # Served uncached: the caller's own item when it sent one; else (a saturated hit) the
        # ring's copy, which is in mmcache's form.
        return mm_item[0] if mm_item is not None else item_from_mmcache(data)

    def _abandon(
        self, issued: list[Any], sent: Sequence[str] = (), found: Set[str] = frozenset()
    ) -> None:
        if self._ring is not None:
            self._ring.release_handles(issued)

    def _stat(self, *, delta: bool = False) -> Any:
        """vLLM's statistics helper, over ours (its counters are not kept here)."""
        return self.make_stats(delta=delta)

    def remove_dangling_items(self) -> None:
        """Nothing to do: the ring prunes the prompt updates of the items it evicted itself."""

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        """``InvalidShmHandleError`` unless ``mm_item`` is plain data or the handle this cache
        holds for ``mm_hash`` now (no hit counted, no reference, no recency change)."""
        handle = handle_from_item(mm_item, mm_hash)
        if handle is None:
            return
        if self._ring is None or not self._ring.verify(handle, mm_hash):
            raise invalid_handle(mm_hash, "not the current entry of this key")

    def clear_cache(self) -> None:
        """Forget every item and reset the statistics.  Requests in flight keep their
        references: their handles still read their own data (a reader never gets another
        item's), and each object is reclaimed once it has been read."""
        if self._ring is None:
            self._sender.clear_cache()
        else:
            self._ring.clear_cache(keep_in_flight=True)

    def close(self) -> None:
        """Leave the ring (the last writer to leave unlinks the segment) and withdraw what
        was published."""
        withdraw(self._published)
        self._sender.close()
