"""A real Valkey server that answers, but refuses something: a write past ``maxmemory``, the
scripting claims need, a key of another type, more connections than the URL allows.  The
server is up all along, so none of it may count as the store failing (whose breaker would
turn the whole tier off, reads too): each refusal is counted for what it is."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
import redis

from mmcache.remote.local_server import LocalServer, start_valkey
from tests.test_remote import HANG_S, in_time, key, make_item, open_store, same

MiB = 1 << 20


@pytest.fixture
def full_server() -> Iterator[LocalServer]:
    """A server of its own whose memory this test may fill (``noeviction``)."""
    with start_valkey(extra=["--maxmemory-policy", "noeviction"]) as srv:
        yield srv


def _fill(server: LocalServer) -> None:
    """From now on the server refuses every write that may add memory (``-OOM``)."""
    client = redis.Redis.from_url(server.url)
    client.config_set("maxmemory", "1")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", b"x")
    client.close()


@pytest.mark.parametrize("n_bytes", [100, 3 * MiB], ids=["plain", "chunked"])
def test_writes_the_server_refuses_are_counted_refusals_not_the_store_down(
    full_server: LocalServer, namespace: str, n_bytes: int
) -> None:
    """``-OOM`` on every put: counted as ``refused``; the breaker stays closed, so the items
    already there are still read - and claimed lookups, whose script's ``SET`` the full
    server refuses too, still answer them."""
    item = make_item(1, n_bytes)
    with open_store(full_server.url, namespace, breaker_failures=2) as store:
        store.put(key(1), item)
        _fill(full_server)
        for name in range(2, 2 + 3 * store._breaker.failures_to_open):
            in_time(lambda name=name: store.put(key(name), make_item(name, n_bytes)))
        stats = store.stats()
        assert stats["refused"] == 3 * store._breaker.failures_to_open, stats
        assert stats["breaker_opened"] == 0 and stats["server_errors"] == 0, stats
        assert same(store.get(key(1)), item), store.stats()
        found = in_time(lambda: store.fetch_or_claim([key(1), key(2)], "host-a"))
        assert same(found[0][0], item) and found[1] == (None, None), store.stats()
        stats = store.stats()
        assert stats["breaker_opened"] == 0 and stats["claims_refused"] == 1, stats


def test_claims_come_back_at_the_first_lookup_after_the_server_stops_refusing_them(
    full_server: LocalServer, namespace: str
) -> None:
    """A full server refuses the claim script; once it has room again the very next claiming
    lookup claims.  The refused script is sent with every claiming lookup (in the lookup's
    own round trip, the bytes every accepted one sends too), so no back-off stands between
    a recovered server and single flight."""
    raw = redis.Redis.from_url(full_server.url)
    try:
        with open_store(full_server.url, namespace) as store:
            _fill(full_server)
            for _ in range(3):
                assert in_time(lambda: store.fetch_or_claim([key(1)], "host-a")) == [(None, None)]
            raw.config_set("maxmemory", "0")  # room again
            assert in_time(lambda: store.fetch_or_claim([key(1)], "host-a")) == [(None, "host-a")]
            assert raw.get(f"mmc/{namespace}/{key(1)}/claim") == b"host-a"
            stats = store.stats()
            assert stats["claims_refused"] == 3 and stats["errors"] == 0, stats
    finally:
        raw.close()


@pytest.mark.parametrize(
    ("server_args", "reply"),
    [
        (["--user", "default", "on", "nopass", "~*", "&*", "+@all", "-@scripting"], "permissions"),
        (["--rename-command", "EVAL", ""], "unknown command"),
    ],
    ids=["acl", "renamed"],
)
def test_a_server_refusing_scripting_serves_gets_and_puts_with_claims_off(
    namespace: str, caplog: pytest.LogCaptureFixture, server_args: list[str], reply: str
) -> None:
    """An ACL user without ``@scripting``, or ``EVAL`` renamed away: every claim script is
    refused.  Gets, puts and claiming lookups still work (without claims); that is counted,
    and logged once; a release of claims (a script too) is counted refused; the breaker
    never opens."""
    with start_valkey(extra=server_args) as srv, open_store(srv.url, namespace) as store:
        item = make_item(1, 100)
        store.put(key(1), item)
        rounds = 2 * store._breaker.failures_to_open
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            for _ in range(rounds):
                found = in_time(lambda: store.fetch_or_claim([key(1), key(2)], "host-a"))
                assert same(found[0][0], item) and found[1] == (None, None), store.stats()
                in_time(lambda: store.release_claims([key(2)], "host-a"))
        assert same(store.get(key(1)), item)
        stats = store.stats()
        assert stats["breaker_opened"] == 0 and stats["server_errors"] == 0, stats
        assert stats["claims_refused"] == rounds and stats["refused"] == rounds, stats
        logged = [r for r in caplog.records if "claim" in r.getMessage()]
        assert len(logged) == 1 and reply in logged[0].getMessage(), caplog.text


@pytest.mark.parametrize("n_bytes", [100, 3 * MiB], ids=["plain", "chunked"])
def test_more_threads_than_max_connections_wait_for_one_instead_of_failing(
    server: LocalServer, namespace: str, n_bytes: int
) -> None:
    """``max_connections=2`` and 8 threads getting and putting at once: each call waits for
    a connection (within its deadline, generous here) rather than being refused "Too many
    connections", counted as the store unreachable and opening the breaker."""
    items = {name: make_item(name, n_bytes) for name in range(4)}
    url = f"{server.url}?max_connections=2"
    with open_store(url, namespace, timeout_s=20, breaker_failures=1) as store:
        for name, item in items.items():
            store.put(key(name), item)
        wrong: list[object] = []
        start = threading.Barrier(8)

        def work(thread: int) -> None:
            start.wait()
            for round_ in range(5):
                name = (thread + round_) % len(items)
                if not same(store.get(key(name)), items[name]):
                    wrong.append(name)
                store.put(key(100 + thread), make_item(thread, 100))

        threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_S * 4)
            assert not thread.is_alive(), "a call hung waiting for a connection"
        stats = store.stats()
        assert not wrong and stats["errors"] == 0 and stats["breaker_opened"] == 0, stats


