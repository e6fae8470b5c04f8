"""Several API servers on one ring (``vllm serve --api-server-count N``), in one process:
the launcher's ring, the API servers' joined writers, a worker reading what either wrote,
vLLM's prompt updates stored with the items (``mmcache.vllm.prompt_codec``), and single
flight: an item one server is processing is waited for by the other."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.multimodal.cache import (
    engine_receiver_cache_from_config,
    processor_cache_from_config,
    worker_receiver_cache_from_config,
)
from vllm.multimodal.cache import factories as vllm_factories
from vllm.multimodal.processing.processor import (
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptUpdateDetails,
    apply_token_matches,
    find_mm_placeholders,
)

import mmcache
import mmcache.vllm as mv
from mmcache._core import MAX_WRITERS
from mmcache.vllm import launcher, prompt_codec, sender
from mmcache.vllm.publish import published_handle
from mmcache.vllm.sender import rendering
from vllm_helpers import (
    MiB,
    feature,
    items_travel_with_their_data,
    kwargs_item,
    mmcache_warnings,
    same_item,
    vllm_config,
)

LOCK = object()
IMAGE, START, END = 7, 1, 2


def config(rank: int) -> Any:
    """The config of API server ``rank`` of two (``-1``: their launcher and engine core)."""
    return vllm_config("shm", 4 * MiB, api_process_count=2, api_process_rank=rank)


def prompt_updates() -> dict[str, list[list[Any]]]:
    """Prompt updates of two images as vLLM's processors resolve them: content whose
    ``is_embed`` is a closure, and targets that are closures (``PromptIndexTargets``)."""
    replacement = PromptReplacement(
        "image",
        target=[IMAGE],
        replacement=lambda i: PromptUpdateDetails.select_token_id(
            [START] + [IMAGE] * (i + 2) + [END], IMAGE
        ),
    )
    insertion = PromptInsertion(
        "image",
        target=PromptIndexTargets.prefix([START]),
        insertion=lambda i: PromptUpdateDetails.select_token_ids([9, IMAGE, 9], [IMAGE]),
    )
    return {"image": [[replacement.resolve(i), insertion.resolve(i)] for i in range(2)]}


def placeholders(updates: dict[str, list[list[Any]]], prompt: list[int]) -> list[Any]:
    found = find_mm_placeholders(prompt, updates)["image"]
    return [(p.item_idx, p.start_idx, p.tokens, p.is_embed.tolist()) for p in found]


# -- prompt updates ----------------------------------------------------------------------------


def test_prompt_updates_need_the_codec() -> None:
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(prompt_updates())


def test_decoded_prompt_updates_update_prompts_as_vllms_own() -> None:
    original = prompt_updates()
    decoded = prompt_codec.loads(prompt_codec.dumps(original))
    prompt = [START, 5, IMAGE, 6, IMAGE, 8]
    assert apply_token_matches(prompt, decoded) == apply_token_matches(prompt, original)
    updated, _ = apply_token_matches(prompt, original)
    assert placeholders(decoded, updated) == placeholders(original, updated)
    assert placeholders(original, updated)  # the updated prompt has placeholders to find
    inserted = [START, 9, IMAGE, 9, 3]
    target = decoded["image"][0][1].target
    assert target.get_match_index(inserted) == original["image"][0][1].target.get_match_index(
        inserted
    )


def test_a_decoded_is_embed_gives_its_mask_for_its_own_tokens_only() -> None:
    details = PromptUpdateDetails.select_token_id([START, IMAGE, IMAGE, END], IMAGE)
    decoded = prompt_codec.loads(prompt_codec.dumps(details))
    assert isinstance(decoded.is_embed, prompt_codec.PrecomputedMask)
    mask = decoded.is_embed(decoded.full)
    assert torch.equal(mask, details.is_embed(details.full))
    mask[0] = True  # each call's mask is the caller's own
    assert not decoded.is_embed(decoded.full)[0]
    with pytest.raises(ValueError, match="other tokens"):
        decoded.is_embed([IMAGE])
    plain = PromptUpdateDetails.from_seq([IMAGE])
    assert prompt_codec.loads(prompt_codec.dumps(plain)) == plain


# -- one ring, several API servers -------------------------------------------------------------


def test_without_the_launchers_ring_vllm_serves_processor_only() -> None:
    # Looked up where the factories look it up: mmcache rebinds it there.
    assert vllm_factories._get_cache_type(config(0)) == "processor_only"
    close = launcher.open_ring(config(-1))
    try:
        assert {vllm_factories._get_cache_type(config(rank)) for rank in (-1, 0, 1)} == {"shm"}
    finally:
        close()
    assert mv.WRITER_HANDLE_ENV not in os.environ


def test_more_api_servers_than_a_ring_has_writers_fall_back_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM takes --api-server-count 64; a ring has at most 64 writers, the launcher's
    # included: vLLM's processor-only caches serve them, as without mmcache.
    def config(rank: int) -> Any:
        return vllm_config("shm", 4 * MiB, api_process_count=64, api_process_rank=rank)

    with caplog.at_level(logging.WARNING, logger="mmcache"):
        close = launcher.open_ring(config(-1))
    try:
        warnings = mmcache_warnings(caplog.records)
        assert len(warnings) == 1 and "--api-server-count" in warnings[0]
        server = processor_cache_from_config(config(0))
        assert type(server) is mv.MmcacheShmSenderCache and server.ring is None
        items_travel_with_their_data(server, worker_receiver_cache_from_config(config(-1), LOCK))
        server.close()
    finally:
        close()
    # The launcher's bound is the ring's.
    mmcache.ShmSenderCache(0.001, max_writers=MAX_WRITERS).close()
    with pytest.raises(ValueError, match="max_writers"):
        mmcache.ShmSenderCache(0.001, max_writers=MAX_WRITERS + 1)


def test_api_servers_hit_what_the_other_put_and_workers_read_it() -> None:
    close = launcher.open_ring(config(-1))
    published = published_handle()
    assert published is not None
    ring = Path("/dev/shm") / published.name
    servers = [processor_cache_from_config(config(rank)) for rank in (0, 1)]
    worker = worker_receiver_cache_from_config(config(-1), LOCK)
    try:
        assert all(type(s) is mv.MmcacheShmSenderCache for s in servers)
        assert engine_receiver_cache_from_config(config(-1)) is None
        first, second = servers
        assert first.ring is not None and second.ring is not None
        assert first.ring.name == second.ring.name == published.name
        item, updates = kwargs_item(1), prompt_updates()["image"][0]

        assert first.is_cached(["a"]) == [False]
        first.touch_sender_cache_item("a")
        put, _ = first.get_and_update_item((item, updates), "a")
        first.release_sender_touches()

        assert second.is_cached(["a"]) == [True]
        second.touch_sender_cache_item("a")
        hit, hit_updates = second.get_and_update_item(None, "a")
        second.release_sender_touches()

        prompt = [START, IMAGE, 4]
        assert apply_token_matches(prompt, {"image": [hit_updates]}) == apply_token_matches(
            prompt, {"image": [updates]}
        )
        features = [feature(put, "a"), feature(hit, "a")]
        worker.get_and_update_features(features)
        assert all(same_item(item, f.data) for f in features)
        assert second.make_stats().hits == 1 and first.make_stats().hits == 0
    finally:
        worker._shm_cache.close()
        for server in servers:
            server.close()
    # The launcher's writer slot keeps the ring after every API server left.
    assert ring.exists()
    close()
    assert not ring.exists()


# -- single flight between API servers ---------------------------------------------------------

TIMEOUT = 120  # seconds a lookup may take before the test calls it hung


def looked_up_in_thread(server: Any, hashes: list[str]) -> tuple[threading.Thread, list[Any]]:
    """``server.is_cached(hashes)`` in a thread of its own (its answer in the list)."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(server.is_cached(hashes)), daemon=True)
    thread.start()
    return thread, answer


