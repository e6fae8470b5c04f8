"""Items to and from a payload in shared memory, without pickle and without copying tensors.

An item is encoded as *parts*: part 0 is a small framing prefix plus a msgpack header (field
names, small values inline, and for every tensor, array or large ``bytes`` value its dtype,
shape and the index of the part that holds its bytes); parts 1.. are the raw buffers of
those values, made C-contiguous but otherwise not copied.  The shared-memory core writes the
parts one after another, each starting at the next multiple of :data:`ALIGNMENT` bytes from
the payload start, so a reader finds every part from the header alone and can view it in
place.

Payload layout::

    offset 0        b"MMC1" | header_len: u32 LE | msgpack([part_lengths, tree])
    align64(...)    part 1 (raw bytes)   zero padding
    align64(...)    part 2 (raw bytes)   ...

In the msgpack tree scalars (``None``, ``bool``, ``int``, ``float``, ``str`` and short
``bytes``) stand for themselves; every other value is a list whose first element is a tag
(see ``_LIST`` ... ``_SCALAR``), so no user value can be mistaken for a tagged node.
"""

from __future__ import annotations

import struct
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from mmcache import _core
from mmcache._core import SegmentCorruptError
from mmcache.items import is_tensor

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ALIGNMENT", "OUT_OF_BAND_BYTES", "decode", "encode", "part_offsets", "payload_size"]

ALIGNMENT: int = _core.PART_ALIGNMENT
"""Every part starts at a multiple of this many bytes from the payload start (the core's rule)."""

OUT_OF_BAND_BYTES = 256
"""``bytes`` values at least this long travel as their own part instead of in the header."""

_MAGIC = b"MMC1"
_PREFIX = struct.Struct("<4sI")

# Tags of the tree's list nodes.
_LIST, _TUPLE, _DICT, _ARRAY, _TENSOR, _BYTES, _SCALAR = range(7)

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1

# What parsing a malformed payload can raise (numpy, torch, msgpack, struct).
_MALFORMED = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    RuntimeError,
    struct.error,
    msgpack.UnpackException,
)


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def part_offsets(lengths: Sequence[int]) -> list[int]:
    """Start offset of each part, given every part's length (part 0 included)."""
    offsets: list[int] = []
    end = 0
    for n in lengths:
        start = _align(end) if offsets else 0
        offsets.append(start)
        end = start + n
    return offsets


def payload_size(header: bytes, buffers: Sequence[memoryview]) -> int:
    """Bytes the core stores for ``encode``'s output (padding included, none after the end)."""
    lengths = [len(header), *(b.nbytes for b in buffers)]
    return part_offsets(lengths)[-1] + lengths[-1]


def encode(item: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """Encode ``item`` as (part 0, raw buffers); ``store.put(key, [part0, *buffers])``.

    The buffers are byte-format, C-contiguous views of the item's tensors and arrays (a copy
    is made only for non-contiguous ones); they keep their source alive.  Unsupported values
    raise ``TypeError`` naming the field.
    """
    if not isinstance(item, Mapping):
        raise TypeError(f"an item must be a mapping of field names, not {type(item).__qualname__}")
    buffers: list[memoryview] = []
    tree = _encode_node(item, buffers, "item")
    header = msgpack.packb([[b.nbytes for b in buffers], tree], use_bin_type=True)
    return _PREFIX.pack(_MAGIC, len(header)) + header, buffers


def _encode_node(value: Any, buffers: list[memoryview], path: str) -> Any:
    if value is None or isinstance(value, bool | float | str):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise TypeError(f"field {path}: int {value} does not fit in 64 bits")
        return value
    if isinstance(value, bytes):
        if len(value) < OUT_OF_BAND_BYTES:
            return value
        buffers.append(memoryview(value))
        return [_BYTES, len(buffers)]
    if isinstance(value, np.ndarray):
        dtype = value.dtype
        if dtype.hasobject or dtype.fields is not None or isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"field {path}: unsupported array ({type(value).__name__}, {dtype})")
        arr = value if value.flags.c_contiguous else value.copy(order="C")
        buffers.append(arr.reshape(-1).view(np.uint8).data)
        return [_ARRAY, dtype.str, list(value.shape), len(buffers)]
    if is_tensor(value):
        return _encode_tensor(value, buffers, path)
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return [_SCALAR, value.dtype.str, value.tobytes()]
    if isinstance(value, list | tuple):
        tag = _LIST if isinstance(value, list) else _TUPLE
        return [tag, *(_encode_node(v, buffers, f"{path}[{i}]") for i, v in enumerate(value))]
    if isinstance(value, Mapping):
        node: list[Any] = [_DICT]
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"field {path}: key {k!r} is not a str")
            node += [k, _encode_node(v, buffers, f"{path}[{k!r}]")]
        return node
    raise TypeError(f"field {path}: unsupported type {type(value).__qualname__}")


