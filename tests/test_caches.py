"""The processor-only and mirrored LRU caches: consistency, mirroring, eviction, drift."""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace as Namespace
from typing import Any

import numpy as np
import pytest
import torch

from item_checks import same_item
from mmcache import (
    CacheInfo,
    CacheMissError,
    Feature,
    LRUCache,
    ProcessorOnlyCache,
    ReaderHandle,
    ReceiverCache,
    SenderCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    make_caches,
)
from mmcache.caches import BaseReceiverCache, BaseSenderCache

KiB = 1024
GiB = 1 << 30


def gb(n_bytes: float) -> float:
    """``capacity_gb`` for a capacity of ``n_bytes``."""
    return n_bytes / GiB


def make_item(key: str, n_bytes: int = KiB) -> dict[str, Any]:
    """A distinct item whose tensors weigh ``n_bytes``."""
    seed = int.from_bytes(key.encode(), "little") % (2**31)
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randint(0, 255, (n_bytes - 8,), dtype=torch.uint8, generator=g),
        "grid": torch.tensor([seed], dtype=torch.int64),
    }


def updates_of(key: str) -> list[str]:
    return [f"updates of {key}"]


def run_request(
    p0: BaseSenderCache | None,
    p1: BaseReceiverCache | None,
    hashes: Sequence[str],
    truth: dict[str, dict[str, Any]],
    extra_lookups: int = 0,
) -> tuple[list[Any], list[Any]]:
    """One request through P0 and P1 as an engine drives them; (P1's data, prompt updates)."""
    if p0 is None:
        data, updates = [truth[h] for h in hashes], [updates_of(h) for h in hashes]
    else:
        for _ in range(extra_lookups):
            p0.is_cached(hashes)
        cached = p0.is_cached(hashes)
        inputs = [
            None if c else (truth[h], updates_of(h)) for h, c in zip(hashes, cached, strict=True)
        ]
        for h in hashes:
            p0.touch_sender_cache_item(h)
        outputs = p0.get_and_update(inputs, hashes)
        data, updates = [d for d, _ in outputs], [u for _, u in outputs]
    features = [
        Feature(d, mm_hash=h, identifier=h, modality="image")
        for d, h in zip(data, hashes, strict=True)
    ]
    if p1 is not None:
        p1.get_and_update_features(features)
    return [f.data for f in features], updates


# -- construction ----------------------------------------------------------------------------


def test_make_caches_builds_each_mode() -> None:
    assert make_caches("none", capacity_gb=1) == (None, None)
    p0, p1 = make_caches("processor_only", capacity_gb=1)
    assert isinstance(p0, ProcessorOnlyCache) and p1 is None
    p0, p1 = make_caches("lru", capacity_gb=1)
    assert isinstance(p0, SenderCache) and isinstance(p1, ReceiverCache)
    p0, downstream = make_caches("shm", capacity_gb=gb(4 << 20), n_readers=2, max_object_size_mb=1)
    with p0:
        assert isinstance(p0, ShmSenderCache) and isinstance(downstream, ReaderHandle)
        assert downstream.n_readers == 2 and downstream.name == p0.name
    with pytest.raises(ValueError, match="unknown cache mode"):
        make_caches("redis", capacity_gb=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "option", "value"),
    [
        ("lru", "max_writers", 2),
        ("processor_only", "max_writers", 2),
        ("none", "max_writers", 2),
        ("lru", "name", "mmcache-mine"),
        ("processor_only", "name", "mmcache-mine"),
        ("processor_only", "prompt_updates_codec", "pickle"),
        ("shm", "getsizeof", lambda item: 1),
        ("none", "getsizeof", lambda item: 1),
    ],
)
def test_an_option_the_mode_does_not_have_is_a_value_error_naming_both(
    mode: str, option: str, value: object
) -> None:
    # Was silently ignored: make_caches("lru", max_writers=2) read as frontends sharing a
    # cache, and an lru pair has no ring to share.
    with pytest.raises(ValueError, match=rf"^{option}=.* applies to mode .*, not {mode}\b"):
        make_caches(mode, capacity_gb=0.01, **{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["none", "processor_only", "lru", "shm"])
def test_defaults_passed_explicitly_and_specs_options_suit_every_mode(mode: str) -> None:
    # Engine code passes its worker count, an object size (SPEC's factory signature has both)
    # and the defaults whatever the mode it runs.
    p0, downstream = make_caches(
        mode,  # type: ignore[arg-type]
        capacity_gb=0.01,
        n_readers=2,
        max_object_size_mb=1,
        name=None,
        max_writers=1,
        prompt_updates_codec="plain",
    )
    if p0 is not None:
        p0.close()
    if isinstance(downstream, ReaderHandle):
        assert downstream.n_readers == 2


@pytest.mark.parametrize("mode", ["none", "processor_only", "lru", "shm"])
@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("n_readers", 0, ValueError),
        ("n_readers", -2, ValueError),
        ("n_readers", "2", TypeError),
        ("n_readers", 2.0, TypeError),
        ("max_object_size_mb", 0, ValueError),
        ("max_object_size_mb", -1, ValueError),
        ("max_object_size_mb", float("nan"), ValueError),
        ("max_object_size_mb", "128", TypeError),
        ("capacity_gb", -1, ValueError),
        ("capacity_gb", "4", TypeError),
    ],
)
def test_specs_options_are_checked_in_every_mode(
    mode: str, option: str, value: object, error: type[Exception]
) -> None:
    # Engine code passes them whatever the mode it runs: a bad value was taken without a
    # word outside shm (and by mode none, capacity_gb too), to fail only once the engine
    # switched to shm.
    options: dict[str, Any] = {"capacity_gb": 0.01, option: value}
    with pytest.raises(error, match=rf"^{option} must "):
        make_caches(mode, **options)  # type: ignore[arg-type]


def test_capacity_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        SenderCache(-1)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_capacity_must_be_a_number(mode: str) -> None:
    # E.g. read from an environment variable and passed on unconverted.
    with pytest.raises(TypeError, match="capacity_gb must be a number of GiB, not str"):
        make_caches(mode, capacity_gb="4")  # type: ignore[arg-type]