def test_an_api_server_waits_for_the_item_the_other_is_processing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sender.CLAIM_WAIT_ENV, "3600")  # only the claim's end ends a wait
    close = launcher.open_ring(config(-1))
    first, second = servers = [processor_cache_from_config(config(rank)) for rank in (0, 1)]
    try:
        assert first.is_cached(["a"]) == [False]  # first claims "a": it processes it
        waiter, answer = looked_up_in_thread(second, ["a"])
        waiter.join(0.2)
        assert waiter.is_alive(), "second waits for first's item rather than processing it"
        first.touch_sender_cache_item("a")
        first.get_and_update_item((kwargs_item(1), prompt_updates()["image"][0]), "a")
        first.release_sender_touches()
        waiter.join(TIMEOUT)
        assert answer == [[True]]
        second.touch_sender_cache_item("a")
        second.get_and_update_item(None, "a")
        second.release_sender_touches()
        assert second.make_stats().hits == 1

        # A render that fails before vLLM's release (its processor raised) gives up its claims.
        def render_that_fails() -> None:
            with rendering():
                assert first.is_cached(["b"]) == [False]
                assert first.ring.stats()["store_claims"] == 1
                raise RuntimeError("the HF processor failed")

        with pytest.raises(RuntimeError, match="processor"):
            render_that_fails()
        assert first.ring.stats()["store_claims"] == 0
        waiter, answer = looked_up_in_thread(second, ["b"])
        waiter.join(TIMEOUT)
        assert answer == [[False]], "nobody processes b: second claims it"
        second.release_sender_touches()
    finally:
        for server in servers:
            server.close()
        close()


