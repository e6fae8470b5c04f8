"""LRUCache and CacheInfo."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import cachetools
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from mmcache import CacheInfo, LRUCache


def unit_cache(capacity: int) -> LRUCache:
    return LRUCache(capacity, getsizeof=lambda v: 1)


def test_cache_info() -> None:
    assert CacheInfo(0, 0).hit_ratio == 0.0
    assert CacheInfo(3, 4).hit_ratio == 0.75
    assert CacheInfo(5, 9) - CacheInfo(2, 4) == CacheInfo(3, 5)
    assert isinstance(CacheInfo(5, 9) - CacheInfo(2, 4), CacheInfo)


def test_stat_of_a_delta_that_is_no_bool_is_a_type_error() -> None:
    # stat(delta="no") gave a delta (and moved the delta mark), as the caches' make_stats did.
    cache = LRUCache(10)
    cache.get("a")
    for bad in ("no", 1, None):
        with pytest.raises(TypeError, match=r"^delta must be True or False, not "):
            cache.stat(bad)  # type: ignore[arg-type]
    assert cache.stat(delta=True) == CacheInfo(0, 1)  # the mark had not moved


def test_cache_info_minus_what_is_no_cache_info_is_a_type_error() -> None:
    # CacheInfo(5, 9) - 1 (or - a plain pair) was "'int' object has no attribute 'hits'", an
    # AttributeError from inside __sub__, where Python's operators raise a TypeError.
    for other in (1, (2, 4), None):
        with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for -: 'CacheInfo'"):
            CacheInfo(5, 9) - other  # type: ignore[operator]


def test_evicts_least_recently_used_and_counts_lookups() -> None:
    cache = unit_cache(3)
    cache.put(1, "a")
    cache.put(1, "a")
    cache.put(2, "b")
    cache.put(3, "c")
    assert len(cache) == 3
    assert cache.get(1) == "a"  # 1 becomes most recent
    cache.put(4, "d")  # evicts 2
    assert cache.recency_order() == [3, 1, 4]
    assert cache.evictions == 1
    assert cache.stat() == CacheInfo(1, 1)
    assert cache.stat(delta=True) == CacheInfo(1, 1)
    assert cache.get(2) is None and cache.get(2, "dflt") == "dflt"
    assert cache.stat() == CacheInfo(1, 3)
    assert cache.stat(delta=True) == CacheInfo(0, 2)
    assert cache.stat(delta=True) == CacheInfo(0, 0)


def test_contains_neither_counts_nor_reorders() -> None:
    cache = unit_cache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert "a" in cache and "zz" not in cache
    assert cache.stat() == CacheInfo(0, 0)
    cache.put("c", 3)  # "a" is still the least recent
    assert "a" not in cache and cache.recency_order() == ["b", "c"]


def test_touch_moves_to_most_recent_and_ignores_absent_keys() -> None:
    cache = unit_cache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.touch("a")
    assert cache.recency_order() == ["b", "a"]
    cache.touch("ghost")
    assert "ghost" not in cache and cache.recency_order() == ["b", "a"]
    cache.put("c", 3)  # evicts "b", terminates, no phantom entry
    assert cache.recency_order() == ["a", "c"]
    assert cache.stat() == CacheInfo(0, 0)


def test_size_aware_eviction_and_put_if_fits() -> None:
    cache = LRUCache(100)
    cache.put("a", {"x": np.zeros(40, dtype=np.uint8)})
    cache.put("b", {"x": np.zeros(40, dtype=np.uint8)})
    assert cache.currsize == 80
    assert cache.put_if_fits("c", {"x": np.zeros(50, dtype=np.uint8)})  # evicts "a"
    assert cache.recency_order() == ["b", "c"] and cache.currsize == 90
    assert not cache.put_if_fits("huge", {"x": np.zeros(101, dtype=np.uint8)})
    assert "huge" not in cache and cache.recency_order() == ["b", "c"]
    with pytest.raises(ValueError, match="cannot fit"):
        cache.put("huge", {"x": np.zeros(101, dtype=np.uint8)})
    assert cache.put_if_fits("exact", {"x": np.zeros(100, dtype=np.uint8)})
    assert cache.recency_order() == ["exact"]


def test_replacing_a_value_updates_its_size_and_recency() -> None:
    cache = LRUCache(100)
    cache.put("a", b"x" * 10)
    cache.put("b", b"x" * 10)
    cache.put("a", b"x" * 60)
    assert cache.currsize == 70 and cache.recency_order() == ["b", "a"]


def make_room_as_cachetools_before_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """cachetools before 8.0 (pyproject allows 5.3 on) made room for a replacing value's
    whole size while the value it replaces still took its own: it evicted more than needed,
    and when only protected entries were left, ``popitem`` raised ``KeyError``."""
    installed = cachetools.Cache.__setitem__

    def setitem(cache: cachetools.Cache, key: Hashable, value: Any) -> None:  # type: ignore[type-arg]
        size = cache.getsizeof(value)
        if key in cache and size > cache.getsizeof(cachetools.Cache.__getitem__(cache, key)):
            while cache.currsize + size > cache.maxsize:
                cache.popitem()
        installed(cache, key, value)

    monkeypatch.setattr(cachetools.Cache, "__setitem__", setitem)


@pytest.mark.parametrize("cachetools_room", ["installed", "before 8.0"])
def test_a_protected_entry_replaced_by_a_bigger_value_that_fits_evicts_nothing_needed(
    cachetools_room: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1 replaces a protected item with a bigger payload under the same key: the old value's
    room is given back before any eviction, whatever cachetools does."""
    if cachetools_room != "installed":
        make_room_as_cachetools_before_8(monkeypatch)
    cache = LRUCache(100, getsizeof=len)
    for key, size in (("p", 30), ("q", 20)):
        cache.put(key, b"x" * size)
        cache.protect(key)
    cache.put("a", b"x" * 20)
    cache.put("p", b"x" * 60)  # 60 + 20 + 20 = 100: everything still fits
    assert cache.recency_order() == ["q", "a", "p"] and cache.currsize == 100
    assert cache.is_protected("p") and cache.protected_bytes == 80
    assert cache.evictions == 0


