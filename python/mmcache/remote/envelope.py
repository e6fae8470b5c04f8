"""The value the remote tier stores for one item: a self-describing, digested envelope.

::

    offset 0   b"MMCR"                 magic
           4   schema version: u16 LE  (SCHEMA_VERSION; another version is a miss)
           6   flags: u16 LE           (bit 0: the digest is keyed with a shared secret)
           8   payload length: u64 LE
          16   digest: 32 bytes        BLAKE3 of (the 16 bytes above, the store key, payload)
          48   payload                 the item codec's payload (serde.pack): its header,
                                       then the raw tensor bytes at 64-byte aligned offsets

The digest covers the store key as well as the bytes, so a value copied under another key
(another item, another model's namespace) does not verify either.  With a secret the digest
is keyed BLAKE3 (the key derived from the secret): whoever can write to the store but does not
know the secret cannot make a value that verifies, so a tampered value is a miss, never a
wrong tensor.  Without a secret the digest still catches truncation and corruption.
"""

from __future__ import annotations

import hmac
import struct
from typing import TYPE_CHECKING

try:
    import blake3
except ImportError as exc:  # pragma: no cover - the remote and test extras install it
    raise ImportError(f"mmcache.remote needs: pip install 'mmcache[remote]' ({exc})") from exc

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "SCHEMA_VERSION",
    "CorruptValue",
    "DigestMismatch",
    "VersionMismatch",
    "derive_digest_key",
    "open_envelope",
    "seal",
]

MAGIC = b"MMCR"
SCHEMA_VERSION = 1
_KEYED = 1
_FIXED = struct.Struct("<4sHHQ")  # magic, schema version, flags, payload length
_DIGEST_SIZE = 32
HEADER_SIZE = _FIXED.size + _DIGEST_SIZE
_KEY_CONTEXT = "mmcache remote tier 2026-01 value digest key"


class CorruptValue(Exception):
    """A stored value that is not a whole envelope (bad magic, truncated, wrong lengths)."""


class VersionMismatch(CorruptValue):
    """A stored value written with another schema version of the envelope."""


class DigestMismatch(CorruptValue):
    """A stored value whose digest does not verify: tampered, corrupted, stored under another
    key, or sealed with another secret (or with one where this reader has none, or the
    reverse)."""


def derive_digest_key(secret: bytes | str) -> bytes:
    """The 32-byte BLAKE3 key for ``secret`` (any length; a ``str`` is taken as UTF-8)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the remote tier's secret must not be empty (pass None for no secret)")
    return blake3.blake3(raw, derive_key_context=_KEY_CONTEXT).digest()


#: Payloads at least this large are hashed on all cores (BLAKE3 splits them; smaller ones
#: would spend more on the threads than they save).
_PARALLEL_BYTES = 1 << 20


def _digest(fixed: bytes, store_key: str, payload: Buffer, digest_key: bytes | None) -> bytes:
    size = memoryview(payload).nbytes
    threads = blake3.blake3.AUTO if size >= _PARALLEL_BYTES else 1
    hasher = (
        blake3.blake3(max_threads=threads)
        if digest_key is None
        else blake3.blake3(key=digest_key, max_threads=threads)
    )
    name = store_key.encode()
    hasher.update(fixed)
    hasher.update(struct.pack("<I", len(name)))
    hasher.update(name)
    hasher.update(payload)
    return hasher.digest()


def seal(store_key: str, payload: Buffer, digest_key: bytes | None) -> bytes:
    """The envelope header for ``payload`` stored under ``store_key``; the value is this
    header followed by ``payload``."""
    length = memoryview(payload).nbytes
    fixed = _FIXED.pack(MAGIC, SCHEMA_VERSION, 0 if digest_key is None else _KEYED, length)
    return fixed + _digest(fixed, store_key, payload, digest_key)


def open_envelope(store_key: str, value: Buffer, digest_key: bytes | None) -> memoryview:
    """The payload of ``value`` (a view of it), once the envelope is verified as a whole.

    Raises :class:`CorruptValue`, :class:`VersionMismatch` or :class:`DigestMismatch`.
    """
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptValue(f"{view.nbytes} bytes, shorter than an envelope header")
    magic, version, flags, length = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptValue(f"bad magic {bytes(magic)!r}")
    if version != SCHEMA_VERSION:
        raise VersionMismatch(f"schema version {version}, this reader speaks {SCHEMA_VERSION}")
    if length != view.nbytes - HEADER_SIZE:
        raise CorruptValue(
            f"header says {length} payload bytes, the value holds {view.nbytes - HEADER_SIZE}"
        )
    if bool(flags & _KEYED) != (digest_key is not None):
        raise DigestMismatch(
            "sealed with a secret, read without one"
            if flags & _KEYED
            else "sealed without a secret, read with one"
        )
    payload = view[HEADER_SIZE:]
    fixed = bytes(view[: _FIXED.size])
    expected = _digest(fixed, store_key, payload, digest_key)
    if not hmac.compare_digest(expected, view[_FIXED.size : HEADER_SIZE]):
        raise DigestMismatch("digest does not match the value")
    return payload
