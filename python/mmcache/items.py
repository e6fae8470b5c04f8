"""The data model: items, features, their sizes and their content hashes.

An *item* is what a multimodal processor produces for one image, audio clip or video: a
mapping from field name to tensors, arrays and small values.  torch is never imported here;
a value is recognised as a tensor only if torch is already loaded (if it is not, no value can
be a tensor).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from mmcache._core import ShmHandle

__all__ = [
    "CachedItem",
    "Feature",
    "Item",
    "ItemMetadata",
    "ShmHandle",
    "content_hash",
    "is_tensor",
    "item_size",
]

Item: TypeAlias = Mapping[str, Any]
"""Field name -> ``torch.Tensor``, ``numpy.ndarray``, ``bytes``, ``int``, ``float``, ``str``,
``bool``, ``None``, or lists/tuples/dicts of these."""


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor``, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


class Feature:
    """One multimodal item of a request, as P1 and the workers see it.

    ``data`` is the item itself, an :class:`ShmHandle` standing in for it, or ``None`` (the
    sender believes the receiver holds it, or the engine stripped a payload it does not
    need).  The cache key is ``mm_hash or identifier`` (so variants of one item that differ
    only in ``identifier`` share an entry).  Any other keyword becomes an attribute too
    (e.g. ``modality``, ``position``), for the engine's own use.
    """

    data: Item | ShmHandle | None
    mm_hash: str | None
    identifier: str

    def __init__(
        self,
        data: Item | ShmHandle | None = None,
        mm_hash: str | None = None,
        identifier: str = "",
        **extra: Any,
    ) -> None:
        # Its cache key, checked here as the caches check it: the error names where it came from.
        if not (mm_hash is None or isinstance(mm_hash, str)):
            raise TypeError(
                f"Feature: mm_hash must be a str or None, not {type(mm_hash).__qualname__}"
            )
        if not isinstance(identifier, str):
            raise TypeError(
                f"Feature: identifier must be a str, not {type(identifier).__qualname__}"
            )
        if not (mm_hash or identifier):
            raise ValueError("a Feature needs an mm_hash or an identifier (its cache key)")
        for name in extra:
            if hasattr(type(self), name):
                raise TypeError(f"Feature field {name!r} clashes with a Feature attribute")
        self.data = data
        self.mm_hash = mm_hash
        self.identifier = identifier
        self.__dict__.update(extra)

    @property
    def cache_key(self) -> str:
        """The key the caches use: ``mm_hash or identifier``."""
        return self.mm_hash or self.identifier

    @property
    def extra(self) -> dict[str, Any]:
        """The free-form fields (everything but ``data``, ``mm_hash`` and ``identifier``)."""
        return {k: v for k, v in vars(self).items() if k not in ("data", "mm_hash", "identifier")}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "data")
        return f"Feature({fields}, data={type(self.data).__name__})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Feature):
            return NotImplemented
        # Not `vars(self) == vars(other)`: a tensor's == is a tensor, whose truth value raises.
        return _same_value(vars(self), vars(other))

    __hash__ = None  # type: ignore[assignment]  # mutable


def _same_value(a: Any, b: Any) -> bool:
    """Whether two values hold the same data: containers field by field, tensors and arrays
    by dtype, shape and elements, anything else by ``==``."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if is_tensor(a):
        return bool(a.dtype == b.dtype and a.device == b.device and a.equal(b))
    return bool(a == b)


@dataclass(slots=True)
class CachedItem:
    """A full item and its prompt updates, as a P0 cache that keeps data stores it."""

    item: Item
    prompt_updates: Any


@dataclass(frozen=True, slots=True)
class ItemMetadata:
    """What the mirroring sender keeps of an item: its size and its prompt updates."""

    size: int
    prompt_updates: Any

    @classmethod
    def of(cls, item: Item, prompt_updates: Any) -> ItemMetadata:
        """The metadata of ``item``: ``item_size(metadata) == item_size(item)``."""
        return cls(item_size(item), prompt_updates)


