"""The shared-memory core (`mmcache._core`) across real processes, real segments."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import stat
import sys

import numpy as np
import pytest

from mmcache import _core
from mmcache._core import (
    InvalidHandleError,
    MmcacheError,
    NoReaderSlotError,
    ObjectTooLargeError,
    ReaderHandle,
    ReferencesSaturatedError,
    RingFullError,
    SegmentCorruptError,
    ShmHandle,
    ShmObjectStore,
    ShmReader,
    ShmTooSmallError,
    ShmWriter,
    StaleHandleError,
    WriterGoneError,
    WriterHandle,
)

SHM = "/dev/shm"
CHUNK = 1024  # a 1 KiB chunk: 128-byte header (n_readers <= 8) + 896 payload bytes
PAYLOAD = 896


def content(i: int, size: int) -> bytes:
    """Deterministic, object-specific bytes (so a foreign object can never match)."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def size_of(i: int) -> int:
    return [17, 4096, 65_536, 300_000][i % 4] + i


@pytest.fixture
def store():
    s = ShmObjectStore.create(1 << 20, n_readers=1)
    yield s
    s.close()


# --- multi-process readers ----------------------------------------------------------------


def reader_proc(rh, inbox, outbox, copy):
    """Attach, then resolve every (index, handle) until None; report mismatches."""
    reader = ShmObjectStore.attach(rh)
    outbox.put(("ready", reader.reader_slot))
    bad = read = 0
    while (msg := inbox.get()) is not None:
        i, handle = msg
        data = reader.resolve(handle, f"k{i}", copy=copy)
        read += 1
        if bytes(data) != content(i, size_of(i)):
            bad += 1
        del data
    outbox.put(("done", read, bad))
    reader.close()


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("copy", [True, False])
def test_writer_and_four_reader_processes_read_every_object(method, copy):
    ctx = mp.get_context(method)
    n_readers, n_objects = 4, 60
    # A ring of 2 MiB for ~6 MiB of objects: it wraps several times while readers lag.
    writer = ShmObjectStore.create(2 << 20, n_readers=n_readers)
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(n_readers)]
    procs = [
        ctx.Process(target=reader_proc, args=(writer.handle(), q, outbox, copy)) for q in inboxes
    ]
    for p in procs:
        p.start()
    slots = sorted(outbox.get(timeout=60)[1] for _ in procs)
    assert slots == [0, 1, 2, 3]
    i = 0
    while i < n_objects:
        try:
            handle = writer.put(f"k{i}", content(i, size_of(i)))
        except MemoryError:
            # Every chunk is unread by some reader: wait for them, never overwrite.
            import time

            time.sleep(0.01)
            continue
        for q in inboxes:
            q.put((i, pickle.loads(pickle.dumps(handle))))
        i += 1
    for q in inboxes:
        q.put(None)
    results = [outbox.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(r == ("done", n_objects, 0) for r in results), results
    stats = writer.stats()
    assert stats["evictions"] > 0
    assert stats["outstanding_refs"] == 0
    writer.close()


# --- handles ------------------------------------------------------------------------------


def test_handles_pickle_and_compare():
    h = ShmHandle(address=64, monotonic_id=7, signature=b"x" * 16)
    assert pickle.loads(pickle.dumps(h)) == h
    assert hash(pickle.loads(pickle.dumps(h))) == hash(h)
    assert (h.address, h.monotonic_id, h.signature) == (64, 7, b"x" * 16)
    with pytest.raises(ValueError, match="address must be"):
        ShmHandle(address=-1, monotonic_id=1, signature=b"")
    with pytest.raises(ValueError, match="monotonic_id must be"):
        ShmHandle(address=1, monotonic_id=2**64, signature=b"")
    with pytest.raises(TypeError):
        ShmHandle(64, 7, b"x")  # keywords only


# Pickles made by an earlier version (protocol 4): processes of two versions may meet, so
# both must read each other's handles, and these bytes must not change.
EARLIER_PICKLES = {
    "shm": b"\x80\x04\x95A\x00\x00\x00\x00\x00\x00\x00\x8c\rmmcache._core\x94\x8c\x0b_shm_handle"
    b"\x94\x93\x94M\x00\x10K\x07C\x14\x00\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f"
    b"\x10\x11\x12\x13\x94\x87\x94R\x94.",
    "reader": b"\x80\x04\x95f\x00\x00\x00\x00\x00\x00\x00\x8c\rmmcache._core\x94\x8c\x0e"
    b"_reader_handle\x94\x93\x94(\x8c\tmmc_1_abc\x94J\x00\x00\x10\x00K\x03J\x00\x00\x01\x00K\tC "
    b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17"
    b"\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\x94t\x94R\x94.",
    "writer": b"\x80\x04\x95h\x00\x00\x00\x00\x00\x00\x00\x8c\rmmcache._core\x94\x8c\x0e"
    b"_writer_handle\x94\x93\x94(\x8c\tmmc_1_abc\x94J\x00\x00\x10\x00K\x03J\x00\x00\x01\x00K\x04"
    b"K\tC \x00\x01\x02\x03\x04\x05\x06\x07\x08\t\n\x0b\x0c\r\x0e\x0f\x10\x11\x12\x13\x14\x15"
    b"\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f\x94t\x94R\x94.",
}


def test_handles_pickled_by_an_earlier_version_unpickle_and_pickle_the_same():
    secret = bytes(range(32))
    geometry = {"name": "mmc_1_abc", "capacity": 1 << 20, "n_readers": 3}
    geometry |= {"max_object_size": 65536, "layout_version": 9, "secret": secret}
    expected = {
        "shm": ShmHandle(address=4096, monotonic_id=7, signature=bytes(range(20))),
        "reader": ReaderHandle(**geometry),
        "writer": WriterHandle(**geometry, max_writers=4),
    }
    for kind, handle in expected.items():
        old = pickle.loads(EARLIER_PICKLES[kind])
        assert type(old) is type(handle) and old == handle, kind
        assert pickle.dumps(handle, protocol=4) == EARLIER_PICKLES[kind], kind
    writer = pickle.loads(EARLIER_PICKLES["writer"])
    assert (writer.max_writers, writer.secret, writer.layout_version) == (4, secret, 9)
    assert repr(writer) == 'WriterHandle(name="mmc_1_abc", capacity=1048576, max_writers=4)'
    assert repr(pickle.loads(EARLIER_PICKLES["reader"])) == (
        'ReaderHandle(name="mmc_1_abc", capacity=1048576, n_readers=3)'
    )
    for cls, extra in ((ReaderHandle, {}), (WriterHandle, {"max_writers": 4})):
        with pytest.raises(ValueError, match="secret must be 32 bytes"):
            cls(**(geometry | {"secret": secret[:31]}), **extra)


def test_forged_truncated_out_of_range_and_foreign_handles_are_rejected(store):
    reader = ShmObjectStore.attach(store.handle())
    h = store.put("k", b"payload")
    sig = h.signature
    forged = [
        ShmHandle(address=h.address, monotonic_id=h.monotonic_id, signature=bytes(16)),
        ShmHandle(address=h.address, monotonic_id=h.monotonic_id, signature=sig[:8]),
        ShmHandle(address=h.address, monotonic_id=h.monotonic_id, signature=b""),
        ShmHandle(address=1 << 40, monotonic_id=h.monotonic_id, signature=sig),
        ShmHandle(address=h.address + 8, monotonic_id=h.monotonic_id, signature=sig),
        ShmHandle(address=h.address, monotonic_id=h.monotonic_id + 1, signature=sig),
        ShmHandle(address=h.address, monotonic_id=0, signature=sig),
    ]
    for bad in forged:
        for copy in (True, False):
            with pytest.raises(InvalidHandleError):
                reader.get(bad, "k", copy=copy)
    with pytest.raises(InvalidHandleError):
        reader.get(h, "another-key")
    other = ShmObjectStore.create(1 << 16)
    with pytest.raises(InvalidHandleError):
        reader.get(other.put("k", b"payload"), "k")
    other.close()
    assert reader.get(h, "k") == b"payload"  # the genuine one still works


def test_stale_after_eviction_and_after_clear():
    writer = ShmObjectStore.create(2 * CHUNK)
    reader = ShmObjectStore.attach(writer.handle())
    h0 = writer.put("a", b"a" * PAYLOAD)
    assert reader.get(h0, "a") == b"a" * PAYLOAD
    h1 = writer.put("b", b"b" * PAYLOAD)
    reader.get(h1, "b")
    writer.put("c", b"c" * PAYLOAD)  # evicts a (read, oldest)
    assert not writer.is_cached("a")
    assert writer.uncached(iter(["c", "a", "zz", "b", "a"])) == ["a", "zz", "a"]
    with pytest.raises(TypeError):
        writer.uncached(["b", 1])
    # One key is iterable too: it was read as the keys "z", "z" (both reported uncached).
    for one in ("zz", b"zz"):
        with pytest.raises(TypeError, match="uncached takes a list of keys, not one"):
            writer.uncached(one)
        with pytest.raises(TypeError):
            writer.wait_for(one, 0.0)
    with pytest.raises(StaleHandleError):
        reader.get(h0, "a")
    writer.clear()
    h2 = writer.put("b", b"B" * PAYLOAD)
    assert h2.monotonic_id > h1.monotonic_id
    with pytest.raises(StaleHandleError):
        reader.get(h1, "b")  # same key, new data: the old handle never aliases it
    assert reader.get(h2, "b") == b"B" * PAYLOAD
    writer.close()


def test_issue_adds_a_reference_and_release_gives_it_back():
    writer = ShmObjectStore.create(2 * CHUNK)
    reader = ShmObjectStore.attach(writer.handle())
    h = writer.put("a", b"1" * PAYLOAD)
    reader.resolve(h, "a")
    again = writer.issue("a")
    assert again == h
    writer.put("b", b"2" * PAYLOAD)
    with pytest.raises(MemoryError):
        writer.put("c", b"3" * PAYLOAD)  # a has an undelivered reference, b is unread
    writer.release(again)
    writer.put("c", b"3" * PAYLOAD)
    assert not writer.is_cached("a")
    with pytest.raises(KeyError):
        writer.issue("a")
    writer.close()


# --- roles: the writer and reader classes, new names and their aliases ----------------------

WRITER_ONLY = (
    "put",
    "put_item",
    "is_cached",
    "uncached",
    "issue",
    "issue_if_present",
    "read_stored",
    "pin",
    "pin_if_present",
    "unpin",
    "release",
    "verify",
    "invalidate",
    "clear",
    "keys",
    "get_cached",
    "try_get_cached",
    "get_stored",
    "try_pin",
)
READER_ONLY = ("resolve", "resolve_item", "view_mapping", "reader_slot")
BOTH = (
    "name",
    "capacity",
    "n_readers",
    "max_object_size",
    "closed",
    "is_writer",
    "handle",
    "get",
    "get_item",
    "stats",
    "close",
)


def test_create_makes_a_writer_and_attach_a_reader(store):
    reader = ShmObjectStore.attach(store.handle())
    assert type(store) is ShmWriter and type(reader) is ShmReader
    assert isinstance(store, ShmObjectStore) and isinstance(reader, ShmObjectStore)
    assert store.is_writer and not reader.is_writer
    assert repr(store).startswith("ShmWriter(") and repr(reader).startswith("ShmReader(")
    with pytest.raises(TypeError):
        ShmObjectStore()  # only create() and attach() make stores
    with reader:
        assert reader.name == store.name and reader.capacity == store.capacity
    assert reader.closed and not store.closed


def test_each_role_has_only_its_own_methods(store):
    reader = ShmObjectStore.attach(store.handle())
    for name in WRITER_ONLY:
        assert hasattr(store, name) and not hasattr(reader, name), name
    for name in READER_ONLY:
        assert hasattr(reader, name) and not hasattr(store, name), name
    for name in BOTH:
        assert hasattr(store, name) and hasattr(reader, name), name
    with pytest.raises(AttributeError):
        reader.put("k", b"readers cannot write")  # type: ignore[attr-defined]
    assert store.stats()["puts"] == 0
    reader.close()


def test_old_names_are_aliases_of_the_new_ones(store):
    reader = ShmObjectStore.attach(store.handle())
    h = store.put("k", b"payload")

    def outstanding():
        return _core.inspect_segment(store.name)["readers"][reader.reader_slot]["outstanding"]

    assert store.get_cached("k") == h and outstanding() == 2  # issue()
    assert store.try_get_cached("k") == h and outstanding() == 3  # issue_if_present()
    assert store.try_get_cached("absent") is None
    assert store.get_stored("k") == store.read_stored("k") == b"payload"
    assert outstanding() == 3, "reading what is stored issues no reference"
    assert store.try_pin("k") is True and store.try_pin("absent") is False
    store.unpin("k")
    for old in (store.get_cached, store.get_stored):
        with pytest.raises(KeyError):
            old("absent")
    # A reader's get/get_item are its resolve/resolve_item: each consumes a reference.
    assert reader.get(h, "k") == b"payload" and outstanding() == 2
    assert bytes(reader.get(h, "k", False)) == b"payload" and outstanding() == 1
    assert reader.resolve(h, "k") == b"payload" and outstanding() == 0
    # The writer's get reads its own copy and consumes nothing.
    assert store.get(h, "k") == b"payload" and bytes(store.get(h, "k", copy=False)) == b"payload"
    reader.close()


# --- protection ---------------------------------------------------------------------------


def test_a_live_view_protects_its_chunk_and_is_read_only():
    writer = ShmObjectStore.create(2 * CHUNK)
    reader = ShmObjectStore.attach(writer.handle())
    h = writer.put("a", np.full(PAYLOAD // 4, 7, dtype=np.float32))
    view = reader.get(h, "a", copy=False)
    arr = np.frombuffer(view, dtype=np.float32)
    assert not arr.flags.writeable
    with pytest.raises(TypeError):
        memoryview(view)[0:1] = b"x"
    del view  # the array keeps the view (and the chunk) alive
    for key in "bcd":
        hk = writer.put(key, key.encode() * PAYLOAD)
        reader.get(hk, key)
        assert writer.is_cached("a"), "the viewed chunk was stepped over"
    assert (arr == 7).all()
    del arr
    writer.put("e", b"e" * PAYLOAD)
    writer.put("f", b"f" * PAYLOAD)
    assert not writer.is_cached("a"), "once the last view is gone the chunk is reclaimed"
    writer.close()


def test_pinned_objects_are_not_evicted():
    writer = ShmObjectStore.create(2 * CHUNK)
    writer.put("a", b"a" * PAYLOAD)
    writer.put("b", b"b" * PAYLOAD)
    writer.pin("a")
    writer.put("c", b"c" * PAYLOAD)
    assert writer.is_cached("a") and not writer.is_cached("b")
    writer.pin("a")
    writer.unpin("a")
    writer.put("d", b"d" * PAYLOAD)
    assert writer.is_cached("a"), "pins are counted"
    with pytest.raises(KeyError):
        writer.pin("zzz")
    writer.close()


def test_pins_by_object_never_reach_a_later_object_under_the_key():
    writer = ShmObjectStore.create(4 * CHUNK)
    writer.put("a", b"a" * PAYLOAD)
    first = writer.pin_object("a")
    assert first == writer.issue("a").monotonic_id
    assert writer.pin_object("zzz") is None
    writer.invalidate("a")  # ends its pins
    writer.put("a", b"A" * PAYLOAD)
    second = writer.pin_object("a")
    assert second is not None and second != first
    writer.unpin_object("a", first)
    assert writer.stats()["pinned"] == 1, "an undo of the first object's pin reached the second"
    handle = writer.issue_unpinning("a", first)
    assert handle is not None and handle.monotonic_id == second
    assert writer.stats()["pinned"] == 1
    handle = writer.issue_unpinning("a", second)
    assert handle is not None and writer.stats()["pinned"] == 0
    assert writer.issue_unpinning("zzz", None) is None
    writer.close()


def test_oversize_duplicate_and_full_errors():
    writer = ShmObjectStore.create(2 * CHUNK, max_object_size=PAYLOAD)
    with pytest.raises(ObjectTooLargeError, match="max_object_size") as too_large:
        writer.put("big", b"x" * (PAYLOAD + 1))
    assert isinstance(too_large.value, ValueError)
    writer.put("a", b"a" * PAYLOAD)
    with pytest.raises(ValueError, match="already stored") as duplicate:
        writer.put("a", b"a")
    assert not isinstance(duplicate.value, ObjectTooLargeError)
    writer.pin("a")
    writer.put("b", b"b" * PAYLOAD)
    writer.pin("b")
    with pytest.raises(RingFullError, match="pinned") as full:
        writer.put("c", b"c")
    assert isinstance(full.value, MemoryError)
    with pytest.raises(TypeError):
        writer.put("d", 12345)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        writer.put("d", np.zeros((4, 4))[:, 0])
    writer.close()


def test_multi_part_put_aligns_every_part():
    writer = ShmObjectStore.create(1 << 16)
    arr = np.arange(5, dtype=np.int64)
    h = writer.put("k", [b"abc", arr, memoryview(b"xy")])
    data = writer.get(h, "k")
    assert data[:3] == b"abc"
    assert np.frombuffer(data[64 : 64 + 40], dtype=np.int64).tolist() == [0, 1, 2, 3, 4]
    assert data[128:] == b"xy"
    # The rule the store applied is the one it exports (serde's part_offsets/payload_size).
    assert _core.part_offsets([3, arr.nbytes, 2]) == ([0, 64, 128], len(data))
    with pytest.raises(OverflowError):
        _core.part_offsets([2**64 - 1, 1])
    writer.close()


# --- readers, slots, crashes ---------------------------------------------------------------


def test_reader_slots_are_exclusive_and_freed_on_close():
    writer = ShmObjectStore.create(1 << 16, n_readers=2)
    r1 = ShmObjectStore.attach(writer.handle())
    r2 = ShmObjectStore.attach(writer.handle())
    assert {r1.reader_slot, r2.reader_slot} == {0, 1}
    with pytest.raises(NoReaderSlotError):
        ShmObjectStore.attach(writer.handle())
    r1.close()
    r3 = ShmObjectStore.attach(writer.handle())
    assert r3.reader_slot == 0
    for r in (r2, r3):
        r.close()
    writer.close()


def _attach_and_die(rh, conn):
    reader = ShmObjectStore.attach(rh)
    conn.send("attached")
    h = conn.recv()
    view = reader.get(h, "a", copy=False)  # holds a view of a ...
    conn.send(len(view))
    conn.recv()  # ... and never reads b: wait to be killed


def test_sigkilled_reader_holding_a_view_and_unread_handles_is_reclaimed():
    ctx = mp.get_context("spawn")
    writer = ShmObjectStore.create(2 * CHUNK, n_readers=1)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_attach_and_die, args=(writer.handle(), child))
    proc.start()
    assert parent.recv() == "attached"
    parent.send(writer.put("a", b"a" * PAYLOAD))
    assert parent.recv() == PAYLOAD
    writer.put("b", b"b" * PAYLOAD)
    with pytest.raises(MemoryError):
        writer.put("c", b"c" * PAYLOAD)
    proc.kill()
    proc.join()
    writer.put("c", b"c" * PAYLOAD)
    writer.put("d", b"d" * PAYLOAD)
    assert writer.stats()["readers_reclaimed"] == 1
    assert not writer.is_cached("a") and not writer.is_cached("b")
    ShmObjectStore.attach(writer.handle()).close()  # its slot is free again
    writer.close()


def _exit_child(store):
    """Runs in a forked child that inherited the writer; dropping it must not unlink."""
    del store
    import gc

    gc.collect()


def test_forked_child_does_not_unlink_and_creator_close_does():
    writer = ShmObjectStore.create(1 << 16)
    path = os.path.join(SHM, writer.name)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_exit_child, args=(writer,))
    p.start()
    p.join()
    assert p.exitcode == 0
    assert os.path.exists(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert writer.name in _core.list_segments()
    writer.close()
    assert not os.path.exists(path)
    writer.close()  # idempotent
    with pytest.raises(_core.ClosedError):
        writer.put("k", b"x")


def test_readers_get_a_clear_error_when_the_writer_is_gone():
    writer = ShmObjectStore.create(1 << 16)
    reader = ShmObjectStore.attach(writer.handle())
    h = writer.put("k", b"x")
    rh = writer.handle()
    writer.close()
    with pytest.raises(WriterGoneError, match="closed"):
        reader.get(h, "k")
    with pytest.raises(FileNotFoundError):
        ShmObjectStore.attach(rh)


def test_corrupt_segment_header_is_refused(store):
    path = os.path.join(SHM, store.name)
    with open(path, "r+b") as f:
        f.seek(24)  # the capacity field
        f.write((1 << 50).to_bytes(8, "little"))
    with pytest.raises(SegmentCorruptError):
        ShmObjectStore.attach(store.handle())
    with pytest.raises(SegmentCorruptError):
        _core.inspect_segment(store.name)
    with open(path, "r+b") as f:
        f.write(b"NOTMMCAC")
    with pytest.raises(SegmentCorruptError, match="magic"):
        ShmObjectStore.attach(store.handle())


def test_more_than_dev_shm_holds_is_a_memory_error_and_the_process_lives():
    free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    with pytest.raises(ShmTooSmallError, match="shm-size") as too_small:
        ShmObjectStore.create(free + (1 << 30))
    assert isinstance(too_small.value, MemoryError)
    assert not isinstance(too_small.value, RingFullError)
    # Nothing was left behind and the process carries on.
    before = set(_core.list_segments())
    s = ShmObjectStore.create(1 << 16)
    assert set(_core.list_segments()) - before == {s.name}
    s.close()


def test_each_memory_error_has_its_own_class_exported_by_the_package():
    import mmcache
    import mmcache.errors

    kinds = (RingFullError, ReferencesSaturatedError, ShmTooSmallError)
    for cls in kinds:
        assert issubclass(cls, MemoryError) and not issubclass(cls, MmcacheError)
        assert getattr(mmcache, cls.__name__) is cls is getattr(mmcache.errors, cls.__name__)
        assert cls.__name__ in mmcache.__all__ and cls.__name__ in mmcache.errors.__all__
        assert sum(issubclass(cls, other) for other in kinds) == 1, "told apart by type"


def test_existing_name_and_bad_arguments():
    s = ShmObjectStore.create(1 << 16, name=f"mmc_test_named_{os.getpid()}")
    with pytest.raises(FileExistsError):
        ShmObjectStore.create(1 << 16, name=s.name)
    s.close()
    for kwargs, message in (
        ({"capacity": 0}, "capacity must be positive"),
        ({"capacity": 1 << 16, "n_readers": 0}, "n_readers must be between"),
        ({"capacity": 64}, "cannot hold even one chunk header"),
    ):
        with pytest.raises(ValueError, match=message):
            ShmObjectStore.create(**kwargs)


def test_inspect_reports_counters_and_reader_slots(store):
    reader = ShmObjectStore.attach(store.handle())
    h = store.put("k", b"x" * 100)
    store.issue("k")
    info = _core.inspect_segment(store.name)
    assert info["creator_pid"] == os.getpid() and info["creator_alive"]
    assert info["puts"] == 1 and info["hits"] == 1 and info["objects"] == 1
    slot = info["readers"][reader.reader_slot]
    assert slot["claimed"] and slot["pid"] == os.getpid() and slot["outstanding"] == 2
    reader.resolve(h, "k")
    reader.resolve(h, "k")
    info = _core.inspect_segment(store.name)
    assert info["readers"][reader.reader_slot]["outstanding"] == 0


def test_context_manager_closes(tmp_path):
    with ShmObjectStore.create(1 << 16) as s:
        name = s.name
        assert not s.closed
    assert s.closed
    assert name not in _core.list_segments()


def test_large_put_and_get_round_trip():
    writer = ShmObjectStore.create(64 << 20)
    reader = ShmObjectStore.attach(writer.handle())
    big = np.random.default_rng(0).integers(0, 255, 20 << 20, dtype=np.uint8)
    h = writer.put("big", big)
    assert np.array_equal(np.frombuffer(reader.get(h, "big"), dtype=np.uint8), big)
    writer.close()


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("the shared-memory core targets Linux", allow_module_level=True)
