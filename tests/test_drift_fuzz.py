"""Drift fuzzing: hypothesis drives the engine models of :mod:`tests.drift` (P0, P1 and the
workers around the real caches) through random request streams and faults, and the model
checks its oracle after every step: (a) every resolved tensor is the truth for its hash, bit
for bit; (b) every request succeeds on its first or second attempt; (c) with no fault, P0
and P1 hold the same keys; (d) nothing raises but ``CacheMissError``, and that only where a
fault could cause it.

The hypothesis budget is a settings profile: ``mmcache-drift-ci`` (the default; fixed
example and step counts, derandomized, about a minute on two cores) or
``mmcache-drift-long`` (``MMCACHE_DRIFT_PROFILE=mmcache-drift-long``).  Longer runs:
``python -m tests.drift --seconds 600`` (from the repository root).

The last section keeps each bug the fuzzer found as a small regression example.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from mmcache import (
    CacheMissError,
    Feature,
    ReceiverCache,
    SenderCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
)
from tests.drift import (
    FAULTS,
    EngineModel,
    FuzzStats,
    OracleFailure,
    make_model,
    run_episode,
)

KiB = 1024
GiB = 1 << 30

settings.register_profile(
    "mmcache-drift-ci",
    max_examples=600,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "mmcache-drift-long",
    parent=settings.get_profile("mmcache-drift-ci"),
    max_examples=1000,
    stateful_step_count=80,
    derandomize=False,
)
PROFILE = settings.get_profile(os.environ.get("MMCACHE_DRIFT_PROFILE", "mmcache-drift-ci"))

MACHINE_STATS = FuzzStats()  # what the state machines exercised, over the whole session

# Request items: ids into the model's universe (reduced modulo its size), 1-6 per request,
# repeats within a request included.
request_ids = st.lists(st.integers(0, 63), min_size=1, max_size=6)


class _DriftMachine(RuleBasedStateMachine):
    """One model per example; every rule is one engine operation, checked by the model."""

    mode = ""

    def __init__(self) -> None:
        super().__init__()
        self.model: EngineModel | None = None

    def _start(self, **config: Any) -> None:
        self.model = make_model(self.mode, stats=MACHINE_STATS, **config)

    # hypothesis picks rules uniformly: plain requests get two rules, so that most steps are
    # fault-free and fault-free stretches (oracle c) are long.
    @rule(ids=request_ids)
    def request(self, ids: list[int]) -> None:
        assert self.model is not None
        self.model.request(ids)

    @rule(ids=request_ids)
    def another_request(self, ids: list[int]) -> None:
        assert self.model is not None
        self.model.request(ids)

    @rule(ids=request_ids, data=st.data())
    def faulty_request(self, ids: list[int], data: st.DataObject) -> None:
        assert self.model is not None
        self.model.request(ids, data.draw(st.sampled_from(FAULTS[self.mode]), label="fault"))

    @rule(a=request_ids, b=request_ids, kind=st.sampled_from(["reorder", "interleave"]))
    def two_requests(self, a: list[int], b: list[int], kind: str) -> None:
        assert self.model is not None
        getattr(self.model, kind)(a, b)

    @rule(ids=request_ids, every=st.integers(0, 3))
    def sometimes_resync(self, ids: list[int], every: int) -> None:
        assert self.model is not None
        if every == 0:
            self.model.resync()
        else:
            self.model.request(ids)

    def teardown(self) -> None:
        if self.model is not None:
            self.model.close()


class LruDrift(_DriftMachine):
    mode = "lru"

    @initialize(
        seed=st.integers(0, 2**16),
        capacity=st.sampled_from([2 * KiB, 4 * KiB, 8 * KiB, 32 * KiB]),
        n_ids=st.integers(2, 24),
    )
    def start(self, seed: int, capacity: int, n_ids: int) -> None:
        self._start(seed=seed, capacity=capacity, n_ids=n_ids)


class ShmDrift(_DriftMachine):
    mode = "shm"

    @initialize(
        seed=st.integers(0, 2**16),
        capacity=st.sampled_from([96 * KiB, 160 * KiB, 256 * KiB]),
        n_ids=st.integers(2, 24),
        copies=st.lists(st.booleans(), min_size=1, max_size=3),
        max_object_fraction=st.sampled_from([0.25, 0.5, 0.9]),
    )
    def start(
        self,
        seed: int,
        capacity: int,
        n_ids: int,
        copies: list[bool],
        max_object_fraction: float,
    ) -> None:
        self._start(
            seed=seed,
            capacity=capacity,
            n_ids=n_ids,
            n_workers=len(copies),
            copies=copies,
            max_object_fraction=max_object_fraction,
        )

    @rule()
    def drop_views(self) -> None:
        assert self.model is not None
        self.model.drop_views()


class ProcessorOnlyDrift(_DriftMachine):
    mode = "processor_only"

    @initialize(
        seed=st.integers(0, 2**16),
        capacity=st.sampled_from([2 * KiB, 8 * KiB, 32 * KiB]),
        n_ids=st.integers(2, 24),
    )
    def start(self, seed: int, capacity: int, n_ids: int) -> None:
        self._start(seed=seed, capacity=capacity, n_ids=n_ids)


TestLruDrift = LruDrift.TestCase
TestLruDrift.settings = PROFILE
TestShmDrift = ShmDrift.TestCase
TestShmDrift.settings = PROFILE
TestProcessorOnlyDrift = ProcessorOnlyDrift.TestCase
TestProcessorOnlyDrift.settings = settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 3))


# -- the fuzzer exercises what it claims, and its oracle bites ------------------------------


def test_every_fault_is_injected_and_every_oracle_is_exercised() -> None:
    stats = FuzzStats()
    # Ten episodes per mode: P0 misses (an interleaving whose second request evicts items
    # the first was told are cached) are rare.
    for episode in range(40):
        run_episode(7, episode, stats, steps=150, fault_rate=0.4)
    for mode, faults in FAULTS.items():
        for fault in faults:
            assert stats.faults[fault] > 0, f"{mode} fault {fault} never injected"
    for op in ("reorder", "interleave"):
        assert stats.faults[op] > 0
    assert stats.modes == {"lru": 10, "shm": 10, "processor_only": 10, "remote": 10}
    assert stats.p1_misses > 0 and stats.p0_misses > 0 and stats.retries > 0
    assert stats.mirror_checks > 0 and stats.replay_misses > 0
    assert stats.tensors_checked > stats.items_checked > 1000
    assert stats.uncached > 0  # oversize items and full rings were served uncached
    # The remote tier served items, and damaged values and dead servers cost misses.
    assert stats.remote_served > 0 and stats.remote_misses > 0


def _swap_values_in_the_store(model: Any, a: int, b: int) -> None:
    """Behind the tier's back, store item ``b``'s value (its chunks too) under item ``a``'s
    key."""
    hash_a, hash_b = model.universe.hash(a), model.universe.hash(b)
    with model._raw() as raw:
        for name in raw.scan_iter(match=f"mmc/{model._namespace}/{hash_b}*"):
            raw.copy(name, name.replace(hash_b.encode(), hash_a.encode()), replace=True)


@pytest.mark.parametrize("verified", [True, False])
def test_the_oracle_catches_a_remote_tier_that_serves_unverified_values(
    monkeypatch: pytest.MonkeyPatch, verified: bool
) -> None:
    import mmcache.remote.store as remote_store
    from mmcache.remote.envelope import HEADER_SIZE

    with make_model("remote", seed=4, capacity=64 * KiB, n_ids=6) as model:
        for host in model._tiered():  # the fuzzer's 50 ms: a loaded machine times out
            host.remote.timeout_s = 10.0
        small = [i for i in range(6) if model.universe.size(i) * 4 <= model.capacity][:2]
        model.request(small)  # host A processes both and publishes them
        _swap_values_in_the_store(model, small[0], small[1])
        if verified:  # the digest covers the key: the swapped value is a miss, then processed
            model.request([small[0]], "other_host")
            assert model.other.stats()["remote_digest_mismatch"] == 1
            return
        # A tier that trusts whatever the store holds hands host B the other item.
        monkeypatch.setattr(
            remote_store,
            "open_envelope",
            lambda key, value, digest_key, parts=None: memoryview(value)[HEADER_SIZE:],
        )
        with pytest.raises(OracleFailure, match=r"\(a\)"):
            model.request([small[0]], "other_host")


def test_a_fault_free_stream_never_retries_and_keeps_the_mirror() -> None:
    # Items no larger than a fifth of the cache (so every request of <= 5 items fits).
    with make_model("lru", seed=3, capacity=64 * KiB, n_ids=12) as model:
        small = [i for i in range(12) if model.universe.size(i) * 5 <= model.capacity]
        assert len(small) >= 4
        rng = np.random.default_rng(0)
        for _ in range(300):
            model.request(list(rng.choice(small, size=rng.integers(1, 6))))
        assert model.stats.retries == 0 and not model.drifted
        assert model.stats.mirror_checks == 300
        assert model.frontend().keys() == model.p1.keys() != []


@pytest.mark.parametrize("fault", ["p1_clear", "p1_restart", "p1_clear_inflight", "lost"])
def test_each_lru_drift_fault_is_recovered_with_exactly_one_retry(fault: str) -> None:
    with make_model("lru", seed=1, capacity=64 * KiB, n_ids=8) as model:
        small = [i for i in range(8) if model.universe.size(i) * 4 <= model.capacity][:3]
        assert len(small) == 3
        model.request(small[:2])  # both sides now hold these two items
        assert model.stats.retries == 0
        if fault == "lost":
            model.request([small[2]], "lost")  # P0 inserted it, P1 never saw it
            model.request([small[2], small[0]])  # P0 sends None for it: P1 misses it
        else:
            model.request(small[:2], fault)  # P1 lost everything: it misses both
        assert model.stats.p1_misses == 1 and model.stats.retries == 1
        assert model.drifted
        model.request(small)  # and the stream goes on
        model.resync()
        model.request(small)
        assert not model.drifted and model.stats.retries == 1


@pytest.mark.parametrize(
    "fault", ["p0_clear_inflight", "invalidate_inflight", "worker_restart_inflight"]
)
def test_shm_handles_disturbed_in_flight_resolve_right_or_miss_once(fault: str) -> None:
    with make_model(
        "shm", seed=1, capacity=256 * KiB, n_ids=8, n_workers=2, copies=[True, False]
    ) as model:
        small = [i for i in range(8) if model.universe.size(i) * 4 <= model.capacity][:3]
        model.request(small)
        model.request(small, fault)
        assert model.stats.requests == 2 and model.stats.attempts <= 3
        assert model.stats.items_checked >= 4 * len(small)


def test_the_oracle_catches_a_receiver_that_returns_foreign_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_model("lru", seed=2, capacity=64 * KiB, n_ids=4) as model:
        model.request([0, 1])
        real = ReceiverCache.get_and_update_item

        def swapped(self: ReceiverCache, item: Any, mm_hash: str) -> Any:
            other = model.universe.hash(1 if mm_hash == model.universe.hash(0) else 0)
            return real(self, None, other) if item is None else real(self, item, mm_hash)

        monkeypatch.setattr(ReceiverCache, "get_and_update_item", swapped)
        with pytest.raises(OracleFailure, match=r"\(a\)"):
            model.request([0])


def test_the_oracle_catches_a_silent_drift() -> None:
    with make_model("lru", seed=2, capacity=64 * KiB, n_ids=4) as model:
        model.request([0, 1])
        model.frontend().invalidate(model.universe.hash(0))  # behind the model's back
        with pytest.raises(OracleFailure, match=r"\(c\)"):
            model.request([1])


def test_the_oracle_catches_an_unexplained_miss() -> None:
    with make_model("lru", seed=2, capacity=64 * KiB, n_ids=4) as model:
        model.request([0, 1])
        model.p1.clear_cache()  # behind the model's back: no fault was declared
        with pytest.raises(OracleFailure, match=r"\(d\)"):
            model.request([0])


def test_the_fuzz_entry_point_runs_and_reports_what_it_exercised() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.drift", "--seconds", "1", "--seed", "5", "--steps", "60"],
        cwd=Path(__file__).parent.parent,  # the repository root
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "clean after" in out.stdout and "seed 5" in out.stdout
    for word in ("requests", "faults", "retries", "checks"):
        assert word in out.stdout


# -- regression examples: bugs the fuzzer found (each fixed at its root) ---------------------


def _sized(key: str, n_bytes: int) -> dict[str, Any]:
    """An item whose item_size is exactly ``n_bytes``."""
    return {"x": np.full(n_bytes, ord(key[0]), dtype=np.uint8)}


class _LruPair:
    """P0 SenderCache + P1 ReceiverCache driven by the engine loop of the specification."""

    def __init__(self, capacity: int, sizes: dict[str, int]) -> None:
        self.p0 = SenderCache(capacity / GiB)
        self.p1 = ReceiverCache(capacity / GiB)
        self.items = {k: _sized(k, n) for k, n in sizes.items()}

    def stage(self, keys: list[str], *, attach_all: bool = False) -> list[Any]:
        flags = [False] * len(keys) if attach_all else self.p0.is_cached(keys)
        for k in keys:
            self.p0.touch_sender_cache_item(k)
        inputs = [None if f else (self.items[k], None) for f, k in zip(flags, keys, strict=True)]
        return self.p0.get_and_update(inputs, keys)

    def deliver(self, keys: list[str], outputs: list[Any]) -> None:
        features = [Feature(data=d, mm_hash=k) for (d, _), k in zip(outputs, keys, strict=True)]
        self.p1.get_and_update_features(features)
        for f, k in zip(features, keys, strict=True):
            assert f.data["x"].tobytes() == self.items[k]["x"].tobytes()

    def finish(self, keys: list[str], outputs: list[Any]) -> int:
        """Deliver; on a miss invalidate the reported hashes and retry once with data.
        Returns the number of retries (raises if the retry misses too)."""
        try:
            self.deliver(keys, outputs)
            return 0
        except CacheMissError as miss:
            for h in miss.mm_hashes:
                self.p0.invalidate(h)
        self.deliver(keys, self.stage(keys, attach_all=True))
        return 1


def test_request_larger_than_the_cache_keeps_the_mirror() -> None:
    # Fixed bug: touching a request's items did not stop the request's own insertions from
    # evicting them, so P0 raised CacheMissError for an item it had just reported cached.
    pair = _LruPair(10_000, {"a": 4_000, "b": 7_000})
    assert pair.finish(["a"], pair.stage(["a"])) == 0
    # No fault at all: a 2-item request of 11 000 bytes into a 10 000-byte cache.  'a' is
    # touched, so 'b' cannot evict it: both sides serve 'b' uncached and keep 'a'.
    outputs = pair.stage(["b", "a"])
    assert outputs[0][0] is pair.items["b"] and outputs[1][0] is None
    assert pair.finish(["b", "a"], outputs) == 0
    assert pair.p0.keys() == pair.p1.keys() == ["a"]
    assert pair.p0.stats()["uncached_full"] == pair.p1.stats()["uncached_full"] == 1


def test_request_larger_than_the_cache_recovers_with_one_retry() -> None:
    # Fixed bug: after a drift, P1 evicted an item of the request (that P0 still held) while
    # ingesting the request's other items, so the prescribed retry missed again.
    pair = _LruPair(100, {"a": 40, "b": 10, "c": 60, "d": 50})
    assert pair.finish(["a"], pair.stage(["a"])) == 0
    # Two requests applied in different orders: P0 stages x then y, P1 gets y then x.
    x, y = ["c", "a", "d"], ["c", "b"]
    out_x, out_y = pair.stage(x), pair.stage(y)
    assert pair.finish(y, out_y) == 0
    assert pair.finish(x, out_x) == 1  # x misses 'a'; 'c' stays protected on P1 for the retry
    assert pair.p0.keys() == pair.p1.keys() == ["c", "a"]


def test_a_retry_cannot_miss_an_item_p1_could_not_keep() -> None:
    # Drift: P0 alone holds 'm' (a lost request), P1 alone holds 'x' (another frontend).
    pair = _LruPair(100, {"x": 70, "k": 40, "m": 20})
    pair.p0.get_and_update_item((pair.items["m"], None), "m")
    pair.p1.get_and_update_item(pair.items["x"], "x")
    request = ["x", "k", "m"]
    outputs = pair.stage(request)  # P0 keeps 'k' (evicting 'x') and sends None for 'm'
    assert [d is None for d, _ in outputs] == [False, False, True]
    with pytest.raises(CacheMissError) as miss:
        pair.deliver(request, outputs)
    # 'm' missed; 'k' was resolved but P1 could not keep it beside the touched 'x': P1
    # reports it too, or P0 (which kept it) would send None for it in the retry.
    assert miss.value.mm_hashes == ["k", "m"]
    assert pair.p0.is_cached(["k", "m"]) == [True, True] and pair.p1.keys() == ["x"]
    assert pair.finish(request, outputs) == 1


def test_a_retry_resolves_a_repeated_item_p1_could_not_keep() -> None:
    # Found by the fuzzer (P1 cleared alone, then a request with a repeated item larger
    # than the cache with its other item).
    pair = _LruPair(100, {"a": 85, "b": 16})
    assert pair.finish(["a"], pair.stage(["a"])) == 0
    pair.p1.clear_cache()
    request = ["a", "a", "b"]
    outputs = pair.stage(request)
    # The retry: P0 keeps 'a' and sends None for its second occurrence, but P1 cannot keep
    # it beside 'b' (which it held, so touched); P1 resolves the second 'a' from the first.
    assert pair.finish(request, outputs) == 1
    assert pair.p0.keys() == pair.p1.keys() == ["b"]


def test_a_stale_is_cached_answer_makes_p0_raise_before_applying_anything() -> None:
    # is_cached answered, then the items evicted (mirrored) before the update: P0 raises,
    # listing every item it was told is cached but is not, and applies none of the request
    # (it used to apply 'b' first and raise part-way, leaving 'b' on P0 alone).
    pair = _LruPair(100, {"a": 40, "b": 30, "c": 90, "d": 20})
    pair.finish(["a", "d"], pair.stage(["a", "d"]))
    flags = pair.p0.is_cached(["b", "a", "d"])
    assert flags == [False, True, True]
    pair.finish(["c"], pair.stage(["c"]))  # evicts 'a' and 'd' on both sides
    for k in ("b", "a", "d"):
        pair.p0.touch_sender_cache_item(k)
    before = pair.p0.make_stats()
    with pytest.raises(CacheMissError) as miss:
        pair.p0.get_and_update([(pair.items["b"], None), None, None], ["b", "a", "d"])
    assert miss.value.mm_hashes == ["a", "d"]
    assert not pair.p0.is_cached_item("b") and pair.p0.make_stats() == before
    assert pair.p0.keys() == pair.p1.keys() == ["c"]  # the mirror still holds
    for k in miss.value.mm_hashes:
        pair.p0.invalidate(k)
    pair.deliver(["b", "a", "d"], pair.stage(["b", "a", "d"], attach_all=True))
    assert pair.p0.keys() == pair.p1.keys()


def test_clear_reclaims_the_references_of_abandoned_handles() -> None:
    with ShmSenderCache(256 * KiB / GiB, n_readers=1) as p0, ShmReceiverCache(p0.handle()):
        data, _ = p0.get_and_update_item((_sized("a", 40 * KiB), None), "a")
        assert isinstance(data, ShmHandle)  # the request carrying it is abandoned
        p0.clear_cache()
        stats = p0.stats()
        assert stats["store_objects"] == 0
        assert stats["store_outstanding_refs"] == 0
        assert stats["store_bytes_in_use"] == 0


def test_a_batch_that_misses_part_way_leaves_no_reference_behind() -> None:
    # Fixed bug: the handles issued for the items before the missing one were lost with the
    # exception, so the engine could not release_handles them.
    with (
        ShmSenderCache(256 * KiB / GiB, n_readers=1) as p0,
        ShmReceiverCache(p0.handle()) as worker,
    ):
        h, _ = p0.get_and_update_item((_sized("a", 1 * KiB), None), "a")
        worker.get_and_update_features([Feature(data=h, mm_hash="a")])
        assert p0.is_cached(["b", "a"]) == [False, True]
        p0.invalidate("a")  # 'a' goes away between is_cached and the update
        for k in ("b", "a"):
            p0.touch_sender_cache_item(k)
        with pytest.raises(CacheMissError):
            p0.get_and_update([(_sized("b", 1 * KiB), None), None], ["b", "a"])
        p0.release_sender_touches()
        stats = p0.stats()
        assert stats["store_pinned"] == 0
        assert stats["store_outstanding_refs"] == 0, "b's handle was issued and lost"


def test_torch_items_survive_the_shm_model_bit_for_bit() -> None:
    # The fuzzer's items carry torch tensors of every common dtype (NaN bit patterns
    # included); a zero-copy worker and a copying one both see them bit for bit.
    with make_model(
        "shm", seed=4, capacity=256 * KiB, n_ids=10, n_workers=2, copies=[False, True]
    ) as model:
        kinds = {type(v) for i in range(10) for v in model.universe.item(i).values()}
        assert torch.Tensor in kinds and np.ndarray in kinds
        for i in range(10):
            model.request([i, (i + 3) % 10])
        assert model.stats.tensors_checked > 0 and model.stats.items_checked >= 40
