"""The receivers: P1's cache in ``lru`` mode and each worker's in ``shm`` mode.

P1's is mmcache's mirror of P0's LRU: a miss raises vLLM's ``MultiModalCacheMissError``
listing every hash of the request it does not hold, which vLLM's engine core turns into one
retry with data.

A worker attaches to the ring P0 published (:mod:`mmcache.vllm.publish`) in its constructor,
before P0 can write.  It reads zero-copy views, copies each tensor once into memory of its
own (pinned where vLLM pins and this process can), and keeps the views of what it read last
for the requests vLLM replays.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import cachetools
from vllm.config import ModelConfig, VllmConfig
from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache
from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache
from vllm.utils.platform_utils import is_pin_memory_available

from mmcache import pinning
from mmcache._core import ReaderHandle
from mmcache.arguments import (
    check_feature_list,
    check_hash_list,
    check_item_list,
    check_mm_hash,
    feature_keys,
)
from mmcache.caches import ReceiverCache
from mmcache.errors import StaleHandleError
from mmcache.items import Feature, ShmHandle, item_size
from mmcache.shm import ShmReceiverCache
from mmcache.vllm.errors import (
    InvalidShmHandleError,
    StaleShmHandleError,
    invalid_handle,
    vllm_errors,
)
from mmcache.vllm.publish import published_handle
from mmcache.vllm.sender import KeysView, capacity_gb
from mmcache.vllm.wire import handle_from_item, item_from_mmcache, vllm_item_size

__all__ = ["REPLAY_SHARE", "MmcacheLruReceiverCache", "MmcacheShmReceiverCache"]

logger = logging.getLogger(__name__)

REPLAY_SHARE = 4
"""A worker keeps the objects it read most recently alive in the ring, up to 1/REPLAY_SHARE
of its capacity, so that a replayed handle (a preempted request vLLM resends) still reads."""


class MmcacheLruReceiverCache(LruKeyReplicatedReceiverCache):  # type: ignore[misc]
    """vLLM's P1 cache in ``lru`` mode, on :class:`ReceiverCache`: a miss raises
    ``MultiModalCacheMissError`` listing every hash of the request it does not hold."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._receiver = ReceiverCache(capacity_gb(model_config), getsizeof=vllm_item_size)
        self._cache = KeysView(self._receiver.keys)

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        """Resolve the request's features (in prompt order), then settle the recency of its
        items as P0 settled it (P0 updated them modality by modality): the mirror holds."""
        check_feature_list(mm_features)
        if not isinstance(mm_features, Sequence):  # read more than once below
            mm_features = list(mm_features)
        # Read (and checked) before anything is resolved: the settling below runs whatever
        # resolving raised.
        keys = feature_keys(mm_features)
        # One step for the cache: no other thread's request between the two.
        with self._receiver._lock:
            try:
                with vllm_errors():
                    self._receiver.get_and_update_features(mm_features)
            finally:
                self._receiver.settle_recency(keys)
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        with vllm_errors():
            return self._receiver.get_and_update_item(mm_item, mm_hash)

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: list[str]) -> list[Any]:
        with vllm_errors():
            return self._receiver.get_and_update(mm_items, mm_hashes)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        self._receiver.touch_receiver_cache_item(mm_hash, mm_item)

    def clear_cache(self) -> None:
        self._receiver.clear_cache()


class _Rejected:
    """A feature's data that is not a valid handle item: raises when resolved, so the rest
    of the request is still resolved (and gives back its references) first."""

    def __init__(self, error: InvalidShmHandleError) -> None:
        self.error = error


class _VllmShmReader(ShmReceiverCache):
    """A ring reader that returns vLLM items and keeps replayed handles readable.

    vLLM's scheduler resends a preempted request with the same handles, as often as it
    preempts it.  Reading a handle gives its reference back, after which the ring may reclaim
    the object.  So the reader reads zero-copy views, hands vLLM a copy (pinned where vLLM
    pins), and keeps the views of the objects it read most recently, up to ``lease_bytes``:
    while a view lives, its object stays in the ring, and a replay reads it again, verified,
    from P0's own bytes, however many times.  A replay of an object no longer kept is a
    miss, never another item's data.
    """

    def __init__(self, handle: ReaderHandle, *, pin_memory: bool, lease_bytes: int) -> None:
        super().__init__(handle, copy=False)
        self._pin_memory = pin_memory
        self._leases: cachetools.LRUCache[tuple[str, ShmHandle], Any] = cachetools.LRUCache(
            lease_bytes, getsizeof=item_size
        )
        # The reader resolves without a lock (worker threads read in parallel); the leases
        # are Python state threads share: two inserts evicting at once would pop one key twice.
        self._leases_lock = threading.Lock()

    def get_and_update_item(self, item: Any, mm_hash: str) -> Any:
        if isinstance(item, _Rejected):
            raise item.error
        views: Any = super().get_and_update_item(item, mm_hash)
        if not isinstance(item, ShmHandle):
            return views  # a plain vLLM item, passed through
        lease = (mm_hash, item)
        # A replay of a leased object refreshes the lease and keeps its views: what the
        # replay read is a private copy, which would not keep the object in the ring.
        with self._leases_lock:
            if self._leases.get(lease) is None and item_size(views) <= self._leases.maxsize:
                self._leases[lease] = views
        return item_from_mmcache(views, pin_memory=self._pin_memory)

    def give_back(self, handle: ShmHandle, mm_hash: str) -> None:
        """Give back this reader's reference of a handle never delivered to it: read it
        without decoding (a miss: it was reclaimed, there is nothing to give back)."""
        with contextlib.suppress(StaleHandleError):
            self._store.resolve(handle, mm_hash, copy=False)

    def clear_cache(self) -> None:
        """Let the objects kept for replays go."""
        with self._leases_lock:
            self._leases.clear()