def test_a_ring_of_zero_capacity_is_refused_naming_capacity_gb() -> None:
    # 0 is a valid capacity_gb for the LRU caches (they cache nothing); the ring's refusal
    # was the core's "capacity must be positive", naming no argument the user passed.
    with pytest.raises(ValueError, match="capacity_gb must be positive for a shared-memory ring"):
        make_caches("shm", capacity_gb=0)
    with pytest.raises(ValueError, match="capacity_gb must be positive"):
        ShmSenderCache(0.0)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_is_cached_refuses_one_hash_for_a_list(mode: str) -> None:
    # A str is a sequence of one-character hashes: its answer, a non-empty list, would read
    # as "cached" in `if p0.is_cached(h):`.
    p0, _ = make_caches(mode, capacity_gb=gb(4 << 20))  # type: ignore[arg-type]
    assert p0 is not None
    with p0:
        for one in ("a" * 64, b"a" * 64):
            with pytest.raises(TypeError, match="a list of mm_hashes"):
                p0.is_cached(one)  # type: ignore[arg-type]
        assert p0.is_cached(["a" * 64]) == [False]


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_is_cached_item_of_a_list_is_a_type_error_naming_mm_hash(mode: str) -> None:
    # is_cached([h]) carried over to is_cached_item([h]) was "unhashable type: 'list'" in
    # the LRU modes (shm named the call).
    p0, _ = make_caches(mode, capacity_gb=gb(4 << 20))  # type: ignore[arg-type]
    assert p0 is not None
    with p0:
        with pytest.raises(TypeError, match=r"^is_cached_item.*mm_hash.*\blist\b"):
            p0.is_cached_item(["a" * 64])  # type: ignore[arg-type]
        assert p0.is_cached_item("a" * 64) is False


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_p0_refuses_an_item_that_is_not_a_mapping(mode: str) -> None:
    # An array passed as the item itself: every mode refuses it at P0 (P1's ReceiverCache
    # and the ring would refuse it too, after P0 had counted it as cached).
    p0, _ = make_caches(mode, capacity_gb=gb(4 << 20))  # type: ignore[arg-type]
    assert p0 is not None
    with p0:
        with pytest.raises(TypeError, match="an item must be a mapping of field names, not"):
            p0.get_and_update_item((torch.zeros(4), []), "a")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="an item must be a mapping of field names, not"):
            p0.get_and_update([(make_item("b"), []), (torch.zeros(4), [])], ["b", "c"])  # type: ignore[list-item]
        assert p0.is_cached(["a", "c"]) == [False, False]
        if mode != "shm":  # nothing of the request applied (the ring keeps what it stored)
            assert not p0.is_cached_item("b")


def test_batch_lengths_must_match() -> None:
    for cache in (SenderCache(1), ReceiverCache(1), ProcessorOnlyCache(1)):
        with pytest.raises(ValueError, match="1 items but 2 mm_hashes"):
            cache.get_and_update([None], ["a", "b"])


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ShmSenderCache])
def test_a_request_with_a_malformed_input_changes_nothing(cache_type: type) -> None:
    """An input that is neither ``(item, prompt_updates)`` nor ``None`` is refused before any
    item of the request is applied: in ``lru`` mode an item put in P0's mirror by a request
    that never reaches P1 would be a drift; in ``shm`` mode nothing is left claimed, pinned
    or referenced."""
    with cache_type(gb(1 << 20)) as cache:
        cache.get_and_update_item((make_item("t"), updates_of("t")), "t")
        cache.touch_sender_cache_item("t")
        if isinstance(cache, ShmSenderCache):
            assert cache.is_cached(["a", "b", "c"], claim=True) == [False] * 3
        before = cache.make_stats()
        inputs = [(make_item("a"), updates_of("a")), None, "not a pair", (make_item("c"), [])]
        with pytest.raises(TypeError, match="P0 input for b must be"):
            cache.get_and_update(inputs, ["a", "t", "b", "c"])
        assert cache.is_cached(["a", "t", "b", "c"]) == [False, True, False, False]
        assert cache.make_stats() == before, "nothing was looked up"
        if isinstance(cache, ShmSenderCache):
            stats = cache.stats()
            assert stats["store_outstanding_refs"] == 0 and stats["store_pinned"] == 0
            assert stats["store_claims"] == 0


# -- per-cache semantics ---------------------------------------------------------------------


def test_processor_only_returns_the_stored_item_on_a_hit() -> None:
    cache = ProcessorOnlyCache(1)
    item = make_item("a")
    assert cache.get_and_update_item((item, ["u"]), "a") == (item, ["u"])
    data, updates = cache.get_and_update_item(None, "a")
    assert data is item and updates == ["u"]
    assert cache.make_stats() == CacheInfo(1, 2)


def test_sender_returns_none_on_a_hit() -> None:
    cache = SenderCache(1)
    item = make_item("a")
    data, updates = cache.get_and_update_item((item, ["u"]), "a")
    assert data is item and updates == ["u"]
    assert cache.get_and_update_item(None, "a") == (None, ["u"])
    # The sender keeps metadata only: a resend of data on a hit is not needed and not kept.
    assert cache.get_and_update_item((make_item("b"), ["v"]), "a") == (None, ["u"])


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache])
def test_sender_miss_without_data_raises_cache_miss(cache_type: type) -> None:
    cache = cache_type(1)
    with pytest.raises(CacheMissError) as info:
        cache.get_and_update_item(None, "missing")
    assert info.value.mm_hashes == ["missing"]
    assert isinstance(info.value, RuntimeError) and "retr" in str(info.value)
    with pytest.raises(TypeError):
        cache.get_and_update_item(make_item("bare"), "bare")  # not (item, prompt_updates)


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache])
def test_lookups_are_pure_and_stats_have_deltas(cache_type: type) -> None:
    cache = cache_type(gb(2 * KiB + 100))
    cache.get_and_update_item((make_item("a"), []), "a")
    cache.get_and_update_item((make_item("b"), []), "b")
    assert cache.is_cached(["a", "b", "c"]) == [True, True, False]
    assert cache.is_cached_item("a")
    assert cache.make_stats() == CacheInfo(0, 2)
    assert cache.keys() == ["a", "b"]  # is_cached did not make "a" recent
    cache.get_and_update_item(None, "a")
    assert cache.make_stats(delta=True) == CacheInfo(1, 3)
    cache.get_and_update_item(None, "b")
    assert cache.make_stats(delta=True) == CacheInfo(1, 1)
    cache.clear_cache()
    assert cache.make_stats() == CacheInfo(0, 0) and cache.keys() == []


def test_invalidate_forgets_and_is_a_noop_when_absent() -> None:
    cache = SenderCache(1)
    cache.get_and_update_item((make_item("a"), []), "a")
    cache.invalidate("a")
    cache.invalidate("never-seen")
    assert not cache.is_cached_item("a")


def test_receiver_keeps_full_items() -> None:
    with ReceiverCache(1) as cache:
        item = make_item("a")
        assert cache.get_and_update_item(item, "a") is item
        assert cache.get_and_update_item(None, "a") is item
        with pytest.raises(CacheMissError):
            cache.get_and_update_item(None, "b")
        assert cache.stats()["entries"] == 1 and cache.stats()["used_bytes"] == KiB


# -- consistency and mirroring ---------------------------------------------------------------


def test_lru_processor_only_and_none_give_p1_identical_tensors() -> None:
    rng = random.Random(1234)
    keys = [f"img{i}" for i in range(16)]
    truth = {k: make_item(k, rng.choice([1, 2, 4, 8]) * KiB) for k in keys}
    capacity = gb(40 * KiB)  # room for any request (<= 4 items), not for all 16 items
    configs = {
        "lru": (SenderCache(capacity), ReceiverCache(capacity)),
        "processor_only": (ProcessorOnlyCache(capacity), None),
        "none": (None, None),
    }
    for _ in range(100):
        hashes = [rng.choice(keys) for _ in range(rng.randint(1, 4))]
        extra = rng.randint(1, 3)
        results = {
            name: run_request(p0, p1, hashes, truth, extra) for name, (p0, p1) in configs.items()
        }
        for data, updates in results.values():
            assert updates == [updates_of(h) for h in hashes]
            assert all(same_item(d, truth[h]) for d, h in zip(data, hashes, strict=True))
    # The run exercised hits and evictions.
    sender, receiver = configs["lru"]
    assert 0 < sender.make_stats().hits < sender.make_stats().total
    assert len(receiver.keys()) < len(keys)


