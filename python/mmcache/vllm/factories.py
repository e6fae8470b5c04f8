"""The names vLLM's cache factories look up, rebound to mmcache's classes.

``vllm.multimodal.cache.factories`` looks the five cache classes up in its module when a
factory is called, so rebinding those names makes the frontend (P0), the engine core (P1)
and every worker build mmcache-backed caches from vLLM's own factories, with no patch to
vLLM.  vLLM's own classes stay importable from their modules.
"""

from __future__ import annotations

from typing import Any

from vllm.multimodal import cache as vllm_cache
from vllm.multimodal.cache import factories as vllm_factories

from mmcache.vllm.receiver import MmcacheLruReceiverCache, MmcacheShmReceiverCache
from mmcache.vllm.sender import (
    MmcacheLruSenderCache,
    MmcacheProcessorOnlyCache,
    MmcacheShmSenderCache,
)

__all__ = ["REPLACEMENTS", "rebind"]

REPLACEMENTS: dict[str, type[Any]] = {
    "MultiModalProcessorOnlyCache": MmcacheProcessorOnlyCache,
    "LruKeyReplicatedSenderCache": MmcacheLruSenderCache,
    "LruKeyReplicatedReceiverCache": MmcacheLruReceiverCache,
    "ShmObjectStoreSenderCache": MmcacheShmSenderCache,
    "ShmObjectStoreReceiverCache": MmcacheShmReceiverCache,
}
"""vLLM's cache class names and the classes :func:`rebind` binds to them."""


def rebind() -> None:
    """Bind :data:`REPLACEMENTS` in ``vllm.multimodal.cache.factories`` (where the factories
    look them up) and in ``vllm.multimodal.cache`` (for code that imports them from there
    afterwards).  Idempotent."""
    for module in (vllm_factories, vllm_cache):
        for name, cls in REPLACEMENTS.items():
            setattr(module, name, cls)
