"""``mmcache.vllm`` in one process: installing, items, handles, the request bracket,
errors, clearing and the small-``/dev/shm`` fallback, all through vLLM's own factories."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from vllm.multimodal import cache as vllm_cache
from vllm.multimodal.cache import (
    MultiModalCacheMissError,
    engine_receiver_cache_from_config,
    processor_cache_from_config,
    worker_receiver_cache_from_config,
)
from vllm.multimodal.cache.base import MultiModalCache
from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache
from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache, ShmObjectStoreSenderCache
from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem
from vllm.platforms import current_platform
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.worker import worker_base

import mmcache.vllm as mv
from mmcache import ReferencesSaturatedError, ShmHandle, pinning
from mmcache.vllm import publish
from vllm_helpers import (
    MiB,
    feature,
    items_travel_with_their_data,
    kwargs_item,
    mmcache_warnings,
    outstanding,
    same_item,
    vllm_config,
)

LOCK = object()  # vLLM's worker factory insists on a lock; mmcache ignores it
Pair = tuple[Any, Any]  # P0's cache and a worker's


def mm_hash(i: int) -> str:
    return f"image-{i}"


# -- installing --------------------------------------------------------------------------------


def test_install_makes_every_factory_build_mmcache_and_is_idempotent() -> None:
    mv.install()
    mv.install()
    for name, cls in mv.REPLACEMENTS.items():
        assert getattr(vllm_cache, name) is cls
    assert issubclass(mv.MmcacheLruSenderCache, LruKeyReplicatedSenderCache)
    assert issubclass(mv.MmcacheLruReceiverCache, LruKeyReplicatedReceiverCache)
    assert issubclass(mv.MmcacheShmSenderCache, ShmObjectStoreSenderCache)
    assert issubclass(mv.MmcacheShmReceiverCache, ShmObjectStoreReceiverCache)

    lru = vllm_config("lru", MiB)
    assert type(processor_cache_from_config(lru)) is mv.MmcacheLruSenderCache
    assert type(engine_receiver_cache_from_config(lru)) is mv.MmcacheLruReceiverCache
    only = vllm_config("processor_only", MiB)
    assert type(processor_cache_from_config(only)) is mv.MmcacheProcessorOnlyCache
    shm = vllm_config("shm", 4 * MiB)
    sender = processor_cache_from_config(shm)
    try:
        assert type(sender) is mv.MmcacheShmSenderCache
        assert engine_receiver_cache_from_config(shm) is None
        receiver = worker_receiver_cache_from_config(shm, LOCK)
        assert type(receiver) is mv.MmcacheShmReceiverCache
        receiver._shm_cache.close()
    finally:
        sender.close()


# -- items and handles -------------------------------------------------------------------------


def test_items_convert_losslessly() -> None:
    item = kwargs_item(3)
    back = mv.item_from_mmcache(mv.item_to_mmcache(item))
    assert same_item(item, back)
    assert back["image_embeds"].field.slices == [slice(0, 2), slice(2, 4, 1)]
    assert back["grid_thw"].field.keep_on_cpu is True


def test_sizes_are_vllms_own() -> None:
    items = [kwargs_item(i, n_bytes=100 * (i + 1)) for i in range(3)]
    sender = processor_cache_from_config(vllm_config("lru", MiB))
    receiver = engine_receiver_cache_from_config(vllm_config("lru", MiB))
    for i, item in enumerate(items):
        data, _ = sender.get_and_update_item((item, []), mm_hash(i))
        receiver.get_and_update_item(data, mm_hash(i))
    expected = sum(MultiModalCache.get_item_size(item) for item in items)
    assert sender._sender.stats()["used_bytes"] == expected
    assert receiver._receiver.stats()["used_bytes"] == expected


@pytest.mark.parametrize("signature_bytes", [16, 20, 32, 1])
def test_handles_cross_vllms_ipc_with_signatures_of_any_length(signature_bytes: int) -> None:
    handle = ShmHandle(
        address=2**63 + 64,
        monotonic_id=2**40 + 1,
        signature=bytes(range(7, 7 + signature_bytes)),
    )
    item = mv.handle_as_item(handle)
    assert "address" in item
    decoded = MsgpackDecoder(MultiModalKwargsItem).decode(MsgpackEncoder().encode(item))
    assert mv.handle_from_item(decoded, "k") == handle
    assert mv.handle_from_item(kwargs_item(1), "k") is None


def _with(item: Any, key: str, data: Any) -> Any:
    elems = dict(item)
    elems[key] = MultiModalFieldElem(data=data, field=item["address"].field)
    return MultiModalKwargsItem(elems)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("address", True),
        ("address", -1),
        ("address", 2**64),
        ("monotonic_id", 1.0),
        ("signature", [[1]]),
        ("signature", [2**64]),
        ("signature", "00"),
        ("signature_nbytes", 17),
        ("signature_nbytes", 8),
    ],
)
def test_malformed_handle_items_are_value_errors(key: str, value: Any) -> None:
    good = mv.handle_as_item(ShmHandle(address=0, monotonic_id=1, signature=bytes(16)))
    with pytest.raises(ValueError, match="SHM handle signature") as info:
        mv.handle_from_item(_with(good, key, value), "k")
    assert isinstance(info.value, mv.InvalidShmHandleError)


# -- P0 and the request bracket ----------------------------------------------------------------


def vllm_p0_request(p0: Any, hashes: list[str], truth: dict[str, Any]) -> list[Any]:
    """What vLLM's processor does with P0's cache for one request (``_merge_mm_kwargs``)."""
    cached = p0.is_cached(hashes)
    try:
        for h in hashes:
            p0.touch_sender_cache_item(h)
        return [
            p0.get_and_update_item(None if c else (truth[h], [f"pu-{h}"]), h)[0]
            for h, c in zip(hashes, cached, strict=True)
        ]
    finally:
        p0.release_sender_touches()


def test_lru_mode_stays_mirrored_with_requests_larger_than_the_cache() -> None:
    rng = random.Random(5)
    truth = {mm_hash(i): kwargs_item(i, n_bytes=rng.choice([1, 2, 3, 5]) * 1000) for i in range(12)}
    config = vllm_config("lru", 10_000)
    p0, p1 = processor_cache_from_config(config), engine_receiver_cache_from_config(config)
    oversized = 0
    for _ in range(200):
        hashes = [rng.choice(list(truth)) for _ in range(rng.randint(1, 5))]
        oversized += sum(MultiModalCache.get_item_size(truth[h]) for h in set(hashes)) > 10_000
        features = [
            feature(d, h) for d, h in zip(vllm_p0_request(p0, hashes, truth), hashes, strict=True)
        ]
        p1.get_and_update_features(features)
        assert all(same_item(truth[h], f.data) for f, h in zip(features, hashes, strict=True))
        assert p0._sender.keys() == p1._receiver.keys()
    assert oversized > 20


def test_a_request_that_fails_part_way_gives_its_handles_back() -> None:
    # A ring that holds one object: the first item's object must be reclaimable after the
    # failed request, or the next request's item is served uncached.
    item = kwargs_item(1, n_bytes=600_000)
    p0 = processor_cache_from_config(vllm_config("shm", 1_000_000, max_object_mb=1))
    try:
        p0.touch_sender_cache_item("a")
        p0.touch_sender_cache_item("b")
        handle, _ = p0.get_and_update_item((item, []), "a")
        assert "address" in handle
        with pytest.raises(MultiModalCacheMissError) as info:
            p0.get_and_update_item(None, "b")  # not cached and no data
        assert info.value.mm_hashes == ["b"]
        p0.release_sender_touches()
        p0.invalidate("a")
        again, _ = p0.get_and_update_item((kwargs_item(2, n_bytes=600_000), []), "c")
        assert "address" in again, "the failed request's reference still pins the ring"
    finally:
        p0.close()


# -- P0 validates what clients send back -----------------------------------------------------


def test_validate_input_item_accepts_only_the_current_handle_of_the_key() -> None:
    p0 = processor_cache_from_config(vllm_config("shm", 4 * MiB))
    try:
        handle, _ = p0.get_and_update_item((kwargs_item(1), []), "a")
        before = p0.make_stats()
        p0.validate_input_item(handle, "a")
        p0.validate_input_item(kwargs_item(2), "a")  # plain data: nothing to check
        assert p0.make_stats() == before, "validation counted a lookup"
        with pytest.raises(ValueError, match="SHM handle signature"):
            p0.validate_input_item(handle, "b")
        p0.clear_cache()
        with pytest.raises(ValueError, match="SHM handle signature"):
            p0.validate_input_item(handle, "a")
    finally:
        p0.close()


# -- clear_cache and workers -----------------------------------------------------------------


@pytest.fixture
def shm_pair() -> Iterator[Pair]:
    """P0's cache and one worker's, on a 2 MiB ring of 1 MiB objects at most."""
    config = vllm_config("shm", 2 * MiB, max_object_mb=1)
    p0 = processor_cache_from_config(config)
    worker = worker_receiver_cache_from_config(config, LOCK)
    yield p0, worker
    worker._shm_cache.close()
    p0.close()


@contextmanager
def p0_and_receiver(mode: str) -> Iterator[tuple[Any, Any]]:
    """P0's cache of ``mode`` (4 MiB) and the receiver vLLM pairs with it (the engine core's
    in lru mode, a worker's in shm mode, none otherwise), closed after."""
    config = vllm_config(mode, 4 * MiB)
    p0 = processor_cache_from_config(config)
    p1 = None
    if mode == "lru":
        p1 = engine_receiver_cache_from_config(config)
    elif mode == "shm":
        p1 = worker_receiver_cache_from_config(config, LOCK)
    try:
        yield p0, p1
    finally:
        if mode == "shm":
            p1._shm_cache.close()
        p0.close()


