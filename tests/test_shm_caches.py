"""The shared-memory caches: handles, lifetimes, eviction, misses and several processes."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mmcache
from item_checks import same_item
from mmcache import (
    CacheInfo,
    CacheMissError,
    ClosedError,
    Feature,
    InvalidHandleError,
    MmcacheError,
    ReaderHandle,
    ReceiverCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    content_hash,
    make_caches,
)
from mmcache.prompt_updates import PRUNE_STEP, KeptPromptUpdates

KiB = 1024
MiB = 1 << 20
GiB = 1 << 30

# Objects of OBJ bytes; a ring of RING bytes holds three of them (chunk headers included)
# but not four.
OBJ = 64 * KiB
RING = 224 * KiB


def make_item(key: str, n_bytes: int = OBJ - 256) -> dict[str, Any]:
    seed = int.from_bytes(key.encode(), "little") % (2**31)
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, generator=g)}


@pytest.fixture
def sender() -> Iterator[ShmSenderCache]:
    with ShmSenderCache(RING / GiB, max_object_size_mb=1) as cache:
        yield cache


@pytest.fixture
def reader(sender: ShmSenderCache) -> Iterator[ShmReceiverCache]:
    with ShmReceiverCache(sender.handle()) as cache:
        yield cache


def put(sender: ShmSenderCache, key: str, item: dict[str, Any] | None = None) -> Any:
    """P0's update for one new item; returns what P0 sends (a handle, or the data)."""
    data, updates = sender.get_and_update_item((item or make_item(key), [f"pu-{key}"]), key)
    assert updates == [f"pu-{key}"]
    return data


def cached(sender: ShmSenderCache, keys: str) -> set[str]:
    return {k for k, c in zip(keys, sender.is_cached(list(keys)), strict=True) if c}


# -- the sender ------------------------------------------------------------------------------


def test_prompt_updates_of_evicted_items_are_forgotten(sender: ShmSenderCache) -> None:
    """The ring holds three items: after 200 puts the cache keeps the prompt updates of the
    three and of fewer than 64 evicted ones (the pruning threshold), and every cached item
    still hits with its own."""
    item = make_item("x")
    for i in range(200):
        sender.release_handles([put(sender, f"k{i}", item)])
    live = [f"k{i}" for i in range(200) if sender.is_cached_item(f"k{i}")]
    assert len(live) == 3, live
    kept = sender._prompt_updates
    assert set(live) <= set(kept) and len(kept) < 64, len(kept)
    for key in live:
        handle, updates = sender.get_and_update_item(None, key)
        assert updates == [f"pu-{key}"]
        sender.release_handles([handle])


def test_forgetting_prompt_updates_looks_up_a_bounded_number_of_keys_per_put() -> None:
    """A ring of 4,096 objects and 20,000 puts: forgetting the prompt updates of evicted
    objects never looks up more than ``PRUNE_STEP`` kept keys in one put (it looked up every
    kept key at once, ~8,000 here: on a 1 GiB ring one put in ~130,000 waited 20-60 ms);
    what is kept stays bounded, and every cached item still hits with its own."""
    item = {"x": torch.zeros(4, dtype=torch.uint8)}
    with ShmSenderCache(64 * MiB / GiB, max_object_size_mb=1) as sender:
        objects = sender.stats()["store_max_objects"]
        looked_up: list[int] = []
        uncached = sender._kept._uncached

        def recording(keys: list[str]) -> Any:
            looked_up.append(len(keys))
            return uncached(keys)

        sender._kept._uncached = recording
        largest_kept = 0
        for i in range(5 * objects):
            sender.release_handles([put(sender, f"k{i}", item)])
            largest_kept = max(largest_kept, len(sender._prompt_updates))
        assert looked_up and max(looked_up) <= PRUNE_STEP, max(looked_up)
        assert sum(looked_up) > 3 * objects  # evicted ones were forgotten, pass after pass
        assert largest_kept <= 2 * objects + 2 * PRUNE_STEP, (largest_kept, objects)
        live = [f"k{i}" for i in range(5 * objects) if sender.is_cached_item(f"k{i}")]
        assert len(live) > objects // 2
        assert set(live) <= set(sender._prompt_updates)
        for key in live[-50:]:
            handle, updates = sender.get_and_update_item(None, key)
            assert updates == [f"pu-{key}"]
            sender.release_handles([handle])


