"""Single flight across hosts: claims in a real Valkey (started on a free loopback port).

Hosts are ``TieredSenderCache`` objects with stores of their own, in threads of this process
or in a process of their own (to be SIGKILLed while holding a claim).  The oracle: an item
many hosts ask for at once is processed once, every host gets the same item bit for bit, a
claim whose holder gave up or died stops nobody for longer than its lapse, and a failing
server costs a call its deadline, never a hang (each call runs under a generous join
timeout; no duration is asserted).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest
import redis

from mmcache import CacheMissError, SenderCache, ShmSenderCache, _core, make_caches
from mmcache.remote import TieredSenderCache, redis_backend
from mmcache.remote.local_server import LocalServer
from test_remote import (
    HANG_S,
    MiB,
    in_time,
    key,
    make_item,
    open_store,
    same,
)
from tests.servers import resume, stall


def open_p0(url: str, namespace: str, claim_ttl_s: float = 5.0) -> TieredSenderCache:
    """A host's P0 over a healthy server: a deadline that only a hang reaches (a loaded test
    machine must not turn a claim into a timeout)."""
    return TieredSenderCache(
        SenderCache(0.05), open_store(url, namespace, timeout_s=10), claim_ttl_s=claim_ttl_s
    )


def claim_of(raw: redis.Redis, namespace: str, i: int) -> str | None:
    """Who holds the claim on item ``i``, read behind the hosts' backs."""
    holder = raw.get(f"mmc/{namespace}/{key(i)}/claim")
    return None if holder is None else holder.decode()


def until(condition: Callable[[], bool]) -> bool:
    """Whether ``condition()`` became true within :data:`HANG_S` (polled)."""
    give_up = time.monotonic() + HANG_S
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True


def item(i: int) -> tuple[dict[str, Any], list[Any]]:
    return make_item(i, 40_000), ["<image>", i]


