"""Build the caches of one cache mode."""

from __future__ import annotations

from typing import Literal, TypeAlias

from mmcache._core import ReaderHandle
from mmcache.caches import BaseSenderCache, ProcessorOnlyCache, ReceiverCache, SenderCache
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

    ``n_readers`` (the number of workers) and ``max_object_size_mb`` apply to ``shm`` only.
    ``ValueError`` for an unknown mode.
    """
    if mode == "none":
        return None, None
    if mode == "processor_only":
        return ProcessorOnlyCache(capacity_gb), None
    if mode == "lru":
        return SenderCache(capacity_gb), ReceiverCache(capacity_gb)
    if mode == "shm":
        sender = ShmSenderCache(
            capacity_gb, max_object_size_mb=max_object_size_mb, n_readers=n_readers
        )
        return sender, sender.handle()
    raise ValueError(f"unknown cache mode {mode!r}; expected one of {', '.join(MODES)}")
