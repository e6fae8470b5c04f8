"""Redis / Valkey backend: the official client (redis-py), automatic retries off.

A value of at most :data:`CHUNK_BYTES` is one key.  A larger one is its envelope header plus a
payload split into chunk keys written first, then a small *manifest* under the item's key
naming them and holding the header (``SET NX``: the first writer wins, and a reader never sees
a manifest before its chunks).  Chunk keys carry the writer's random nonce, so two hosts
putting one item at once never mix their chunks; the loser deletes its own.  Each chunk is one
part of the envelope's digest (see :mod:`.envelope`).  Chunks and manifest are written to live
:data:`UPLOAD_LEASE_MS` and given the value's lifetime in one transaction once the manifest
won, so a put cut short leaves nothing behind for long.

A reader fetches the manifests (and small values) of a whole batch in one round trip - a
``GETRANGE`` of each key that reads at most the largest value it accepts, so a plain value
over the bound is :data:`~.backend.TOO_LARGE` without being read whole - and the chunks of
the batch with an ``MGET`` (split over :data:`FETCH_CONNECTIONS` connections at once where
a fetch thread is free, else - another call using it, or the URL's ``max_connections``
capping the pool - on one), whose reply it reads off the
socket itself: each chunk goes straight into one buffer allocated for the whole value - no
copy in the client's parser, no join - and is hashed as soon as it is in, while the server
is still sending the next.  A value missing any chunk (evicted by
``maxmemory``, deleted, expired) is :data:`~.backend.INCOMPLETE`, a miss, and its manifest is
deleted (if unchanged) so that the item can be put again.

Claims (:class:`~.backend.ClaimingBackend`) are keys beside the item's (``<key>/claim``)
holding the claiming host's id with a ``PX`` expiry, so a host that dies holding one frees it
when it lapses.  A claiming read sends one ``EVAL`` (look at each item key, read its claim,
take it where asked and free: atomically) in the same pipeline as the ``GETRANGE`` reads, ahead
of them; a release is one ``EVAL`` that compares each claim with the owner before deleting
it, so a host never deletes a claim that lapsed and another host took since (a ``GET`` then
``DEL`` could; ``WATCH`` would cost a round trip per key).  Scripting is in every Redis
since 2.6 and every Valkey; where the server refuses it (an ACL without ``@scripting``, a
renamed ``EVAL``), a lookup is answered without claims and a release is a refused write.

With retries on, redis-py retries a failed command three times with backoff, so a dead server
costs seconds per call; here retries are off and every call ends by its deadline as a whole:
the connections' sockets (:class:`_DeadlineSocket`) bound each connect, send and receive by
what is left of the deadline of the call the thread is making, so neither a stalled server
nor one that sends its reply a byte at a time holds a call longer; a call finding every
connection of the pool taken waits for one by the same deadline (:class:`_WaitingPool`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - the remote and test extras install it
    hint = "redis:// and valkey:// need: pip install 'mmcache[remote]'"
    raise ImportError(f"{hint} ({exc})") from exc

from mmcache.remote.backend import (
    INCOMPLETE,
    MAX_OWNER_BYTES,
    OTHER_VERSION,
    TOO_LARGE,
    Fetched,
    Received,
    RemoteTimeout,
    RemoteUnreachable,
    TooLarge,
    WriteRefused,
    redact_url,
)
from mmcache.remote.envelope import (
    HEADER_SIZE,
    MAGIC,
    MIN_PART_BYTES,
    SCHEMA_VERSION,
    PartDigests,
    part_hasher,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CHUNK_BYTES", "RedisBackend", "claim_key"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Values larger than this are split into chunks of this size (the URL's ``chunk_kb`` query
parameter sets another, e.g. for a proxy that limits value sizes)."""

FETCH_CONNECTIONS = 2
"""Connections that fetch a batch's chunks at once (a Redis/Valkey server writes a large reply
64 KiB per event-loop turn and client)."""

_MANIFEST = struct.Struct("<4s16sIIQ")  # magic, writer nonce, chunk count, chunk size, total
_MANIFEST_MAGIC = b"MMCK"  # ... then the envelope header
_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
_MAX_LINE = 1 << 16  # a reply's type line (an error message at most)
_LINE_READ = 64  # bytes asked for when a type line is next (the rest goes straight in place)
_SKIP_READ = 1 << 16  # bytes read at a time from a chunk of the wrong length, to drop them
UPLOAD_LEASE_MS = 60_000
"""How long a chunked value's keys live until its put completes: a put cut short (its
deadline, a lost connection) leaves nothing that outlives this; a complete one then gives them
the value's own lifetime in one transaction."""