class Host:
    """One host's P0 asking in single flight, as ``mmcache simulate`` does: ``is_cached``
    with ``claim=True`` and a wait, process the misses, update (which publishes)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        before_processing: Callable[[], object],
        wait_s: float = HANG_S,
        claim_ttl_s: float = 5.0,
    ):
        self.p0 = open_p0(url, namespace, claim_ttl_s)
        self.processed: list[int] = []
        self.sent: set[int] = set()
        self.before_processing = before_processing
        self.wait_s = wait_s

    def serve(self, ids: Sequence[int]) -> None:
        hashes = [key(i) for i in ids]
        cached = self.p0.is_cached(hashes, claim=True, wait_s=self.wait_s)
        if not all(cached):
            self.before_processing()
        inputs = [None if hit else self._process(i) for i, hit in zip(ids, cached, strict=True)]
        outputs = self.p0.get_and_update(inputs, hashes)
        for (data, updates), i in zip(outputs, ids, strict=True):
            # lru mode: P1 holds what this host sent it before (no data); the rest is sent.
            assert (i in self.sent and data is None) or same(data, make_item(i, 40_000))
            assert updates == ["<image>", i]
            self.sent.add(i)

    def _process(self, i: int) -> tuple[dict[str, Any], list[Any]]:
        self.processed.append(i)
        return item(i)


def run_at_once(
    hosts: list[Host],
    requests: list[list[list[int]]],
    *,
    claimed_first: Sequence[list[int]] | None = None,
    limit_s: float = 4 * HANG_S,
) -> None:
    """Each host serves its requests in turn, all hosts at once (from one barrier); with
    ``claimed_first``, each host's first request has claimed those items before the barrier
    (in a lookup of its own, as vLLM's per modality).  Fails if a host has not finished
    after ``limit_s``."""
    barrier = threading.Barrier(len(hosts))
    errors: list[BaseException] = []

    def run(host: Host, mine: list[list[int]], first: list[int]) -> None:
        try:
            assert not any(host.p0.is_cached([key(i) for i in first], claim=True))
            barrier.wait()
            for ids in mine:
                host.serve(ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(h, r, f), daemon=True)
        for h, r, f in zip(hosts, requests, claimed_first or [[]] * len(hosts), strict=True)
    ]
    for t in threads:
        t.start()
    give_up = time.monotonic() + limit_s
    for t in threads:
        t.join(max(0.0, give_up - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a host hung"
    if errors:
        raise errors[0]


def assert_settled(hosts: list[Host], raw: redis.Redis, namespace: str, ids: Iterable[int]) -> None:
    """No host's wait ended at its bound, every item published was put and no claim is left
    on ``ids``."""
    assert all(h.p0.stats()["remote_claim_wait_timeouts"] == 0 for h in hosts)
    assert all(h.p0.flush() for h in hosts)
    assert all(claim_of(raw, namespace, i) is None for i in ids)


def test_hosts_asking_for_the_same_new_items_at_once_process_each_once(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    ids = list(range(6))
    hosts: list[Host] = []

    def others_are_waiting() -> None:  # so the waiting is real, not a late lookup's hit
        assert until(lambda: sum(h.p0.stats()["remote_claim_waits"] for h in hosts) == 12)

    hosts += [Host(server.url, namespace, others_are_waiting) for _ in range(3)]
    orders = [random.Random(n).sample(ids, len(ids)) for n in range(3)]
    try:
        run_at_once(hosts, [[order] for order in orders])
        # One host claimed all six (claims go in one key order), the others waited for them.
        assert sorted(i for h in hosts for i in h.processed) == ids
        stats = [h.p0.stats() for h in hosts]
        assert sorted(s["remote_claims"] for s in stats) == [0, 0, 6]
        waiters = [s for s in stats if s["remote_claims"] == 0]
        for s in waiters:
            assert s["remote_claim_wait_hits"] == 6 and s["remote_served"] == 6
            assert s["remote_claim_wait_abandoned"] == 0
        assert_settled(hosts, raw, namespace, ids)
    finally:
        for h in hosts:
            h.p0.close()


def test_hosts_with_overlapping_requests_never_wait_in_a_circle(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    # Four hosts, each a stream of requests over a few shared items in its own order: hosts
    # claim some items of a request and wait for others, in every combination.
    rng = random.Random(7)
    requests = [[rng.sample(range(12), rng.randint(1, 4)) for _ in range(8)] for _ in range(4)]
    hosts = [Host(server.url, namespace, lambda: None) for _ in range(4)]
    try:
        run_at_once(hosts, requests)
        asked = {i for mine in requests for ids in mine for i in ids}
        assert sorted(i for h in hosts for i in h.processed) == sorted(asked)
        # A claimer gives its claims up while it waits: a wait for one of them may end with
        # the claim gone (abandoned: claimed and processed here), never at its bound.
        assert_settled(hosts, raw, namespace, asked)
    finally:
        for h in hosts:
            h.p0.close()


def test_two_hosts_whose_requests_claimed_each_others_items_never_wait_for_each_other(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    # Two hosts' requests for the same two images, each of which claimed one first: were
    # they to wait holding their claims, each would wait for the other for all of wait_s
    # (the claims outlast it: no lapse ends the wait).
    hosts = [
        Host(server.url, namespace, lambda: None, wait_s=10 * HANG_S, claim_ttl_s=20 * HANG_S)
        for _ in range(2)
    ]
    try:
        run_at_once(hosts, [[[1, 2]], [[2, 1]]], claimed_first=[[1], [2]], limit_s=HANG_S)
        # Both gave their claims up to wait; one claimed both again, the other waited for them.
        assert sorted(i for h in hosts for i in h.processed) == [1, 2]
        assert sorted(len(h.processed) for h in hosts) == [0, 2]
        assert_settled(hosts, raw, namespace, [1, 2])
    finally:
        for h in hosts:
            h.p0.close()


def test_a_wait_takes_back_the_claims_of_the_requests_earlier_lookups_here_and_locally(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    # A request's lookup waits for an item another host claimed: its earlier lookup's claim,
    # in the store and in the shm ring, is given up while it waits and taken back after.
    a = TieredSenderCache(
        ShmSenderCache(0.01, max_writers=2), open_store(server.url, namespace, timeout_s=10)
    )
    b = open_p0(server.url, namespace, claim_ttl_s=20 * HANG_S)  # no lapse ends the wait
    try:
        assert b.is_cached([key(2)], claim=True) == [False]
        assert a.is_cached([key(1)], claim=True) == [False]
        assert claim_of(raw, namespace, 1) == a.host_id and a.local.stats()["store_claims"] == 1
        given_up: list[bool] = []

        def a_holds_no_claim() -> bool:
            return claim_of(raw, namespace, 1) is None and a.local.stats()["store_claims"] == 0

        def publish_once_a_gave_up() -> None:
            given_up.append(until(a_holds_no_claim))
            b.get_and_update([item(2)], [key(2)])

        publisher = threading.Thread(target=publish_once_a_gave_up, daemon=True)
        publisher.start()
        assert a.is_cached([key(2)], claim=True, wait_s=10 * HANG_S) == [True]
        publisher.join(HANG_S)
        assert given_up == [True], "a waited holding its claims"
        assert a.stats()["remote_claim_wait_hits"] == 1
        # Both claims are the request's again (item 2's only in the ring: it was fetched).
        assert claim_of(raw, namespace, 1) == a.host_id and a.local.stats()["store_claims"] == 2
        assert sorted(a.give_up_claims()) == sorted([key(1), key(2)])
        assert a_holds_no_claim()
    finally:
        a.close()
        b.close()


_CLAIMER = """
import sys, time
from mmcache import SenderCache
from mmcache.remote import RemoteStore, TieredSenderCache
url, namespace, h = sys.argv[1:]
store = RemoteStore(url, namespace=namespace, secret="shared secret")
p0 = TieredSenderCache(SenderCache(0.01), store, claim_ttl_s=1.0)
assert p0.is_cached([h], claim=True) == [False]
print(p0.host_id, flush=True)
time.sleep(3600)
"""


def test_a_claimer_killed_holding_its_claim_stops_the_others_only_until_it_lapses(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    p0 = open_p0(server.url, namespace)
    with subprocess.Popen(
        [sys.executable, "-c", _CLAIMER, server.url, namespace, key(1)],
        stdout=subprocess.PIPE,
        text=True,
    ) as claimer:
        try:
            assert claimer.stdout is not None
            claimer_id = in_time(claimer.stdout.readline).strip()
            assert claim_of(raw, namespace, 1) == claimer_id
        finally:
            claimer.kill()
    try:
        # The wait (HANG_S) is far longer than the claim's 1 s: it ends as the claim lapses.
        assert in_time(lambda: p0.is_cached([key(1)], claim=True, wait_s=HANG_S)) == [False]
        s = p0.stats()
        assert s["remote_claim_waits"] == s["remote_claim_wait_abandoned"] == 1
        assert s["remote_claim_wait_timeouts"] == 0 and s["remote_claims"] == 1
        assert claim_of(raw, namespace, 1) == p0.host_id  # this host processes it now
        p0.get_and_update([item(1)], [key(1)])
        assert p0.flush() and claim_of(raw, namespace, 1) is None
        assert same(p0.remote.get(key(1)), {"item": item(1)[0], "prompt_updates": item(1)[1]})
    finally:
        p0.close()


def test_a_wait_ends_at_its_bound_while_the_claimer_works_on(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    a, b = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        assert a.is_cached([key(1)], claim=True) == [False]
        assert in_time(lambda: b.is_cached([key(1)], claim=True, wait_s=0.2)) == [False]
        s = b.stats()
        assert s["remote_claim_waits"] == s["remote_claim_wait_timeouts"] == 1
        assert s["remote_claims"] == 0 and claim_of(raw, namespace, 1) == a.host_id
    finally:
        a.close()
        b.close()


def _raise_in_update(p0: TieredSenderCache) -> None:
    with pytest.raises(CacheMissError):  # no data for a hash it holds no item of
        p0.get_and_update([None, None], [key(1), key(2)])


@pytest.mark.parametrize(
    "give_up",
    [_raise_in_update, TieredSenderCache.release_sender_touches, TieredSenderCache.close],
    ids=["update-raises", "release_sender_touches", "close"],
)
def test_a_claimer_that_gives_up_frees_its_claims_at_once(
    server: LocalServer,
    raw: redis.Redis,
    namespace: str,
    give_up: Callable[[TieredSenderCache], None],
) -> None:
    a, b = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        assert a.is_cached([key(1), key(2)], claim=True) == [False, False]
        assert claim_of(raw, namespace, 1) == claim_of(raw, namespace, 2) == a.host_id
        give_up(a)
        assert claim_of(raw, namespace, 1) is None and claim_of(raw, namespace, 2) is None
        # Nothing left to wait for: the other host claims both at its first lookup.
        assert in_time(lambda: b.is_cached([key(1), key(2)], claim=True, wait_s=HANG_S)) == [
            False,
            False,
        ]
        s = b.stats()
        assert s["remote_claim_waits"] == 0 and s["remote_claims"] == 2
        assert a.stats()["remote_claims_released"] == 2
    finally:
        a.close()
        b.close()


def test_a_request_that_ends_without_its_update_ends_its_claims(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    # As the shm ring's: a request whose processing raised ends (no update will come) and
    # its claims end with it, in the store and here; the thread's next request, which waits,
    # never takes them again (nobody would process the item: every other host would wait).
    a = TieredSenderCache(ShmSenderCache(0.01), open_store(server.url, namespace, timeout_s=10))
    b = open_p0(server.url, namespace, claim_ttl_s=20 * HANG_S)
    try:
        a.begin_request()
        assert a.is_cached([key(1)], claim=True) == [False]
        assert claim_of(raw, namespace, 1) == a.host_id and a.local.stats()["store_claims"] == 1
        a.end_request()  # the request's processing raised: it ends without an update
        assert a.local.stats()["store_claims"] == 0
        assert claim_of(raw, namespace, 1) is None
        assert b.is_cached([key(2)], claim=True) == [False]
        a.begin_request()
        assert in_time(lambda: a.is_cached([key(2)], claim=True, wait_s=0.2)) == [False]
        assert claim_of(raw, namespace, 1) is None
        a.end_request()
        assert in_time(lambda: b.is_cached([key(1)], claim=True, wait_s=HANG_S)) == [False]
        assert b.stats()["remote_claim_waits"] == 0 and claim_of(raw, namespace, 1) == b.host_id
    finally:
        a.close()
        b.close()


def test_a_claim_ends_only_once_the_published_item_is_stored(
    server: LocalServer, raw: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    p0 = open_p0(server.url, namespace)
    holders_at_put: list[str | None] = []
    real_put = p0.remote.put

    def put(k: str, record: Any) -> None:
        holders_at_put.append(claim_of(raw, namespace, 1))
        real_put(k, record)

    monkeypatch.setattr(p0.remote, "put", put)
    try:
        assert p0.is_cached([key(1)], claim=True) == [False]
        p0.get_and_update([item(1)], [key(1)])
        assert p0.flush()
        assert holders_at_put == [p0.host_id] and claim_of(raw, namespace, 1) is None
        assert p0.remote.contains([key(1)]) == [True]
        assert p0.stats()["remote_claims_released"] == 1
    finally:
        p0.close()


def test_close_waits_for_the_writer_at_most_its_timeout_and_frees_the_queued_claims(
    server: LocalServer, raw: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(server.url, namespace, timeout_s=10)
    release, holding = threading.Event(), threading.Event()
    real_put = store.put

    def held_put(k: str, record: Any) -> None:
        holding.set()
        release.wait(3 * HANG_S)  # a put that outlasts close's timeout (a slow store)
        real_put(k, record)

    monkeypatch.setattr(store, "put", held_put)
    p0 = TieredSenderCache(SenderCache(0.05), store, publish_queue=1)
    try:
        for i in range(2):  # the writer holds item 0's put; item 1 fills the queue
            assert p0.is_cached([key(i)], claim=True) == [False]
            p0.get_and_update([item(i)], [key(i)])
            # Item 1 is queued only once the writer took item 0 (else the full queue drops it).
            assert holding.wait(HANG_S)
        assert claim_of(raw, namespace, 1) == p0.host_id
        in_time(lambda: p0.close(timeout_s=0.1))
        # Item 1 was never put (counted), and its claim does not wait for a put to come.
        assert p0.stats()["remote_publish_dropped"] == 1
        assert claim_of(raw, namespace, 1) is None
    finally:
        release.set()
        p0.close()


def test_a_host_never_waits_on_its_own_claims(server: LocalServer, namespace: str) -> None:
    p0 = open_p0(server.url, namespace)
    try:
        for _ in range(2):  # asked again before its update: still its own claim
            assert in_time(lambda: p0.is_cached([key(1)], claim=True, wait_s=HANG_S)) == [False]
        s = p0.stats()
        assert s["remote_claims"] == 1 and s["remote_claim_waits"] == 0
    finally:
        p0.close()


def test_no_claim_is_taken_on_a_present_item_or_without_claim(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    writer, p0 = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        writer.get_and_update([item(1)], [key(1)])
        assert writer.flush()
        assert p0.is_cached([key(1), key(2)], claim=True) == [True, False]
        assert claim_of(raw, namespace, 1) is None and claim_of(raw, namespace, 2) == p0.host_id
        assert p0.is_cached([key(3)]) == [False] and claim_of(raw, namespace, 3) is None
        assert p0.stats()["remote_claims"] == 1
    finally:
        writer.close()
        p0.close()


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
def test_a_lookup_that_waits_no_more_claims_the_misses_behind_another_hosts_claim(
    server: LocalServer, raw: redis.Redis, namespace: str, wait_s: float
) -> None:
    """The store claims a batch's misses in key order and none after one another host holds
    (a host that would wait for it holds only keys before it). A lookup that will not wait
    (no ``wait_s``, or its time is up) claims the misses after it too: else nobody held them
    while this host processed them, and a third host processed them again."""
    a, b, c = (open_p0(server.url, namespace) for _ in range(3))
    first, second = sorted([1, 2], key=lambda i: f"mmc/{namespace}/{key(i)}")
    try:
        assert a.is_cached([key(first)], claim=True) == [False]  # a never publishes it
        assert b.is_cached([key(first), key(second)], claim=True, wait_s=wait_s) == [False] * 2
        assert claim_of(raw, namespace, first) == a.host_id
        assert claim_of(raw, namespace, second) == b.host_id
        assert b.stats()["remote_claims"] == 1

        def publish_once_c_waits() -> None:
            assert until(lambda: c.stats()["remote_claim_waits"] == 1)
            b.get_and_update([item(first), item(second)], [key(first), key(second)])

        publisher = threading.Thread(target=publish_once_c_waits, daemon=True)
        publisher.start()
        assert in_time(lambda: c.is_cached([key(second)], claim=True, wait_s=HANG_S)) == [True]
        publisher.join(HANG_S)
        assert c.stats()["remote_claims"] == 0, "c waited for b's item instead of processing it"
    finally:
        for host in (a, b, c):
            host.close()


def test_a_host_may_wait_for_others_claims_without_claiming(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    a, b = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        assert a.is_cached([key(1)], claim=True) == [False]

        def publish_once_b_waits() -> None:
            assert until(lambda: b.stats()["remote_claim_waits"] == 1)
            a.get_and_update([item(1)], [key(1)])

        publisher = threading.Thread(target=publish_once_b_waits, daemon=True)
        publisher.start()
        assert in_time(lambda: b.is_cached([key(1)], wait_s=HANG_S)) == [True]
        publisher.join(HANG_S)
        fetched = b.fetched(key(1))
        assert fetched is not None and same(fetched[0], item(1)[0])
        s = b.stats()
        assert s["remote_claim_wait_hits"] == 1 and s["remote_claims"] == 0
    finally:
        a.close()
        b.close()


def test_a_stalled_server_costs_claim_calls_their_deadline_not_a_hang(
    own_server: LocalServer, namespace: str
) -> None:
    store_options = {"timeout_s": 0.3, "breaker_failures": 100}
    a = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    b = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    a_thread = ThreadPoolExecutor(max_workers=1)  # a's request: its claims are its thread's
    try:
        assert a_thread.submit(a.is_cached, [key(1)], claim=True).result(HANG_S) == [False]
        waiting: list[Any] = []
        waiter = threading.Thread(
            target=lambda: waiting.append(b.is_cached([key(1)], claim=True, wait_s=HANG_S)),
            daemon=True,
        )
        waiter.start()
        assert until(lambda: b.stats()["remote_claim_waits"] == 1)
        stall(own_server)
        try:
            waiter.join(HANG_S)  # its next look times out: the wait ends, b processes
            assert not waiter.is_alive() and waiting == [[False]]
            s = b.stats()
            # One deadline in all: nothing is claimed again after the look that failed.
            assert s["remote_timeouts"] == 1 and s["remote_claim_wait_abandoned"] == 1
            # A claiming lookup and a release with the server stalled: a deadline each.
            assert in_time(lambda: b.is_cached([key(2)], claim=True, wait_s=HANG_S)) == [False]
            a_thread.submit(a.release_sender_touches).result(HANG_S)  # a deadline, not a hang
            assert a.stats()["remote_timeouts"] == 1
        finally:
            resume(own_server)
    finally:
        a_thread.shutdown(wait=False)
        in_time(a.close)
        in_time(b.close)


def test_claims_a_failed_lookup_took_are_the_owners_and_are_released(
    own_server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claiming lookup of a large item and a miss whose script ran (the miss claimed) and
    whose chunk read then timed out (the server stalled mid-value): the claim is in the
    store, so the answer names its owner as the miss's holder, and the request's end
    releases it.  It was ``(None, None)``: a claim nobody released, that other hosts waited
    on until it lapsed."""
    # More than the sockets' buffers hold: the stall catches the value mostly unsent.
    with open_store(own_server.url, namespace, timeout_s=30) as writer:
        writer.put(key(1), {"item": make_item(1, 40 * MiB), "prompt_updates": None})
    store = open_store(own_server.url, namespace, timeout_s=1.0, breaker_failures=100)
    a = TieredSenderCache(SenderCache(0.05), store)
    a_thread = ThreadPoolExecutor(max_workers=1)  # a's request: its claims are its thread's
    raw = redis.Redis.from_url(own_server.url)
    real_into = redis_backend._ReplyReader.into

    def stall_first(reader: Any, view: memoryview) -> bytes:
        stall(own_server)  # once the value has begun to arrive: the claims are taken
        return real_into(reader, view)

    def stalled(call: Callable[[], Any]) -> Any:
        monkeypatch.setattr(redis_backend._ReplyReader, "into", stall_first)
        try:
            return a_thread.submit(call).result(HANG_S)
        finally:
            resume(own_server)
            monkeypatch.undo()

    try:
        answer = stalled(lambda: store.fetch_or_claim([key(1), key(2)], "host-b"))
        assert store.stats()["timeouts"] == 1 and claim_of(raw, namespace, 2) == "host-b"
        assert answer == [(None, "host-b"), (None, "host-b")], "a claim it holds, unsaid"
        store.release_claims([key(1), key(2)], "host-b")  # compare-and-delete: what it took
        assert claim_of(raw, namespace, 2) is None
        found = stalled(lambda: a.is_cached([key(1), key(3)], claim=True))
        assert found == [False, False] and claim_of(raw, namespace, 3) == a.host_id
        a_thread.submit(a.release_sender_touches).result(HANG_S)  # the request gives up
        assert claim_of(raw, namespace, 3) is None, "a claim the host did not know it held"
    finally:
        a_thread.shutdown(wait=False)
        raw.close()
        in_time(a.close)


def test_a_server_that_stalls_as_a_wait_begins_costs_it_one_deadline(
    own_server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_options = {"timeout_s": 0.3, "breaker_failures": 100}
    a = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    b = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    real_release = b.remote.release_claims

    def release_as_the_server_stalls(keys: Sequence[str], owner: str) -> None:
        stall(own_server)
        real_release(keys, owner)

    def b_request() -> list[bool]:  # one thread's: the claim is its request's
        assert b.is_cached([key(2)], claim=True) == [False]  # an earlier lookup's claim
        monkeypatch.setattr(b.remote, "release_claims", release_as_the_server_stalls)
        return b.is_cached([key(1)], claim=True, wait_s=HANG_S)

    try:
        assert a.is_cached([key(1)], claim=True) == [False]
        try:
            # The wait gives item 2's claim up first: that release times out, and nothing
            # more is asked of the store (no look, no claim taken again).
            assert in_time(b_request) == [False]
        finally:
            resume(own_server)
        s = b.stats()
        assert s["remote_timeouts"] == 1
        assert s["remote_claim_waits"] == s["remote_claim_wait_abandoned"] == 1
    finally:
        monkeypatch.undo()
        in_time(a.close)
        in_time(b.close)


def test_a_server_that_stalls_as_a_wait_begins_is_not_asked_about_a_local_hit_lost_meanwhile(
    own_server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local hit evicted during a wait is asked of the tier after it, unless the store
    failed: the failing store costs the wait one deadline, not one more for that lookup."""
    store_options = {"timeout_s": 0.3, "breaker_failures": 100}
    a = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    b = TieredSenderCache(SenderCache(0.05), open_store(own_server.url, namespace, **store_options))
    old = key("old")
    b.local.get_and_update_item(item(0), old)  # cached at b only
    real_release = b.remote.release_claims

    def release_as_the_server_stalls(keys: Sequence[str], owner: str) -> None:
        for i in range(1, 200):  # b's other requests evict old meanwhile
            if not b.local.is_cached_item(old):
                break
            b.local.get_and_update_item((make_item(i, MiB), ["<image>", i]), key(f"filler-{i}"))
        stall(own_server)
        real_release(keys, owner)

    def b_request() -> list[bool]:  # one thread's: the claim is its request's
        assert b.is_cached([key(2)], claim=True) == [False]  # an earlier lookup's claim
        monkeypatch.setattr(b.remote, "release_claims", release_as_the_server_stalls)
        return b.is_cached([old, key(1)], claim=True, wait_s=HANG_S)

    try:
        assert a.is_cached([key(1)], claim=True) == [False]
        try:
            assert in_time(b_request) == [False, False]
        finally:
            resume(own_server)
        assert not b.local.is_cached_item(old)
        assert b.stats()["remote_timeouts"] == 1
    finally:
        monkeypatch.undo()
        in_time(a.close)
        in_time(b.close)


def test_a_local_hit_evicted_while_the_lookup_waits_is_reported_missing(
    server: LocalServer, namespace: str
) -> None:
    """A lookup that waits for another host's item answers for its local hits as they stand
    after the wait: one evicted locally meanwhile (another thread's updates filled the local
    cache) is a miss the engine processes, never a hit whose update then misses."""
    host, claimer = open_p0(server.url, namespace), open_p0(server.url, namespace)
    old, new = key("old"), key("new")
    try:
        host.local.get_and_update_item(item(0), old)  # cached here only, never published
        assert claimer.is_cached([new], claim=True) == [False]
        remote = host.remote
        evicted: list[bool] = []

        class Waiting:
            """The host's store, whose first look again during the wait has the host's other
            requests evict ``old`` and the claimer publish ``new`` first."""

            def __getattr__(self, name: str) -> Any:
                return getattr(remote, name)

            def fetch_or_claim(self, keys: list[str], owner: str, **kwargs: Any) -> Any:
                if not kwargs["claim"] and not evicted:
                    for i in range(1, 200):
                        if not host.local.is_cached_item(old):
                            break
                        filler = (make_item(i, MiB), ["<image>", i])
                        host.local.get_and_update_item(filler, key(f"filler-{i}"))
                    evicted.append(not host.local.is_cached_item(old))
                    claimer.get_and_update([item(9)], [new])
                    assert claimer.flush()
                return remote.fetch_or_claim(keys, owner, **kwargs)

        host.remote = Waiting()  # type: ignore[assignment]
        try:
            looked_up = host.is_cached([old, new], claim=True, wait_s=HANG_S)
        finally:
            host.remote = remote
        assert evicted == [True], "old was evicted locally during the wait"
        assert looked_up == [False, True]
        # The engine processes what was reported missing; the rest is the claimer's item.
        outputs = host.get_and_update([item(0), None], [old, new])
        assert [updates for _, updates in outputs] == [["<image>", 0], ["<image>", 9]]
    finally:
        host.close()
        claimer.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_local_hit_evicted_while_the_lookup_waits_is_asked_of_the_remote_tier(
    server: LocalServer, namespace: str, mode: str
) -> None:
    """A local hit evicted while the lookup waited for another host is a local miss like
    the others: asked of the remote tier (the host published it: a remote hit, not
    processed again) and, where the tier lacks it, claimed, in the store and in a local
    cache that takes claims (else another host's lookup of it, or another writer's of the
    host's ring, would process it too instead of waiting)."""
    local = SenderCache(0.05) if mode == "lru" else ShmSenderCache(0.05)
    host = TieredSenderCache(local, open_store(server.url, namespace, timeout_s=10))
    claimer = open_p0(server.url, namespace)
    published, unpublished, new = key("published"), key("unpublished"), key("new")
    try:
        host.get_and_update([item(1)], [published])  # cached here and in the tier
        assert host.flush()
        host.local.get_and_update_item(item(2), unpublished)  # cached here only
        assert claimer.is_cached([new], claim=True) == [False]
        remote = host.remote
        evicted: list[bool] = []

        class Waiting:
            """The host's store, whose first look again during the wait has the host's other
            requests evict both local hits and the claimer publish ``new`` first."""

            def __getattr__(self, name: str) -> Any:
                return getattr(remote, name)

            def fetch_or_claim(self, keys: list[str], owner: str, **kwargs: Any) -> Any:
                if not kwargs["claim"] and not evicted:
                    for i in range(1, 200):
                        if not (
                            host.local.is_cached_item(published)
                            or host.local.is_cached_item(unpublished)
                        ):
                            break
                        filler = (make_item(i, MiB), ["<image>", i])
                        host.local.get_and_update_item(filler, key(f"filler-{i}"))
                    evicted.append(
                        not host.local.is_cached_item(published)
                        and not host.local.is_cached_item(unpublished)
                    )
                    claimer.get_and_update([item(9)], [new])
                    assert claimer.flush()
                return remote.fetch_or_claim(keys, owner, **kwargs)

        host.remote = Waiting()  # type: ignore[assignment]
        try:
            looked_up = host.is_cached([published, unpublished, new], claim=True, wait_s=HANG_S)
        finally:
            host.remote = remote
        assert evicted == [True], "both were evicted locally during the wait"
        assert looked_up == [True, False, True], "the published one is a remote hit"
        [(_, holder)] = claimer.remote.fetch_or_claim(
            [unpublished], claimer.host_id, claim=False, claim_ttl_s=5.0
        )
        assert holder == host.host_id, "the host claimed the one it now processes"
        if mode == "shm":  # new (a local miss, claimed again after the wait) and unpublished
            assert host.local.stats()["store_claims"] == 2
        outputs = host.get_and_update([None, item(2), None], [published, unpublished, new])
        assert [updates for _, updates in outputs] == [["<image>", i] for i in (1, 2, 9)]
    finally:
        host.close()
        claimer.close()


def test_a_local_cache_that_takes_claims_gets_them() -> None:
    class LocalWithClaims(SenderCache):
        asked: ClassVar[list[tuple[bool, float]]] = []

        def is_cached(
            self, mm_hashes: Sequence[str], *, claim: bool = False, wait_s: float = 0.0
        ) -> list[bool]:
            self.asked.append((claim, wait_s))
            return super().is_cached(mm_hashes)

    local = LocalWithClaims(0.05)
    # An unreachable store: the local cache's answer is all there is.
    p0 = TieredSenderCache(local, open_store("redis://127.0.0.1:1", "test/local@1", timeout_s=0.2))
    try:
        assert p0.is_cached([key(1)], claim=True, wait_s=0.5) == [False]
        assert p0.is_cached([key(1)]) == [False]
        assert local.asked == [(True, 0.5), (False, 0.0)]
    finally:
        p0.close()


@pytest.mark.parametrize(
    "bound",
    [
        {"publish_queue_mb": float("inf")},
        {"prefetch_limit_mb": float("inf")},
        {"publish_queue_mb": float("nan")},
        {"prefetch_limit_mb": -1.0},
    ],
)
def test_a_byte_bound_that_is_no_finite_number_is_a_value_error(bound: dict[str, float]) -> None:
    """Both waiting rooms are bounded by bytes: an infinite bound is a ``ValueError`` naming
    it, not an ``OverflowError`` from turning it into a byte count."""
    store = open_store("redis://127.0.0.1:1", "test/bad@1", timeout_s=0.2)
    try:
        with pytest.raises(ValueError, match=next(iter(bound))):
            TieredSenderCache(SenderCache(0.05), store, **bound)
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_url_where_the_store_goes_is_a_type_error_naming_remote(mode: str) -> None:
    """``remote="redis://..."`` was accepted; the first lookup then raised ``AttributeError:
    'str' object has no attribute 'get_many'``, and so did ``close()``."""
    name = _core.generate_segment_name()
    with pytest.raises(
        TypeError, match=r"remote must be a RemoteStore\(url, namespace=.*\), not str"
    ):
        make_caches(
            mode,  # type: ignore[arg-type]
            capacity_gb=0.01,
            name=name if mode == "shm" else None,  # an lru pair has no ring to name
            remote="redis://127.0.0.1:1",  # type: ignore[arg-type]
        )
    assert not os.path.exists(f"/dev/shm/{name}")  # the ring made first is closed again
    local = SenderCache(0.01)
    with pytest.raises(TypeError, match="remote must be a RemoteStore"):
        TieredSenderCache(local, "redis://127.0.0.1:1")  # type: ignore[arg-type]
    local.close()


def test_a_local_cache_that_is_no_p0_cache_is_a_type_error_naming_local() -> None:
    """``make_caches``'s whole ``(p0_cache, downstream)`` pair, or a receiver, as ``local``
    was ``AttributeError: 'tuple' object has no attribute 'is_cached'``."""
    store = open_store("redis://127.0.0.1:1", "test/bad@1", timeout_s=0.2)
    pair = make_caches("lru", capacity_gb=0.01)
    try:
        for local in (pair, pair[1]):
            with pytest.raises(TypeError, match=r"local must be a P0 cache .*, not (tuple|Recei)"):
                TieredSenderCache(local, store)  # type: ignore[arg-type]
    finally:
        store.close()


@pytest.mark.parametrize("claim_ttl_s", [float("inf"), float("nan"), -1.0, 0, "5", True, None])
def test_a_claim_lifetime_out_of_range_is_a_value_error(claim_ttl_s: Any) -> None:
    """Not an ``OverflowError`` (infinity), nor a claim silently cut to 1 ms (0, negative)
    that lapses before anyone could wait on it, nor a bool taken for a second; the tier
    refuses alike what it would pass the store (not a ``TypeError`` from comparing a str)."""
    store = open_store("redis://127.0.0.1:1", "test/bad@1", timeout_s=0.2)
    try:
        with pytest.raises(ValueError, match="claim_ttl_s"):
            store.fetch_or_claim([key(1)], "me", claim_ttl_s=claim_ttl_s)
        with pytest.raises(ValueError, match="claim_ttl_s must be between"):
            TieredSenderCache(SenderCache(0.05), store, claim_ttl_s=claim_ttl_s)
        assert store.stats()["skipped"] + store.stats()["unreachable"] == 0  # refused first
    finally:
        store.close()


def test_hashes_given_as_an_iterator_are_looked_up(server: LocalServer, namespace: str) -> None:
    """As every cache's ``is_cached`` reads an iterator into a list: the local cache's lookup
    used it up, and the tier's zip of it with the local answers raised ``ValueError``."""
    host, other = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        other.get_and_update([item(1)], [key(1)])
        assert other.flush()
        hashes = [key(1), key(2)]
        assert host.is_cached(iter(hashes)) == [True, False]
        assert host.is_cached((h for h in hashes), claim=True, wait_s=0.1) == [True, False]
        assert host.stats()["remote_claims"] == 1
    finally:
        host.close()
        other.close()


@pytest.mark.parametrize("claim", ["no", 1, None])
def test_a_claim_that_is_no_bool_is_a_type_error_and_no_store_failure(
    server: LocalServer, raw: redis.Redis, namespace: str, claim: Any
) -> None:
    """A truthy string ("no") or number would turn claims on, and reached the claim script as
    its "take" argument: the lookup failed there, counted as the store failing, so that a few
    such calls opened the breaker and cut every request of the host off the remote tier."""
    p0 = open_p0(server.url, namespace)
    try:
        for _ in range(4):  # more than the breaker's failures in a row
            with pytest.raises(TypeError, match="claim must be True or False"):
                p0.remote.fetch_or_claim([key(1)], p0.host_id, claim=claim)
            with pytest.raises(TypeError, match="claim must be True or False"):
                p0.is_cached([key(1)], claim=claim)
        stats = p0.remote.stats()
        assert stats["errors"] == stats["breaker_opened"] == stats["skipped"] == 0, stats
        assert claim_of(raw, namespace, 1) is None and p0.stats()["remote_claims"] == 0
        assert p0.is_cached([key(1)], claim=True) == [False]
        assert claim_of(raw, namespace, 1) == p0.host_id
    finally:
        p0.close()


@pytest.mark.parametrize("wait_s", [-1.0, float("nan"), float("inf"), "1", True])
def test_a_bad_wait_is_a_value_error(wait_s: Any) -> None:
    p0 = TieredSenderCache(
        SenderCache(0.05), open_store("redis://127.0.0.1:1", "test/bad@1", timeout_s=0.2)
    )
    try:
        with pytest.raises(ValueError, match="wait_s"):
            p0.is_cached([key(1)], claim=True, wait_s=wait_s)
        with pytest.raises(ValueError, match="claim_ttl_s"):
            TieredSenderCache(SenderCache(0.05), p0.remote, claim_ttl_s=0)
    finally:
        p0.close()


def test_a_wait_too_long_for_a_float_waits_until_the_item_arrives(
    server: LocalServer, namespace: str
) -> None:
    """A finite ``wait_s`` past the largest float (an int) is a wait with no practical end,
    not an ``OverflowError``."""
    host, claimer = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        assert claimer.is_cached([key(1)], claim=True) == [False]
        waiter = ThreadPoolExecutor(1)
        try:
            looked_up = waiter.submit(host.is_cached, [key(1)], claim=True, wait_s=10**400)
            claimer.get_and_update([item(1)], [key(1)])
            assert looked_up.result(HANG_S) == [True]
        finally:
            waiter.shutdown(wait=False)
    finally:
        host.close()
        claimer.close()


def test_a_host_drops_its_lapsed_claims_and_looks_at_them_only_once_one_may_have_lapsed(
    server: LocalServer, namespace: str
) -> None:
    """The claims a host's requests hold are looked over for lapsed ones at a claiming
    lookup, but only once one may have lapsed: a pass over all of them at every lookup cost
    each one time that grew with the claims held (1.5 ms with 10,000)."""
    p0 = open_p0(server.url, namespace, claim_ttl_s=1.0)
    try:
        held: dict[str, Any] = {}

        def hold() -> None:  # a request that claims and never updates (another thread's)
            p0.is_cached([key(1), key(2)], claim=True)
            held.update(p0._claims)

        thread = threading.Thread(target=hold)
        thread.start()
        thread.join(HANG_S)
        assert set(held) == {key(1), key(2)}
        lapse = min(claim.lapses for claim in held.values())
        claims = p0._claims
        for i in range(3, 6):  # none lapsed yet: not looked over
            assert p0.is_cached([key(i)], claim=True) == [False]
            p0.give_up_claims()
            # (No duration asserted: a machine that stalled past the lapse skips the check.)
            assert p0._claims is claims or time.monotonic() >= lapse
        time.sleep(max(0.0, lapse - time.monotonic()) + 0.05)
        assert p0.is_cached([key(6)], claim=True) == [False]
        assert set(p0._claims) == {key(6)}, "the lapsed claims are dropped"
    finally:
        p0.close()


def test_a_claim_key_of_another_type_is_no_claim_and_fails_nothing(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """Garbage at an item's claim key (a list, say) is one key's garbage: the batch that asks
    for that item still answers its other keys, the store is not counted as failing (its
    breaker stays closed), and the item is claimed and released as usual."""
    writer, p0 = open_p0(server.url, namespace), open_p0(server.url, namespace)
    try:
        writer.get_and_update([item(1)], [key(1)])
        assert writer.flush()
        raw.rpush(f"mmc/{namespace}/{key(2)}/claim", b"not a claim")

        def ask_then_give_up() -> list[bool]:
            cached = p0.is_cached([key(1), key(2)], claim=True)
            p0.release_sender_touches()  # the claims are this thread's request's
            return cached

        for _ in range(p0.remote._breaker.failures_to_open + 1):
            assert in_time(ask_then_give_up) == [True, False]
        assert claim_of(raw, namespace, 2) is None  # taken, then released by its holder
        s = p0.stats()
        assert s["remote_server_errors"] == 0 and s["remote_breaker_opened"] == 0
        assert s["remote_claims"] >= 1 and s["remote_claims_released"] >= 1
    finally:
        writer.close()
        p0.close()


def test_a_claim_that_never_lapses_is_no_claim_and_stops_no_wait(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """Every claim a host takes lapses by itself (``claim_ttl_s``), so that one whose host
    died frees its item.  A string at a claim key without an expiry (garbage, a key a tool
    persisted) is no host's claim: honoured, it would hold every host's every lookup of the
    item to the end of its wait, for as long as the key stays."""
    name = f"mmc/{namespace}/{key(2)}/claim"
    raw.set(name, b"a host long gone")
    p0 = open_p0(server.url, namespace)
    try:
        assert in_time(lambda: p0.is_cached([key(2)], claim=True, wait_s=2.0)) == [False]
        s = p0.stats()
        assert s["remote_claim_waits"] == 0 and s["remote_claims"] == 1, s
        assert claim_of(raw, namespace, 2) == p0.host_id
        assert 0 < raw.pttl(name) <= 5000  # now a claim that lapses
    finally:
        p0.close()


def test_an_enormous_claim_is_never_read_whole(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """A claim holds a host's short id: a claim key holding megabytes (garbage) is not sent
    whole to every lookup of its item (a value is bounded by ``max_value_mb``; a claim by
    what a host id can be)."""
    import tracemalloc

    raw.set(f"mmc/{namespace}/{key(2)}/claim", b"x" * (16 << 20), px=60_000)
    store = open_store(server.url, namespace, timeout_s=10, max_value_mb=1)
    try:
        assert store.get(key(1)) is None  # connected, so the next lookup is the claim alone
        tracemalloc.start()
        try:
            ((record, holder),) = store.fetch_or_claim([key(2)], "me")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert record is None and holder is not None and holder != "me"
        assert peak < 4 << 20, f"the lookup allocated {peak / (1 << 20):.1f} MiB for a claim"
        for owner in ("", "x" * 257):  # a claim is read no further than an owner's id can be
            with pytest.raises(ValueError, match="owner"):
                store.fetch_or_claim([key(3)], owner)
    finally:
        store.close()
