"""The native item codec: every dtype round trips bit-exact (through a payload and through the
ring, copied and zero-copy), malformed payloads are a SegmentCorruptError, the copy path owns
its memory, and the store's hot-path helpers."""

from __future__ import annotations

import collections
import gc
import math
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache import ItemNotEncodableError, SegmentCorruptError, serde
from mmcache._core import ShmObjectStore, ShmReader, ShmWriter

# torch warns whenever it makes a complex32 tensor (encoding a strided one makes a copy).
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

# Every torch dtype the codec carries: those with a DLPack type and those that travel as
# bytes and are re-viewed (sub-byte integers, bit types).
TORCH_DTYPES = [
    getattr(torch, name)
    for name in (
        "float32 float16 bfloat16 float64 int64 int32 int16 int8 uint8 uint16 uint32 uint64 "
        "bool complex32 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
        "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 int1 int2 int3 int4 int5 int6 int7 "
        "uint1 uint2 uint3 uint4 uint5 uint6 uint7 bits1x8 bits2x4 bits4x2 bits8 bits16"
    ).split()
]

# torch stores these a byte per element but cannot copy them: they only come contiguous.
SUB_BYTE = {getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in range(1, 8)}

NUMPY_DTYPES = [
    np.dtype(d)
    for d in ("<f4 >f8 <f2 <i8 >i4 |i1 |u1 <u2 |b1 <c8 >c16 <M8[D] <m8[ms] <U3 |S5 |V3".split())
]


def raw(value: Any) -> bytes:
    """A tensor's or array's bytes, whatever its dtype."""
    if isinstance(value, torch.Tensor):
        return value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(np.ascontiguousarray(value).reshape(-1).view(np.uint8))


def same(a: Any, b: Any) -> bool:
    """Same type, structure, dtypes, shapes and bits (NaN payloads and -0.0 included)."""
    if isinstance(a, torch.Tensor):
        return (
            type(b) is torch.Tensor
            and a.dtype == b.dtype
            and a.shape == b.shape
            and raw(a) == raw(b)
        )
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
        )
    if isinstance(a, np.generic):
        return type(b) is type(a) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def tensor_of(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    flat = torch.tensor(list(data), dtype=torch.uint8)
    if dtype == torch.bool:
        flat = flat % 2
    return flat.view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape) * dtype.itemsize
    t = tensor_of(dtype, shape, draw(st.binary(min_size=n, max_size=n)))
    if t.dim() >= 2 and dtype not in SUB_BYTE and draw(st.booleans()):
        t = t.transpose(0, 1)  # not contiguous: materialised on encode
    if t.is_complex() and draw(st.booleans()):
        t = t.conj()  # a lazy conjugate: resolved on encode
    return t


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape) * dtype.itemsize
    data = draw(st.binary(min_size=n, max_size=n))
    a = np.frombuffer(data, dtype=np.uint8).copy()
    if dtype.kind == "b":
        a %= 2
    a = a.view(dtype).reshape(shape)
    return a[::-1] if a.ndim and draw(st.booleans()) else a


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=600),  # both sides of OUT_OF_BAND_BYTES
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.bool_, st.booleans()),
)

