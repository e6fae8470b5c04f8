"""A vLLM general plugin of the tests' own: every engine process says which caches it built.

vLLM calls :func:`register` in every process it starts (the frontend, the engine core, each
worker), as it calls mmcache's.  It wraps the factory each process builds its multimodal cache
with, so that every cache built writes one JSON record into the directory named by
``MMCACHE_ENGINE_PROBE_DIR``: the process's role and pid, and the cache's class (and, for
the frontend, the name of the ring it published).  A frontend's cache also keeps
``stats-PID.json`` there up to date (:func:`read_stats`): its lookups and hits after each
request it released, and how often it was cleared (vLLM clears it once, when its API server
is up).  It also records, in ``events/`` there, each request the scheduler preempts and the
requests each step gives a worker's cache.

:func:`write_entry_point` makes the plugin visible to a Python whose ``PYTHONPATH`` holds
the directory it is given (and this file's): a ``.dist-info`` with the entry point, which
``importlib.metadata`` finds on ``sys.path`` as if it were installed.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

PROBE_DIR_ENV = "MMCACHE_ENGINE_PROBE_DIR"


def class_name(obj: object) -> str | None:
    """``module.Class`` of ``obj``; ``None`` for ``None`` (no cache built)."""
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


_records = itertools.count()


def _record(role: str, factory: str, cache: object) -> None:
    directory = Path(os.environ[PROBE_DIR_ENV])
    record = {"role": role, "pid": os.getpid(), "factory": factory, "cache": class_name(cache)}
    if role == "frontend":
        record["ring"] = published_ring()
    _write(directory / f"{role}-{os.getpid()}-{next(_records)}.json", record)
    if role == "frontend" and cache is not None:
        _keep_stats(cache, directory / f"stats-{os.getpid()}.json")


def _write(path: Path, record: dict[str, Any]) -> None:
    """``record`` as ``path``, whole or not at all (for readers in other processes)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(path)


def _keep_stats(cache: Any, path: Path) -> None:
    """Rewrite ``path`` with ``cache``'s statistics after each request it releases and each
    clear."""
    clears = 0

    def write() -> None:
        hits, total = cache.make_stats()
        _write(path, {"pid": os.getpid(), "hits": hits, "total": total, "clears": clears})

    release, clear = cache.release_sender_touches, cache.clear_cache

    def release_sender_touches() -> None:
        release()
        write()

    def clear_cache() -> None:
        nonlocal clears
        clear()
        clears += 1
        write()

    cache.release_sender_touches, cache.clear_cache = release_sender_touches, clear_cache


def _record_event(event: str, request_ids: list[str]) -> None:
    """One event of this process (a preemption, a worker given requests), in ``events/``."""
    directory = Path(os.environ[PROBE_DIR_ENV]) / "events"
    directory.mkdir(exist_ok=True)
    record = {"event": event, "pid": os.getpid(), "request_ids": request_ids}
    path = directory / f"{event}-{os.getpid()}-{next(_records)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(path)


def _watch_preemptions(scheduler: type) -> None:
    """Record each request the engine core's scheduler preempts."""
    original = scheduler._preempt_request  # type: ignore[attr-defined]
    if getattr(original, "_probed", False):
        return

    @functools.wraps(original)
    def preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _record_event("preempted", [request.request_id])
        return original(self, request, *args, **kwargs)

    preempt_request._probed = True  # type: ignore[attr-defined]
    scheduler._preempt_request = preempt_request  # type: ignore[attr-defined]


def _watch_deliveries(wrapper: type) -> None:
    """Record the requests with multimodal data each step gives a worker's cache."""
    original = wrapper._apply_mm_cache  # type: ignore[attr-defined]
    if getattr(original, "_probed", False):
        return

    @functools.wraps(original)
    def apply_mm_cache(self: Any, scheduler_output: Any) -> Any:
        given = [
            r.req_id
            for r in scheduler_output.scheduled_new_reqs
            if any(f.data is not None for f in r.mm_features or ())
        ]
        if given:
            _record_event("delivered", given)
        return original(self, scheduler_output)

    apply_mm_cache._probed = True  # type: ignore[attr-defined]
    wrapper._apply_mm_cache = apply_mm_cache  # type: ignore[attr-defined]


def published_ring() -> str | None:
    """The name of the ring this process's frontend cache published (``None``: none)."""
    from mmcache.vllm import READER_HANDLE_ENV

    published = os.environ.get(READER_HANDLE_ENV)
    return str(json.loads(published)["name"]) if published else None


def _wrap(module: ModuleType, factory: str, role: str) -> None:
    """Record what ``module``'s global ``factory`` returns, each time it is called there."""
    original = getattr(module, factory)
    if getattr(original, "_probed", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        cache = original(*args, **kwargs)
        _record(role, factory, cache)
        return cache

    wrapper._probed = True  # type: ignore[attr-defined]
    setattr(module, factory, wrapper)


def register() -> None:
    """Wrap the cache factories where the frontend, the engine core and the workers call
    them (module globals, looked up at each call, so loading order does not matter)."""
    if PROBE_DIR_ENV not in os.environ:
        return
    from vllm.renderers import base as renderer
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import core as engine_core
    from vllm.v1.worker import worker_base

    _wrap(renderer, "processor_cache_from_config", "frontend")
    _wrap(engine_core, "engine_receiver_cache_from_config", "engine_core")
    _wrap(worker_base, "worker_receiver_cache_from_config", "worker")
    _watch_preemptions(Scheduler)
    _watch_deliveries(worker_base.WorkerWrapperBase)


def read_records(directory: Path) -> list[dict[str, Any]]:
    """Every record of a cache built that the engine's processes wrote into ``directory``."""
    return [
        json.loads(p.read_text())
        for p in sorted(directory.glob("*.json"))
        if not p.name.startswith("stats-")
    ]


def read_stats(directory: Path) -> dict[int, dict[str, int]]:
    """Each frontend's latest cache statistics in ``directory``, by pid: ``hits``, ``total``
    (lookups) and ``clears``."""
    stats = (json.loads(p.read_text()) for p in directory.glob("stats-*.json"))
    return {record["pid"]: record for record in stats}


def read_events(directory: Path, event: str) -> list[str]:
    """The request ids of the ``event``s the engine's processes recorded in ``directory``,
    one per request and event (a request preempted twice is there twice)."""
    paths = sorted((directory / "events").glob(f"{event}-*.json"))
    return [rid for path in paths for rid in json.loads(path.read_text())["request_ids"]]


def write_entry_point(directory: Path) -> None:
    """A distribution ``mmcache-engine-probe`` in ``directory`` whose ``vllm.general_plugins``
    entry point is :func:`register` (importable as ``probe`` from this file's directory)."""
    dist_info = directory / "mmcache_engine_probe-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: mmcache-engine-probe\nVersion: 0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nmmcache_engine_probe = probe:register\n"
    )
