"""The engine-core and worker processes of the end-to-end tests (spawned: fresh interpreters).

Each loads vLLM's general plugins, as vLLM's own engine core and workers do, so with
``MMCACHE_VLLM=1`` mmcache is installed through its entry point, and builds its cache with
vLLM's factory.  Requests arrive as vLLM's IPC encodes them (``MsgpackEncoder``) over a pipe;
each is answered with a digest of every resolved feature's data (``None`` for a feature
without data), or with the error it raised.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from mmcache import content_hash


def digest(data: Any) -> str | None:
    """A content hash of a vLLM item's data and fields (what a worker would compute on)."""
    import mmcache.vllm

    return None if data is None else content_hash(mmcache.vllm.item_to_mmcache(data))


def serve(role: str, config_kwargs: dict[str, Any], conn: Connection) -> None:
    """Build the ``role`` cache (``engine`` or ``worker``), report its class, then resolve
    every request until ``None``.  ``"clear"`` clears the cache (as vLLM's reset does)."""
    from vllm.multimodal.cache import (
        MultiModalCacheMissError,
        engine_receiver_cache_from_config,
        worker_receiver_cache_from_config,
    )
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.plugins import load_general_plugins
    from vllm.v1.serial_utils import MsgpackDecoder

    from vllm_helpers import vllm_config

    load_general_plugins()
    config = vllm_config(**config_kwargs)
    if role == "engine":
        cache = engine_receiver_cache_from_config(config)
    else:
        cache = worker_receiver_cache_from_config(config, object())
    conn.send(f"{type(cache).__module__}.{type(cache).__qualname__}")
    decoder = MsgpackDecoder(list[MultiModalFeatureSpec])
    while (message := conn.recv()) is not None:
        if message == "clear":
            cache.clear_cache()
            conn.send("cleared")
            continue
        features = decoder.decode(message)
        try:
            cache.get_and_update_features(features)
        except MultiModalCacheMissError as miss:
            conn.send(("miss", type(miss).__name__, miss.mm_hashes))
        except Exception as exc:
            conn.send(("error", type(exc).__name__, str(exc)))
        else:
            conn.send(("ok", [digest(f.data) for f in features]))
