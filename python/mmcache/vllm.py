"""mmcache inside vLLM 0.33: its own multimodal processor cache, running on mmcache.

The only module of the package that imports vLLM (install the extra: ``mmcache[vllm]``).
:func:`install` rebinds the five cache classes that ``vllm.multimodal.cache.factories`` looks
up when it builds a cache, so the frontend (P0), the engine core (P1) and every worker get
mmcache-backed caches from vLLM's own factories, with no patch to vLLM.  :func:`register` is
the ``vllm.general_plugins`` entry point ``mmcache``: vLLM calls it in every process before
it builds caches, and it installs only when ``MMCACHE_VLLM=1``.

The classes vLLM's factories look up, and what replaces each (and backs the replacement):

* ``MultiModalProcessorOnlyCache``: :class:`MmcacheProcessorOnlyCache` (``ProcessorOnlyCache``)
* ``LruKeyReplicatedSenderCache``: :class:`MmcacheLruSenderCache` (``SenderCache``)
* ``LruKeyReplicatedReceiverCache``: :class:`MmcacheLruReceiverCache` (``ReceiverCache``)
* ``ShmObjectStoreSenderCache``: :class:`MmcacheShmSenderCache` (``ShmSenderCache``)
* ``ShmObjectStoreReceiverCache``: :class:`MmcacheShmReceiverCache` (``ShmReceiverCache``)

How vLLM's conventions map onto mmcache's:

* **Sizes** are vLLM's own (``MultiModalCache.get_item_size``), passed to the LRU caches as
  their ``getsizeof``, so capacities mean what they mean in vLLM.
* **The request bracket.**  vLLM's P0 touches every hash of a request, updates the items one
  call at a time, then calls ``release_sender_touches()``.  The first touch begins an
  mmcache request (a touch after the request's updates begins the next one) and the release
  ends it, so a touched item stays protected for the whole request, as on the receiver.  A
  request whose updates did not all happen (it raised part-way) is abandoned: the handles
  it was issued are given back.
* **Handles** travel as a ``MultiModalKwargsItem`` of four int fields: ``address``,
  ``monotonic_id``, ``signature`` (the signature's bytes as 64-bit little-endian words, zero
  padded) and ``signature_nbytes``.  vLLM's IPC carries them as they are, and its scheduler
  keeps items with an ``address`` key when it strips prefix-covered payloads.
* **Workers attach in their constructor.**  P0's sender publishes its ``ReaderHandle``
  (segment name, layout and signing secret) in the environment variable
  ``MMCACHE_VLLM_READER_HANDLE``, which the engine core and the workers inherit: vLLM builds
  P0's cache before it starts them.  A process's environment is readable by its own user
  only (``/proc/PID/environ`` is 0400), the same boundary the segment already has (mode
  0600): whoever can read the secret there can read and write the segment anyway.  The
  secret is what keeps API clients from forging handles, and they never see it.
* **Errors.**  A miss raises vLLM's ``MultiModalCacheMissError`` listing every missing hash
  (the engine core's retry path).  A malformed, forged or foreign handle raises
  :class:`InvalidShmHandleError` (a ``ValueError``, as vLLM's own receiver raises); a
  genuine handle whose object the ring no longer holds raises :class:`StaleShmHandleError`,
  both a ``MultiModalCacheMissError`` and a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import cachetools
import torch
from vllm.config import ModelConfig, VllmConfig
from vllm.multimodal import cache as vllm_cache
from vllm.multimodal.cache import factories as vllm_factories
from vllm.multimodal.cache.base import (
    MultiModalCache,
    MultiModalCacheMissError,
    MultiModalProcessorOnlyCache,
)
from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache
from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache, ShmObjectStoreSenderCache
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)
from vllm.utils.cache import CacheInfo as VllmCacheInfo
from vllm.utils.platform_utils import is_pin_memory_available

from mmcache._core import ReaderHandle
from mmcache.caches import (
    BaseSenderCache,
    ProcessorOnlyCache,
    ReceiverCache,
    SenderCache,
)
from mmcache.errors import CacheMissError, InvalidHandleError
from mmcache.items import Feature, ShmHandle, item_size
from mmcache.shm import ShmReceiverCache, ShmSenderCache

__all__ = [
    "ENABLE_ENV",
    "READER_HANDLE_ENV",
    "InvalidShmHandleError",
    "MmcacheLruReceiverCache",
    "MmcacheLruSenderCache",
    "MmcacheProcessorOnlyCache",
    "MmcacheShmReceiverCache",
    "MmcacheShmSenderCache",
    "StaleShmHandleError",
    "handle_as_item",
    "handle_from_item",
    "install",
    "item_from_mmcache",
    "item_to_mmcache",
    "register",
    "vllm_item_size",
]

logger = logging.getLogger("mmcache.vllm")

ENABLE_ENV = "MMCACHE_VLLM"
"""``MMCACHE_VLLM=1`` makes :func:`register` (vLLM's plugin hook) call :func:`install`."""

READER_HANDLE_ENV = "MMCACHE_VLLM_READER_HANDLE"
"""Where P0's shared-memory sender publishes its ``ReaderHandle`` for the workers (JSON;
empty when P0 runs without a ring)."""

GiB = 1 << 30

REPLAY_SHARE = 4
"""A worker keeps the objects it read most recently alive in the ring, up to 1/REPLAY_SHARE
of its capacity, so that a replayed handle (a preempted request vLLM resends) still reads."""

_WORD = struct.Struct("<Q")
_U64_END = 1 << 64


# -- errors -----------------------------------------------------------------------------------


class InvalidShmHandleError(InvalidHandleError, ValueError):
    """A handle item that is malformed, forged, out of range or signed for another key.

    A ``ValueError`` (what vLLM's own shared-memory caches raise for bad handles) and an
    mmcache :class:`~mmcache.errors.InvalidHandleError`.  Its message names the "SHM handle
    signature" as vLLM's does.
    """


class StaleShmHandleError(MultiModalCacheMissError, ValueError):  # type: ignore[misc]
    """Genuine handles whose objects the ring no longer holds (evicted, overwritten or
    cleared before the reader got to them): a miss, never another item's data.

    A ``MultiModalCacheMissError`` listing every such hash of the request, and a
    ``ValueError`` whose message says the data "has been modified or is invalid", as vLLM's
    own receiver reports it.
    """

    def __init__(self, mm_hashes: list[str]) -> None:
        super().__init__(mm_hashes)
        self.args = (
            f"the shared-memory objects of {mm_hashes} are gone: each has been modified or is "
            "invalid (evicted, overwritten or cleared after its handle was issued); retry the "
            "request with its multi-modal data attached",
        )


def _invalid_handle(mm_hash: str, detail: str) -> InvalidShmHandleError:
    return InvalidShmHandleError(
        f"invalid SHM handle signature for mm_hash={mm_hash!r}: {detail}; only handles this "
        "cache issued for this key are accepted"
    )


@contextmanager
def _vllm_errors(miss_error: type[Exception] = MultiModalCacheMissError) -> Iterator[None]:
    """Raise mmcache's misses (as ``miss_error(mm_hashes)``) and bad handles as the
    exceptions vLLM's callers expect."""
    try:
        yield
    except CacheMissError as miss:
        raise miss_error(miss.mm_hashes) from miss
    except InvalidShmHandleError:
        raise
    except InvalidHandleError as exc:
        raise InvalidShmHandleError(f"invalid SHM handle signature: {exc}") from exc


# -- items and handles ------------------------------------------------------------------------

_FIELD_CLASSES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (MultiModalBatchedField, MultiModalFlatField, MultiModalSharedField)
}