@pytest.mark.parametrize("options", ["?max_connections=1", ""], ids=["capped", "default"])
def test_a_call_that_gets_no_connection_by_its_deadline_is_a_timeout(
    server: LocalServer, namespace: str, options: str
) -> None:
    """Every connection of the pool held elsewhere (the URL's cap, or redis-py's default
    of 100): a call waits for one to its deadline, then is a counted timeout, never
    "unreachable" (redis-py refuses it at once: "Too many connections")."""
    with open_store(f"{server.url}{options}", namespace, timeout_s=0.2) as store:
        pool = store._backend._client.connection_pool  # type: ignore[attr-defined]
        held = [pool.get_connection() for _ in range(pool.max_connections)]
        try:
            assert in_time(lambda: store.get(key(1))) is None
        finally:
            for connection in held:
                pool.release(connection)
        stats = store.stats()
        assert stats["timeouts"] == 1 and stats["unreachable"] == 0, stats
        assert store.get(key(1)) is None and store.stats()["misses"] == 1, store.stats()


def test_an_item_key_holding_another_type_is_absent_and_a_counted_miss(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """A list and a hash under two items' keys (another program's, or garbage): neither is
    "present" to a lookup, and a get of either is a miss counted as such, not an error."""
    with open_store(server.url, namespace) as store:
        raw.rpush(f"mmc/{namespace}/{key(1)}", b"not ours")
        raw.hset(f"mmc/{namespace}/{key(2)}", "field", b"not ours")
        store.put(key(3), make_item(3, 100))
        assert store.contains([key(1), key(2), key(3)]) == [False, False, True]
        assert store.get_many([key(1), key(2)]) == [None, None]
        found = store.fetch_or_claim([key(1), key(2)], "host-a", claim=False)
        assert found == [(None, None), (None, None)]
        stats = store.stats()
        assert stats["contains_found"] == 1 and stats["misses"] == 4, stats
        assert stats["errors"] == 0 and stats["breaker_opened"] == 0, stats


def test_a_read_only_replica_serves_reads_and_refuses_puts_without_the_breaker(
    own_server: LocalServer, namespace: str
) -> None:
    """A store opened on a replica: its puts are refused ``-READONLY`` (counted), and what
    the primary holds is still read from it, claimed lookups included."""
    item = make_item(1, 100)
    port = own_server.url.rpartition(":")[2]
    with start_valkey(extra=["--replicaof", "127.0.0.1", port]) as replica:
        with open_store(own_server.url, namespace) as primary:
            primary.put(key(1), item)
        raw = redis.Redis.from_url(own_server.url, socket_timeout=2 * HANG_S)
        try:  # until the replica acknowledged the primary's writes (or HANG_S ran out)
            assert raw.execute_command("WAIT", 1, HANG_S * 1000) >= 1, "the replica never synced"
        finally:
            raw.close()
        with open_store(replica.url, namespace, breaker_failures=2) as store:
            assert same(in_time(lambda: store.get(key(1))), item), store.stats()
            for name in range(2, 2 + 2 * store._breaker.failures_to_open):
                in_time(lambda name=name: store.put(key(name), make_item(name, 100)))
            found = in_time(lambda: store.fetch_or_claim([key(1), key(2)], "host-a"))
            assert same(found[0][0], item) and found[1] == (None, None), store.stats()
            stats = store.stats()
            assert stats["refused"] == 2 * store._breaker.failures_to_open, stats
            assert stats["breaker_opened"] == 0 and stats["server_errors"] == 0, stats
