"""Errors of the caches and of the shared-memory core.

Everything the package raises on its own account derives from :class:`MmcacheError`;
where a user already expects a builtin (``ValueError``, ``KeyError``, ``MemoryError``, ...)
that builtin is raised instead, or a subclass of it where callers must tell cases apart:
``ObjectTooLargeError`` and ``KeyExistsError`` (``ValueError`` s: an object larger than the
ring takes, a put of a key already stored), ``ItemNotEncodableError`` (a ``TypeError`` and a
``ValueError``: an item the codec cannot hold), and three ``MemoryError`` s:
``RingFullError`` (no reclaimable room in the ring), ``ReferencesSaturatedError`` (a reader
holds the most unread references to an object it can count) and ``ShmTooSmallError``
(``/dev/shm`` cannot hold the ring).
"""

from __future__ import annotations

from collections.abc import Iterable

from mmcache._core import (
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
from mmcache.arguments import check_hash_types, check_list

__all__ = [
    "CacheMissError",
    "ClosedError",
    "InvalidHandleError",
    "ItemNotEncodableError",
    "KeyExistsError",
    "MmcacheError",
    "NoReaderSlotError",
    "NoWriterSlotError",
    "ObjectTooLargeError",
    "ReferencesSaturatedError",
    "RingFullError",
    "SegmentCorruptError",
    "ShmTooSmallError",
    "StaleHandleError",
    "WriterGoneError",
    "WrongProcessError",
]


class CacheMissError(MmcacheError, RuntimeError):
    """A receiver was asked for items it does not hold (the two sides drifted apart).

    ``mm_hashes`` lists every missing hash of the request, in request order.  The sender
    should ``invalidate`` each of them; the request then succeeds when retried once with its
    data attached.
    """

    mm_hashes: list[str]

    def __init__(self, mm_hashes: Iterable[str]) -> None:
        # One str would be listed as its characters.
        check_list(mm_hashes, "CacheMissError", "mm_hashes", "CacheMissError([mm_hash])")
        self.mm_hashes = list(mm_hashes)
        # The sender invalidates each: one that is no str would raise there, far from here.
        check_hash_types(self.mm_hashes, "CacheMissError(mm_hashes)")
        super().__init__(
            f"multimodal cache miss for {self.mm_hashes}: the sender's view of the cache "
            "drifted from the receiver's; invalidate these hashes on the sender and retry "
            "the request with its data attached"
        )

    def __reduce__(self) -> tuple[type[CacheMissError], tuple[list[str]]]:
        # Rebuild from the hashes (the default would pass the message as `mm_hashes`).
        return (type(self), (self.mm_hashes,))