def test_a_clear_while_requests_are_in_flight_never_hands_out_other_data(
    shm_pair: Pair,
) -> None:
    p0, worker = shm_pair
    in_flight = [feature(p0.get_and_update_item((kwargs_item(0), []), "k")[0], "k")]
    p0.clear_cache()  # vLLM: sleep, KV-cache release, reset
    assert not p0.is_cached_item("k") and p0.make_stats().total == 0
    for i in range(1, 6):  # other data under the same key fills the ring
        p0.get_and_update_item((kwargs_item(i, n_bytes=400_000), []), "k")
        p0.invalidate("k")
    worker.get_and_update_features(in_flight)
    assert same_item(kwargs_item(0), in_flight[0].data)


def test_a_stale_handle_is_a_miss_that_is_also_a_value_error(shm_pair: Pair) -> None:
    p0, worker = shm_pair
    handle, _ = p0.get_and_update_item((kwargs_item(0), []), "old")
    # mmcache's plain clear drops the references of handles in flight, so the ring
    # reuses their space: the worker has never read this one.
    p0.ring.clear_cache()
    for i in range(1, 8):
        p0.get_and_update_item((kwargs_item(i, n_bytes=400_000), []), f"new-{i}")
    with pytest.raises(MultiModalCacheMissError) as info:
        worker.get_and_update_features([feature(handle, "old")])
    assert isinstance(info.value, ValueError)
    assert info.value.mm_hashes == ["old"]
    assert "modified or is invalid" in str(info.value)


