"""``TieredSenderCache`` called from several threads at once (SPEC §3.9, "Threads"), against a
real Valkey (started on a free loopback port).

Deterministic tests pin down what threads share and what is a request's own: a fetched item
serves every request whose lookup found it, claims belong to the request that took them,
the request bracket reaches the local cache, and a thread waiting on the remote tier holds
up no other thread.  Then 8 threads hammer one ``TieredSenderCache`` over each local mode
(``processor_only``; ``lru`` with a P1 thread; ``shm`` with a reader process) while a second
host publishes into the same store, and every item any of them resolves is checked against
the truth for its hash.  No duration is asserted; deadlines only stop a hung test.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import redis

from mmcache import (
    CacheMissError,
    Feature,
    ProcessorOnlyCache,
    ReceiverCache,
    SenderCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
)
from mmcache.caches import BaseSenderCache
from mmcache.remote import TieredSenderCache
from mmcache.remote.local_server import LocalServer
from test_remote import (
    HANG_S,
    in_time,
    key,
    make_item,
    open_store,
    same,
)
from test_remote_claims import claim_of, until

N_THREADS = 8
CATALOGUE = 16  # items 0..15, each the same bits whichever host processes it
ROUNDS = 10


@pytest.fixture(autouse=True)
def interleave() -> Iterator[None]:
    """Switch threads as often as the interpreter can, so they interleave inside calls."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def truth(i: int) -> dict[str, Any]:
    """The item any host's P0 produces for item ``i``."""
    return make_item(i, 6_000)


def updates_of(i: int) -> list[Any]:
    return ["<image>", i]


def processed(i: int) -> tuple[dict[str, Any], list[Any]]:
    return truth(i), updates_of(i)


def record(i: int) -> dict[str, Any]:
    """What the tier stores for item ``i``."""
    return {"item": truth(i), "prompt_updates": updates_of(i)}


def open_p0(url: str, namespace: str, local: BaseSenderCache) -> TieredSenderCache:
    """A host's P0 over a healthy server: a deadline only a hang reaches."""
    return TieredSenderCache(local, open_store(url, namespace, timeout_s=10))


