"""``RemoteStore``: items shared between hosts through an existing distributed store.

Everything that can go wrong on the way to or from the store is a miss, never an exception
into the engine: a timeout, a refused or reset connection, a value that is corrupt,
truncated, missing a chunk, larger than the reader accepts, written by another schema
version, whose digest does not verify (tampered, or sealed with another secret), or that
verifies but does not decode.  On the way in, an item the codec cannot encode is skipped.
Each is counted in :meth:`RemoteStore.stats` and the first of each kind is logged through the
``mmcache`` logger - with the store's URL stripped of credentials, the only form of it this
module keeps.  A circuit breaker stops calling a store that keeps failing
(``breaker_failures`` transport failures in a row), so a dead server costs nothing per
request; after ``breaker_cooldown_s`` one call probes it, and a success closes the breaker
again (each failed probe doubles the wait, up to 30 s; a probe that ends without reaching the
store lets the next call probe).
"""

from __future__ import annotations

import logging
import numbers
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np

from mmcache import serde
from mmcache.arguments import flag
from mmcache.closing import ClosesOnExit
from mmcache.errors import SegmentCorruptError
from mmcache.items import Item
from mmcache.remote.backend import (
    MAX_OWNER_BYTES,
    Backend,
    ClaimingBackend,
    Fetched,
    Incomplete,
    OtherVersion,
    Received,
    RemoteTimeout,
    RemoteUnreachable,
    TooLarge,
    ValueTooLarge,
    WriteRefused,
    redact_url,
)
from mmcache.remote.envelope import (
    CorruptValue,
    DigestMismatch,
    VersionMismatch,
    derive_digest_key,
    open_envelope,
    seal,
)

__all__ = ["CircuitBreaker", "RemoteStore", "check_claim_ttl_s", "is_shareable_key"]

logger = logging.getLogger("mmcache")

_T = TypeVar("_T")
MiB = 1 << 20
_NAMESPACE = re.compile(r"[A-Za-z0-9._:@+=,-][A-Za-z0-9._:@+=,/-]{0,199}")
_CONTENT_KEY = re.compile(r"[A-Za-z0-9._+=-]{32,256}")
_LATENCY_SAMPLES = 100_000

# What each failure is counted as in stats(), and whether it is the store failing (which
# trips the circuit breaker) rather than one bad value.
_TRANSPORT = ("timeouts", "unreachable", "server_errors")


def is_shareable_key(key: object) -> bool:
    """Whether ``key`` can name an item in a store shared between hosts: a full-width
    content hash (at least 32 characters of ``[A-Za-z0-9._+=-]``, e.g. hex), never an
    arbitrary identifier two hosts could use for different items."""
    return isinstance(key, str) and _CONTENT_KEY.fullmatch(key) is not None


