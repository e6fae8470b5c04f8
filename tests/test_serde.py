"""Serde: items to payloads and back, bit-exact, with zero-copy views."""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import SegmentCorruptError
from mmcache.serde import (
    ALIGNMENT,
    OUT_OF_BAND_BYTES,
    decode,
    encode,
    pack,
    part_offsets,
    payload_size,
)


def store_like_core(item: dict) -> np.ndarray:
    """The payload the core stores for ``item``: parts at 64-byte aligned offsets, zero padding.

    Returned as a read-only uint8 array (weak-referenceable, unlike ``bytes``).
    """
    header, buffers = encode(item)
    parts = [header, *(bytes(b) for b in buffers)]
    offsets = part_offsets([len(p) for p in parts])
    payload = bytearray()
    for offset, part in zip(offsets, parts, strict=True):
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


def test_a_payload_naming_a_key_twice_is_corrupt() -> None:
    """A dict whose header repeats a key would decode with one of its values silently gone."""
    good = pack({"a": 1, "b": torch.ones(2)})
    assert decode(good)["b"].tolist() == [1.0, 1.0]
    twice = good.replace(b"\x01\x00\x00\x00b", b"\x01\x00\x00\x00a")
    assert twice != good
    for copy in (True, False):
        with pytest.raises(SegmentCorruptError, match="twice"):
            decode(twice, copy=copy)


# -- what the encoder refuses --------------------------------------------------------------


def self_containing() -> list:
    loop: list = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"deep": self_containing()}, "deep"),
        ({"meta": {"t": torch.zeros((1,) * 65)}}, "t"),
        ({"huge": 2**64}, "huge"),
        ({"negative": -(2**63) - 1}, "negative"),
    ],
    ids=["nesting", "ndim", "int-above", "int-below"],
)
def test_codec_limits_are_one_exception_type(item: dict, field: str) -> None:
    """Every limit of the format raises ItemNotEncodableError naming the field: a TypeError and
    a ValueError, so callers that caught either before still do."""
    from mmcache._core import ShmObjectStore
    from mmcache.errors import ItemNotEncodableError

    assert issubclass(ItemNotEncodableError, TypeError)
    assert issubclass(ItemNotEncodableError, ValueError)
    with pytest.raises(ItemNotEncodableError, match=field):
        encode(item)
    with (
        ShmObjectStore.create(1 << 20) as writer,
        pytest.raises(ItemNotEncodableError, match=field),
    ):
        writer.put_item("k", item)


def test_numpy_scalars_keep_their_type() -> None:
    """np.float64, np.str_ and np.bytes_ subclass float, str and bytes: still numpy scalars."""
    item = {
        "f8": np.float64(0.1),
        "str": np.str_("naïve"),
        "bytes": np.bytes_(b"ab"),
        "c16": np.complex128(1 - 2j),
        "f4": np.float32(2.5),
        "float": 0.5,
    }
    out = decode(store_like_core(item))
    for name, value in item.items():
        assert type(out[name]) is type(value), name
        assert out[name] == value, name


def test_numpy_integer_types_that_share_a_descriptor_keep_their_type() -> None:
    """np.longlong and np.int64 are two types of one ``dtype.str`` ("<i8" on LP64, which reads
    back as int64): a longlong scalar came back an int64, an array of them one of int64s."""
    item = {
        "q": np.longlong(-5),
        "Q": np.ulonglong(2**64 - 1),
        "q_array": np.array([1, -2], dtype=np.longlong),
        "Q_big_endian": np.array([3, 4], dtype=np.dtype(np.ulonglong).newbyteorder(">")),
        "l": np.int64(6),
    }
    for payload in (store_like_core(item), pack(item)):
        out = decode(payload)
        for name, value in item.items():
            assert out[name].dtype.type is value.dtype.type, name
            assert out[name].dtype == value.dtype, name
            assert out[name].tobytes() == value.tobytes(), name
        assert type(out["q"]) is np.longlong and type(out["Q"]) is np.ulonglong


