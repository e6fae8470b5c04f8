"""Items: size accounting, features and content hashes."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import Feature, content_hash, item_size
from mmcache.items import CachedItem, ItemMetadata
from mmcache.serde import decode, encode, part_offsets


def _int8(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int8)


def _through_serde(item: dict) -> dict:
    """A copy of ``item`` as a receiver rebuilds it from a payload."""
    header, buffers = encode(item)
    parts = [header, *(bytes(b) for b in buffers)]
    payload = bytearray()
    for offset, part in zip(part_offsets([len(p) for p in parts]), parts, strict=True):
        payload += bytes(offset - len(payload)) + part
    return decode(bytes(payload))


# -- item_size -------------------------------------------------------------------------------


def test_size_of_tensors_counts_their_bytes() -> None:
    assert item_size(_int8(100)) == 100
    assert item_size({"a": _int8(100), "b": _int8(110)}) == 210
    assert item_size(torch.zeros(3, 4, dtype=torch.float32)) == 48
    assert item_size(torch.zeros(8, dtype=torch.bfloat16)) == 16


def test_size_of_a_sparse_tensor_counts_the_bytes_it_holds() -> None:
    # torch has no nbytes for a sparse tensor (RuntimeError): an item holding one made every
    # LRU cache raise from inside torch, though the LRU modes keep any value.
    from mmcache import ReceiverCache, SenderCache

    sparse = torch.eye(4, dtype=torch.float32).to_sparse()  # 4 values, 2 x 4 int64 indices
    assert item_size({"s": sparse}) == 4 * 4 + 2 * 4 * 8
    p0, p1 = SenderCache(0.001), ReceiverCache(0.001)
    data, _ = p0.get_and_update_item(({"s": sparse}, None), "h")
    assert p0.get_and_update_item(None, "h")[0] is None  # stored: a hit
    assert p1.get_and_update_item(data, "h")["s"] is sparse
    assert p0.stats()["used_bytes"] == p1.stats()["used_bytes"] == 80


def test_size_of_arrays_bytes_and_nesting() -> None:
    item = {
        "pixels": np.zeros((2, 5), dtype=np.float64),  # 80
        "raw": b"x" * 33,  # 33
        "grid": [_int8(7), (np.zeros(3, dtype=np.int16), {"deep": _int8(5)})],  # 7 + 6 + 5
    }
    assert item_size(item) == 80 + 33 + 7 + 6 + 5


def test_size_of_other_leaves_is_getsizeof() -> None:
    assert item_size({"n": 12345, "s": "hello"}) == sys.getsizeof(12345) + sys.getsizeof("hello")
    assert item_size({"none": None}) == sys.getsizeof(None)


def test_size_is_the_same_for_item_metadata_and_copy() -> None:
    item = {
        "pixel_values": torch.randn(3, 8, 8),
        "grid_thw": torch.tensor([1, 2, 2]),
        "extra": [np.ones(4, dtype=np.float32), b"abc"],
    }
    updates = ["a large prompt update list"] * 1000  # never counted
    expected = 3 * 8 * 8 * 4 + 3 * 8 + 4 * 4 + 3
    assert item_size(item) == expected
    assert item_size(CachedItem(item, updates)) == expected
    assert item_size(ItemMetadata.of(item, updates)) == expected
    assert item_size(copy.deepcopy(item)) == expected
    assert item_size(_through_serde(item)) == expected


def test_non_contiguous_tensor_counts_its_elements() -> None:
    t = torch.randn(4, 6).t()[::2]
    assert item_size(t) == t.contiguous().nbytes == 3 * 4 * 4


# -- Feature ---------------------------------------------------------------------------------


def test_feature_key_is_mm_hash_or_identifier() -> None:
    assert Feature(None, mm_hash="h", identifier="lora1:h").cache_key == "h"
    assert Feature(None, mm_hash=None, identifier="id").cache_key == "id"
    with pytest.raises(ValueError, match="needs an mm_hash or an identifier"):
        Feature({"x": 1})


def test_feature_free_form_fields_are_mutable_and_picklable() -> None:
    f = Feature({"x": 1}, mm_hash="h", identifier="h", modality="image", position=(3, 7))
    assert f.modality == "image" and f.position == (3, 7)
    assert f.extra == {"modality": "image", "position": (3, 7)}
    f.data = None
    f.position = (4, 8)
    clone = pickle.loads(pickle.dumps(f))
    assert clone == f and clone.position == (4, 8) and clone.data is None
    assert clone != Feature(None, mm_hash="h", identifier="h", modality="audio", position=(4, 8))


def test_features_holding_tensors_compare_by_value_without_raising() -> None:
    # Resolved features hold tensors: comparing two ("f in features", features.index(f))
    # compared their items' tensors with ==, and the tensor's truth value raised
    # "Boolean value of Tensor with more than one value is ambiguous".
    def item(x: float) -> dict[str, Any]:
        return {"t": torch.full((2, 3), x), "a": np.arange(4), "meta": [b"x", {"n": 1}]}

    a, b = (Feature(item(1.0), mm_hash=h, identifier=h) for h in "ab")
    assert Feature(item(1.0), mm_hash="a", identifier="a") == a
    assert pickle.loads(pickle.dumps(a)) == a
    assert b not in [a] and [a, b].index(b) == 1
    assert Feature(item(2.0), mm_hash="a", identifier="a") != a
    other_dtype = {**item(1.0), "t": torch.full((2, 3), 1.0, dtype=torch.float64)}
    assert Feature(other_dtype, mm_hash="a", identifier="a") != a
    other_array = {**item(1.0), "a": np.arange(4, dtype=np.int8)}
    assert Feature(other_array, mm_hash="a", identifier="a") != a


@pytest.mark.parametrize("bad", [5, ("a",), b"a"], ids=repr)
def test_feature_refuses_a_key_that_is_no_str(bad: object) -> None:
    # Feature(mm_hash=5) or Feature(identifier=b"a") was built without a word (its cache key
    # then an int or bytes), where it refuses a missing key at once: the error came only
    # from a receiver, if ever, far from the code that built it.
    with pytest.raises(TypeError, match=r"^Feature: mm_hash must be a str or None, not "):
        Feature(None, mm_hash=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Feature: identifier must be a str, not "):
        Feature(None, mm_hash="h", identifier=bad)  # type: ignore[arg-type]
    assert Feature(None, mm_hash=None, identifier="id").cache_key == "id"


def test_feature_refuses_fields_that_shadow_its_own() -> None:
    with pytest.raises(TypeError):
        Feature(None, mm_hash="h", cache_key="x")


# -- content_hash ----------------------------------------------------------------------------


def test_hash_is_full_width_hex_and_deterministic() -> None:
    h = content_hash(b"image bytes", size=448)
    assert len(h) == 64 and int(h, 16) >= 0
    assert h == content_hash(b"image bytes", size=448)


def test_hash_is_the_same_in_another_process() -> None:
    code = (
        "import numpy as np, torch; from mmcache import content_hash;"
        "print(content_hash(b'abc', np.arange(6).reshape(2, 3),"
        " torch.ones(2, dtype=torch.bfloat16), 'x', 1, 2.5, None, [True], mode='rgb'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    local = content_hash(
        b"abc",
        np.arange(6).reshape(2, 3),
        torch.ones(2, dtype=torch.bfloat16),
        "x",
        1,
        2.5,
        None,
        [True],
        mode="rgb",
    )
    assert out.stdout.strip() == local


def test_hash_distinguishes_types_values_and_structure() -> None:
    hashes = {
        content_hash(1),
        content_hash("1"),
        content_hash(1.0),
        content_hash(True),
        content_hash(b"1"),
        content_hash([1]),
        content_hash((1,)),
        content_hash(b"ab", b"c"),
        content_hash(b"a", b"bc"),
        content_hash(None),
        content_hash(x=1),
        content_hash(y=1),
        content_hash(np.zeros(4, dtype=np.float32)),
        content_hash(np.zeros(4, dtype=np.int32)),
        content_hash(np.zeros((2, 2), dtype=np.float32)),
        content_hash(torch.zeros(4)),
        content_hash(torch.zeros(4, dtype=torch.int32)),
        content_hash(torch.zeros(2, 2)),
        content_hash(np.array(0.0, dtype=np.float32)),
        content_hash(torch.tensor([0.0])),
        content_hash(torch.tensor(0.0)),
    }
    assert len(hashes) == 21
    assert content_hash(np.float32(0)) == content_hash(np.array(0.0, dtype=np.float32))


def test_hash_tells_structured_dtypes_of_one_size_apart() -> None:
    """Two record layouts of the same bytes (both ``|V8`` by ``dtype.str``) are two inputs."""
    data = np.zeros(2, dtype=np.uint64)
    pair = data.view([("x", "<i4"), ("y", "<i4")])
    whole = data.view([("xy", "<i8")])
    floats = data.view([("x", "<f4"), ("y", "<f4")])
    assert pair.dtype.str == whole.dtype.str == floats.dtype.str
    assert len({content_hash(pair), content_hash(whole), content_hash(floats)}) == 3
    assert content_hash(pair) == content_hash(pair.copy())


def test_hash_tells_user_defined_dtypes_of_one_size_apart() -> None:
    """ml_dtypes' float8, float6, float4 and int4 kinds all say ``<V1`` by ``dtype.str``: the
    same bytes as any two of them, or as plain bytes, are different inputs."""
    import ml_dtypes  # a test requirement (pyproject's `test` extra)

    data = np.arange(16, dtype=np.uint8)
    kinds = [
        np.dtype(getattr(ml_dtypes, name))
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn", "int4")
    ]
    assert {kind.str for kind in kinds} == {"<V1"}
    arrays = [data.view(kind) for kind in kinds] + [data, data.view("V1")]
    assert len({content_hash(a) for a in arrays}) == len(arrays)
    assert content_hash(arrays[0]) == content_hash(arrays[0].copy())
    # ... nor as a record's field (`descr` says "<V1" too), or a subarray's element.
    records = [data.view([("x", kind)]) for kind in kinds]
    subarrays = [data.view([("x", kind, (2,))]) for kind in kinds]
    assert len({content_hash(a) for a in records + subarrays}) == 2 * len(kinds)


def test_hash_takes_ints_of_any_size() -> None:
    """Past Python's limit on converting an int to decimal text (4300 digits by default,
    settable per process), an int is still hashed, alike in every process."""
    huge = 7**6000  # 5071 digits
    assert content_hash(huge) != content_hash(huge + 1)
    assert content_hash(-huge) != content_hash(huge)
    code = "import sys; from mmcache import content_hash; sys.set_int_max_str_digits(640);"
    code += "print(content_hash(7**6000, 10**639))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == content_hash(huge, 10**639)


def test_hash_ignores_kwarg_order_and_memory_layout() -> None:
    assert content_hash(a=1, b=2) == content_hash(b=2, a=1)
    assert content_hash({"a": 1, "b": 2}) == content_hash({"b": 2, "a": 1})
    base = torch.arange(12.0).reshape(3, 4)
    assert content_hash(base.t()) == content_hash(base.t().contiguous())
    arr = np.arange(12).reshape(3, 4)
    assert content_hash(arr.T) == content_hash(np.ascontiguousarray(arr.T))
    assert content_hash(base) != content_hash(base.t().contiguous())


def test_hash_sees_every_byte() -> None:
    t = torch.zeros(1000, dtype=torch.bfloat16)
    u = t.clone()
    u[999] = 1
    assert content_hash(t) != content_hash(u)


def test_hash_sees_a_masked_arrays_mask() -> None:
    """A MaskedArray's mask is not in its data: hashing the data alone gave arrays that mask
    different elements (and the plain array) one hash, so one's processed item served both."""
    data = [1.0, 2.0, 3.0]
    hashes = {
        content_hash(np.ma.array(data, mask=[0, 1, 0])),
        content_hash(np.ma.array(data, mask=[1, 0, 0])),
        content_hash(np.ma.array(data)),
        content_hash(np.array(data)),
    }
    assert len(hashes) == 4
    assert content_hash(np.ma.array(data, mask=[0, 1, 0])) == content_hash(
        np.ma.array(np.array(data), mask=np.array([False, True, False]))
    )


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_hash_sees_a_quantized_tensors_scale() -> None:
    """A quantized tensor's bytes are its integers: 1.0 at scale 0.1 and 2.0 at scale 0.2 are
    both 10s, and had one hash."""
    ones = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    twos = torch.quantize_per_tensor(torch.full((3,), 2.0), 0.2, 0, torch.qint8)
    assert torch.equal(ones.int_repr(), twos.int_repr())
    assert content_hash(ones) != content_hash(twos)
    assert content_hash(ones) == content_hash(
        torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    )


