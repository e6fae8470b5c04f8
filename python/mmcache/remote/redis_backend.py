"""Redis / Valkey backend: the official client (redis-py), automatic retries off.

A value of at most :data:`CHUNK_BYTES` is one key.  A larger one is split into chunk keys
written first, then a small *manifest* under the item's key naming them (``SET NX``: the first
writer wins, and a reader never sees a manifest before its chunks).  Chunk keys carry the
writer's random nonce, so two hosts putting one item at once never mix their chunks; the
loser deletes its own.  A reader fetches the manifests (and small values) of a whole batch in
one ``MGET`` and the chunks of the batch in a second round trip, split over
:data:`FETCH_CONNECTIONS` connections at once (a Redis/Valkey server writes a large reply 64 KiB
per event-loop turn and client, so one connection gets about half of what loopback TCP
carries); a value missing any chunk (evicted by ``maxmemory``, deleted, expired) is
:data:`~.backend.INCOMPLETE`, a miss.

With retries on, redis-py retries a failed command three times with backoff, so a dead server
costs seconds per call; here every socket operation is bounded by the store's ``timeout_s``
and fails once.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - the remote and test extras install it
    hint = "redis:// and valkey:// need: pip install 'mmcache[remote]'"
    raise ImportError(f"{hint} ({exc})") from exc

from mmcache.remote.backend import (
    INCOMPLETE,
    Incomplete,
    RemoteTimeout,
    RemoteUnreachable,
    check_deadline,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CHUNK_BYTES", "RedisBackend"]

CHUNK_BYTES = 1 << 20
"""Values larger than this are split into chunks of this size (the URL's ``chunk_kb`` query
parameter sets another, e.g. for a proxy that limits value sizes)."""

FETCH_CONNECTIONS = 2
"""Connections that fetch a batch's chunks at once."""

_MANIFEST = struct.Struct("<4s16sIIQ")  # magic, writer nonce, chunk count, chunk size, total
_MANIFEST_MAGIC = b"MMCK"
_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


def chunk_key(key: str, nonce: bytes, index: int) -> str:
    """The key of chunk ``index`` of ``key``'s value written by the writer ``nonce``."""
    return f"{key}/chunk/{nonce.hex()}/{index}"


def _chunks(header: bytes, payload: memoryview, size: int) -> Iterator[bytes | memoryview]:
    """``header + payload`` in pieces of ``size`` bytes, copying only the first."""
    first = size - len(header)
    yield header + payload[:first]
    for start in range(first, payload.nbytes, size):
        yield payload[start : start + size]


class RedisBackend:
    """A Redis or Valkey server at ``url`` (``redis://``, ``rediss://``, ``valkey://``,
    ``valkeys://``; ``user:password@``, ``/db`` and query options as redis-py reads them)."""

    def __init__(self, url: str, *, timeout_s: float, ttl_s: float | None = None) -> None:
        parts = urlsplit(url)
        scheme = _SCHEMES.get(parts.scheme)
        if scheme is None or not parts.hostname:
            raise ValueError(
                f"not a Redis/Valkey URL: {url!r} (expected redis://HOST:PORT or valkey://HOST:PORT)"
            )
        query = parse_qs(parts.query, keep_blank_values=True)
        chunk_kb = query.pop("chunk_kb", [str(CHUNK_BYTES >> 10)])[-1]
        try:
            self._chunk = int(chunk_kb) << 10
        except ValueError:
            self._chunk = 0
        if not 1 << 10 <= self._chunk <= 512 << 20:
            raise ValueError(f"chunk_kb must be a whole number from 1 to 524288 in {url!r}")
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._fetchers = ThreadPoolExecutor(FETCH_CONNECTIONS, "mmcache-redis-fetch")
        self._client = redis.Redis.from_url(
            urlunsplit(parts._replace(scheme=scheme, query=urlencode(query, doseq=True))),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def exists(self, keys: Sequence[str], deadline: float) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in self._call(pipe.execute)]

    def read(self, keys: Sequence[str], deadline: float) -> list[Buffer | Incomplete | None]:
        heads: list[bytes | None] = self._call(self._client.mget, list(keys))
        out: list[Buffer | Incomplete | None] = list(heads)
        # (position, chunk key, offset in the value, chunk size)
        wanted: list[tuple[int, str, int, int]] = []
        sizes: dict[int, int] = {}
        for position, (key, head) in enumerate(zip(keys, heads, strict=True)):
            if head is None or not head.startswith(_MANIFEST_MAGIC):
                continue
            if len(head) != _MANIFEST.size:
                out[position] = INCOMPLETE  # a torn manifest reads as a broken value
                continue
            _, nonce, count, size, total = _MANIFEST.unpack(head)
            if size == 0 or count != -(-total // size):
                out[position] = INCOMPLETE
                continue
            sizes[position] = total
            wanted += [(position, chunk_key(key, nonce, i), i * size, size) for i in range(count)]
        if not wanted:
            return out
        check_deadline(deadline, "reading chunks")
        chunks = self._fetch([w[1] for w in wanted])
        parts: dict[int, list[bytes]] = {position: [] for position in sizes}
        for (position, _, offset, size), chunk in zip(wanted, chunks, strict=True):
            pieces = parts.get(position)
            if pieces is None:
                continue  # already found incomplete
            if chunk is None or len(chunk) != min(size, sizes[position] - offset):
                del parts[position]
                out[position] = INCOMPLETE
            else:
                pieces.append(chunk)
        for position, pieces in parts.items():
            # One copy into a buffer of our own (writable: the item may view it in place).
            out[position] = bytearray().join(pieces)
        return out

    def _fetch(self, names: list[str]) -> list[bytes | None]:
        """``MGET`` of ``names``, split over the fetch connections when there are several."""
        if len(names) < 2:
            return list(self._call(self._client.mget, names))
        step = -(-len(names) // FETCH_CONNECTIONS)
        parts = [names[i : i + step] for i in range(0, len(names), step)]
        futures = [self._fetchers.submit(self._call, self._client.mget, part) for part in parts]
        return [value for future in futures for value in future.result()]

    def write(self, key: str, header: bytes, payload: Buffer, deadline: float) -> bool:
        body = memoryview(payload).cast("B")
        total = len(header) + body.nbytes
        if total <= self._chunk:
            return bool(self._call(self._client.set, key, header + body, nx=True, px=self._ttl_ms))
        if self._call(self._client.exists, key):
            return False  # put-if-absent: do not upload chunks nobody will read
        nonce = os.urandom(16)
        names = []
        pipe = self._client.pipeline(transaction=False)
        for index, chunk in enumerate(_chunks(header, body, self._chunk)):
            names.append(chunk_key(key, nonce, index))
            pipe.set(names[-1], chunk, px=self._ttl_ms)
        check_deadline(deadline, "writing chunks")
        self._call(pipe.execute)
        check_deadline(deadline, "writing the manifest")
        manifest = _MANIFEST.pack(_MANIFEST_MAGIC, nonce, len(names), self._chunk, total)
        if self._call(self._client.set, key, manifest, nx=True, px=self._ttl_ms):
            return True
        self._call(self._client.delete, *names)  # another writer won: drop our chunks
        return False

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    @staticmethod
    def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` with the client's transport errors as ours."""
        try:
            return function(*args, **kwargs)
        except redis.exceptions.TimeoutError as exc:
            raise RemoteTimeout(str(exc)) from exc
        except redis.exceptions.ConnectionError as exc:
            raise RemoteUnreachable(str(exc)) from exc
