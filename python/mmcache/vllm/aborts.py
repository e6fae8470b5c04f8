"""Requests the engine core finishes before a worker read their handles give them back.

In ``shm`` mode a request's features carry handles from P0 to the workers through the engine
core, and a worker gives a handle's reference back by reading it, when the request is first
scheduled to it (``scheduled_new_reqs``).  A request aborted while it waits in the engine
core (a client that goes away in ``AsyncLLM``: ``AsyncLLM.abort`` sends the abort to the
engine core, whose ``Scheduler.finish_requests`` drops the request) never reaches a worker,
and only P0's writer could give its references back, without knowing whether a worker read
them.  So the workers do it, as they would have:

* in the engine core, ``Scheduler.finish_requests`` notes the handle features of each
  request it finishes, and the next ``Scheduler.schedule`` hands them to the workers on its
  output (attribute :data:`UNREAD_ATTR`: request id to features; the output travels to the
  workers pickled, with its instance attributes);
* in each worker, ``WorkerWrapperBase._apply_mm_cache`` (after vLLM's own) lets the cache
  read the handles of those requests it was never given
  (:meth:`~mmcache.vllm.receiver.MmcacheShmReceiverCache.settle_requests`), which gives
  their references back; a request the worker was given, it has read already.

A request the engine core drops before its scheduler has it (one that arrives while the engine
is paused, ``EngineCoreProc._reject_add_while_paused``; one that fails the engine core's
checks, ``_handle_request_validation_error`` / ``_handle_request_preproc_error``, in its
input thread) is noted the same way.

Both methods are the same in vLLM 0.32 and 0.33.  The references come back with the step
after the abort (the engine core schedules a step while it has requests).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.worker.worker_base import WorkerWrapperBase

__all__ = ["UNREAD_ATTR", "wrap"]

UNREAD_ATTR = "mmcache_unread"
"""The attribute of a ``SchedulerOutput`` that carries the handle features of the requests
finished since the previous step: ``{request_id: [MultiModalFeatureSpec, ...]}``."""

_PENDING = "_mmcache_unread"
"""The scheduler's attribute where finished requests' handle features wait for a step."""

_PENDING_LOCK = threading.Lock()
"""Guards :data:`_PENDING`: the engine core's input thread notes the requests it rejects
while its busy loop schedules."""

_ORIGINAL = "__mmcache_original__"


def _handle_features(request: Any) -> list[Any]:
    """The features of ``request`` whose data is a handle item (``address``)."""
    return [
        feature
        for feature in request.mm_features or ()
        if isinstance(feature.data, Mapping) and "address" in feature.data
    ]


def _finish_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finish_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        finished = original(self, *args, **kwargs)
        for request in finished or ():
            _note_unread(self, request)
        return finished

    return finish_requests


def _note_unread(scheduler: Any, request: Any) -> None:
    """Hand ``request``'s handle features (if any) to the workers with ``scheduler``'s next
    step."""
    if features := _handle_features(request):
        with _PENDING_LOCK:
            scheduler.__dict__.setdefault(_PENDING, {})[request.request_id] = features


def _reject_add_while_paused(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def reject_add_while_paused(self: Any, request: Any) -> bool:
        rejected = original(self, request)
        if rejected:
            _note_unread(self.scheduler, request)
        return rejected

    return reject_add_while_paused


def _rejects(original: Callable[..., None]) -> Callable[..., None]:
    """An engine core method that answers a request it dropped (its first argument)."""

    @functools.wraps(original)
    def rejects(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        try:
            original(self, request, *args, **kwargs)
        finally:
            _note_unread(self.scheduler, request)

    return rejects


def _schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        with _PENDING_LOCK:
            pending = self.__dict__.pop(_PENDING, None)
        if pending:
            setattr(output, UNREAD_ATTR, pending)
        return output

    return schedule


def _apply_mm_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_mm_cache(self: Any, scheduler_output: Any) -> None:
        original(self, scheduler_output)
        settle: Callable[..., None] | None = getattr(
            self.mm_receiver_cache, "settle_requests", None
        )
        if settle is not None:
            settle(
                delivered=[r.req_id for r in scheduler_output.scheduled_new_reqs],
                unread=getattr(scheduler_output, UNREAD_ATTR, None) or {},
                finished=scheduler_output.finished_req_ids,
            )

    return apply_mm_cache


def _wrap_all(targets: Iterable[tuple[type, str, Callable[..., Any]]]) -> None:
    for cls, name, wrapper in targets:
        method = getattr(cls, name)
        if not hasattr(method, _ORIGINAL):
            wrapped = wrapper(method)
            setattr(wrapped, _ORIGINAL, method)
            setattr(cls, name, wrapped)


def wrap() -> None:
    """Wrap the three methods, and the engine core's that reject requests (idempotent)."""
    _wrap_all(
        [
            (Scheduler, "finish_requests", _finish_requests),
            (Scheduler, "schedule", _schedule),
            (WorkerWrapperBase, "_apply_mm_cache", _apply_mm_cache),
            # Those of vLLM 0.33's engine core that a vLLM lacks, it does not call.
            *(
                (EngineCoreProc, name, wrapper)
                for name, wrapper in (
                    ("_reject_add_while_paused", _reject_add_while_paused),
                    ("_handle_request_validation_error", _rejects),
                    ("_handle_request_preproc_error", _rejects),
                )
                if hasattr(EngineCoreProc, name)
            ),
        ]
    )
