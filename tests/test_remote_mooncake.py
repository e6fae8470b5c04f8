"""The remote tier on a real Mooncake Store: a ``mooncake_master`` from the
``mooncake-transfer-engine-non-cuda`` wheel on loopback, clients over TCP.

Mooncake's wheel needs libibverbs, libnuma and libcurl from the OS; where one is missing these
tests skip, saying which (README: what to install) - unless ``MMCACHE_REQUIRE_MOONCAKE=1``
(set by ``make test`` wherever it can fetch the libraries itself: CI), where they fail.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from mmcache import SenderCache
from mmcache.remote import RemoteStore, TieredSenderCache
from mmcache.remote.envelope import HEADER_SIZE
from mmcache.remote.local_server import LocalServer, start_mooncake_master
from mmcache.remote.mooncake_backend import import_mooncake
from test_remote import HANG_S, in_time, key, make_item, same
from tests.servers import kill

MiB = 1 << 20

try:
    mooncake_store = import_mooncake()
except ImportError as exc:
    if os.environ.get("MMCACHE_REQUIRE_MOONCAKE") == "1":
        raise  # the libraries were to be there (see the Makefile's mooncake-libs)
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def master() -> Iterator[LocalServer]:
    with start_mooncake_master() as srv:
        yield srv


def open_store(url: str, namespace: str, **kwargs: Any) -> RemoteStore:
    """A store on the test's master; unless the test says otherwise, with a deadline only a
    hang reaches (a client's first call sets it up, which on a loaded machine can take
    longer than the default 0.5 s)."""
    options = {"timeout_s": 10.0, **kwargs}
    return RemoteStore(f"{url}&segment_mb=64", namespace=namespace, secret="shared", **options)


@pytest.fixture
def raw(master: LocalServer) -> Iterator[Any]:
    """A plain Mooncake client, to damage values behind the store's back."""
    store = mooncake_store.MooncakeDistributedStore()
    host_port, metadata = master.url.removeprefix("mooncake://").split("?metadata=")
    assert store.setup("127.0.0.1", metadata, 16 * MiB, 16 * MiB, "tcp", "", host_port) == 0
    yield store
    store.close()


@pytest.mark.parametrize("n_bytes", [1000, 3 * MiB + 124], ids=["small", "large"])
def test_get_returns_what_was_put_bit_for_bit(master: LocalServer, n_bytes: int) -> None:
    with open_store(master.url, f"mc/roundtrip{n_bytes}@1") as store:
        item = make_item(1, n_bytes)
        assert store.get(key(1)) is None
        store.put(key(1), item)
        assert store.contains([key(1), key(2), key(1)]) == [True, False, True]
        got = store.get_many([key(1), key(2)])
        assert same(got[0], item) and got[1] is None
        store.put(key(1), make_item(2, n_bytes))  # put-if-absent: the first item stays
        assert same(store.get(key(1)), item)
        stats = store.stats()
        assert stats["puts"] == 1 and stats["put_present"] == 1 and stats["errors"] == 0


def test_another_host_reads_it_and_a_wrong_secret_does_not(master: LocalServer) -> None:
    namespace = "mc/hosts@1"
    item = make_item(3, 2 * MiB)
    # Mooncake keeps a value in the memory the writing client contributes: the writer stays.
    with open_store(master.url, namespace) as writer:
        writer.put(key(3), item)
        with open_store(master.url, namespace) as reader:
            assert same(reader.get(key(3)), item)
        wrong = RemoteStore(
            master.url + "&segment_mb=16", namespace=namespace, secret="wrong", timeout_s=10.0
        )
        with wrong:
            assert wrong.get(key(3)) is None and wrong.stats()["digest_mismatch"] == 1


def test_a_damaged_value_is_a_miss(master: LocalServer, raw: Any) -> None:
    namespace = "mc/damage@1"
    with open_store(master.url, namespace) as store:
        store.put(key(1), make_item(1, 10_000))
        name = f"mmc/{namespace}/{key(1)}"
        value = bytearray(raw.get(name))
        value[HEADER_SIZE + 4000] ^= 0x10
        assert raw.upsert(name, bytes(value)) == 0
        assert store.get(key(1)) is None and store.stats()["digest_mismatch"] == 1


def test_a_dead_master_costs_misses_not_hangs() -> None:
    with start_mooncake_master() as master:
        store = open_store(master.url, "mc/dead@1", timeout_s=1.0, breaker_cooldown_s=0.2)
        store.put(key(1), make_item(1, 1000))
        kill(master)
        for _ in range(6):
            assert in_time(lambda: store.get(key(2))) is None
            assert in_time(lambda: store.contains([key(2)])) == [False]
        stats = store.stats()
        assert stats["errors"] > 0 and stats["hits"] == 0
        in_time(store.close)


