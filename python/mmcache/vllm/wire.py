"""vLLM's items and mmcache's, and the handle item that carries a ring handle through vLLM.

Items: a ``MultiModalKwargsItem`` becomes an mmcache item (for every key its element's data
and its field's class and attributes) and back, losslessly, so P0 can write it into the ring
and a worker can rebuild it.  Sizes are vLLM's own (``MultiModalCache.get_item_size``).

Handles travel as a ``MultiModalKwargsItem`` of four int fields: ``address``,
``monotonic_id``, ``signature`` (the signature's bytes as 64-bit little-endian words, zero
padded) and ``signature_nbytes``.  vLLM's IPC carries them as they are, and its scheduler
keeps items with an ``address`` key when it strips prefix-covered payloads.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

import torch
from vllm.multimodal.cache.base import MultiModalCache
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)

from mmcache.items import ShmHandle
from mmcache.vllm.errors import invalid_handle

__all__ = [
    "handle_as_item",
    "handle_from_item",
    "item_from_mmcache",
    "item_to_mmcache",
    "vllm_item_size",
]

_WORD = struct.Struct("<Q")
_U64_END = 1 << 64

_FIELD_CLASSES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (MultiModalBatchedField, MultiModalFlatField, MultiModalSharedField)
}


def _batched(data: Any) -> Any:
    return MultiModalFieldElem(data=data, field=MultiModalBatchedField())


def handle_as_item(handle: ShmHandle) -> Any:
    """The ``MultiModalKwargsItem`` that carries ``handle`` through vLLM (ints only)."""
    signature = handle.signature
    padded = signature + bytes(-len(signature) % _WORD.size)
    return MultiModalKwargsItem(
        {
            "address": _batched(handle.address),
            "monotonic_id": _batched(handle.monotonic_id),
            "signature": _batched([word for (word,) in _WORD.iter_unpack(padded)]),
            "signature_nbytes": _batched(len(signature)),
        }
    )


def _u64(item: Mapping[str, Any], key: str) -> int:
    value = item[key].data
    if type(value) is not int or not 0 <= value < _U64_END:
        raise ValueError(f"{key} must be an int in [0, 2**64), not {value!r}")
    return value


def handle_from_item(item: Mapping[str, Any], mm_hash: str) -> ShmHandle | None:
    """The :class:`ShmHandle` an item carries, ``None`` for an item without ``address`` (plain
    data) or what is no item (for the receiver to refuse, naming what it takes), or
    :class:`InvalidShmHandleError` when its fields do not make a handle."""
    if not isinstance(item, Mapping) or "address" not in item:
        return None
    try:
        words = item["signature"].data
        if not isinstance(words, list) or not all(
            type(w) is int and 0 <= w < _U64_END for w in words
        ):
            raise ValueError("signature must be a list of ints in [0, 2**64)")
        n_bytes = _u64(item, "signature_nbytes")
        if not len(words) * _WORD.size - _WORD.size < n_bytes <= len(words) * _WORD.size:
            raise ValueError(f"{n_bytes} signature bytes do not fill {len(words)} words")
        signature = b"".join(_WORD.pack(w) for w in words)[:n_bytes]
        return ShmHandle(
            address=_u64(item, "address"),
            monotonic_id=_u64(item, "monotonic_id"),
            signature=signature,
        )
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise invalid_handle(mm_hash, f"not a handle item ({exc})") from None


def _slices_out(value: Any) -> Any:
    """Field attributes as mmcache values: a ``slice`` becomes ``{"slice": [start, stop,
    step]}``; lists and tuples keep their type."""
    if isinstance(value, slice):
        return {"slice": [value.start, value.stop, value.step]}
    if isinstance(value, list | tuple):
        return type(value)(_slices_out(v) for v in value)
    return value


def _slices_in(value: Any) -> Any:
    if isinstance(value, dict):
        return slice(*value["slice"])
    if isinstance(value, list | tuple):
        return type(value)(_slices_in(v) for v in value)
    return value


def item_to_mmcache(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``MultiModalKwargsItem`` as an mmcache item: for every key its element's data
    (tensors, lists, numbers) and its field (class name and attributes).  ``TypeError`` for
    a value that is no element, or a field class vLLM 0.33 does not define."""
    out: dict[str, Any] = {}
    for key, elem in item.items():
        if not isinstance(elem, MultiModalFieldElem):
            raise TypeError(
                f"field {key!r}: {type(elem).__qualname__}, not the MultiModalFieldElem a "
                "vLLM item (MultiModalKwargsItem) holds"
            )
        field = elem.field
        name = type(field).__name__
        if _FIELD_CLASSES.get(name) is not type(field):
            raise TypeError(f"field {key!r}: unsupported field type {type(field).__qualname__}")
        attrs = {f.name: _slices_out(getattr(field, f.name)) for f in dataclasses.fields(field)}
        out[key] = {"data": elem.data, "field": name, "attrs": attrs}
    return out


def _owned(data: Any, pin_memory: bool) -> Any:
    """``data`` with every tensor copied into memory of its own (pinned if asked)."""
    if isinstance(data, torch.Tensor):
        return torch.empty(data.shape, dtype=data.dtype, pin_memory=pin_memory).copy_(data)
    if isinstance(data, list | tuple):
        return type(data)(_owned(v, pin_memory) for v in data)
    return data


def item_from_mmcache(item: Mapping[str, Any], *, pin_memory: bool = False) -> Any:
    """The ``MultiModalKwargsItem`` :func:`item_to_mmcache` was given, its tensors copied
    into memory of their own (so ``item`` may hold zero-copy views of shared memory); with
    ``pin_memory``, pinned memory, as vLLM's IPC decoder does where pinning is available."""
    elems = {}
    for key, spec in item.items():
        field = _FIELD_CLASSES[spec["field"]](
            **{name: _slices_in(v) for name, v in spec["attrs"].items()}
        )
        elems[key] = MultiModalFieldElem(data=_owned(spec["data"], pin_memory), field=field)
    return MultiModalKwargsItem(elems)


def vllm_item_size(item: Any) -> int:
    """vLLM's size of an item (what its LRU caches count), as an mmcache ``getsizeof``."""
    return int(MultiModalCache.get_item_size(item))
