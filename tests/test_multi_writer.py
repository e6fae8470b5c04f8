"""Several writers on one store (SPEC §3.9), with real processes (spawned):

- a writer that joins from another process sees every object the others stored, and theirs
  see its objects; readers attach once and read every writer's handles; metadata comes back
  from any writer; the store's counters are shared;
- joining checks the handle (secret, name, free slots naming ``max_writers``) and the layout;
- the segment lives while any writer lives and is unlinked by the last one to close;
- single flight across processes: a claim makes the others wait (bounded) for its put, and a
  claim whose writer died is void at once;
- writer processes with several threads each race on the same keys under constant eviction
  while a reader checks every handle bit for bit;
- ``inspect``, ``segment_status``, ``prune`` and ``mmcache inspect`` see writer slots.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import pickle
import queue
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmcache import (
    InvalidHandleError,
    KeyExistsError,
    NoWriterSlotError,
    RingFullError,
    SegmentCorruptError,
    WriterGoneError,
    WriterHandle,
    _core,
    prune,
)
from mmcache._core import ShmObjectStore, ShmReader, ShmWriter

KiB = 1024
MiB = 1 << 20
TIMEOUT = 120  # seconds to wait for a child's answer (a hang fails the test, not CI)

ctx = mp.get_context("spawn")


pytestmark = pytest.mark.usefixtures("hang_deadline")


def content(key: str) -> bytes:
    """The bytes every writer stores under ``key`` (random, so any foreign byte shows)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, 500 + seed % 6000, dtype=np.uint8).tobytes()


def wire(handle: _core.ShmHandle) -> tuple[int, int, bytes]:
    return handle.address, handle.monotonic_id, bytes(handle.signature)


def unwire(fields: tuple[int, int, bytes]) -> _core.ShmHandle:
    return _core.ShmHandle(address=fields[0], monotonic_id=fields[1], signature=fields[2])


def recv(conn: Any) -> Any:
    assert conn.poll(TIMEOUT), "the child process did not answer"
    return conn.recv()


def reap(proc: Any) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(TIMEOUT)


@pytest.fixture
def store() -> Iterator[ShmWriter]:
    writer = ShmObjectStore.create(4 * MiB, n_readers=1, max_writers=3)
    yield writer
    writer.close()


# -- children ----------------------------------------------------------------------------


def _sharing_writer(handle: WriterHandle, conn: Any) -> None:
    """Join, read what the parent stored, store one object with metadata, hand back a hit's
    handle and what it saw; then wait for the word to close."""
    writer = ShmObjectStore.join(handle)
    seen = (
        writer.is_cached("from-parent"),
        writer.read_meta("from-parent"),
        writer.read_stored("from-parent")[: len(content("from-parent"))],
    )
    put = writer.put("from-child", content("from-child"), meta=b"child meta")
    hit = writer.issue("from-parent")
    conn.send((writer.writer_slot, seen, wire(put), wire(hit)))
    assert conn.recv() == "close"
    writer.close()
    conn.send("closed")


def _claiming_writer(handle: WriterHandle, conn: Any) -> None:
    """Claim what the parent says, put it when told; die holding a claim if told to."""
    writer = ShmObjectStore.join(handle)
    while (command := conn.recv()) is not None:
        verb, key = command
        if verb == "claim":
            conn.send(writer.claim(key))
        elif verb == "put":
            writer.put(key, content(key))
            conn.send("put")
    writer.close()


def _racing_writer(handle: WriterHandle, seed: int, rounds: int, out: Any) -> None:
    """Three threads of one writer put, hit, pin, invalidate and claim keys the other writers
    race on too; every handle goes to the reader (the parent)."""
    writer = ShmObjectStore.join(handle)

    def work(thread: int) -> None:
        rng = random.Random(seed * 10 + thread)
        for _ in range(rounds):
            key = f"k{rng.randrange(24)}"
            roll = rng.random()
            try:
                if roll < 0.5:
                    out.put((key, wire(writer.put(key, content(key)))))
                elif roll < 0.8:
                    handle = writer.issue_if_present(key)
                    if handle is not None:
                        out.put((key, wire(handle)))
                elif roll < 0.9:
                    if writer.pin_if_present(key):
                        writer.unpin(key)
                elif roll < 0.95:
                    writer.invalidate(key)
                elif writer.claim(key):
                    out.put((key, wire(writer.put(key, content(key)))))
            except KeyExistsError:
                pass  # another writer (or thread) stored it first
            except RingFullError:
                pass  # the reader has not caught up: ring full of unread objects

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    out.put(None)