@given(st.lists(st.tuples(st.integers(0, 300), st.booleans()), max_size=3_000))
@settings(max_examples=60, deadline=None)
def test_kept_prompt_updates_forget_only_what_the_store_dropped(
    ops: list[tuple[int, bool]],
) -> None:
    """A model of the store (a set of keys, some dropped as others arrive; a flag drops a
    key, as an invalidation does): ``KeptPromptUpdates`` keeps every stored key's entry, the
    last one kept, looks up at most ``PRUNE_STEP`` keys a time, and keeps a bounded number."""
    stored: dict[str, int] = {}  # key -> the id its kept entry must carry, in put order
    looked_up: list[int] = []

    def uncached(keys: list[str]) -> list[str]:
        looked_up.append(len(keys))
        return [key for key in keys if key not in stored]

    kept = KeptPromptUpdates(uncached)
    for n, (k, invalidate) in enumerate(ops):
        key = f"k{k}"
        if invalidate:
            stored.pop(key, None)
            kept.entries.pop(key, None)  # as `ShmSenderCache.invalidate` does
            continue
        stored[key] = n
        while len(stored) > 100:  # the store evicts its oldest
            del stored[next(iter(stored))]
        kept.keep(key, n, f"pu-{n}")
        for stored_key, put_at in stored.items():
            assert kept.entries[stored_key] == (put_at, f"pu-{put_at}")
        assert len(kept.entries) <= 2 * 100 + 2 * PRUNE_STEP + 64
    assert all(size <= PRUNE_STEP for size in looked_up)


def test_data_sent_again_for_a_cached_item_is_a_hit_and_ignored(sender: ShmSenderCache) -> None:
    """P0 puts data without looking it up first; data for a stored key is still a hit with
    the stored item's prompt updates, even data the codec refuses, which is an error on a
    miss."""
    handle = put(sender, "a")
    for data in (make_item("other"), {"x": object()}):
        again, updates = sender.get_and_update_item((data, ["new"]), "a")
        assert again == handle and updates == ["pu-a"]
        sender.release_handles([again])
    assert sender.make_stats() == CacheInfo(2, 3)
    with pytest.raises(TypeError, match=r"field item\['x'\]"):
        sender.get_and_update_item(({"x": object()}, ["new"]), "b")
    assert not sender.is_cached_item("b")


def test_another_thread_puts_while_stats_walks_the_store(sender: ShmSenderCache) -> None:
    """The store's ``stats()`` walks the whole ring (milliseconds in a large one): the cache's
    lock is not held meanwhile, so the writer's other threads go on."""
    put(sender, "a")
    store = sender._store
    finished = []

    class Watched:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def stats(self) -> dict[str, int]:
            other = threading.Thread(target=put, args=(sender, "b"))
            other.start()
            other.join(timeout=60)  # only a bound for a failure: it returns as soon as it puts
            finished.append(not other.is_alive())
            return store.stats()

    sender._store = Watched()  # type: ignore[assignment]
    try:
        stats = sender.stats()
    finally:
        sender._store = store
    assert finished == [True], "the put waited for the cache's lock, held across the walk"
    assert stats["store_objects"] == 2 and cached(sender, "ab") == {"a", "b"}