class DistinctStr(str):
    """A str subclass whose instances are distinct dict keys even when their text is equal."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


class RepeatingMapping(Mapping[str, int]):
    """A mapping whose ``items()`` names one key twice."""

    def __getitem__(self, key: str) -> int:
        return 1

    def __iter__(self) -> Iterator[str]:
        return iter(["k", "k"])

    def __len__(self) -> int:
        return 2

    def items(self) -> Any:
        return [("k", 1), ("k", 2)]


def test_keys_of_one_text_are_refused_not_merged() -> None:
    """Two keys with one text decode as one key: one value would be lost without a word."""
    from mmcache.errors import ItemNotEncodableError

    inner = {"pixels": torch.ones(2), DistinctStr("pixels"): torch.zeros(2)}
    assert len(inner) == 2
    for item, field in (
        (inner, r"item:"),
        ({"meta": inner}, r"item\['meta'\]"),
        ({"m": RepeatingMapping()}, r"item\['m'\]"),
    ):
        for encoder in (encode, pack):
            with pytest.raises(ItemNotEncodableError, match=field + ".*two keys"):
                encoder(item)
    # Distinct texts of a str subclass are fine.
    out = decode(pack({DistinctStr("a"): 1, "b": 2}))
    assert out == {"a": 1, "b": 2}


def test_a_dtype_its_descriptor_does_not_name_is_refused_not_turned_into_void() -> None:
    """A user-defined numpy dtype (ml_dtypes' bfloat16 and float8s, numpy's own test dtype
    rational) has a void descriptor ("<V8"): stored as that, it would come back as raw void
    records, another dtype, so the encoder refuses it, in an array or as a scalar."""
    from numpy._core._rational_tests import rational

    from mmcache.errors import ItemNotEncodableError

    values = np.array([rational(1, 3), rational(2, 5)], dtype=rational)
    assert np.dtype(values.dtype.str) != values.dtype  # what makes it untransportable
    for item, field in (({"frac": values}, "frac"), ({"one": values[0]}, "one")):
        with pytest.raises(ItemNotEncodableError, match=f"{field}.*rational"):
            encode(item)


def test_a_dtype_whose_descriptor_numpy_cannot_read_is_refused_by_name() -> None:
    """ml_dtypes' float8_e5m2 says "<f1", which numpy itself cannot read back: the refusal
    names the field and the dtype, as for any other user-defined dtype."""
    import ml_dtypes  # a test requirement (pyproject's `test` extra)

    from mmcache.errors import ItemNotEncodableError

    values = np.zeros(4, dtype=ml_dtypes.float8_e5m2)
    with pytest.raises(ItemNotEncodableError, match=r"scale.*float8_e5m2.*user-defined"):
        encode({"scale": values})


def _refused_dtypes() -> list[tuple[str, Any, str]]:
    """(case, value, what its refusal must say) for each numpy dtype items cannot hold."""
    import ml_dtypes

    aligned = np.zeros(3, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True))
    fields = (
        r"which is a structured dtype \(records of the fields 'a', 'b'\), a layout items do "
        r"not carry: pass each field as an array of its own \(x\['a'\]\)"
    )
    return [
        ("aligned structured", aligned, fields),
        ("aligned record scalar", aligned[0], r"numpy scalar of dtype .*" + fields),
        ("structured", np.zeros(3, dtype=[("a", "u1"), ("b", "<f8")]), fields),
        ("record array", np.rec.array(np.zeros(2, dtype=[("a", "<f8")])), r"the field 'a'\)"),
        (
            "object",
            np.array([None, 1], dtype=object),
            r"an array of dtype object, which holds references to Python objects \(no other "
            r"process can read them\): pass the values themselves",
        ),
        (
            "object field",
            np.zeros(2, dtype=[("a", "O")]),
            r"holds references to Python objects",
        ),
        (
            "variable-width str",
            np.array(["a", "bc"], dtype=np.dtypes.StringDType()),
            r"StringDType\(\), which keeps its strings outside the array.*astype\('U'\)",
        ),
        (
            "user-defined",
            np.zeros(2, dtype=ml_dtypes.bfloat16),
            r"bfloat16, which is not one of numpy's own \(a user-defined dtype\): its descriptor "
            r"'<V2' names another dtype \(\|V2\).*one of numpy's dtypes, or pass a torch tensor",
        ),
        (
            "unreadable descriptor",
            np.zeros(2, dtype=ml_dtypes.float8_e5m2),
            r"float8_e5m2, which is not one of numpy's own \(a user-defined dtype\): its "
            r"descriptor '<f1' names no dtype numpy reads",
        ),
    ]


@pytest.mark.parametrize(
    ("value", "says"),
    [case[1:] for case in _refused_dtypes()],
    ids=[case[0] for case in _refused_dtypes()],
)
def test_a_refused_numpy_dtype_is_named_with_what_is_wrong_and_what_to_pass(
    value: Any, says: str
) -> None:
    """Each numpy dtype the codec cannot carry is refused saying what the dtype is, why it
    cannot travel, and what to pass instead: the refusals said only "is a structured dtype"
    (an aligned one printed as a dict), StringDType's "holds Python objects" (it holds
    none), a user-defined dtype "is not the one its descriptor names"."""
    from mmcache import ShmSenderCache
    from mmcache.errors import ItemNotEncodableError

    with pytest.raises(ItemNotEncodableError, match=r"item\['x'\]: .*" + says):
        encode({"x": value})
    with (
        ShmSenderCache(0.01) as sender,
        pytest.raises(ItemNotEncodableError, match=r"item\['x'\]: .*" + says),
    ):
        sender.get_and_update_item(({"x": value}, None), "h")


# -- tensors whose memory the encoder must not trust ----------------------------------------


def run_python(code: str) -> tuple[int, str, str]:
    """``code`` in a fresh interpreter (a crash kills it, not the test run)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return out.returncode, out.stdout, out.stderr[-3000:]


