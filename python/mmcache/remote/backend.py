"""What :class:`~mmcache.remote.RemoteStore` needs of a store: three batched byte operations,
and two more for claims where the store can hold them (:class:`ClaimingBackend`).

A backend moves whole envelopes (see :mod:`.envelope`) and knows nothing of items, keys of
digests or the circuit breaker (one that receives a value in parts may hash each part as it
arrives: :class:`Received`); it raises :class:`RemoteTimeout` or :class:`RemoteUnreachable`
(or its client's own exceptions) and the store turns each into a counted miss; a write the
store refuses raises :class:`WriteRefused`.  It never
allocates for a value larger than the reader's bound: that value is :data:`TOO_LARGE`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias, runtime_checkable
from urllib.parse import SplitResult, unquote, urlsplit

from mmcache.remote.envelope import PartDigests

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "INCOMPLETE",
    "MAX_OWNER_BYTES",
    "OTHER_VERSION",
    "TOO_LARGE",
    "Backend",
    "ClaimingBackend",
    "Fetched",
    "Incomplete",
    "OtherVersion",
    "Received",
    "RemoteTimeout",
    "RemoteUnreachable",
    "TooLarge",
    "ValueTooLarge",
    "WriteRefused",
    "redact_url",
]


class RemoteTimeout(Exception):
    """A call to the store ran out of its deadline."""


class RemoteUnreachable(Exception):
    """The store could not be reached (refused, reset, not set up)."""


class WriteRefused(Exception):
    """The store answered a write with a refusal (full with ``noeviction``, a read-only
    replica, a value over its limit): the store is up, so this is no failure of it."""


class ValueTooLarge(Exception):
    """A value larger than this backend can store (a limit of the client, not a failure of
    the store)."""


class Incomplete:
    """A value whose header is present but part of whose body is gone (a chunk evicted or
    deleted): a miss, counted apart from a plain absence."""

    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE = Incomplete()


class OtherVersion:
    """A value that another schema version of this package wrote in a layout the backend
    cannot even take apart (a chunked value's manifest of another version): a miss counted
    as a version mismatch, left in the store for the hosts of that version."""

    def __repr__(self) -> str:
        return "OTHER_VERSION"


OTHER_VERSION = OtherVersion()


class TooLarge:
    """A value larger than the reader accepts (``max_value_mb``), refused before anything was
    allocated for it or read of it past the bound: a miss."""

    def __repr__(self) -> str:
        return "TOO_LARGE"


TOO_LARGE = TooLarge()


class Received(NamedTuple):
    """A whole value whose payload's parts the backend hashed as they arrived (the store then
    only hashes the short list of part digests, not the value)."""

    value: Buffer
    parts: PartDigests


Fetched: TypeAlias = "Buffer | Received | Incomplete | OtherVersion | TooLarge | None"
"""What a backend read for one key: the whole value (possibly with its part digests), or why
there is none."""


class Backend(Protocol):
    """The byte operations of one store.  ``deadline`` is a :func:`time.monotonic` instant
    by which the call must have returned (or raised :class:`RemoteTimeout`)."""

    part_bytes: int
    """The part size values written here are digested in (see :mod:`.envelope`): a backend
    that stores a large value as chunks uses its chunk size, so that each chunk is one part
    and can be hashed as soon as it arrives."""

    def exists(self, keys: Sequence[str], deadline: float) -> list[bool]:
        """Whether each key holds a value, in one round trip."""

    def read(self, keys: Sequence[str], deadline: float) -> list[Fetched]:
        """Each key's whole value (``None`` when absent, :data:`INCOMPLETE` when part of it
        is gone, :data:`OTHER_VERSION` when another schema version laid it out,
        :data:`TOO_LARGE` when over the bound it was made with), possibly with its
        part digests.  A writable buffer is the caller's to keep (no one else refers to
        it)."""

    def write(self, key: str, header: bytes, payload: Buffer, deadline: float) -> bool:
        """Store ``header + payload`` under ``key`` unless the key holds a value already;
        whether this call stored it."""

    def close(self) -> None:
        """Release connections and threads; idempotent."""


MAX_OWNER_BYTES = 256
"""The longest owner (a host's id) a claim may name: a store reads no more of a claim."""


@runtime_checkable
class ClaimingBackend(Backend, Protocol):
    """A store that can also hold *claims*: short-lived markers, beside an item's key, that
    name the host processing that item (see :class:`~mmcache.remote.TieredSenderCache`)."""

    claims_refused: int
    """Claiming reads answered without claims (every holder ``None``): the store refused to
    take or read them (full, read-only, scripting off), yet answered the reads."""

    def read_claiming(
        self, keys: Sequence[str], owner: str, take: bool, ttl_ms: int, deadline: float
    ) -> tuple[list[Fetched], list[str | None]]:
        """:meth:`read` of ``keys`` and, in the same round trip, each absent key's claim:
        who holds it, or ``None`` where the key holds a value or nobody claimed it.  With
        ``take``, absent keys nobody claimed are claimed for ``owner`` for ``ttl_ms`` (their
        holder is then ``owner``) in the order of ``keys``, stopping at the first key another
        owner holds: an owner that waits for a key holds only keys before it, so owners
        waiting on each other's claims (given keys in one order) never wait in a circle."""

    def release_claims(self, keys: Sequence[str], owner: str, deadline: float) -> int:
        """Drop the claims of ``keys`` that ``owner`` holds (never another's), in one round
        trip; how many there were."""


# Query parameters whose values may be credentials (redis-py reads ``password=``, for one).
_SECRET_PARAMETER = re.compile(r"pass|pwd|secret|token|auth|cred|key", re.IGNORECASE)
# A URL with userinfo as an option's value: what goes is up to its last '@'.
_URL_IN_VALUE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*(?:%3A|:)(?:%2F|/){2}).*@", re.IGNORECASE)


