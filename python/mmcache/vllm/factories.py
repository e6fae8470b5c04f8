"""The names vLLM's cache factories look up, rebound to mmcache's classes.

``vllm.multimodal.cache.factories`` looks the five cache classes up in its module when a
factory is called, so rebinding those names makes the frontend (P0), the engine core (P1)
and every worker build mmcache-backed caches from vLLM's own factories, with no patch to
vLLM.  vLLM's own classes stay importable from their modules.

The factories also look up ``_get_cache_type``, which decides the mode of every process's
cache: :func:`cache_type` answers ``shm`` where several API servers share one ring
(:mod:`mmcache.vllm.launcher`), and vLLM's answer everywhere else.

vLLM's worker factory insists, in ``shm`` mode, on the lock its own ring shares between the
workers, which vLLM's Ray executor does not give them; mmcache's ring needs none, so
the factory is wrapped (:func:`lock_optional`) to give it a lock of its own when the worker
has none (where vLLM's worker imported the factory, too).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from vllm.multimodal import cache as vllm_cache
from vllm.multimodal.cache import factories as vllm_factories
from vllm.v1.worker import worker_base as vllm_worker_base

from mmcache.vllm.publish import WRITER_HANDLE_ENV
from mmcache.vllm.receiver import MmcacheLruReceiverCache, MmcacheShmReceiverCache
from mmcache.vllm.sender import (
    MmcacheLruSenderCache,
    MmcacheProcessorOnlyCache,
    MmcacheShmSenderCache,
    shares_one_ring,
)

__all__ = ["NO_LOCK", "REPLACEMENTS", "cache_type", "lock_optional", "rebind"]

REPLACEMENTS: dict[str, type[Any]] = {
    "MultiModalProcessorOnlyCache": MmcacheProcessorOnlyCache,
    "LruKeyReplicatedSenderCache": MmcacheLruSenderCache,
    "LruKeyReplicatedReceiverCache": MmcacheLruReceiverCache,
    "ShmObjectStoreSenderCache": MmcacheShmSenderCache,
    "ShmObjectStoreReceiverCache": MmcacheShmReceiverCache,
}
"""vLLM's cache class names and the classes :func:`rebind` binds to them."""

_vllm_cache_type = vllm_factories._get_cache_type


def cache_type(vllm_config: Any) -> Any:
    """vLLM's ``_get_cache_type``, but ``shm`` for an engine whose API servers share one ring:
    in every process that inherited the launcher's writer handle (the API servers, the
    engine core, the workers), so they all agree (:mod:`mmcache.vllm.launcher`)."""
    if WRITER_HANDLE_ENV in os.environ and shares_one_ring(vllm_config):
        return "shm"
    return _vllm_cache_type(vllm_config)


NO_LOCK = threading.Lock()
"""What a worker given no ``shared_worker_lock`` passes vLLM's factory in ``shm`` mode: the
factory insists on one (for vLLM's own ring), and mmcache's ring, which it builds there
(:data:`REPLACEMENTS`), takes none."""


def lock_optional(factory: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """vLLM's worker factory ``factory`` (or whatever wraps it already), called with
    :data:`NO_LOCK` in ``shm`` mode when the executor gave the worker no lock (vLLM's Ray
    executor gives none).  A wrapper, not a replacement: another plugin's wrapper of the
    factory stays in the chain, before or after this one."""
    if getattr(factory, "_mmcache_lock_optional", False):
        return factory

    @functools.wraps(factory)
    def worker_receiver_cache_from_config(vllm_config: Any, shared_worker_lock: Any) -> Any:
        if shared_worker_lock is None and cache_type(vllm_config) == "shm":
            shared_worker_lock = NO_LOCK
        return factory(vllm_config, shared_worker_lock)

    worker_receiver_cache_from_config._mmcache_lock_optional = True  # type: ignore[attr-defined]
    return worker_receiver_cache_from_config


def rebind() -> None:
    """Bind :data:`REPLACEMENTS` in ``vllm.multimodal.cache.factories`` (where the factories
    look them up) and in ``vllm.multimodal.cache`` (for code that imports them from there
    afterwards), :func:`cache_type` as the factories' ``_get_cache_type``, and the worker
    factory wrapped by :func:`lock_optional` where vLLM's worker looks it up and where it is
    imported from.  Idempotent."""
    for module in (vllm_factories, vllm_cache):
        for name, cls in REPLACEMENTS.items():
            setattr(module, name, cls)
    vllm_factories._get_cache_type = cache_type
    for module in (vllm_factories, vllm_cache, vllm_worker_base):
        factory = module.worker_receiver_cache_from_config
        module.worker_receiver_cache_from_config = lock_optional(factory)