def _can_pin() -> bool:
    """Whether this process can pin the memory vLLM asks for; if not (CUDA torch on a host
    without a driver, say), one warning, and the worker resolves into unpinned memory."""
    problem = pinning.pinning_unavailable()
    if problem is not None:
        logger.warning(
            "mmcache: vLLM pins multi-modal tensors here, but this process cannot (%s); "
            "resolving them into unpinned memory",
            problem,
        )
    return problem is None


class MmcacheShmReceiverCache(ShmObjectStoreReceiverCache):  # type: ignore[misc]
    """vLLM's worker cache in ``shm`` mode, on :class:`ShmReceiverCache`: one reader slot of
    the ring P0 published, attached here, before P0 can write.

    Plain items pass through; stripped features (``data=None``) are skipped; handle items
    become the items P0 wrote, their tensors pinned where vLLM pins and this process can.
    ``shared_worker_lock`` is accepted and not needed: mmcache shares no lock between
    processes.
    """

    def __init__(self, vllm_config: VllmConfig, shared_worker_lock: Any = None) -> None:
        self.world_size = vllm_config.parallel_config.world_size
        handle = published_handle()
        self._reader: _VllmShmReader | None = None
        if handle is not None:
            self._reader = _VllmShmReader(
                handle,
                pin_memory=is_pin_memory_available() and _can_pin(),
                lease_bytes=handle.capacity // REPLAY_SHARE,
            )
        self._shm_cache = self._reader
        self._delivered: set[str] = set()
        """The requests scheduled to this worker that have not finished."""

    def _incoming(self, data: Any, mm_hash: str) -> Any:
        """A feature's data as the reader takes it: handle items become handles."""
        try:
            handle = handle_from_item(data, mm_hash)
        except InvalidShmHandleError as exc:
            return _Rejected(exc)
        if handle is not None and self._reader is None:
            return _Rejected(invalid_handle(mm_hash, "this process has no ring to read"))
        return data if handle is None else handle

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        """Resolve every feature that carries data, in place (``None``: a payload the
        scheduler stripped, nothing to read)."""
        check_feature_list(mm_features)
        if not isinstance(mm_features, Sequence):  # read more than once below
            mm_features = list(mm_features)
        keys = feature_keys(mm_features)  # before any handle is read
        with_data = [
            (f, key) for f, key in zip(mm_features, keys, strict=True) if f.data is not None
        ]
        resolving = [
            Feature(data=self._incoming(f.data, key), mm_hash=f.mm_hash, identifier=f.identifier)
            for f, key in with_data
        ]
        with vllm_errors(StaleShmHandleError):
            if self._reader is None:
                for feature in resolving:
                    if isinstance(feature.data, _Rejected):
                        raise feature.data.error
            else:
                self._reader.get_and_update_features(resolving)
        for (feature, _), resolved in zip(with_data, resolving, strict=True):
            feature.data = resolved.data
        return mm_features

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: Sequence[str]) -> list[Any]:
        """The resolved items of one request, resolved as :meth:`get_and_update_features`
        resolves features: every handle is read (vLLM's base class stopped at the first
        miss, leaving the handles after it unread, pinning their objects in the ring) and a
        miss lists every missing hash.  ``ValueError`` when the lengths differ."""
        mm_items = check_item_list(mm_items, "get_and_update")
        mm_hashes = check_hash_list(mm_hashes, "get_and_update")
        if len(mm_items) != len(mm_hashes):
            raise ValueError(f"{len(mm_items)} items but {len(mm_hashes)} mm_hashes")
        features = [
            SimpleNamespace(data=item, mm_hash=h, identifier=h)
            for item, h in zip(mm_items, mm_hashes, strict=True)
        ]
        self.get_and_update_features(features)
        return [feature.data for feature in features]

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        check_mm_hash(mm_hash, "get_and_update_item(item, mm_hash)")  # as the reader does
        if mm_item is None:
            return None
        incoming = self._incoming(mm_item, mm_hash)
        if isinstance(incoming, _Rejected):
            raise incoming.error
        if self._reader is None:
            return incoming
        with vllm_errors(StaleShmHandleError):
            return self._reader.get_and_update_item(incoming, mm_hash)

    def settle_requests(
        self,
        *,
        delivered: Iterable[str],
        unread: Mapping[str, list[Any]],
        finished: Iterable[str],
    ) -> None:
        """One step's requests (:mod:`mmcache.vllm.aborts`): those ``delivered`` to this
        worker (it read their handles); the handle features of requests the engine core
        finished, ``unread`` if never delivered here, whose references are given back now;
        the ``finished`` ones, forgotten."""
        self._delivered.update(delivered)
        for request_id, features in unread.items():
            if request_id in self._delivered or self._reader is None:
                continue
            for feature in features:
                mm_hash = feature.mm_hash or feature.identifier
                incoming = self._incoming(feature.data, mm_hash)
                if isinstance(incoming, ShmHandle):
                    self._reader.give_back(incoming, mm_hash)
        self._delivered.difference_update(finished)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        """Nothing to do but check ``mm_hash``, as the reader does: P0 took the references,
        reading gives them back."""
        check_mm_hash(mm_hash, "touch_receiver_cache_item(mm_hash)")

    def clear_cache(self) -> None:
        """Let the objects kept for replays go (a reader does not own the ring)."""
        if self._reader is not None:
            self._reader.clear_cache()
