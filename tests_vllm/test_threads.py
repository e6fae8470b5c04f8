"""mmcache's vLLM caches called from several threads at once (SPEC §3.9 "Threads").

vLLM 0.33 renders raw prompts (their multimodal processing included) on a pool of
``--renderer-num-workers`` threads, each running P0's protocol on the one processor cache:
touch every hash, update each item, release. Each thread's request must stay its own. On
the worker side mmcache's reader resolves without a lock, so the Python state vLLM's reader
adds (the leases that keep replayed objects readable) must hold under threads too.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.actors import Actor
from vllm_helpers import MiB, feature, kwargs_item, outstanding, same_item, shm_caches


@pytest.fixture
def two_threads() -> Iterator[tuple[Actor, Actor]]:
    a, b = Actor(), Actor()
    yield a, b
    a.close()
    b.close()


def test_a_threads_release_judges_its_own_request_not_anothers(
    shm_pair: tuple[Any, Any], two_threads: tuple[Actor, Actor]
) -> None:
    """b's request (one item, updated) ends while a's (two items touched, none updated yet)
    is open: b's handle stays issued for its worker, and a's complete request keeps its two."""
    p0, _worker = shm_pair
    a, b = two_threads
    b(p0.is_cached, ["b1"])
    b(p0.touch_sender_cache_item, "b1")
    a(p0.is_cached, ["a1", "a2"])
    a(p0.touch_sender_cache_item, "a1")
    a(p0.touch_sender_cache_item, "a2")
    b(p0.get_and_update_item, (kwargs_item(1), []), "b1")
    b(p0.release_sender_touches)
    assert outstanding(p0) == 1, "b's complete request had its handle given back"
    a(p0.get_and_update_item, (kwargs_item(2), []), "a1")
    a(p0.get_and_update_item, (kwargs_item(3), []), "a2")
    a(p0.release_sender_touches)
    assert outstanding(p0) == 3


def test_another_threads_update_does_not_end_a_request_between_its_touches(
    shm_pair: tuple[Any, Any], two_threads: tuple[Actor, Actor]
) -> None:
    """An update made by b between a's two touches is not "a touch after a's updates": a's
    request goes on, and the item its first touch protected stays pinned."""
    p0, _worker = shm_pair
    a, b = two_threads
    p0.get_and_update_item((kwargs_item(1), []), "a1")  # cached before a's request
    a(p0.is_cached, ["a1", "a2"])
    a(p0.touch_sender_cache_item, "a1")
    assert p0.ring.stats()["store_pinned"] == 1
    b(p0.is_cached, ["b1"])
    b(p0.touch_sender_cache_item, "b1")
    b(p0.get_and_update_item, (kwargs_item(2), []), "b1")
    a(p0.touch_sender_cache_item, "a2")
    assert p0.ring.stats()["store_pinned"] == 1, "a1 lost the pin of a's open request"
    b(p0.release_sender_touches)
    hit, _ = a(p0.get_and_update_item, None, "a1")
    a(p0.get_and_update_item, (kwargs_item(3), []), "a2")
    a(p0.release_sender_touches)
    assert hit is not None
    assert p0.ring.stats()["store_pinned"] == 0
    assert outstanding(p0) == 4  # a1's put and hit, b1, a2: every handle still issued


@pytest.fixture
def small_leases() -> Iterator[tuple[Any, Any]]:
    """P0 and a worker whose reader keeps 2 MiB of leases (a quarter of the ring): a few
    100 KB items each, so the threads' inserts evict one another's."""
    with shm_caches(8 * MiB) as pair:
        yield pair


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """The interpreter switches threads every microsecond, not every 5 ms, so that threads
    interleave inside the few bytecodes of a Python-side update."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def test_worker_threads_resolving_at_once_get_their_items_and_keep_the_leases_whole(
    small_leases: tuple[Any, Any], frequent_switches: None
) -> None:
    """Eight threads each resolve a new 100 KB item at the same moment, 150 times: every
    resolve returns its item, and the leases' size accounting matches what they hold."""
    p0, worker = small_leases
    n_threads, rounds = 8, 150
    errors: list[BaseException] = []
    wrong: list[str] = []
    start = threading.Barrier(n_threads + 1)
    work: list[tuple[Any, Any]] = [(None, None)] * n_threads

    def resolver(i: int) -> None:
        for _ in range(rounds):
            start.wait()
            features, expected = work[i]
            try:
                worker.get_and_update_features(features)
            except BaseException as exc:  # reported below, with its type
                errors.append(exc)
            else:
                if not same_item(features[0].data, expected):
                    wrong.append(features[0].mm_hash)
            start.wait()

    threads = [threading.Thread(target=resolver, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    for r in range(rounds):
        for i in range(n_threads):
            mm_hash = f"img-{r}-{i}"
            item = kwargs_item(rng.randrange(1000), n_bytes=100_000)
            data, _ = p0.get_and_update_item((item, []), mm_hash)
            work[i] = ([feature(data, mm_hash)], item)
        start.wait()  # every thread resolves its feature now
        start.wait()
    for t in threads:
        t.join(60)
    assert not errors, f"{len(errors)} resolves raised, the first: {errors[0]!r}"
    assert not wrong, f"wrong items for {wrong[:5]}"
    leases = worker._reader._leases
    assert leases.currsize <= leases.maxsize
    assert leases.currsize == sum(leases.getsizeof(v) for v in leases.values())
