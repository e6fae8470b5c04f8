"""Items to and from a payload in shared memory, without pickle and without copying tensors.

The codec is native (``src/codec.rs`` defines the format, ``src/python/encode.rs`` and
``src/python/decode.rs`` walk the Python objects): one pass over the item each way, tensor
metadata read straight from the tensors, and no per-field Python code.

An item is encoded as *parts*: part 0 is the header (the format's magic and version, the
length of every other part, and the value tree: field names, small values inline, and for
every tensor, array or long ``bytes`` value its dtype, shape and the number of the part that
holds its bytes); parts 1.. are the raw C-contiguous bytes of those values, read in place.
The shared-memory core writes the parts one after another, each starting at the next
multiple of :data:`ALIGNMENT` bytes from the payload start (the core's rule, which
:func:`part_offsets` applies), so a reader finds every part from the header alone and can view
it in place.  ``ARCHITECTURE.md`` has the byte layout.

The caches do not go through this module: ``ShmWriter.put_item`` encodes straight into the
ring and ``ShmReader.resolve_item`` decodes straight out of it.  It is for payloads that
travel elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmcache import _core

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "ALIGNMENT",
    "OUT_OF_BAND_BYTES",
    "decode",
    "encode",
    "pack",
    "part_offsets",
    "payload_size",
]

ALIGNMENT: int = _core.PART_ALIGNMENT
"""Every part starts at a multiple of this many bytes from the payload start (the core's rule)."""

OUT_OF_BAND_BYTES: int = _core.OUT_OF_BAND_BYTES
"""``bytes`` values at least this long travel as their own part instead of in the header."""


def part_offsets(lengths: Sequence[int]) -> list[int]:
    """Start offset of each part, given every part's length (part 0 included)."""
    return _core.part_offsets(lengths)[0]


def payload_size(header: bytes, buffers: Sequence[memoryview]) -> int:
    """Bytes the core stores for ``encode``'s output (padding included, none after the end)."""
    return _core.part_offsets([len(header), *(b.nbytes for b in buffers)])[1]


def encode(item: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """Encode ``item`` as (part 0, raw buffers); ``store.put(key, [part0, *buffers])``.

    The buffers are read-only byte views of the item's own tensors, arrays and long
    ``bytes`` values (a copy is made only of tensors whose bytes are not their values as they
    stand: non-contiguous, on another device, or lazily conjugated/negated); they keep their
    source alive: a tensor's view holds the tensor's storage, so re-pointing the tensor
    (``set_()``) or dropping it leaves the view intact.  Resizing that storage or moving it
    to shared memory (``untyped_storage().resize_()``, ``share_memory_()``) frees the memory
    a view reads, as it does under ``Tensor.numpy()``: where another thread may do that
    while the views are read, use :func:`pack`.

    A value the codec cannot hold raises :class:`~mmcache.errors.ItemNotEncodableError` (a
    ``TypeError`` and a ``ValueError``) naming the field: an unsupported type, a limit of the
    format (nesting or dimensions over 64, an int outside 64 bits, a str, bytes or key over
    4 GiB), or a tensor without memory of its own (a wrapper subclass such as DTensor or
    FakeTensor).
    """
    return _core.encode_item(item)


def decode(payload: Buffer, *, copy: bool = True) -> dict[str, Any]:
    """Rebuild the item ``encode`` produced from its stored payload (``bytes`` or a view).

    With ``copy=True`` tensors and arrays own their memory.  With ``copy=False`` they are
    views of ``payload`` (read-only where ``payload`` is: numpy arrays say so, torch tensors
    cannot), all through one buffer export of it, which each keeps open (so ``payload``
    cannot be resized or freed under them); torch gives no warning for them.  A payload that
    is not a valid encoding raises :class:`~mmcache.errors.SegmentCorruptError`: every part
    belongs to exactly one value, so nothing decodes into more memory than the payload
    holds.  An allocation that fails anyway raises ``MemoryError``.
    """
    return _core.decode_item(payload, copy=copy)


def pack(item: Mapping[str, Any]) -> bytes:
    """The whole payload of ``item`` as one ``bytes`` object: exactly what the shared-memory
    ring stores for it (part 0, then each buffer at its aligned offset, zero padding between),
    so ``decode(pack(item))`` rebuilds it.  For stores that keep one value per key.

    Encoded and copied in one native call, holding the GIL while it copies out of tensor
    storages: safe while other threads re-point, resize or share the item's tensors (each
    copy is the tensor's bytes before or after, or ``ItemNotEncodableError`` for a storage
    too small for its tensor).  Errors as for :func:`encode`."""
    return _core.pack_item(item)