def test_pop_and_clear() -> None:
    cache = unit_cache(3)
    for key in "xyzw":
        cache.put(key, 0)
    cache.clear()
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.evictions == 0
    assert cache.pop("a") == 1 and cache.pop("a") is None and cache.pop("a", 0) == 0
    cache.get("b")
    cache.get("nope")
    assert cache.stat() == CacheInfo(1, 2)
    cache.clear()
    assert cache.evictions == 0
    assert len(cache) == 0 and cache.currsize == 0
    assert cache.stat() == CacheInfo(0, 0) and cache.stat(delta=True) == CacheInfo(0, 0)


class LRUAgainstModel(RuleBasedStateMachine):
    """Random operations against a tiny model; every insert must terminate and agree."""

    CAPACITY = 20

    def __init__(self) -> None:
        super().__init__()
        self.cache = LRUCache(self.CAPACITY, getsizeof=len)
        self.model: OrderedDict[str, bytes] = OrderedDict()
        self.hits = self.total = 0

    keys = st.sampled_from("abcdefg")

    @rule(key=keys, size=st.integers(0, 25))
    def put_if_fits(self, key: str, size: int) -> None:
        value = b"v" * size
        fits = self.cache.put_if_fits(key, value)
        assert fits == (size <= self.CAPACITY)
        if fits:
            self.model.pop(key, None)
            while sum(map(len, self.model.values())) + size > self.CAPACITY:
                self.model.popitem(last=False)
            self.model[key] = value

    @rule(key=keys)
    def get(self, key: str) -> None:
        self.total += 1
        if key in self.model:
            self.hits += 1
            self.model.move_to_end(key)
        assert self.cache.get(key) == self.model.get(key)

    @rule(key=keys)
    def touch(self, key: str) -> None:
        if key in self.model:
            self.model.move_to_end(key)
        self.cache.touch(key)

    @rule(key=keys)
    def pop(self, key: str) -> None:
        assert self.cache.pop(key) == self.model.pop(key, None)

    @rule(key=keys)
    def contains(self, key: str) -> None:
        assert (key in self.cache) == (key in self.model)

    @invariant()
    def agrees(self) -> None:
        assert self.cache.recency_order() == list(self.model)
        assert self.cache.currsize == sum(map(len, self.model.values())) <= self.CAPACITY
        assert self.cache.stat() == CacheInfo(self.hits, self.total)


MODEL_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUAgainstModel = LRUAgainstModel.TestCase
TestLRUAgainstModel.settings = MODEL_SETTINGS


def test_agrees_with_the_model_on_cachetools_before_8(monkeypatch: pytest.MonkeyPatch) -> None:
    make_room_as_cachetools_before_8(monkeypatch)
    run_state_machine_as_test(LRUAgainstModel, settings=MODEL_SETTINGS)