# Every way to encode an item: the codec's views, the packed payload, the ring.
ENCODERS = """
import gc, torch
from mmcache import serde
from mmcache._core import ShmObjectStore
writer = ShmObjectStore.create(256 << 20)
reader = ShmObjectStore.attach(writer.handle())
def round_trips(item):
    header, buffers = serde.encode(item)
    viewed = [bytes(b) for b in buffers]
    packed = serde.decode(serde.pack(item))
    key = f"k{id(item)}"
    ringed = reader.resolve_item(writer.put_item(key, item), key)
    writer.invalidate(key)
    return viewed, packed, ringed
def refusals(item):
    out = []
    for name, encode in [("encode", serde.encode), ("pack", serde.pack),
                         ("put_item", lambda i: writer.put_item("refused", i))]:
        try:
            encode(item)
            out.append(f"{name}: accepted")
        except TypeError as e:
            out.append(f"{name}: {e}")
    return out
"""


def assert_refused(code: str, count: int, *fragments: str) -> None:
    """``code`` (which starts with :data:`ENCODERS`) exits 0 in a fresh interpreter having
    printed ``count`` lines (its refusals), each holding every one of ``fragments``."""
    rc, stdout, stderr = run_python(code)
    assert rc == 0, stderr
    lines = stdout.splitlines()
    assert len(lines) == count, stdout
    for line in lines:
        assert all(fragment in line for fragment in fragments), line


def test_a_wrapper_subclass_is_refused_not_read_at_address_zero() -> None:
    """The _make_wrapper_subclass pattern (DTensor, FakeTensor, torchao): CPU, strided,
    contiguous, data_ptr() 0. It killed the process with SIGSEGV."""
    code = (
        ENCODERS
        + """
class Wrapper(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
    def __init__(self, inner):
        self.inner = inner
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.inner if isinstance(x, Wrapper) else x
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})
wrapped = Wrapper(torch.arange(1 << 20, dtype=torch.float32))
assert wrapped.data_ptr() == 0 and wrapped.is_contiguous() and wrapped.is_cpu
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    fake = torch.empty(1 << 20)
for item in ({"pixels": [wrapped]}, {"pixels": [fake]}):
    print(*refusals(item), sep="\\n")
"""
    )
    assert_refused(code, 6, "item['pixels'][0]", "no memory of its own")


def test_a_lying_data_ptr_is_never_read() -> None:
    """A subclass's data_ptr() is not where its bytes are: the encoder reads them from the
    tensor's storage. One whose storage cannot hold it is refused."""
    code = (
        ENCODERS
        + """
class Liar(torch.Tensor):
    def data_ptr(self):
        return 16
class ShortStorage(torch.Tensor):
    def untyped_storage(self):
        return torch.UntypedStorage(8)
class FarOffset(torch.Tensor):
    def storage_offset(self):
        return 1 << 40
values = torch.arange(1 << 20, dtype=torch.float32)
viewed, packed, ringed = round_trips({"t": values.as_subclass(Liar)})
assert viewed == [values.numpy().tobytes()]
assert torch.equal(packed["t"], values) and torch.equal(ringed["t"], values)
print(*refusals({"t": values.as_subclass(ShortStorage)}), sep="\\n")
print(*refusals({"t": values.as_subclass(FarOffset)}), sep="\\n")
"""
    )
    assert_refused(code, 6, "item['t']", "storage of")