@pytest.mark.skipif(
    np.finfo(np.longdouble).nmant != 63, reason="long double is not x87 extended precision here"
)
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, ">f16"], ids=str)
def test_hash_of_long_doubles_ignores_their_padding(dtype: Any) -> None:
    """An x87 long double is 10 bytes in 16: the other 6 are whatever memory held (a pointer's
    bits, in practice), so equal arrays hashed apart, and differently in every process."""
    a = np.full(3, 1.5, dtype=dtype)
    b = a.copy()
    native = b if b.dtype.isnative else b.view(b.dtype.newbyteorder("="))
    rows = native.view(np.uint8).reshape(-1, np.dtype(np.longdouble).itemsize)
    if not b.dtype.isnative:
        rows = rows[:, ::-1]  # a swapped long double's padding comes first
    rows[:, 10:] = 0xAB
    assert (a == b).all() and a.tobytes() != b.tobytes()
    assert content_hash(a) == content_hash(b)
    rows[0, 0] ^= 1  # a significant bit
    assert content_hash(a) != content_hash(b)


def test_hash_of_records_ignores_their_padding() -> None:
    """An aligned record's padding bytes are whatever memory held (``np.empty``, a C
    library's struct): equal arrays hashed apart."""
    dtype = np.dtype([("a", "u1"), ("b", "<i4"), ("c", [("d", "u1"), ("e", "<f8")])], align=True)
    assert dtype.itemsize > 1 + 4 + 1 + 8
    a = np.zeros(2, dtype=dtype)
    a["a"], a["b"], a["c"]["d"], a["c"]["e"] = 1, 2, 3, 4.5
    b = a.copy()
    raw = b.view(np.uint8).reshape(2, -1)
    raw[:, 1:4] = 0xAB  # between a and b
    raw[:, 9:16] = 0xCD  # between d and e
    assert (a == b).all() and a.tobytes() != b.tobytes()
    assert content_hash(a) == content_hash(b)
    b["c"]["e"][1] = 5.5
    assert content_hash(a) != content_hash(b)
    packed = np.dtype([("a", "u1"), ("b", "<i4")])
    assert content_hash(np.zeros(2, dtype=packed)) != content_hash(np.zeros(2, dtype=dtype))


