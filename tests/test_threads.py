"""Every cache object called from several threads at once (SPEC §3.9, "Threads").

Real threads hammer one instance of each class with random requests over a shared catalogue
(evictions, clears and invalidations included) and every item they get back is checked
against the truth for its hash; the switch interval is lowered so that threads interleave
inside the caches' calls.  In ``shm`` mode the readers are threads of a spawned process that
resolve every handle P0's threads issued; in ``lru`` mode P0's threads feed one P1 thread in
the order they finish, and every request completes with at most one retry.  Deterministic
tests pin down the per-thread request bracket and protections several requests share.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import queue
import random
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, MutableMapping, Sequence
from typing import Any

import cachetools
import numpy as np
import pytest
import torch

from mmcache import (
    CacheMissError,
    Feature,
    LRUCache,
    ProcessorOnlyCache,
    ReceiverCache,
    SenderCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    item_size,
    make_caches,
)
from mmcache.caches import BaseSenderCache
from tests.actors import Actor

GiB = 1 << 30
KiB = 1024
N_THREADS = 8
KEYS = [f"img-{i:02d}" for i in range(40)]
JOIN_DEADLINE_S = 300  # only stops a hung test


@pytest.fixture(autouse=True)
def interleave() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so they interleave inside calls."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def truth(key: str) -> dict[str, Any]:
    """The item P0 produces for ``key``: 1 to 4 KiB of bytes that depend on the key only."""
    index = KEYS.index(key) if key in KEYS else len(KEYS)
    rng = np.random.default_rng(index)
    return {"pixel_values": rng.integers(0, 255, size=KiB * (1 + index % 4), dtype=np.uint8)}


def updates_of(key: str) -> list[Any]:
    return [("image", key, 16)]


def is_truth(key: str, item: Any) -> bool:
    expected = truth(key)
    return (
        isinstance(item, dict)
        and item.keys() == expected.keys()
        and all(np.array_equal(np.asarray(item[f]), expected[f]) for f in expected)
    )


def run_threads(n: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` for i in range(n), each in its own thread, released together;
    re-raise the first failure."""
    start = threading.Barrier(n)
    errors: list[BaseException] = []

    def main(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(i,), name=f"hammer-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_DEADLINE_S)
        assert not t.is_alive(), f"{t.name} hung"
    if errors:
        raise errors[0]


def request_keys(rng: random.Random) -> list[str]:
    """One request's hashes: 1 to 4, a repeat now and then."""
    keys = rng.sample(KEYS, rng.randint(1, 4))
    if rng.random() < 0.1:
        keys.append(keys[0])
    return keys


def capacity_gb(n_bytes: int) -> float:
    return n_bytes / GiB


# -- P0: the engine's loop, as each thread runs it ------------------------------------------


def p0_request(
    cache: BaseSenderCache,
    keys: Sequence[str],
    rng: random.Random,
    send: Callable[[str, Any], None],
) -> None:
    """One request through a P0 cache: ``is_cached``, touch every hash, update (batched or,
    inside a request bracket, item by item), then ``send`` each output's data; a P0 miss (its
    answer went stale: another thread evicted, invalidated or cleared the item) is retried
    once with every item's data.  Checks every output's prompt updates and any data."""
    cached = cache.is_cached(keys)
    inputs = [None if c else (truth(k), updates_of(k)) for c, k in zip(cached, keys, strict=True)]
    try:
        outputs = _update(cache, keys, inputs, one_by_one=rng.random() < 0.5)
    except CacheMissError as miss:
        assert set(miss.mm_hashes) <= {k for c, k in zip(cached, keys, strict=True) if c}
        outputs = _update(cache, keys, [(truth(k), updates_of(k)) for k in keys], False)
    assert len(outputs) == len(keys)
    for (data, updates), key in zip(outputs, keys, strict=True):
        assert updates == updates_of(key)
        send(key, data)


def _update(
    cache: BaseSenderCache, keys: Sequence[str], inputs: list[Any], one_by_one: bool
) -> list[Any]:
    for k in keys:
        cache.touch_sender_cache_item(k)
    if not one_by_one:
        try:
            return cache.get_and_update(inputs, keys)
        finally:
            cache.release_sender_touches()
    outputs: list[Any] = []
    cache.begin_request()
    try:
        for item, k in zip(inputs, keys, strict=True):
            outputs.append(cache.get_and_update_item(item, k))
    except CacheMissError:
        if isinstance(cache, ShmSenderCache):
            cache.release_handles(data for data, _ in outputs)
        raise
    finally:
        cache.end_request()
    return outputs


def maintenance(cache: Any, rng: random.Random, clear: Callable[[], None]) -> None:
    """What a thread does besides requests: invalidate, clear, read statistics."""
    roll = rng.random()
    if roll < 0.5:
        cache.invalidate(rng.choice(KEYS))
    elif roll < 0.6:
        clear()
    else:
        delta = rng.random() < 0.5
        hits, total = cache.make_stats(delta=delta)
        assert delta or 0 <= hits <= total  # a delta across a clear may be negative
        assert cache.stats()["uncached_oversize"] == 0


def assert_nothing_protected(cache: BaseSenderCache, capacity: int) -> None:
    """An item as large as the whole cache goes in: no protection outlived its request."""
    big = {"x": np.zeros(capacity, dtype=np.uint8)}
    cache.get_and_update_item((big, None), "whole-cache")
    assert cache.is_cached_item("whole-cache")


# -- processor_only, and lru's P0 alone -------------------------------------------------------


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache])
def test_p0_lru_caches_under_threads(cache_type: type[ProcessorOnlyCache | SenderCache]) -> None:
    capacity = 12 * KiB
    cache = cache_type(capacity_gb(capacity))

    def send(key: str, data: Any) -> None:
        if data is None:
            assert cache_type is SenderCache  # a hit: P1 holds it
        else:
            assert is_truth(key, data)

    def hammer(i: int) -> None:
        rng = random.Random(i)
        for _ in range(150):
            if rng.random() < 0.9:
                p0_request(cache, request_keys(rng), rng, send)
            else:
                maintenance(cache, rng, cache.clear_cache)

    run_threads(N_THREADS, hammer)
    stats = cache.stats()
    keys = cache.keys()
    assert stats["entries"] == len(keys) == len(set(keys))
    assert stats["used_bytes"] == sum(item_size(truth(str(k))) for k in keys) <= capacity
    for k in keys:
        assert cache.is_cached_item(str(k))
    assert_nothing_protected(cache, capacity)