values = st.recursive(
    st.one_of(scalars, tensors(), arrays()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)

items = st.dictionaries(st.text(max_size=12), values, max_size=6)


def expected(value: Any) -> Any:
    """What decoding gives back: what was encoded, with tensors as their values stand."""
    if isinstance(value, torch.Tensor):
        return value.resolve_conj().contiguous()
    if isinstance(value, np.ndarray):
        return value.copy(order="C")
    if isinstance(value, list | tuple):
        return type(value)(expected(v) for v in value)
    if isinstance(value, dict):
        return {k: expected(v) for k, v in value.items()}
    return value


def payload_of(item: dict[str, Any]) -> bytes:
    """The payload the store would hold for ``item``."""
    header, buffers = serde.encode(item)
    parts = [header, *(bytes(b) for b in buffers)]
    out = bytearray()
    for offset, part in zip(serde.part_offsets([len(p) for p in parts]), parts, strict=True):
        out += bytes(offset - len(out)) + part
    assert len(out) == serde.payload_size(header, buffers)
    return bytes(out)


@pytest.fixture(scope="module")
def ring() -> Iterator[tuple[ShmWriter, ShmReader]]:
    writer = ShmObjectStore.create(64 << 20, n_readers=1)
    reader = ShmObjectStore.attach(writer.handle())
    yield writer, reader
    reader.close()
    writer.close()


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@PROPERTY
@given(item=items)
def test_any_item_round_trips_bit_exact_through_a_payload(item: dict[str, Any]) -> None:
    payload = payload_of(item)
    want = expected(item)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch warning for read-only memory either
        for copy in (True, False):
            assert same(want, serde.decode(payload, copy=copy))


_keys = iter(range(10**9))


@PROPERTY
@given(item=items)
def test_any_item_round_trips_bit_exact_through_the_ring(
    ring: tuple[ShmWriter, ShmReader], item: dict[str, Any]
) -> None:
    writer, reader = ring
    key = f"item-{next(_keys)}"
    first = writer.put_item(key, item)
    second = writer.issue(key)
    want = expected(item)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same(want, reader.resolve_item(first, key, copy=True))
        view = reader.resolve_item(second, key, copy=False)
        assert same(want, view)
    assert same(want, writer.get_item(writer.issue(key), key))  # the writer's own read
    del view
    writer.invalidate(key)


@PROPERTY
@given(item=items, data=st.data())
def test_corrupt_payloads_raise_segment_corrupt(item: dict[str, Any], data: st.DataObject) -> None:
    payload = bytearray(payload_of(item))
    header_len = struct.unpack_from("<I", payload, 4)[0]
    for _ in range(data.draw(st.integers(1, 6))):
        # Mostly the header (where a flip changes meaning), sometimes anywhere.
        limit = header_len if data.draw(st.booleans()) else len(payload)
        payload[data.draw(st.integers(0, limit - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    for mangled in (bytes(payload), bytes(payload[:cut])):
        for copy in (True, False):
            try:
                out = serde.decode(mangled, copy=copy)
            except SegmentCorruptError:
                continue
            assert isinstance(out, dict)  # a flip that still makes a valid item


# Every dtype the running torch defines, but the quantized ones (refused on purpose: their
# scale is not in their bytes): a dtype a newer torch adds (bcomplex32) must be carried too.
EVERY_TORCH_DTYPE = sorted(
    {
        value
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype) and not name.startswith("q")
    },
    key=str,
)


@pytest.mark.parametrize("dtype", EVERY_TORCH_DTYPE, ids=str)
def test_every_torch_dtype_round_trips_through_a_payload_and_the_ring(
    ring: tuple[ShmWriter, ShmReader], dtype: torch.dtype
) -> None:
    writer, reader = ring
    item = {
        "t": tensor_of(dtype, (2, 3), bytes(range(6 * dtype.itemsize))),
        "scalar": tensor_of(dtype, (), bytes(range(dtype.itemsize))),
        "empty": tensor_of(dtype, (0, 4), b""),
    }
    key = f"every-dtype-{dtype}"
    handle = writer.put_item(key, item)
    for copy in (True, False):
        assert same(item, serde.decode(serde.pack(item), copy=copy)), copy
        assert same(item, reader.resolve_item(writer.issue(key), key, copy=copy)), copy
    reader.resolve_item(handle, key)
    writer.invalidate(key)


def test_every_truncation_is_corrupt() -> None:
    payload = payload_of({"t": torch.arange(10), "a": np.ones(3), "b": b"x" * 300, "n": [1]})
    for cut in range(len(payload)):
        with pytest.raises(SegmentCorruptError):
            serde.decode(payload[:cut])


def test_object_dtypes_in_a_payload_are_refused() -> None:
    """A descriptor flipped to numpy's object dtype must not make pointers of shared bytes."""
    payload = bytearray(payload_of({"a": np.zeros(2, dtype="<i8")}))
    at = payload.index(b"<i8")
    payload[at : at + 3] = b"|O8"
    with pytest.raises(SegmentCorruptError, match="Python objects"):
        serde.decode(bytes(payload))


def test_other_format_versions_are_refused_with_the_reason() -> None:
    payload = bytearray(payload_of({"a": 1}))
    assert payload[:4] == b"MMC2"
    payload[3] = ord("1")
    with pytest.raises(SegmentCorruptError, match="version '1'"):
        serde.decode(bytes(payload))


def test_views_freed_by_the_garbage_collector_inside_a_native_call() -> None:
    """torch frees a tensor with the GIL released, even when the collector runs inside one of
    our own calls: the DLPack deleter must take the GIL itself to drop what it holds. (It
    crashed the interpreter when it trusted PyO3's belief that the GIL was held.)"""
    code = """
import gc, torch, numpy as np
from mmcache import serde
payload = serde.pack({"t": torch.arange(4.0)})
item = {"a": np.arange(3)}
gc.set_threshold(1, 1, 1)  # collect at (nearly) every allocation, ours included
for _ in range(3000):
    view = serde.decode(payload, copy=False)
    cycle = [view]
    cycle.append(cycle)  # only the collector frees the tensor
    del view, cycle
    serde.encode(item)  # allocates inside a native call
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_lazy_negation_is_resolved_on_encode() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    negated = z.conj().imag  # a real tensor with torch's negative bit
    assert negated.is_neg()
    out = serde.decode(payload_of({"im": negated}))
    assert out["im"].tolist() == [-2.0, 4.0] and not out["im"].is_neg()


def test_a_contiguous_lazy_negation_is_resolved_on_encode(
    ring: tuple[ShmWriter, ShmReader],
) -> None:
    # A one-element (or 0-d) negated view is contiguous: its bytes still hold the values
    # before the negation, so encoding them in place would send +2 for -2.
    items = {
        "one": torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag,
        "scalar": torch.tensor(3 - 4j, dtype=torch.complex128).conj().imag,
    }
    for t in items.values():
        assert t.is_neg() and t.is_contiguous()
    want = {"one": [-2.0], "scalar": 4.0}
    out = serde.decode(payload_of(items))
    assert {k: v.tolist() for k, v in out.items()} == want
    writer, reader = ring
    handle = writer.put_item("negated", items)
    for got in (
        reader.resolve_item(handle, "negated", copy=True),
        writer.get_item(writer.issue("negated"), "negated"),
    ):
        assert {k: v.tolist() for k, v in got.items()} == want
        assert not any(v.is_neg() for v in got.values())


# -- the copy path -------------------------------------------------------------------------


def in_mapping(t: torch.Tensor, mapping: tuple[int, int]) -> bool:
    start, length = mapping
    return start <= t.data_ptr() < start + length


def test_copies_own_torch_memory_and_release_the_ring(
    ring: tuple[ShmWriter, ShmReader],
) -> None:
    writer, reader = ring
    item = {
        "a": torch.arange(1000, dtype=torch.float32),
        "b": torch.ones(3, 5, dtype=torch.bfloat16),
        "arr": np.arange(7),
    }
    handle = writer.put_item("copied", item)
    out = reader.resolve_item(handle, "copied", copy=True)
    mapping = reader.view_mapping()
    for name in ("a", "b"):
        assert not in_mapping(out[name], mapping)
    assert out["arr"].flags.writeable and out["arr"].flags.owndata
    assert writer.stats()["views"] == 0, "a copy holds no view of the ring"
    out["a"][0] = 42.0  # writable, and the ring is untouched
    again = reader.resolve_item(writer.issue("copied"), "copied", copy=True)
    assert again["a"][0] == 0.0 and same(item["b"], again["b"])
    writer.invalidate("copied")


def test_zero_copy_views_point_into_the_read_only_mapping(
    ring: tuple[ShmWriter, ShmReader],
) -> None:
    writer, reader = ring
    item = {"t": torch.arange(64, dtype=torch.int16), "a": np.arange(5.0)}
    view = reader.resolve_item(writer.put_item("viewed", item), "viewed", copy=False)
    assert in_mapping(view["t"], reader.view_mapping())
    assert not view["a"].flags.writeable
    assert writer.stats()["views"] == 1
    tensor = view["t"]
    del view
    gc.collect()
    assert writer.stats()["views"] == 1, "the tensor alone keeps the object"
    del tensor
    gc.collect()
    assert writer.stats()["views"] == 0
    writer.invalidate("viewed")


def test_large_items_copy_with_every_byte(ring: tuple[ShmWriter, ShmReader]) -> None:
    """Above the GIL-release threshold, and several tensors in one copy buffer."""
    writer, reader = ring
    g = torch.Generator().manual_seed(7)
    item = {
        "pixels": torch.randn(3, 448, 448, generator=g),
        "grid": torch.randint(0, 99, (1, 3), generator=g),
        "mask": torch.rand(448, 448, generator=g) > 0.5,
        "raw": bytes(range(256)) * 1000,
    }
    out = reader.resolve_item(writer.put_item("large", item), "large", copy=True)
    assert same(item, out)
    writer.invalidate("large")


def test_copies_are_aligned_and_apart_in_every_rank(ring: tuple[ShmWriter, ShmReader]) -> None:
    """0 to 8 dimensions (past those a DLPack export keeps inline), empty tensors among
    them: each copy bit-exact, 64-byte aligned, writable without touching its neighbours."""
    writer, reader = ring
    shapes = [(), (0,), (5,), (2, 3), (1, 0, 2), (2, 1, 3, 2), (1, 2, 1, 2, 3), (2,) * 6, (1,) * 8]
    item = {
        f"t{i}": torch.arange(math.prod(shape), dtype=torch.int16).reshape(shape) + i
        for i, shape in enumerate(shapes)
    }
    out = reader.resolve_item(writer.put_item("ranks", item), "ranks", copy=True)
    assert same(item, out)
    assert all(t.data_ptr() % 64 == 0 for t in out.values() if t.numel())
    names = list(out)
    for i, name in enumerate(names):
        out[name].fill_(-1)  # a copy is its own: the tensors not yet filled keep their values
        assert all(same(item[n], out[n]) for n in names[i + 1 :])
    writer.invalidate("ranks")


def test_keys_round_trip_past_the_key_cache() -> None:
    """More distinct keys than the decoder caches, some too long to cache, some sharing a
    slot: every item decodes, twice, to exactly its own keys and values."""
    items = [{f"field_{i}": i, "x" * (60 + i % 10): -i, f"{i}é": str(i)} for i in range(300)]
    payloads = [serde.pack(item) for item in items]
    for _ in range(2):
        for item, payload in zip(items, payloads, strict=True):
            assert serde.decode(payload) == item


def test_pin_memory_applies_to_copies_only(ring: tuple[ShmWriter, ShmReader]) -> None:
    writer, reader = ring
    handle = writer.put_item("pinned", {"t": torch.ones(2)})
    with pytest.raises(ValueError, match="pins copies"):
        reader.resolve_item(handle, "pinned", copy=False, pin_memory=True)
    writer.release(handle)
    writer.invalidate("pinned")


# -- the store's hot-path helpers ----------------------------------------------------------


def test_issue_if_present_and_pin_if_present_answer_instead_of_raising(
    ring: tuple[ShmWriter, ShmReader],
) -> None:
    writer, reader = ring
    assert writer.issue_if_present("absent") is None
    assert writer.pin_if_present("absent") is False
    handle = writer.put_item("present", {"x": 1})
    assert writer.pin_if_present("present") is True
    hit = writer.issue_if_present("present")
    assert hit == handle, "the same object, one more reference"
    for h in (handle, hit):
        assert reader.resolve_item(h, "present") == {"x": 1}
    writer.unpin("present")
    writer.invalidate("present")


def test_view_mapping_is_the_readers() -> None:
    with ShmObjectStore.create(1 << 20) as writer:
        assert not hasattr(writer, "view_mapping")
        with ShmObjectStore.attach(writer.handle()) as reader:
            address, length = reader.view_mapping()
            assert address > 0 and length > writer.capacity


# -- hostile payloads: no payload decodes into more memory than it holds -------------------


def raw_payload(tree: bytes, part_lens: list[int]) -> bytes:
    """A payload as a forger would write it: part 0 with this value tree and part table, then
    zero-filled parts at their aligned offsets (the encoder never writes such trees)."""
    header_len = 16 + 8 * len(part_lens) + len(tree)
    header = (
        b"MMC2"
        + struct.pack("<III", header_len, len(part_lens), 0)
        + struct.pack(f"<{len(part_lens)}Q", *part_lens)
        + tree
    )
    end = serde.part_offsets([header_len, *part_lens])[-1] + part_lens[-1]
    return header + bytes(end - header_len)


def part_node(kind: str, part: int, nbytes: int) -> bytes:
    """A node naming ``part`` (1-based) of ``nbytes`` bytes: a uint8 tensor, array or bytes."""
    if kind == "tensor":
        return b"\x0c\x05uint8\x01" + struct.pack("<QI", nbytes, part)
    if kind == "array":
        return b"\x0d\x03|u1\x01" + struct.pack("<QI", nbytes, part)
    return b"\x08" + struct.pack("<I", part)


def dict_tree(values: list[bytes]) -> bytes:
    """A root dict of ``values`` under the keys ``"0"``, ``"1"``, ..."""
    entries = b"".join(
        struct.pack("<I", len(str(i))) + str(i).encode() + v for i, v in enumerate(values)
    )
    return b"\x0b" + struct.pack("<I", len(values)) + entries


def list_tree(value: bytes, count: int) -> bytes:
    """A root dict whose one entry is a list of ``count`` copies of ``value``."""
    return dict_tree([b"\x09" + struct.pack("<I", count) + value * count])


@pytest.mark.parametrize("kind", ["tensor", "array", "bytes"])
@pytest.mark.parametrize("copy", [True, False])
def test_a_part_named_by_two_values_is_corrupt(kind: str, copy: bool) -> None:
    """64 values naming one 256 KiB part decoded into 16 MiB (each copied once)."""
    size = 256 << 10
    amplified = raw_payload(list_tree(part_node(kind, 1, size), 64), [size])
    with pytest.raises(SegmentCorruptError, match="part 1 is named by two values"):
        serde.decode(amplified, copy=copy)
    mixed = raw_payload(dict_tree([part_node(kind, 1, size), part_node("tensor", 1, size)]), [size])
    with pytest.raises(SegmentCorruptError, match="part 1 is named by two values"):
        serde.decode(mixed, copy=copy)


def test_a_part_named_by_no_value_is_corrupt() -> None:
    payload = raw_payload(dict_tree([part_node("bytes", 2, 300)]), [300, 300])
    with pytest.raises(SegmentCorruptError, match="part 1 is named by no value"):
        serde.decode(payload)


def run_python(code: str, stdin: bytes = b"") -> tuple[int, str, str]:
    """``code`` in a fresh interpreter (what would crash this process crashes that one):
    its exit status, stdout and stderr."""
    out = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, timeout=300
    )
    return out.returncode, out.stdout.decode(), out.stderr.decode(errors="replace")[-3000:]


# Caps the child's address space a little above what it uses once its payload is read, so
# that an allocation of the size a payload asks for fails at once (and never swaps).
CAP_MEMORY = """
import resource
def cap_memory(extra):
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))
"""


def test_a_small_payload_never_asks_for_a_huge_arena() -> None:
    """196608 tensors naming one 8 MiB part: a 12 MiB payload that asked torch for a 1.5 TiB
    copy arena, whose RuntimeError escaped."""
    size = 8 << 20
    payload = raw_payload(list_tree(part_node("tensor", 1, size), 196_608), [size])
    code = (
        CAP_MEMORY
        + """
import sys, torch
from mmcache import serde, SegmentCorruptError
payload = sys.stdin.buffer.read()
cap_memory(1 << 30)
try:
    serde.decode(payload, copy=True)
except SegmentCorruptError as e:
    print("corrupt:", e)
"""
    )
    rc, stdout, stderr = run_python(code, payload)
    assert rc == 0 and "named by two values" in stdout, stderr


def test_a_failed_allocation_is_a_memory_error() -> None:
    """Every allocation of the decoder (torch's copy arena, numpy, bytes) maps its failure to
    a MemoryError, never a stray RuntimeError."""
    code = (
        CAP_MEMORY
        + """
import numpy as np, torch
from mmcache import serde
payloads = [
    serde.pack({"t": torch.zeros(32 << 20, dtype=torch.uint8)}),
    serde.pack({"a": np.zeros(32 << 20, dtype=np.uint8)}),
    serde.pack({"b": bytes(32 << 20)}),
]
cap_memory(16 << 20)
for payload in payloads:
    try:
        serde.decode(payload, copy=True)
    except MemoryError as e:
        print(type(e).__name__, "(a MemoryError):", str(e)[:60].replace(chr(10), " "))
"""
    )
    rc, stdout, stderr = run_python(code)
    assert rc == 0 and stdout.count("(a MemoryError)") == 3, (stdout, stderr)
    assert "cannot allocate" in stdout.splitlines()[0], stdout


def bytearray_exports(buffer: bytearray) -> int:
    """How many buffer exports of ``buffer`` are open (CPython's ``ob_exports``, the last field
    of a bytearray object), checked against a memoryview of our own."""
    import ctypes

    field = ctypes.c_ssize_t.from_address(id(buffer) + bytearray.__basicsize__ - 8)
    before = field.value
    with memoryview(buffer):
        assert field.value == before + 1, "not CPython's bytearray layout"
    return field.value


def test_zero_copy_decoding_holds_the_one_export_its_pointer_came_from() -> None:
    """Views hold exactly the export their bytes were read through: an exporter may return
    other memory for every export (``__buffer__``, from Python 3.12)."""
    item = {"t": torch.arange(16, dtype=torch.int32), "a": np.arange(4.0), "b": b"x" * 300}
    payload = bytearray(serde.pack(item))
    out = serde.decode(payload, copy=False)
    assert bytearray_exports(payload) == 1
    assert out["a"].flags.writeable, "a view of a writable payload is writable"
    tensor, array = out.pop("t"), out.pop("a")
    del out
    gc.collect()
    assert bytearray_exports(payload) == 1
    del tensor
    gc.collect()
    assert bytearray_exports(payload) == 1, "the array holds the export"
    with pytest.raises(BufferError):
        payload.extend(b"x")  # which would move the memory the array views
    array[0] = 7.0
    assert serde.decode(payload)["a"][0] == 7.0, "the array views the payload"
    del array
    gc.collect()
    assert bytearray_exports(payload) == 0
    assert not serde.decode(serde.pack(item), copy=False)["a"].flags.writeable


# -- values a walk or a hostile header could get wrong ------------------------------------------


@pytest.mark.parametrize(
    "scalar",
    [np.str_(""), np.bytes_(b""), np.array(["ab", ""])[1]],
    ids=["str_", "bytes_", "str_ of an array"],
)
def test_an_empty_numpy_string_scalar_round_trips(scalar: Any) -> None:
    """Their dtype has no size (``<U0``, ``|S0``) while their bytes are one NUL item."""
    out = serde.decode(serde.pack({"s": scalar}))["s"]
    assert type(out) is type(scalar) and out == scalar


@pytest.mark.parametrize(
    "scalar",
    [
        np.str_("a\x00"),
        np.bytes_(b"a\x00\x00"),
        np.str_("\x00"),
        np.bytes_(b"\x00"),
        np.str_("\ud800"),
    ],
    ids=["str_", "bytes_", "str_ NUL", "bytes_ NUL", "str_ surrogate"],
)
def test_a_numpy_string_scalar_keeps_its_trailing_nuls(scalar: Any) -> None:
    """A str_ or bytes_ scalar's dtype is its own length, trailing NULs included: rebuilt
    through an array (which takes them for padding) they were gone, and the dtype shorter."""
    out = serde.decode(serde.pack({"s": scalar}))["s"]
    assert type(out) is type(scalar) and out.dtype == scalar.dtype
    assert out == scalar and out.tobytes() == scalar.tobytes()


def test_an_empty_void_scalar_is_refused_when_encoded() -> None:
    with pytest.raises(ItemNotEncodableError, match=r"item\['v'\]"):
        serde.pack({"v": np.void(b"")})


def test_a_header_with_a_sizeless_string_dtype_is_corrupt_not_an_allocation() -> None:
    """``|S0`` items, 2^33 of them, in a part of no bytes: numpy would make them one byte each
    and hand back 8 GiB of uninitialised memory."""
    payload = bytearray(serde.pack({"a": np.zeros((0,), dtype="S1")}))
    at = payload.index(b"|S1")
    payload[at : at + 3] = b"|S0"
    payload[at + 4 : at + 12] = (1 << 33).to_bytes(8, "little")
    for copy in (True, False):
        with pytest.raises(SegmentCorruptError, match="no size"):
            serde.decode(bytes(payload), copy=copy)


def test_a_header_with_strides_torch_cannot_hold_is_corrupt() -> None:
    """An empty tensor of shape (0, 2^63-1, 2^63-1): no bytes, but strides past int64, which
    torch refuses to build (``torch.empty``) and which came back saturated, a tensor whose
    every reshaping raised later, in the worker."""
    big = (1 << 63) - 1
    with pytest.raises(RuntimeError, match="overflow"):
        torch.empty((0, big, big))
    node = b"\x0c\x07float32\x03" + struct.pack("<QQQI", 0, big, big, 1)
    for copy in (True, False):
        with pytest.raises(SegmentCorruptError, match="strides"):
            serde.decode(raw_payload(dict_tree([node]), [0]), copy=copy)
    # The largest shapes torch does build still round trip.
    for shape in [(0, 1 << 31, 1 << 31), (1 << 62, 0, 1)]:
        t = torch.empty(shape, dtype=torch.uint8)
        for copy in (True, False):
            out = serde.decode(serde.pack({"t": t}), copy=copy)["t"]
            assert out.shape == t.shape and out.stride() == t.stride()


def test_an_empty_tensor_of_a_huge_dimension_round_trips() -> None:
    """torch builds a float32 tensor of shape (2^63-1, 0): no bytes, but its first dimension
    times the item size overflowed before the 0 was reached, and it was refused as too large."""
    t = torch.empty(((1 << 63) - 1, 0))
    for copy in (True, False):
        out = serde.decode(serde.pack({"t": t}), copy=copy)["t"]
        assert out.shape == t.shape and out.dtype == t.dtype


def test_a_dict_changed_while_its_values_are_walked_is_encoded_as_it_was() -> None:
    class Grows(dict[str, Any]):
        """A mapping (not a plain dict, so walked through ``items()``) that adds a key to
        the item holding it when walked."""

        def __init__(self, outer: dict[str, Any]) -> None:
            super().__init__()
            self.outer = outer

        def items(self) -> Any:
            self.outer["late"] = 1
            return iter(())

    item: dict[str, Any] = {"a": None, "b": 2}
    item["a"] = Grows(item)
    assert serde.decode(serde.pack(item)) == {"a": {}, "b": 2}
    # A dict subclass (walked through its items()) alike: it raised "OrderedDict mutated
    # during iteration" ("dictionary changed size" for a defaultdict) and was refused.
    for subclass in (collections.OrderedDict(), collections.defaultdict(int)):
        subclass.update(a=Grows(subclass), b=2)
        assert serde.decode(serde.pack(subclass)) == {"a": {}, "b": 2}, type(subclass)
        subclass.pop("late")
        assert serde.decode(payload_of({"m": subclass}))["m"] == {"a": {}, "b": 2}


def test_a_list_changed_while_its_values_are_walked_is_encoded_as_it_was() -> None:
    """A list walked by index met its fields again (or skipped them) once something shifted
    it mid-walk: here a value's own code, as another thread could whenever the walk runs
    Python code or releases the GIL (making a strided tensor contiguous does)."""

    class Shifts(dict[str, Any]):
        """A mapping (walked through ``items()``) that puts a value in front of the list
        holding it, the first time it is walked."""

        def __init__(self, outer: list[Any]) -> None:
            super().__init__()
            self.outer = outer

        def items(self) -> Any:
            if self.outer[0] != "early":
                self.outer.insert(0, "early")
            return iter(())

    walked: list[Any] = []
    shifts = Shifts(walked)
    for encoder in (serde.pack, payload_of):
        walked[:] = ["a", shifts, "b"]
        assert serde.decode(encoder({"l": walked}))["l"] == ["a", {}, "b"], encoder

    # And a list's elements are read by the list's own rules: a subclass's __iter__ decides.
    class Reversed(list[int]):
        def __iter__(self) -> Any:
            return reversed(list(super().__iter__()))

    assert serde.decode(serde.pack({"r": Reversed([1, 2, 3])}))["r"] == [3, 2, 1]


def test_pack_copies_a_tensors_bytes_even_when_a_keys_finalizer_frees_its_storage() -> None:
    """The last reference to a field's key (here a fresh ``str`` subclass each ``items()``)
    goes only after the copy: its ``__del__`` runs Python code, which here frees the storage
    whose address the encoder had just read."""
    code = """if True:
        from collections.abc import Mapping
        import torch
        from mmcache import serde
        N = 64 << 20
        t = torch.full((N,), 7, dtype=torch.uint8)
        class Key(str):
            def __del__(self):
                t.untyped_storage().resize_(0)
        class Item(Mapping):
            def __getitem__(self, k): return t
            def __len__(self): return 1
            def __iter__(self): return iter(["a"])
            def items(self): return [(Key("a"), t)]
        payload = serde.pack(Item())
        raise SystemExit(0 if set(payload[-N:]) == {7} else 3)
    """
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-500:])


def test_an_array_whose_shape_disagrees_with_its_buffer_is_refused_when_encoded() -> None:
    class Reshaped(np.ndarray):  # type: ignore[type-arg]
        @property  # type: ignore[misc]
        def shape(self) -> tuple[int, ...]:
            return (7,)

    array = np.arange(3, dtype=np.float32).view(Reshaped)
    with pytest.raises(ItemNotEncodableError, match="shape"):
        serde.pack({"a": array})