def test_sender_mirrors_receiver_after_every_request() -> None:
    rng = random.Random(99)
    keys = [f"k{i}" for i in range(24)]
    truth = {k: make_item(k, rng.choice([1, 2, 3, 5]) * KiB) for k in keys}
    truth["too-big"] = make_item("too-big", 64 * KiB)
    keys.append("too-big")
    capacity = gb(20 * KiB)
    sender, receiver = SenderCache(capacity), ReceiverCache(capacity)
    evicted_some = False
    for _ in range(200):
        hashes = [rng.choice(keys) for _ in range(rng.randint(1, 3))]
        data, _ = run_request(sender, receiver, hashes, truth, rng.randint(0, 2))
        assert all(same_item(d, truth[h]) for d, h in zip(data, hashes, strict=True))
        assert sender.keys() == receiver.keys()
        assert sender.stats()["used_bytes"] == receiver.stats()["used_bytes"]
        assert sender.stats()["evictions"] == receiver.stats()["evictions"]
        evicted_some |= len(sender.keys()) < len(set(keys) - {"too-big"})
    assert evicted_some
    assert "too-big" not in sender.keys()


def test_lru_pair_eviction_order() -> None:
    truth = {k: make_item(k) for k in "abcdef"}
    sender, receiver = SenderCache(gb(3.5 * KiB)), ReceiverCache(gb(3.5 * KiB))
    for hashes in (["a"], ["b"], ["c"], ["a"], ["d"]):
        run_request(sender, receiver, hashes, truth)
    # "a" was hit, so "b" was the least recent when "d" came.
    assert sender.keys() == receiver.keys() == ["c", "a", "d"]
    # "c" is least recent, but the request touches it before inserting "b": "a" goes instead
    # (without the touch, P0 would have sent None for an item inserting "b" evicted).
    data, _ = run_request(sender, receiver, ["b", "c"], truth)
    assert sender.keys() == receiver.keys() == ["d", "b", "c"]
    assert same_item(data[1], truth["c"])
    # New items replace the least recent ones, on both sides alike.
    run_request(sender, receiver, ["e", "f"], truth)
    assert sender.keys() == receiver.keys() == ["c", "e", "f"]


# -- requests larger than the cache ----------------------------------------------------------


def test_protected_entries_are_never_evicted() -> None:
    cache = LRUCache(100, getsizeof=len)
    for key, size in (("a", 30), ("b", 30), ("c", 30)):
        cache.put(key, b"v" * size)
    cache.protect("a")
    cache.protect("ghost")  # absent: a no-op
    assert cache.protected_bytes == 30 and not cache.is_protected("ghost")
    assert cache.put_if_fits("d", b"v" * 40)  # evicts "b": the least recent, "a", is skipped
    assert cache.recency_order() == ["a", "c", "d"] and cache.evictions == 1
    cache.protect("c")
    # 41 bytes fit only by evicting a protected entry: refused, and nothing is evicted.
    assert not cache.put_if_fits("e", b"v" * 41)
    assert cache.recency_order() == ["a", "c", "d"] and cache.evictions == 1
    with pytest.raises(ValueError, match="protected"):
        cache.put("e", b"v" * 41)
    assert cache.put_if_fits("e", b"v" * 40)  # "d" is the only one it may take
    assert cache.recency_order() == ["a", "c", "e"] and cache.currsize == 100
    # A protected entry may be replaced in place (its own size is given back).
    assert cache.put_if_fits("a", b"v" * 10) and cache.protected_bytes == 40
    assert cache.pop("c") is not None and cache.protected_bytes == 10  # pop drops it
    cache.unprotect("a")
    assert cache.protected_bytes == 0
    assert cache.put_if_fits("f", b"v" * 100)  # nothing protected: evicts everything
    assert cache.recency_order() == ["f"]
    cache.protect("f")
    with pytest.raises(KeyError):  # nothing left that eviction may take
        cache.popitem()
    cache.clear()
    assert len(cache) == 0 and cache.protected_bytes == 0


def test_a_request_cannot_evict_the_items_it_touched() -> None:
    truth = {"a": make_item("a", 4 * KiB), "b": make_item("b", 7 * KiB)}
    for p0, p1 in (
        (SenderCache(gb(10 * KiB)), ReceiverCache(gb(10 * KiB))),
        (ProcessorOnlyCache(gb(10 * KiB)), None),
    ):
        run_request(p0, p1, ["a"], truth)
        data, _ = run_request(p0, p1, ["b", "a"], truth)  # 11 KiB into 10 KiB
        assert all(same_item(d, truth[h]) for d, h in zip(data, ["b", "a"], strict=True))
        assert p0.keys() == ["a"] and p0.stats()["uncached_full"] == 1
        if p1 is not None:
            assert p1.keys() == ["a"] and p1.stats()["uncached_full"] == 1
        # The protection ends with the request: the next one may evict "a".
        run_request(p0, p1, ["b"], truth)
        assert p0.keys() == ["b"]


def test_items_updated_one_by_one_are_protected_until_their_own_update() -> None:
    sender = SenderCache(gb(10 * KiB))
    sender.get_and_update_item((make_item("a", 4 * KiB), []), "a")
    sender.touch_sender_cache_item("a")
    sender.get_and_update_item((make_item("b", 7 * KiB), []), "b")  # cannot evict "a"
    assert sender.keys() == ["a"]
    sender.get_and_update_item(None, "a")  # its update: "a" is no longer protected
    sender.get_and_update_item((make_item("b", 7 * KiB), []), "b")
    assert sender.keys() == ["b"]
    sender.touch_sender_cache_item("b")
    sender.release_sender_touches()  # an abandoned request: "b" may go
    sender.get_and_update_item((make_item("c", 4 * KiB), []), "c")
    assert sender.keys() == ["c"]


def test_sender_mirrors_receiver_with_requests_larger_than_the_cache() -> None:
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(16)]
    truth = {k: make_item(k, rng.choice([1, 2, 3, 5, 7]) * KiB) for k in keys}
    capacity = gb(10 * KiB)
    sender, receiver = SenderCache(capacity), ReceiverCache(capacity)
    over = 0
    for _ in range(300):
        # Up to 6 items, repeats included: many requests do not fit in the cache.
        hashes = [rng.choice(keys) for _ in range(rng.randint(1, 6))]
        over += sum(truth[h]["pixel_values"].numel() + 8 for h in set(hashes)) > 10 * KiB
        data, _ = run_request(sender, receiver, hashes, truth, rng.randint(0, 1))
        assert all(same_item(d, truth[h]) for d, h in zip(data, hashes, strict=True))
        assert sender.keys() == receiver.keys()
        assert sender.stats()["used_bytes"] == receiver.stats()["used_bytes"]
        assert sender.stats()["evictions"] == receiver.stats()["evictions"]
    assert over > 50
    assert sender.stats()["uncached_full"] == receiver.stats()["uncached_full"] > 0