# -- P1 alone -----------------------------------------------------------------------------------


def test_receiver_cache_under_threads() -> None:
    capacity = 12 * KiB
    p1 = ReceiverCache(capacity_gb(capacity))

    def hammer(i: int) -> None:
        rng = random.Random(100 + i)
        for _ in range(150):
            if rng.random() < 0.03:
                p1.clear_cache()
                continue
            keys = request_keys(rng)
            features = [
                Feature(data=None if rng.random() < 0.5 else truth(k), mm_hash=k) for k in keys
            ]
            try:
                p1.get_and_update_features(features)
            except CacheMissError as miss:
                assert miss.mm_hashes and set(miss.mm_hashes) <= set(keys)
                for k, f in zip(keys, features, strict=True):
                    assert k in miss.mm_hashes or is_truth(k, f.data)
                # The retry carries the data of every item.
                features = [Feature(data=truth(k), mm_hash=k) for k in keys]
                p1.get_and_update_features(features)
            assert all(is_truth(k, f.data) for k, f in zip(keys, features, strict=True))

    run_threads(N_THREADS, hammer)
    keys = p1.keys()
    stats = p1.stats()
    assert stats["entries"] == len(keys)
    assert stats["used_bytes"] == sum(item_size(truth(str(k))) for k in keys) <= capacity
    resolved = p1.get_and_update_features([Feature(data=None, mm_hash=str(k)) for k in keys])
    assert all(is_truth(str(k), f.data) for k, f in zip(keys, resolved, strict=True))
    big = {"x": np.zeros(capacity, dtype=np.uint8)}
    p1.get_and_update_item(big, "whole-cache")
    assert p1.keys() == ["whole-cache"]  # nothing left protected


