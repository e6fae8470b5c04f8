"""What :class:`~mmcache.remote.RemoteStore` needs of a store: three batched byte operations.

A backend moves whole envelopes (see :mod:`.envelope`) and knows nothing of items, keys of
digests, deadlines' bookkeeping or the circuit breaker (one that receives a value in parts may
hash each part as it arrives: :class:`Received`); it raises :class:`RemoteTimeout` or
:class:`RemoteUnreachable` (or its client's own exceptions) and the store turns each into a
counted miss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from mmcache.remote.envelope import PartDigests

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "INCOMPLETE",
    "Backend",
    "Incomplete",
    "Received",
    "RemoteTimeout",
    "RemoteUnreachable",
    "ValueTooLarge",
    "check_deadline",
]


class RemoteTimeout(Exception):
    """A call to the store ran out of its deadline."""


class RemoteUnreachable(Exception):
    """The store could not be reached (refused, reset, not set up)."""


class ValueTooLarge(Exception):
    """A value larger than this backend can store (a limit of the client, not a failure of
    the store)."""


class Incomplete:
    """A value whose header is present but part of whose body is gone (a chunk evicted or
    deleted): a miss, counted apart from a plain absence."""

    def __repr__(self) -> str:
        return "INCOMPLETE"


INCOMPLETE = Incomplete()


class Received(NamedTuple):
    """A whole value whose payload's parts the backend hashed as they arrived (the store then
    only hashes the short list of part digests, not the value)."""

    value: Buffer
    parts: PartDigests


class Backend(Protocol):
    """The byte operations of one store.  ``deadline`` is a :func:`time.monotonic` instant
    by which the call must have returned (or raised :class:`RemoteTimeout`)."""

    part_bytes: int
    """The part size values written here are digested in (see :mod:`.envelope`): a backend
    that stores a large value as chunks uses its chunk size, so that each chunk is one part
    and can be hashed as soon as it arrives."""

    def exists(self, keys: Sequence[str], deadline: float) -> list[bool]:
        """Whether each key holds a value, in one round trip."""

    def read(
        self, keys: Sequence[str], deadline: float
    ) -> list[Buffer | Received | Incomplete | None]:
        """Each key's whole value (``None`` when absent, :data:`INCOMPLETE` when part of it
        is gone), possibly with its part digests.  A writable buffer is the caller's to keep
        (no one else refers to it)."""

    def write(self, key: str, header: bytes, payload: Buffer, deadline: float) -> bool:
        """Store ``header + payload`` under ``key`` unless the key holds a value already;
        whether this call stored it."""

    def close(self) -> None:
        """Release connections and threads; idempotent."""


def check_deadline(deadline: float, what: str) -> None:
    """Raise :class:`RemoteTimeout` if ``deadline`` has passed (between two round trips)."""
    if time.monotonic() >= deadline:
        raise RemoteTimeout(f"deadline passed before {what}")
