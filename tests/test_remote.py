"""The remote tier against a real Valkey server (started on a free loopback port).

Every fault is injected for real: values rewritten or deleted in the server with a raw
client, the server killed and restarted, stopped with SIGSTOP, two stores racing on one key.
The oracle is always the same: a get returns the very item that was put, bit for bit, or
``None`` - never other tensors, never an exception, never a hang (each call runs with a
generous join timeout; no duration is asserted).
"""

from __future__ import annotations

import collections
import enum
import logging
import socket
import struct
import subprocess
import threading
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
import torch

from mmcache import (
    Feature,
    ReceiverCache,
    SenderCache,
    ShmReceiverCache,
    ShmSenderCache,
    content_hash,
    serde,
)
from mmcache._core import ShmObjectStore
from mmcache.remote import (
    CircuitBreaker,
    RemoteStore,
    TieredSenderCache,
    is_shareable_key,
    redis_backend,
)
from mmcache.remote.backend import RemoteUnreachable, ValueTooLarge, redact_url
from mmcache.remote.envelope import (
    HEADER_SIZE,
    MIN_PART_BYTES,
    SCHEMA_VERSION,
    CorruptValue,
    DigestMismatch,
    PartDigests,
    derive_digest_key,
    open_envelope,
    part_hasher,
    seal,
)
from mmcache.remote.local_server import (
    LocalServer,
    ServerUnavailable,
    find_mooncake_master,
    start_mooncake_master,
    start_valkey,
)
from mmcache.remote.redis_backend import CHUNK_BYTES, UPLOAD_LEASE_MS
from tests.servers import kill, resume, stall

MiB = 1 << 20
HANG_S = 30  # a call that has not returned by then is a hang (the test fails, CI goes on)


def same(a: Any, b: Any) -> bool:
    """Bit-identical items: same structure, same types, tensors and arrays by dtype, shape
    and bytes."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def make_item(seed: int, n_bytes: int) -> dict[str, Any]:
    """Random bits (any foreign byte shows) in tensors of several dtypes, an array, bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)
    return {
        "pixel_values": raw.view(torch.float32),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * seed,
        "grid": np.array([seed, 2, 3], dtype=np.int64),
        "blob": bytes(range(256)) * 2,
        "meta": {"id": seed, "tags": ("a", "b"), "ok": True},
    }


def key(name: object) -> str:
    return content_hash(str(name))