def _batched(data: Any) -> Any:
    return MultiModalFieldElem(data=data, field=MultiModalBatchedField())


def handle_as_item(handle: ShmHandle) -> Any:
    """The ``MultiModalKwargsItem`` that carries ``handle`` through vLLM (ints only)."""
    signature = handle.signature
    padded = signature + bytes(-len(signature) % _WORD.size)
    return MultiModalKwargsItem(
        {
            "address": _batched(handle.address),
            "monotonic_id": _batched(handle.monotonic_id),
            "signature": _batched([word for (word,) in _WORD.iter_unpack(padded)]),
            "signature_nbytes": _batched(len(signature)),
        }
    )


def _u64(item: Mapping[str, Any], key: str) -> int:
    value = item[key].data
    if type(value) is not int or not 0 <= value < _U64_END:
        raise ValueError(f"{key} must be an int in [0, 2**64), not {value!r}")
    return value


def handle_from_item(item: Mapping[str, Any], mm_hash: str) -> ShmHandle | None:
    """The :class:`ShmHandle` an item carries, ``None`` for an item without ``address`` (plain
    data), or :class:`InvalidShmHandleError` when its fields do not make a handle."""
    if "address" not in item:
        return None
    try:
        words = item["signature"].data
        if not isinstance(words, list) or not all(
            type(w) is int and 0 <= w < _U64_END for w in words
        ):
            raise ValueError("signature must be a list of ints in [0, 2**64)")
        n_bytes = _u64(item, "signature_nbytes")
        if not len(words) * _WORD.size - _WORD.size < n_bytes <= len(words) * _WORD.size:
            raise ValueError(f"{n_bytes} signature bytes do not fill {len(words)} words")
        signature = b"".join(_WORD.pack(w) for w in words)[:n_bytes]
        return ShmHandle(
            address=_u64(item, "address"),
            monotonic_id=_u64(item, "monotonic_id"),
            signature=signature,
        )
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise _invalid_handle(mm_hash, f"not a handle item ({exc})") from None