class Actor:
    """Runs calls on a thread of its own, one at a time, so a test can interleave two
    threads' calls in a chosen order (``start`` does not wait for the call to end)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1)
        self.ident: int = self(threading.get_ident)

    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(fn, *args, **kwargs)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.start(fn, *args, **kwargs).result(timeout=HANG_S)

    def close(self) -> None:
        self._pool.shutdown()


@pytest.fixture
def actors() -> Iterator[tuple[Actor, Actor]]:
    a, b = Actor(), Actor()
    yield a, b
    a.close()
    b.close()


def publish(url: str, namespace: str, *ids: int) -> None:
    """Another host processed and published these items."""
    with open_store(url, namespace) as store:
        for i in ids:
            store.put(key(i), record(i))


# -- what threads share, and what is a request's own ---------------------------------------


class PausingLocal(ProcessorOnlyCache):
    """A local cache whose batched update, in the thread ``pause_in``, waits for ``resume``
    once it has begun (``entered``): another thread runs while it is inside."""

    def __init__(self, capacity_gb: float) -> None:
        super().__init__(capacity_gb)
        self.pause_in: int | None = None
        self.entered = threading.Event()
        self.resume = threading.Event()

    def get_and_update(self, items: Sequence[Any], mm_hashes: Sequence[str]) -> list[Any]:
        if threading.get_ident() == self.pause_in:
            self.entered.set()
            assert self.resume.wait(HANG_S)
        return super().get_and_update(items, mm_hashes)


def test_an_item_fetched_for_two_requests_serves_both_while_the_first_is_inserting_it(
    server: LocalServer, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    publish(server.url, namespace, 1)
    local = PausingLocal(0.05)
    p0 = open_p0(server.url, namespace, local)
    try:
        assert a(p0.is_cached, [key(1)]) == [True]
        assert b(p0.is_cached, [key(1)]) == [True]  # the same fetched item
        local.pause_in = a.ident
        first = a.start(p0.get_and_update, [None], [key(1)])
        assert local.entered.wait(HANG_S)  # a's update has the item, the local cache not yet
        ((data, updates),) = b(p0.get_and_update, [None], [key(1)])
        assert same(data, truth(1)) and updates == updates_of(1)
        local.resume.set()
        ((data, updates),) = first.result(timeout=HANG_S)
        assert same(data, truth(1)) and updates == updates_of(1)
        assert p0.fetched(key(1)) is None  # both requests had it: nothing left waiting
        assert p0.stats()["remote_served"] == 1 and p0.stats()["remote_lookups"] == 1
    finally:
        local.resume.set()
        p0.close()


def test_an_item_the_local_cache_served_uncached_still_serves_the_other_request(
    server: LocalServer, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    publish(server.url, namespace, 1)
    p0 = open_p0(server.url, namespace, ProcessorOnlyCache(0.0))  # holds nothing
    try:
        assert a(p0.is_cached, [key(1)]) == b(p0.is_cached, [key(1)]) == [True]
        for actor in (a, b):
            ((data, updates),) = actor(p0.get_and_update, [None], [key(1)])
            assert same(data, truth(1)) and updates == updates_of(1)
        assert p0.local.stats()["uncached_oversize"] == 2 and p0.fetched(key(1)) is None
    finally:
        p0.close()


def test_an_item_fetched_for_a_request_outlives_another_requests_update_of_it(
    server: LocalServer, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    """Updated one by one, inside a request bracket: a repeated hash still finds its item."""
    a, b = actors
    publish(server.url, namespace, 1)
    p0 = open_p0(server.url, namespace, ProcessorOnlyCache(0.0))
    try:
        assert a(p0.is_cached, [key(1), key(1)]) == [True, True]
        assert b(p0.is_cached, [key(1)]) == [True]
        a(p0.begin_request)
        (data, _) = a(p0.get_and_update_item, None, key(1))
        assert same(data, truth(1))
        (data, _) = b(p0.get_and_update_item, None, key(1))
        assert same(data, truth(1))
        (data, _) = a(p0.get_and_update_item, None, key(1))  # the repeat, in a's request
        assert same(data, truth(1))
        assert p0.fetched(key(1)) is not None  # a's request is still open
        a(p0.end_request)
        assert p0.fetched(key(1)) is None
    finally:
        p0.close()


def test_claims_are_the_request_that_took_them(
    server: LocalServer, raw: redis.Redis, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    p0 = open_p0(server.url, namespace, SenderCache(0.05))
    try:
        assert a(p0.is_cached, [key(1)], claim=True) == [False]
        assert b(p0.is_cached, [key(2)], claim=True) == [False]
        assert claim_of(raw, namespace, 1) == claim_of(raw, namespace, 2) == p0.host_id
        # b gives up its request: its claim ends, a's stays.
        b(p0.release_sender_touches)
        assert claim_of(raw, namespace, 2) is None and claim_of(raw, namespace, 1) == p0.host_id
        # b's update of a's item raises: a's claim stays (b never held it).
        with pytest.raises(CacheMissError):
            b(p0.get_and_update, [None], [key(1)])
        assert claim_of(raw, namespace, 1) == p0.host_id
        # b asking for the item a's request claimed: this host's claim, never waited on;
        # b processes it too, without a claim of its own.
        assert in_time(lambda: b(p0.is_cached, [key(1)], claim=True, wait_s=HANG_S)) == [False]
        assert p0.stats()["remote_claims"] == 2 and p0.stats()["remote_claim_waits"] == 0
        assert claim_of(raw, namespace, 1) == p0.host_id  # still a's
        # b's update publishes it: once stored, the claim has nothing left to guard.
        b(p0.get_and_update, [processed(1)], [key(1)])
        assert p0.flush() and claim_of(raw, namespace, 1) is None
        assert p0.remote.contains([key(1)]) == [True]
        a(p0.get_and_update, [processed(1)], [key(1)])  # nothing left to release
        assert p0.stats()["remote_claims_released"] == 2
    finally:
        p0.close()


def test_close_ends_every_requests_claims(
    server: LocalServer, raw: redis.Redis, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    p0 = open_p0(server.url, namespace, SenderCache(0.05))
    assert a(p0.is_cached, [key(1)], claim=True) == b(p0.is_cached, [key(2)], claim=True)
    p0.close()
    assert claim_of(raw, namespace, 1) is None and claim_of(raw, namespace, 2) is None


def test_close_ends_the_claims_of_an_update_in_flight(
    server: LocalServer, raw: redis.Redis, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    """The update has let go of its claim but not released it yet when another thread
    closes the cache: close releases it (once), and nothing the update processed after that
    is published."""
    a, _ = actors
    local = PausingLocal(0.05)
    p0 = open_p0(server.url, namespace, local)
    try:
        assert a(p0.is_cached, [key(1)], claim=True) == [False]
        local.pause_in = a.ident
        update = a.start(p0.get_and_update, [processed(1)], [key(1)])
        assert local.entered.wait(HANG_S)
        in_time(p0.close)
        assert claim_of(raw, namespace, 1) is None
        local.resume.set()
        ((data, updates),) = update.result(timeout=HANG_S)
        assert same(data, truth(1)) and updates == updates_of(1)
        assert p0.flush() and p0.stats()["remote_claims_released"] == 1
        with open_store(server.url, namespace) as store:
            assert store.contains([key(1)]) == [False]
    finally:
        local.resume.set()
        p0.close()


def test_threads_go_on_calling_while_and_after_the_cache_closes(
    server: LocalServer, namespace: str
) -> None:
    """8 threads serve requests (half the catalogue a remote hit, the rest processed and
    published: the local cache holds nothing) while the cache is closed under them: no call
    raises or hangs, every item is the truth, and nothing is left queued that no writer
    thread will ever put."""
    publish(server.url, namespace, *range(0, CATALOGUE, 2))
    p0 = open_p0(server.url, namespace, ProcessorOnlyCache(0.0))
    served = [0] * N_THREADS  # requests served before the cache was closed
    after = [0] * N_THREADS  # ... and after
    closed = threading.Event()

    def frontend(t: int) -> None:
        rng = random.Random(t)
        while after[t] < 20:
            ids = request_ids(rng, rng.sample(range(CATALOGUE), 4))
            for (data, _), i in zip(serve(p0, ids, rng), ids, strict=True):
                assert same(data, truth(i))
            if closed.is_set():
                after[t] += 1
            else:
                served[t] += 1

    def close_midway() -> None:
        try:
            if until(lambda: sum(served) >= 4 * N_THREADS):
                p0.close()
        finally:
            closed.set()

    closer = threading.Thread(target=close_midway, name="closer")
    closer.start()
    try:
        run_threads(N_THREADS, frontend)
        closer.join(HANG_S)
        stats = p0.stats()  # published before the close; answered by a closed store after
        assert stats["remote_published"] > 0 and stats["remote_skipped"] > 0
        assert p0.flush(HANG_S)
        with open_store(server.url, namespace) as store:
            stored = store.get_many([key(i) for i in range(CATALOGUE)])
        assert all(found is None or same(found, record(i)) for i, found in enumerate(stored))
    finally:
        closed.set()
        closer.join(HANG_S)
        p0.close()


def test_the_request_bracket_reaches_the_local_cache(
    server: LocalServer, namespace: str, actors: tuple[Actor, Actor]
) -> None:
    a, b = actors
    item = {"x": bytes(4096)}  # the whole local cache
    local = SenderCache(4096 / (1 << 30))
    p0 = open_p0(server.url, namespace, local)
    try:
        p0.get_and_update_item((item, None), "a")
        a(p0.begin_request)
        assert a(lambda: local.in_request) and not b(lambda: local.in_request)
        a(p0.touch_sender_cache_item, "a")
        assert a(p0.get_and_update_item, None, "a") == (None, None)
        # "a" stays protected until a's request ends, not only until its own update.
        a(p0.get_and_update_item, (item, None), "b")
        assert local.keys() == ["a"] and p0.stats()["uncached_full"] == 1
        a(p0.end_request)
        assert not a(lambda: local.in_request)
        p0.get_and_update_item((item, None), "b")
        assert local.keys() == ["b"]
    finally:
        p0.close()


def test_a_thread_waiting_on_the_remote_tier_holds_up_no_other_thread(
    server: LocalServer, namespace: str
) -> None:
    other = open_p0(server.url, namespace, SenderCache(0.05))
    p0 = open_p0(server.url, namespace, ProcessorOnlyCache(0.05))
    publish(server.url, namespace, 3)

    def serve(i: int, **lookup: Any) -> Any:
        cached = p0.is_cached([key(i)], claim=True, **lookup)
        p0.touch_sender_cache_item(key(i))
        return cached, p0.get_and_update([None if cached[0] else processed(i)], [key(i)])

    try:
        assert other.is_cached([key(1)], claim=True) == [False]
        p0.get_and_update([processed(2)], [key(2)])
        waited: list[Any] = []
        waiting = threading.Thread(
            target=lambda: waited.append(serve(1, wait_s=HANG_S)), daemon=True
        )
        waiting.start()
        assert until(lambda: p0.stats()["remote_claim_waits"] == 1)
        # A local hit and a remote hit while the other thread waits.
        for i in (2, 3):
            cached, [(data, updates)] = in_time(lambda i=i: serve(i))
            assert cached == [True] and same(data, truth(i)) and updates == updates_of(i)
        assert waiting.is_alive()
        other.get_and_update([processed(1)], [key(1)])
        waiting.join(HANG_S)
        assert not waiting.is_alive()
        cached, [(data, _)] = waited[0]
        assert cached == [True] and same(data, truth(1))
        assert p0.stats()["remote_claim_wait_hits"] == 1
    finally:
        other.close()
        p0.close()


# -- many threads, one cache, another host beside it -----------------------------------------


def run_threads(n: int, target: Callable[[int], None]) -> None:
    """``target(i)`` for each i in range(n) on its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def main(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(i,), name=f"p0-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * HANG_S)
        assert not t.is_alive(), f"{t.name} hung"
    if errors:
        raise errors[0]


class SecondHost:
    """Another host's P0 (holding nothing locally: every request asks the store) serving
    random requests over the catalogue in single flight until stopped, checking each item."""

    def __init__(self, url: str, namespace: str) -> None:
        self.p0 = open_p0(url, namespace, ProcessorOnlyCache(0.0))
        self.requests = 0
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="second-host", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(99)
        try:
            while not self._stop.is_set():
                ids = rng.sample(range(CATALOGUE), rng.randint(1, 3))
                hashes = [key(i) for i in ids]
                cached = self.p0.is_cached(hashes, claim=True, wait_s=0.2)
                inputs = [None if hit else processed(i) for i, hit in zip(ids, cached, strict=True)]
                outputs = self.p0.get_and_update(inputs, hashes)
                for (data, updates), i in zip(outputs, ids, strict=True):
                    assert same(data, truth(i)) and updates == updates_of(i)
                self.requests += 1
        except BaseException as exc:
            self._errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(4 * HANG_S)
        assert not self._thread.is_alive(), "the second host hung"
        if self._errors:
            raise self._errors[0]
        assert self.requests > 0


def request_ids(rng: random.Random, hot: list[int]) -> list[int]:
    """One request: 1 to 4 of the round's items, a repeat now and then."""
    ids = rng.sample(hot, rng.randint(1, len(hot)))
    if rng.random() < 0.2:
        ids.append(ids[0])
    return ids


def serve(p0: TieredSenderCache, ids: list[int], rng: random.Random) -> list[Any]:
    """One request through ``p0`` as an engine's frontend thread runs it: ``is_cached`` (with a
    claim and a wait, or not), process the misses, touch every hash, update (batched or one
    by one inside a request bracket).  A P0 miss is a failure: nothing is evicted, so only
    another thread's use of a fetched item could cause one.  The outputs."""
    hashes = [key(i) for i in ids]
    claim = rng.random() < 0.5
    cached = p0.is_cached(hashes, claim=claim, wait_s=0.2 if rng.random() < 0.5 else 0.0)
    inputs = [None if hit else processed(i) for i, hit in zip(ids, cached, strict=True)]
    for h in hashes:
        p0.touch_sender_cache_item(h)
    if rng.random() < 0.5:
        try:
            outputs = p0.get_and_update(inputs, hashes)
        finally:
            p0.release_sender_touches()
    else:
        p0.begin_request()
        try:
            outputs = [p0.get_and_update_item(x, h) for x, h in zip(inputs, hashes, strict=True)]
        finally:
            p0.end_request()
    for (_, updates), i in zip(outputs, ids, strict=True):
        assert updates == updates_of(i)
    return outputs


def _reader_process(handle: Any, requests: Any, report: Any, n_threads: int) -> None:
    """A worker: one ShmReceiverCache shared by ``n_threads`` threads resolving requests
    (lists of (id, handle)) until ``None``, acknowledging each ("done"); then its tally."""
    sys.setswitchinterval(1e-6)
    tally = {"features": 0, "wrong": 0, "misses": 0, "errors": 0}
    lock = threading.Lock()
    with ShmReceiverCache(handle) as reader:
        report.put("attached")

        def resolve() -> None:
            while (request := requests.get()) is not None:
                features = [Feature(data=h, mm_hash=key(i)) for i, h in request]
                seen = {"features": len(features), "wrong": 0, "misses": 0, "errors": 0}
                try:
                    reader.get_and_update_features(features)
                except CacheMissError as miss:
                    seen["misses"] += len(miss.mm_hashes)
                except Exception:
                    seen["errors"] += 1
                else:
                    seen["wrong"] = sum(
                        not same(f.data, truth(i))
                        for (i, _), f in zip(request, features, strict=True)
                    )
                with lock:
                    for name, n in seen.items():
                        tally[name] += n
                report.put("done")

        threads = [threading.Thread(target=resolve) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report.put(tally)


class Downstream:
    """Where P0's outputs go, per mode: nowhere (``processor_only``: checked here), one P1
    thread resolving requests in arrival order (``lru``), or a reader process (``shm``)."""

    def __init__(self, mode: str, p0: TieredSenderCache) -> None:
        self.mode = mode
        self.p0 = p0
        self.tally: dict[str, int] | None = None  # the reader's, once closed (shm)
        self._closed = False
        if mode == "lru":
            self.p1 = ReceiverCache(0.05)
            self._to_p1: queue.Queue[tuple[list[int], list[Any], queue.Queue[Any]] | None]
            self._to_p1 = queue.Queue()
            self._p1_thread = threading.Thread(target=self._engine_core, name="engine-core")
            self._p1_thread.start()
        elif mode == "shm":
            assert isinstance(p0.local, ShmSenderCache)
            ctx = mp.get_context("spawn")
            self._requests, self._report = ctx.Queue(), ctx.Queue()
            self._reader = ctx.Process(
                target=_reader_process, args=(p0.local.handle(), self._requests, self._report, 2)
            )
            self._reader.start()
            self.sent = self.acked = 0
            self._acked = threading.Condition()
            self._tally: queue.Queue[Any] = queue.Queue()
            try:
                assert self._report.get(timeout=120) == "attached"  # before P0 writes
            except BaseException:
                self._reader.kill()
                raise
            self._collector = threading.Thread(target=self._collect, name="acks")
            self._collector.start()

    def send(self, ids: list[int], outputs: list[Any]) -> None:
        """Deliver one request's outputs; every item resolved downstream is the truth."""
        data = [d for d, _ in outputs]
        if self.mode == "processor_only":
            assert all(same(d, truth(i)) for d, i in zip(data, ids, strict=True))
        elif self.mode == "lru":
            assert all(d is None or same(d, truth(i)) for d, i in zip(data, ids, strict=True))
            answer = self._submit(ids, data)
            if isinstance(answer, CacheMissError):
                # Requests reached P1 in another order than P0's threads applied them: a
                # drift (nothing is evicted: P1 only lacks items still on their way), and
                # the retry that carries every item's data recovers it.
                answer = self._submit(ids, [truth(i) for i in ids])
                assert not isinstance(answer, CacheMissError), f"{ids}: a second miss"
            assert all(same(item, truth(i)) for item, i in zip(answer, ids, strict=True))
        else:
            handles = [(i, d) for d, i in zip(data, ids, strict=True) if isinstance(d, ShmHandle)]
            assert all(
                same(d, truth(i))
                for d, i in zip(data, ids, strict=True)
                if not isinstance(d, ShmHandle)
            )
            if handles:
                with self._acked:
                    self.sent += 1
                self._requests.put(handles)

    def _submit(self, ids: list[int], data: list[Any]) -> Any:
        reply: queue.Queue[Any] = queue.Queue()
        self._to_p1.put((ids, data, reply))
        return reply.get(timeout=HANG_S)

    def _engine_core(self) -> None:
        while (job := self._to_p1.get()) is not None:
            ids, data, reply = job
            features = [Feature(data=d, mm_hash=key(i)) for i, d in zip(ids, data, strict=True)]
            try:
                self.p1.get_and_update_features(features)
            except CacheMissError as miss:
                reply.put(miss)
            else:
                reply.put([f.data for f in features])

    def _collect(self) -> None:
        while (message := self._report.get(timeout=4 * HANG_S)) == "done":
            with self._acked:
                self.acked += 1
                self._acked.notify_all()
        self._tally.put(message)

    def clear(self) -> None:
        """Clear P0 (and P1) between rounds, once nothing is in flight (every handle read)."""
        if self.mode == "shm":
            with self._acked:
                assert self._acked.wait_for(lambda: self.acked == self.sent, HANG_S)
        self.p0.clear_cache()
        if self.mode == "lru":
            self.p1.clear_cache()

    def close(self) -> None:
        """Stop the P1 thread or the reader (whose tally is then :attr:`tally`); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "lru":
            self._to_p1.put(None)
            self._p1_thread.join(HANG_S)
        elif self.mode == "shm":
            try:
                for _ in range(2):
                    self._requests.put(None)
                self._collector.join(4 * HANG_S)
                self.tally = self._tally.get(timeout=HANG_S)
                self._reader.join(HANG_S)
                assert self._reader.exitcode == 0
            finally:
                if self._reader.is_alive():
                    self._reader.kill()


def local_cache(mode: str) -> BaseSenderCache:
    """A local cache far larger than the catalogue: nothing is evicted."""
    if mode == "processor_only":
        return ProcessorOnlyCache(0.01)
    if mode == "lru":
        return SenderCache(0.01)
    return ShmSenderCache(0.01)


@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_threads_sharing_one_tiered_cache_beside_another_host(
    server: LocalServer, raw: redis.Redis, namespace: str, mode: str
) -> None:
    p0 = open_p0(server.url, namespace, local_cache(mode))
    downstream = Downstream(mode, p0)
    second = SecondHost(server.url, namespace)
    try:
        # Rounds: all threads ask for the same few items at once, from a P0 cleared between
        # rounds, so the remote tier serves many threads the same items at the same time.
        barrier = threading.Barrier(N_THREADS)

        def frontend(t: int) -> None:
            rng = random.Random(t)
            for round_ in range(ROUNDS):
                if barrier.wait(HANG_S) == 0:
                    downstream.clear()
                barrier.wait(HANG_S)
                hot = random.Random(round_).sample(range(CATALOGUE), 4)
                ids = request_ids(rng, hot)
                downstream.send(ids, serve(p0, ids, rng))

        run_threads(N_THREADS, frontend)
        second.stop()
        downstream.close()
        if downstream.tally is not None:
            assert downstream.tally["features"] > 0
            assert downstream.tally == {**downstream.tally, "wrong": 0, "misses": 0, "errors": 0}
        assert p0.flush() and second.p0.flush()
        # Every claim ended, nothing fetched is left waiting, every item stored is the truth.
        assert raw.keys(f"mmc/{namespace}/*/claim") == []
        assert all(p0.fetched(key(i)) is None for i in range(CATALOGUE))
        stats = p0.stats()
        assert stats["remote_served"] > 0 and stats["remote_prefetch_dropped"] == 0
        for i, stored in enumerate(p0.remote.get_many([key(i) for i in range(CATALOGUE)])):
            assert stored is None or same(stored, record(i))
    finally:
        second.p0.close()
        downstream.close()
        p0.close()