# -- the standalone LRU -------------------------------------------------------------------------


def test_lru_cache_under_threads() -> None:
    capacity = 12 * KiB
    lru = LRUCache(capacity)

    def hammer(i: int) -> None:
        rng = random.Random(200 + i)
        for _ in range(300):
            key, roll = rng.choice(KEYS), rng.random()
            if roll < 0.35:
                value = lru.get(key)
                assert value is None or is_truth(key, value)
            elif roll < 0.55:
                assert lru.put_if_fits(key, truth(key))
            elif roll < 0.6:
                with lru.lock:  # several calls as one step
                    lru.protect(key)
                    other = rng.choice(KEYS)
                    assert lru.put_if_fits(other, truth(other)) or lru.is_protected(key)
                    lru.unprotect(key)
            elif roll < 0.7:
                lru.touch(key)
            elif roll < 0.8:
                value = lru.pop(key)
                assert value is None or is_truth(key, value)
            elif roll < 0.85:
                assert is_truth(key, lru.setdefault(key, truth(key)))
            elif roll < 0.88:
                lru.clear()
            elif roll < 0.94:
                assert set(lru.recency_order()) <= set(KEYS) and set(lru) <= set(KEYS)
            else:
                hits, total = lru.stat(delta=rng.random() < 0.5)
                assert hits <= total or total < 0

    run_threads(N_THREADS, hammer)
    order = lru.recency_order()
    assert set(order) == set(lru) and len(order) == len(set(order)) == len(lru)
    assert lru.currsize == sum(item_size(truth(str(k))) for k in order) <= capacity
    assert all(is_truth(str(k), lru[k]) for k in order)
    assert lru.protected_bytes == 0


# -- shm: P0's threads write, a spawned process's threads read --------------------------------


def shm_truth(key: str) -> dict[str, Any]:
    """``truth`` with a torch tensor beside the array."""
    item = truth(key)
    item["embedding"] = torch.from_numpy(item["pixel_values"][:64].astype(np.float32))
    return item


def is_shm_truth(key: str, item: Any) -> bool:
    expected = shm_truth(key)
    return (
        isinstance(item, dict)
        and item.keys() == expected.keys()
        and np.array_equal(np.asarray(item["pixel_values"]), expected["pixel_values"])
        and isinstance(item["embedding"], torch.Tensor)
        and torch.equal(item["embedding"], expected["embedding"])
    )


