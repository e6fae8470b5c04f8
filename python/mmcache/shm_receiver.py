"""A worker's cache in ``shm`` mode: :class:`ShmReceiverCache`, one reader of the ring P0's
:class:`~mmcache.shm.ShmSenderCache` writes (see :mod:`mmcache.shm` for the protocol), which
turns handles back into items."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from mmcache import pinning
from mmcache._core import ReaderHandle, ShmObjectStore, ShmReader, StaleHandleError
from mmcache.arguments import check_mm_hash, check_mm_hash_type, flag, receiver_type_error
from mmcache.caches import BaseReceiverCache
from mmcache.errors import CacheMissError
from mmcache.items import Item, ShmHandle

__all__ = ["ShmReceiverCache"]


class ShmReceiverCache(BaseReceiverCache):
    """A worker's cache in ``shm`` mode: one reader of the ring P0 writes.

    Resolves an :class:`ShmHandle` to the item it stands for (a handle whose object is gone
    is a :class:`CacheMissError`; a forged or mismatched one raises
    :class:`~mmcache.errors.InvalidHandleError`), returns a plain item as is and skips
    ``None``.  Each instance claims its own reader slot (``NoReaderSlotError`` when all are
    taken) until :meth:`close`.

    With ``copy=False`` tensors and arrays are read-only zero-copy views of shared memory;
    each keeps its object from being reclaimed until the last view of it is gone. With
    ``copy=True`` (the default) each tensor and array is copied once, straight out of the
    ring, into memory of its own (one allocation per item for its tensors).

    ``pin_memory=True`` makes resolved tensors pinned host memory, so ``.to("cuda",
    non_blocking=True)`` is a DMA: with ``copy=False`` the reader's read-only mapping of the
    ring is registered with CUDA once, here (and unregistered by :meth:`close`), so the
    zero-copy views are pinned with no copy at all; with ``copy=True`` the copies go to
    torch's pinned allocator. Without a CUDA device, or if CUDA refuses, it warns once and
    resolves unpinned.
    """

    def __init__(
        self, handle: ReaderHandle, *, copy: bool = True, pin_memory: bool = False
    ) -> None:
        # Checked before a reader slot is taken: the core takes only a bool at every
        # resolve, and a truthy string would silently mean copies.
        copy, pin_memory = flag("copy", copy), flag("pin_memory", pin_memory)
        if not isinstance(handle, ReaderHandle):  # the sender itself, say
            raise TypeError(
                "ShmReceiverCache takes a ReaderHandle (from the P0 cache's handle(), or "
                f"make_caches' downstream), not {type(handle).__qualname__}"
            )
        super().__init__()
        # Nothing in Python to guard (a request's state is per thread; the core reader is
        # thread-safe): no lock, so worker threads resolve and copy in parallel.
        self._lock = contextlib.nullcontext()
        self._store: ShmReader = ShmObjectStore.attach(handle)
        self._copy = copy
        self._pin_copies = False
        self._unregister: weakref.finalize[[], ShmReceiverCache] | None = None
        if pin_memory:
            self._pin()
        self._plain_copies = copy and not self._pin_copies

    def _pin(self) -> None:
        problem = pinning.pinning_unavailable()
        if problem is None and self._copy:
            self._pin_copies = True
            return
        if problem is None:
            address, length = self._store.view_mapping()
            try:
                unregister = pinning.register_read_only(address, length)
            except RuntimeError as exc:
                problem = str(exc)
            else:
                # Also when the cache is dropped without close(): before the mapping goes.
                self._unregister = weakref.finalize(self, unregister)
                return
        warnings.warn(
            f"ShmReceiverCache(pin_memory=True): {problem}; resolving into unpinned memory",
            RuntimeWarning,
            stacklevel=3,
        )

    @property
    def pinned(self) -> bool:
        """Whether resolved tensors are pinned (``pin_memory=True`` took effect)."""
        return self._pin_copies or (self._unregister is not None and self._unregister.alive)

    def get_and_update_item(self, item: Item | ShmHandle | None, mm_hash: str) -> Item | None:
        # Handles first: an isinstance check against the Mapping ABC costs more than the
        # rest of the call's Python together.
        if type(item) is not ShmHandle:
            # Checked although unused here: the other receivers and the senders refuse it.
            check_mm_hash(mm_hash, "get_and_update_item(item, mm_hash)")
            if item is None or isinstance(item, Mapping):
                return item
            raise receiver_type_error(
                "ShmReceiverCache",
                "an item (a mapping of field names), a handle or None",
                item,
                mm_hash,
            )
        try:
            if self._plain_copies:
                # The core's defaults, passed as none: PyO3 parses keywords at ~0.25 µs a
                # call, 5 % of a 4 KiB item's resolve.
                return self._store.resolve_item(item, mm_hash)
            return self._store.resolve_item(
                item, mm_hash, copy=self._copy, pin_memory=self._pin_copies
            )
        except StaleHandleError:
            raise CacheMissError([mm_hash]) from None
        except TypeError:  # the core's, for a key that is not a str (nothing was read)
            check_mm_hash_type("get_and_update_item(item, mm_hash)", mm_hash)
            raise

    def touch_receiver_cache_item(self, mm_hash: str, item: Any = None) -> None:
        """Nothing to do but check ``mm_hash`` (as :class:`~mmcache.caches.ReceiverCache`
        does): references are taken by P0 and given back by reading."""
        check_mm_hash(mm_hash, "touch_receiver_cache_item(mm_hash)")

    def clear_cache(self) -> None:
        """Nothing to do: a reader does not own the ring (P0 clears it)."""

    def close(self) -> None:
        """Detach, freeing the reader slot (what it had not read is credited), and unregister
        a pinned mapping; idempotent. Zero-copy views still alive stay valid (unpinned)."""
        try:
            if self._unregister is not None:
                self._unregister()
        finally:
            # Detached even if CUDA fails to unregister: the slot would stay taken for good.
            if not self._store.closed:
                self._store.close()