class ProtectedLRUAgainstModel(LRUAgainstModel):
    """The model with protected entries: eviction takes the least recent entry that is not
    protected, and a value fits only beside the protected ones (the cache parks protected
    entries it passes, so the order it keeps must still be the model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.protected: set[str] = set()

    keys = st.sampled_from("abcdefg")

    @rule(key=keys, size=st.integers(0, 25))
    def put_if_fits(self, key: str, size: int) -> None:
        value = b"v" * size
        others = sum(len(v) for k, v in self.model.items() if k in self.protected and k != key)
        fits = self.cache.put_if_fits(key, value)
        assert fits == (size <= self.CAPACITY - others)
        if fits:
            self.model.pop(key, None)
            while sum(map(len, self.model.values())) + size > self.CAPACITY:
                oldest = next(k for k in self.model if k not in self.protected)
                del self.model[oldest]
            self.model[key] = value

    @rule(key=keys)
    def pop(self, key: str) -> None:
        assert self.cache.pop(key) == self.model.pop(key, None)
        self.protected.discard(key)

    @rule(key=keys)
    def protect(self, key: str) -> None:
        assert self.cache.protect(key) == (key in self.model)
        if key in self.model:
            self.protected.add(key)

    @rule(key=keys)
    def unprotect(self, key: str) -> None:
        self.cache.unprotect(key)
        self.protected.discard(key)

    @rule()
    def unprotect_all(self) -> None:
        self.cache.unprotect_all()
        self.protected.clear()

    @invariant()
    def protects_the_same(self) -> None:
        assert {k for k in "abcdefg" if self.cache.is_protected(k)} == self.protected
        assert self.cache.protected_bytes == sum(len(self.model[k]) for k in self.protected)


TestProtectedLRUAgainstModel = ProtectedLRUAgainstModel.TestCase
TestProtectedLRUAgainstModel.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)


class RestoredLRUAgainstModel(ProtectedLRUAgainstModel):
    """The model with recency given back: a touch a mirror never saw is undone
    (``restore_recency``), the key going back among the others by its earlier stamp, unless
    something made it recent since. The model keeps stamps of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: dict[str, int] = {}
        self.clock = 0
        # key, the model's stamps before and after the touch, the cache's before and after
        self.touched: list[tuple[str, int, int, int, int]] = []

    keys = st.sampled_from("abcdefg")

    def stamp(self, key: str) -> None:
        self.clock += 1
        self.stamps[key] = self.clock

    @rule(key=keys, size=st.integers(0, 25))
    def put_if_fits(self, key: str, size: int) -> None:
        others = sum(len(v) for k, v in self.model.items() if k in self.protected and k != key)
        super().put_if_fits(key, size)
        if size <= self.CAPACITY - others:
            self.stamp(key)

    @rule(key=keys)
    def get(self, key: str) -> None:
        hit = key in self.model
        super().get(key)
        if hit:
            self.stamp(key)

    @rule(key=keys)
    def touch(self, key: str) -> None:
        super().touch(key)
        if key in self.model:
            self.stamp(key)

    @rule(key=keys)
    def touch_to_undo(self, key: str) -> None:
        if key in self.model:
            model_before, cache_before = self.stamps[key], self.cache.recency(key)
            assert cache_before is not None
            self.touch(key)
            cache_after = self.cache.recency(key)
            assert cache_after is not None and cache_after > cache_before
            self.touched.append((key, model_before, self.stamps[key], cache_before, cache_after))

    @rule(data=st.data())
    def undo(self, data: st.DataObject) -> None:
        if not self.touched:
            return
        i = data.draw(st.integers(0, len(self.touched) - 1))
        key, model_before, model_after, before, after = self.touched.pop(i)
        expected = key in self.model and self.stamps[key] == model_after
        assert self.cache.restore_recency(key, before, since=after) == expected
        if expected:
            self.stamps[key] = model_before
            self.model = OrderedDict(sorted(self.model.items(), key=lambda kv: self.stamps[kv[0]]))

    @invariant()
    def stamps_ascend(self) -> None:
        stamps = [self.cache.recency(key) or 0 for key in self.cache.recency_order()]
        assert 0 not in stamps and stamps == sorted(set(stamps))  # present, ascending
        assert self.cache.recency("absent") is None


TestRestoredLRUAgainstModel = RestoredLRUAgainstModel.TestCase
TestRestoredLRUAgainstModel.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)


