"""Build the caches of one cache mode."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeAlias

from mmcache._core import ReaderHandle
from mmcache.arguments import capacity_bytes, check_max_object_size_mb, check_n_readers
from mmcache.caches import BaseSenderCache, ProcessorOnlyCache, ReceiverCache, SenderCache
from mmcache.items import Item, item_size
from mmcache.prompt_updates import PromptUpdatesCodecSpec
from mmcache.shm import ShmSenderCache

if TYPE_CHECKING:
    from mmcache.remote import RemoteStore

__all__ = ["MODES", "Mode", "make_caches"]

Mode: TypeAlias = Literal["none", "processor_only", "lru", "shm"]
MODES: tuple[Mode, ...] = ("none", "processor_only", "lru", "shm")

# The modes each option of `make_caches` applies to.  SPEC's two, `n_readers` and
# `max_object_size_mb`, suit every mode (engine code passes them whatever the mode it runs).
_APPLIES_TO: dict[str, tuple[Mode, ...]] = {
    "name": ("shm",),
    "max_writers": ("shm",),
    "prompt_updates_codec": ("shm",),
    "getsizeof": ("processor_only", "lru"),
}


def make_caches(
    mode: Mode,
    *,
    capacity_gb: float,
    n_readers: int = 1,
    max_object_size_mb: float = 128,
    getsizeof: Callable[[Item], int] = item_size,
    remote: RemoteStore | None = None,
    name: str | None = None,
    max_writers: int = 1,
    prompt_updates_codec: PromptUpdatesCodecSpec = "plain",
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

    ``n_readers`` (the number of workers), ``max_object_size_mb``, ``name`` (the ring's
    segment name; default: a fresh one), ``max_writers`` (how many P0 caches may share the
    ring: the others join it with ``ShmSenderCache.join(p0_cache.writer_handle())``) and
    ``prompt_updates_codec`` (how prompt updates travel between them: see
    :class:`~mmcache.shm.ShmSenderCache`) apply to ``shm`` only;
    ``getsizeof`` (the size an item counts for) to ``processor_only`` and ``lru`` (the ring
    counts bytes).  With ``remote`` (a :class:`~mmcache.remote.RemoteStore`), ``p0_cache`` is
    that mode's P0 cache behind the shared remote tier (a
    :class:`~mmcache.remote.TieredSenderCache`; it closes the store with itself); mode
    ``none`` has no P0 cache to put it in (``ValueError``).  ``ValueError`` for an unknown
    mode, and for an option given a value other than its default in a mode it does not
    apply to (``make_caches("lru", ..., max_writers=2)`` shares nothing: an lru pair has no
    ring); ``n_readers`` and ``max_object_size_mb`` (the factory's first options) suit
    every mode (engine code passes them whatever the mode it runs), and are checked in every
    mode, as is ``capacity_gb``: ``TypeError`` for one that is no number (``n_readers``: no
    int), ``ValueError`` for one out of range (``n_readers`` below 1, ``max_object_size_mb``
    not positive), each naming its argument.

    Safe to call from several threads, and every cache it returns may be shared by threads
    (see "Threads" in :mod:`mmcache.caches`; the
    :class:`~mmcache.remote.TieredSenderCache` of ``remote`` too: see its module).
    """
    if mode not in MODES:
        raise ValueError(f"unknown cache mode {mode!r}; expected one of {', '.join(MODES)}")
    # Refused rather than ignored: the caller expects what the option does (frontends
    # sharing a ring, a size function), and the mode would silently not do it.
    options = {
        "name": name,
        "max_writers": max_writers,
        "prompt_updates_codec": prompt_updates_codec,
        "getsizeof": getsizeof,
    }
    for option, value in options.items():
        modes = _APPLIES_TO[option]
        default = _DEFAULTS[option]
        if mode not in modes and value is not default and value != default:
            raise ValueError(
                f"{option}={value!r} applies to mode {' and '.join(modes)} only, not {mode}"
            )
    if mode != "shm":
        # SPEC's options suit every mode (engine code passes them whatever the mode it runs),
        # so a bad value is refused in every mode, not first when the engine switches to shm
        # (whose ring checks them itself); mode none builds nothing that would check any.
        capacity_bytes(capacity_gb)
        check_n_readers(n_readers)
        check_max_object_size_mb(max_object_size_mb)
    if remote is not None and mode == "none":
        raise ValueError("a remote tier needs a P0 cache: use mode processor_only, lru or shm")
    sender: BaseSenderCache | None
    downstream: ReceiverCache | ReaderHandle | None = None
    if mode == "none":
        sender = None
    elif mode == "processor_only":
        sender = ProcessorOnlyCache(capacity_gb, getsizeof=getsizeof)
    elif mode == "lru":
        sender = SenderCache(capacity_gb, getsizeof=getsizeof)
        downstream = ReceiverCache(capacity_gb, getsizeof=getsizeof)
    else:
        shm = ShmSenderCache(
            capacity_gb,
            max_object_size_mb=max_object_size_mb,
            n_readers=n_readers,
            name=name,
            max_writers=max_writers,
            prompt_updates_codec=prompt_updates_codec,
        )
        sender, downstream = shm, shm.handle()
    if remote is not None and sender is not None:
        from mmcache.remote import TieredSenderCache

        try:
            sender = TieredSenderCache(sender, remote)
        except BaseException:  # a bad remote: the cache made for it is never returned
            sender.close()
            raise
    return sender, downstream


# An option at its default was not asked for, whatever the mode.
_DEFAULTS = {name: p.default for name, p in inspect.signature(make_caches).parameters.items()}