def test_a_request_bracket_keeps_items_updated_one_by_one_mirrored() -> None:
    # vLLM's P0 touches a request's hashes, updates its items one call at a time, then ends
    # the request; P1 resolves the request in one call.  Within begin/end_request the
    # sender protects touched items until the end, as the receiver does.
    rng = random.Random(11)
    keys = [f"k{i}" for i in range(16)]
    truth = {k: make_item(k, rng.choice([1, 2, 3, 5, 7]) * KiB) for k in keys}
    sender, receiver = SenderCache(gb(10 * KiB)), ReceiverCache(gb(10 * KiB))
    for _ in range(300):
        hashes = [rng.choice(keys) for _ in range(rng.randint(1, 6))]
        cached = sender.is_cached(hashes)
        sender.begin_request()
        assert sender.in_request
        for h in hashes:
            sender.touch_sender_cache_item(h)
        data = [
            sender.get_and_update_item(None if c else (truth[h], updates_of(h)), h)[0]
            for h, c in zip(hashes, cached, strict=True)
        ]
        sender.end_request()
        assert not sender.in_request
        features = [Feature(d, mm_hash=h) for d, h in zip(data, hashes, strict=True)]
        receiver.get_and_update_features(features)
        assert all(same_item(f.data, truth[h]) for f, h in zip(features, hashes, strict=True))
        assert sender.keys() == receiver.keys()
    assert sender.stats()["uncached_full"] == receiver.stats()["uncached_full"] > 0


def sender_bracket(sender: SenderCache, hashes: list[str], truth: dict[str, Any]) -> list[Any]:
    """One request at P0 as vLLM brackets it, settled; the data it sends."""
    cached = sender.is_cached(hashes)
    sender.begin_request()
    for h in hashes:
        sender.touch_sender_cache_item(h)
    data = [
        sender.get_and_update_item(None if c else (truth[h], updates_of(h)), h)[0]
        for h, c in zip(hashes, cached, strict=True)
    ]
    sender.settle_recency(hashes)
    sender.end_request()
    return data


def test_a_request_that_never_reaches_the_receiver_gives_the_recency_it_moved_back() -> None:
    # An engine may reject a request after P0 applied it (vLLM: a prompt too long), so P1
    # never sees it; its touches made the items it found cached most recent at P0 only. Kept
    # so, the next evictions took other items on each side, and a later request of an item
    # P1 had evicted (cached at P0, so sent without its data) missed at P1.
    rng = random.Random(3)
    keys = [f"k{i}" for i in range(12)]
    truth = {k: make_item(k, rng.choice([1, 2, 3]) * KiB) for k in keys}
    sender, receiver = SenderCache(gb(8 * KiB)), ReceiverCache(gb(8 * KiB))
    rejected = 0
    for _ in range(300):
        hashes = [rng.choice(keys) for _ in range(rng.randint(1, 3))]
        if all(sender.is_cached(hashes)) and rng.random() < 0.5:
            # Rejected: only items it found cached, so it stored (and evicted) nothing.
            sender_bracket(sender, hashes, truth)
            assert sender.undo_recency(list(reversed(hashes)))  # the hashes it found cached
            assert not sender.undo_recency(hashes)  # once only
            rejected += 1
        else:
            data = sender_bracket(sender, hashes, truth)
            receiver.get_and_update_features(
                [Feature(d, mm_hash=h) for d, h in zip(data, hashes, strict=True)]
            )
            receiver.settle_recency(hashes)
        assert sender.keys() == receiver.keys()
    assert rejected > 20


@pytest.mark.parametrize("first", ["older", "newer"])
def test_undoing_two_requests_that_moved_one_item_puts_it_back_where_it_was(first: str) -> None:
    truth = {k: make_item(k) for k in "abc"}
    sender = SenderCache(1)
    for h in "abc":
        sender.get_and_update_item((truth[h], updates_of(h)), h)
    sender_bracket(sender, ["a", "b"], truth)
    sender_bracket(sender, ["a"], truth)
    assert sender.keys() == ["c", "b", "a"]
    if first == "older":
        assert sender.undo_recency(["a", "b"])  # b back; a stays, where the newer one left it
        assert sender.keys() == ["b", "c", "a"]
        assert sender.undo_recency(["a"])
    else:
        assert sender.undo_recency(["a"])
        assert sender.keys() == ["c", "a", "b"]
        assert sender.undo_recency(["b", "a"])
    assert sender.keys() == ["a", "b", "c"]


def test_an_undone_request_leaves_what_moved_its_items_since_alone() -> None:
    truth = {k: make_item(k) for k in "abc"}
    sender = SenderCache(1)
    for h in "abc":
        sender.get_and_update_item((truth[h], updates_of(h)), h)
    sender_bracket(sender, ["a", "b"], truth)
    assert not sender.undo_recency(["a"])  # no request found exactly "a" cached
    sender.touch_sender_cache_item("a")  # outside a request: moves it, files nothing
    assert sender.keys() == ["c", "b", "a"]
    assert sender.undo_recency(["a", "b"])
    assert sender.keys() == ["b", "c", "a"]
    with pytest.raises(TypeError, match="undo_recency takes a list of mm_hashes"):
        sender.undo_recency("ab")


def test_request_bracket_rules() -> None:
    sender = SenderCache(gb(10 * KiB))
    sender.end_request()  # none open: nothing to do
    sender.get_and_update_item((make_item("a", 6 * KiB), []), "a")
    sender.begin_request()
    with pytest.raises(RuntimeError, match="already open"):
        sender.begin_request()
    sender.touch_sender_cache_item("a")
    sender.get_and_update_item(None, "a")
    # Still protected after its own update, until the request ends.
    sender.get_and_update_item((make_item("b", 6 * KiB), []), "b")
    assert sender.keys() == ["a"]
    # A batched call inside the open request belongs to it (and does not end it).
    sender.get_and_update([(make_item("b", 6 * KiB), [])], ["b"])
    assert sender.in_request and sender.keys() == ["a"]
    sender.end_request()
    sender.get_and_update_item((make_item("b", 6 * KiB), []), "b")
    assert sender.keys() == ["b"]


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache])
def test_a_size_function_sets_what_an_item_counts_for(cache_type: type) -> None:
    # Every item counts for 1 byte: a 3-byte cache holds three items, whatever their tensors.
    def one(item: Any) -> int:
        return 1

    sender = cache_type(gb(3), getsizeof=one)
    truth = {k: make_item(k, 4 * KiB) for k in "abcd"}
    for k in "abcd":
        run_request(sender, None, [k], truth)
    assert sender.keys() == list("bcd")
    assert sender.stats()["used_bytes"] == 3


#: Every cache that takes a size function, made as ``make(capacity_gb, getsizeof=...)``.
SIZED_CACHES: dict[str, Any] = {
    "ProcessorOnlyCache": ProcessorOnlyCache,
    "SenderCache": SenderCache,
    "ReceiverCache": ReceiverCache,
    "LRUCache": lambda capacity_gb, getsizeof: LRUCache(GiB * capacity_gb, getsizeof=getsizeof),
}


@pytest.mark.parametrize(
    "make",
    [
        *SIZED_CACHES.values(),
        lambda capacity_gb, getsizeof: make_caches(
            "lru", capacity_gb=capacity_gb, getsizeof=getsizeof
        ),
    ],
    ids=[*SIZED_CACHES, "make_caches"],
)
@pytest.mark.parametrize("bad", [None, 5, "item_size"], ids=repr)
def test_a_size_function_that_is_no_function_is_a_type_error_naming_getsizeof(
    make: Any, bad: object
) -> None:
    # getsizeof=5 was taken, and the first put raised "'int' object is not callable";
    # getsizeof=None made ReceiverCache (and LRUCache) count every item as 1 byte, without a
    # word (cachetools' default), while SenderCache failed at its first put: P1's LRU never
    # evicted, and the two sides could not mirror.
    with pytest.raises(
        TypeError,
        match=rf"^getsizeof must be a function of an item returning its size in bytes, not "
        rf"{type(bad).__name__}$",
    ):
        make(0.01, getsizeof=bad)