def churn(p0: Any, worker: Any) -> None:
    """Enough other objects, each read by ``worker``, to wrap ``shm_pair``'s ring several
    times; each is larger than what a worker keeps for replays (a quarter of the ring), so
    none displaces an object the worker keeps."""
    for i in range(1, 16):
        other, _ = p0.get_and_update_item((kwargs_item(i, n_bytes=600_000), []), f"o{i}")
        assert "address" in other
        worker.get_and_update_item(other, f"o{i}")
        p0.invalidate(f"o{i}")


def test_a_replayed_handle_reads_its_own_data_after_the_ring_moved_on(shm_pair: Pair) -> None:
    # vLLM resends a preempted request with the same handles, after the first read gave
    # their references back.
    p0, worker = shm_pair
    handle, _ = p0.get_and_update_item((kwargs_item(0), []), "a")
    assert same_item(kwargs_item(0), worker.get_and_update_item(handle, "a"))
    p0.invalidate("a")
    churn(p0, worker)
    assert same_item(kwargs_item(0), worker.get_and_update_item(handle, "a"))
    worker.clear_cache()  # the worker lets its recent objects go: now the ring may too
    churn(p0, worker)
    with pytest.raises(MultiModalCacheMissError):
        worker.get_and_update_item(handle, "a")