def _fields(query: str) -> list[tuple[str, str, str]]:
    return [field.partition("=") for field in query.split("&")] if query else []


def _accounts_for_every_at(parts: SplitResult, text: str) -> bool:
    """Whether ``parts`` (``text`` parsed) reads as a whole authority (a host, a valid port
    or none) with every '@' of ``text`` in a place of its own: the userinfo's end, inside a
    password-like option's value (hidden whole) or a URL given as an option's value."""
    try:
        parts.port  # noqa: B018 - raises for a port that is not one
    except ValueError:
        return False
    accounted = parts.netloc.count("@") + sum(
        value.count("@")
        for name, eq, value in _fields(parts.query)
        if eq and (_SECRET_PARAMETER.search(unquote(name)) or _URL_IN_VALUE.match(value))
    )
    return bool(parts.hostname) and text.count("@") == accounted


def redact_url(url: str) -> str:
    """``url`` as it may be shown (logs, reprs, errors): the userinfo (``user:password@``),
    the userinfo of a URL given as an option's value (Mooncake's ``metadata=``) and the value
    of every password-like query parameter become ``***``; the rest (scheme, host, port, path,
    other options) still says which store it is. A password pasted without percent-encoding
    may hold ``/``, ``?`` or ``#``, which end the netloc where a URL parser looks: an ``@``
    found anywhere else then hides everything up to the first ``@`` after which the URL reads
    whole (a password-like option's value may hold an ``@`` of its own: no part of it is
    shown, nor taken for the host)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparseable URL>"
    scheme, colon_slashes, rest = url.partition("://")
    if colon_slashes and "@" in rest and not _accounts_for_every_at(parts, rest):
        for at, char in enumerate(rest):
            if char != "@":
                continue
            tail = rest[at + 1 :]
            try:
                tail_parts = urlsplit(f"{scheme}://{tail}")
            except ValueError:
                continue
            if _accounts_for_every_at(tail_parts, tail):
                return redact_url(f"{scheme}://***@{tail}")
        return f"{scheme}://***"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    shown = []
    for name, eq, value in _fields(parts.query):
        if eq and _SECRET_PARAMETER.search(unquote(name)):
            shown.append(f"{name}=***")
        else:
            shown.append(name + eq + _URL_IN_VALUE.sub(r"\1***@", value))
    query = "&".join(shown)
    shown_url = parts._replace(netloc=netloc, query=query).geturl()
    if colon_slashes and not netloc:  # geturl() drops an empty authority's "//"
        shown_url = shown_url.replace(":", "://", 1)
    return shown_url
