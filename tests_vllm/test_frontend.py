"""What the adapter does around vLLM's frontend: requests vLLM rejects after P0's cache issued
their handles give them back, and invalidations never land inside a request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.multimodal.cache import (
    MultiModalCacheMissError,
    engine_receiver_cache_from_config,
    processor_cache_from_config,
)
from vllm.multimodal.cache.base import MultiModalCache
from vllm.renderers.base import BaseRenderer
from vllm.v1.engine.input_processor import InputProcessor

from mmcache.vllm import frontend
from mmcache.vllm.sender import rendering
from tests.actors import Actor
from vllm_helpers import MiB, feature, kwargs_item, outstanding, same_item, vllm_config

TRUTH = {h: kwargs_item(i) for i, h in enumerate(["a", "b", "c"])}


def vllm_p0_request(p0: Any, hashes: list[str]) -> list[Any]:
    """What vLLM's processor does with P0's cache for one request (``_merge_mm_kwargs``)."""
    cached = p0.is_cached(hashes)
    try:
        for h in hashes:
            p0.touch_sender_cache_item(h)
        return [
            p0.get_and_update_item(None if c else (TRUTH[h], [f"pu-{h}"]), h)[0]
            for h, c in zip(hashes, cached, strict=True)
        ]
    finally:
        p0.release_sender_touches()


def test_install_wraps_the_four_methods_once() -> None:
    frontend.wrap()  # installed already (conftest): idempotent
    for method in (
        BaseRenderer._process_multimodal,
        InputProcessor.process_inputs,
        InputProcessor.__init__,
        BaseRenderer.__init__,
    ):
        original = method.__mmcache_original__
        assert not hasattr(original, "__mmcache_original__")


def test_a_render_that_fails_after_its_request_gives_the_handles_back(
    shm_pair: tuple[Any, Any],
) -> None:
    # vLLM's processor fails the prompt's replacements after the request was released.
    p0, _ = shm_pair

    def render_then_fail() -> None:
        assert all("address" in item for item in vllm_p0_request(p0, ["a", "b"]))
        assert outstanding(p0) == 2
        raise AssertionError("Failed to apply prompt replacement for mm_items['image'][1]")

    with pytest.raises(AssertionError, match="prompt replacement"), rendering():
        render_then_fail()
    assert outstanding(p0) == 0


def test_a_render_that_succeeds_keeps_its_handles_for_the_workers(
    shm_pair: tuple[Any, Any],
) -> None:
    p0, worker = shm_pair
    # The outer one: process_inputs rendering a raw prompt.
    with rendering(), rendering():
        items = vllm_p0_request(p0, ["a", "b"])
    assert outstanding(p0) == 2
    features = [feature(item, h) for item, h in zip(items, ["a", "b"], strict=True)]
    worker.get_and_update_features(features)
    assert all(same_item(TRUTH[h], f.data) for f, h in zip(features, ["a", "b"], strict=True))
    assert outstanding(p0) == 0


def test_a_rendered_prompt_process_inputs_rejects_gives_its_handles_back(
    shm_pair: tuple[Any, Any],
) -> None:
    p0, _ = shm_pair
    with rendering():
        items = vllm_p0_request(p0, ["a", "b", "a"])
    rendered = {"type": "multimodal", "mm_kwargs": {"image": items}, "mm_hashes": {}}

    def too_long(self: Any, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("The decoder prompt is longer than the maximum model length")

    process_inputs = frontend._process_inputs(too_long)
    processor = SimpleNamespace(renderer=SimpleNamespace(mm_processor_cache=p0))
    assert outstanding(p0) == 3
    with pytest.raises(ValueError, match="maximum model length"):
        process_inputs(processor, request_id="r", prompt=rendered, params=None)
    assert outstanding(p0) == 0


def async_processor(p0: Any, executor: ThreadPoolExecutor, hashes: list[str]) -> Any:
    """A stand-in for vLLM's InputProcessor as its wrapped constructor leaves it, whose
    ``process_inputs`` renders ``hashes`` through P0's cache once ``go`` is set."""
    started, go = threading.Event(), threading.Event()

    def init(self: Any) -> None:
        self.renderer = SimpleNamespace(_executor=executor, mm_processor_cache=p0)
        self.process_inputs_async = "vLLM's binding"

    def process_inputs(request_id: str) -> Any:
        started.set()
        assert go.wait(30)
        with rendering():
            items = vllm_p0_request(p0, hashes)
        return SimpleNamespace(
            mm_features=[feature(i, h) for i, h in zip(items, hashes, strict=True)]
        )

    processor = SimpleNamespace(process_inputs=process_inputs, started=started, go=go)
    frontend._init(init)(processor)
    return processor