def chunk_key(key: str, nonce: bytes, index: int) -> str:
    """The key of chunk ``index`` of ``key``'s value written by the writer ``nonce``."""
    return f"{key}/chunk/{nonce.hex()}/{index}"


def claim_key(key: str) -> str:
    """The key of the claim on ``key``'s item (its value: the claiming host's id)."""
    return f"{key}/claim"


# A claim key's holder, or "" where it holds none: a key of another type (garbage, never a
# claim) is read as no claim rather than failing the whole script - and with it the lookup of
# every item in the batch, counted as the store failing until its breaker opens.  So is a
# string without an expiry: every claim is taken with one (PX), so that a dead host's lapses;
# one that never lapses would hold every host's lookups of the item to the end of their
# waits, for as long as it stays.  A holder is a host's short id: at most the first
# MAX_OWNER_BYTES of a claim are read, so one holding megabytes (garbage) is not sent whole
# to every lookup (it stays another's claim, until it lapses).
_CLAIM_HOLDER = f"""
local function holder_of(key)
  local holder = redis.pcall("GET", key)
  if type(holder) ~= "string" or redis.call("PTTL", key) < 0 then
    return ""
  end
  return string.sub(holder, 1, {MAX_OWNER_BYTES})
end
"""

# KEYS: n item keys, then their n claim keys; ARGV: owner, ttl in ms, take (1 or 0).  For
# each item key that holds no value: the claim's holder, after claiming it for the owner when
# asked, nobody holds it and no key before it is held by another; "" for an item present, or
# unclaimed.  Atomic, so two hosts never both take one claim, and no claim is taken on an
# item already present.  A claim key of another type, or without an expiry, is taken over
# (SET replaces it).  All or nothing: Redis and Valkey refuse a script's write (full,
# read-only, a disk error) only before its first one, so a refused script took no claim.
_CLAIM_SCRIPT = (
    _CLAIM_HOLDER
    + """
local n = #KEYS / 2
local holders = {}
local blocked = false
for i = 1, n do
  local holder = ""
  if redis.call("EXISTS", KEYS[i]) == 0 then
    holder = holder_of(KEYS[n + i])
    if holder == "" then
      if ARGV[3] == "1" and not blocked then
        redis.call("SET", KEYS[n + i], ARGV[1], "PX", ARGV[2])
        holder = ARGV[1]
      end
    elseif holder ~= ARGV[1] then
      blocked = true
    end
  end
  holders[i] = holder
end
return holders
"""
)

# KEYS: claim keys; ARGV[1]: owner.  Compare-and-delete: drops each claim the owner holds,
# never one that lapsed and another host took since (nor a key of another type); how many it
# dropped.
_RELEASE_SCRIPT = (
    _CLAIM_HOLDER
    + """
local dropped = 0
for i = 1, #KEYS do
  if holder_of(KEYS[i]) == ARGV[1] then
    dropped = dropped + redis.call("DEL", KEYS[i])
  end
end
return dropped
"""
)

# KEYS: keys of broken values; ARGV: each one's value as read.  Deletes those still holding
# exactly that value (a manifest whose chunks are gone, say), so that the next put of the
# item is not refused as present.
_DROP_SCRIPT = """
local dropped = 0
for i = 1, #KEYS do
  if redis.call("GET", KEYS[i]) == ARGV[i] then
    dropped = dropped + redis.call("DEL", KEYS[i])
  end
end
return dropped
"""

_call_deadline = threading.local()


@contextlib.contextmanager
def _bounded_by(deadline: float) -> Iterator[None]:
    """Bound every socket operation this thread makes meanwhile by ``deadline`` (a
    :func:`time.monotonic` instant; see :class:`_DeadlineSocket`)."""
    outer = getattr(_call_deadline, "at", None)
    _call_deadline.at = deadline
    try:
        yield
    finally:
        _call_deadline.at = outer