def test_a_nested_tensor_is_refused_with_what_to_pass() -> None:
    """A torch.nested tensor of the strided layout says it is a contiguous CPU tensor but has
    no shape: it was refused with torch's own 'Internal error ... Please file an issue'."""
    code = (
        ENCODERS
        + """
import warnings
warnings.simplefilter("ignore")  # torch's nested tensors are a prototype, and say so
nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
assert nested.layout == torch.strided and nested.is_nested
print(*refusals({"patches": [nested]}), sep="\\n")
"""
    )
    assert_refused(code, 3, "item['patches'][0]", "nested tensor", "unbind()")


def test_a_storage_off_the_cpu_is_refused() -> None:
    """The storage's own device decides, whatever the tensor says: one whose storage is on
    the meta device is refused; a tensor made on ``cpu:0`` is read like any other."""
    code = (
        ENCODERS
        + """
class MetaStorage(torch.Tensor):
    def untyped_storage(self):
        return torch.UntypedStorage(1 << 22, device="meta")
values = torch.arange(1 << 20, dtype=torch.float32)
print(*refusals({"t": values.as_subclass(MetaStorage)}), sep="\\n")
indexed = torch.arange(1 << 10, dtype=torch.float32, device="cpu:0")
viewed, packed, ringed = round_trips({"t": indexed})
assert viewed == [indexed.numpy().tobytes()]
assert torch.equal(packed["t"], indexed) and torch.equal(ringed["t"], indexed)
"""
    )
    assert_refused(code, 3, "item['t']", "its storage is on meta")


def test_encoded_views_hold_the_storage_not_the_tensor() -> None:
    """serde.encode's views stay readable after the tensor is re-pointed with set_(): they
    read freed memory when they held the tensor."""
    code = """
import gc, torch
from mmcache import serde
t = torch.full((1 << 22,), 3.0)  # 16 MiB: unmapped as soon as it is freed
header, buffers = serde.encode({"t": t})
t.set_(torch.zeros(1))
gc.collect()
assert bytes(buffers[0]) == torch.full((1 << 22,), 3.0).numpy().tobytes()
print("ok")
"""
    rc, stdout, stderr = run_python(code)
    assert rc == 0 and stdout.strip() == "ok", stderr


@pytest.mark.parametrize("encoder", ["pack", "put_item"])
@pytest.mark.parametrize("mutation", ["set_", "resize_"])
def test_another_thread_repointing_or_freeing_the_storage(encoder: str, mutation: str) -> None:
    """A thread re-points the tensor at fresh storages (``set_``) or frees its storage
    (``untyped_storage().resize_(0)``) in a loop while this one encodes it: every decoded
    tensor is the old or the new content, or the encoder refuses a storage too small for
    the tensor, never garbage and never a crash."""
    code = (
        ENCODERS
        + f"""
import collections, itertools, sys, threading
from mmcache.errors import ItemNotEncodableError
sys.setswitchinterval(1e-5)  # hand the GIL over as often as the interpreter can
N = 1 << 22
old, new = torch.full((N,), 1.0), torch.full((N,), 2.0)
t = old.clone()
stop = False
def mutate():
    for i in itertools.count():
        if stop:
            return
        if {mutation == "resize_"}:
            t.untyped_storage().resize_(0)  # frees the memory being encoded, if it is
        # Most likely where memory was just freed (by resize_ or the last set_): 7s are what
        # a read of freed memory would see.
        junk = torch.full((N,), 7.0)
        t.set_((old, new)[i % 2].clone())  # frees the storage t had, unless it is held
def encode(i):
    if "{encoder}" == "pack":
        return serde.decode(serde.pack({{"t": t}}))["t"]
    key = f"k{{i}}"
    out = reader.resolve_item(writer.put_item(key, {{"t": t}}), key)["t"]
    writer.invalidate(key)
    return out
thread = threading.Thread(target=mutate)
thread.start()
seen = collections.Counter()
try:
    for i in range(150):
        try:
            out = encode(i)
        except ItemNotEncodableError as e:
            assert "storage of 0 bytes" in str(e), e
            seen["refused"] += 1
            continue
        assert torch.equal(out, old) or torch.equal(out, new), "garbage"
        seen["old" if torch.equal(out, old) else "new"] += 1
finally:
    stop = True
    thread.join()
print(dict(seen))
"""
    )
    rc, stdout, stderr = run_python(code)
    assert rc == 0, stderr
    assert stdout.strip().startswith("{"), stdout