def cancel_once_started(stand_in: Any, start: Callable[[], Awaitable[Any]]) -> None:
    """Await ``start()`` and cancel it once ``stand_in``'s thread has ``started`` processing
    (a client that goes away), then let that thread go on (``stand_in.go``)."""

    async def cancel_while_processing() -> None:
        task = asyncio.ensure_future(start())
        while not stand_in.started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_processing())
    stand_in.go.set()


def test_a_request_cancelled_while_its_images_are_processed_gives_its_handles_back(
    shm_pair: tuple[Any, Any],
) -> None:
    # AsyncLLM.add_request awaits process_inputs_async; the client goes away meanwhile.
    p0, _ = shm_pair
    with ThreadPoolExecutor(1) as executor:
        processor = async_processor(p0, executor, ["a", "b"])
        cancel_once_started(processor, lambda: processor.process_inputs_async("r"))
    assert outstanding(p0) == 0  # the executor's exit waited for the thread's release
    assert p0.is_cached(["a", "b"]) == [True, True]  # the items stay cached for later


def test_a_render_cancelled_while_its_images_are_processed_gives_its_handles_back(
    shm_pair: tuple[Any, Any],
) -> None:
    # vllm serve's renderer awaits _process_multimodal_async; the client goes away meanwhile.
    p0, _ = shm_pair
    started, go = threading.Event(), threading.Event()

    def init(self: Any) -> None:
        self._mm_executor = executor
        self.mm_processor_cache = p0
        self._process_multimodal_async = "vLLM's binding"

    def process_multimodal(prompt: list[int]) -> Any:
        started.set()
        assert go.wait(30)
        with rendering():
            items = vllm_p0_request(p0, ["a", "b"])
        return {"type": "multimodal", "mm_kwargs": {"image": items}, "prompt_token_ids": prompt}

    with ThreadPoolExecutor(1) as executor:
        renderer = SimpleNamespace(_process_multimodal=process_multimodal, started=started, go=go)
        frontend._renderer_init(init)(renderer)
        cancel_once_started(renderer, lambda: renderer._process_multimodal_async([1, 2]))
    assert outstanding(p0) == 0  # the executor's exit waited for the thread's release
    assert p0.is_cached(["a", "b"]) == [True, True]


def test_a_request_awaited_to_the_end_keeps_its_handles_for_the_workers(
    shm_pair: tuple[Any, Any],
) -> None:
    p0, worker = shm_pair
    with ThreadPoolExecutor(1) as executor:
        processor = async_processor(p0, executor, ["a", "b"])
        processor.go.set()
        request = asyncio.run(processor.process_inputs_async("r"))
    assert outstanding(p0) == 2
    worker.get_and_update_features(request.mm_features)
    assert all(same_item(TRUTH[h], f.data) for f, h in zip(request.mm_features, "ab", strict=True))
    assert outstanding(p0) == 0


def invalidate_from_another_thread(p0: Any, mm_hash: str) -> None:
    other_thread = threading.Thread(target=p0.invalidate, args=(mm_hash,))
    other_thread.start()
    other_thread.join()


def finish_request_a_b(p0: Any) -> None:
    """The rest of a request that looked up "a" (cached) and "b" (not), whose lookup an
    invalidation of "a" arrived in: "a" is still a hit, and gone once the request is."""
    for h in ["a", "b"]:
        p0.touch_sender_cache_item(h)
    p0.get_and_update_item(None, "a")  # would be a miss had it landed
    p0.get_and_update_item((TRUTH["b"], []), "b")
    p0.release_sender_touches()
    assert p0.is_cached(["a", "b"]) == [False, True], "not applied after the request"
    p0.release_sender_touches()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_an_invalidation_from_another_thread_waits_for_the_request_in_its_lookup(
    mode: str,
) -> None:
    # vLLM 0.32's output handler invalidates what the engine reported missing while the
    # renderer's thread may be between a request's lookup and its updates (vLLM 0.33 queues
    # them and drains them before its next lookup).
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert p0.is_cached(["a", "b"]) == [True, False]  # the renderer's lookup
        invalidate_from_another_thread(p0, "a")
        assert p0.is_cached_item("a"), "the invalidation landed inside the request"
        finish_request_a_b(p0)
        p0.invalidate("b")  # no request in its lookup: at once
        assert not p0.is_cached_item("b")
    finally:
        p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_an_invalidation_waits_for_every_modality_of_the_request_in_its_lookup(
    mode: str,
) -> None:
    # vLLM looks a request up once per modality (`_get_cache_missing_items`): the second
    # modality's lookup is still inside the request the first one began.
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert p0.is_cached(["a"]) == [True]  # the images
        invalidate_from_another_thread(p0, "a")
        assert p0.is_cached(["b"]) == [False]  # the videos, of the same request
        assert p0.is_cached_item("a"), "the invalidation landed inside the request"
        finish_request_a_b(p0)
    finally:
        p0.close()


