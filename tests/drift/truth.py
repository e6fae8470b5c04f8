"""The truth: the items of a model's universe, their hashes and prompt updates, and the
bit-exact fingerprints that resolved items are compared with."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mmcache.items import content_hash, item_size

try:  # Items carry torch tensors whenever torch is installed (it is an optional extra).
    import torch
except ImportError:  # pragma: no cover - the test extras always install torch
    torch = None  # type: ignore[assignment]

__all__ = ["SIZE_CLASSES", "Universe", "count_arrays", "fingerprint"]

# (name, fraction of the capacity, weight)
SIZE_CLASSES = (
    ("tiny", 0.002, 5),
    ("small", 0.03, 6),
    ("medium", 0.12, 4),
    ("large", 0.3, 2),
    ("huge", 0.6, 1),
    ("oversize", 1.3, 1),
)

_TORCH_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int32", "int64", "float64")


def _torch_from_bytes(raw: bytes, dtype_name: str, shape: tuple[int, ...]) -> Any:
    arr = np.frombuffer(bytearray(raw), dtype=np.uint8)
    return torch.from_numpy(arr).view(getattr(torch, dtype_name)).reshape(shape)


class Universe:
    """The truth: item ``i`` (deterministic in ``seed`` and ``i``), its hash and its prompt
    updates.  Item sizes are drawn relative to ``capacity`` (tiny to larger than it)."""

    def __init__(self, seed: int, capacity: int, n_ids: int) -> None:
        self.seed = seed
        self.capacity = capacity
        self.n_ids = n_ids
        self._items: dict[int, dict[str, Any]] = {}
        self._hashes: dict[int, str] = {}
        self._prints: dict[int, Any] = {}
        self._by_hash: dict[str, int] = {}

    def item(self, i: int) -> dict[str, Any]:
        if i not in self._items:
            self._items[i] = self._make(i)
            # Fingerprinted before any cache sees it, so that a cache changing the very
            # object it was given cannot go unnoticed.
            self._prints[i] = fingerprint(self._items[i])
        return self._items[i]

    def hash(self, i: int) -> str:
        if i not in self._hashes:
            h = content_hash(self.item(i), modality="image")
            self._hashes[i] = h
            self._by_hash[h] = i
        return self._hashes[i]

    def hashes(self, ids: Sequence[int]) -> list[str]:
        return [self.hash(i) for i in ids]

    def id_of(self, mm_hash: str) -> int:
        return self._by_hash[mm_hash]

    def fingerprint(self, i: int) -> Any:
        self.item(i)
        return self._prints[i]

    def prompt_updates(self, i: int) -> tuple[str, int, int]:
        return ("image", i, 1 + i % 7)

    def size(self, i: int) -> int:
        return item_size(self.item(i))

    def _make(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, i])
        weights = np.array([w for _, _, w in SIZE_CLASSES], dtype=float)
        cls = int(rng.choice(len(SIZE_CLASSES), p=weights / weights.sum()))
        name, frac, _ = SIZE_CLASSES[cls]
        target = max(8, int(self.capacity * frac * rng.uniform(0.6, 1.2)))
        item: dict[str, Any] = {"id": i, "size_class": name}
        item["image_grid_thw"] = np.array([1, 1 + i % 5, 2 + i % 3], dtype=np.int64)
        body = target - 24
        # The main payload: a torch tensor with random bits (NaN patterns included), or a
        # numpy array when torch is missing or for variety.
        dtype_name = _TORCH_DTYPES[int(rng.integers(len(_TORCH_DTYPES)))]
        share = float(rng.uniform(0.5, 1.0)) if rng.random() < 0.3 else 1.0
        main_bytes = max(0, int(body * share))
        if torch is not None and rng.random() < 0.8:
            itemsize = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
            n = main_bytes // itemsize
            cols = int(rng.integers(1, 9))
            shape = (n // cols, cols) if n >= cols and rng.random() < 0.7 else (n,)
            n = math.prod(shape)
            t = _torch_from_bytes(rng.bytes(n * itemsize), dtype_name, shape)
            if len(shape) == 2 and rng.random() < 0.15:
                t = t.t()  # a non-contiguous view: the caches must make it contiguous
            item["pixel_values"] = t
        else:
            np_dtype = np.dtype(rng.choice(["<f4", "<f8", "<u2", "<i8", "|u1"]))
            n = main_bytes // np_dtype.itemsize
            item["pixel_values"] = np.frombuffer(rng.bytes(n * np_dtype.itemsize), np_dtype)
        rest = body - item_size(item["pixel_values"])
        if rest > 64 and rng.random() < 0.5:
            item["embeds"] = np.frombuffer(rng.bytes((rest // 4) * 4), "<f4").reshape(-1, 1)
        extras = rng.random()
        if extras < 0.25:
            item["meta"] = {
                "tags": ["img", i, 0.5 + i, None, True],
                "raw": rng.bytes(int(rng.integers(0, 600))),
                "pair": (i, f"name-{i}"),
            }
        elif extras < 0.35 and torch is not None:
            item["scale"] = torch.tensor(float(i) / 3.0, dtype=torch.float64)  # 0-dim
            item["empty"] = np.zeros((0, 3), dtype=np.float32)
        return item


def fingerprint(value: Any) -> Any:
    """A canonical, bit-exact description of a value (tensors and arrays by kind, dtype,
    shape and bytes; floats by their bits), for comparing a resolved item with the truth."""
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("T", str(t.dtype), tuple(t.shape), raw)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return ("A", arr.dtype.str, arr.shape, arr.tobytes())
    if isinstance(value, Mapping):
        return ("M", tuple(sorted((k, fingerprint(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("L", tuple(fingerprint(v) for v in value))
    if isinstance(value, tuple):
        return ("U", tuple(fingerprint(v) for v in value))
    if isinstance(value, bool):
        return ("B", value)
    if isinstance(value, float):
        return ("F", struct.pack("<d", value))
    if isinstance(value, int | str | bytes) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, np.generic):
        return ("G", value.dtype.str, value.tobytes())
    return ("?", type(value).__qualname__, repr(value))


def count_arrays(fp: Any) -> int:
    """How many tensors and arrays the :func:`fingerprint` ``fp`` describes."""
    if not isinstance(fp, tuple) or not fp:
        return 0
    if fp[0] in ("T", "A"):
        return 1
    if fp[0] == "M":
        return sum(count_arrays(v) for _, v in fp[1])
    if fp[0] in ("L", "U"):
        return sum(count_arrays(v) for v in fp[1])
    return 0