def _filling_writer(handle: WriterHandle, seed: int, rounds: int, out: Any) -> None:
    """Put objects of every size under keys of its own (most carved from its allocation
    buffer without the ring lock, some large enough to evict and merge many blocks) and
    invalidate some; then say it is done."""
    writer = ShmObjectStore.join(handle)
    rng = random.Random(seed)
    for i in range(rounds):
        roll = rng.random()
        size = rng.randrange(8 * KiB, 200 * KiB) if roll < 0.03 else rng.randrange(1, 1500)
        writer.put(f"{seed}-{i}", bytes(size))
        if roll > 0.9:
            writer.invalidate(f"{seed}-{rng.randrange(i + 1)}")
    writer.close()
    out.put(None)


def _store_with_two_writers(conn: Any) -> None:
    """Create a store with two writers in this process and wait to be killed."""
    first = ShmObjectStore.create(1 * MiB, max_writers=2)
    second = ShmObjectStore.join(first.writer_handle())
    first.put("k", b"v")
    conn.send((first.name, second.writer_slot))
    conn.recv()  # never comes: the test kills us


def _creating_writer(conn: Any) -> None:
    """Create a store of two writers, store one object, hand over the writer handle and wait
    to be killed."""
    writer = ShmObjectStore.create(1 * MiB, max_writers=2)
    writer.put("k", content("k"))
    conn.send(writer.writer_handle())
    conn.recv()  # never comes: the test kills us


# -- tests -------------------------------------------------------------------------------


def test_a_writer_in_another_process_shares_every_object(store: ShmWriter) -> None:
    reader: ShmReader = ShmObjectStore.attach(store.handle())
    first = store.put("from-parent", content("from-parent"), meta=b"parent meta")
    assert reader.resolve(first, "from-parent") == content("from-parent")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_sharing_writer, args=(store.writer_handle(), theirs))
    child.start()
    try:
        slot, seen, put, hit = recv(mine)
        assert slot == 1 and store.writer_slot == 0
        assert seen == (True, b"parent meta", content("from-parent"))
        assert store.is_cached("from-child")
        assert store.read_meta("from-child") == b"child meta"
        assert store.read_meta("from-child", monotonic_id=put[1]) == b"child meta"
        with pytest.raises(KeyError):
            store.read_meta("from-child", monotonic_id=put[1] + 1)
        # The reader resolves every writer's handles, and cannot tell them apart.
        assert reader.resolve(unwire(put), "from-child") == content("from-child")
        assert reader.resolve(unwire(hit), "from-parent") == content("from-parent")
        again = store.issue("from-child")
        assert reader.resolve(again, "from-child") == content("from-child")
        stats = store.stats()
        assert (stats["puts"], stats["hits"], stats["objects"]) == (2, 2, 2)
        assert stats["writers_attached"] == 2
        info = _core.inspect_segment(store.name)
        assert [w["alive"] for w in info["writers"]] == [True, True, False]
        assert info["writers_alive"] == 2 and info["max_writers"] == 3
        mine.send("close")
        assert recv(mine) == "closed"
    finally:
        child.join(TIMEOUT)
        reap(child)
    assert child.exitcode == 0
    assert store.is_cached("from-child"), "items outlive the writer that put them"
    assert _core.inspect_segment(store.name)["writers_alive"] == 1
    reader.close()


def test_joining_checks_the_handle_the_slots_and_the_layout() -> None:
    with ShmObjectStore.create(1 * MiB, max_writers=2) as first:
        handle = first.writer_handle()
        assert pickle.loads(pickle.dumps(handle)) == handle
        assert (handle.name, handle.max_writers, len(handle.secret)) == (first.name, 2, 32)
        forged = WriterHandle(
            name=handle.name,
            capacity=handle.capacity,
            n_readers=handle.n_readers,
            max_object_size=handle.max_object_size,
            max_writers=handle.max_writers,
            layout_version=handle.layout_version,
            secret=bytes(32),
        )
        with pytest.raises(InvalidHandleError, match="secret"):
            ShmObjectStore.join(forged)
        with ShmObjectStore.join(handle) as second:
            assert second.writer_slot == 1 and second.max_writers == 2
            with pytest.raises(NoWriterSlotError, match="max_writers=2"):
                ShmObjectStore.join(handle)
        third = ShmObjectStore.join(handle)  # the closed writer's slot is free again
        assert third.writer_slot == 1
        third.close()
    with pytest.raises(FileNotFoundError):
        ShmObjectStore.join(handle)
    with ShmObjectStore.create(1 * MiB) as solo, pytest.raises(NoWriterSlotError):
        ShmObjectStore.join(solo.writer_handle())
    with pytest.raises(ValueError, match="max_writers"):
        ShmObjectStore.create(1 * MiB, max_writers=0)
    with ShmObjectStore.create(1 * MiB, max_writers=2) as other:
        # A store of an older layout is refused with the usual message.
        with open(os.path.join("/dev/shm", other.name), "r+b") as f:
            f.seek(8)
            f.write((2).to_bytes(8, "little"))
        with pytest.raises(SegmentCorruptError, match="layout version 2"):
            ShmObjectStore.join(other.writer_handle())