def look_up_in_another_thread(p0: Any, hashes: list[str]) -> list[bool]:
    """A request of another renderer thread, left between its lookup and its release."""
    found: list[list[bool]] = []
    other_thread = threading.Thread(target=lambda: found.append(p0.is_cached(hashes)))
    other_thread.start()
    other_thread.join()
    return found[0]


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_an_invalidation_waits_only_for_requests_that_found_the_item_cached(mode: str) -> None:
    # Renderer threads overlap under load: some request is always between its lookup and its
    # release.  vLLM 0.33's renderer drains its invalidations in its own thread right before
    # its next lookup; one held back until no request at all is in its lookup would never
    # land, and the retry of the request that missed would find the item cached again (and
    # miss again on P1).
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert look_up_in_another_thread(p0, ["b"]) == [False]  # it never found "a"
        p0.invalidate("a")  # the drain, before this thread's lookup
        assert p0.is_cached(["a"]) == [False], "the invalidation waits for a request of b"
        items = vllm_p0_request(p0, ["a"])
        assert items[0] is not None, "the retry was not sent with its data"
    finally:
        p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_an_invalidation_held_back_lands_once_the_requests_that_found_the_item_end(
    mode: str,
) -> None:
    # A request that found "a" cached holds its invalidation back; requests that begin later
    # (here, in this thread, overlapping it) do not hold it back for ever.
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert p0.is_cached(["a"]) == [True]  # this thread's request found "a"
        invalidate_from_another_thread(p0, "a")
        assert p0.is_cached_item("a"), "the invalidation landed inside the request"
        assert look_up_in_another_thread(p0, ["c"]) == [False]  # overlapping, without "a"
        finish_request_a_b(p0)
    finally:
        p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_an_invalidation_a_threads_last_request_held_back_lands_before_its_next_lookup(
    mode: str,
) -> None:
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert p0.is_cached(["a"]) == [True]  # a request that never got its release
        invalidate_from_another_thread(p0, "a")
        p0.touch_sender_cache_item("a")  # ... and made touches: the next lookup is another's
        assert p0.is_cached(["a"]) == [False]
        p0.release_sender_touches()
        assert not p0.is_cached_item("a")
    finally:
        p0.close()