def test_a_request_keeps_what_its_first_lookup_found_while_its_next_one_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM looks a request up once per modality and touches its items only after the last
    lookup: an image the first lookup found cached must survive the video lookup's wait for
    the other server (seconds), however much that server writes meanwhile, or the request's
    update of the image misses."""
    monkeypatch.setenv(sender.CLAIM_WAIT_ENV, "3600")  # only the claim's end ends a wait
    close = launcher.open_ring(config(-1))
    first, second = servers = [processor_cache_from_config(config(rank)) for rank in (0, 1)]
    try:
        first.touch_sender_cache_item("image")
        first.get_and_update_item((kwargs_item(1), prompt_updates()["image"][0]), "image")
        first.release_sender_touches()
        assert second.is_cached(["video"]) == [False]  # second claims the video
        store = first.ring._store
        waiting = threading.Event()

        class Waiting:
            """``first``'s writer, which says when a wait begins."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def wait_for(self, keys: list[str], timeout_s: float) -> list[bool]:
                waiting.set()
                return store.wait_for(keys, timeout_s)

        first.ring._store = Waiting()
        outcome: list[Any] = []

        def request() -> None:  # as vLLM's processor runs one request
            try:
                with rendering():
                    looked_up = [first.is_cached(["image"]), first.is_cached(["video"])]
                    for h in ("image", "video"):
                        first.touch_sender_cache_item(h)
                    outcome.append(looked_up)
                    outcome.append([first.get_and_update_item(None, h) for h in ("image", "video")])
                    first.release_sender_touches()
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        assert waiting.wait(TIMEOUT), "the video lookup waits for second"
        evictions = first.ring.stats()["store_evictions"]

        def other_requests() -> None:  # second's other renderer thread: the ring turns over
            for i in range(2, 40):
                if not first.ring.is_cached_item("image"):
                    break
                second.touch_sender_cache_item(f"other-{i}")
                second.get_and_update_item((kwargs_item(i, MiB // 2), []), f"other-{i}")
                second.release_sender_touches()

        other = threading.Thread(target=other_requests, daemon=True)
        other.start()
        other.join(TIMEOUT)
        assert first.ring.stats()["store_evictions"] > evictions
        second.touch_sender_cache_item("video")
        second.get_and_update_item((kwargs_item(99), prompt_updates()["image"][1]), "video")
        second.release_sender_touches()
        thread.join(TIMEOUT)
        first.ring._store = store
        assert not isinstance(outcome[-1], BaseException), outcome[-1]
        assert outcome[0] == [[True], [True]]
        # Each item's own prompt updates (those resolved for item 0 and item 1).
        assert [[u.item_idx for u in updates] for _, updates in outcome[1]] == [[0, 0], [1, 1]]
    finally:
        for server in servers:
            server.close()
        close()


def test_the_claim_wait_is_set_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    close = launcher.open_ring(config(-1))
    try:
        monkeypatch.setenv(sender.CLAIM_WAIT_ENV, "soon")
        with pytest.raises(ValueError, match=sender.CLAIM_WAIT_ENV) as refused:
            processor_cache_from_config(config(0))
        monkeypatch.setenv(sender.CLAIM_WAIT_ENV, "0")  # no single flight
        first, second = servers = [processor_cache_from_config(config(r)) for r in (0, 1)]
        try:
            # The refused one took no writer slot (its traceback, kept, would keep it alive).
            assert refused.traceback is not None
            assert first.ring.stats()["store_writers_attached"] == 3  # the launcher's too
            assert first.is_cached(["a"]) == [False]
            assert second.is_cached(["a"]) == [False]
            assert first.ring.stats()["store_claims"] == 0
        finally:
            for server in servers:
                server.close()
    finally:
        close()


# -- the launcher's shutdown --------------------------------------------------------------------


def test_the_launchers_shutdown_returns_once_its_ring_is_closed_whichever_thread_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's engine manager's ``shutdown`` is called by the launcher's main thread and, as
    the engine core stops, by the daemon thread watching it: the ring is closed by whichever
    comes first, and the other's call returns only once it is closed (the interpreter's exit
    stops a daemon thread where it stands)."""
    closing = threading.Event()
    wait_for_the_other_writers = launcher._wait_for_the_other_writers

    def closes(name: str) -> None:
        closing.set()
        wait_for_the_other_writers(name)

    monkeypatch.setattr(launcher, "_wait_for_the_other_writers", closes)
    monkeypatch.setattr(launcher, "_OTHER_WRITERS_DEADLINE_S", 0.5)

    class Manager:  # vLLM's CoreEngineProcManager, as the launcher wraps it
        def __init__(self, vllm_config: Any) -> None:
            pass

        def shutdown(self, timeout: float | None = None) -> None:
            if threading.current_thread() is threading.main_thread():
                assert closing.wait(TIMEOUT), "the watcher never began to close the ring"

    Manager.__init__ = launcher._start(Manager.__init__)  # type: ignore[method-assign]
    Manager.shutdown = launcher._shutdown(Manager.shutdown)  # type: ignore[method-assign]
    manager = Manager(config(-1))
    published = published_handle()
    assert published is not None
    # An API server still there: the close waits for it to leave (until the deadline).
    server = processor_cache_from_config(config(0))
    try:
        watcher = threading.Thread(target=manager.shutdown, daemon=True)
        watcher.start()
        manager.shutdown()
        writers = mmcache.inspect(published.name)["writers"]
        assert [w["claimed"] for w in writers] == [False, True, False]
        watcher.join(TIMEOUT)
    finally:
        server.close()
    assert not (Path("/dev/shm") / published.name).exists()