def test_make_caches_passes_the_size_function_to_both_sides() -> None:
    def one(item: Any) -> int:
        return 1

    p0, p1 = make_caches("lru", capacity_gb=gb(3), getsizeof=one)
    assert isinstance(p0, SenderCache) and isinstance(p1, ReceiverCache)
    truth = {k: make_item(k, 4 * KiB) for k in "abcd"}
    for k in "abcd":
        run_request(p0, p1, [k], truth)
    assert p0.keys() == p1.keys() == list("bcd")
    assert p1.stats()["used_bytes"] == 3


def test_receiver_reports_the_items_of_a_missed_request_it_could_not_keep() -> None:
    receiver = ReceiverCache(gb(10 * KiB))
    held = make_item("held", 6 * KiB)
    receiver.get_and_update_item(held, "held")
    big, small = make_item("big", 5 * KiB), make_item("small", KiB)
    # No miss: nothing is raised, even though "big" cannot be kept beside "held".
    features = [Feature(big, mm_hash="big"), Feature(None, mm_hash="held")]
    receiver.get_and_update_features(features)
    assert features[0].data is big and receiver.keys() == ["held"]
    # A miss: the error also lists "big", which the sender may believe is kept here.
    features = [
        Feature(big, mm_hash="big"),
        Feature(None, mm_hash="held"),
        Feature(None, mm_hash="gone"),
        Feature(small, mm_hash="small"),
    ]
    with pytest.raises(CacheMissError) as info:
        receiver.get_and_update_features(features)
    assert info.value.mm_hashes == ["big", "gone"]
    assert features[0].data is big and features[1].data is held and features[3].data is small
    assert receiver.keys() == ["held", "small"]


def test_receiver_resolves_a_repeated_hash_from_its_request_payload() -> None:
    receiver = ReceiverCache(gb(10 * KiB))
    held = make_item("held", 6 * KiB)
    receiver.get_and_update_item(held, "held")
    big = make_item("big", 5 * KiB)
    features = [
        Feature(big, mm_hash="big"),  # cannot be kept beside the touched "held" ...
        Feature(None, mm_hash="held"),
        Feature(None, mm_hash="big"),  # ... but this request carried it
    ]
    receiver.get_and_update_features(features)
    assert features[2].data is big and receiver.keys() == ["held"]
    # Only within the request that carried it.
    with pytest.raises(CacheMissError):
        receiver.get_and_update_features([Feature(None, mm_hash="big")])


# -- oversize --------------------------------------------------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "mmcache" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("mode", ["processor_only", "lru"])
def test_oversize_items_are_served_uncached(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    truth = {"big1": make_item("big1", 16 * KiB), "big2": make_item("big2", 16 * KiB)}
    truth["small"] = make_item("small", KiB)
    p0, p1 = make_caches(mode, capacity_gb=gb(8 * KiB))
    assert p0 is not None
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        for hashes in (["big1"], ["big2", "small"], ["big1"]):
            data, _ = run_request(p0, p1, hashes, truth)
            assert all(same_item(d, truth[h]) for d, h in zip(data, hashes, strict=True))
    assert p0.is_cached(["big1", "big2", "small"]) == [False, False, True]
    assert p0.stats()["uncached_oversize"] == 3
    if p1 is not None:
        assert p1.keys() == ["small"] and p1.stats()["uncached_oversize"] == 3
    # One warning per cache, naming the setting to raise.
    assert len(_warnings(caplog)) == (2 if p1 is not None else 1)
    assert "capacity_gb" in _warnings(caplog)[0].getMessage()


def test_oversize_resend_drops_a_stale_receiver_entry() -> None:
    receiver = ReceiverCache(gb(8 * KiB))
    receiver.get_and_update_item(make_item("old"), "h")
    fresh = make_item("fresh", 16 * KiB)
    assert receiver.get_and_update_item(fresh, "h") is fresh
    with pytest.raises(CacheMissError):  # never the old payload
        receiver.get_and_update_item(None, "h")


# -- drift -----------------------------------------------------------------------------------


def test_receiver_reports_every_miss_in_order_and_ingests_the_rest() -> None:
    receiver = ReceiverCache(1)
    kept = make_item("d")
    receiver.get_and_update_item(kept, "d")
    fresh = make_item("b")
    features = [
        Feature(None, mm_hash="a", identifier="a"),
        Feature(fresh, mm_hash="b", identifier="b"),
        Feature(None, mm_hash="c", identifier="c"),
        Feature(None, mm_hash="d", identifier="d"),
        Feature(None, mm_hash="e", identifier="e"),
    ]
    with pytest.raises(CacheMissError) as info:
        receiver.get_and_update_features(features)
    assert info.value.mm_hashes == ["a", "c", "e"]
    assert receiver.get_and_update_item(None, "b") is fresh
    assert features[3].data is kept


def test_receiver_batched_update_reports_every_miss_and_ingests_the_rest() -> None:
    # get_and_update is one request, as get_and_update_features is: it stopped at the first
    # miss, reporting only it and leaving the rest of the request unapplied.
    receiver = ReceiverCache(1)
    kept, fresh = make_item("d"), make_item("b")
    receiver.get_and_update_item(kept, "d")
    with pytest.raises(CacheMissError) as info:
        receiver.get_and_update([None, fresh, None, None, None], ["a", "b", "c", "d", "e"])
    assert info.value.mm_hashes == ["a", "c", "e"]
    assert receiver.get_and_update_item(None, "b") is fresh
    assert receiver.get_and_update([None, None], ["d", "b"]) == [kept, fresh]


def test_invalidate_and_one_resend_recover_from_drift() -> None:
    truth = {k: make_item(k) for k in "xyz"}
    sender, receiver = SenderCache(1), ReceiverCache(1)
    run_request(sender, receiver, ["x", "y", "z"], truth)
    receiver.clear_cache()  # the engine restarted; P0 does not know
    receiver.get_and_update_item(truth["y"], "y")  # ... and saw "y" again since
    with pytest.raises(CacheMissError) as info:
        run_request(sender, receiver, ["z", "y", "x"], truth)
    assert info.value.mm_hashes == ["z", "x"]
    for h in info.value.mm_hashes:
        sender.invalidate(h)
    data, _ = run_request(sender, receiver, ["z", "y", "x"], truth)  # the single retry
    assert all(same_item(d, truth[h]) for d, h in zip(data, ["z", "y", "x"], strict=True))
    assert sender.keys() == receiver.keys() == ["z", "y", "x"]


def test_receiver_prefers_the_resent_payload() -> None:
    receiver = ReceiverCache(1)
    first, second = make_item("first"), make_item("second")
    receiver.get_and_update_item(first, "h")
    features = [Feature(second, mm_hash="h", identifier="h")]
    receiver.get_and_update_features(features)
    assert features[0].data is second
    assert receiver.get_and_update_item(None, "h") is second


def test_identifiers_sharing_an_mm_hash_share_one_entry() -> None:
    receiver = ReceiverCache(1)
    item = make_item("shared")
    features = [
        Feature(item, mm_hash="h", identifier="lora-1:h"),
        Feature(None, mm_hash="h", identifier="lora-2:h"),
        Feature(None, mm_hash=None, identifier="h"),
    ]
    receiver.get_and_update_features(features)
    assert all(f.data is item for f in features)
    assert receiver.keys() == ["h"]


def test_identifier_is_the_key_without_mm_hash() -> None:
    receiver = ReceiverCache(1)
    item = make_item("i")
    receiver.get_and_update_features([Feature(item, mm_hash=None, identifier="id-1")])
    assert receiver.keys() == ["id-1"]
    with pytest.raises(CacheMissError) as info:
        receiver.get_and_update_features([Feature(None, mm_hash=None, identifier="id-2")])
    assert info.value.mm_hashes == ["id-2"]


def test_cache_miss_error_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(CacheMissError(["a", "b"])))
    assert isinstance(err, CacheMissError) and err.mm_hashes == ["a", "b"]


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ReceiverCache])
def test_settle_recency_orders_a_requests_cached_keys_and_counts_nothing(cache_type: type) -> None:
    cache = cache_type(1)
    for h in ["c", "a", "x", "b"]:
        item = make_item(h)
        cache.get_and_update_item((item, None) if cache_type is not ReceiverCache else item, h)
    before = cache.stats()
    cache.settle_recency(["b", "c", "absent", "a", "c"])
    assert cache.keys() == ["x", "a", "b", "c"]
    assert cache.stats() == before


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ReceiverCache])
def test_settle_recency_refuses_one_hash_for_a_list(cache_type: type) -> None:
    # A str was read as its characters: "ab" settled the keys "a" and "b", not "ab".
    cache = cache_type(1)
    for h in ["b", "a", "ab"]:
        item = make_item(h)
        cache.get_and_update_item((item, None) if cache_type is not ReceiverCache else item, h)
    with pytest.raises(TypeError, match="settle_recency takes a list of mm_hashes, not one str"):
        cache.settle_recency("ab")
    assert cache.keys() == ["b", "a", "ab"]