def item_size(value: object) -> int:
    """Bytes an item (or any part of one) counts for in a cache.

    Tensors and arrays count their data (``nbytes``; a sparse tensor, its indices' and
    values'), bytes-like values their length, any
    other leaf ``sys.getsizeof``; containers sum their elements (mapping keys do not count).
    :class:`CachedItem` counts its item and :class:`ItemMetadata` its recorded size, so an
    item, the metadata the sender keeps of it and the receiver's copy all have one size.
    Prompt updates never count.
    """
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if is_tensor(value):
        return _tensor_bytes(value)
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, Mapping):
        return sum(item_size(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(item_size(v) for v in value)
    if isinstance(value, CachedItem):
        return item_size(value.item)
    if isinstance(value, ItemMetadata):
        return value.size
    return sys.getsizeof(value)


_COMPRESSED_PARTS = {
    "sparse_csr": ("crow_indices", "col_indices"),
    "sparse_bsr": ("crow_indices", "col_indices"),
    "sparse_csc": ("ccol_indices", "row_indices"),
    "sparse_bsc": ("ccol_indices", "row_indices"),
}
"""The index tensors of torch's compressed sparse layouts, by layout name."""


def _tensor_bytes(tensor: Any) -> int:
    """The bytes a tensor holds: ``nbytes``, or for a sparse one (which has none) those of
    the tensors it is made of (indices and values)."""
    layout = str(tensor.layout).removeprefix("torch.")
    if layout == "strided":
        return int(tensor.nbytes)
    if layout == "sparse_coo":
        return int(tensor._indices().nbytes + tensor._values().nbytes)
    if layout in _COMPRESSED_PARTS:
        parts = [getattr(tensor, name)() for name in _COMPRESSED_PARTS[layout]]
        return int(sum(part.nbytes for part in parts) + tensor.values().nbytes)
    return int(tensor.numel() * tensor.element_size())  # a layout torch may add: as dense


def _user_defined(dtype: np.dtype[Any]) -> str:
    """The user-defined dtypes in ``dtype`` (itself, its fields', its subarrays'), named by
    their scalar types: ``str`` and ``descr`` give each as void bytes of its size (ml_dtypes'
    float8s, float4s and int4s are all "<V1"). Empty when there are none."""
    if dtype.isbuiltin == 2:
        return f"{dtype.type.__module__}.{dtype.type.__qualname__}"
    if dtype.subdtype is not None:
        return _user_defined(dtype.subdtype[0])
    if dtype.fields is None:
        return ""
    kinds = [_user_defined(dtype.fields[name][0]) for name in dtype.names or ()]
    return repr(kinds) if any(kinds) else ""


def content_hash(*parts: object, **kwargs: object) -> str:
    """A full-width (256-bit, hex) hash of content, the same in every process and run.

    Accepts bytes-like values, numpy arrays and torch tensors (hashed by dtype, a record's
    fields and a user-defined dtype's type included, shape and bytes, whatever their memory
    layout, never padding: a record's, a long double's; a masked array's mask too, a
    quantized tensor's values), ``str``, ``int`` (of any size), ``float``, ``bool``, ``None``
    and lists/tuples/dicts of these.  Keyword arguments (e.g. the processor's kwargs) are hashed
    by name, in sorted order, so their order does not matter.  Every value is tagged with its
    type and length, so different inputs cannot collide by concatenation.
    ``TypeError`` naming a value it cannot hash (another type, an object array, a sparse,
    meta or nested tensor).
    """
    h = hashlib.blake2b(digest_size=32, person=b"mmcache.v1")
    _feed(h, list(parts), "parts")
    _feed(h, {name: kwargs[name] for name in sorted(kwargs)}, "kwargs")
    return h.hexdigest()


# An x87 extended-precision long double (x86's) is 10 significant bytes stored in 12 or 16:
# the rest is whatever memory held, and would make equal arrays hash apart in every process.
_LONG_DOUBLE_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else None

# Ints this wide have at most 603 digits, under the smallest limit Python lets a process set
# on converting an int to decimal text (640).
_DECIMAL_INT_BITS = 2000


def _feed(h: Any, value: object, path: str) -> None:
    """Feed one value, tagged and length-prefixed, into the hash ``h``."""

    def tag(code: bytes, payload: bytes | memoryview) -> None:
        h.update(code + struct.pack("<Q", len(payload)))
        h.update(payload)

    if value is None:
        tag(b"N", b"")
    elif isinstance(value, bool):
        tag(b"B", b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        if value.bit_length() <= _DECIMAL_INT_BITS:
            tag(b"I", str(value).encode())
        else:  # decimal text is refused past a per-process limit: the bytes, alike anywhere
            tag(b"J", value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True))
    elif isinstance(value, float):
        tag(b"F", value.hex().encode())
    elif isinstance(value, str):
        tag(b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, bytes | bytearray | memoryview):
        tag(b"Y", memoryview(value).cast("B"))
    elif isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)  # keeps 0-d arrays 0-d, unlike ascontiguousarray
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        if arr.dtype.hasobject:
            raise TypeError(f"content_hash: {path} is an object array, which has no content bytes")
        # A record's fields are not in dtype.str (every layout of 8 bytes is "|V8").
        fields = "" if arr.dtype.names is None else str(arr.dtype.descr)
        tag(b"A", f"{arr.dtype.str}{fields}{_user_defined(arr.dtype)}{arr.shape}".encode())
        if arr.dtype.names is not None:
            # A record's padding is whatever memory held: its fields, packed, are its content.
            from numpy.lib.recfunctions import repack_fields

            arr = np.ascontiguousarray(repack_fields(arr, recurse=True))
        data = arr.reshape(-1).view(np.uint8)
        if _LONG_DOUBLE_BYTES and arr.dtype.type in (np.longdouble, np.clongdouble):
            # Only the significant bytes of each long double (native order first).
            native = arr.astype(arr.dtype.newbyteorder("=")).reshape(-1).view(np.uint8)
            rows = native.reshape(-1, np.dtype(np.longdouble).itemsize)
            data = np.ascontiguousarray(rows[:, :_LONG_DOUBLE_BYTES]).reshape(-1)
        tag(b"D", data.data)
        # Which elements a masked array masks is not in its data: its own tag keeps it apart.
        # (A MaskedArray exists only once numpy.ma is loaded: never imported here.)
        ma = sys.modules.get("numpy.ma")
        if ma is not None and isinstance(value, ma.MaskedArray):
            mask = np.ascontiguousarray(ma.getmaskarray(value))
            tag(b"K", mask.reshape(-1).view(np.uint8).data)
    elif is_tensor(value):
        tensor: Any = value
        torch = sys.modules["torch"]
        # What has no strided bytes to hash is named, with the fix, rather than failing
        # deep inside torch.
        if tensor.is_nested:  # strided or jagged, with no one shape (and no .to_dense())
            raise TypeError(
                f"content_hash: {path} is a nested tensor, which has no one shape: hash its "
                ".unbind() list"
            )
        if tensor.layout != torch.strided:
            raise TypeError(
                f"content_hash: {path} is a {tensor.layout} tensor, which has no contiguous "
                "content bytes: hash its .to_dense()"
            )
        if tensor.is_meta:
            raise TypeError(f"content_hash: {path} is a tensor on the meta device: it has no data")
        t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        tag(b"T", f"{t.dtype}{tuple(t.shape)}".encode())
        if t.is_quantized:  # its bytes are integers whose scale is elsewhere: its values
            t = t.dequantize()
        tag(b"D", t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, list | tuple):
        tag(b"L" if isinstance(value, list) else b"U", struct.pack("<Q", len(value)))
        for i, v in enumerate(value):
            _feed(h, v, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        keys = list(value)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"content_hash: {path} has a non-str key")
        tag(b"M", struct.pack("<Q", len(keys)))
        for k in sorted(keys):
            _feed(h, k, path)
            _feed(h, value[k], f"{path}[{k!r}]")
    else:
        raise TypeError(f"content_hash: {path} has unsupported type {type(value).__qualname__}")