def _encode_tensor(value: Any, buffers: list[memoryview], path: str) -> list[Any]:
    torch = sys.modules["torch"]
    if value.layout != torch.strided or value.is_quantized:
        raise TypeError(f"field {path}: unsupported tensor ({value.layout}, {value.dtype})")
    t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    # numpy has no bfloat16 (and friends): export every dtype as its raw bytes.
    buffers.append(t.reshape(-1).view(torch.uint8).numpy().data)
    return [_TENSOR, str(t.dtype).removeprefix("torch."), list(t.shape), len(buffers)]


def decode(payload: Buffer, *, copy: bool = True) -> dict[str, Any]:
    """Rebuild the item ``encode`` produced from its stored payload (``bytes`` or a view).

    With ``copy=True`` tensors and arrays own their memory.  With ``copy=False`` they are
    read-only views of ``payload`` (torch tensors included, without torch's non-writable
    warning), each keeping ``payload`` alive.  A payload that is not a valid encoding raises
    :class:`SegmentCorruptError`.
    """
    mv = memoryview(payload).cast("B")
    try:
        magic, header_len = _PREFIX.unpack_from(mv)
        if magic != _MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        lengths, tree = msgpack.unpackb(
            mv[_PREFIX.size : _PREFIX.size + header_len], raw=False, use_list=True
        )
        all_lengths = [_PREFIX.size + header_len, *lengths]
        offsets = part_offsets(all_lengths)
        if offsets[-1] + all_lengths[-1] > mv.nbytes:
            raise ValueError("parts run past the payload")
        parts = [mv[o : o + n] for o, n in zip(offsets[1:], lengths, strict=True)]
        parts.insert(0, mv[:0])  # part indices start at 1
        item = _Decoder(parts, copy).node(tree)
    except _MALFORMED as exc:
        raise SegmentCorruptError(f"payload is not a valid mmcache item: {exc}") from exc
    if not isinstance(item, dict):
        raise SegmentCorruptError("payload is not a valid mmcache item: root is not a mapping")
    return item


class _Decoder:
    """Rebuilds a tree's values from its parts."""

    def __init__(self, parts: list[memoryview], copy: bool) -> None:
        self.parts = parts
        self.copy = copy

    def node(self, node: Any) -> Any:
        if not isinstance(node, list):
            return node
        tag = node[0]
        if tag == _LIST:
            return [self.node(v) for v in node[1:]]
        if tag == _TUPLE:
            return tuple(self.node(v) for v in node[1:])
        if tag == _DICT:
            return {node[i]: self.node(node[i + 1]) for i in range(1, len(node), 2)}
        if tag == _ARRAY:
            return self.array(np.dtype(node[1]), tuple(node[2]), self.parts[node[3]])
        if tag == _TENSOR:
            return self.tensor(node[1], tuple(node[2]), self.parts[node[3]])
        if tag == _BYTES:
            return bytes(self.parts[node[1]])
        if tag == _SCALAR:
            return np.frombuffer(node[2], dtype=np.dtype(node[1]))[0]
        raise ValueError(f"unknown tag {tag!r}")

    def array(self, dtype: np.dtype[Any], shape: tuple[int, ...], buf: memoryview) -> Any:
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        return arr.copy() if self.copy else arr

    def tensor(self, dtype_name: str, shape: tuple[int, ...], buf: memoryview) -> Any:
        import torch

        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype_name!r}")
        if self.copy or buf.nbytes == 0:
            out = torch.empty(shape, dtype=dtype)
            flat = out.reshape(-1).view(torch.uint8)
            if flat.numel() != buf.nbytes:
                raise ValueError(f"{buf.nbytes} bytes do not make a {dtype_name}{list(shape)}")
            flat.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
            return out
        with warnings.catch_warnings():
            # The view is read-only by contract; torch has no read-only tensors and warns.
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def pack(item: Mapping[str, Any]) -> bytes:
    """The whole payload of ``item`` as one ``bytes`` object: exactly what the shared-memory
    ring stores for it (part 0, then each buffer at its aligned offset, zero padding between),
    so ``decode(pack(item))`` rebuilds it.  For stores that keep one value per key."""
    header, buffers = encode(item)
    offsets = part_offsets([len(header), *(b.nbytes for b in buffers)])
    pieces: list[bytes | memoryview] = [header]
    end = len(header)
    for offset, buffer in zip(offsets[1:], buffers, strict=True):
        pieces += [bytes(offset - end), buffer]
        end = offset + buffer.nbytes
    return b"".join(pieces)
