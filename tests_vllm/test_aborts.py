"""Requests the engine core finishes before a worker read them (``mmcache.vllm.aborts``):
the scheduler hands their handle features to the workers, which give back the references
of those they were never given, and only those."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.worker.worker_base import WorkerWrapperBase

from mmcache.vllm import aborts
from vllm_helpers import feature, kwargs_item, outstanding, same_item

TRUTH = {h: kwargs_item(i) for i, h in enumerate(["a", "b"])}


def request_features(p0: Any, hashes: list[str]) -> list[Any]:
    """One request through P0's cache, as vLLM's processor makes it: its features."""
    cached = p0.is_cached(hashes)
    for h in hashes:
        p0.touch_sender_cache_item(h)
    items = [
        p0.get_and_update_item(None if c else (TRUTH[h], [f"pu-{h}"]), h)[0]
        for h, c in zip(hashes, cached, strict=True)
    ]
    p0.release_sender_touches()
    return [feature(item, h) for item, h in zip(items, hashes, strict=True)]


def step(worker: Any, new: dict[str, list[Any]], unread: Any, finished: set[str]) -> None:
    """One step of a worker: vLLM's ``_apply_mm_cache`` (wrapped) on a scheduler output."""
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, mm_features=f) for r, f in new.items()],
        finished_req_ids=finished,
    )
    if unread is not None:
        setattr(output, aborts.UNREAD_ATTR, unread)
    WorkerWrapperBase._apply_mm_cache(SimpleNamespace(mm_receiver_cache=worker), output)


def test_install_wraps_the_three_methods_once() -> None:
    aborts.wrap()  # installed already (conftest): idempotent
    for method in (
        Scheduler.finish_requests,
        Scheduler.schedule,
        WorkerWrapperBase._apply_mm_cache,
    ):
        assert not hasattr(method.__mmcache_original__, "__mmcache_original__")


def test_the_scheduler_hands_finished_requests_handles_to_the_next_step(
    shm_pair: tuple[Any, Any],
) -> None:
    p0, _ = shm_pair
    with_handles = SimpleNamespace(request_id="r1", mm_features=request_features(p0, ["a"]))
    plain = feature(TRUTH["b"], "b")  # an item that travels with its data
    without = SimpleNamespace(request_id="r2", mm_features=[plain])
    scheduler = SimpleNamespace()
    finish = aborts._finish_requests(lambda self, ids, status: [with_handles, without])
    schedule = aborts._schedule(lambda self: SimpleNamespace())
    assert finish(scheduler, ["r1", "r2"], "aborted") == [with_handles, without]
    output = schedule(scheduler)
    assert getattr(output, aborts.UNREAD_ATTR) == {"r1": with_handles.mm_features}
    assert not hasattr(schedule(scheduler), aborts.UNREAD_ATTR)  # handed over once
    p0.release_unsent([f.data for f in with_handles.mm_features])


def test_a_worker_gives_back_only_what_it_was_never_given(
    shm_pair: tuple[Any, Any],
) -> None:
    p0, worker = shm_pair
    read = request_features(p0, ["a", "b"])
    step(worker, {"read": read}, None, set())
    assert all(same_item(TRUTH[h], f.data) for f, h in zip(read, ["a", "b"], strict=True))
    waiting = request_features(p0, ["a"])  # the same object, a reference of its own
    aborted = request_features(p0, ["a", "b"])
    assert outstanding(p0) == 3
    # Both finish: "read" was given to this worker (reading it again would take the
    # reference "waiting" holds), "aborted" never was.
    step(worker, {}, {"read": read, "aborted": aborted}, {"read", "aborted"})
    assert outstanding(p0) == 1
    step(worker, {"waiting": waiting}, None, set())
    assert same_item(TRUTH["a"], waiting[0].data)
    assert outstanding(p0) == 0


def engine_core(scheduler: Any) -> Any:
    """A stand-in for vLLM's engine core (paused, rejecting new requests) over
    ``scheduler``."""
    return SimpleNamespace(
        scheduler=scheduler,
        reject_new_requests=True,
        _send_finish_outputs_to_client=lambda *args: None,
        _send_error_outputs_to_client=lambda *args: None,
    )


def test_requests_the_engine_core_rejects_give_their_handles_back(
    shm_pair: tuple[Any, Any],
) -> None:
    # The engine core drops a request that arrives while it is paused (an RL loop's weight
    # update), or that fails its checks there (a structured-output grammar it cannot
    # compile): the request never reaches the scheduler, nor a worker.
    p0, worker = shm_pair
    scheduler = SimpleNamespace(has_request=lambda request_id: False)
    core = engine_core(scheduler)
    paused = SimpleNamespace(
        request_id="paused",
        mm_features=request_features(p0, ["a", "b"]),
        abort_immediately=False,
        client_index=0,
        kv_transfer_params=None,
    )
    assert EngineCoreProc._reject_add_while_paused(core, paused)
    invalid = SimpleNamespace(
        request_id="invalid", mm_features=request_features(p0, ["a"]), client_index=0
    )
    EngineCoreProc._handle_request_validation_error(core, invalid, ValueError("grammar"))
    failed = SimpleNamespace(
        request_id="failed", mm_features=request_features(p0, ["b"]), client_index=0
    )
    EngineCoreProc._handle_request_preproc_error(core, failed)
    assert outstanding(p0) == 4
    output = aborts._schedule(lambda self: SimpleNamespace())(scheduler)
    unread = getattr(output, aborts.UNREAD_ATTR, None)
    assert unread is not None and set(unread) == {"paused", "invalid", "failed"}
    step(worker, {}, unread, set())
    assert outstanding(p0) == 0