def test_a_request_preempted_again_and_again_reads_its_own_data_every_time(
    shm_pair: Pair,
) -> None:
    # Each replay reads a private copy (the worker owes the handle nothing any more); the
    # lease the first read took must keep the object in the ring through all of them.
    p0, worker = shm_pair
    handle, _ = p0.get_and_update_item((kwargs_item(0), []), "a")
    features = [feature(handle, "a")]
    worker.get_and_update_features(features)
    assert same_item(kwargs_item(0), features[0].data)
    p0.invalidate("a")
    for replay in range(3):
        churn(p0, worker)
        features = [feature(handle, "a")]
        worker.get_and_update_features(features)  # vLLM 0.33: a miss here fails the step
        assert same_item(kwargs_item(0), features[0].data), f"replay {replay}"


def test_a_saturated_hit_is_served_as_vllms_own_item(shm_pair: Pair) -> None:
    # A worker that stopped reading holds the most unread references to "hot" the ring can
    # count; P0 believes "hot" cached (None), so it gets the ring's copy, uncached.
    p0, worker = shm_pair
    first, _ = p0.get_and_update_item((kwargs_item(0), ["pu"]), "hot")
    store = p0.ring._store
    while True:
        try:
            store.issue("hot")
        except ReferencesSaturatedError:
            break
    served, updates = p0.get_and_update_item(None, "hot")
    assert type(served) is MultiModalKwargsItem and updates == ["pu"]
    assert same_item(kwargs_item(0), served)
    assert p0.ring.stats()["uncached_saturated"] == 1
    # What the worker receives for it is that item, passed through as plain data.
    assert same_item(kwargs_item(0), worker.get_and_update_item(served, "hot"))
    assert same_item(kwargs_item(0), worker.get_and_update_item(first, "hot"))


# -- small /dev/shm --------------------------------------------------------------------------


def test_a_ring_too_big_for_dev_shm_falls_back_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stat = os.statvfs("/dev/shm")
    too_big = 2 * stat.f_bavail * stat.f_frsize + (1 << 30)
    config = vllm_config("shm", too_big)
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        p0 = processor_cache_from_config(config)
    warnings = mmcache_warnings(caplog.records)
    assert len(warnings) == 1 and "processor-only" in warnings[0]
    assert type(p0) is mv.MmcacheShmSenderCache and p0.ring is None
    assert os.environ[mv.READER_HANDLE_ENV] == ""
    worker = worker_receiver_cache_from_config(config, LOCK)
    item = kwargs_item(1)
    sent, _ = p0.get_and_update_item((item, []), "a")
    assert sent is item  # data travels by IPC
    assert p0.get_and_update_item(None, "a")[0] is item  # a processor-only hit
    features = [feature(sent, "a"), feature(None, "b")]
    worker.get_and_update_features(features)
    assert features[0].data is item and features[1].data is None
    with pytest.raises(ValueError, match="SHM handle signature"):
        p0.validate_input_item(
            mv.handle_as_item(ShmHandle(address=0, monotonic_id=0, signature=bytes(16))), "a"
        )
    p0.close()


