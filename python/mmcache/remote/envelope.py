"""The value the remote tier stores for one item: a self-describing, digested envelope.

::

    offset 0   b"MMCR"                 magic
           4   schema version: u16 LE  (SCHEMA_VERSION; another version is a miss)
           6   flags: u16 LE           (bit 0: the digest is keyed with a shared secret)
           8   payload length: u64 LE
          16   part size: u32 LE       (the payload is digested in parts of this many bytes)
          20   reserved: 12 zero bytes
          32   digest: 32 bytes        see below
          64   payload                 the item codec's payload (serde.pack): its header,
                                       then the raw tensor bytes at 64-byte aligned offsets

The digest is defined over a *hash list*: the payload is cut into parts of the part size (the
last one shorter), each part is hashed with plain BLAKE3, and the digest is BLAKE3 of (the 32
bytes at offset 0, the store key's length and bytes, the parts' hashes in order).  So it binds
the lengths, the part size, the order of the parts and every byte, and a reader can hash each
part as soon as it arrives (a backend that fetches a value in chunks does so in the thread
that fetched the chunk: :class:`PartDigests`) instead of hashing the whole value after the
transfer.

The digest covers the store key as well as the bytes, so a value copied under another key
(another item, another model's namespace) does not verify either.  With a secret the digest
is keyed BLAKE3 (the key derived from the secret): whoever can write to the store but does not
know the secret cannot make a value that verifies - changing a part needs a BLAKE3 collision,
changing the hash list needs the key - so a tampered value is a miss, never a wrong tensor.
Without a secret the digest still catches truncation and corruption.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

try:
    import blake3
except ImportError as exc:  # pragma: no cover - the remote and test extras install it
    raise ImportError(f"mmcache.remote needs: pip install 'mmcache[remote]' ({exc})") from exc

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "MIN_PART_BYTES",
    "SCHEMA_VERSION",
    "CorruptValue",
    "DigestMismatch",
    "PartDigests",
    "VersionMismatch",
    "derive_digest_key",
    "open_envelope",
    "part_hasher",
    "seal",
]

MAGIC = b"MMCR"
SCHEMA_VERSION = 2
_KEYED = 1
# magic, schema version, flags, payload length, part size, reserved
_FIXED = struct.Struct("<4sHHQI12s")
_RESERVED = bytes(12)
_DIGEST_SIZE = 32
HEADER_SIZE = _FIXED.size + _DIGEST_SIZE
_KEY_CONTEXT = "mmcache remote tier 2026-01 value digest key"

MIN_PART_BYTES = 1 << 10
"""The smallest part size a value may declare (smaller parts would only make a reader hash
longer lists)."""


class CorruptValue(Exception):
    """A stored value that is not a whole envelope (bad magic, truncated, wrong lengths)."""


class VersionMismatch(CorruptValue):
    """A stored value written with another schema version of the envelope."""


class DigestMismatch(CorruptValue):
    """A stored value whose digest does not verify: tampered, corrupted, stored under another
    key, or sealed with another secret (or with one where this reader has none, or the
    reverse)."""


class PartDigests(NamedTuple):
    """The hash (:func:`part_hasher`) of each part of a payload cut into ``part_bytes``
    pieces, in order: what a backend hashed while the parts arrived."""

    part_bytes: int
    digests: list[bytes]


def derive_digest_key(secret: bytes | str) -> bytes:
    """The 32-byte BLAKE3 key for ``secret`` (any length; a ``str`` is taken as UTF-8, bytes
    as they are; anything else is a ``TypeError``)."""
    # bytes() would take an int for a length (7: seven zero bytes) and a list for its items.
    if isinstance(secret, str):
        raw = secret.encode()
    elif isinstance(secret, bytes | bytearray | memoryview):
        raw = bytes(secret)
    else:
        raise TypeError(
            f"the remote tier's secret must be a str or bytes, not {type(secret).__name__}"
        )
    if not raw:
        raise ValueError("the remote tier's secret must not be empty (pass None for no secret)")
    return blake3.blake3(raw, derive_key_context=_KEY_CONTEXT).digest()


#: Parts at least this large are hashed on all cores when they are hashed whole (BLAKE3
#: splits them; smaller ones would spend more on the threads than they save).
_PARALLEL_BYTES = 1 << 20


def part_hasher(*, whole: int = 0) -> blake3.blake3:
    """A hasher of one part of a payload: ``update`` it with the part's bytes in order (as
    they arrive), and its ``digest()`` is the part's entry in the digest's hash list.
    ``whole``: the size of the one ``update`` to come, if the part is hashed whole (a large
    one is then hashed on all cores; the digest is the same)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if whole >= _PARALLEL_BYTES else 1)