def test_restore_recency_gives_a_key_its_place_back_unless_it_moved_since() -> None:
    cache = unit_cache(4)
    for key in "abcd":
        cache.put(key, 1)
    before = cache.recency("b")
    assert before is not None
    cache.touch("b")
    after = cache.recency("b")
    assert after is not None and after > before
    assert cache.recency_order() == ["a", "c", "d", "b"]
    assert not cache.restore_recency("b", before, since=after + 1)  # not where it was left
    assert not cache.restore_recency("b", after, since=after)  # no earlier recency
    assert not cache.restore_recency("absent", before, since=after)
    assert cache.restore_recency("b", before, since=after)
    assert cache.recency_order() == ["a", "b", "c", "d"]
    assert not cache.restore_recency("b", before, since=after)  # once
    cache.put("e", 1)  # evicts a, as if b was never touched
    assert cache.recency_order() == ["b", "c", "d", "e"]
    assert cache.stat() == CacheInfo(0, 0)


def test_restore_recency_puts_a_key_back_at_any_place() -> None:
    keys = [f"k{i}" for i in range(9)]
    cache = unit_cache(len(keys))
    for key in keys:
        cache.put(key, 1)
    for key in keys:
        before = cache.recency(key)
        cache.touch(key)
        after = cache.recency(key)
        assert before is not None and after is not None
        assert cache.restore_recency(key, before, since=after)
        assert cache.recency_order() == keys


def test_restore_recency_among_the_parked_entries_keeps_eviction_in_order() -> None:
    cache = unit_cache(6)
    for key in "abcdef":
        cache.put(key, 1)
    cache.protect("a")
    cache.protect("b")
    cache.put("g", 1)  # evicts c, parking a and b
    before = cache.recency("a")
    cache.touch("a")
    after = cache.recency("a")
    assert before is not None and after is not None
    assert cache.recency_order() == ["b", "d", "e", "f", "g", "a"]
    assert cache.restore_recency("a", before, since=after)  # back before the parked b
    assert cache.recency_order() == ["a", "b", "d", "e", "f", "g"]
    cache.put("h", 1)  # a and b still protected: evicts d
    assert cache.recency_order() == ["a", "b", "e", "f", "g", "h"]
    cache.unprotect("a")
    cache.put("i", 1)  # evicts a, the least recent
    assert cache.recency_order() == ["b", "e", "f", "g", "h", "i"]


def test_protected_entries_at_the_least_recent_end_are_passed_once_then_kept_in_order() -> None:
    """An eviction parks the protected entries it passes at the least recent end: later ones
    do not pass them again, and each keeps its place in the recency order (evicted first
    once unprotected, oldest first, before any entry of the rest)."""
    cache = unit_cache(6)
    for key in "abcdef":
        cache.put(key, 1)
    for key in "abc":
        cache.protect(key)
    cache.put("g", 1)  # evicts d, passing a, b, c
    assert cache.recency_order() == ["a", "b", "c", "e", "f", "g"]
    cache.put("h", 1)  # evicts e
    assert cache.recency_order() == ["a", "b", "c", "f", "g", "h"]
    cache.unprotect("c")
    cache.unprotect("a")
    cache.put("i", 1)  # evicts a (the least recent), not f, nor c
    assert cache.recency_order() == ["b", "c", "f", "g", "h", "i"]
    cache.touch("b")  # made recent: no longer among the parked
    cache.put("j", 1)  # evicts c
    assert cache.recency_order() == ["f", "g", "h", "i", "b", "j"]
    cache.unprotect("b")
    cache.put("k", 1)  # evicts f: b is recent now
    assert cache.recency_order() == ["g", "h", "i", "b", "j", "k"]
    assert cache.evictions == 5


@pytest.mark.parametrize("capacity", [float("nan"), -1, -0.5])
def test_a_capacity_that_is_no_size_is_a_value_error(capacity: float) -> None:
    # NaN compares false with every size: LRUCache(nan) was accepted and then refused every
    # value ("cannot fit in a cache of nan bytes"), a cache that never caches.
    with pytest.raises(ValueError, match="capacity_bytes must be"):
        LRUCache(capacity)


@pytest.mark.parametrize("capacity", ["1024", None])
def test_a_capacity_that_is_no_number_is_a_type_error(capacity: Any) -> None:
    with pytest.raises(TypeError, match="capacity_bytes must be a number of bytes"):
        LRUCache(capacity)


def test_an_infinite_capacity_is_an_unbounded_cache() -> None:
    cache = LRUCache(float("inf"))
    assert cache.put_if_fits("a", b"x" * 1000) and "a" in cache