def test_a_max_object_size_of_0_falls_back_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM takes --mm-shm-cache-max-object-size-mb 0 (its own ring then serves every item
    # uncached); a ring that lets no item in is not made: items travel with their data.
    config = vllm_config("shm", 4 * MiB, max_object_mb=0)
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        p0 = processor_cache_from_config(config)
    warnings = mmcache_warnings(caplog.records)
    assert len(warnings) == 1 and "--mm-shm-cache-max-object-size-mb" in warnings[0]
    assert type(p0) is mv.MmcacheShmSenderCache and p0.ring is None
    assert os.environ[mv.READER_HANDLE_ENV] == ""
    items_travel_with_their_data(p0, worker_receiver_cache_from_config(config, LOCK))
    p0.close()


def test_a_worker_given_no_shared_lock_reads_the_ring() -> None:
    # vLLM's Ray executor gives its workers no shared_worker_lock (only vLLM's own ring needs
    # one), and vLLM's factory refused shm mode without it ("Missing `shared_worker_lock`"),
    # so a worker under Ray stopped the engine at start-up.
    config = vllm_config("shm", 4 * MiB)
    p0 = processor_cache_from_config(config)
    try:
        # Where vLLM's worker looks the factory up (it imported the name).
        worker = worker_base.worker_receiver_cache_from_config(config, None)
        try:
            assert type(worker) is mv.MmcacheShmReceiverCache
            item = kwargs_item(1)
            p0.touch_sender_cache_item("a")
            sent, _ = p0.get_and_update_item((item, []), "a")
            p0.release_sender_touches()
            features = [feature(sent, "a")]
            worker.get_and_update_features(features)
            assert same_item(item, features[0].data)
        finally:
            worker._shm_cache.close()
    finally:
        p0.close()
    # The other modes are vLLM's: no worker cache.
    assert worker_base.worker_receiver_cache_from_config(vllm_config("lru", MiB), None) is None


def test_workers_refuse_to_start_when_no_ring_was_published() -> None:
    with pytest.raises(RuntimeError, match=mv.READER_HANDLE_ENV):
        worker_receiver_cache_from_config(vllm_config("shm", MiB), LOCK)


def _malformed(published: str) -> list[str]:
    """``published`` (a handle's JSON) made unusable in each way a stale or hand-edited
    environment can: not JSON, not an object, a field missing, one too many, a secret that
    is not hex, a size out of range."""
    fields = json.loads(published)
    return [
        "{oops",
        "[1, 2]",
        json.dumps({k: v for k, v in fields.items() if k != "secret"}),
        json.dumps({**fields, "extra": 1}),
        json.dumps({**fields, "secret": "zz" + fields["secret"]}),
        json.dumps({**fields, "capacity": -1}),
    ]


def test_a_malformed_published_handle_is_an_error_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker (or an API server) that inherited a stale or hand-edited environment: the
    # error says which variable is wrong, never the secret it holds.
    config = vllm_config("shm", 4 * MiB)
    p0 = processor_cache_from_config(config)
    try:
        published = os.environ[mv.READER_HANDLE_ENV]
        secret = json.loads(published)["secret"]
        for value in _malformed(published):
            monkeypatch.setenv(mv.READER_HANDLE_ENV, value)
            with pytest.raises(ValueError, match=mv.READER_HANDLE_ENV) as caught:
                worker_receiver_cache_from_config(config, LOCK)
            assert secret not in str(caught.value)
        writer = publish.publish_writer(p0.ring.writer_handle())
        for value in _malformed(writer):
            monkeypatch.setenv(mv.WRITER_HANDLE_ENV, value)
            with pytest.raises(ValueError, match=mv.WRITER_HANDLE_ENV):
                publish.published_writer_handle()
    finally:
        p0.close()


def test_workers_resolve_into_unpinned_memory_where_pinning_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM says "pin" (a CUDA platform) but this process cannot: CUDA torch, no driver.
    if pinning.pinning_unavailable() is None:
        pytest.skip("this host can pin memory")
    monkeypatch.setattr(current_platform, "is_pin_memory_available", lambda: True)
    is_pin_memory_available.cache_clear()
    assert is_pin_memory_available()
    config = vllm_config("shm", 2 * MiB, max_object_mb=1)
    p0 = processor_cache_from_config(config)
    try:
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            worker = worker_receiver_cache_from_config(config, LOCK)
            try:
                for i in range(3):
                    handle, _ = p0.get_and_update_item((kwargs_item(i), []), mm_hash(i))
                    features = [feature(handle, mm_hash(i))]
                    worker.get_and_update_features(features)
                    assert same_item(kwargs_item(i), features[0].data)
            finally:
                worker._shm_cache.close()
        warnings = [
            r
            for r in caplog.records
            if r.name.startswith("mmcache") and r.levelno >= logging.WARNING
        ]
        assert len(warnings) == 1 and "unpinned" in warnings[0].getMessage()
    finally:
        is_pin_memory_available.cache_clear()
        p0.close()


def test_decoded_tensors_are_ordinary_writable_tensors_on_cpu(shm_pair: Pair) -> None:
    p0, worker = shm_pair
    handle, _ = p0.get_and_update_item((kwargs_item(1), []), "a")
    out = worker.get_and_update_item(handle, "a")
    pixels = out["pixel_values"].data
    pixels += 1  # vLLM may modify what it receives: it owns it
    assert torch.equal(pixels, kwargs_item(1)["pixel_values"].data + 1)


def new_items_by_modality(
    p0: Any, p1: Any, truth: dict[str, Any], by_modality: dict[str, list[str]], prompt: list[str]
) -> None:
    """One request of new items as vLLM runs it: P0 updates them modality by modality, P1
    resolves them in ``prompt`` order."""
    for hashes in by_modality.values():
        for h in hashes:
            p0.touch_sender_cache_item(h)
    sent = {
        h: p0.get_and_update_item((truth[h], []), h)[0] for hs in by_modality.values() for h in hs
    }
    p0.release_sender_touches()
    p1.get_and_update_features([feature(sent[h], h, offset) for offset, h in enumerate(prompt)])


def test_lru_mode_stays_mirrored_when_p1_resolves_in_prompt_order() -> None:
    # vLLM's P0 updates a request's items modality by modality (`_merge_mm_kwargs` walks
    # mm_hashes, a dict by modality); its P1 resolves the request's features in prompt order
    # (`argsort_mm_positions`).  A prompt image, video, image puts them in another order on
    # each side: the two LRUs must still end the request alike, or the next evictions differ.
    truth = {h: kwargs_item(i) for i, h in enumerate(["i0", "i1", "v0"])}
    size = MultiModalCache.get_item_size(truth["i0"])
    truth["big"] = kwargs_item(9, n_bytes=4096 + size)  # needs the room of two of them
    config = vllm_config("lru", 3 * size + 64)
    p0, p1 = processor_cache_from_config(config), engine_receiver_cache_from_config(config)
    by_modality = {"image": ["i0", "i1"], "video": ["v0"]}
    assert p0.is_cached(by_modality["image"]) == [False, False]
    assert p0.is_cached(by_modality["video"]) == [False]
    new_items_by_modality(p0, p1, truth, by_modality, ["i0", "v0", "i1"])
    assert p0._sender.keys() == p1._receiver.keys()
    # The next request evicts the two least recent items: the same two on both sides.
    sent_big = vllm_p0_request(p0, ["big"], truth)
    p1.get_and_update_features([feature(sent_big[0], "big")])
    assert p0._sender.keys() == p1._receiver.keys()
    request = [feature(None, h) for h in ["big"] + [h for h in truth if p0.is_cached_item(h)]]
    p1.get_and_update_features(request)  # what P0 holds, P1 holds


def test_a_workers_batched_update_checks_lengths_and_reads_every_handle(shm_pair: Pair) -> None:
    # The worker's get_and_update (vLLM's base class stopped at the first miss and asserted
    # the lengths): a stale handle first must not leave the next one unread, pinning it.
    p0, worker = shm_pair
    stale, _ = p0.get_and_update_item((kwargs_item(0), []), "old")
    p0.ring.clear_cache()  # drops the reference of the handle in flight
    churn(p0, worker)  # the ring reuses its space
    before = outstanding(p0)
    fresh, _ = p0.get_and_update_item((kwargs_item(9), []), "fresh")
    assert outstanding(p0) == before + 1
    with pytest.raises(ValueError, match="mm_hashes"):
        worker.get_and_update([fresh], [])
    with pytest.raises(MultiModalCacheMissError) as info:
        worker.get_and_update([stale, fresh, None, stale], ["old", "fresh", "x", "old"])
    assert info.value.mm_hashes == ["old", "old"]
    assert outstanding(p0) == before, "the handle after the stale one was left unread"


@pytest.mark.xfail(
    raises=MultiModalCacheMissError,
    strict=True,
    reason="a request's new items are stored in the order each side applies them (unfixed)",
)
def test_lru_mode_stays_mirrored_when_a_requests_new_items_evict_each_other() -> None:
    # Two new items of one request that do not fit together: each side keeps the one it
    # inserted last (a new item is no older entry, and nothing protects it), and P0 inserts
    # them modality by modality, P1 in prompt order.  P0 then kept the video, P1 the image,
    # and the next request of the video, a hit at P0, missed at P1.
    truth = {"v0": kwargs_item(1), "i0": kwargs_item(2)}
    size = MultiModalCache.get_item_size(truth["v0"])
    config = vllm_config("lru", size + size // 2)
    p0, p1 = processor_cache_from_config(config), engine_receiver_cache_from_config(config)
    by_modality = {"image": ["i0"], "video": ["v0"]}
    for hashes in by_modality.values():
        assert p0.is_cached(hashes) == [False]
    new_items_by_modality(p0, p1, truth, by_modality, ["v0", "i0"])
    for h in truth:  # what P0 holds, P1 holds
        sent_again = vllm_p0_request(p0, [h], truth)
        p1.get_and_update_features([feature(sent_again[0], h)])
    assert p0._sender.keys() == p1._receiver.keys()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_one_feature_or_item_where_vllm_passes_a_list_is_a_type_error(mode: str) -> None:
    # get_and_update_features(feature), one MultiModalFeatureSpec for the request's list,
    # was "'MultiModalFeatureSpec' object is not iterable" from deep inside; one item for
    # get_and_update's list was "5 items but 1 mm_hashes" (its field names taken for items).
    item = kwargs_item(1)
    with p0_and_receiver(mode) as (p0, p1):
        with pytest.raises(TypeError, match=r"^get_and_update takes a list of items, not one"):
            p0.get_and_update(item, ["h"])
        assert p0.is_cached(["h"]) == [False]
        [(data, _)] = p0.get_and_update([(item, [])], ["h"])
        one = feature(data if data is not None else item, "h")
        with pytest.raises(
            TypeError,
            match=r"^get_and_update_features takes a list of features, not one "
            r"MultiModalFeatureSpec: get_and_update_features\(\[feature\]\)",
        ):
            p1.get_and_update_features(one)
        with pytest.raises(
            TypeError, match=r"^get_and_update takes a list of items, not one MultiModalKwargsItem"
        ):
            p1.get_and_update(one.data, ["h"])
        [resolved] = p1.get_and_update_features([one])  # nothing was consumed
        assert same_item(item, resolved.data)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_an_item_without_its_prompt_updates_is_a_type_error_saying_what_p0_takes(
    mode: str,
) -> None:
    # In shm mode, an item passed without its prompt updates (or an int) was unpacked by the
    # adapter's conversion: "too many values to unpack (expected 2)", a ValueError, or
    # "cannot unpack non-iterable int object"; a pair holding no item was "'int' object has
    # no attribute 'items'" (or 'field', for a mapping of no elements), AttributeErrors,
    # where the other modes say what P0 takes.
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    item = kwargs_item(1)
    try:
        for bad in (item, 5, (item,)):
            what = type(bad).__name__
            takes = rf"^P0 input for new must be \(item, prompt_updates\) or None, not {what}$"
            with pytest.raises(TypeError, match=takes):
                p0.get_and_update_item(bad, "new")
            with pytest.raises(TypeError, match=takes):
                p0.get_and_update([bad], ["new"])
        mapping = r"^an item must be a mapping of field names, not int$"
        with pytest.raises(TypeError, match=mapping):
            p0.get_and_update_item((5, []), "new")
        with pytest.raises(TypeError, match=mapping):
            p0.get_and_update([(5, [])], ["new"])
        if mode == "shm":  # the ring holds vLLM's items converted, element by element
            elements = r"^field 'a': int, not the MultiModalFieldElem a vLLM item"
            with pytest.raises(TypeError, match=elements):
                p0.get_and_update_item(({"a": 1}, []), "new")
        assert p0.is_cached(["new"]) == [False]
    finally:
        p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_data_that_is_no_item_is_a_type_error_saying_what_the_receiver_takes(mode: str) -> None:
    # A worker's data that is no mapping (an int, a list) was "argument of type 'int' is not
    # iterable" in shm mode: the adapter looked for a handle's "address" key in it first.
    takes = (
        r"^ReceiverCache takes an item \(a mapping of field names\) or None"
        if mode == "lru"
        else r"^ShmReceiverCache takes an item \(a mapping of field names\), a handle or None"
    )
    with p0_and_receiver(mode) as (_, p1):
        for bad in (5, [1, 2]):
            message = rf"{takes} as the data of h, not {type(bad).__name__}$"
            with pytest.raises(TypeError, match=message):
                p1.get_and_update_item(bad, "h")
            with pytest.raises(TypeError, match=message):
                p1.get_and_update_features([feature(bad, "h")])


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_receivers_mm_hash_that_is_no_str_is_a_type_error_naming_it(mode: str) -> None:
    # The shm worker's adapter returned None for get_and_update_item(None, 5) and took
    # touch_receiver_cache_item(5), where the lru one (and mmcache's receivers) refuse them.
    with p0_and_receiver(mode) as (_, p1):
        for bad in (5, b"h"):
            not_str = rf"mm_hash must be a str, not {type(bad).__name__}$"
            with pytest.raises(
                TypeError, match=rf"^get_and_update_item\(item, mm_hash\): {not_str}"
            ):
                p1.get_and_update_item(None, bad)
            with pytest.raises(
                TypeError, match=rf"^touch_receiver_cache_item\(mm_hash\): {not_str}"
            ):
                p1.touch_receiver_cache_item(bad)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_a_requests_items_and_hashes_from_generators_are_updated(mode: str) -> None:
    # P0's get_and_update((item, [])...) from a generator converted the items (reading it),
    # then zipped the outputs with the spent generator: "zip() argument 2 is shorter than
    # argument 1"; the workers' said "object of type 'generator' has no len()".
    item = kwargs_item(1)
    with p0_and_receiver(mode) as (p0, p1):
        [(data, _)] = p0.get_and_update(((item, []) for _ in "h"), (h for h in ["h"]))
        assert p0.is_cached(["h"]) == [True]
        if p1 is not None:
            [resolved] = p1.get_and_update((d for d in [data or item]), (h for h in ["h"]))
            assert same_item(item, resolved)


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_list_of_data_for_features_is_a_type_error_naming_the_call(mode: str) -> None:
    # get_and_update_features([data]), the request's items where its features go, was
    # "'MultiModalKwargsItem' object has no attribute 'mm_hash'" (lru: from the settling
    # after the core's TypeError, which it replaced) or "... no attribute 'data'" (shm), an
    # AttributeError, where mmcache's own receivers name the call and what to pass.
    item = kwargs_item(1)
    with p0_and_receiver(mode) as (p0, p1):
        [(data, _)] = p0.get_and_update([(item, [])], ["h"])
        one = feature(data if data is not None else item, "h")
        with pytest.raises(
            TypeError,
            match=r"^get_and_update_features takes a list of features \(with data, mm_hash "
            r"and identifier\), not of MultiModalKwargsItem: pass data to get_and_update$",
        ):
            p1.get_and_update_features([one, item])
        [resolved] = p1.get_and_update_features([one])  # nothing was consumed
        assert same_item(item, resolved.data)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_a_lookups_hashes_are_checked_as_the_senders_check_them(mode: str) -> None:
    # The adapter's is_cached records what a lookup finds (for the invalidations it holds
    # back) before the sender checks the hashes: [["a"]] was "unhashable type: 'list'",
    # None "'NoneType' object is not iterable", where mmcache's senders name the call and
    # the argument; and hashes from a generator were read by that record, leaving the
    # sender an empty one: is_cached answered [] for two hashes.
    p0 = processor_cache_from_config(vllm_config(mode, 4 * MiB))
    try:
        p0.get_and_update_item((kwargs_item(1), []), "a")
        assert p0.is_cached(h for h in ["a", "b"]) == [True, False]
        with pytest.raises(
            TypeError, match=r"^is_cached\(mm_hashes\): mm_hashes\[1\] must be a str, not list$"
        ):
            p0.is_cached(["a", ["b"]])
        for bad in (None, 5):
            with pytest.raises(
                TypeError,
                match=rf"^is_cached takes a list of mm_hashes, not one {type(bad).__name__}",
            ):
                p0.is_cached(bad)
        assert p0.is_cached(["a"]) == [True]
    finally:
        p0.close()