def test_the_segment_lives_while_any_writer_does_and_the_last_one_unlinks_it() -> None:
    first = ShmObjectStore.create(1 * MiB, max_writers=2)
    name, reader_handle = first.name, first.handle()
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_sharing_writer, args=(first.writer_handle(), theirs))
    put = first.put("from-parent", content("from-parent"))
    child.start()
    try:
        recv(mine)
        first.close()
        assert name in _core.list_segments(), "the other writer still uses it"
        assert _core.segment_status(name)[0] == "live"
        # Readers attach whichever writer made the store, and need nothing else.
        late: ShmReader = ShmObjectStore.attach(reader_handle)
        assert late.resolve(put, "from-parent") == content("from-parent")
        mine.send("close")
        assert recv(mine) == "closed"
        assert name not in _core.list_segments(), "the last writer unlinked it"
        with pytest.raises(WriterGoneError):
            late.resolve(put, "from-parent")
    finally:
        child.join(TIMEOUT)
        reap(child)


def test_a_store_whose_creator_died_lives_while_a_joined_writer_does() -> None:
    """Every creation first removes orphaned segments (``remove_orphans``): a store whose
    creator was SIGKILLed is not one while a writer that joined it lives."""
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_creating_writer, args=(theirs,))
    child.start()
    try:
        joined = ShmObjectStore.join(recv(mine))
        name = joined.name
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        assert _core.segment_status(name)[0] == "live"
        assert name not in prune(dry_run=True)
        ShmObjectStore.create(1 * MiB).close()  # a creation runs remove_orphans first
        assert name in _core.list_segments()
        assert joined.read_stored("k")[: len(content("k"))] == content("k")
        reader: ShmReader = ShmObjectStore.attach(joined.handle())
        put = joined.put("after", content("after"))
        assert reader.resolve(put, "after") == content("after")
        reader.close()
        joined.close()
        assert name not in _core.list_segments(), "the last writer unlinked it"
    finally:
        reap(child)


def test_single_flight_across_processes_and_a_dead_claimant(store: ShmWriter) -> None:
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_claiming_writer, args=(store.writer_handle(), theirs))
    child.start()
    try:
        mine.send(("claim", "hot"))
        assert recv(mine) is True
        assert store.claim("hot") is False, "another live writer computes it"
        assert store.wait_for(["hot"], 0.02) == [False], "not put in time"
        assert store.stats()["claims"] == 1
        waited: list[list[bool]] = []
        waiter = threading.Thread(target=lambda: waited.append(store.wait_for(["hot"], 600)))
        waiter.start()
        mine.send(("put", "hot"))
        assert recv(mine) == "put"
        waiter.join(TIMEOUT)
        assert waited == [[True]]
        assert store.read_stored("hot")[: len(content("hot"))] == content("hot")
        assert store.stats()["claims"] == 0, "the put ended the claim"
        mine.send(("claim", "doomed"))
        assert recv(mine) is True
        assert store.claim("mine") is True
        assert store.wait_for(["mine"], 600) == [False], "a writer never waits on itself"
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        assert child.exitcode == -signal.SIGKILL
        assert store.wait_for(["doomed"], 600) == [False], "a dead writer's claim is void"
        assert store.claim("doomed") is True
        assert store.stats()["claims"] == 2
    finally:
        reap(child)


def start_writers(target: Any, store: ShmObjectStore, count: int, out: Any) -> list[Any]:
    """Two writer processes joined to ``store`` (seeds 1 and 2), started: each runs
    ``target(writer_handle, seed, count, out)``."""
    children = [
        ctx.Process(target=target, args=(store.writer_handle(), seed, count, out))
        for seed in (1, 2)
    ]
    for child in children:
        child.start()
    return children