def _is_number(value: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_claim_ttl_s(claim_ttl_s: object) -> None:
    """``ValueError`` naming ``claim_ttl_s`` unless a number (not a bool) from 0.001 to 3600:
    a claim that lapses before anyone could wait on it (0 or less would be cut to 1 ms) is
    no claim, and an infinite one no whole milliseconds."""
    if not (_is_number(claim_ttl_s) and 0.001 <= claim_ttl_s <= 3600):  # type: ignore[operator]
        raise ValueError(f"claim_ttl_s must be between 0.001 and 3600 s, not {claim_ttl_s!r}")


def _check_owner(owner: object) -> None:
    if not (isinstance(owner, str) and 0 < len(owner.encode()) <= MAX_OWNER_BYTES):
        raise ValueError(
            f"a claim's owner must be a non-empty str of at most {MAX_OWNER_BYTES} bytes "
            "(a host's id)"
        )


class CircuitBreaker:
    """Closed (calls go through) until ``failures`` failures in a row; then open (calls are
    refused) for ``cooldown_s``; then half-open: one call probes, its success closes the
    breaker, its failure opens it again for twice as long (at most ``max_cooldown_s``), and a
    probe that ends with neither (:meth:`release`) lets the next call probe.  Thread-safe."""

    def __init__(
        self, failures: int = 3, cooldown_s: float = 1.0, max_cooldown_s: float = 30.0
    ) -> None:
        if failures < 1 or not cooldown_s > 0 or not max_cooldown_s >= cooldown_s:
            raise ValueError(
                "a circuit breaker needs failures >= 1 and 0 < cooldown_s <= max_cooldown_s"
            )
        self.failures_to_open = failures
        self._base_cooldown = cooldown_s
        self._max_cooldown = max_cooldown_s
        self._lock = threading.Lock()
        self._failures = 0
        self._cooldown = cooldown_s
        self._open_until: float | None = None
        self._prober: int | None = None  # the thread making the half-open probe
        self.opened = 0  # times the breaker opened

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if time.monotonic() < self._open_until else "half-open"

    def allow(self) -> bool:
        """Whether a call may go to the store now (in half-open state: only one probe, made
        by the calling thread)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._prober is not None or time.monotonic() < self._open_until:
                return False
            self._prober = threading.get_ident()
            return True

    def success(self) -> bool:
        """A call succeeded; whether that closed an open breaker."""
        with self._lock:
            was_open = self._open_until is not None
            self._failures = 0
            self._cooldown = self._base_cooldown
            self._open_until = None
            self._prober = None
            return was_open

    def failure(self) -> bool:
        """A call failed; whether that opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._prober is not None:  # the probe failed: wait longer before the next one
                self._prober = None
                self._cooldown = min(self._cooldown * 2, self._max_cooldown)
                self._open_until = time.monotonic() + self._cooldown
                return False
            if self._open_until is None and self._failures >= self.failures_to_open:
                self._open_until = time.monotonic() + self._cooldown
                self.opened += 1
                return True
            return False

    def release(self) -> None:
        """The calling thread's call ended without telling whether the store works (refused
        before it reached the store, or interrupted): if it was the probe, the next call
        probes instead, so the breaker never stays half-open for good.  A no-op otherwise."""
        with self._lock:
            if self._prober == threading.get_ident():
                self._prober = None


def _open_backend(url: str, timeout_s: float, ttl_s: float | None, max_value: int) -> Backend:
    try:
        scheme = urlsplit(url).scheme
    except ValueError:
        scheme = ""
    if scheme in ("redis", "rediss", "valkey", "valkeys"):
        from mmcache.remote.redis_backend import RedisBackend

        return RedisBackend(url, timeout_s=timeout_s, ttl_s=ttl_s, max_value_bytes=max_value)
    if scheme == "mooncake":
        from mmcache.remote.mooncake_backend import MooncakeBackend

        return MooncakeBackend(url, timeout_s=timeout_s, max_value_bytes=max_value)
    raise ValueError(
        f"unsupported remote store URL {redact_url(url)!r}: expected redis://, rediss://, "
        "valkey://, valkeys:// or mooncake://"
    )


class RemoteStore(ClosesOnExit):
    """Processed items shared by every host that opens the same store with the same
    ``namespace`` (and ``secret``).

    ``url`` picks the backend: ``redis://`` / ``valkey://`` (``rediss://`` / ``valkeys://``
    for TLS) or ``mooncake://`` (see :mod:`mmcache.remote`).  ``namespace`` names what
    produced the items - the model, the processor and their versions, e.g.
    ``"Qwen2-VL-7B@a1b2c3/processor@4.57"`` - and prefixes every key, so two models never share
    an item.  With ``secret`` (shared by every host; a ``str`` or ``bytes``) every value's
    digest is keyed, so a process that can write to the store but does not know the secret
    cannot plant a value that verifies.  Every call ends by its deadline, ``timeout_s`` after
    it starts, as a whole (it makes at most two round trips).  ``ttl_s`` lets values expire
    (Redis/Valkey).  ``max_value_mb`` bounds an item's payload both ways: a larger item is
    not published, and a stored value announced or found larger is a miss before anything
    is allocated for it.  ``url`` may carry credentials (``redis://user:password@host``, a
    ``password=`` option): :attr:`url`, reprs, logs and errors show it without them.

    Keys are content hashes (see :func:`is_shareable_key`); any other key raises
    ``ValueError``.  Thread-safe: P0's request thread reads while its writer thread puts.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        secret: bytes | str | None = None,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        max_value_mb: float = 256,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 1.0,
    ) -> None:
        if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
            raise ValueError(
                f"namespace {namespace!r} must be 1-200 characters of letters, digits and "
                "._:@+=,-/ (e.g. 'model@revision/processor@version')"
            )
        if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= 60):
            raise ValueError(f"timeout_s must be a number of seconds in (0, 60], not {timeout_s!r}")
        # Each checked for a number first: compared as they are, a str would raise "'<' not
        # supported between instances of ...", naming neither the option nor what it takes.
        if ttl_s is not None and not (_is_number(ttl_s) and 0 < ttl_s < 1e9):
            raise ValueError(f"ttl_s must be a positive number of seconds or None, not {ttl_s!r}")
        if not (_is_number(max_value_mb) and 0 < max_value_mb <= 1 << 20):
            raise ValueError(f"max_value_mb must be positive, not {max_value_mb!r}")
        if not (_is_number(breaker_failures) and _is_number(breaker_cooldown_s)):
            raise ValueError(
                f"breaker_failures and breaker_cooldown_s must be numbers, not "
                f"{breaker_failures!r} and {breaker_cooldown_s!r}"
            )
        self.url = redact_url(url)
        """The store's URL without its credentials (the only form of it kept)."""
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self._digest_key = None if secret is None else derive_digest_key(secret)
        self._max_value = int(max_value_mb * MiB)
        self._breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._backend = _open_backend(url, self.timeout_s, ttl_s, self._max_value)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._latency: dict[str, deque[float]] = {
            op: deque(maxlen=_LATENCY_SAMPLES) for op in ("contains", "get", "put", "release")
        }
        self._closed = False
        self._calls = threading.local()  # .failed: whether the thread's latest call failed

    # -- the interface ---------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each key (one round trip for the whole batch; repeated
        keys are asked once).  A failure answers ``False`` for every key."""
        unique = self._unique(keys)
        found = self._call("contains", lambda deadline: self._backend.exists(unique, deadline))
        if found is None:
            return [False] * len(keys)
        self._count(contains_keys=len(unique), contains_found=sum(found))
        by_key = dict(zip(unique, found, strict=True))
        return [by_key[self._store_key(k)] for k in keys]

    def get(self, key: str) -> Item | None:
        """The item stored under ``key``, verified end to end, or ``None`` (absent, or any
        failure)."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[Item | None]:
        """:meth:`get` for a batch, in at most two round trips (repeated keys fetched once)."""
        unique = self._unique(keys)
        values = self._call("get", lambda deadline: self._backend.read(unique, deadline))
        if values is None:
            return [None] * len(keys)
        items = {
            store_key: self._open(store_key, value)
            for store_key, value in zip(unique, values, strict=True)
        }
        return [items[self._store_key(k)] for k in keys]

    @property
    def supports_claims(self) -> bool:
        """Whether this store can hold claims (Redis/Valkey: yes; Mooncake Store: no - its
        ``put`` cannot tell the caller whether it stored anything, and nothing in it expires,
        so a claim whose host died would stay)."""
        return isinstance(self._backend, ClaimingBackend)

    def fetch_or_claim(
        self,
        keys: Sequence[str],
        owner: str,
        *,
        claim: bool = True,
        claim_ttl_s: float = 5.0,
    ) -> list[tuple[Item | None, str | None]]:
        """:meth:`get_many` of ``keys`` and, in the same round trip, who claimed each key that
        holds no value: ``(item, None)`` for a hit, ``(None, holder)`` for a miss, where
        ``holder`` is the claimer's id, or ``None`` if nobody claimed it.  With ``claim``, a
        miss nobody claimed is claimed for ``owner`` (its holder is then ``owner``) for
        ``claim_ttl_s`` seconds, until :meth:`release_claims` or the expiry - in the order
        of the store's keys, and none after a key another host holds (a miss left unclaimed
        for that reason has no holder), so hosts that wait for each other's claims never
        wait in a circle.  One call, under the deadline and the breaker like every other.
        A store without claims (:attr:`supports_claims`) answers every holder ``None``; a
        failure answers ``(None, None)`` for every key - ``(None, owner)`` where, claiming,
        it reached the store: its claims may have been taken before the rest of the lookup
        failed (the reply lost, the reads past the deadline), so they are the owner's to
        release (:meth:`release_claims` drops only those it holds)."""
        _check_owner(owner)
        # Before the call: the claim script takes it as a number, and a value it refuses
        # there would be counted as the store failing (toward the breaker).
        claim = flag("claim", claim)
        check_claim_ttl_s(claim_ttl_s)
        if not isinstance(self._backend, ClaimingBackend):
            return [(item, None) for item in self.get_many(keys)]
        backend = self._backend
        unique = sorted(self._unique(keys))  # one order for every host: see the backend
        ttl_ms = max(1, int(claim_ttl_s * 1000))
        reached = False

        def lookup(deadline: float) -> tuple[list[Fetched], list[str | None]]:
            nonlocal reached
            reached = True
            return backend.read_claiming(unique, owner, claim, ttl_ms, deadline)

        found = self._call("get", lookup)
        if found is None:
            # The store runs a claim script to its end once it began, whatever came of the
            # rest: a caller told nobody holds them would never release claims it holds,
            # and other hosts would wait on them until they lapse.
            return [(None, owner if claim and reached else None)] * len(keys)
        values, holders = found
        results = {
            store_key: (self._open(store_key, value), holder)
            for store_key, value, holder in zip(unique, values, holders, strict=True)
        }
        return [results[self._store_key(k)] for k in keys]

    def release_claims(self, keys: Sequence[str], owner: str) -> None:
        """Drop the claims ``owner`` holds on ``keys`` (one round trip; a claim that lapsed
        and another host took since stays theirs).  Never raises for the store's sake."""
        _check_owner(owner)
        if not keys or not isinstance(self._backend, ClaimingBackend):
            return
        backend = self._backend
        unique = self._unique(keys)
        released = self._call(
            "release", lambda deadline: backend.release_claims(unique, owner, deadline)
        )
        if released is not None:
            self._count(claims_released=released)

    def put(self, key: str, item: Item) -> None:
        """Store ``item`` under ``key`` unless the key holds a value already (items are
        immutable: the first writer wins, a later put is a no-op).  Never raises for the
        store's sake; an item the codec cannot encode (a value it does not support, or one
        past its limits, such as a tensor of 65 dimensions) is counted, logged once and
        skipped.  Only bad arguments raise (a key that is not a content hash, a non-mapping)."""
        store_key = self._store_key(key)
        if not isinstance(item, Mapping):
            raise TypeError(f"an item must be a mapping of field names, not {type(item).__name__}")
        try:
            payload = serde.pack(item)
        except Exception as exc:  # whatever the codec refuses: TypeError, ValueError, ...
            self._fault("unencodable", f"item {key} cannot be encoded for the remote tier: {exc}")
            return
        if len(payload) > self._max_value:
            self._fault(
                "oversize",
                f"item {key} is {len(payload) / MiB:.1f} MiB, more than max_value_mb="
                f"{self._max_value / MiB:g}; not published",
            )
            return
        header = seal(store_key, payload, self._digest_key, self._backend.part_bytes)

        def write(deadline: float) -> bool:
            return self._backend.write(store_key, header, payload, deadline)

        stored = self._call("put", write)
        if stored is not None:
            self._count(
                **({"puts": 1, "bytes_written": len(payload)} if stored else {"put_present": 1})
            )

    @property
    def last_call_failed(self) -> bool:
        """Whether the calling thread's latest call failed or was refused (the store failing
        or closed, its breaker open) rather than answered: a miss it answered then is no
        news of the key."""
        return bool(getattr(self._calls, "failed", False))

    def close(self) -> None:
        """Close the connections; later calls are misses.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._backend.close()

    def stats(self, *, latencies: bool = True) -> dict[str, float]:
        """Counters and (unless ``latencies=False``) latency percentiles.

        ``hits`` / ``misses`` (gets), ``puts`` (values stored; with Mooncake, whose put of a
        present key answers as one that stored it, hosts racing to put one key may both
        count it), ``put_present`` (already there), ``bytes_read`` / ``bytes_written``
        (payloads), ``contains_keys`` / ``contains_found``, ``claims_released`` (claims
        :meth:`release_claims` dropped);
        failures: ``timeouts``, ``unreachable``, ``server_errors``, ``corrupt``,
        ``incomplete`` (a chunk gone), ``too_large`` (a stored value over ``max_value_mb``,
        not read), ``version_mismatch``, ``digest_mismatch``,
        ``undecodable`` (verified, but decoding it raised), ``unencodable`` (an item the
        codec refused), ``oversize`` (an item over ``max_value_mb``, or over what the
        backend's client can put, not published), ``refused`` (puts the store answered with a
        refusal - full, read-only - none of which trips the breaker), ``skipped`` (calls the
        open breaker refused) and ``errors`` (their sum, minus ``skipped``);
        ``claims_refused`` (claiming lookups the store answered without claims, its claim
        script refused); ``breaker_opened``,
        ``breaker_open`` (1 while open); ``{contains,get,put,release}_p50_ms`` / ``_p99_ms``
        over the latest calls that reached the store (a claiming lookup is a ``get``)."""
        with self._lock:
            counts = dict(self._counts)
            samples = (
                {op: np.array(values) for op, values in self._latency.items()} if latencies else {}
            )
        failures = (
            *_TRANSPORT,
            "corrupt",
            "incomplete",
            "too_large",
            "version_mismatch",
            "digest_mismatch",
            "undecodable",
            "unencodable",
            "oversize",
            "refused",
        )
        out: dict[str, float] = {
            name: counts.get(name, 0)
            for name in (
                "hits",
                "misses",
                "puts",
                "put_present",
                "bytes_read",
                "bytes_written",
                "contains_keys",
                "contains_found",
                "claims_released",
                *failures,
                "skipped",
            )
        }
        out["errors"] = sum(counts.get(name, 0) for name in failures)
        backend = self._backend
        out["claims_refused"] = (
            backend.claims_refused if isinstance(backend, ClaimingBackend) else 0
        )
        out["breaker_opened"] = self._breaker.opened
        out["breaker_open"] = int(self._breaker.state == "open")
        for op, values in samples.items():
            for q in (50, 99):
                out[f"{op}_p{q}_ms"] = float(np.percentile(values, q)) * 1e3 if values.size else 0.0
        return out

    def latencies(self) -> dict[str, list[float]]:
        """The durations, in seconds, of the latest calls that reached the store (at most
        100,000 per operation): ``{"contains": [...], "get": [...], "put": [...], "release":
        [...]}``."""
        with self._lock:
            return {op: list(values) for op, values in self._latency.items()}

    def __repr__(self) -> str:
        keyed = "keyed" if self._digest_key is not None else "unkeyed"
        return f"RemoteStore({self.url!r}, namespace={self.namespace!r}, {keyed})"

    # -- machinery -------------------------------------------------------------------------

    def _store_key(self, key: str) -> str:
        if not is_shareable_key(key):
            raise ValueError(
                f"remote tier key {key!r} is not a full-width content hash (at least 32 "
                "characters of [A-Za-z0-9._+=-], such as mmcache.content_hash(...))"
            )
        return f"mmc/{self.namespace}/{key}"

    def _unique(self, keys: Sequence[str]) -> list[str]:
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of keys, not one str")
        return list(dict.fromkeys(self._store_key(k) for k in keys))

    def _call(self, op: str, call: Callable[[float], _T]) -> _T | None:
        """Run one backend call under the deadline and the breaker; ``None`` for a failure
        (counted, logged once)."""
        self._calls.failed = True  # until the store answers
        if self._closed or not self._breaker.allow():
            self._count(skipped=1)
            return None
        started = time.monotonic()
        try:
            result = call(started + self.timeout_s)
        except RemoteTimeout as exc:
            self._transport_failure("timeouts", op, f"timed out after {self.timeout_s:g} s ({exc})")
            return None
        except RemoteUnreachable as exc:
            self._transport_failure("unreachable", op, f"unreachable ({exc})")
            return None
        except ValueTooLarge as exc:  # the client's limit, not the store failing
            self._fault("oversize", f"remote tier {self.url}: {op} refused: {exc}")
            return None
        except WriteRefused as exc:  # the store answered: it is up, whatever it refused
            self._fault("refused", f"remote tier {self.url}: {op} refused by the store: {exc}")
            return None
        except Exception as exc:  # the client's own errors (e.g. a server that refuses writes)
            self._transport_failure("server_errors", op, f"failed: {type(exc).__name__}: {exc}")
            return None
        else:
            self._calls.failed = False
            elapsed = time.monotonic() - started
            with self._lock:
                self._latency[op].append(elapsed)
            if self._breaker.success():
                logger.warning("remote tier %s answers again; calling it again", self.url)
            return result
        finally:
            # Every outcome settles a probe: after a success or a failure this is a no-op; a
            # call refused before it reached the store, or interrupted, lets the next probe.
            self._breaker.release()

    def _transport_failure(self, kind: str, op: str, message: str) -> None:
        self._fault(kind, f"remote tier {self.url}: {op} {message}")
        if self._breaker.failure():
            logger.warning(
                "remote tier %s failed %s times in a row: not calling it for a while (probing "
                "again later); requests are served by processing meanwhile",
                self.url,
                self._breaker.failures_to_open,
            )

    def _open(self, store_key: str, value: Fetched) -> Item | None:
        """The verified item in ``value``, or ``None`` (counted)."""
        if value is None:
            self._count(misses=1)
            return None
        if isinstance(value, Incomplete):
            self._fault("incomplete", f"remote value {store_key} is missing a chunk")
            self._count(misses=1)
            return None
        if isinstance(value, OtherVersion):
            self._fault(
                "version_mismatch", f"remote value {store_key} was written by another version"
            )
            self._count(misses=1)
            return None
        if isinstance(value, TooLarge):
            self._fault(
                "too_large",
                f"remote value {store_key} is larger than max_value_mb="
                f"{self._max_value / MiB:g}; not read",
            )
            self._count(misses=1)
            return None
        try:
            payload = (
                open_envelope(store_key, value.value, self._digest_key, value.parts)
                if isinstance(value, Received)
                else open_envelope(store_key, value, self._digest_key)
            )
            # A buffer the backend handed over writable is ours alone: view it in place.
            item = serde.decode(payload, copy=payload.readonly)
        except VersionMismatch as exc:
            self._fault("version_mismatch", f"remote value {store_key}: {exc}")
        except DigestMismatch as exc:
            self._fault(
                "digest_mismatch",
                f"remote value {store_key} does not verify ({exc}): tampered, corrupted, or "
                "written with another secret",
            )
        except (CorruptValue, SegmentCorruptError) as exc:
            self._fault("corrupt", f"remote value {store_key} is corrupt: {exc}")
        except Exception as exc:  # e.g. an allocation refused: never into the engine
            self._fault(
                "undecodable",
                f"remote value {store_key} verifies but does not decode "
                f"({type(exc).__name__}: {exc})",
            )
        else:
            self._count(hits=1, bytes_read=payload.nbytes)
            return item
        self._count(misses=1)
        return None

    def _fault(self, kind: str, message: str) -> None:
        """Count a failure of ``kind``; log the first one of each kind."""
        with self._lock:
            self._counts[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning(
                "%s; treated as a miss. Further failures of this kind are counted in "
                "RemoteStore.stats()['%s'] and not logged.",
                message,
                kind,
            )

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)
