"""Build the caches of one cache mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeAlias

from mmcache._core import ReaderHandle
from mmcache.caches import BaseSenderCache, ProcessorOnlyCache, ReceiverCache, SenderCache
from mmcache.items import Item, item_size
from mmcache.shm import ShmSenderCache

__all__ = ["MODES", "Mode", "make_caches"]

Mode: TypeAlias = Literal["none", "processor_only", "lru", "shm"]
MODES: tuple[Mode, ...] = ("none", "processor_only", "lru", "shm")


def make_caches(
    mode: Mode,
    *,
    capacity_gb: float,
    n_readers: int = 1,
    max_object_size_mb: float = 128,
    getsizeof: Callable[[Item], int] = item_size,
) -> tuple[BaseSenderCache | None, ReceiverCache | ReaderHandle | None]:
    """The P0 cache of ``mode`` and what P1/workers need, as ``(p0_cache, downstream)``:

    ================== ========================== ===============================================
    ``mode``           ``p0_cache``               ``downstream``
    ================== ========================== ===============================================
    ``none``           ``None``                   ``None``
    ``processor_only`` :class:`ProcessorOnlyCache` ``None``
    ``lru``            :class:`SenderCache`        P1's :class:`ReceiverCache` (same capacity)
    ``shm``            :class:`ShmSenderCache`     its picklable ``ReaderHandle``; each worker
                                                  calls ``ShmReceiverCache(downstream)``
    ================== ========================== ===============================================

    ``n_readers`` (the number of workers) and ``max_object_size_mb`` apply to ``shm`` only;
    ``getsizeof`` (the size an item counts for) to ``processor_only`` and ``lru`` (the ring
    counts bytes).  ``ValueError`` for an unknown mode.
    """
    if mode == "none":
        return None, None
    if mode == "processor_only":
        return ProcessorOnlyCache(capacity_gb, getsizeof=getsizeof), None
    if mode == "lru":
        return (
            SenderCache(capacity_gb, getsizeof=getsizeof),
            ReceiverCache(capacity_gb, getsizeof=getsizeof),
        )
    if mode == "shm":
        sender = ShmSenderCache(
            capacity_gb, max_object_size_mb=max_object_size_mb, n_readers=n_readers
        )
        return sender, sender.handle()
    raise ValueError(f"unknown cache mode {mode!r}; expected one of {', '.join(MODES)}")