def in_time(call: Callable[[], Any], limit_s: float = HANG_S) -> Any:
    """``call()`` on a thread (what it returns, or the exception it raised, raised here);
    fails the test if it has not returned after ``limit_s``."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), "the call hung instead of returning a miss"
    if errors:
        raise errors[0]
    return result[0]


def open_store(url: str, namespace: str, **kwargs: Any) -> RemoteStore:
    return RemoteStore(url, namespace=namespace, secret="shared secret", **kwargs)


# --------------------------------------------------------------------------------------------
# The codec's whole payload


def test_pack_is_exactly_what_the_ring_stores() -> None:
    item = make_item(3, 5000)
    header, buffers = serde.encode(item)
    with ShmObjectStore.create(1 * MiB) as ring:
        handle = ring.put("k", [header, *buffers])
        stored = ring.get(handle, "k")
    assert serde.pack(item) == bytes(stored)
    assert same(serde.decode(serde.pack(item)), item)


# --------------------------------------------------------------------------------------------
# The envelope's digest: a keyed hash over the hash list of the payload's parts


def _hash_list(payload: bytes, part_bytes: int) -> list[bytes]:
    digests = []
    for start in range(0, len(payload), part_bytes):
        hasher = part_hasher()
        hasher.update(payload[start : start + part_bytes])
        digests.append(hasher.digest())
    return digests


def test_a_value_verifies_from_part_digests_hashed_on_arrival() -> None:
    payload = serde.pack(make_item(1, 10_000))
    secret = derive_digest_key("s")
    value = seal("k", payload, secret, 4096) + payload
    parts = _hash_list(payload, 4096)
    assert len(parts) == 3
    assert bytes(open_envelope("k", value, secret)) == payload
    assert bytes(open_envelope("k", value, secret, PartDigests(4096, parts))) == payload
    # Digests for another part size than the header's, or too few, are not used: the
    # payload is hashed again.
    assert bytes(open_envelope("k", value, secret, PartDigests(8192, [bytes(32)] * 2))) == payload
    assert bytes(open_envelope("k", value, secret, PartDigests(4096, parts[:2]))) == payload


@pytest.mark.parametrize(
    "tamper",
    ["a part digest", "the parts' order", "the key", "the secret", "the part size"],
)
def test_the_hash_list_is_bound_to_every_part_its_order_the_key_and_the_header(
    tamper: str,
) -> None:
    payload = serde.pack(make_item(2, 12_000))
    secret = derive_digest_key("s")
    value = bytearray(seal("k", payload, secret, 4096) + payload)
    parts = _hash_list(payload, 4096)
    store_key, digest_key = "k", secret
    if tamper == "a part digest":
        parts[1] = bytes(32)
    elif tamper == "the parts' order":
        parts[0], parts[1] = parts[1], parts[0]
    elif tamper == "the key":
        store_key = "k2"
    elif tamper == "the secret":
        digest_key = derive_digest_key("another")
    else:
        struct.pack_into("<I", value, 16, 8192)
        parts = _hash_list(payload, 8192)
    with pytest.raises(DigestMismatch):
        open_envelope(store_key, value, digest_key, PartDigests(4096, parts))
    if tamper in ("a part digest", "the parts' order"):  # the bytes themselves are intact
        assert bytes(open_envelope(store_key, value, digest_key)) == payload
    else:  # hashed from the bytes, the verdict is the same
        with pytest.raises(DigestMismatch):
            open_envelope(store_key, value, digest_key)


def test_a_header_with_a_tiny_part_size_or_reserved_bytes_set_is_corrupt() -> None:
    payload = serde.pack(make_item(3, 100))
    with pytest.raises(ValueError, match="part_bytes"):
        seal("k", payload, None, MIN_PART_BYTES - 1)
    good = seal("k", payload, None, MIN_PART_BYTES) + payload
    for offset, field in ((16, "<I"), (24, "<B")):
        value = bytearray(good)
        struct.pack_into(field, value, offset, 1)
        with pytest.raises(CorruptValue, match="part size"):
            open_envelope("k", value, None)


# --------------------------------------------------------------------------------------------
# Round trips and the interface


@pytest.mark.parametrize("n_bytes", [1000, 3 * MiB + 124], ids=["one-key", "chunked"])
def test_get_returns_what_was_put_bit_for_bit(
    server: LocalServer, namespace: str, n_bytes: int
) -> None:
    with open_store(server.url, namespace) as store:
        item = make_item(1, n_bytes)
        assert store.get(key(1)) is None
        store.put(key(1), item)
        got = store.get(key(1))
        assert same(got, item)
        assert got is not None and got["pixel_values"].numel() * 4 == n_bytes
        stats = store.stats()
        assert stats["puts"] == 1 and stats["hits"] == 1 and stats["misses"] == 1
        assert stats["errors"] == 0
        assert stats["get_p50_ms"] > 0 and stats["put_p99_ms"] > 0
        # Without latencies: the same counters, no percentiles (nothing sorted).
        counters = store.stats(latencies=False)
        assert counters == {k: v for k, v in stats.items() if not k.endswith("_ms")}


def test_valkey_urls_name_the_same_server(server: LocalServer, namespace: str) -> None:
    item = make_item(4, 100)
    with open_store(server.url, namespace) as redis_url:
        redis_url.put(key(4), item)
    with open_store(server.url.replace("redis://", "valkey://"), namespace) as valkey_url:
        assert same(valkey_url.get(key(4)), item)


def test_a_chunked_value_is_chunks_plus_a_manifest_written_last(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    item = make_item(2, 3 * MiB)
    with open_store(server.url, namespace) as store:
        store.put(key(2), item)
    names = sorted(n.decode() for n in raw.scan_iter(match=f"mmc/{namespace}/*"))
    manifest, chunks = names[0], names[1:]
    assert manifest == f"mmc/{namespace}/{key(2)}"
    assert len(chunks) == 4 and all(c.startswith(manifest + "/chunk/") for c in chunks)
    assert all(raw.strlen(c) <= CHUNK_BYTES for c in chunks)
    # The chunks hold the payload alone; the envelope header travels in the manifest.
    assert sum(raw.strlen(c) for c in chunks) == len(serde.pack(item))
    assert raw.strlen(manifest) < 128 and (raw.get(manifest) or b"").find(b"MMCR") > 0


def test_the_chunk_size_is_the_writers_choice_and_any_reader_follows_it(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    item = make_item(5, 50_000)
    with RemoteStore(server.url + "?chunk_kb=4", namespace=namespace, secret="s") as small:
        small.put(key(5), item)
    assert len(list(raw.scan_iter(match=f"mmc/{namespace}/*/chunk/*"))) == 13
    with RemoteStore(server.url, namespace=namespace, secret="s") as default:
        assert same(default.get(key(5)), item)


def test_put_if_absent_keeps_the_first_item(server: LocalServer, namespace: str) -> None:
    with open_store(server.url, namespace) as store:
        first, second = make_item(1, 2 * MiB), make_item(2, 2 * MiB)
        store.put(key(1), first)
        store.put(key(1), second)
        assert same(store.get(key(1)), first)
        assert store.stats()["put_present"] == 1


def test_contains_answers_each_key_and_asks_a_repeated_key_once(
    server: LocalServer, namespace: str
) -> None:
    with open_store(server.url, namespace) as store:
        store.put(key("a"), make_item(1, 100))
        assert store.contains([key("a"), key("b"), key("a")]) == [True, False, True]
        assert store.stats()["contains_keys"] == 2


def test_contains_of_a_16_item_request_is_one_round_trip(
    server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sends = []
    real_send = redis.connection.AbstractConnection.send_packed_command

    def counting_send(self: Any, command: Any, check_health: bool = True) -> None:
        sends.append(command)
        real_send(self, command, check_health)

    with open_store(server.url, namespace) as store:
        keys = [key(i) for i in range(16)]
        store.put(keys[3], make_item(3, 100))
        store.contains(keys[:1])  # connect first: the handshake is not the request's
        monkeypatch.setattr(
            redis.connection.AbstractConnection, "send_packed_command", counting_send
        )
        found = store.contains(keys)
    assert found == [i == 3 for i in range(16)]
    assert len(sends) == 1


def test_namespaces_never_share_an_item(server: LocalServer, namespace: str) -> None:
    with open_store(server.url, namespace) as a, open_store(server.url, namespace + "x") as b:
        a.put(key(1), make_item(1, 100))
        assert b.get(key(1)) is None and b.contains([key(1)]) == [False]


def test_get_many_fetches_a_batch(server: LocalServer, namespace: str) -> None:
    with open_store(server.url, namespace) as store:
        items = {i: make_item(i, 2 * MiB if i % 2 else 500) for i in range(4)}
        for i, item in items.items():
            store.put(key(i), item)
        got = store.get_many([key(0), key(9), key(3), key(1), key(0)])
        assert got[1] is None
        assert all(same(g, items[i]) for g, i in zip(got, [0, 9, 3, 1, 0], strict=True) if i != 9)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.get("short"), "full-width content hash"),
        (lambda s: s.contains(["has space" * 8]), "full-width content hash"),
        (lambda s: s.contains(key(1)), "not one str"),
        (lambda s: s.put(key(1), [1, 2]), "mapping"),
    ],
)
def test_bad_keys_and_items_are_clear_errors(
    server: LocalServer, namespace: str, call: Callable[[RemoteStore], Any], message: str
) -> None:
    with open_store(server.url, namespace) as store, pytest.raises((ValueError, TypeError)) as e:
        call(store)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("url", "kwargs", "message"),
    [
        ("http://127.0.0.1:1", {}, "unsupported remote store URL"),
        ("redis://", {}, "not a Redis/Valkey URL"),
        ("redis://127.0.0.1:1", {"namespace": "has space"}, "namespace"),
        ("redis://127.0.0.1:1", {"namespace": ""}, "namespace"),
        ("redis://127.0.0.1:1", {"timeout_s": 0}, "timeout_s"),
        ("redis://127.0.0.1:1", {"secret": b""}, "must not be empty"),
        ("mooncake://127.0.0.1", {}, "not a Mooncake URL"),
        ("redis://127.0.0.1:1?chunk_kb=0", {}, "chunk_kb"),
        ("redis://127.0.0.1:1?chunk_kb=many", {}, "chunk_kb"),
        # Not a number: named, not "'<' not supported between instances of ...".
        ("redis://127.0.0.1:1", {"ttl_s": "60"}, "ttl_s"),
        ("redis://127.0.0.1:1", {"max_value_mb": "256"}, "max_value_mb"),
        ("redis://127.0.0.1:1", {"breaker_failures": "3"}, "breaker_failures"),
        ("redis://127.0.0.1:1", {"breaker_cooldown_s": None}, "breaker_cooldown_s"),
    ],
)
def test_bad_configuration_is_a_value_error(url: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RemoteStore(url, **{"namespace": "m@1", **kwargs})


@pytest.mark.parametrize(
    "option",
    [
        "sockettimeout=1",  # a typo: redis-py would pass it on to every connection it makes
        "decode_responses=True",  # values would come back as text: no value of ours is
        "decode_responses=false",  # a string, so as true as "True" to redis-py
        "single_connection_client=1",
    ],
)
def test_a_url_option_that_would_fail_every_call_is_a_value_error(
    server: LocalServer, namespace: str, option: str
) -> None:
    """Refused when the store is made, naming the option and not the password, rather than
    accepted and then every call counted as the store failing (until its breaker opens)."""
    url = server.url.replace("redis://", "redis://admin:hunter2@") + "?" + option
    with pytest.raises(ValueError, match=option.partition("=")[0]) as refused:
        RemoteStore(url, namespace=namespace)
    assert "hunter2" not in str(refused.value)


def test_the_url_options_redis_reads_still_work(server: LocalServer, namespace: str) -> None:
    options = "socket_keepalive=true&health_check_interval=30&client_name=p0&protocol=3"
    with open_store(f"{server.url}/0?{options}", namespace) as store:
        store.put(key(1), make_item(1, 3 * MiB))
        assert same(store.get(key(1)), make_item(1, 3 * MiB)), store.stats()
        assert store.stats()["errors"] == 0


@pytest.mark.parametrize("secret", [7, True, [1, 2, 3], 2.5])
def test_a_secret_that_is_not_text_or_bytes_is_a_type_error(secret: Any) -> None:
    """``bytes(7)`` is seven zero bytes: an int taken for a secret would key every value with
    a key that says nothing of its digits (``7`` and ``b"\\0" * 7`` the same), and a large
    one would be a huge allocation."""
    with pytest.raises(TypeError, match="secret"):
        RemoteStore("redis://127.0.0.1:1", namespace="m@1", secret=secret)
    with pytest.raises(TypeError, match="secret"):
        derive_digest_key(secret)


def test_a_pool_of_one_connection_still_reads_chunked_values(
    server: LocalServer, namespace: str
) -> None:
    """``max_connections=1`` (a connection per process): the chunks are fetched on that one
    connection, not refused as "Too many connections" - counted as the store unreachable,
    every time, until the breaker turned the tier off."""
    item = make_item(1, 3 * MiB)
    with open_store(f"{server.url}?max_connections=1", namespace) as store:
        store.put(key(1), item)
        for _ in range(store._breaker.failures_to_open + 1):
            assert same(store.get(key(1)), item), store.stats()
        assert store.stats()["errors"] == 0


def test_shareable_keys_are_full_width_hashes() -> None:
    assert is_shareable_key(content_hash(b"x"))
    assert not is_shareable_key("image-0")
    assert not is_shareable_key(None)


def test_an_unencodable_item_is_counted_not_raised(
    server: LocalServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    with open_store(server.url, namespace) as store, caplog.at_level(logging.WARNING):
        store.put(key(1), {"fn": print})
        store.put(key(2), {"fn": print})
        assert store.stats()["unencodable"] == 2 and store.contains([key(1)]) == [False]
    assert len([r for r in caplog.records if "cannot be encoded" in r.message]) == 1


# --------------------------------------------------------------------------------------------
# Values damaged in the store: always a miss, never other tensors


def _value_key(namespace: str, name: object) -> str:
    return f"mmc/{namespace}/{key(name)}"


def _chunks_of(raw: redis.Redis, namespace: str, name: object) -> list[str]:
    return sorted(
        (n.decode() for n in raw.scan_iter(match=_value_key(namespace, name) + "/chunk/*")),
        key=lambda n: int(n.rsplit("/", 1)[1]),
    )


def _flip(raw: redis.Redis, name: str, offset: int) -> None:
    value = bytearray(raw.get(name) or b"")
    value[offset] ^= 0x01
    raw.set(name, bytes(value))


def _with_version(raw: redis.Redis, name: str, version: int, at: int = 0) -> None:
    value = bytearray(raw.get(name) or b"")
    struct.pack_into("<H", value, at + 4, version)
    raw.set(name, bytes(value))


def _header_at(raw: redis.Redis, manifest: str) -> int:
    """Where the envelope header starts in a chunked value's manifest (it ends it)."""
    at = raw.strlen(manifest) - HEADER_SIZE
    assert (raw.getrange(manifest, at, at + 3)) == b"MMCR"
    return at


