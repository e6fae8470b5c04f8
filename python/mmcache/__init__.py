"""Mirrored multimodal caches and a lock-free shared-memory object store for LLM serving.

P0 (the frontend) uses a sender cache, P1 (the engine core) and the workers a receiver
cache; :func:`make_caches` builds the pair of one cache mode.  Importing this package does
not import torch.
"""

from mmcache._core import ReaderHandle, ShmHandle, WriterHandle, __version__
from mmcache.caches import ProcessorOnlyCache, ReceiverCache, SenderCache
from mmcache.errors import (
    CacheMissError,
    ClosedError,
    InvalidHandleError,
    ItemNotEncodableError,
    KeyExistsError,
    MmcacheError,
    NoReaderSlotError,
    NoWriterSlotError,
    ObjectTooLargeError,
    ReferencesSaturatedError,
    RingFullError,
    SegmentCorruptError,
    ShmTooSmallError,
    StaleHandleError,
    WriterGoneError,
    WrongProcessError,
)
from mmcache.factory import make_caches
from mmcache.items import Feature, Item, content_hash, item_size
from mmcache.lru import CacheInfo, LRUCache
from mmcache.maintenance import inspect, prune
from mmcache.shm import ShmReceiverCache, ShmSenderCache

__all__ = [
    "CacheInfo",
    "CacheMissError",
    "ClosedError",
    "Feature",
    "InvalidHandleError",
    "Item",
    "ItemNotEncodableError",
    "KeyExistsError",
    "LRUCache",
    "MmcacheError",
    "NoReaderSlotError",
    "NoWriterSlotError",
    "ObjectTooLargeError",
    "ProcessorOnlyCache",
    "ReaderHandle",
    "ReceiverCache",
    "ReferencesSaturatedError",
    "RingFullError",
    "SegmentCorruptError",
    "SenderCache",
    "ShmHandle",
    "ShmReceiverCache",
    "ShmSenderCache",
    "ShmTooSmallError",
    "StaleHandleError",
    "WriterGoneError",
    "WriterHandle",
    "WrongProcessError",
    "__version__",
    "content_hash",
    "inspect",
    "item_size",
    "make_caches",
    "prune",
]
