"""A real Valkey server that answers, but refuses something: a write past ``maxmemory``, the
scripting claims need, a key of another type, more connections than the URL allows.  The
server is up all along, so none of it may count as the store failing (whose breaker would
turn the whole tier off, reads too): each refusal is counted for what it is."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from mmcache.remote.local_server import LocalServer, start_valkey
from tests.test_remote import in_time, key, make_item, open_store, same

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


def test_a_server_refusing_scripting_serves_gets_and_puts_with_claims_off(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL user without ``@scripting``: every claim script is refused ``-NOPERM``.  Gets,
    puts and claiming lookups still work (without claims); that is counted, and logged once;
    a release of claims (a script too) is counted refused; the breaker never opens."""
    acl = ["--user", "default", "on", "nopass", "~*", "&*", "+@all", "-@scripting"]
    with start_valkey(extra=acl) as srv, open_store(srv.url, namespace) as store:
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
        assert len(logged) == 1 and "no permissions" in logged[0].getMessage(), caplog.text