def reject_too_long(p0: Any, rendered: Any) -> None:
    """vLLM's process_inputs rejecting ``rendered`` (its length) after its render."""

    def too_long(self: Any, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("The decoder prompt is longer than the maximum model length")

    process_inputs = frontend._process_inputs(too_long)
    processor = SimpleNamespace(renderer=SimpleNamespace(mm_processor_cache=p0))
    with pytest.raises(ValueError, match="maximum model length"):
        process_inputs(processor, request_id="r", prompt=rendered, params=None)


def test_an_lru_request_vllm_rejects_after_its_render_leaves_p0_as_p1_is() -> None:
    # In lru mode P0's cache is P1's mirror: an item a request stored never reaches P1 when
    # vLLM rejects the request after its render (a prompt too long, a failed replacement).
    # Kept, it made P0 send the next request that has it without its data: a miss at P1 in
    # a run without faults, failing that request.
    p0 = processor_cache_from_config(vllm_config("lru", 4 * MiB))
    try:
        vllm_p0_request(p0, ["c"])  # sent: P1 holds it

        def render_then_fail() -> None:
            vllm_p0_request(p0, ["a", "c"])
            raise AssertionError("Failed to apply prompt replacement for mm_items['image'][1]")

        with pytest.raises(AssertionError, match="prompt replacement"), rendering():
            render_then_fail()
        assert p0.is_cached(["a", "c"]) == [False, True]
        p0.release_sender_touches()
        with rendering():
            items = vllm_p0_request(p0, ["b", "c", "b"])
        assert [item is not None for item in items] == [True, False, False]
        rendered = {
            "type": "multimodal",
            "mm_kwargs": {"image": items},
            "mm_hashes": {"image": ["b", "c", "b"]},
        }
        reject_too_long(p0, rendered)
        assert p0.is_cached(["b", "c"]) == [False, True]
    finally:
        p0.close()


def mirrored_after(reject: Callable[[Any], None]) -> None:
    """Requests of "c" then "a" through P0 and P1, ``reject(p0)`` (a request of "c" that P1
    never gets), then requests of "b" (evicting the least recent item), "c" and "a": P1
    misses unless P0 evicted what P1 did."""
    size = MultiModalCache.get_item_size(TRUTH["a"])
    config = vllm_config("lru", 2 * size + size // 2)  # room for two items
    p0, p1 = processor_cache_from_config(config), engine_receiver_cache_from_config(config)

    def request(hashes: list[str]) -> None:
        items = vllm_p0_request(p0, hashes)
        p1.get_and_update_features([feature(d, h) for d, h in zip(items, hashes, strict=True)])

    try:
        request(["c"])
        request(["a"])
        reject(p0)
        request(["b"])  # evicts the least recent item
        request(["c"])
        request(["a"])
        assert p0._sender.keys() == p1._receiver.keys()
    finally:
        p0.close()


def test_an_lru_request_vllm_rejects_after_its_render_moves_no_recency_p1_does_not() -> None:
    # A rejected request never reaches P1, but its lookup's touch of a cached item made the
    # item most recent at P0: the next eviction took another item on each side, and a later
    # request of the item P1 evicted (cached at P0, so sent without its data) missed at P1.
    def too_long(p0: Any) -> None:
        with rendering():
            items = vllm_p0_request(p0, ["c"])
        rendered = {
            "type": "multimodal",
            "mm_kwargs": {"image": items},
            "mm_hashes": {"image": ["c"]},
        }
        reject_too_long(p0, rendered)

    mirrored_after(too_long)


def test_an_lru_render_that_fails_after_its_request_moves_no_recency_p1_does_not() -> None:
    def render_then_fail(p0: Any) -> None:
        vllm_p0_request(p0, ["c"])
        raise AssertionError("Failed to apply prompt replacement for mm_items['image'][0]")

    def replacement_fails(p0: Any) -> None:
        with pytest.raises(AssertionError, match="prompt replacement"), rendering():
            render_then_fail(p0)

    mirrored_after(replacement_fails)


def test_an_lru_request_that_fails_part_way_moves_no_recency_p1_does_not() -> None:
    def fails_part_way(p0: Any) -> None:
        assert p0.is_cached(["c", "x"]) == [True, False]
        p0.touch_sender_cache_item("c")
        p0.touch_sender_cache_item("x")
        p0.get_and_update_item(None, "c")
        with pytest.raises(MultiModalCacheMissError):
            p0.get_and_update_item(None, "x")  # vLLM's processor failed to give its data
        p0.release_sender_touches()

    mirrored_after(fails_part_way)


def test_an_lru_request_rejected_while_another_thread_found_its_item_cached_fails_neither() -> None:
    # A request vLLM rejects after its render forgets the items it stored (P1 never gets
    # them), but that forgetting bypassed the invalidations' rule: it landed inside another
    # renderer thread's request that had found the item cached, whose update of it (no data:
    # a hit) then raised MultiModalCacheMissError at P0, failing that request for good
    # instead of a miss at P1 that one retry recovers.
    config = vllm_config("lru", 4 * MiB)
    p0, p1 = processor_cache_from_config(config), engine_receiver_cache_from_config(config)
    other = Actor()
    try:
        with rendering():
            items = vllm_p0_request(p0, ["a"])  # stored at P0
        assert other(p0.is_cached, ["a"]) == [True]  # the other thread's request finds it
        other(p0.touch_sender_cache_item, "a")
        rendered = {
            "type": "multimodal",
            "mm_kwargs": {"image": items},
            "mm_hashes": {"image": ["a"]},
        }
        reject_too_long(p0, rendered)  # never reaches P1
        sent, _ = other(p0.get_and_update_item, None, "a")
        other(p0.release_sender_touches)
        assert sent is None
        assert not p0.is_cached_item("a"), "the rejected request's item outlived the request"
        with pytest.raises(MultiModalCacheMissError) as miss:  # P1 never got "a"
            p1.get_and_update_features([feature(sent, "a")])
        for h in miss.value.mm_hashes:
            p0.invalidate(h)
        [retried] = vllm_p0_request(p0, ["a"])
        [resolved] = p1.get_and_update_features([feature(retried, "a")])
        assert same_item(TRUTH["a"], resolved.data)
    finally:
        other.close()
        p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
@pytest.mark.parametrize("bad", [["a"], {"a": 1}], ids=["list", "dict"])
def test_an_invalidation_of_no_hash_is_a_type_error_naming_it_while_a_request_looks_up(
    mode: str, bad: Any
) -> None:
    # With another thread's request between its lookup and its release, invalidate(["a"])
    # (a list where one hash goes) was "unhashable type: 'list'", from the check of whether
    # that request holds the invalidation back; with none, the sender's error naming
    # mm_hash. The error depended on what other threads were doing.
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        vllm_p0_request(p0, ["a"])
        assert look_up_in_another_thread(p0, ["a"]) == [True]
        with pytest.raises(TypeError, match=r"^invalidate\(mm_hash\): mm_hash must be a str"):
            p0.invalidate(bad)
        assert p0.is_cached_item("a")
    finally:
        p0.close()