def test_a_value_past_the_readers_max_value_mb_is_refused_before_it_is_read(
    master: LocalServer,
) -> None:
    namespace = "mc/too-large@1"
    item = make_item(4, 3 * MiB)
    with open_store(master.url, namespace) as writer:
        writer.put(key(4), item)
        with open_store(master.url, namespace, max_value_mb=1) as reader:
            assert reader.get(key(5)) is None  # set up, so the next get is the value alone
            tracemalloc.start()
            try:
                got = reader.get_many([key(4), key(5)])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert got == [None, None] and reader.stats()["too_large"] == 1
            assert peak < 2 * MiB, f"the reader allocated {peak / MiB:.1f} MiB for it"
        with open_store(master.url, namespace) as default:  # 256 MiB: it reads
            assert same(default.get(key(4)), item)


def test_a_put_larger_than_the_client_buffer_as_the_probe_settles_the_breaker() -> None:
    with start_mooncake_master() as master:
        store = RemoteStore(
            f"{master.url}&segment_mb=16&buffer_mb=1",
            namespace="mc/probe@1",
            secret="s",
            timeout_s=1.0,
            breaker_failures=1,
            breaker_cooldown_s=0.2,
        )
        store.put(key(1), make_item(1, 1000))  # the writer client is set up
        kill(master)
        assert in_time(lambda: store.get(key(1))) is None
        assert store.stats()["breaker_opened"] == 1
        threading.Event().wait(0.3)  # the cooldown: the next call probes
        in_time(lambda: store.put(key(2), make_item(2, 2 * MiB)))  # refused: over buffer_mb
        assert store.stats()["oversize"] == 1
        skipped = store.stats()["skipped"]
        assert in_time(lambda: store.get(key(1))) is None
        assert store.stats()["skipped"] == skipped, "the refused probe left the breaker shut"
        in_time(store.close)


def test_a_put_the_full_store_refuses_is_counted_refused_and_reads_go_on() -> None:
    """A store with no room left (one 16 MiB segment, 20 MiB items): Mooncake refuses each
    put (``NO_AVAILABLE_HANDLE``) - counted as ``refused``, not as the master unreachable,
    whose breaker would turn reads off too."""
    with start_mooncake_master() as master:
        store = RemoteStore(
            f"{master.url}&segment_mb=16&buffer_mb=32",
            namespace="mc/full@1",
            secret="s",
            timeout_s=10.0,
        )
        item = make_item(1, 1000)
        store.put(key(1), item)  # the writer client is set up
        puts = 2 * store._breaker.failures_to_open
        for name in range(2, 2 + puts):
            in_time(lambda name=name: store.put(key(name), make_item(name, 20 * MiB)))
        stats = store.stats()
        assert stats["refused"] == puts and stats["unreachable"] == 0, stats
        assert stats["breaker_opened"] == 0, stats
        # Answered, not refused by an open breaker (Mooncake may have evicted it for room).
        got = in_time(lambda: store.get(key(1)))
        stats = store.stats()
        assert got is None or same(got, item)
        assert stats["skipped"] == 0 and stats["hits"] + stats["misses"] == 1, stats
        in_time(store.close)


def test_mooncake_holds_no_claims_so_its_hosts_do_not_single_flight(master: LocalServer) -> None:
    # Its put of an existing key answers success to every writer and nothing in it expires:
    # nothing to build a claim on (see RemoteStore.supports_claims).
    a = TieredSenderCache(SenderCache(0.05), open_store(master.url, "mc/claims@1"))
    b = TieredSenderCache(SenderCache(0.05), open_store(master.url, "mc/claims@1"))
    try:
        assert not a.remote.supports_claims
        assert a.is_cached([key(1)], claim=True, wait_s=HANG_S) == [False]
        # No claim to wait for: the second host processes the item too.
        assert in_time(lambda: b.is_cached([key(1)], claim=True, wait_s=HANG_S)) == [False]
        for p0 in (a, b):
            s = p0.stats()
            assert s["remote_claims"] == s["remote_claim_waits"] == 0 and s["remote_errors"] == 0
        a.get_and_update([(make_item(1, 1000), ["<image>", 1])], [key(1)])
        assert a.flush() and b.is_cached([key(1)], claim=True) == [True]
    finally:
        a.close()
        b.close()