def _rewrite_manifest(raw: redis.Redis, ns: str, **fields: int) -> None:
    """Change the chunk count, chunk size or payload length a manifest announces."""
    name = _value_key(ns, 1)
    value = bytearray(raw.get(name) or b"")
    offsets = {"count": 20, "size": 24, "total": 28}
    for field, number in fields.items():
        struct.pack_into("<Q" if field == "total" else "<I", value, offsets[field], number)
    raw.set(name, bytes(value))


def _swap_chunks(raw: redis.Redis, ns: str) -> None:
    first, second = _chunks_of(raw, ns, 1)[:2]
    a, b = raw.get(first), raw.get(second)
    assert a != b and len(a or b"") == len(b or b"")
    raw.set(first, b or b"")
    raw.set(second, a or b"")


def _foreign_chunk(raw: redis.Redis, ns: str) -> None:
    """Item 2's chunk 1 (same length, same position) in place of item 1's."""
    raw.copy(_chunks_of(raw, ns, 2)[1], _chunks_of(raw, ns, 1)[1], replace=True)


def _part_size(raw: redis.Redis, ns: str, part_bytes: int) -> None:
    name = _value_key(ns, 1)
    value = bytearray(raw.get(name) or b"")
    struct.pack_into("<I", value, _header_at(raw, name) + 16, part_bytes)
    raw.set(name, bytes(value))