def test_release_handles_refuses_one_str_for_a_list() -> None:
    # A str's characters are no handles, so it gave nothing back without a word.
    with (
        ShmSenderCache(gb(1 << 20)) as sender,
        pytest.raises(TypeError, match="release_handles takes a list of handles"),
    ):
        sender.release_handles("handle")


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_one_hash_where_a_request_takes_a_list_is_a_type_error(mode: str) -> None:
    # A str is a sequence of one-character strings: get_and_update([a, b], "xy") cached a
    # under "x" and b under "y" without a word (is_cached already refuses a str).
    p0, downstream = make_caches(mode, capacity_gb=0.01)
    assert p0 is not None
    receiver = downstream if isinstance(downstream, ReceiverCache) else None
    try:
        items = [({"x": torch.ones(2)}, None), ({"x": torch.zeros(2)}, None)]
        with pytest.raises(TypeError, match="get_and_update takes a list of mm_hashes"):
            p0.get_and_update(items, "xy")
        assert not p0.is_cached_item("x") and not p0.is_cached_item("y")
        if receiver is not None:
            with pytest.raises(TypeError, match="get_and_update takes a list of mm_hashes"):
                receiver.get_and_update([{"x": torch.ones(2)}, None], "xy")
            assert "x" not in receiver._lru
    finally:
        p0.close()
        if receiver is not None:
            receiver.close()


@contextmanager
def cache_pair(mode: str) -> Iterator[tuple[BaseSenderCache, BaseReceiverCache | None]]:
    """``mode``'s P0 cache (0.01 GiB) and its receiver (a worker's, in ``shm``; ``None``
    where the mode has none), both closed after."""
    p0, downstream = make_caches(mode, capacity_gb=0.01)  # type: ignore[arg-type]
    assert p0 is not None
    receiver = ShmReceiverCache(downstream) if isinstance(downstream, ReaderHandle) else downstream
    try:
        yield p0, receiver
    finally:
        if receiver is not None:
            receiver.close()
        p0.close()


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_a_requests_items_from_a_generator_are_updated(mode: str) -> None:
    # get_and_update(generator, hashes) was "object of type 'generator' has no len()", naming
    # neither the call nor items, where its hashes (and a receiver's features) may come from
    # one.
    item = {"x": torch.ones(2)}
    with cache_pair(mode) as (p0, receiver):
        [(data, _)] = p0.get_and_update(((item, None) for _ in "a"), (h for h in "a"))
        assert p0.is_cached(["a"]) == [True]
        if receiver is not None:
            [resolved] = receiver.get_and_update((d for d in [data]), (h for h in "a"))
            assert torch.equal(resolved["x"], item["x"])


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_features_from_a_generator_are_resolved(mode: str) -> None:
    # An iterable of features that is not a sequence was read twice (keys, then data): the
    # second pass found it empty, "zip() argument 2 is longer than argument 1".
    item = {"x": torch.arange(3)}
    with cache_pair(mode) as (p0, receiver):
        assert receiver is not None
        (data, _), *_ = p0.get_and_update([(item, None)], ["h"])
        features = [Feature(data, mm_hash="h", identifier="h")]
        resolved = receiver.get_and_update_features(f for f in features)
        assert list(resolved) == features
        assert torch.equal(features[0].data["x"], item["x"])


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_one_feature_or_item_where_a_request_takes_a_list_is_a_type_error(mode: str) -> None:
    # get_and_update_features(feature) was "'Feature' object is not iterable" from deep
    # inside; one item (a mapping: iterable, over its field names) for a list of items was
    # "1 items but 2 mm_hashes" at best, "ReceiverCache got a str for h" (a field name as
    # the item) at worst; one handle to release_handles was "not iterable".
    item = {"x": torch.ones(2)}
    with cache_pair(mode) as (p0, receiver):
        with pytest.raises(TypeError, match=r"^get_and_update takes a list of items, not one dict"):
            p0.get_and_update(item, ["h"])  # type: ignore[arg-type]
        assert not p0.is_cached_item("h")
        (data, _), *_ = p0.get_and_update([(item, None)], ["h"])
        if isinstance(p0, ShmSenderCache):
            with pytest.raises(
                TypeError, match=r"^release_handles takes a list of handles, not one ShmHandle"
            ):
                p0.release_handles(data)  # type: ignore[arg-type]
        if receiver is None:
            return
        one = Feature(data, mm_hash="h", identifier="h")
        with pytest.raises(
            TypeError,
            match=r"^get_and_update_features takes a list of features, not one Feature: "
            r"get_and_update_features\(\[feature\]\)",
        ):
            receiver.get_and_update_features(one)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^get_and_update takes a list of items, not one"):
            receiver.get_and_update(data if data is not None else item, ["h"])
        # A list of data (not of features) was "'ShmHandle' object has no attribute
        # 'mm_hash'", an AttributeError.
        with pytest.raises(
            TypeError,
            match=r"^get_and_update_features takes a list of features \(with data, mm_hash "
            r"and identifier\), not of (ShmHandle|dict)",
        ):
            receiver.get_and_update_features([one, data])
        [resolved] = receiver.get_and_update_features([one])  # nothing was consumed
        assert torch.equal(resolved.data["x"], item["x"])


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_an_mm_hash_that_is_not_a_str_is_a_type_error_naming_it(mode: str) -> None:
    # get_and_update_item(mm_hash, item), the arguments swapped, was "unhashable type:
    # 'dict'" (LRU) or "'tuple' object is not an instance of 'str'" (shm); a list of hashes
    # passed to touch_sender_cache_item or invalidate was "unhashable type: 'list'".
    item = {"x": torch.ones(2)}
    with cache_pair(mode) as (p0, receiver):
        p0.touch_sender_cache_item("a")  # a pin held (shm): the swapped call must not hide it
        p0.get_and_update_item((item, None), "a")
        with pytest.raises(
            TypeError, match=r"get_and_update_item\(item, mm_hash\): mm_hash must be a str, not"
        ):
            p0.get_and_update_item("b", (item, None))  # type: ignore[arg-type]
        with pytest.raises(
            TypeError, match=r"touch_sender_cache_item\(mm_hash\): mm_hash must be a str, not list"
        ):
            p0.touch_sender_cache_item(["a", "b"])  # type: ignore[arg-type]
        with pytest.raises(
            TypeError, match=r"invalidate\(mm_hash\): mm_hash must be a str, not list"
        ):
            p0.invalidate(["a"])  # type: ignore[arg-type]
        assert p0.is_cached(["a", "b"]) == [True, False]
        if receiver is not None:
            with pytest.raises(
                TypeError, match=r"get_and_update_item\(item, mm_hash\): mm_hash must be a str"
            ):
                receiver.get_and_update_item("a", item)
            # A handle with a hash that is no str: named as the senders name it (shm's was
            # "'bytes' object is not an instance of 'str'"), and nothing consumed.
            handle, _ = p0.get_and_update_item(None, "a")
            if isinstance(handle, ShmHandle):
                for bad in (b"a", ("a",), None):
                    with pytest.raises(
                        TypeError,
                        match=r"get_and_update_item\(item, mm_hash\): mm_hash must be a str, not",
                    ):
                        receiver.get_and_update_item(handle, bad)  # type: ignore[arg-type]
                assert torch.equal(receiver.get_and_update_item(handle, "a")["x"], item["x"])