def _reader_process(handle: Any, requests: Any, report: Any, n_threads: int) -> None:
    """A worker: one ShmReceiverCache shared by ``n_threads`` threads, each resolving whole
    requests (lists of (key, handle)) until it gets ``None``, acknowledging each ("done");
    reports what it saw."""
    sys.setswitchinterval(1e-6)
    counts = {"features": 0, "wrong": 0, "misses": 0, "errors": 0}
    lock = threading.Lock()
    with ShmReceiverCache(handle) as reader:
        report.put("attached")

        def resolve() -> None:
            while (request := requests.get()) is not None:
                keys = [k for k, _ in request]
                features = [Feature(data=h, mm_hash=k) for k, h in request]
                seen = {"features": len(features), "wrong": 0, "misses": 0, "errors": 0}
                try:
                    reader.get_and_update_features(features)
                except CacheMissError as miss:
                    seen["misses"] += len(miss.mm_hashes)
                except Exception:
                    seen["errors"] += 1
                else:
                    seen["wrong"] = sum(
                        not is_shm_truth(k, f.data) for k, f in zip(keys, features, strict=True)
                    )
                with lock:
                    for name, n in seen.items():
                        counts[name] += n
                report.put("done")

        threads = [threading.Thread(target=resolve) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report.put(counts)


def test_shm_caches_under_threads() -> None:
    reader_threads = 4
    ctx = mp.get_context("spawn")
    requests, report = ctx.Queue(), ctx.Queue()
    with ShmSenderCache(capacity_gb(96 * KiB)) as p0:
        reader = ctx.Process(
            target=_reader_process, args=(p0.handle(), requests, report, reader_threads)
        )
        reader.start()
        try:
            assert report.get(timeout=120) == "attached"  # readers attach before P0 writes
            sent = [0]
            count = threading.Lock()
            # At most a few requests in flight, as an engine's queues bound them: the ring
            # holds unread objects and evicts the rest.
            in_flight = threading.BoundedSemaphore(4)
            results: queue.Queue[Any] = queue.Queue()

            def collect_acks() -> None:
                while (message := report.get(timeout=JOIN_DEADLINE_S)) == "done":
                    in_flight.release()
                results.put(message)

            collector = threading.Thread(target=collect_acks)
            collector.start()

            def hammer(i: int) -> None:
                rng = random.Random(300 + i)
                for _ in range(100):
                    if rng.random() < 0.08:
                        # In-flight handles keep their references: none of them may miss.
                        maintenance(p0, rng, lambda: p0.clear_cache(keep_in_flight=True))
                        continue
                    handles: list[tuple[str, ShmHandle]] = []

                    def send(key: str, data: Any) -> None:  # called in this iteration only
                        if isinstance(data, ShmHandle):
                            handles.append((key, data))  # noqa: B023
                        else:  # served uncached (the ring is full of unread objects)
                            assert is_shm_truth(key, data)

                    keys = request_keys(rng)
                    cached = p0.is_cached(keys)
                    for k in keys:
                        p0.touch_sender_cache_item(k)
                    inputs = [
                        None if c else (shm_truth(k), updates_of(k))
                        for c, k in zip(cached, keys, strict=True)
                    ]
                    try:
                        outputs = p0.get_and_update(inputs, keys)
                    except CacheMissError:
                        outputs = p0.get_and_update(
                            [(shm_truth(k), updates_of(k)) for k in keys], keys
                        )
                    finally:
                        p0.release_sender_touches()
                    for (data, updates), k in zip(outputs, keys, strict=True):
                        assert updates == updates_of(k)
                        send(k, data)
                    if handles:
                        with count:
                            sent[0] += len(handles)
                        in_flight.acquire()
                        requests.put(handles)

            run_threads(N_THREADS, hammer)
            for _ in range(reader_threads):
                requests.put(None)
            collector.join(JOIN_DEADLINE_S)
            counts = results.get_nowait()
            reader.join(JOIN_DEADLINE_S)
        finally:
            if reader.is_alive():
                reader.kill()
        assert reader.exitcode == 0
        assert counts == {"features": sent[0], "wrong": 0, "misses": 0, "errors": 0}
        stats = p0.stats()
        assert stats["store_pinned"] == 0 and stats["store_outstanding_refs"] == 0
        assert stats["store_evictions"] > 0 and sent[0] > 0


def test_shm_pins_and_handles_under_threads_in_one_process() -> None:
    """Threads update and readers resolve in one process; eviction is constant (a ring of
    three objects) and every handle is resolved right after it is issued."""
    with ShmSenderCache(capacity_gb(20 * KiB)) as p0, ShmReceiverCache(p0.handle()) as worker:

        def hammer(i: int) -> None:
            rng = random.Random(400 + i)
            for _ in range(150):
                if rng.random() < 0.05:
                    maintenance(p0, rng, p0.clear_cache)  # drops in-flight references: misses
                    continue
                got: list[tuple[str, Any]] = []
                # p0_request calls the lambda before it returns, in this iteration (B023).
                p0_request(p0, request_keys(rng), rng, lambda k, d: got.append((k, d)))  # noqa: B023
                for key, data in got:
                    if not isinstance(data, ShmHandle):
                        assert is_truth(key, data)
                        continue
                    # A miss: a clear by another thread dropped its reference.
                    with contextlib.suppress(CacheMissError):
                        assert is_truth(key, worker.get_and_update_item(data, key))

        run_threads(N_THREADS, hammer)
        stats = p0.stats()
        assert stats["store_pinned"] == 0 and stats["store_outstanding_refs"] == 0
        assert stats["store_evictions"] > 0


# -- lru: P0's threads, P1 in the order requests reach it --------------------------------------


def test_lru_mirror_under_threads_recovers_every_drift_in_one_retry() -> None:
    """P0 threads apply requests in one order and P1 resolves them in another (the order
    they reach it): every drift is a ``CacheMissError`` whose one retry, carrying every
    item's data, succeeds; every tensor P1 resolves is the truth."""
    capacity = 10 * KiB
    p0, p1 = SenderCache(capacity_gb(capacity)), ReceiverCache(capacity_gb(capacity))
    to_p1: queue.Queue[tuple[list[str], list[Any], queue.Queue[Any]] | None] = queue.Queue()
    tally = {"requests": 0, "retries": 0}
    tally_lock = threading.Lock()

    def engine_core() -> None:
        """P1: one thread resolving requests in arrival order."""
        while (job := to_p1.get()) is not None:
            keys, data, reply = job
            features = [Feature(data=d, mm_hash=k) for k, d in zip(keys, data, strict=True)]
            try:
                p1.get_and_update_features(features)
            except CacheMissError as miss:
                reply.put(miss)
            else:
                reply.put([f.data for f in features])

    def submit(keys: list[str], data: list[Any]) -> Any:
        reply: queue.Queue[Any] = queue.Queue()
        to_p1.put((keys, data, reply))
        return reply.get(timeout=JOIN_DEADLINE_S)

    def frontend(i: int) -> None:
        rng = random.Random(500 + i)
        for _ in range(120):
            keys = request_keys(rng)
            sent: list[Any] = []
            # p0_request calls the lambda before it returns, in this iteration (B023).
            p0_request(p0, keys, rng, lambda k, d: sent.append(d))  # noqa: B023
            answer = submit(keys, sent)
            retried = isinstance(answer, CacheMissError)
            if retried:
                # The drift's recovery: forget what P1 lacks, resend with every item's data.
                assert set(answer.mm_hashes) <= set(keys)
                for h in answer.mm_hashes:
                    p0.invalidate(h)
                for k in keys:
                    p0.touch_sender_cache_item(k)
                p0.get_and_update([(truth(k), updates_of(k)) for k in keys], keys)
                answer = submit(keys, [truth(k) for k in keys])
                assert not isinstance(answer, CacheMissError), f"{keys}: a second miss"
            assert all(is_truth(k, item) for k, item in zip(keys, answer, strict=True))
            with tally_lock:
                tally["requests"] += 1
                tally["retries"] += retried

    p1_thread = threading.Thread(target=engine_core, name="engine-core")
    p1_thread.start()
    try:
        run_threads(N_THREADS, frontend)
    finally:
        to_p1.put(None)
        p1_thread.join(JOIN_DEADLINE_S)
    assert tally["requests"] == N_THREADS * 120 and tally["retries"] <= tally["requests"]

    # Resynchronised (both cleared), one thread at a time: the mirror is exact again, so
    # nothing the threads did left either side's state inconsistent.
    p0.clear_cache()
    p1.clear_cache()
    rng = random.Random(7)
    for _ in range(60):
        keys = request_keys(rng)
        sent = []
        # p0_request calls the lambda before it returns, in this iteration (B023).
        p0_request(p0, keys, rng, lambda k, d: sent.append(d))  # noqa: B023
        assert not isinstance(submit_now(p1, keys, sent), CacheMissError)
        assert p0.keys() == p1.keys()


def submit_now(p1: ReceiverCache, keys: list[str], data: list[Any]) -> Any:
    features = [Feature(data=d, mm_hash=k) for k, d in zip(keys, data, strict=True)]
    try:
        return p1.get_and_update_features(features)
    except CacheMissError as miss:
        return miss


# -- make_caches --------------------------------------------------------------------------------


def test_make_caches_from_threads() -> None:
    built: list[tuple[str, Any, Any]] = []
    lock = threading.Lock()

    def build(i: int) -> None:
        for mode in ("none", "processor_only", "lru", "shm"):
            p0, downstream = make_caches(mode, capacity_gb=capacity_gb(64 * KiB))
            with lock:
                built.append((mode, p0, downstream))

    run_threads(N_THREADS, build)
    names = [p0.name for mode, p0, _ in built if mode == "shm"]
    assert len(names) == len(set(names)) == N_THREADS
    key = KEYS[0]
    for mode, p0, downstream in built:
        if mode == "shm":
            with p0, ShmReceiverCache(downstream) as worker:
                handle, _ = p0.get_and_update_item((truth(key), None), key)
                assert is_truth(key, worker.get_and_update_item(handle, key))
        elif p0 is not None:
            with p0:
                assert is_truth(key, p0.get_and_update_item((truth(key), None), key)[0])


# -- the request bracket is per thread ----------------------------------------------------------


@pytest.fixture
def actors() -> Iterator[tuple[Actor, Actor]]:
    a, b = Actor(), Actor()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_each_thread_has_its_own_request(mode: str, actors: tuple[Actor, Actor]) -> None:
    a, b = actors
    p0, _ = make_caches(mode, capacity_gb=capacity_gb(64 * KiB))  # type: ignore[arg-type]
    assert p0 is not None
    with p0:
        a(p0.begin_request)
        assert a(lambda: p0.in_request) and not b(lambda: p0.in_request)
        assert not p0.in_request  # nor this thread
        b(p0.begin_request)  # another thread's open request is no obstacle
        with pytest.raises(RuntimeError, match="already open"):
            a(p0.begin_request)
        a(p0.end_request)
        assert not a(lambda: p0.in_request) and b(lambda: p0.in_request)
        b(p0.end_request)


def test_receiver_request_is_per_thread(actors: tuple[Actor, Actor]) -> None:
    a, b = actors
    p1 = ReceiverCache(capacity_gb(64 * KiB))
    a(p1.begin_request)
    a(p1.get_and_update_item, truth(KEYS[0]), KEYS[0])
    p1.clear_cache()
    # Thread a's request carried KEYS[0]: it resolves a repeat of it; thread b's does not.
    assert is_truth(KEYS[0], a(p1.get_and_update_item, None, KEYS[0]))
    b(p1.begin_request)
    with pytest.raises(CacheMissError):
        b(p1.get_and_update_item, None, KEYS[0])
    a(p1.end_request)
    b(p1.end_request)


def fill_item(n_bytes: int) -> dict[str, Any]:
    return {"x": np.zeros(n_bytes, dtype=np.uint8)}


@pytest.mark.parametrize("cache_type", [SenderCache, ReceiverCache])
def test_an_item_two_requests_touched_stays_protected_until_both_end(
    cache_type: type, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    cache = cache_type(capacity_gb(4 * KiB))
    item = fill_item(4 * KiB)  # the whole cache
    sender = cache_type is SenderCache

    def update(key: str) -> None:
        cache.get_and_update_item((item, None) if sender else item, key)

    def touch(key: str) -> None:
        if sender:
            cache.touch_sender_cache_item(key)
        else:
            cache.touch_receiver_cache_item(key)

    update("a")
    for actor in (a, b):
        actor(cache.begin_request)
        actor(touch, "a")
    a(cache.end_request)
    update("b")  # would have to evict "a", which b's request still protects
    assert cache.keys() == ["a"] and cache.stats()["uncached_full"] == 1
    b(cache.end_request)
    update("b")
    assert cache.keys() == ["b"]


@pytest.mark.parametrize("cache_type", [SenderCache, ReceiverCache])
def test_a_stale_protection_never_ends_a_later_one(
    cache_type: type, actors: tuple[Actor, Actor]
) -> None:
    """a's request touched "a"; "a" is then dropped and stored anew, and b's request touches
    the new entry: a's request ending must not end b's protection."""
    a, b = actors
    cache = cache_type(capacity_gb(4 * KiB))
    item = fill_item(4 * KiB)
    sender = cache_type is SenderCache

    def update(key: str) -> None:
        cache.get_and_update_item((item, None) if sender else item, key)

    def touch(key: str) -> None:
        if sender:
            cache.touch_sender_cache_item(key)
        else:
            cache.touch_receiver_cache_item(key)

    update("a")
    a(cache.begin_request)
    a(touch, "a")
    cache.clear_cache()
    update("a")
    b(cache.begin_request)
    b(touch, "a")
    a(cache.end_request)
    update("b")
    assert cache.keys() == ["a"]  # still protected by b's request
    b(cache.end_request)
    update("b")
    assert cache.keys() == ["b"]


def test_shm_pins_are_counted_across_threads(actors: tuple[Actor, Actor]) -> None:
    a, b = actors
    with ShmSenderCache(capacity_gb(64 * KiB)) as p0, ShmReceiverCache(p0.handle()) as worker:
        key = KEYS[0]
        handle, _ = p0.get_and_update_item((truth(key), None), key)
        worker.get_and_update_item(handle, key)
        a(p0.touch_sender_cache_item, key)
        b(p0.touch_sender_cache_item, key)
        assert p0.stats()["store_pinned"] == 1
        handle, _ = a(p0.get_and_update_item, None, key)
        assert p0.stats()["store_pinned"] == 1  # b's touch still pins it
        assert is_truth(key, worker.get_and_update_item(handle, key))
        b(p0.release_sender_touches)
        assert p0.stats()["store_pinned"] == 0


def test_shm_a_stale_pin_never_unpins_a_later_one(actors: tuple[Actor, Actor]) -> None:
    a, b = actors
    with ShmSenderCache(capacity_gb(64 * KiB)) as p0:
        key = KEYS[0]
        p0.get_and_update_item((truth(key), None), key)
        a(p0.touch_sender_cache_item, key)
        p0.invalidate(key)  # drops the object and its pins
        p0.get_and_update_item((truth(key), None), key)
        b(p0.touch_sender_cache_item, key)
        a(p0.release_sender_touches)  # a's pin was of the object invalidated
        assert p0.stats()["store_pinned"] == 1
        b(p0.release_sender_touches)
        assert p0.stats()["store_pinned"] == 0


# -- pickling (simulate hands P1 its ReceiverCache) ---------------------------------------------


@pytest.mark.parametrize("cache_type", [ProcessorOnlyCache, SenderCache, ReceiverCache])
def test_a_pickled_cache_has_its_own_lock_and_no_request_in_flight(
    cache_type: type, actors: tuple[Actor, Actor]
) -> None:
    a, _ = actors
    cache = cache_type(capacity_gb(4 * KiB))
    sender = cache_type is not ReceiverCache
    item = fill_item(4 * KiB)
    cache.get_and_update_item((item, None) if sender else item, "a")
    a(cache.begin_request)
    if sender:
        a(cache.touch_sender_cache_item, "a")
    else:
        a(cache.touch_receiver_cache_item, "a")
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.keys() == ["a"] and not copy.in_request
    copy.get_and_update_item((item, None) if sender else item, "b")  # nothing protects "a"
    assert copy.keys() == ["b"] and cache.keys() == ["a"]
    a(cache.end_request)


def test_a_pickled_lru_cache_has_its_own_lock() -> None:
    lru = LRUCache(4 * KiB)
    lru.put("a", truth(KEYS[0]))
    copy = pickle.loads(pickle.dumps(lru))
    assert copy.lock is not lru.lock and is_truth(KEYS[0], copy.get("a"))


# -- operations on the whole state while other threads change it -------------------------------


def emulate_old_cachetools(monkeypatch: pytest.MonkeyPatch) -> None:
    """cachetools before 7.0.2 (pyproject allows 5.3 on) has no ``Cache.clear``: it clears
    through ``MutableMapping.clear``, popping items until ``popitem`` raises ``KeyError``."""
    monkeypatch.setattr(cachetools.Cache, "clear", MutableMapping.clear)


@pytest.mark.parametrize("cachetools_clear", ["installed", "before 7.0.2"])
@pytest.mark.parametrize("cache_type", [SenderCache, ReceiverCache])
def test_a_clear_while_another_threads_request_protects_an_item_leaves_nothing_behind(
    cache_type: type,
    cachetools_clear: str,
    actors: tuple[Actor, Actor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM clears P0's cache from its event loop while a renderer thread is inside a
    request: the item that request protects goes too, and is a plain miss afterwards."""
    if cachetools_clear != "installed":
        emulate_old_cachetools(monkeypatch)
    a, _ = actors
    cache = cache_type(capacity_gb(8 * KiB))
    sender = cache_type is SenderCache
    item = fill_item(KiB)

    def update(key: str) -> Any:
        return cache.get_and_update_item((item, None) if sender else item, key)

    for key in ("a", "b", "c"):
        update(key)
    a(cache.begin_request)
    a(cache.touch_sender_cache_item if sender else cache.touch_receiver_cache_item, "a")
    cache.clear_cache()
    a(cache.end_request)
    assert cache.keys() == []
    assert cache.stats()["entries"] == 0 and cache.stats()["used_bytes"] == 0
    if sender:
        assert not cache.is_cached_item("a")
    update("a")
    assert cache.keys() == ["a"]
    if sender:
        cache.invalidate("a")
        assert cache.keys() == []


def hammer(change: Callable[[int], None], read: Callable[[], object], reads: int) -> None:
    """``read()`` ``reads`` times while another thread calls ``change(i)`` for i = 0, 1, ...;
    fails with what a read raised."""
    stop, start = threading.Event(), threading.Barrier(2)

    def changer() -> None:
        start.wait()
        i = 0
        while not stop.is_set():
            change(i)
            i += 1

    thread = threading.Thread(target=changer)
    thread.start()
    start.wait()
    try:
        for _ in range(reads):
            read()
    finally:
        stop.set()
        thread.join(JOIN_DEADLINE_S)


def test_pickling_an_lru_cache_while_another_thread_changes_it() -> None:
    lru = LRUCache(64 * KiB)

    def change(i: int) -> None:
        lru.put_if_fits(f"k{i % 200}", fill_item(64))
        lru.pop(f"k{(i * 7) % 200}")

    hammer(change, lambda: pickle.loads(pickle.dumps(lru)), 3000)


def test_pickling_a_receiver_cache_while_another_thread_updates_it() -> None:
    p1 = ReceiverCache(capacity_gb(64 * KiB))

    def change(i: int) -> None:
        p1.get_and_update_item(fill_item(64), f"k{i % 200}")
        if i % 50 == 0:
            p1.clear_cache()

    hammer(change, lambda: pickle.loads(pickle.dumps(p1)), 3000)


def test_an_lru_caches_items_and_values_are_a_snapshot_that_changes_no_recency() -> None:
    lru = LRUCache(1 << 20)
    for key in ("a", "b", "c"):
        lru.put(key, fill_item(8))
    lru.touch("a")
    order = lru.recency_order()
    assert [k for k, _ in lru.items()] == ["a", "b", "c"] and len(lru.values()) == 3
    assert lru.recency_order() == order == ["b", "c", "a"]

    def change(i: int) -> None:
        lru.put(f"k{i % 100}", fill_item(8))
        lru.pop(f"k{(i + 50) % 100}")

    hammer(change, lambda: (list(lru.items()), list(lru.values())), 3000)


def test_an_lru_caches_settle_is_one_step_for_other_threads() -> None:
    # settle() held the lock for each key, not for the whole call: another thread's settle
    # ran between two of its keys, and neither request's keys ended most recent together.
    class Pausing(LRUCache):
        """Pauses the first settle() after its first key until the other thread's
        settle() is done, or, when that one waits for the lock, a moment."""

        def touch(self, key: Hashable) -> int | None:
            stamp = super().touch(key)
            if key == "a":
                first_paused.set()
                second_done.wait(0.5)
            return stamp

    first_paused, second_done = threading.Event(), threading.Event()
    lru = Pausing(1 << 20)
    for key in ("a", "b", "c", "x", "y", "z"):
        lru.put(key, fill_item(8))

    def second() -> None:
        first_paused.wait(JOIN_DEADLINE_S)
        lru.settle(["x", "y", "z"])
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    lru.settle(["c", "b", "a"])
    thread.join(JOIN_DEADLINE_S)
    assert lru.recency_order() == ["a", "b", "c", "x", "y", "z"]