def test_verify_is_side_effect_free_and_tracks_the_current_entry(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    handle = put(sender, "a")
    before = sender.stats()
    assert sender.verify(handle, "a")
    assert not sender.verify(handle, "b"), "signed for another key"
    forged = ShmHandle(
        address=handle.address, monotonic_id=handle.monotonic_id + 1, signature=handle.signature
    )
    assert not sender.verify(forged, "a")
    assert not sender.verify({"pixel_values": 1}, "a")
    after = sender.stats()
    for counter in ("hits", "total", "store_refs_issued", "store_outstanding_refs"):
        assert after[counter] == before[counter], counter
    sender.invalidate("a")
    assert not sender.verify(handle, "a"), "no longer the current entry"
    fresh = put(sender, "a")
    assert sender.verify(fresh, "a") and not sender.verify(handle, "a")


def test_verify_refuses_an_mm_hash_that_is_no_str_naming_it(sender: ShmSenderCache) -> None:
    # verify(handle, 5) was the core's "'int' object is not an instance of 'str'", naming
    # neither the call nor mm_hash; a lone surrogate was a UnicodeEncodeError about a codec.
    handle = put(sender, "a")
    for bad in (5, b"a", ("a",), None):
        with pytest.raises(
            TypeError,
            match=rf"^verify\(handle, mm_hash\): mm_hash must be a str, not {type(bad).__name__}$",
        ):
            sender.verify(handle, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mm_hash '\\ud800' holds a lone surrogate"):
        sender.verify(handle, "\ud800")
    assert sender.verify(handle, "a")


def test_hit_returns_a_handle_and_the_prompt_updates(sender: ShmSenderCache) -> None:
    handle = put(sender, "a")
    assert isinstance(handle, ShmHandle)
    assert sender.is_cached(["a", "b"]) == [True, False]
    assert sender.make_stats() == CacheInfo(0, 1)  # is_cached counted nothing
    again, updates = sender.get_and_update_item(None, "a")
    assert isinstance(again, ShmHandle) and updates == ["pu-a"]
    assert sender.make_stats(delta=True) == CacheInfo(1, 2)
    assert sender.make_stats(delta=True) == CacheInfo(0, 0)
    stats = sender.stats()
    assert stats["hits"] == 1 and stats["total"] == 2 and stats["uncached_oversize"] == 0
    assert any(k.startswith("store_") for k in stats)


def test_is_cached_item_sees_invalidation_and_keeps_no_cache_alive() -> None:
    cache = ShmSenderCache(RING / GiB, max_object_size_mb=1)
    put(cache, "a")
    assert cache.is_cached_item("a") and not cache.is_cached_item("b")
    cache.invalidate("a")
    assert not cache.is_cached_item("a")
    with pytest.raises(TypeError):
        cache.is_cached_item(b"a")  # type: ignore[arg-type]
    gone = weakref.ref(cache)
    cache.close()
    del cache
    gc.collect()
    assert gone() is None, "the native is_cached_item keeps its cache alive"


def test_is_cached_item_answers_every_argument_as_the_full_check_does() -> None:
    # The native function answers an exact str stored and kept, or not stored, given by
    # position, by itself; everything else (a str subclass, a keyword, a key it cannot
    # encode, another type, a wrong number of arguments, a closed store) goes through the
    # full check, with its answer or its error.
    class Key(str):
        pass

    cache = ShmSenderCache(RING / GiB, max_object_size_mb=1)
    put(cache, "a")
    assert cache.is_cached_item(Key("a")) and not cache.is_cached_item(Key("b"))
    assert cache.is_cached_item(mm_hash="a") and not cache.is_cached_item(mm_hash="b")
    for args, kwargs in [
        ((), {}),
        (("a", "b"), {}),
        ((), {"key": "a"}),
        (("a",), {"mm_hash": "a"}),
    ]:
        with pytest.raises(TypeError, match="one argument, mm_hash"):
            cache.is_cached_item(*args, **kwargs)
    with pytest.raises(ValueError, match=r"mm_hash '\\ud800' holds a lone surrogate"):
        cache.is_cached_item("\ud800")
    for bad in (None, 1, b"a"):
        with pytest.raises(TypeError, match=r"^is_cached_item\(mm_hash\): mm_hash must be a str"):
            cache.is_cached_item(bad)  # type: ignore[arg-type]
    check = cache.is_cached_item
    cache.close()
    with pytest.raises(ClosedError):
        check("a")


def test_is_cached_item_of_subclasses_and_of_a_cache_never_opened() -> None:
    # `is_cached_item` is a C method of `ShmSenderCache` (its native base's, set on the class
    # itself); a subclass inherits it or overrides it like any method.
    class Plain(ShmSenderCache):
        pass

    class Overriding(ShmSenderCache):
        def is_cached_item(self, mm_hash: str) -> bool:
            return mm_hash == "always"

    for cls in (Plain, Overriding):
        with cls(RING / GiB, max_object_size_mb=1) as cache:
            put(cache, "a")
            answers = [cache.is_cached_item(h) for h in ("a", "b", "always")]
            assert answers == ([True, False, False] if cls is Plain else [False, False, True])
            assert cache.is_cached(["a", "always"]) == answers[::2]
            with pytest.raises(RuntimeError, match="answered already"):
                cache._check_with(cache._store, {})
    never_opened = ShmSenderCache.__new__(ShmSenderCache)
    with pytest.raises(RuntimeError, match="never opened"):
        never_opened.is_cached_item("a")


def test_miss_without_data_raises(sender: ShmSenderCache) -> None:
    with pytest.raises(CacheMissError) as info:
        sender.get_and_update_item(None, "nope")
    assert info.value.mm_hashes == ["nope"]


def test_oversize_items_are_served_uncached(caplog: pytest.LogCaptureFixture) -> None:
    with ShmSenderCache(RING / GiB, max_object_size_mb=32 * KiB / MiB) as sender:
        big1, big2 = make_item("big1", 40 * KiB), make_item("big2", 40 * KiB)
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            assert put(sender, "big1", big1) is big1
            assert put(sender, "big2", big2) is big2
            assert isinstance(put(sender, "small", make_item("small", KiB)), ShmHandle)
        assert sender.is_cached(["big1", "big2", "small"]) == [False, False, True]
        assert sender.stats()["uncached_oversize"] == 2
        records = [r for r in caplog.records if r.name == "mmcache"]
        assert len(records) == 1
        assert "larger than max_object_size_mb=0.03125" in records[0].getMessage()
        assert "capacity_gb" not in records[0].getMessage()


def test_an_item_larger_than_the_ring_names_the_ring_not_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The default limit (128 MiB) is lowered to what a small ring holds: raising it would
    # change nothing, so the message names the ring's size and capacity_gb.
    with ShmSenderCache(RING / GiB) as sender:
        big = make_item("big", RING)
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            assert put(sender, "big", big) is big
        (record,) = [r for r in caplog.records if r.name == "mmcache"]
        message = record.getMessage()
        assert "max_object_size_mb=128 was lowered to what a ring of 0.21875 MiB holds" in message
        assert "raise capacity_gb" in message


def test_full_ring_of_unread_objects_serves_uncached(
    sender: ShmSenderCache, reader: ShmReceiverCache, caplog: pytest.LogCaptureFixture
) -> None:
    handles = [put(sender, k) for k in "abc"]  # the reader reads none: all protected
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        d, e = make_item("d"), make_item("e")
        assert put(sender, "d", d) is d
        assert put(sender, "e", e) is e
    assert sender.stats()["uncached_full"] == 2
    assert len([r for r in caplog.records if r.name == "mmcache"]) == 1

    # The request carrying a and b was aborted: giving their references back frees room.
    def outstanding() -> int:
        (slot,) = mmcache.inspect(sender.name)["readers"]
        return int(slot["outstanding"])

    assert outstanding() == 3
    sender.release_handles([handles[0], None, d, handles[1]])
    assert outstanding() == 1, "inspect still counts the references given back"
    sender.release_handles([handles[0]])  # given back already: nothing more
    assert outstanding() == 1
    assert isinstance(put(sender, "d"), ShmHandle)
    assert cached(sender, "abcd") in ({"b", "c", "d"}, {"a", "c", "d"})


# -- eviction --------------------------------------------------------------------------------


def test_eviction_spares_unread_and_pinned_objects(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    ha, hb, hc = (put(sender, k) for k in "abc")
    reader.get_and_update_item(ha, "a")
    reader.get_and_update_item(hc, "c")  # "b" stays unread
    hd = put(sender, "d")
    assert isinstance(hd, ShmHandle)
    assert cached(sender, "abcd") == {"b", "c", "d"}  # "a": read, oldest
    with pytest.raises(CacheMissError):  # a replay of a's handle finds it gone
        reader.get_and_update_item(ha, "a")
    reader.get_and_update_item(hd, "d")
    # A request [e, c]: P0 touches both first, so writing "e" cannot evict "c".
    for key in "ec":
        sender.touch_sender_cache_item(key)
    he = put(sender, "e")
    hc2, _ = sender.get_and_update_item(None, "c")
    assert isinstance(he, ShmHandle) and isinstance(hc2, ShmHandle)
    assert cached(sender, "abcde") == {"b", "c", "e"}  # only "d" was reclaimable
    assert same_item(reader.get_and_update_item(hb, "b"), make_item("b"))
    assert same_item(reader.get_and_update_item(hc2, "c"), make_item("c"))


def test_released_touches_no_longer_protect(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    for key in "abc":
        reader.get_and_update_item(put(sender, key), key)
    sender.touch_sender_cache_item("a")
    sender.touch_sender_cache_item("absent")  # nothing to pin
    sender.release_sender_touches()  # the request was abandoned
    put(sender, "d")
    assert cached(sender, "abcd") == {"b", "c", "d"}


def test_a_request_that_misses_part_way_gives_its_handles_back(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    for key in "abc":
        reader.get_and_update_item(put(sender, key), key)
    # "a" is cached when the request is checked, but it was not touched (not pinned), so
    # writing "d" reclaims it (the oldest read object) before its update: a part-way miss.
    with pytest.raises(CacheMissError) as miss:
        sender.get_and_update([(make_item("d"), []), None], ["d", "a"])
    assert miss.value.mm_hashes == ["a"] and cached(sender, "abcd") == {"b", "c", "d"}
    stats = sender.stats()
    assert stats["store_outstanding_refs"] == 0, "d's handle was issued and lost"
    assert stats["store_pinned"] == 0


def test_ending_a_request_unpins_the_items_it_touched_but_never_updated(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    for key in "ab":
        reader.get_and_update_item(put(sender, key), key)
    sender.begin_request()
    for key in "ab":
        sender.touch_sender_cache_item(key)
    assert sender.stats()["store_pinned"] == 2
    data, _ = sender.get_and_update_item(None, "a")  # "b"'s update never comes
    assert sender.stats()["store_pinned"] == 1, "b stays pinned until the request ends"
    sender.end_request()
    assert sender.stats()["store_pinned"] == 0, "an abandoned touch kept b pinned"
    assert same_item(reader.get_and_update_item(data, "a"), make_item("a"))
    # Nothing is pinned any more: a ring's worth of new items evicts both.
    for i in range(8):
        reader.get_and_update_item(put(sender, f"n{i}"), f"n{i}")
    assert cached(sender, "ab") == set()


def test_a_request_that_cannot_be_assembled_issues_nothing(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    reader.get_and_update_item(put(sender, "a"), "a")
    for key in "bac":
        sender.touch_sender_cache_item(key)
    before = sender.make_stats()
    with pytest.raises(CacheMissError) as miss:
        sender.get_and_update([None, (make_item("a"), []), None], ["b", "a", "c"])
    assert miss.value.mm_hashes == ["b", "c"]  # every missing hash, in request order
    stats = sender.stats()
    assert stats["store_outstanding_refs"] == 0 and stats["store_pinned"] == 0
    assert sender.make_stats() == before  # nothing was looked up, nothing issued


def test_a_pinned_object_survives_a_full_sweep(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    for key in "abc":
        reader.get_and_update_item(put(sender, key), key)
    sender.touch_sender_cache_item("a")
    for key in "defg":
        reader.get_and_update_item(put(sender, key), key)
        assert sender.is_cached_item("a")
    handle, updates = sender.get_and_update_item(None, "a")
    assert updates == ["pu-a"]
    assert same_item(reader.get_and_update_item(handle, "a"), make_item("a"))


def test_zero_copy_view_keeps_its_object(sender: ShmSenderCache) -> None:
    with ShmReceiverCache(sender.handle(), copy=False) as reader:
        view = reader.get_and_update_item(put(sender, "a"), "a")
        for key in "bcdef":
            reader.get_and_update_item(put(sender, key), key)  # views dropped at once
            assert sender.is_cached_item("a")
        assert same_item(view, make_item("a"))
        del view
        for key in "ghi":
            reader.get_and_update_item(put(sender, key), key)
        assert not sender.is_cached_item("a")


# -- the receiver ----------------------------------------------------------------------------

TORCH_CASES = {
    "f32": torch.randn(3, 5),
    "bf16": torch.randn(4, 6).to(torch.bfloat16),
    "f16_t": torch.randn(5, 3).half().t(),
    "i64_strided": torch.arange(40)[::3],
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.25, dtype=torch.float64),
    "empty": torch.empty(0, 7),
    "nested": [torch.ones(2, dtype=torch.int8), {"deep": torch.zeros(1, 1)}],
}
NUMPY_CASES = {
    "np_f4": np.arange(12, dtype=np.float32).reshape(3, 4),
    "np_t": np.arange(12, dtype=np.int16).reshape(3, 4).T,
    "np_scalar": np.array(5, dtype=np.uint32),
    "np_empty": np.zeros((2, 0)),
    "meta": {"size": (448, 448), "name": "cat.png", "ratio": 0.5, "blob": b"x" * 1000},
}


def _bits(value: Any) -> Any:
    """A comparable, bit-exact picture of a value (dtype, shape and raw bytes)."""
    if isinstance(value, torch.Tensor):
        raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", value.dtype, tuple(value.shape), raw)
    if isinstance(value, np.ndarray):
        return ("array", value.dtype, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (type(value), [_bits(v) for v in value])
    return value


@pytest.mark.parametrize("copy", [True, False])
def test_round_trip_through_shared_memory_is_bit_exact(sender: ShmSenderCache, copy: bool) -> None:
    item = {**TORCH_CASES, **NUMPY_CASES}
    handle = put(sender, "item", item)
    with ShmReceiverCache(sender.handle(), copy=copy) as reader, warnings.catch_warnings():
        warnings.simplefilter("error")
        out = reader.get_and_update_item(handle, "item")
        assert _bits(out) == _bits(item)
        pixels = out["f32"]
        assert pixels.is_contiguous()
        if copy:
            pixels.add_(1)  # owned memory: writable, the ring is untouched
        else:
            assert not out["np_f4"].flags.writeable
        del out, pixels
        handle2, _ = sender.get_and_update_item(None, "item")
        assert _bits(reader.get_and_update_item(handle2, "item")) == _bits(item)


def test_round_trip_through_the_lru_pair_is_bit_exact() -> None:
    item = {**TORCH_CASES, **NUMPY_CASES}
    sender, receiver = make_caches("lru", capacity_gb=0.01)
    assert sender is not None and isinstance(receiver, ReceiverCache)
    for _ in range(2):  # a miss (data sent), then a hit (None sent)
        ((data, _),) = sender.get_and_update([(item, [])], ["item"])
        features = receiver.get_and_update_features([Feature(data, mm_hash="item")])
        assert _bits(features[0].data) == _bits(item)
    assert data is None


def test_features_mix_handles_plain_items_and_stripped_payloads(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    plain = make_item("plain", 10)
    features = [
        Feature(put(sender, "a"), mm_hash="a", identifier="a", modality="image"),
        Feature(None, mm_hash="b", identifier="b"),  # payload stripped by the engine
        Feature(plain, mm_hash="p", identifier="p"),  # served uncached by P0
    ]
    assert reader.get_and_update_features(features) is features
    assert same_item(features[0].data, make_item("a"))
    assert features[1].data is None
    assert features[2].data is plain


def test_gone_objects_are_misses_listed_in_order(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    ha, hb, hc = (put(sender, k) for k in "abc")  # the ring is full
    sender.release_handles([ha, hc])  # as if their first delivery was aborted ...
    put(sender, "d")  # ... so new items reclaim them; "b" is still held by its handle
    put(sender, "e")
    assert cached(sender, "abcde") == set("bde")
    features = [
        Feature(h, mm_hash=k, identifier=k) for h, k in zip((ha, hb, hc), "abc", strict=True)
    ]
    with pytest.raises(CacheMissError) as info:
        reader.get_and_update_features(features)
    assert info.value.mm_hashes == ["a", "c"]
    assert same_item(features[1].data, make_item("b"))
    # The retry with data attached succeeds.
    retry = [Feature(put(sender, k), mm_hash=k, identifier=k) for k in "ac"]
    reader.get_and_update_features(retry)
    assert same_item(retry[0].data, make_item("a")) and same_item(retry[1].data, make_item("c"))


def test_batched_update_resolves_every_handle_and_reports_every_miss(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    # get_and_update stopped at the first gone object: the other misses went unreported and
    # the handles after it unread, so their references pinned the ring.
    ha, hb, hc = (put(sender, k) for k in "abc")  # the ring is full
    sender.release_handles([ha, hb])  # as if their first delivery was aborted ...
    put(sender, "d")  # ... so new items reclaim them; "c" is still held by its handle
    put(sender, "e")
    assert cached(sender, "abcde") == set("cde")
    with pytest.raises(CacheMissError) as info:
        reader.get_and_update([ha, hb, hc], ["a", "b", "c"])
    assert info.value.mm_hashes == ["a", "b"]
    # "c" was read: its reference is given back, so the ring can reclaim it for "f".
    assert isinstance(put(sender, "f"), ShmHandle) and not sender.is_cached_item("c")


def test_a_handle_from_before_a_clear_never_reads_other_data(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    old = put(sender, "h", make_item("old"))
    sender.clear_cache()
    assert sender.make_stats() == CacheInfo(0, 0) and not sender.is_cached_item("h")
    new = put(sender, "h", make_item("new"))
    try:
        got = reader.get_and_update_item(old, "h")
    except CacheMissError:
        pass
    else:
        assert same_item(got, make_item("old"))
    assert same_item(reader.get_and_update_item(new, "h"), make_item("new"))


def test_a_clear_that_keeps_in_flight_handles_lets_them_read_their_own_data(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    in_flight = {k: put(sender, k) for k in "ab"}
    sender.clear_cache(keep_in_flight=True)
    assert sender.make_stats() == CacheInfo(0, 0) and cached(sender, "ab") == set()
    assert not sender.verify(in_flight["a"], "a")
    # The ring is refilled with new objects (RING holds three): the in-flight handles
    # keep their objects until read.
    for k in "cdef":
        put(sender, k)
    for k, handle in in_flight.items():
        assert same_item(reader.get_and_update_item(handle, k), make_item(k))
    # Read, and no longer cached: their space is reclaimed for new items.
    assert isinstance(put(sender, "g"), ShmHandle) and isinstance(put(sender, "h"), ShmHandle)


def test_forged_or_misdirected_handles_are_rejected(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    handle = put(sender, "a")
    put(sender, "b")
    sig = bytearray(handle.signature)
    sig[0] ^= 1
    forged = ShmHandle(
        address=handle.address, monotonic_id=handle.monotonic_id, signature=bytes(sig)
    )
    with pytest.raises(InvalidHandleError):
        reader.get_and_update_item(forged, "a")
    with pytest.raises(InvalidHandleError):
        reader.get_and_update_item(handle, "b")
    with pytest.raises(TypeError):
        reader.get_and_update_item(42, "a")  # type: ignore[arg-type]
    assert same_item(reader.get_and_update_item(handle, "a"), make_item("a"))


def test_a_forged_handle_does_not_leave_the_rest_of_its_request_unread(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    ha, hb, hc = (put(sender, k) for k in "abc")
    forged = ShmHandle(address=ha.address, monotonic_id=ha.monotonic_id, signature=bytes(16))
    features = [
        Feature(h, mm_hash=k, identifier=k) for h, k in zip((forged, hb, hc), "abc", strict=True)
    ]
    with pytest.raises(InvalidHandleError):
        reader.get_and_update_features(features)
    # b and c were still read (their references given back) and resolved.
    assert same_item(features[1].data, make_item("b"))
    assert same_item(features[2].data, make_item("c"))
    assert sender.stats()["store_outstanding_refs"] == 1  # only the genuine handle of a


def test_a_forged_handle_given_to_release_handles_does_not_keep_the_rest_pinned(
    sender: ShmSenderCache, reader: ShmReceiverCache
) -> None:
    """An aborted request's handles are all given back even when one of them is forged or
    truncated: its error comes once the rest are released (as a request's resolve does)."""
    ha, hb = put(sender, "a"), put(sender, "b")
    truncated = ShmHandle(address=ha.address, monotonic_id=ha.monotonic_id, signature=b"x")
    forged = ShmHandle(
        address=ha.address, monotonic_id=ha.monotonic_id, signature=bytes(16) + ha.signature[16:]
    )
    for bad, good in ((truncated, ha), (forged, hb)):
        with pytest.raises(InvalidHandleError):
            sender.release_handles([bad, good])
    assert sender.stats()["store_outstanding_refs"] == 0
    # Both given back: a ring of three objects takes three new ones without serving uncached.
    assert all(isinstance(put(sender, k), ShmHandle) for k in "cde")


def test_a_reader_handle_of_another_secret_is_refused_at_attach() -> None:
    """A stale handle (its name since taken by a new ring) fails at once, taking no slot,
    rather than failing every handle it would read."""
    with ShmSenderCache(RING / GiB, n_readers=1) as sender:
        mine = sender.handle()
        fields = {f: getattr(mine, f) for f in ("name", "capacity", "n_readers")}
        fields |= {"max_object_size": mine.max_object_size, "secret": bytes(32)}
        stale = ReaderHandle(**fields, layout_version=mine.layout_version)
        with pytest.raises(InvalidHandleError, match="secret"):
            ShmReceiverCache(stale)
        ShmReceiverCache(mine).close()  # the only slot is still free


def test_each_receiver_takes_a_reader_slot() -> None:
    with ShmSenderCache(RING / GiB, n_readers=2) as sender:
        first, second = ShmReceiverCache(sender.handle()), ShmReceiverCache(sender.handle())
        with pytest.raises(MmcacheError):
            ShmReceiverCache(sender.handle())
        second.close()
        second.close()  # idempotent
        third = ShmReceiverCache(sender.handle())
        handle = put(sender, "a")
        for r in (first, third):
            assert same_item(r.get_and_update_item(handle, "a"), make_item("a"))
        first.close()
        third.close()


def test_invalidate_forgets_a_key(sender: ShmSenderCache, reader: ShmReceiverCache) -> None:
    handle = put(sender, "a")
    sender.touch_sender_cache_item("a")
    sender.invalidate("a")
    sender.invalidate("never-seen")
    assert not sender.is_cached_item("a")
    # The handle already in flight still reads the right data (or misses), never other data.
    with contextlib.suppress(CacheMissError):
        assert same_item(reader.get_and_update_item(handle, "a"), make_item("a"))
    assert isinstance(put(sender, "a", make_item("a2")), ShmHandle)
    handle2, updates = sender.get_and_update_item(None, "a")
    assert updates == ["pu-a"]
    assert same_item(reader.get_and_update_item(handle2, "a"), make_item("a2"))


def test_clear_and_close_are_safe_to_repeat(sender: ShmSenderCache) -> None:
    put(sender, "a")
    sender.clear_cache()
    sender.clear_cache()
    assert sender.is_cached(["a"]) == [False]
    sender.close()
    sender.close()


# -- several processes -----------------------------------------------------------------------


def _worker(handle: Any, requests: list[list[tuple[str, Any]]], copy: bool, out: Any) -> None:
    """A worker process: resolve every request's features, report their content hashes."""
    with ShmReceiverCache(handle, copy=copy) as receiver:
        hashes = []
        for request in requests:
            features = [Feature(h, mm_hash=k, identifier=k) for k, h in request]
            receiver.get_and_update_features(features)
            hashes.append([content_hash(f.data) for f in features])
        out.put(hashes)


def test_two_spawned_workers_resolve_identical_tensors() -> None:
    truth = {
        "img": {"pixel_values": torch.randn(3, 64, 64), "grid": torch.tensor([1, 8, 8])},
        "bf16": {"x": torch.randn(16, 16).to(torch.bfloat16).t()},
        "np": {"a": np.arange(100, dtype=np.float64).reshape(10, 10)},
    }
    ctx = mp.get_context("spawn")
    with ShmSenderCache(4 * MiB / GiB, n_readers=2) as sender:
        requests = []
        for keys in (["img", "bf16"], ["np", "img"], ["bf16", "np", "img"]):
            outputs = sender.get_and_update([(truth[k], []) for k in keys], keys)
            assert all(isinstance(d, ShmHandle) for d, _ in outputs)
            requests.append([(k, d) for k, (d, _) in zip(keys, outputs, strict=True)])
        queues = [ctx.Queue(), ctx.Queue()]
        workers = [
            ctx.Process(target=_worker, args=(sender.handle(), requests, copy, q))
            for copy, q in zip((True, False), queues, strict=True)
        ]
        for w in workers:
            w.start()
        results = [q.get(timeout=120) for q in queues]
        for w in workers:
            w.join(timeout=60)
            assert w.exitcode == 0
        expected = [[content_hash(truth[k]) for k, _ in request] for request in requests]
        assert results == [expected, expected]
        assert sender.make_stats() == CacheInfo(4, 7)


@pytest.mark.parametrize(
    ("flag", "value"), [("copy", None), ("copy", 0), ("copy", "no"), ("pin_memory", "yes")]
)
def test_a_receiver_flag_that_is_no_bool_is_refused_before_it_takes_a_slot(
    flag: str, value: Any
) -> None:
    # copy=None or 0 was accepted, then every resolve in the worker raised "'NoneType' object
    # is not an instance of 'bool'"; copy="no" silently meant copies.
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1, n_readers=1) as p0:
        with pytest.raises(TypeError, match=f"^{flag} must be True or False, not "):
            ShmReceiverCache(p0.handle(), **{flag: value})
        # The one reader slot is still free; numpy's bool is a bool.
        with ShmReceiverCache(p0.handle(), copy=np.bool_(False)) as worker:
            handle, _ = p0.get_and_update_item(({"x": torch.ones(4)}, None), "a")
            assert worker.get_and_update_item(handle, "a")["x"].tolist() == [1.0] * 4


def test_a_worker_given_the_sender_instead_of_its_handle_names_what_it_takes(
    sender: ShmSenderCache,
) -> None:
    # Was PyO3's "'ShmSenderCache' object is not an instance of 'ReaderHandle'", which did not
    # say where a ReaderHandle comes from.
    for wrong in (sender, sender.writer_handle(), None):
        with pytest.raises(TypeError, match=r"ShmReceiverCache takes a ReaderHandle \(from"):
            ShmReceiverCache(wrong)  # type: ignore[arg-type]
    ShmReceiverCache(sender.handle()).close()  # no reader slot was taken by the refusals