# Hashable, but no mm_hash (SPEC: a str): the LRU modes keyed items by them.
NOT_STR_HASHES = [5, ("a",), b"a", 1.5]


def _hash_type_error(call: str, bad: object, name: str = "mm_hash") -> Any:
    """``pytest.raises`` for ``call``'s error naming ``name``, ``bad``, that is not a str."""
    return pytest.raises(
        TypeError,
        match=rf"^{re.escape(f'{call}: {name} must be a str, not {type(bad).__qualname__}')}$",
    )


@pytest.mark.parametrize("bad", NOT_STR_HASHES, ids=repr)
@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ShmSenderCache])
def test_a_sender_refuses_a_hashable_mm_hash_that_is_no_str(cache_type: type, bad: object) -> None:
    # The LRU senders keyed items by any hashable (an int, a tuple, bytes): cached, found,
    # touched and invalidated under it without a word, while the ring refused it; P1's
    # ReceiverCache took the same, so both sides agreed on a key SPEC never allows.
    item = {"x": torch.ones(2)}
    with cache_type(0.01) as p0:
        p0.get_and_update_item((item, None), "a")
        with _hash_type_error("get_and_update_item(item, mm_hash)", bad):
            p0.get_and_update_item((item, None), bad)
        with _hash_type_error("get_and_update_item(item, mm_hash)", bad):
            p0.get_and_update_item(None, bad)
        with _hash_type_error("get_and_update(items, mm_hashes)", bad, "mm_hashes[0]"):
            p0.get_and_update([(item, None), (item, None)], [bad, "b"])
        with _hash_type_error("is_cached_item(mm_hash)", bad):
            p0.is_cached_item(bad)
        with _hash_type_error("is_cached(mm_hashes)", bad, "mm_hashes[0]"):
            p0.is_cached([bad, "a"])
        with _hash_type_error("touch_sender_cache_item(mm_hash)", bad):
            p0.touch_sender_cache_item(bad)
        with _hash_type_error("invalidate(mm_hash)", bad):
            p0.invalidate(bad)
        if cache_type is not ShmSenderCache:
            with _hash_type_error("settle_recency(mm_hashes)", bad, "mm_hashes[0]"):
                p0.settle_recency([bad, "a"])
        if cache_type is SenderCache:
            with _hash_type_error("undo_recency(mm_hashes)", bad, "mm_hashes[0]"):
                p0.undo_recency([bad])
        assert p0.is_cached(["a", "b"]) == [True, False]  # nothing stored under "b" either


@pytest.mark.parametrize("bad", NOT_STR_HASHES, ids=repr)
@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_receiver_refuses_a_hashable_mm_hash_that_is_no_str(mode: str, bad: object) -> None:
    # ReceiverCache stored, touched and resolved items under any hashable; ShmReceiverCache
    # refused one only with a handle, and returned a plain item or None under it.
    item = {"x": torch.ones(2)}
    with cache_pair(mode) as (p0, receiver):
        assert receiver is not None
        with _hash_type_error("get_and_update_item(item, mm_hash)", bad):
            receiver.get_and_update_item(item, bad)
        with _hash_type_error("get_and_update_item(item, mm_hash)", bad):
            receiver.get_and_update_item(None, bad)
        with _hash_type_error("touch_receiver_cache_item(mm_hash)", bad):
            receiver.touch_receiver_cache_item(bad)
        with _hash_type_error("get_and_update(items, mm_hashes)", bad, "mm_hashes[0]"):
            receiver.get_and_update([item, item], [bad, "b"])
        data, _ = p0.get_and_update_item((item, None), "a")
        feature = Feature(data, mm_hash="a", identifier="a")
        # An engine's own feature objects (Feature itself refuses such keys).
        key = "features[1]'s key (its mm_hash, else its identifier)"
        with _hash_type_error("get_and_update_features(features)", bad, key):
            receiver.get_and_update_features(
                [feature, Namespace(data=item, mm_hash=bad, identifier="i")]
            )
        with _hash_type_error("get_and_update_features(features)", bad, key):
            receiver.get_and_update_features(
                [feature, Namespace(data=item, mm_hash=None, identifier=bad)]
            )
        if isinstance(receiver, ReceiverCache):
            with _hash_type_error("settle_recency(mm_hashes)", bad, "mm_hashes[0]"):
                receiver.settle_recency([bad])
            assert receiver.keys() == []  # nothing stored under bad, nor under "b"
        # Refused before anything was read: the handle's reference is still there to read.
        [resolved] = receiver.get_and_update_features([feature])
        assert torch.equal(resolved.data["x"], item["x"])


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ShmSenderCache])
def test_a_flag_that_is_no_bool_is_a_type_error_naming_it(cache_type: type) -> None:
    # A flag's truthiness was taken: is_cached(hashes, claim="no") claimed every miss (other
    # writers then waited on claims this one never meant to take), clear_cache(
    # keep_in_flight="no") kept the handles in flight, make_stats(delta="no") gave a delta.
    with cache_type(0.01) as p0:
        p0.get_and_update_item(({"x": torch.ones(2)}, None), "a")
        calls = [("delta", lambda bad: p0.make_stats(delta=bad))]
        if cache_type is ShmSenderCache:
            calls += [
                ("claim", lambda bad: p0.is_cached(["b"], claim=bad)),
                ("keep_in_flight", lambda bad: p0.clear_cache(keep_in_flight=bad)),
            ]
        for name, call in calls:
            for bad in ("no", 1, None):
                with pytest.raises(TypeError, match=rf"^{name} must be True or False, not "):
                    call(bad)
        assert p0.make_stats(delta=np.bool_(True)) == CacheInfo(0, 1)  # numpy's bool is one
        assert p0.is_cached(["a", "b"]) == [True, False]
        if cache_type is ShmSenderCache:
            assert p0.give_up_claims() == []  # nothing was claimed