def _slices_out(value: Any) -> Any:
    """Field attributes as mmcache values: a ``slice`` becomes ``{"slice": [start, stop,
    step]}``; lists and tuples keep their type."""
    if isinstance(value, slice):
        return {"slice": [value.start, value.stop, value.step]}
    if isinstance(value, list | tuple):
        return type(value)(_slices_out(v) for v in value)
    return value


def _slices_in(value: Any) -> Any:
    if isinstance(value, dict):
        return slice(*value["slice"])
    if isinstance(value, list | tuple):
        return type(value)(_slices_in(v) for v in value)
    return value


def item_to_mmcache(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``MultiModalKwargsItem`` as an mmcache item: for every key its element's data
    (tensors, lists, numbers) and its field (class name and attributes).  ``TypeError`` for
    a field class vLLM 0.33 does not define."""
    out: dict[str, Any] = {}
    for key, elem in item.items():
        field = elem.field
        name = type(field).__name__
        if _FIELD_CLASSES.get(name) is not type(field):
            raise TypeError(f"field {key!r}: unsupported field type {type(field).__qualname__}")
        attrs = {f.name: _slices_out(getattr(field, f.name)) for f in dataclasses.fields(field)}
        out[key] = {"data": elem.data, "field": name, "attrs": attrs}
    return out


def _owned(data: Any, pin_memory: bool) -> Any:
    """``data`` with every tensor copied into memory of its own (pinned if asked)."""
    if isinstance(data, torch.Tensor):
        return torch.empty(data.shape, dtype=data.dtype, pin_memory=pin_memory).copy_(data)
    if isinstance(data, list | tuple):
        return type(data)(_owned(v, pin_memory) for v in data)
    return data


def item_from_mmcache(item: Mapping[str, Any], *, pin_memory: bool = False) -> Any:
    """The ``MultiModalKwargsItem`` :func:`item_to_mmcache` was given, its tensors copied
    into memory of their own (so ``item`` may hold zero-copy views of shared memory); with
    ``pin_memory``, pinned memory, as vLLM's IPC decoder does where pinning is available."""
    elems = {}
    for key, spec in item.items():
        field = _FIELD_CLASSES[spec["field"]](
            **{name: _slices_in(v) for name, v in spec["attrs"].items()}
        )
        elems[key] = MultiModalFieldElem(data=_owned(spec["data"], pin_memory), field=field)
    return MultiModalKwargsItem(elems)


def vllm_item_size(item: Any) -> int:
    """vLLM's size of an item (what its LRU caches count), as an mmcache ``getsizeof``."""
    return int(MultiModalCache.get_item_size(item))


# -- publishing the ring to the workers -------------------------------------------------------


def _publish(handle: ReaderHandle | None) -> str:
    """Put ``handle`` (``None``: no ring) where child processes find it; returns the value."""
    value = ""
    if handle is not None:
        value = json.dumps(
            {
                "name": handle.name,
                "capacity": handle.capacity,
                "n_readers": handle.n_readers,
                "max_object_size": handle.max_object_size,
                "layout_version": handle.layout_version,
                "secret": handle.secret.hex(),
            }
        )
    os.environ[READER_HANDLE_ENV] = value
    return value


def _published_handle() -> ReaderHandle | None:
    """The ``ReaderHandle`` P0 published, ``None`` when it runs without a ring;
    ``RuntimeError`` when nothing was published."""
    value = os.environ.get(READER_HANDLE_ENV)
    if value is None:
        raise RuntimeError(
            f"no shared-memory ring was published ({READER_HANDLE_ENV} is not set): the "
            "frontend must run vLLM with mmcache too (MMCACHE_VLLM=1) and build its cache "
            "before it starts the engine"
        )
    if not value:
        return None
    fields = json.loads(value)
    fields["secret"] = bytes.fromhex(fields["secret"])
    return ReaderHandle(**fields)


# -- P0 ---------------------------------------------------------------------------------------


class _SenderAdapter:
    """vLLM's P0 cache interface over an mmcache sender (``self._sender``), with vLLM's
    request bracket mapped onto ``begin_request`` / ``end_request`` (see the module)."""

    _sender: BaseSenderCache

    def _adopt(self, sender: BaseSenderCache) -> None:
        self._sender = sender
        self._touches = 0
        self._updates = 0
        self._issued: list[Any] = []

    def _to_mmcache(self, mm_item: Any) -> Any:
        """vLLM's input item as the sender takes it."""
        return mm_item

    def _to_vllm(self, data: Any, mm_item: Any) -> Any:
        """What the sender returned for ``mm_item``, as vLLM expects it."""
        return data

    def _abandon(self, issued: list[Any]) -> None:
        """A request failed part-way: give back what its outputs hold."""

    def is_cached_item(self, mm_hash: str) -> bool:
        return self._sender.is_cached_item(mm_hash)

    def is_cached(self, mm_hashes: list[str]) -> list[bool]:
        return self._sender.is_cached(mm_hashes)

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Protect ``mm_hash`` until the request ends; the first touch of a request (a touch
        after the open request's updates) begins it."""
        if self._updates or not self._sender.in_request:
            self._end_request()
            self._sender.begin_request()
        self._touches += 1
        self._sender.touch_sender_cache_item(mm_hash)

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        with _vllm_errors():
            data, prompt_updates = self._sender.get_and_update_item(
                self._to_mmcache(mm_item), mm_hash
            )
        if self._sender.in_request:
            self._updates += 1
            self._issued.append(data)
        return self._to_vllm(data, mm_item), prompt_updates

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: list[str]) -> list[Any]:
        """One request: every item is updated or none (a miss lists every missing hash)."""
        with _vllm_errors():
            outputs = self._sender.get_and_update(
                [self._to_mmcache(item) for item in mm_items], mm_hashes
            )
        if self._sender.in_request:
            self._updates += len(outputs)
            self._issued += [data for data, _ in outputs]
        return [
            (self._to_vllm(data, item), updates)
            for (data, updates), item in zip(outputs, mm_items)
        ]

    def release_sender_touches(self) -> None:
        """End the request vLLM assembled (vLLM calls this whether or not it succeeded)."""
        self._end_request()

    def _end_request(self) -> None:
        if self._sender.in_request:
            if self._updates < self._touches:
                self._abandon(self._issued)
            self._sender.end_request()
        self._touches = self._updates = 0
        self._issued = []

    def invalidate(self, mm_hash: str) -> None:
        self._sender.invalidate(mm_hash)

    def clear_cache(self) -> None:
        self._sender.clear_cache()

    def make_stats(self, *, delta: bool = False) -> Any:
        return VllmCacheInfo(*self._sender.make_stats(delta=delta))

    def close(self) -> None:
        self._sender.close()


class _KeysView:
    """What vLLM's LRU caches expose as ``_cache`` and its tests inspect: membership and
    ``order`` (keys, least recently used first).  Read-only."""

    def __init__(self, keys: Callable[[], list[Any]]) -> None:
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    @property
    def order(self) -> dict[Any, None]:
        return dict.fromkeys(self._keys())


def _capacity_gb(model_config: Any) -> float:
    return float(model_config.get_multimodal_config().mm_processor_cache_gb)


class MmcacheProcessorOnlyCache(_SenderAdapter, MultiModalProcessorOnlyCache):  # type: ignore[misc]
    """vLLM's P0 cache when nothing is cached downstream, on :class:`ProcessorOnlyCache`."""

    def __init__(self, model_config: ModelConfig) -> None:
        # Not vLLM's constructor: it would build the store this class replaces.
        sender = ProcessorOnlyCache(_capacity_gb(model_config), getsizeof=vllm_item_size)
        self._adopt(sender)
        self._cache = _KeysView(sender.keys)


class MmcacheLruSenderCache(_SenderAdapter, LruKeyReplicatedSenderCache):  # type: ignore[misc]
    """vLLM's P0 cache in ``lru`` mode, on :class:`SenderCache` (P1's mirror)."""

    def __init__(self, model_config: ModelConfig) -> None:
        sender = SenderCache(_capacity_gb(model_config), getsizeof=vllm_item_size)
        self._adopt(sender)
        self._cache = _KeysView(sender.keys)


class MmcacheLruReceiverCache(LruKeyReplicatedReceiverCache):  # type: ignore[misc]
    """vLLM's P1 cache in ``lru`` mode, on :class:`ReceiverCache`: a miss raises
    ``MultiModalCacheMissError`` listing every hash of the request it does not hold."""

    def __init__(self, model_config: ModelConfig) -> None:
        self._receiver = ReceiverCache(_capacity_gb(model_config), getsizeof=vllm_item_size)
        self._cache = _KeysView(self._receiver.keys)

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        with _vllm_errors():
            self._receiver.get_and_update_features(mm_features)
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        with _vllm_errors():
            return self._receiver.get_and_update_item(mm_item, mm_hash)

    def get_and_update(self, mm_items: Sequence[Any], mm_hashes: list[str]) -> list[Any]:
        with _vllm_errors():
            return self._receiver.get_and_update(mm_items, mm_hashes)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        self._receiver.touch_receiver_cache_item(mm_hash, mm_item)

    def clear_cache(self) -> None:
        self._receiver.clear_cache()


class MmcacheShmSenderCache(_SenderAdapter, ShmObjectStoreSenderCache):  # type: ignore[misc]
    """vLLM's P0 cache in ``shm`` mode, on :class:`ShmSenderCache`: the writer of a ring of
    ``mm_processor_cache_gb`` with one reader slot per worker (``world_size``).

    Builds the ring and publishes its ``ReaderHandle`` to the processes P0 starts later (see
    the module).  When ``/dev/shm`` cannot hold the ring it logs one warning and runs as a
    :class:`ProcessorOnlyCache` instead (items then always travel with their data and the
    workers pass them through): a small container never stops the frontend.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        mm_config = vllm_config.model_config.get_multimodal_config()
        self.world_size = vllm_config.parallel_config.world_size
        capacity_gb = float(mm_config.mm_processor_cache_gb)
        try:
            ring: ShmSenderCache | None = ShmSenderCache(
                capacity_gb,
                max_object_size_mb=mm_config.mm_shm_cache_max_object_size_mb,
                n_readers=self.world_size,
            )
        except MemoryError as exc:
            logger.warning(
                "mmcache: no shared-memory ring of %.4g GiB (%s); serving multi-modal items "
                "through IPC with a processor-only cache instead. Give /dev/shm more room "
                "(e.g. docker run --shm-size) or lower --mm-processor-cache-gb to use the "
                "shared-memory cache.",
                capacity_gb,
                exc,
            )
            ring = None
        self._ring = ring
        self._adopt(ring or ProcessorOnlyCache(capacity_gb, getsizeof=vllm_item_size))
        self._shm_cache = self._sender
        self._published = _publish(None if ring is None else ring.handle())

    @property
    def ring(self) -> ShmSenderCache | None:
        """The shared-memory sender, or ``None`` when running without a ring."""
        return self._ring

    def _to_mmcache(self, mm_item: Any) -> Any:
        if self._ring is None or mm_item is None:
            return mm_item
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

    def _abandon(self, issued: list[Any]) -> None:
        if self._ring is not None:
            self._ring.release_handles(issued)

    def validate_input_item(self, mm_item: Any, mm_hash: str) -> None:
        """``InvalidShmHandleError`` unless ``mm_item`` is plain data or the handle this cache
        holds for ``mm_hash`` now (no hit counted, no reference, no recency change)."""
        handle = handle_from_item(mm_item, mm_hash)
        if handle is None:
            return
        if self._ring is None or not self._ring.verify(handle, mm_hash):
            raise _invalid_handle(mm_hash, "not the current entry of this key")

    def clear_cache(self) -> None:
        """Forget every item and reset the statistics.  Requests in flight keep their
        references: their handles still read their own data (a reader never gets another
        item's), and each object is reclaimed once it has been read."""
        if self._ring is None:
            self._sender.clear_cache()
        else:
            self._ring.clear_cache(keep_in_flight=True)

    def close(self) -> None:
        """Close the ring (unlinking the segment) and withdraw what was published."""
        if os.environ.get(READER_HANDLE_ENV) == self._published:
            del os.environ[READER_HANDLE_ENV]
        self._sender.close()


class _Rejected:
    """A feature's data that is not a valid handle item: raises when resolved, so the rest
    of the request is still resolved (and gives back its references) first."""

    def __init__(self, error: InvalidShmHandleError) -> None:
        self.error = error


class _VllmShmReader(ShmReceiverCache):
    """A ring reader that returns vLLM items and keeps replayed handles readable.

    vLLM's scheduler resends a preempted request with the same handles.  Reading a handle
    gives its reference back, after which the ring may reclaim the object.  So the reader
    reads zero-copy views, hands vLLM a copy (pinned where vLLM pins), and keeps the views of
    the objects it read most recently, up to ``lease_bytes``: while a view lives, its object
    stays in the ring, and a replay reads it again, verified, from P0's own bytes.  A replay
    of an object no longer kept is a miss, never another item's data.
    """

    def __init__(self, handle: ReaderHandle, *, pin_memory: bool, lease_bytes: int) -> None:
        super().__init__(handle, copy=False)
        self._pin_memory = pin_memory
        self._leases: cachetools.LRUCache[tuple[str, ShmHandle], Any] = cachetools.LRUCache(
            lease_bytes, getsizeof=item_size
        )

    def get_and_update_item(self, item: Any, mm_hash: str) -> Any:
        if isinstance(item, _Rejected):
            raise item.error
        views: Any = super().get_and_update_item(item, mm_hash)
        if not isinstance(item, ShmHandle):
            return views  # a plain vLLM item, passed through
        if item_size(views) <= self._leases.maxsize:
            self._leases[(mm_hash, item)] = views
        return item_from_mmcache(views, pin_memory=self._pin_memory)

    def clear_cache(self) -> None:
        """Let the objects kept for replays go."""
        self._leases.clear()


class MmcacheShmReceiverCache(ShmObjectStoreReceiverCache):  # type: ignore[misc]
    """vLLM's worker cache in ``shm`` mode, on :class:`ShmReceiverCache`: one reader slot of
    the ring P0 published, attached here, before P0 can write.

    Plain items pass through; stripped features (``data=None``) are skipped; handle items
    become the items P0 wrote, their tensors pinned where vLLM pins.  ``shared_worker_lock``
    is accepted and not needed: mmcache shares no lock between processes.
    """

    def __init__(self, vllm_config: VllmConfig, shared_worker_lock: Any = None) -> None:
        self.world_size = vllm_config.parallel_config.world_size
        handle = _published_handle()
        self._reader: _VllmShmReader | None = None
        if handle is not None:
            self._reader = _VllmShmReader(
                handle,
                pin_memory=is_pin_memory_available(),
                lease_bytes=handle.capacity // REPLAY_SHARE,
            )
        self._shm_cache = self._reader

    def _incoming(self, data: Any, mm_hash: str) -> Any:
        """A feature's data as the reader takes it: handle items become handles."""
        try:
            handle = handle_from_item(data, mm_hash)
        except InvalidShmHandleError as exc:
            return _Rejected(exc)
        if handle is not None and self._reader is None:
            return _Rejected(_invalid_handle(mm_hash, "this process has no ring to read"))
        return data if handle is None else handle

    def get_and_update_features(self, mm_features: list[Any]) -> list[Any]:
        """Resolve every feature that carries data, in place (``None``: a payload the
        scheduler stripped, nothing to read)."""
        with_data = [f for f in mm_features if f.data is not None]
        resolving = [
            Feature(
                data=self._incoming(f.data, f.mm_hash or f.identifier),
                mm_hash=f.mm_hash,
                identifier=f.identifier,
            )
            for f in with_data
        ]
        with _vllm_errors(StaleShmHandleError):
            if self._reader is None:
                for feature in resolving:
                    if isinstance(feature.data, _Rejected):
                        raise feature.data.error
            else:
                self._reader.get_and_update_features(resolving)
        for feature, resolved in zip(with_data, resolving):
            feature.data = resolved.data
        return mm_features

    def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
        if mm_item is None:
            return None
        incoming = self._incoming(mm_item, mm_hash)
        if isinstance(incoming, _Rejected):
            raise incoming.error
        if self._reader is None:
            return incoming
        with _vllm_errors(StaleShmHandleError):
            return self._reader.get_and_update_item(incoming, mm_hash)

    def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
        """Nothing to do: P0 took the references, reading gives them back."""

    def clear_cache(self) -> None:
        """Let the objects kept for replays go (a reader does not own the ring)."""
        if self._reader is not None:
            self._reader.clear_cache()


# -- installing -------------------------------------------------------------------------------

REPLACEMENTS: dict[str, type[Any]] = {
    "MultiModalProcessorOnlyCache": MmcacheProcessorOnlyCache,
    "LruKeyReplicatedSenderCache": MmcacheLruSenderCache,
    "LruKeyReplicatedReceiverCache": MmcacheLruReceiverCache,
    "ShmObjectStoreSenderCache": MmcacheShmSenderCache,
    "ShmObjectStoreReceiverCache": MmcacheShmReceiverCache,
}
"""vLLM's cache class names and the classes :func:`install` binds to them."""


def install() -> None:
    """Make vLLM's cache factories build mmcache caches in this process (idempotent).

    Rebinds the five class names in ``vllm.multimodal.cache.factories`` (which looks them up
    when a factory is called) and in ``vllm.multimodal.cache`` (for code that imports them
    from there afterwards).  vLLM's own classes stay importable from their modules.
    """
    for module in (vllm_factories, vllm_cache):
        for name, cls in REPLACEMENTS.items():
            setattr(module, name, cls)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: :func:`install` when ``MMCACHE_VLLM=1``, so
    installing the extra never changes vLLM by itself."""
    if os.environ.get(ENABLE_ENV) == "1":
        install()
