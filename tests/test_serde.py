"""Serde: items to payloads and back, bit-exact, with zero-copy views."""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch

from mmcache import SegmentCorruptError
from mmcache.serde import ALIGNMENT, OUT_OF_BAND_BYTES, decode, encode, part_offsets, payload_size


def store_like_core(item: dict) -> np.ndarray:
    """The payload the core stores for ``item``: parts at 64-byte aligned offsets, zero padding.

    Returned as a read-only uint8 array (weak-referenceable, unlike ``bytes``).
    """
    header, buffers = encode(item)
    parts = [header, *(bytes(b) for b in buffers)]
    offsets = part_offsets([len(p) for p in parts])
    payload = bytearray()
    for offset, part in zip(offsets, parts):
        payload += bytes(offset - len(payload)) + part
    assert len(payload) == payload_size(header, buffers)
    out = np.frombuffer(payload, dtype=np.uint8).copy()
    out.flags.writeable = False
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(a: torch.Tensor, b: object) -> None:
    assert isinstance(b, torch.Tensor)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert raw_bytes(a) == raw_bytes(b)


def assert_same_array(a: np.ndarray, b: object) -> None:
    assert type(b) is np.ndarray
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == b.tobytes()


TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Random bytes reinterpreted: every bit pattern (NaN payloads included) must survive.
    n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_is_bit_exact(dtype: torch.dtype, copy: bool) -> None:
    base = _tensor(dtype, (6, 10), seed=1)
    item = {
        "plain": base,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": _tensor(dtype, (), seed=2),
        "empty": _tensor(dtype, (0, 5)),
    }
    out = decode(store_like_core(item), copy=copy)
    assert list(out) == list(item)
    for name, tensor in item.items():
        assert_same_tensor(tensor, out[name])


NUMPY_ARRAYS = {
    "f4": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "f2": np.linspace(-1, 1, 7, dtype=np.float16),
    "i8_be": np.arange(5, dtype=">i8"),
    "u1": np.arange(256, dtype=np.uint8),
    "bool": np.array([True, False, True]),
    "c16": np.array([1 + 2j, -3j]),
    "datetime": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
    "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
    "strided": np.arange(40, dtype=np.float64)[::3],
    "scalar": np.array(7.25),
    "empty": np.zeros((0, 3), dtype=np.float32),
}


@pytest.mark.parametrize("copy", [True, False])
def test_numpy_round_trip_is_bit_exact(copy: bool) -> None:
    out = decode(store_like_core(NUMPY_ARRAYS), copy=copy)
    for name, arr in NUMPY_ARRAYS.items():
        assert_same_array(arr, out[name])


def test_small_values_and_structure_round_trip() -> None:
    item = {
        "none": None,
        "flags": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63), 2**64 - 1),
        "float": 0.1,
        "nan": float("nan"),
        "text": "naïve ✓",
        "short": b"\x00\x01",
        "long": bytes(range(256)) * 3,
        "exactly_threshold": b"z" * OUT_OF_BAND_BYTES,
        "nested": {"a": [1, (2, {"b": None})], "t": (torch.ones(2),)},
        "np_scalar": np.float32(1.5),
        "np_int": np.int64(-3),
    }
    out = decode(store_like_core(item))
    assert out["ints"] == item["ints"] and type(out["ints"]) is tuple
    assert out["flags"] == [True, False] and type(out["flags"]) is list
    assert out["float"] == 0.1 and np.isnan(out["nan"])
    assert out["text"] == item["text"] and out["none"] is None
    assert out["short"] == item["short"] and out["long"] == item["long"]
    assert out["exactly_threshold"] == item["exactly_threshold"]
    assert out["nested"]["a"] == [1, (2, {"b": None})]
    assert_same_tensor(torch.ones(2), out["nested"]["t"][0])
    assert type(out["np_scalar"]) is np.float32 and out["np_scalar"] == 1.5
    assert type(out["np_int"]) is np.int64 and out["np_int"] == -3