def test_hash_rejects_unsupported_values() -> None:
    with pytest.raises(TypeError, match="parts"):
        content_hash(object())
    with pytest.raises(TypeError, match="opts"):
        content_hash(opts={1: "non-str key"})
    with pytest.raises(TypeError):
        content_hash(np.array([object()]))


def test_hash_names_the_tensors_it_cannot_read() -> None:
    # A sparse or meta tensor failed deep inside torch (RuntimeError: "unsupported memory
    # format option Contiguous"; NotImplementedError), naming neither the value nor the fix.
    import torch

    with pytest.raises(TypeError, match=r"parts\[1\] is a torch.sparse_coo tensor"):
        content_hash(b"x", torch.eye(2).to_sparse())
    with pytest.raises(TypeError, match=r"\['opts'\]\['t'\] is a torch.sparse_coo tensor"):
        content_hash(opts={"t": torch.zeros(3).to_sparse()})
    with pytest.raises(TypeError, match=r"parts\[0\] is a tensor on the meta device"):
        content_hash(torch.empty(2, device="meta"))


def test_hash_names_a_nested_tensor() -> None:
    """A torch.nested tensor of the strided layout raised torch's RuntimeError ("Internal
    error: NestedTensorImpl doesn't support sizes"), not the TypeError naming the value."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested tensors are a prototype, and say so
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert nested.layout == torch.strided
    with pytest.raises(TypeError, match=r"\['opts'\]\['n'\] is a nested tensor.*unbind"):
        content_hash(opts={"n": nested})


def test_hash_names_a_jagged_nested_tensor() -> None:
    """A torch.nested tensor of the jagged layout is named a nested tensor too: the layout's
    refusal said to hash its .to_dense(), which a jagged tensor has not (torch raises)."""
    import torch

    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"parts\[0\] is a nested tensor.*unbind"):
        content_hash(nested)


def test_import_does_not_pull_in_torch() -> None:
    code = (
        "import sys, numpy as np, mmcache;"
        "mmcache.content_hash(b'x', np.ones(3)); mmcache.item_size({'a': np.ones(2)});"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