def test_a_cache_miss_of_one_str_is_a_type_error() -> None:
    # CacheMissError(h) (one hash, not a list) listed h's characters as the missing hashes:
    # a sender invalidating those forgot nothing, so its retry missed again.
    for one in ("ab" * 32, b"ab" * 32):
        with pytest.raises(TypeError, match=r"CacheMissError takes a list of mm_hashes"):
            CacheMissError(one)  # type: ignore[arg-type]
    assert CacheMissError(("a", "b")).mm_hashes == ["a", "b"]


def test_a_cache_miss_of_what_is_no_list_of_str_is_a_type_error() -> None:
    # CacheMissError(None) was "'NoneType' object is not iterable", naming neither the call
    # nor mm_hashes; CacheMissError([1]) was made, and the sender's invalidate(1) after it
    # raised far from the code that built it.
    with pytest.raises(
        TypeError,
        match=r"^CacheMissError takes a list of mm_hashes, not one NoneType: "
        r"CacheMissError\(\[mm_hash\]\)$",
    ):
        CacheMissError(None)  # type: ignore[arg-type]
    for bad in NOT_STR_HASHES:
        with pytest.raises(
            TypeError,
            match=rf"^CacheMissError\(mm_hashes\): mm_hashes\[1\] must be a str, not "
            rf"{type(bad).__name__}$",
        ):
            CacheMissError(["a", bad])  # type: ignore[list-item]
    assert CacheMissError(h for h in "ab").mm_hashes == ["a", "b"]


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_receiver_given_p0s_whole_output_says_to_pass_its_data(mode: str) -> None:
    # P0 returns (data, prompt_updates) per item; a Feature built with the whole pair was
    # "ReceiverCache got a tuple for a", which did not say what to send instead.
    with cache_pair(mode) as (p0, receiver):
        assert receiver is not None
        output = p0.get_and_update_item(({"x": torch.ones(2)}, ["<image>"]), "a")
        with pytest.raises(TypeError, match=r"P0's output is \(data, prompt_updates\)"):
            receiver.get_and_update_features([Feature(data=output, mm_hash="a")])
        [feature] = receiver.get_and_update_features([Feature(data=output[0], mm_hash="a")])
        assert torch.equal(feature.data["x"], torch.ones(2))


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_none_among_features_is_named_as_what_is_no_feature(mode: str) -> None:
    # [feature, None] was refused as a list of features "('NoneType' object has no attribute
    # 'mm_hash')": the None found was taken for "none found", so the message quoted the
    # AttributeError instead of naming what the list held.
    with cache_pair(mode) as (p0, receiver):
        assert receiver is not None
        data, _ = p0.get_and_update_item(({"x": torch.ones(2)}, None), "a")
        feature = Feature(data, mm_hash="a")
        with pytest.raises(
            TypeError,
            match=r"^get_and_update_features takes a list of features \(with data, mm_hash and "
            r"identifier\), not of NoneType: pass data to get_and_update$",
        ):
            receiver.get_and_update_features([feature, None])
        [resolved] = receiver.get_and_update_features([feature])  # nothing was consumed
        assert torch.equal(resolved.data["x"], torch.ones(2))


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_receiver_given_data_that_is_no_item_says_what_it_takes(mode: str) -> None:
    # An int, a str or a list as a feature's data was "ReceiverCache got a int for a": what
    # the receiver takes instead, nowhere (and "a int").
    takes = {
        "lru": "an item (a mapping of field names) or None",
        "shm": "an item (a mapping of field names), a handle or None",
    }[mode]
    with cache_pair(mode) as (_, receiver):
        assert receiver is not None
        name = type(receiver).__name__
        for data in (5, "pixels", [torch.ones(2)]):
            message = f"{name} takes {takes} as the data of a, not {type(data).__name__}"
            with pytest.raises(TypeError, match=rf"^{re.escape(message)}$"):
                receiver.get_and_update_item(data, "a")
            with pytest.raises(TypeError, match=rf"^{re.escape(message)}$"):
                receiver.get_and_update_features([Feature(data=data, mm_hash="a")])


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_a_hash_with_a_lone_surrogate_is_one_value_error_in_every_mode(mode: str) -> None:
    # The ring keys by UTF-8, so shm raised the codec's bare UnicodeEncodeError, after the
    # request's earlier items were stored; lru stored such a hash as any other.
    bad = "\ud800"
    named = re.escape(f"mm_hash {bad!r} holds a lone surrogate")
    p0, downstream = make_caches(mode, capacity_gb=0.01)
    assert p0 is not None
    item = (make_item("good"), None)
    try:
        with pytest.raises(ValueError, match=named):
            p0.get_and_update([item, item], ["good", bad])
        assert not p0.is_cached_item("good")  # nothing of the request was applied
        for call in (
            p0.is_cached_item,
            lambda h: p0.is_cached([h]),
            p0.touch_sender_cache_item,
            lambda h: p0.get_and_update_item(item, h),
            p0.invalidate,
        ):
            with pytest.raises(ValueError, match=named):
                call(bad)
        p0.release_sender_touches()
        if isinstance(p0, ShmSenderCache):
            stats = p0.stats()
            assert stats["store_outstanding_refs"] == stats["store_pinned"] == 0
            assert stats["store_objects"] == stats["store_claims"] == 0
        if isinstance(downstream, ReceiverCache):
            for call in (
                downstream.touch_receiver_cache_item,
                lambda h: downstream.get_and_update_item(make_item("good"), h),
            ):
                with pytest.raises(ValueError, match=named):
                    call(bad)
            assert downstream.keys() == []
    finally:
        p0.close()
        if isinstance(downstream, ReceiverCache):
            downstream.close()


@pytest.mark.parametrize("make", list(SIZED_CACHES.values()), ids=list(SIZED_CACHES))
@pytest.mark.parametrize(
    ("size", "error", "says"),
    [
        (-1, ValueError, "a number of bytes >= 0, not -1"),
        (math.nan, ValueError, "a number of bytes >= 0, not nan"),
        ("12", TypeError, "a number of bytes, not str"),
        (None, TypeError, "a number of bytes, not NoneType"),
    ],
    ids=repr,
)
def test_a_size_function_that_returns_no_size_is_an_error_naming_getsizeof(
    make: Any, size: object, error: type[Exception], says: str
) -> None:
    # A size below 0 or NaN fits no cache: every item was served uncached as "full" ("does
    # not fit beside the 0 GiB of items the requests in flight still use"), a cache that
    # never caches, with a warning that blamed the requests; a size that is no number was
    # "'<=' not supported between instances of 'int' and 'str'".
    cache = make(0.01, getsizeof=lambda item: size)
    item = make_item("a", KiB)
    if isinstance(cache, LRUCache):
        put, args = cache.put_if_fits, ("a", item)
    elif isinstance(cache, ReceiverCache):
        put, args = cache.get_and_update_item, (item, "a")
    else:
        put, args = cache.get_and_update_item, ((item, []), "a")
    with pytest.raises(error, match=rf"^getsizeof must return {says}$"):
        put(*args)
    if isinstance(cache, LRUCache):
        with pytest.raises(error, match=rf"^getsizeof must return {says}$"):
            cache.put("a", item)
        assert "a" not in cache
    else:
        assert cache.keys() == [] and cache.stats()["uncached_full"] == 0