def test_parts_are_aligned_and_tensors_are_not_copied_on_encode() -> None:
    pixels = torch.randn(3, 16, 16)
    grid = np.arange(3, dtype=np.int64)
    header, buffers = encode({"pixels": pixels, "grid": grid, "blob": b"q" * 1000, "tiny": b"t"})
    assert len(buffers) == 3  # tiny bytes stay in the header
    assert np.shares_memory(np.asarray(buffers[0]), pixels.numpy())
    assert np.shares_memory(np.asarray(buffers[1]), grid)
    offsets = part_offsets([len(header), *(b.nbytes for b in buffers)])
    assert offsets[0] == 0 and all(o % ALIGNMENT == 0 for o in offsets)
    payload = store_like_core({"pixels": pixels, "grid": grid, "blob": b"q" * 1000, "tiny": b"t"})
    assert payload[offsets[1] : offsets[1] + pixels.nbytes].tobytes() == raw_bytes(pixels)
    assert payload[offsets[3] :].tobytes() == b"q" * 1000


def test_zero_copy_views_are_read_only_and_keep_the_payload_alive() -> None:
    item = {"t": torch.randn(4, 4, dtype=torch.bfloat16), "a": np.arange(8.0)}
    payload = store_like_core(item)
    alive = weakref.ref(payload)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's non-writable warning would fail the test
        out = decode(payload, copy=False)
    assert np.shares_memory(out["a"], payload) and not out["a"].flags.writeable
    t_addr = out["t"].data_ptr()
    base_addr = payload.ctypes.data
    assert base_addr <= t_addr < base_addr + payload.nbytes
    del payload
    gc.collect()
    assert alive() is not None
    assert_same_tensor(item["t"], out["t"])
    assert_same_array(item["a"], out["a"])
    del out
    gc.collect()
    assert alive() is None


def test_copies_own_their_memory() -> None:
    payload = store_like_core({"t": torch.arange(6), "a": np.arange(6)})
    out = decode(payload, copy=True)
    assert out["a"].flags.writeable and not np.shares_memory(out["a"], payload)
    base = payload.ctypes.data
    assert not base <= out["t"].data_ptr() < base + payload.nbytes
    out["t"][0] = 99  # writable, and the payload is untouched
    assert decode(payload)["t"][0] == 0


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"pixels": [1, object()]}, "pixels"),
        ({"meta": {"ok": 1, "bad": {3}}}, "bad"),
        ({"objs": np.array([None, 1], dtype=object)}, "objs"),
        ({"keys": {1: "x"}}, "keys"),
        ({"huge": 2**64}, "huge"),
        ({"sparse": torch.eye(2).to_sparse()}, "sparse"),
        ({"buf": bytearray(b"x")}, "buf"),
    ],
)
def test_unsupported_values_name_the_field(item: dict, field: str) -> None:
    with pytest.raises(TypeError, match=field):
        encode(item)


def test_item_must_be_a_mapping() -> None:
    with pytest.raises(TypeError):
        encode([torch.ones(1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mangle",
    [
        lambda p: b"XXXX" + p[4:],  # magic
        lambda p: p[:10],  # truncated header
        lambda p: p[: len(p) - 8],  # truncated last part
        lambda p: b"",
    ],
)
def test_corrupt_payloads_raise_segment_corrupt(mangle) -> None:  # type: ignore[no-untyped-def]
    good = store_like_core({"t": torch.ones(10), "a": np.ones(3)}).tobytes()
    with pytest.raises(SegmentCorruptError):
        decode(mangle(good))


def test_numpy_only_items_never_import_torch() -> None:
    code = (
        "import sys, numpy as np; from mmcache.serde import encode, decode, part_offsets;"
        "h, b = encode({'a': np.ones((2, 2)), 'n': [1, 'x']});"
        "parts = [h, *(bytes(x) for x in b)]; p = bytearray();"
        "offsets = part_offsets([len(q) for q in parts]);"
        "[p.extend(bytes(o - len(p)) + q) for o, q in zip(offsets, parts)];"
        "out = decode(bytes(p)); assert out['a'].sum() == 4;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