def test_writer_processes_with_threads_race_and_every_handle_reads_its_own_bytes() -> None:
    # A small ring (the 24 keys' bytes need about twice its room: constant eviction) shared
    # by this process (the reader, and a writer) and two joined writer processes of three
    # threads each.
    assert sum(len(content(f"k{i}")) for i in range(24)) > 64 * KiB
    store = ShmObjectStore.create(48 * KiB, n_readers=1, max_writers=3)
    reader: ShmReader = ShmObjectStore.attach(store.handle())
    out: Any = ctx.Queue()
    children = start_writers(_racing_writer, store, 300, out)
    done, resolved = 0, 0
    try:
        while done < len(children):
            try:
                message = out.get(timeout=TIMEOUT)
            except queue.Empty:
                pytest.fail("the writer processes stopped answering")
            if message is None:
                done += 1
                continue
            key, fields = message
            # An owed handle always reads back exactly its key's bytes.
            assert reader.resolve(unwire(fields), key) == content(key), key
            resolved += 1
            if resolved % 50 == 0:
                key = f"parent-{resolved}"
                # RingFullError: every other chunk is a handle still in the queue.
                with contextlib.suppress(RingFullError):
                    assert reader.resolve(store.put(key, content(key)), key) == content(key)
    finally:
        for child in children:
            child.join(TIMEOUT)
            reap(child)
    assert [child.exitcode for child in children] == [0, 0]
    assert resolved > 100
    # Whether the race itself evicted depends on the reader's pace (writers that outrun it
    # find every chunk unread: RingFullError, no eviction); after it, more than the ring's
    # room of objects, each read at once, must evict what the race left.
    for i in range(24):
        key = f"after-{i}"
        assert reader.resolve(store.put(key, content(key)), key) == content(key)
    stats = store.stats()
    assert stats["evictions"] > 0
    assert stats["outstanding_refs"] == 0, "every handle was read"
    keys = store.keys()
    assert len(keys) == len(set(keys)), "a key is stored once"
    for key in keys:
        assert store.read_stored(key)[: len(content(key))] == content(key)
    reader.close()
    store.close()


def test_stats_walks_the_ring_while_writer_processes_carve_merge_and_evict() -> None:
    # A ring of a thousand-odd small blocks (several slices of a walk, the ring lock given
    # back between two) that two writer processes keep filling, evicting and merging while
    # this one counts it again and again: every walk ends with figures, never with a header
    # read out of an object's bytes (SegmentCorruptError).
    store = ShmObjectStore.create(1 * MiB, n_readers=1, max_writers=3)
    out: Any = ctx.Queue()
    children = start_writers(_filling_writer, store, 4000, out)
    done, walks, most = 0, 0, 0
    try:
        while done < len(children):
            with contextlib.suppress(queue.Empty):
                if out.get(timeout=0.001) is None:
                    done += 1
            stats = store.stats()
            assert stats["chunks"] <= stats["capacity"] // 64, stats
            most = max(most, stats["chunks"])
            walks += 1
    finally:
        for child in children:
            child.join(TIMEOUT)
            reap(child)
    assert [child.exitcode for child in children] == [0, 0]
    assert walks > 1 and most > 300, (walks, most)
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["chunks_reserved"] == 0
    assert store.stats()["chunks"] == stats["chunks"] >= stats["objects"]
    store.close()


def test_inspect_status_prune_and_the_cli_see_writer_slots(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mmcache.cli import main

    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_store_with_two_writers, args=(theirs,))
    child.start()
    try:
        name, second_slot = recv(mine)
        info = _core.inspect_segment(name)
        assert second_slot == 1
        assert [(w["slot"], w["state"], w["alive"]) for w in info["writers"]] == [
            (0, "claimed", True),
            (1, "claimed", True),
        ]
        assert main(["inspect", name]) == 0
        printed = capsys.readouterr().out
        assert "writers" in printed and "max_writers" in printed
        assert _core.segment_status(name)[0] == "live"
        assert name not in prune(dry_run=True)
        os.kill(child.pid, signal.SIGKILL)
        child.join(TIMEOUT)
        # Any store's creation on this host removes an orphan: another test run may take
        # this one first, so each check below allows for it being gone already.
        with contextlib.suppress(FileNotFoundError):
            info = _core.inspect_segment(name)
            assert [w["alive"] for w in info["writers"]] == [False, False]
            assert not info["creator_alive"]
            assert _core.segment_status(name)[0] == "orphaned"
        assert name in prune() or name not in _core.list_segments()
        assert name not in _core.list_segments()
    finally:
        reap(child)