DAMAGE: dict[str, tuple[int, Callable[[redis.Redis, str], None], str]] = {
    # name: (item size, damage(raw, namespace), the stats counter that must count it)
    "flipped byte in the tensor bytes": (
        10_000,
        lambda r, ns: _flip(r, _value_key(ns, 1), HEADER_SIZE + 5000),
        "digest_mismatch",
    ),
    "flipped byte in the digest": (
        10_000,
        lambda r, ns: _flip(r, _value_key(ns, 1), HEADER_SIZE - 5),
        "digest_mismatch",
    ),
    "flipped byte in a chunk": (
        3 * MiB,
        lambda r, ns: _flip(r, _chunks_of(r, ns, 1)[2], 77),
        "digest_mismatch",
    ),
    "deleted chunk": (3 * MiB, lambda r, ns: r.delete(_chunks_of(r, ns, 1)[1]), "incomplete"),
    "truncated value": (
        10_000,
        lambda r, ns: r.set(_value_key(ns, 1), (r.get(_value_key(ns, 1)) or b"")[:-100]),
        "corrupt",
    ),
    "header of another schema version": (
        10_000,
        lambda r, ns: _with_version(r, _value_key(ns, 1), SCHEMA_VERSION + 1),
        "version_mismatch",
    ),
    "another item's value copied over": (
        10_000,
        lambda r, ns: r.copy(_value_key(ns, 2), _value_key(ns, 1), replace=True),
        "digest_mismatch",
    ),
    "garbage": (10_000, lambda r, ns: r.set(_value_key(ns, 1), b"MMCK" + bytes(40)), "incomplete"),
    # A chunked value: its envelope header lives in the manifest, each chunk is one part of
    # the digest's hash list, and the manifest only says where the parts are.
    "flipped byte in the manifest's digest": (
        3 * MiB,
        lambda r, ns: _flip(r, _value_key(ns, 1), _header_at(r, _value_key(ns, 1)) + 40),
        "digest_mismatch",
    ),
    "manifest's header of another schema version": (
        3 * MiB,
        lambda r, ns: _with_version(
            r, _value_key(ns, 1), SCHEMA_VERSION - 1, _header_at(r, _value_key(ns, 1))
        ),
        "version_mismatch",
    ),
    "another part size in the manifest's header": (
        3 * MiB,
        lambda r, ns: _part_size(r, ns, 2 * CHUNK_BYTES),
        "digest_mismatch",
    ),
    "two chunks swapped": (3 * MiB, _swap_chunks, "digest_mismatch"),
    "another item's chunk in its place": (3 * MiB, _foreign_chunk, "digest_mismatch"),
    "a chunk of another length": (
        3 * MiB,
        lambda r, ns: r.append(_chunks_of(r, ns, 1)[1], b"!"),
        "incomplete",
    ),
    "a chunk of another type": (
        3 * MiB,
        lambda r, ns: (r.delete(c := _chunks_of(r, ns, 1)[2]), r.rpush(c, b"x")),
        "incomplete",
    ),
    "manifest with a byte appended": (
        3 * MiB,
        lambda r, ns: r.append(_value_key(ns, 1), b"!"),
        "incomplete",
    ),
    "manifest with another chunk size": (
        3 * MiB,
        lambda r, ns: _rewrite_manifest(r, ns, size=CHUNK_BYTES // 2),
        "incomplete",
    ),
    "manifest announcing a value past max_value_mb": (
        3 * MiB,
        lambda r, ns: _rewrite_manifest(r, ns, count=1 << 20, total=1 << 40),
        "too_large",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_value_is_a_counted_miss(
    server: LocalServer, raw: redis.Redis, namespace: str, damage: str
) -> None:
    size, harm, counter = DAMAGE[damage]
    with open_store(server.url, namespace) as store:
        store.put(key(1), make_item(1, size))
        store.put(key(2), make_item(2, size))
        harm(raw, namespace)
        assert store.get(key(1)) is None
        assert store.stats()[counter] == 1
        assert same(store.get(key(2)), make_item(2, size))  # the healthy item still reads


def test_a_value_whose_chunk_is_gone_is_put_again_by_the_next_host(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """A chunk evicted (``allkeys-lru``) or flushed from under its manifest: the read that
    finds the value incomplete deletes the manifest, so the item is not refused as present
    for good."""
    item = make_item(2, 3 * MiB)
    with open_store(server.url, namespace) as store:
        store.put(key(2), item)
        raw.delete(_chunks_of(raw, namespace, 2)[0])
        assert store.get(key(2)) is None and store.stats()["incomplete"] == 1
    with open_store(server.url, namespace) as other_host:
        other_host.put(key(2), item)
        assert same(other_host.get(key(2)), item), other_host.stats()
        assert other_host.stats()["puts"] == 1


@pytest.mark.parametrize(
    "damage",
    [
        "manifest with a byte appended",
        "manifest with another chunk size",
        "deleted chunk",
    ],
)
def test_a_broken_chunked_value_read_alone_is_put_again_by_the_next_host(
    server: LocalServer, raw: redis.Redis, namespace: str, damage: str
) -> None:
    """Whether the broken manifest is deleted (so that the item can be put again) does not
    depend on what else the lookup asked for: here it asks for that value alone."""
    size, harm, counter = DAMAGE[damage]
    item = make_item(1, size)
    with open_store(server.url, namespace) as store:
        store.put(key(1), item)
        harm(raw, namespace)
        assert store.get(key(1)) is None and store.stats()[counter] == 1
    with open_store(server.url, namespace) as other_host:
        other_host.put(key(1), item)
        assert other_host.stats()["puts"] == 1, other_host.stats()
        assert same(other_host.get(key(1)), item)


@pytest.mark.parametrize("manifest", ["schema 1's (no envelope header)", "of another version"])
def test_a_chunked_value_of_another_schema_version_is_a_version_mismatch_left_alone(
    server: LocalServer, raw: redis.Redis, namespace: str, manifest: str
) -> None:
    """Hosts of two versions sharing a store during an upgrade: a chunked value the other
    version wrote is a miss counted as ``version_mismatch`` (not a broken value), and is left
    in the store for the hosts that read it - never deleted as a value whose chunks are
    gone."""
    with open_store(server.url, namespace) as store:
        store.put(key(1), make_item(1, 3 * MiB))
        name = _value_key(namespace, 1)
        current = raw.get(name) or b""
        if manifest.startswith("schema 1"):
            # Schema 1's manifest: magic, writer nonce, chunk count, chunk size, total - and
            # nothing after it (its chunks held the whole envelope).
            other = current[: struct.calcsize("<4s16sIIQ")]
            raw.set(name, other)
        else:
            _with_version(raw, name, SCHEMA_VERSION + 1, _header_at(raw, name))
            other = raw.get(name) or b""
        assert store.get(key(1)) is None
        s = store.stats()
        assert s["version_mismatch"] == 1 and s["incomplete"] == 0 and s["misses"] == 1
        assert raw.get(name) == other


def test_a_chunked_put_cut_short_leaves_only_keys_that_expire(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    """A put whose deadline passes after its chunks went out, before its manifest did, leaves
    no key that lives longer than the upload's lease; a complete put's keys then live as long
    as the value (here: for ever)."""
    with open_store(server.url, namespace) as store:
        client = store._backend._client  # type: ignore[attr-defined]
        set_value = client.set

        def manifest_times_out(name: str, value: bytes, **options: Any) -> Any:
            if value[:4] == b"MMCK":
                raise redis.exceptions.TimeoutError("the deadline passed")
            return set_value(name, value, **options)

        client.set = manifest_times_out
        store.put(key(3), make_item(3, 3 * MiB))
        client.set = set_value
        assert store.stats()["timeouts"] == 1 and store.stats()["puts"] == 0
        left = _chunks_of(raw, namespace, 3)
        assert len(left) == 4 and raw.exists(_value_key(namespace, 3)) == 0
        assert all(0 < raw.pttl(name) <= UPLOAD_LEASE_MS for name in left)
        store.put(key(4), make_item(4, 3 * MiB))
        assert store.stats()["puts"] == 1
        kept = [*_chunks_of(raw, namespace, 4), _value_key(namespace, 4)]
        assert len(kept) == 5 and all(raw.pttl(name) == -1 for name in kept)


def test_a_wrong_secret_makes_every_value_a_miss(server: LocalServer, namespace: str) -> None:
    items = {i: make_item(i, 2 * MiB if i == 0 else 300) for i in range(3)}
    with open_store(server.url, namespace) as writer:
        for i, item in items.items():
            writer.put(key(i), item)
        assert all(same(writer.get(key(i)), item) for i, item in items.items())
    for secret in ("another secret", None):
        with RemoteStore(server.url, namespace=namespace, secret=secret) as reader:
            assert reader.get_many([key(i) for i in items]) == [None, None, None]
            assert reader.stats()["digest_mismatch"] == 3 and reader.stats()["hits"] == 0


def test_two_hosts_putting_one_key_at_once_leave_one_whole_item(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    items = [make_item(10, 3 * MiB), make_item(11, 3 * MiB)]  # the hosts disagree, visibly
    for _ in range(5):
        stores = [open_store(server.url, namespace) for _ in items]
        start = threading.Barrier(len(items))

        def put(store: RemoteStore, item: dict[str, Any], start: threading.Barrier = start) -> None:
            start.wait()
            store.put(key("race"), item)

        threads = [
            threading.Thread(target=put, args=pair) for pair in zip(stores, items, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        got = stores[0].get(key("race"))
        assert same(got, items[0]) or same(got, items[1])
        assert sum(s.stats()["puts"] for s in stores) == 1
        assert len(_chunks_of(raw, namespace, "race")) == 4  # the loser removed its chunks
        for s in stores:
            s.close()
        raw.delete(*raw.scan_iter(match=f"mmc/{namespace}/*"))


# --------------------------------------------------------------------------------------------
# Values that verify but do not decode, and values too large to read


def _shared_part_payload(tensors: int, part_bytes: int) -> bytes:
    """A codec payload (ARCHITECTURE.md: "The item payload") whose ``tensors`` bool tensors
    all name part 1 of ``part_bytes`` bytes: ``{"t": [tensor, tensor, ...]}``.  Decoding it
    with copies asks for ``tensors * part_bytes`` bytes at once."""
    node = b"\x0c\x04bool\x01" + struct.pack("<QI", part_bytes, 1)
    tree = b"\x0b" + struct.pack("<I", 1) + struct.pack("<I", 1) + b"t"
    tree += b"\x09" + struct.pack("<I", tensors) + node * tensors
    header = b"MMC2" + struct.pack("<IIIQ", 24 + len(tree), 1, 0, part_bytes) + tree
    return header + bytes(-len(header) % serde.ALIGNMENT) + bytes(part_bytes)


def _plant(raw: redis.Redis, namespace: str, name: object, payload: bytes) -> None:
    """``payload`` sealed without a secret, as one plain value under item ``name``'s key."""
    store_key = _value_key(namespace, name)
    raw.set(store_key, seal(store_key, payload, None, CHUNK_BYTES) + payload)


def test_a_value_whose_decoding_raises_is_a_counted_miss_everywhere(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    # The builder writes exactly what the codec does for one tensor; 400,000 tensors that
    # share one 4 MiB part ask torch for 1.6 TB: an 11 MiB value whose decoding raises.
    assert _shared_part_payload(1, 64) == serde.pack({"t": [torch.zeros(64, dtype=torch.bool)]})
    tensors, part_bytes = 400_000, 4 * MiB
    try:
        torch.UntypedStorage(tensors * part_bytes)  # never touched: costs no memory
    except RuntimeError:
        pass
    else:
        pytest.skip("this machine grants a 1.6 TB allocation (overcommit): nothing to refuse")
    _plant(raw, namespace, 1, _shared_part_payload(tensors, part_bytes))
    with RemoteStore(server.url, namespace=namespace) as store:  # no secret: it verifies
        assert in_time(lambda: store.get(key(1))) is None
        assert in_time(lambda: store.get_many([key(2), key(1)])) == [None, None]
        stats = store.stats()
        # A decoder that refuses parts named twice calls it corrupt instead: a miss either way.
        assert stats["undecodable"] + stats["corrupt"] == 2 and stats["misses"] == 3
    p0 = TieredSenderCache(SenderCache(0.05), RemoteStore(server.url, namespace=namespace))
    try:
        assert in_time(lambda: p0.is_cached([key(1)])) == [False]
        stats = p0.stats()
        assert stats["remote_undecodable"] + stats["remote_corrupt"] == 1
        assert stats["remote_errors"] == 1
    finally:
        p0.close()


@pytest.mark.parametrize(
    "error",
    [RuntimeError("allocator says no"), MemoryError(), OverflowError("shape"), KeyError("x")],
    ids=lambda e: type(e).__name__,
)
def test_any_exception_from_decoding_is_a_counted_miss_logged_once(
    server: LocalServer,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
) -> None:
    with open_store(server.url, namespace) as writer:
        writer.put(key(1), make_item(1, 1000))
        writer.put(key(2), make_item(2, 3 * MiB))

    def fail(payload: Any, *, copy: bool = True) -> Any:
        raise error

    monkeypatch.setattr(serde, "decode", fail)
    with open_store(server.url, namespace) as store, caplog.at_level(logging.WARNING):
        assert store.get(key(1)) is None
        assert store.get_many([key(1), key(2)]) == [None, None]
        stats = store.stats()
        assert stats["undecodable"] == 3 and stats["misses"] == 3 and stats["errors"] == 3
    assert len([r for r in caplog.records if "undecodable" in r.getMessage()]) == 1
    p0 = TieredSenderCache(SenderCache(0.05), open_store(server.url, namespace))
    try:
        assert p0.is_cached([key(1), key(2)]) == [False, False]
        assert p0.stats()["remote_undecodable"] == 2
    finally:
        p0.close()


def test_a_plain_value_past_max_value_mb_is_a_miss_never_read_whole(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    item = make_item(8, 8 * MiB)
    # A writer whose chunks are 16 MiB stores the item as one plain 8 MiB value.
    with RemoteStore(server.url + "?chunk_kb=16384", namespace=namespace) as writer:
        writer.put(key(8), item)
    assert raw.strlen(_value_key(namespace, 8)) > 8 * MiB and not _chunks_of(raw, namespace, 8)
    with RemoteStore(server.url, namespace=namespace, max_value_mb=1) as reader:
        assert reader.get(key(9)) is None  # connected, so the next get is the value alone
        tracemalloc.start()
        try:
            got = reader.get(key(8))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got is None and reader.stats()["too_large"] == 1
        assert peak < 4 * MiB, f"the reader allocated {peak / MiB:.1f} MiB for a refused value"
    with RemoteStore(server.url, namespace=namespace) as default:  # 256 MiB: it reads
        assert same(default.get(key(8)), item)


def _nested(depth: int) -> list[Any]:
    inner: list[Any] = []
    for _ in range(depth):
        inner = [inner]
    return inner


@pytest.mark.parametrize(
    "item",
    [
        {"t": torch.zeros([1] * 65)},
        {"deep": _nested(70)},
    ],
    ids=["65 dimensions", "nested 70 deep"],
)
def test_an_item_past_a_codec_limit_is_counted_and_skipped_not_raised(
    server: LocalServer, namespace: str, item: dict[str, Any]
) -> None:
    with open_store(server.url, namespace) as store:
        store.put(key(1), item)
        assert store.stats()["unencodable"] == 1 and store.contains([key(1)]) == [False]
        store.put(key(2), make_item(2, 100))  # the tier goes on
        assert same(store.get(key(2)), make_item(2, 100))


# --------------------------------------------------------------------------------------------
# A server that dies, stalls and comes back


def test_a_dead_server_costs_misses_then_the_breaker_and_recovers_by_itself(
    own_server: LocalServer, namespace: str
) -> None:
    store = open_store(own_server.url, namespace, timeout_s=0.2, breaker_cooldown_s=0.2)
    store.put(key(1), make_item(1, 100))
    kill(own_server)
    for _ in range(10):
        assert in_time(lambda: store.get(key(1))) is None
        assert in_time(lambda: store.contains([key(1)])) == [False]
        in_time(lambda: store.put(key(2), make_item(2, 100)))
    stats = store.stats()
    assert stats["unreachable"] >= 3 and stats["breaker_opened"] == 1 and stats["skipped"] > 0
    own_server.start()  # a fresh, empty server on the same port
    recovered = False
    for _ in range(200):  # the breaker probes again after its cooldown
        in_time(lambda: store.put(key(3), make_item(3, 100)))
        if same(in_time(lambda: store.get(key(3))), make_item(3, 100)):
            recovered = True
            break
        threading.Event().wait(0.05)
    assert recovered
    assert store.stats()["breaker_open"] == 0
    store.close()


def test_a_stalled_server_costs_each_call_its_deadline_not_a_hang(
    own_server: LocalServer, namespace: str
) -> None:
    store = open_store(own_server.url, namespace, timeout_s=0.3, breaker_failures=100)
    item = make_item(1, 2 * MiB)
    store.put(key(1), item)
    stall(own_server)
    try:
        for call in (
            lambda: store.get(key(1)),
            lambda: store.contains([key(1)]),
            lambda: store.put(key(2), item),
            lambda: store.get_many([key(1), key(2)]),
        ):
            assert in_time(call) in (None, [False], [None, None])
        assert store.stats()["timeouts"] == 4
    finally:
        resume(own_server)
    assert same(in_time(lambda: store.get(key(1))), item)
    store.close()


def test_a_server_that_stalls_mid_value_costs_the_deadline_then_reads_again(
    own_server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 MiB: more than the sockets' buffers hold, so the server stops with most of it unsent.
    item = make_item(1, 40 * MiB)
    with open_store(own_server.url, namespace, timeout_s=30) as writer:
        writer.put(key(1), item)
    store = open_store(own_server.url, namespace, timeout_s=1.0, breaker_failures=100)
    real_into = redis_backend._ReplyReader.into

    def stall_first(reader: Any, view: memoryview) -> bytes:
        stall(own_server)  # once the value has begun to arrive
        return real_into(reader, view)

    monkeypatch.setattr(redis_backend._ReplyReader, "into", stall_first)
    try:
        assert in_time(lambda: store.get(key(1))) is None
        assert store.stats()["timeouts"] == 1 and store.stats()["hits"] == 0
    finally:
        resume(own_server)
    monkeypatch.undo()
    # The connection left mid-reply is closed, never reused: the next get reads whole.
    assert same(in_time(lambda: store.get(key(1))), item)
    store.close()


def test_resp3_connections_read_chunked_values_and_their_gaps(
    server: LocalServer, raw: redis.Redis, namespace: str
) -> None:
    item = make_item(7, 3 * MiB)
    with open_store(server.url + "?protocol=3", namespace) as store:
        store.put(key(7), item)
        assert same(store.get(key(7)), item)
        raw.delete(_chunks_of(raw, namespace, 7)[3])
        assert store.get(key(7)) is None and store.stats()["incomplete"] == 1


def test_the_breaker_opens_probes_once_and_backs_off() -> None:
    breaker = CircuitBreaker(failures=2, cooldown_s=0.05)
    assert breaker.allow() and not breaker.failure() and breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    threading.Event().wait(0.06)
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.failure()  # the probe failed: open again, for longer
    assert breaker.state == "open"
    threading.Event().wait(0.11)
    assert breaker.allow() and breaker.success() and breaker.state == "closed"


# --------------------------------------------------------------------------------------------
# Credentials stay out of logs, reprs and errors

PASSWORD = "hunter2-do-not-log"


def test_credentials_in_the_url_never_reach_logs_repr_or_errors(
    caplog: pytest.LogCaptureFixture, namespace: str
) -> None:
    acl = ["--user", "alice", "on", f">{PASSWORD}", "~*", "&*", "+@all"]
    with start_valkey(extra=acl) as srv:
        url = srv.url.replace("redis://", f"redis://alice:{PASSWORD}@")
        store = open_store(
            url, namespace, timeout_s=0.2, breaker_failures=2, breaker_cooldown_s=0.2
        )
        assert PASSWORD not in repr(store) and PASSWORD not in store.url
        store.put(key(1), make_item(1, 100))
        assert same(store.get(key(1)), make_item(1, 100))  # the credentials do work
        with caplog.at_level(logging.WARNING):
            kill(srv)  # an outage: every kind of failure is logged once
            for _ in range(4):
                in_time(lambda: store.get(key(1)))
                in_time(lambda: store.contains([key(1)]))
                in_time(lambda: store.put(key(2), make_item(2, 100)))
                threading.Event().wait(0.5)  # past the breaker's cooldown: it probes again
            srv.start()  # back: the probe that succeeds is logged too
            for _ in range(100):
                in_time(lambda: store.contains([key(1)]))
                if "answers again" in caplog.text:
                    break
                threading.Event().wait(0.1)
        store.close()
    logged = [r.getMessage() for r in caplog.records] + [caplog.text]
    assert any("unreachable" in m for m in logged) and any("failed 2 times" in m for m in logged)
    assert any("answers again" in m for m in logged)
    assert all(PASSWORD not in m for m in logged)
    assert "127.0.0.1" in store.url and "alice" not in store.url


def test_a_server_with_a_password_starts_and_serves_who_knows_it(namespace: str) -> None:
    """``requirepass``: the server answers a PING without the password ``-NOAUTH``, which
    says it is up (not that it is still starting)."""
    with start_valkey(extra=["--requirepass", PASSWORD]) as srv:
        with open_store(srv.url.replace("redis://", f"redis://:{PASSWORD}@"), namespace) as store:
            store.put(key(1), make_item(1, 100))
            assert same(store.get(key(1)), make_item(1, 100)), store.stats()
        with open_store(srv.url, namespace) as without:
            assert without.get(key(1)) is None and without.stats()["errors"] == 1
            assert PASSWORD not in repr(without)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{PASSWORD}@127.0.0.1:1?chunk_kb=none",
        f"redis://127.0.0.1:1?password={PASSWORD}&chunk_kb=none",
        f"http://user:{PASSWORD}@127.0.0.1:1",
        # Not percent-encoded: '/', '?' and '#' end the netloc where a URL parser looks.
        f"redis://:{PASSWORD}/b64+tail@127.0.0.1:1/0",
        f"redis://default:{PASSWORD}#rest@127.0.0.1:1",
        f"redis://:{PASSWORD}?rest@127.0.0.1:1",
    ],
)
def test_a_bad_url_with_credentials_is_an_error_that_does_not_repeat_them(url: str) -> None:
    with pytest.raises(ValueError) as error:  # noqa: PT011 - its message is checked below
        RemoteStore(url, namespace="m@1")
    assert PASSWORD not in str(error.value) and "127.0.0.1" in str(error.value)


def test_a_url_given_as_an_option_loses_its_credentials_and_the_store_keeps_its_address() -> None:
    shown = redact_url(f"mooncake://10.0.0.5:50051?metadata=http://alice:{PASSWORD}@10.0.0.9:80/m")
    assert shown == "mooncake://10.0.0.5:50051?metadata=http://***@10.0.0.9:80/m"


@pytest.mark.parametrize("url", ["redis://", "mooncake://", "redis:///0", "valkey://?db=1"])
def test_a_url_without_a_host_is_shown_as_given(url: str) -> None:
    """An empty authority keeps its "//" (shown as "redis:", a URL without one reads as
    another mistake)."""
    assert redact_url(url) == url


def test_credentials_in_mooncakes_metadata_url_are_refused() -> None:
    """Mooncake's client logs each metadata request's URL in full."""
    url = f"mooncake://127.0.0.1:1?metadata=http://alice:{PASSWORD}@127.0.0.1:2/metadata"
    with pytest.raises(ValueError, match="metadata") as error:
        RemoteStore(url, namespace="m@1")
    assert PASSWORD not in str(error.value) and "127.0.0.1:1" in str(error.value)


def test_a_password_in_the_query_is_redacted_too(namespace: str) -> None:
    with RemoteStore(
        f"redis://127.0.0.1:1/0?password={PASSWORD}&chunk_kb=64", namespace=namespace
    ) as store:
        assert PASSWORD not in repr(store) and "chunk_kb=64" in store.url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # '@' needs no percent-encoding in a query: a password option may hold one as it is.
        ("redis://cache:6379/0?password=hunter@two", "redis://cache:6379/0?password=***"),
        (
            "rediss://cache:6380?ssl_password=x@y@two&chunk_kb=64",
            "rediss://cache:6380?ssl_password=***&chunk_kb=64",
        ),
        ("redis://u:hunter@cache:6379?password=a@two", "redis://***@cache:6379?password=***"),
        # Still: a userinfo password with '/', '?' or '#' (the netloc parsed ends early).
        ("redis://:hunter?password=x@cache:6379", "redis://***@cache:6379"),
        (
            "redis://:hunter/two@cache:6379/0?password=a@two",
            "redis://***@cache:6379/0?password=***",
        ),
    ],
)
def test_an_at_sign_in_a_password_option_shows_none_of_it(url: str, shown: str) -> None:
    """The part of a password option's value after an '@' is neither shown nor taken for
    the store's host."""
    assert redact_url(url) == shown
    assert "hunter" not in redact_url(url) and "two" not in redact_url(url)


# --------------------------------------------------------------------------------------------
# The breaker: every outcome of a probe settles it


def test_a_probe_that_ends_without_a_verdict_lets_the_next_call_probe() -> None:
    breaker = CircuitBreaker(failures=1, cooldown_s=0.05)
    assert breaker.failure() and breaker.state == "open"
    threading.Event().wait(0.06)
    assert breaker.allow() and not breaker.allow()  # this thread probes
    other = threading.Thread(target=breaker.release)  # not its probe: nothing to release
    other.start()
    other.join()
    assert not breaker.allow()
    breaker.release()  # the probe never reached the store (refused, interrupted)
    assert breaker.state == "half-open" and breaker.opened == 1
    assert breaker.allow() and not breaker.allow()  # the next call probes instead
    assert breaker.success() and breaker.state == "closed"
    breaker.release()  # after a verdict: nothing to release
    assert breaker.state == "closed" and breaker.allow()


class _Interrupted(BaseException):
    """Something that is not an error ends a call (a KeyboardInterrupt, a cancellation)."""


@pytest.mark.parametrize("outcome", ["refused", "interrupted", "failed", "succeeded"])
def test_every_outcome_of_a_probe_settles_the_breaker(
    own_server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    store = open_store(
        own_server.url, namespace, timeout_s=0.3, breaker_failures=1, breaker_cooldown_s=0.2
    )
    store.put(key(1), make_item(1, 100))
    kill(own_server)
    assert store.get(key(1)) is None and store.stats()["breaker_opened"] == 1
    threading.Event().wait(0.3)  # the cooldown: the next call probes
    backend = store._backend

    def probe(store_key: str, header: bytes, payload: Any, deadline: float) -> bool:
        if outcome == "refused":
            raise ValueTooLarge("more than the client's buffer")
        if outcome == "interrupted":
            raise _Interrupted
        if outcome == "failed":
            raise RemoteUnreachable("refused")
        return True

    monkeypatch.setattr(backend, "write", probe)
    if outcome == "interrupted":
        with pytest.raises(_Interrupted):
            store.put(key(2), make_item(2, 100))
    else:
        store.put(key(2), make_item(2, 100))
    monkeypatch.undo()
    if outcome == "failed":  # the probe failed: the breaker waits twice as long, then probes
        threading.Event().wait(0.5)
    own_server.start()
    before = store.stats()
    assert same(in_time(lambda: store.get(key(1))), None)  # a fresh, empty server: a miss
    after = store.stats()
    assert after["skipped"] == before["skipped"], "the breaker stayed shut"
    assert after["misses"] == before["misses"] + 1 and after["breaker_open"] == 0
    store.close()


# --------------------------------------------------------------------------------------------
# Deadlines: a call ends by its deadline, whole, whatever the server does


def test_a_chunk_fetch_queued_behind_another_ends_by_its_own_deadline(
    server: LocalServer, namespace: str
) -> None:
    """The chunks of a batch are fetched on the backend's fetch thread too; a read whose share
    waits there behind another's (here: one that never ends) still ends by its deadline."""
    with open_store(server.url, namespace, timeout_s=0.3) as store:
        store.put(key(5), make_item(5, 3 * MiB))
        fetchers = store._backend._fetchers  # type: ignore[attr-defined]
        release = threading.Event()
        busy = fetchers.submit(release.wait, 10 * HANG_S)
        try:
            got = in_time(lambda: store.get(key(5)))
        finally:
            release.set()
            busy.result()
        assert got is None and store.stats()["timeouts"] == 1
        assert same(store.get(key(5)), make_item(5, 3 * MiB))  # the next read is whole


def test_a_read_never_waits_for_the_fetch_thread_another_read_is_using(
    server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chunked reads at once, the first one's share on the fetch thread held up (as a
    slow transfer would hold it): the second reads all its chunks on its own connection
    instead of queueing its share behind the first's until its deadline - as did every read
    beyond the first when a hundred threads read large values at once, a timeout each."""
    items = {name: make_item(name, 3 * MiB) for name in (1, 2)}
    with open_store(server.url, namespace, timeout_s=10) as store:
        for name, item in items.items():
            store.put(key(name), item)
        backend = store._backend
        real_share = type(backend)._fetch_share  # type: ignore[attr-defined]
        on_fetch_thread, go_on = threading.Event(), threading.Event()

        def held_up_share(self: Any, names: list[str], *args: Any) -> Any:
            if threading.current_thread().name.startswith("mmcache-redis-fetch"):
                on_fetch_thread.set()
                go_on.wait(HANG_S)
            return real_share(self, names, *args)

        monkeypatch.setattr(type(backend), "_fetch_share", held_up_share)
        with ThreadPoolExecutor(1) as caller:
            first = caller.submit(store.get, key(1))
            try:
                assert on_fetch_thread.wait(HANG_S), "the first read used no fetch thread"
                assert same(in_time(lambda: store.get(key(2))), items[2]), store.stats()
            finally:
                go_on.set()
            assert same(first.result(HANG_S), items[1]), store.stats()
        assert store.stats()["errors"] == 0, store.stats()


def _resp_command(buffer: bytearray) -> list[bytes] | None:
    """Take the next whole RESP command (an array of bulk strings) off ``buffer``."""
    if not buffer.startswith(b"*") or (end := buffer.find(b"\r\n")) < 0:
        return None
    count, at, words = int(buffer[1:end]), end + 2, []
    for _ in range(count):
        if (end := buffer.find(b"\r\n", at)) < 0:
            return None
        length = int(buffer[at + 1 : end])
        if len(buffer) < end + 2 + length + 2:
            return None
        words.append(bytes(buffer[end + 2 : end + 2 + length]))
        at = end + 2 + length + 2
    del buffer[:at]
    return words


class DribblingServer:
    """A RESP server on loopback that answers the connection handshake (``CLIENT ...``) at
    once, unless ``handshake_too``, and every other command with a long error reply sent one
    byte at a time (about 70 s for the whole of it: longer than ``HANG_S``); counts the
    replies it sent whole."""

    def __init__(self, *, handshake_too: bool = False) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}"
        self._handshake_too = handshake_too
        self._stop = threading.Event()
        self.commands: list[bytes] = []
        self.replies_dribbled = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pending = bytearray()
        with conn:
            while not self._stop.is_set():
                while (command := _resp_command(pending)) is not None:
                    name = command[0].upper()
                    self.commands.append(name)
                    if name == b"CLIENT" and not self._handshake_too:
                        conn.sendall(b"+OK\r\n")
                    elif not self._dribble(conn, b"-ERR " + b"." * 700 + b"\r\n"):
                        return
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                pending += data

    def _dribble(self, conn: socket.socket, reply: bytes) -> bool:
        for i in range(len(reply)):
            try:
                conn.sendall(reply[i : i + 1])
            except OSError:
                return False  # the client gave up
            if self._stop.wait(0.1):
                return False
        self.replies_dribbled += 1
        return True

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.mark.parametrize("dribbled", ["reply", "handshake"])
@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.get(key(1)),
        lambda s: s.get_many([key(1), key(2)]),
        lambda s: s.contains([key(1)]),
        lambda s: s.put(key(1), make_item(1, 100)),
        lambda s: s.put(key(1), make_item(1, 3 * MiB)),
    ],
    ids=["get", "get_many", "contains", "put", "put chunked"],
)
def test_a_server_dribbling_its_reply_costs_a_call_its_deadline_not_more(
    call: Callable[[RemoteStore], Any], dribbled: str
) -> None:
    server = DribblingServer(handshake_too=dribbled == "handshake")
    timeout_s = 0.5
    try:
        with RemoteStore(server.url, namespace="dribble@1", timeout_s=timeout_s) as store:
            # No duration is judged: a call its deadline did not end would wait for the whole
            # reply, which takes longer than in_time allows.
            assert in_time(lambda: call(store)) in (None, [None, None], [False])
            assert store.stats()["timeouts"] == 1 and store.stats()["errors"] == 1
            assert server.replies_dribbled == 0, "the call waited for the whole reply"
    finally:
        server.close()
    assert server.commands  # it did reach the server


# --------------------------------------------------------------------------------------------
# P0 with the tier: two hosts share what either processed


class Host:
    """One host's P0 (``TieredSenderCache`` over ``lru`` or ``shm``) and its P1 / worker,
    driven as an engine's frontend would; counts what it processed."""

    def __init__(self, mode: str, url: str, namespace: str, secret: str = "shared secret"):
        local: Any
        if mode == "lru":
            local = SenderCache(0.05)
            self.receiver: Any = ReceiverCache(0.05)
        else:
            local = ShmSenderCache(0.05, n_readers=1)
            self.receiver = ShmReceiverCache(local.handle())
        self.p0 = TieredSenderCache(local, RemoteStore(url, namespace=namespace, secret=secret))
        self.processed: list[int] = []

    def serve(self, ids: list[int]) -> list[Feature]:
        hashes = [key(i) for i in ids]
        cached = self.p0.is_cached(hashes)
        for h in hashes:
            self.p0.touch_sender_cache_item(h)
        inputs = [None if hit else self._process(i) for i, hit in zip(ids, cached, strict=True)]
        outputs = self.p0.get_and_update(inputs, hashes)
        features = [
            Feature(data=data, mm_hash=h) for (data, _), h in zip(outputs, hashes, strict=True)
        ]
        self.receiver.get_and_update_features(features)
        for (_, updates), i in zip(outputs, ids, strict=True):
            assert updates == ["<image>", i]
        return features

    def _process(self, i: int) -> tuple[dict[str, Any], list[Any]]:
        self.processed.append(i)
        return make_item(i, 40_000), ["<image>", i]

    def close(self) -> None:
        self.receiver.close()
        self.p0.close()


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_a_second_host_serves_what_the_first_processed_without_processing(
    server: LocalServer, namespace: str, mode: str
) -> None:
    a, b = Host(mode, server.url, namespace), Host(mode, server.url, namespace)
    try:
        for ids in ([1, 2], [3], [1, 4]):
            for f, i in zip(a.serve(ids), ids, strict=True):
                assert same(f.data, make_item(i, 40_000))
        assert a.p0.flush()
        for ids in ([2, 1], [4, 3, 5]):
            for f, i in zip(b.serve(ids), ids, strict=True):
                assert same(f.data, make_item(i, 40_000))
        assert a.processed == [1, 2, 3, 4] and b.processed == [5]
        stats = b.p0.stats()
        assert stats["remote_served"] == 4 and stats["remote_hits"] == 4
        # A remote hit went into B's local cache as usual: now a local hit, no remote call.
        lookups = stats["remote_lookups"]
        b.serve([1, 2])
        assert b.p0.stats()["remote_lookups"] == lookups and b.processed == [5]
    finally:
        a.close()
        b.close()


def test_with_the_server_gone_every_request_is_still_served_by_processing(
    own_server: LocalServer, namespace: str
) -> None:
    host = Host("shm", own_server.url, namespace)
    host.p0.remote.timeout_s = 0.2
    try:
        host.serve([1])
        kill(own_server)
        for ids in ([2, 3], [4], [2, 5]):
            for f, i in zip(in_time(lambda ids=ids: host.serve(ids)), ids, strict=True):
                assert same(f.data, make_item(i, 40_000))
        assert host.processed == [1, 2, 3, 4, 5]
        assert host.p0.stats()["remote_errors"] > 0
    finally:
        host.close()


def test_a_host_with_a_wrong_secret_processes_everything_itself(
    server: LocalServer, namespace: str
) -> None:
    a = Host("lru", server.url, namespace)
    b = Host("lru", server.url, namespace, secret="not the shared one")
    try:
        a.serve([1, 2])
        assert a.p0.flush()
        for f, i in zip(b.serve([1, 2]), [1, 2], strict=True):
            assert same(f.data, make_item(i, 40_000))
        assert b.processed == [1, 2] and b.p0.stats()["remote_digest_mismatch"] == 2
    finally:
        a.close()
        b.close()


def test_make_caches_puts_the_p0_cache_of_a_mode_behind_the_tier(
    server: LocalServer, namespace: str
) -> None:
    from mmcache import make_caches

    with pytest.raises(ValueError, match="needs a P0 cache"):
        make_caches("none", capacity_gb=0.01, remote=open_store(server.url, namespace))
    p0, p1 = make_caches("lru", capacity_gb=0.01, remote=open_store(server.url, namespace))
    assert isinstance(p0, TieredSenderCache) and isinstance(p0.local, SenderCache)
    assert isinstance(p1, ReceiverCache)
    p0.close()
    assert p0.remote.get(key(1)) is None and p0.remote.stats()["skipped"] == 1  # closed with it


def test_one_item_or_hash_where_a_request_takes_a_list_is_a_type_error(
    server: LocalServer, namespace: str
) -> None:
    # The tier zipped them before its local cache checked: one item for a list was "1
    # items but 2 mm_hashes" (or a field name taken for an item), a str "xy" two hashes.
    with TieredSenderCache(SenderCache(0.01), open_store(server.url, namespace)) as p0:
        item = {"x": torch.ones(2)}
        with pytest.raises(TypeError, match=r"^get_and_update takes a list of items, not one dict"):
            p0.get_and_update(item, ["h"])  # type: ignore[arg-type]
        pairs = [(item, None), (item, None)]
        with pytest.raises(TypeError, match=r"^get_and_update takes a list of mm_hashes, not one"):
            p0.get_and_update(pairs, "xy")
        assert p0.is_cached(["h", "x", "y"]) == [False] * 3
        assert p0.get_and_update([(item, None)], ["h"])[0][0] is item


def test_the_readme_example_runs_against_a_real_server(
    server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "remote" in b)
    monkeypatch.setenv("MMCACHE_REMOTE_SECRET", "from the environment")
    namespace: dict[str, Any] = {}
    exec(
        compile(block.replace("redis://cache.internal:6379", server.url), "README", "exec"),
        namespace,
    )
    p0 = namespace["p0"]
    try:
        assert isinstance(p0, TieredSenderCache) and isinstance(p0.local, ShmSenderCache)
        assert p0.is_cached([key("readme")]) == [False] and p0.remote.stats()["errors"] == 0
    finally:
        p0.close()


def hold_puts(store: RemoteStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every put of ``store`` (its writer thread's) until the event returned is set."""
    release = threading.Event()
    real_put = store.put

    def held_put(k: str, item: Any) -> None:
        release.wait(HANG_S)
        real_put(k, item)

    monkeypatch.setattr(store, "put", held_put)
    return release


def test_flush_and_close_may_wait_without_a_bound(
    server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``timeout_s=inf`` waits as long as it takes, rather than raising ``OverflowError``
    (a lock's timeout is at most ``threading.TIMEOUT_MAX``)."""
    store = open_store(server.url, namespace)
    release = hold_puts(store, monkeypatch)
    p0 = TieredSenderCache(SenderCache(0.05), store)
    results: list[Any] = []

    def flush_for_ever() -> None:
        try:
            results.append(p0.flush(float("inf")))
        except BaseException as exc:
            results.append(exc)

    try:
        p0.get_and_update([(make_item(1, 1000), ["<image>", 1])], [key(1)])  # held
        waiter = threading.Thread(target=flush_for_ever, daemon=True)
        waiter.start()
        waiter.join(0.5)  # time for it to wait on the held put (or fail)
        release.set()
        waiter.join(HANG_S)
        assert results == [True]
        in_time(lambda: p0.close(timeout_s=float("inf")))
        assert store.contains([key(1)]) == [False]  # closed: a miss, the call answered
    finally:
        release.set()
        p0.close()


def test_items_waiting_to_be_published_are_bounded_by_bytes(
    server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(server.url, namespace)
    release = hold_puts(store, monkeypatch)
    p0 = TieredSenderCache(SenderCache(0.05), store, publish_queue=64, publish_queue_mb=1)

    def serve(i: int) -> None:
        assert p0.is_cached([key(i)]) == [False]
        p0.get_and_update([(make_item(i, 400_000), ["<image>", i])], [key(i)])

    try:
        for i in range(4):  # 0.4 MB each: two fit in 1 MiB, the writer is held up
            serve(i)
        assert p0.stats()["remote_publish_dropped"] == 2
        release.set()
        assert p0.flush()
        assert store.contains([key(i) for i in range(4)]) == [True, True, False, False]
        serve(4)  # the queue is empty again: the next item is queued
        assert p0.flush() and store.contains([key(4)]) == [True]
        assert p0.stats()["remote_publish_dropped"] == 2
    finally:
        release.set()
        p0.close()


def test_prompt_updates_of_any_shape_never_fail_the_update(
    server: LocalServer, namespace: str
) -> None:
    """Prompt updates are any picklable object and never count towards an item's size: one
    that refers to itself is served as the local cache serves it, and only kept from the
    remote tier (the codec cannot hold it: counted), never raised out of the update."""
    updates: list[Any] = ["<image>"]
    updates.append(updates)
    p0 = TieredSenderCache(SenderCache(0.05), open_store(server.url, namespace))
    try:
        assert p0.is_cached([key(1)], claim=True) == [False]
        [(data, got)] = in_time(lambda: p0.get_and_update([(make_item(1, 100), updates)], [key(1)]))
        assert same(data, make_item(1, 100)) and got is updates
        assert p0.flush()
        s = p0.stats()
        assert s["remote_unencodable"] == 1 and s["remote_puts"] == 0, s
        assert p0.remote.contains([key(1)]) == [False]
    finally:
        p0.close()


Span = collections.namedtuple("Span", "offset length")


class Kind(enum.IntEnum):
    IMAGE = 1


@pytest.mark.parametrize(
    "updates", [[Span(3, 4)], {"kind": Kind.IMAGE}], ids=["namedtuple", "IntEnum"]
)
def test_prompt_updates_the_codec_gives_back_as_another_type_stay_local(
    server: LocalServer, namespace: str, updates: Any
) -> None:
    """The item codec gives a namedtuple back as a tuple and an IntEnum as an int: another
    host served such prompt updates from the remote tier got [(3, 4)] for [Span(3, 4)] (and
    an engine reading .offset failed there). They keep the item local, counted as what the
    codec refuses, as the ring's 'plain' prompt-updates codec does."""
    p0 = TieredSenderCache(SenderCache(0.05), open_store(server.url, namespace))
    try:
        assert p0.is_cached([key(1)], claim=True) == [False]
        [(data, got)] = p0.get_and_update([(make_item(1, 100), updates)], [key(1)])
        assert same(data, make_item(1, 100)) and got is updates
        assert p0.flush()
        assert p0.remote.contains([key(1)]) == [False]
        s = p0.stats()
        assert s["remote_unencodable"] == 1 and s["remote_puts"] == 0, s
    finally:
        p0.close()


def test_an_item_the_full_queue_drops_is_not_counted_published(
    server: LocalServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(server.url, namespace)
    release = hold_puts(store, monkeypatch)
    p0 = TieredSenderCache(SenderCache(0.05), store, publish_queue=1)
    try:
        for i in range(3):  # the writer holds the first: the queue is full for the others
            assert p0.is_cached([key(i)]) == [False]
            p0.get_and_update([(make_item(i, 1000), ["<image>", i])], [key(i)])
        release.set()
        assert p0.flush()
        s = p0.stats()
        stored = sum(store.contains([key(i) for i in range(3)]))
        assert s["remote_publish_dropped"] == 3 - stored
        assert s["remote_published"] == stored
    finally:
        release.set()
        p0.close()


def test_items_fetched_for_the_coming_update_are_bounded_by_bytes(
    server: LocalServer, namespace: str
) -> None:
    with open_store(server.url, namespace) as writer:
        for i in range(3):
            writer.put(key(i), {"item": make_item(i, 400_000), "prompt_updates": ["<image>", i]})
    p0 = TieredSenderCache(
        SenderCache(0.05), open_store(server.url, namespace), prefetch_limit_mb=1
    )
    try:
        # The oldest goes first: what is left is what the coming update can use.
        assert p0.is_cached([key(0), key(1), key(2)]) == [False, True, True]
        assert p0.stats()["remote_prefetch_dropped"] == 1 and p0.fetched(key(0)) is None
        fetched = p0.fetched(key(2))
        assert fetched is not None and same(fetched[0], make_item(2, 400_000))
    finally:
        p0.close()


def test_a_mooncake_master_missing_os_libraries_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `mmcache simulate --remote mooncake://auto` without them showed the loader's "error
    # while loading shared libraries" only, where the client's ImportError names the fix.
    binary = find_mooncake_master()
    if binary is None:
        pytest.skip("no mooncake_master here (the mooncake extra)")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)  # the Makefile's fetched copies
    loads = subprocess.run([binary, "--help"], capture_output=True, text=True, check=False)
    if "error while loading shared libraries" not in loads.stderr:
        pytest.skip("the OS has Mooncake's libraries")
    with pytest.raises(ServerUnavailable, match=r"apt-get install libibverbs1 libnuma1 libcurl4"):
        start_mooncake_master()
