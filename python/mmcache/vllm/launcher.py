"""``vllm serve --api-server-count N``: the N API servers share one ring.

vLLM 0.32 and 0.33 launch several API servers the same way
(``vllm.entrypoints.cli.serve.run_multi_api_server``): the launcher process builds the engine
config (``_api_process_count = N``, ``_api_process_rank = -1``), starts the engine core
(``launch_core_engines``, through a ``CoreEngineProcManager``; the core starts the workers,
which build their caches as they start), then the N API servers (``APIServerProcessManager``,
``spawn``; each builds its renderer's processor cache), and at the end shuts the API servers
down first, then the engine core.  vLLM itself gives each API server a processor-only cache
there (``_get_cache_type`` wants one API process), since nothing could tell the workers of N
separate rings.

With mmcache, when that is the only reason (``shm`` asked for, one engine:
:func:`~mmcache.vllm.sender.shares_one_ring`), the launcher makes the ring, with one reader
slot per worker and ``N + 1`` writer slots, as it starts the engine core (before any process
that needs it exists), and publishes its reader handle for the workers and its writer handle
for the API servers (:mod:`mmcache.vllm.publish`).  Each API server joins it as a writer
(:class:`~mmcache.vllm.sender.MmcacheShmSenderCache`), and ``_get_cache_type`` answers
``shm`` in every process that inherited the writer handle
(:func:`mmcache.vllm.factories.cache_type`), so the workers read what any API server wrote.
The launcher keeps its own writer slot, which it never writes through, for the life of the
engine: the segment then outlives any one API server, and the last writer to leave unlinks it
(the launcher, as it shuts the engine core down after the API servers, or at its exit; it
first waits a moment for API servers vLLM killed to be gone).  A tree killed with SIGKILL
leaves it to ``mmcache prune`` (or the next store's creation).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.engine.utils import CoreEngineProcManager

from mmcache._core import MAX_WRITERS, MmcacheError
from mmcache.maintenance import inspect as inspect_ring
from mmcache.vllm.publish import (
    WRITER_HANDLE_ENV,
    publish,
    publish_writer,
    withdraw,
)
from mmcache.vllm.sender import make_ring, shares_one_ring

__all__ = ["open_ring", "wrap"]

logger = logging.getLogger(__name__)

_ORIGINAL = "__mmcache_original__"
_RING_CLOSER = "_mmcache_ring_closer"


def open_ring(vllm_config: VllmConfig) -> Callable[[], None]:
    """Make the ring of the API servers about to start and publish its handles (a ring of
    ``mm_processor_cache_gb`` with one reader slot per worker and a writer slot per API
    server plus the caller's); the function that closes it and withdraws them.  With more
    API servers than a ring takes, one warning, and "no ring" is published: each API server
    then runs processor-only, as vLLM does without mmcache."""
    servers = vllm_config.parallel_config._api_process_count
    ring = None
    if servers < MAX_WRITERS:
        ring = make_ring(vllm_config, max_writers=servers + 1)
    else:
        logger.warning(
            "mmcache: %d API servers cannot share one shared-memory ring (it takes at most %d "
            "writers, the launcher's included); serving multi-modal items through IPC with a "
            "processor-only cache in each API server instead. Use --api-server-count %d or "
            "fewer to share one ring.",
            servers,
            MAX_WRITERS,
            MAX_WRITERS - 1,
        )
    published = publish(None if ring is None else ring.handle())
    published_writer = publish_writer(None if ring is None else ring.writer_handle())

    def close() -> None:
        withdraw(published)
        withdraw(published_writer, WRITER_HANDLE_ENV)
        if ring is not None:
            _wait_for_the_other_writers(ring.handle().name)
            ring.close()

    return close


def _once(close: Callable[[], None]) -> Callable[[], None]:
    """``close``, run by the first call only; a call made while it runs (in another thread)
    returns once it has finished.  vLLM's engine manager calls ``shutdown`` from two threads
    at once: the launcher's main thread, and the daemon thread that watches the engine core,
    as it sees the core stop.  Were the daemon's call to close the ring while the main
    thread's returned at once, the interpreter's exit would cut the close short (daemon
    threads are stopped where they stand), leaving the launcher's writer slot claimed and
    the ring behind."""
    lock = threading.Lock()
    done = False

    def close_once() -> None:
        nonlocal done
        with lock:
            if not done:
                done = True
                close()

    return close_once


_OTHER_WRITERS_DEADLINE_S = 5.0


def _wait_for_the_other_writers(name: str) -> None:
    """Wait (at most a few seconds) until this process is the ring's only live writer, so
    that its close unlinks the ring.  vLLM shuts the API servers down before the engine core
    (with no grace period unless ``--shutdown-timeout``: SIGTERM, then SIGKILL), and a killed
    server holds its liveness lock until the kernel has torn its memory down, which can
    outlast the engine core's shutdown; a server still running after the deadline leaves
    the ring to the last writer to close, or to ``prune``."""
    deadline = time.monotonic() + _OTHER_WRITERS_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            writers = inspect_ring(name)["writers"]
        except (OSError, MmcacheError):  # gone or unreadable: closing is all that is left
            return
        if sum(1 for writer in writers if writer["alive"]) <= 1:
            return
        time.sleep(0.02)


def _start(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config = signature.bind(self, *args, **kwargs).arguments["vllm_config"]
        # Only the launcher of several API servers starts an engine core with rank -1.
        if not (
            shares_one_ring(vllm_config) and vllm_config.parallel_config._api_process_rank == -1
        ):
            original(self, *args, **kwargs)
            return
        close = _once(open_ring(vllm_config))
        try:
            original(self, *args, **kwargs)
        except BaseException:
            close()
            raise
        # Closed by shutdown() (after the API servers'), or at the latest at exit.
        setattr(self, _RING_CLOSER, close)
        weakref.finalize(self, close)

    return __init__


def _shutdown(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, *args, **kwargs)
        finally:
            if (close := getattr(self, _RING_CLOSER, None)) is not None:
                close()

    return shutdown


def wrap() -> None:
    """Wrap ``CoreEngineProcManager``'s constructor and ``shutdown`` (idempotent)."""
    for name, wrapper in (("__init__", _start), ("shutdown", _shutdown)):
        method = getattr(CoreEngineProcManager, name)
        if not hasattr(method, _ORIGINAL):
            wrapped = wrapper(method)
            setattr(wrapped, _ORIGINAL, method)
            setattr(CoreEngineProcManager, name, wrapped)