def _part_digests(payload: memoryview, part_bytes: int) -> list[bytes]:
    hashes = []
    for start in range(0, payload.nbytes, part_bytes):
        part = payload[start : start + part_bytes]
        hasher = part_hasher(whole=part.nbytes)
        hasher.update(part)
        hashes.append(hasher.digest())
    return hashes


def _digest(
    fixed: bytes, store_key: str, parts: Sequence[bytes], digest_key: bytes | None
) -> bytes:
    hasher = blake3.blake3() if digest_key is None else blake3.blake3(key=digest_key)
    name = store_key.encode()
    hasher.update(fixed)
    hasher.update(struct.pack("<I", len(name)))
    hasher.update(name)
    for part in parts:
        hasher.update(part)
    return hasher.digest()


def seal(store_key: str, payload: Buffer, digest_key: bytes | None, part_bytes: int) -> bytes:
    """The envelope header for ``payload`` stored under ``store_key``, digested in parts of
    ``part_bytes`` (at least :data:`MIN_PART_BYTES`); the value is this header followed by
    ``payload``."""
    if not MIN_PART_BYTES <= part_bytes < 1 << 32:
        raise ValueError(f"part_bytes must be in [{MIN_PART_BYTES}, 2**32), not {part_bytes}")
    view = memoryview(payload).cast("B")
    flags = 0 if digest_key is None else _KEYED
    fixed = _FIXED.pack(MAGIC, SCHEMA_VERSION, flags, view.nbytes, part_bytes, _RESERVED)
    return fixed + _digest(fixed, store_key, _part_digests(view, part_bytes), digest_key)


def open_envelope(
    store_key: str, value: Buffer, digest_key: bytes | None, parts: PartDigests | None = None
) -> memoryview:
    """The payload of ``value`` (a view of it), once the envelope is verified as a whole.

    ``parts``: the digests of the parts of ``value[HEADER_SIZE:]``, computed by whoever
    received ``value``; used when they are for the part size and count the header declares
    (else, as without ``parts``, the payload is hashed here).

    Raises :class:`CorruptValue`, :class:`VersionMismatch` or :class:`DigestMismatch`.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptValue(f"{view.nbytes} bytes, shorter than an envelope header")
    magic, version, flags, length, part_bytes, reserved = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if version != SCHEMA_VERSION:
        raise VersionMismatch(f"schema version {version}, this reader speaks {SCHEMA_VERSION}")
    if length != view.nbytes - HEADER_SIZE:
        raise CorruptValue(
            f"header says {length} payload bytes, the value holds {view.nbytes - HEADER_SIZE}"
        )
    if part_bytes < MIN_PART_BYTES or reserved != _RESERVED:
        raise CorruptValue(f"bad part size {part_bytes} or reserved bytes {bytes(reserved)!r}")
    if bool(flags & _KEYED) != (digest_key is not None):
        raise DigestMismatch(
            "sealed with a secret, read without one"
            if flags & _KEYED
            else "sealed without a secret, read with one"
        )
    payload = view[HEADER_SIZE:]
    if (
        parts is not None
        and parts.part_bytes == part_bytes
        and len(parts.digests) == -(-length // part_bytes)
    ):
        digests = parts.digests
    else:
        digests = _part_digests(payload, part_bytes)
    expected = _digest(bytes(view[: _FIXED.size]), store_key, digests, digest_key)
    if not hmac.compare_digest(expected, view[_FIXED.size : HEADER_SIZE]):
        raise DigestMismatch("digest does not match the value")
    return payload