class _DeadlineSocket:
    """A connection's socket (plain or TLS) whose every send and receive also ends by the
    deadline of the call the current thread is making (:func:`_bounded_by`), so a call ends
    by its deadline as a whole: a socket timeout alone bounds each receive, and a server
    that sends its reply a byte at a time could stretch a call without end.  Everything
    else is the socket's own."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _bound(self) -> None:
        deadline = getattr(_call_deadline, "at", None)
        if deadline is None:
            self._sock.settimeout(self._timeout)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))

    def recv(self, *args: Any) -> bytes:
        self._bound()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self._bound()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> int:
        self._bound()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> None:
        self._bound()
        self._sock.sendall(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _BoundedConnect:
    """For a redis-py connection class: its socket is a :class:`_DeadlineSocket`, and its
    TCP connect (and each step of a TLS handshake, where the URL asks for TLS) is bounded by
    what is left of the call's deadline; the handshake's commands go through the socket."""

    socket_timeout: float | None
    socket_connect_timeout: float | None

    def _connect(self) -> _DeadlineSocket:
        configured = self.socket_timeout, self.socket_connect_timeout
        deadline = getattr(_call_deadline, "at", None)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the call's deadline passed before connecting")
            self.socket_timeout, self.socket_connect_timeout = (
                left if limit is None else min(limit, left) for limit in configured
            )
        try:
            sock = _DeadlineSocket(super()._connect())  # type: ignore[misc]
        finally:
            self.socket_timeout, self.socket_connect_timeout = configured
        sock.settimeout(configured[0])
        return sock


class _Connection(_BoundedConnect, redis.connection.Connection):
    pass


class _TLSConnection(_BoundedConnect, redis.connection.SSLConnection):
    pass


class _WaitingPool(redis.BlockingConnectionPool):
    """A pool of at most ``max_connections`` whose caller, every one taken, waits for one to
    come free until its call's deadline (:func:`_bounded_by`); one that does not is a
    timeout, not the store unreachable.  (Every call runs under a deadline; outside one, the
    pool's own ``timeout``.)"""

    @property
    def timeout(self) -> float | None:
        deadline = getattr(_call_deadline, "at", None)
        return self._wait_s if deadline is None else max(0.0, deadline - time.monotonic())

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._wait_s = seconds

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except redis.exceptions.ConnectionError:
            if self.timeout == 0:
                raise redis.exceptions.TimeoutError(
                    "no connection of the pool came free by the call's deadline"
                ) from None
            raise


class _ReplyReader:
    """The reply to one ``MGET`` read off a socket, each value into a buffer of the caller's
    (RESP2 or RESP3); every receive ends by the call's deadline (:class:`_DeadlineSocket`)."""

    def __init__(self, sock: _DeadlineSocket) -> None:
        self._sock = sock
        self._pending = bytearray()  # received, not consumed yet

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self._sock.recv_into(view)
        except TimeoutError as exc:
            raise RemoteTimeout(f"reading chunks: {exc}") from exc
        except OSError as exc:
            raise RemoteUnreachable(f"reading chunks: {exc}") from exc
        if n == 0:
            raise RemoteUnreachable("the server closed the connection while sending chunks")
        return n

    def line(self) -> bytes:
        """The next ``\\r\\n``-terminated line, without its terminator."""
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > _MAX_LINE:
                raise redis.exceptions.InvalidResponse("a reply line without an end")
            more = bytearray(_LINE_READ)
            self._pending += more[: self._recv_into(memoryview(more))]
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def into(self, view: memoryview) -> bytes:
        """Fill ``view`` with the next bytes of the reply, hashing each piece as it comes in
        (while the server sends the next); the part digest of the whole."""
        hasher = part_hasher()
        got = min(len(self._pending), view.nbytes)
        view[:got] = self._pending[:got]
        del self._pending[:got]
        hasher.update(view[:got])
        while got < view.nbytes:
            n = self._recv_into(view[got:])
            hasher.update(view[got : got + n])
            got += n
        return hasher.digest()

    def skip(self, n: int) -> None:
        """Drop the next ``n`` bytes of the reply."""
        dropped = min(len(self._pending), n)
        del self._pending[:dropped]
        scratch = memoryview(bytearray(min(n - dropped, _SKIP_READ)))
        while dropped < n:
            dropped += self._recv_into(scratch[: n - dropped])

    def values_into(self, views: Sequence[memoryview]) -> list[bytes | None]:
        """Read an ``MGET`` reply of ``len(views)`` values: each one of exactly its view's
        length goes into the view and is hashed there (:func:`~.envelope.part_hasher`);
        ``None`` for one that is absent, of another type or of another length."""
        head = self.line()
        if head[:1] == b"-":
            raise redis.exceptions.ResponseError(head[1:].decode(errors="replace"))
        if head != b"*%d" % len(views):
            raise redis.exceptions.InvalidResponse(f"expected {len(views)} values, got {head!r}")
        digests: list[bytes | None] = []
        for view in views:
            line = self.line()
            if line in (b"$-1", b"_"):  # nil (RESP2, RESP3)
                digests.append(None)
                continue
            try:
                n = int(line[1:]) if line[:1] == b"$" else -1
            except ValueError:
                n = -1
            if n < 0:
                raise redis.exceptions.InvalidResponse(f"expected a bulk string, got {line!r}")
            if n == view.nbytes:
                digests.append(self.into(view))
            else:
                self.skip(n)
                digests.append(None)
            if self.line():
                raise redis.exceptions.InvalidResponse("a bulk string longer than it said")
        return digests


class RedisBackend:
    """A Redis or Valkey server at ``url`` (``redis://``, ``rediss://``, ``valkey://``,
    ``valkeys://``; ``user:password@``, ``/db`` and query options as redis-py reads them:
    one it does not take, or ``decode_responses``, is a ``ValueError`` here, not a failure
    of every call).  A value over ``max_value_bytes`` of payload (plain, or as a manifest
    announces it) is :data:`~.backend.TOO_LARGE`, never an allocation."""

    def __init__(
        self, url: str, *, timeout_s: float, ttl_s: float | None = None, max_value_bytes: int
    ) -> None:
        parts = urlsplit(url)
        scheme = _SCHEMES.get(parts.scheme)
        if scheme is None or not parts.hostname:
            raise ValueError(
                f"not a Redis/Valkey URL: {redact_url(url)!r} (expected redis://HOST:PORT or "
                "valkey://HOST:PORT)"
            )
        if "@" in url.partition("://")[2] and "@" not in parts.netloc:
            # The userinfo holds a '/', '?' or '#': parsed, the password would pass for a
            # host, a port or a path (and reach an error message).
            raise ValueError(
                f"the user:password of {redact_url(url)!r} holds '/', '?' or '#': "
                "percent-encode them (urllib.parse.quote(password, safe=''))"
            )
        query = parse_qs(parts.query, keep_blank_values=True)
        chunk_kb = query.pop("chunk_kb", [str(CHUNK_BYTES >> 10)])[-1]
        try:
            self._chunk = int(chunk_kb) << 10
        except ValueError:
            self._chunk = 0
        if not MIN_PART_BYTES <= self._chunk <= 512 << 20:
            raise ValueError(
                f"chunk_kb must be a whole number from 1 to 524288 in {redact_url(url)!r}"
            )
        # redis-py hands on every query option it does not parse itself, as a string, to
        # each connection it makes: a typo fails every call (a TypeError, counted as the
        # store failing until the breaker opens), and decode_responses (any value: a string
        # is true) turns the values into text.  Refused here, by name (a value may be a
        # password).
        if "decode_responses" in query:
            raise ValueError(
                f"decode_responses in {redact_url(url)!r}: the remote tier reads raw bytes; "
                "drop the option"
            )
        self.part_bytes = self._chunk
        self.claims_refused = 0
        """Claiming reads answered without claims: the server refused the claim script."""
        self._refusals_lock = threading.Lock()
        self._shown_url = redact_url(url)
        self._max_value = max_value_bytes
        # The most a key's first read takes: the largest plain value accepted (a manifest
        # is smaller); one byte more says a value is over it.
        self._max_plain = HEADER_SIZE + max_value_bytes
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._fetchers = ThreadPoolExecutor(FETCH_CONNECTIONS - 1, "mmcache-redis-fetch")
        # The fetch threads no call is using: a call takes one only where it is free, so no
        # call's share waits behind another's (see _fetch).
        self._idle_fetchers = threading.BoundedSemaphore(FETCH_CONNECTIONS - 1)
        # A caller waits for a connection, within its deadline, where every one of the pool
        # is taken (the URL's max_connections, or redis-py's default cap of 100: None):
        # redis-py's own pool refuses it at once ("Too many connections", counted as the
        # store unreachable).
        cap = query.get("max_connections", ["0"])[-1]
        capped = cap.isdigit() and int(cap) > 0  # 0 is no cap of the URL's, as redis-py reads it
        self._client = redis.Redis(
            connection_pool=_WaitingPool.from_url(
                urlunsplit(parts._replace(scheme=scheme, query=urlencode(query, doseq=True))),
                max_connections=None,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                connection_class=_TLSConnection if scheme == "rediss" else _Connection,
            )
        )
        self._client.auto_close_connection_pool = True
        # A call holding one connection of a capped pool while its fetch thread waits for
        # another could wait in a circle with a second call doing the same: one each.
        self._fetch_connections = 1 if capped else FETCH_CONNECTIONS
        pool = self._client.connection_pool
        try:  # a connection object, never connected: whether redis-py takes every option
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError, redis.exceptions.RedisError) as exc:
            self._client.close()
            self._fetchers.shutdown(wait=False)
            raise ValueError(f"redis-py refuses an option of {redact_url(url)!r} ({exc})") from None

    def exists(self, keys: Sequence[str], deadline: float) -> list[bool]:
        # STRLEN, not EXISTS: a key of another type (a list, a hash: never a value of ours,
        # a miss to a get) answers -WRONGTYPE, so it is absent here too, not "present".
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        with _bounded_by(deadline):
            replies = self._call(pipe.execute, raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
                raise reply
        return [isinstance(n, int) and n > 0 for n in replies]

    def read(self, keys: Sequence[str], deadline: float) -> list[Fetched]:
        with _bounded_by(deadline):
            heads, _ = self._heads(keys)
            return self._read(keys, heads, deadline)

    def read_claiming(
        self, keys: Sequence[str], owner: str, take: bool, ttl_ms: int, deadline: float
    ) -> tuple[list[Fetched], list[str | None]]:
        with _bounded_by(deadline):
            heads, holders = self._heads(keys, (owner, take, ttl_ms))
            return self._read(keys, heads, deadline), holders

    def release_claims(self, keys: Sequence[str], owner: str, deadline: float) -> int:
        claims = [claim_key(key) for key in keys]
        with _bounded_by(deadline):
            try:
                return int(
                    self._call(self._client.eval, _RELEASE_SCRIPT, len(claims), *claims, owner)
                )
            except redis.exceptions.ResponseError as exc:  # scripting off, say: it answered
                raise WriteRefused(str(exc)) from exc

    def _read(
        self, keys: Sequence[str], heads: list[bytes | TooLarge | None], deadline: float
    ) -> list[Fetched]:
        out: list[Fetched] = []
        # The chunked values: position -> (the value's buffer, chunk size, chunk digests).
        values: dict[int, tuple[np.ndarray[Any, Any], int, list[bytes]]] = {}
        wanted: list[tuple[int, str, memoryview]] = []  # (position, chunk key, where it goes)
        for position, (key, head) in enumerate(zip(keys, heads, strict=True)):
            out.append(head)
            if not isinstance(head, bytes) or not head.startswith(_MANIFEST_MAGIC):
                continue
            # Another version's manifest (schema 1's ended with the manifest, its chunks held
            # the whole envelope) is a version mismatch, and stays for the hosts that read
            # it: neither fetched nor deleted as a broken value.
            header = head[_MANIFEST.size :]
            if len(head) == _MANIFEST.size or (
                len(header) == HEADER_SIZE
                and header[:4] == MAGIC
                and int.from_bytes(header[4:6], "little") != SCHEMA_VERSION
            ):
                out[position] = OTHER_VERSION
                continue
            # Exactly a manifest and an envelope header, so that the chunks' part digests are
            # of the bytes the envelope calls its payload; a torn manifest is a broken value.
            if len(head) != _MANIFEST.size + HEADER_SIZE:
                out[position] = INCOMPLETE
                continue
            _, nonce, count, size, total = _MANIFEST.unpack_from(head)
            if total > self._max_value:
                out[position] = TOO_LARGE
                continue
            if size < MIN_PART_BYTES or total == 0 or count != -(-total // size):
                out[position] = INCOMPLETE
                continue
            # The whole value in one buffer of its own (the item will view it in place).
            buffer = np.empty(len(header) + total, np.uint8)
            buffer[: len(header)] = np.frombuffer(header, np.uint8)
            payload = buffer[len(header) :].data
            values[position] = (buffer, size, [])
            wanted += [
                (position, chunk_key(key, nonce, i), payload[i * size : (i + 1) * size])
                for i in range(count)
            ]
        if wanted:
            digests = self._fetch([w[1] for w in wanted], [w[2] for w in wanted], deadline)
            for (position, _, _), digest in zip(wanted, digests, strict=True):
                if position not in values:
                    continue  # already found incomplete
                if digest is None:
                    del values[position]
                    out[position] = INCOMPLETE
                else:
                    values[position][2].append(digest)
            for position, (buffer, size, chunk_digests) in values.items():
                out[position] = Received(buffer.data, PartDigests(size, chunk_digests))
        # A torn manifest is dropped too, whether or not the batch had chunks to fetch.
        broken = zip(keys, heads, out, strict=True)
        self._drop_broken([(key, head) for key, head, got in broken if got is INCOMPLETE])
        return out

    def _drop_broken(self, broken: list[tuple[str, bytes | TooLarge | None]]) -> None:
        """Delete the manifests read from ``broken`` keys (their chunks gone: evicted, or
        flushed) if they still hold what was read, so the item can be put again; best effort
        (a failure leaves it to the next reader)."""
        if not broken:
            return
        try:
            self._call(
                self._client.eval,
                _DROP_SCRIPT,
                len(broken),
                *(key for key, _ in broken),
                *(head for _, head in broken),
            )
        except Exception:  # a read's outcome does not depend on it
            logger.debug("could not drop %d broken remote values", len(broken), exc_info=True)

    def _heads(
        self, keys: Sequence[str], claim: tuple[str, bool, int] | None = None
    ) -> tuple[list[bytes | TooLarge | None], list[str | None]]:
        """Each key's value, or the start of it: a manifest, a plain value, ``None`` (absent,
        or not a string) or :data:`~.backend.TOO_LARGE` (at most one byte over the largest
        plain value accepted was read); with ``claim`` (owner, take, ttl in ms), first, in the
        same round trip, each absent key's claim holder (see :data:`_CLAIM_SCRIPT`)."""
        pipe = self._client.pipeline(transaction=False)
        if claim is not None:
            owner, take, ttl_ms = claim
            claims = [claim_key(key) for key in keys]
            pipe.eval(_CLAIM_SCRIPT, 2 * len(keys), *keys, *claims, owner, ttl_ms, int(take))
        for key in keys:
            pipe.getrange(key, 0, self._max_plain)
        replies = self._call(pipe.execute, raise_on_error=False)
        holders: list[str | None] = []
        if claim is not None:
            held = replies.pop(0)
            if isinstance(held, redis.exceptions.ResponseError):
                # The script refused (its SET on a full server, a read-only replica, scripting
                # off): this lookup answers its reads without claims, and the store is up.
                # The next lookup sends it again, no back-off: it rides in the lookup's round
                # trip (as cheap refused as taken), and a server with room again, or
                # promoted, then takes claims at once.
                self._refuse_claims(held)
                held = [None] * len(keys)
            holders = [h.decode(errors="replace") if h else None for h in held]
        heads: list[bytes | TooLarge | None] = []
        for head in replies:
            if isinstance(head, redis.exceptions.ResponseError):
                if not str(head).startswith("WRONGTYPE"):
                    raise head
                head = None  # noqa: PLW2901 - a key of another type holds no value of ours
            # GETRANGE reads an absent key as empty; no value of ours is.
            heads.append(TOO_LARGE if len(head or b"") > self._max_plain else head or None)
        return heads, holders

    def _refuse_claims(self, reply: redis.exceptions.ResponseError) -> None:
        """Count a claiming read the server answered without claims; log the first."""
        with self._refusals_lock:
            self.claims_refused += 1
            first = self.claims_refused == 1
        if first:
            logger.warning(
                "remote tier %s refuses the claim script (%s): lookups go on without claims "
                "(no single flight across hosts) while it does; counted in "
                "RemoteStore.stats()['claims_refused'], not logged again",
                self._shown_url,
                reply,
            )

    def _fetch(
        self, names: list[str], views: list[memoryview], deadline: float
    ) -> list[bytes | None]:
        """The chunks ``names`` read into ``views``, split over this thread and the fetch
        threads no other call is using (this thread reads the first share); each one's
        digest, or ``None`` where it is missing.  A pool the URL's ``max_connections`` caps
        has them read on one connection."""
        # Only a free fetch thread: one shared by every call would queue each call's share
        # behind the others' (a hundred large reads at once: most of them timeouts).
        helpers = 0
        while helpers < min(self._fetch_connections, len(names)) - 1:
            if not self._idle_fetchers.acquire(blocking=False):
                break
            helpers += 1
        step = -(-len(names) // (helpers + 1))
        shares = [slice(i, i + step) for i in range(step, len(names), step)]
        for _ in range(helpers - len(shares)):  # fewer shares than threads taken
            self._idle_fetchers.release()
        futures = []
        for share in shares:
            future = self._fetchers.submit(self._fetch_share, names[share], views[share], deadline)
            # Free once the share ended or was cancelled (whenever its caller stopped waiting).
            future.add_done_callback(lambda _: self._idle_fetchers.release())
            futures.append(future)
        first = self._fetch_share(names[:step], views[:step], deadline)
        try:
            # Bounded too: a share queued behind another call's would end by that call's
            # deadline, not this one's.
            rest = [
                future.result(timeout=max(0.0, deadline - time.monotonic())) for future in futures
            ]
        except FutureTimeout as exc:
            for future in futures:
                future.cancel()
            raise RemoteTimeout("the chunks' fetch ran past the deadline") from exc
        return first + [digest for share in rest for digest in share]

    def _fetch_share(
        self, names: list[str], views: list[memoryview], deadline: float
    ) -> list[bytes | None]:
        """One ``MGET`` of ``names`` on a connection of the pool, its reply read straight into
        ``views``.  A connection whose reply was not read to the end is closed, never reused."""
        pool = self._client.connection_pool
        with _bounded_by(deadline):
            connection = self._call(pool.get_connection)
            try:
                self._call(connection.send_packed_command, connection.pack_command("MGET", *names))
                # redis-py's parser would copy each value twice; this reads the socket itself.
                return _ReplyReader(connection._sock).values_into(views)
            except BaseException:
                connection.disconnect()
                raise
            finally:
                pool.release(connection)

    def write(self, key: str, header: bytes, payload: Buffer, deadline: float) -> bool:
        with _bounded_by(deadline):
            try:
                return self._write(key, header, memoryview(payload).cast("B"))
            except redis.exceptions.ResponseError as exc:  # -OOM, -READONLY, ...: it answered
                raise WriteRefused(str(exc)) from exc

    def _write(self, key: str, header: bytes, body: memoryview) -> bool:
        if len(header) + body.nbytes <= self._chunk:
            return bool(self._call(self._client.set, key, header + body, nx=True, px=self._ttl_ms))
        if self._call(self._client.exists, key):
            return False  # put-if-absent: do not upload chunks nobody will read
        nonce = os.urandom(16)
        names: list[str] = []
        # Every key lives only the upload's lease until the put completes (a put cut short
        # leaves nothing behind for longer), unless the value's own lifetime is shorter.
        leased = self._ttl_ms is None or self._ttl_ms > UPLOAD_LEASE_MS
        px = UPLOAD_LEASE_MS if leased else self._ttl_ms
        pipe = self._client.pipeline(transaction=False)
        for start in range(0, body.nbytes, self._chunk):
            names.append(chunk_key(key, nonce, len(names)))
            pipe.set(names[-1], body[start : start + self._chunk], px=px)
        self._call(pipe.execute)
        manifest = _MANIFEST.pack(_MANIFEST_MAGIC, nonce, len(names), self._chunk, body.nbytes)
        if not self._call(self._client.set, key, manifest + header, nx=True, px=px):
            self._call(self._client.delete, *names)  # another writer won: drop our chunks
            return False
        if leased:
            # The value's lifetime for all its keys at once (a transaction): all of them, or
            # none, and then all go when the lease ends.
            pipe = self._client.pipeline(transaction=True)
            for name in (*names, key):
                if self._ttl_ms is None:
                    pipe.persist(name)
                else:
                    pipe.pexpire(name, self._ttl_ms)
            self._call(pipe.execute)
        return True

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
