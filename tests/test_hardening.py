"""Hardening of the shared-memory core, each with real processes where it is about processes.

Fork (a child inheriting a writer, a reader or views), reader slots (races, dead and draining
occupants), reference-counter limits, liveness across PID namespaces, segments damaged by
another process, and bad input at the edges.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import (
    ClosedError,
    ReceiverCache,
    ReferencesSaturatedError,
    SenderCache,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    WrongProcessError,
    _core,
    make_caches,
    prune,
)
from mmcache._core import ShmObjectStore, ShmWriter
from mmcache.arguments import capacity_bytes

KiB = 1024
MiB = 1 << 20
GiB = 1 << 30
SHM = "/dev/shm"
CHUNK = 1024  # a 1 KiB chunk: 128-byte header (n_readers <= 8) + 896 payload bytes
PAYLOAD = 896
TIMEOUT = 120

spawn = mp.get_context("spawn")


def pattern(tag: int, n: int = PAYLOAD) -> bytes:
    return np.random.default_rng(tag).integers(0, 256, n, dtype=np.uint8).tobytes()


def wait_for(pid: int) -> int:
    """Wait for a forked child; its exit status (negative: killed by that signal)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def in_child(body: Any) -> int:
    """Run ``body()`` in a forked child; exit status 0 if it returned True, 1 otherwise."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            code = 0 if body() else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return wait_for(pid)


def recv(conn: Any) -> Any:
    assert conn.poll(TIMEOUT), "the other process did not answer"
    return conn.recv()


def wait_until(done: Callable[[], bool], never: str) -> None:
    """Poll ``done()`` until it holds; fail with ``never`` if it still does not after
    ``TIMEOUT`` seconds (a guard against hanging, not a measurement)."""
    deadline = time.monotonic() + TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(never)
        time.sleep(0.02)


# -- 1. a forked child of a reader --------------------------------------------------------------


def test_a_forked_child_letting_go_of_inherited_views_releases_nothing() -> None:
    writer = ShmObjectStore.create(2 * CHUNK)
    reader = ShmObjectStore.attach(writer.handle())
    h = writer.put("a", pattern(1))
    view = reader.get(h, "a", copy=False)
    arr = np.frombuffer(view, dtype=np.uint8)

    def child_drops_everything() -> bool:
        nonlocal view, arr
        del view, arr
        gc.collect()
        reader.close()
        return True

    assert in_child(child_drops_everything) == 0
    # The parent's view still protects "a": new objects go around it.
    for n, key in enumerate("bcdef"):
        hk = writer.put(key, pattern(10 + n))
        reader.get(hk, key)
        assert writer.is_cached("a"), "a child's exit released the parent's view"
    assert arr.tobytes() == pattern(1)
    assert writer.stats()["views"] == 1
    writer.close()


def test_a_forked_child_cannot_resolve_through_the_inherited_reader() -> None:
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1, n_readers=2) as p0:
        cache = ShmReceiverCache(p0.handle())
        raw = ShmObjectStore.attach(p0.handle())
        item = {"x": torch.arange(100, dtype=torch.int32)}
        h, _ = p0.get_and_update_item((item, None), "a")
        before = p0.stats()["store_outstanding_refs"]

        def child_tries() -> bool:
            errors = 0
            for attempt in (
                lambda: raw.get(h, "a"),
                lambda: raw.get(h, "a", copy=False),
                lambda: cache.get_and_update_item(h, "a"),
            ):
                try:
                    attempt()
                except WrongProcessError as exc:
                    errors += "attach a new reader in the child" in str(exc)
            return errors == 3

        assert in_child(child_tries) == 0
        assert p0.stats()["store_outstanding_refs"] == before == 2, "the child consumed refs"
        got = cache.get_and_update_item(h, "a")
        assert torch.equal(got["x"], item["x"])
        raw.close()
        cache.close()


def _reader_that_forks(reader_handle: Any, conn: Any, child_conn: Any, how: str) -> None:
    """Attach, take a zero-copy view of "a", fork a child that keeps it, then let go of
    everything in this process (``close``) or exit at once (``exit``)."""
    reader = ShmObjectStore.attach(reader_handle)
    conn.send("attached")
    handle = conn.recv()
    view = reader.get(handle, "a", copy=False)
    arr = np.frombuffer(view, dtype=np.uint8)
    if os.fork() == 0:  # the child keeps the inherited view until told to check it
        code = 1
        try:
            expected = pattern(1)
            child_conn.send("ready")
            child_conn.recv()  # the writer has reused the ring meanwhile
            child_conn.send(arr.tobytes() == expected)
            code = 0
        finally:
            os._exit(code)
    if how == "exit":
        os._exit(0)
    del arr, view
    gc.collect()
    reader.close()
    conn.send("closed")
    conn.recv()  # stay alive until the test is done


@pytest.mark.parametrize("how", ["close", "exit"])
def test_views_a_forked_child_keeps_never_change_after_its_parent_lets_go(how: str) -> None:
    writer = ShmObjectStore.create(2 * CHUNK)
    conn, their_conn = spawn.Pipe()
    child_conn, their_child_conn = spawn.Pipe()
    proc = spawn.Process(
        target=_reader_that_forks, args=(writer.handle(), their_conn, their_child_conn, how)
    )
    proc.start()
    try:
        assert recv(conn) == "attached"
        conn.send(writer.put("a", pattern(1)))
        assert recv(child_conn) == "ready"
        if how == "exit":
            # Not join(): the forked child inherited the pipe join() waits on.
            wait_until(lambda: proc.exitcode is not None, "the reader did not exit")
            assert proc.exitcode == 0
        else:
            assert recv(conn) == "closed"
        # The reader (this test's child process) is gone or detached: "a" is reclaimable and
        # the ring is reused many times over.
        for n in range(8):
            writer.put(f"churn{n}", pattern(100 + n))
        assert not writer.is_cached("a")
        child_conn.send("check")
        assert recv(child_conn) is True, "an inherited view changed its bytes"
    finally:
        if proc.is_alive():
            conn.send("done")
            proc.join(TIMEOUT)
        proc.kill()
    writer.close()


# -- 2. a forked child of the writer --------------------------------------------------------------


def test_every_writer_operation_raises_in_a_forked_child() -> None:
    writer = ShmObjectStore.create(4 * CHUNK)
    reader = ShmObjectStore.attach(writer.handle())
    h = writer.put("a", pattern(1))
    writer.put("b", pattern(2))

    operations = {
        "put": lambda: writer.put("c", pattern(3)),
        "put_item": lambda: writer.put_item("c", {"x": pattern(3)}),
        "issue": lambda: writer.issue("a"),
        "issue_if_present": lambda: writer.issue_if_present("a"),
        "issue_unpinning": lambda: writer.issue_unpinning("a", None),
        "get_cached": lambda: writer.get_cached("a"),
        "try_get_cached": lambda: writer.try_get_cached("a"),
        "pin": lambda: writer.pin("a"),
        "pin_if_present": lambda: writer.pin_if_present("a"),
        "try_pin": lambda: writer.try_pin("a"),
        "unpin": lambda: writer.unpin("a"),
        "pin_object": lambda: writer.pin_object("a"),
        "unpin_object": lambda: writer.unpin_object("a", 1),
        "claim": lambda: writer.claim("d"),
        "unclaim": lambda: writer.unclaim("d"),
        "wait_for": lambda: writer.wait_for(["d"], 0),
        "uncached": lambda: writer.uncached(["a"]),
        "read_meta": lambda: writer.read_meta("a"),
        "release": lambda: writer.release(h),
        "invalidate": lambda: writer.invalidate("b"),
        "clear": writer.clear,
        "is_cached": lambda: writer.is_cached("a"),
        "keys": writer.keys,
        "verify": lambda: writer.verify(h, "a"),
        "read_stored": lambda: writer.read_stored("a"),
        "get_stored": lambda: writer.get_stored("a"),
        "get": lambda: writer.get(h, "a"),
        "get_item": lambda: writer.get_item(h, "a"),
        "stats": writer.stats,
    }
    # Every method of a writer is tried, but those that touch nothing shared: a new method
    # must join one list or the other.
    local = {"attach", "close", "create", "handle", "join", "writer_handle"}
    methods = {n for n in dir(ShmWriter) if not n.startswith("_")}
    methods -= {n for n in methods if not callable(getattr(ShmWriter, n))}  # properties
    assert methods - local == set(operations)

    def child_tries_everything() -> bool:
        refused = []
        for name, operation in operations.items():
            try:
                operation()
            except WrongProcessError:
                refused.append(name)
        writer.close()  # closing the inherited copy is allowed and does nothing
        return refused == list(operations)

    assert in_child(child_tries_everything) == 0
    # The creator carries on; the reader sees exactly what was put.
    assert writer.is_cached("b") and writer.keys() and not writer.closed
    assert reader.get(h, "a") == pattern(1)
    assert os.path.exists(f"{SHM}/{writer.name}")
    writer.close()


def test_a_forked_child_of_p0_gets_a_clear_error_from_the_cache() -> None:
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1) as p0:
        worker = ShmReceiverCache(p0.handle())
        item = {"x": torch.ones(10)}
        h, _ = p0.get_and_update_item((item, "pu"), "a")

        def child_updates() -> bool:
            try:
                p0.get_and_update_item(({"x": torch.zeros(10)}, "pu"), "b")
            except WrongProcessError:
                return True
            return False

        assert in_child(child_updates) == 0
        assert p0.is_cached(["a", "b"]) == [True, False]
        assert torch.equal(worker.get_and_update_item(h, "a")["x"], item["x"])
        worker.close()


# -- 3, 4. reader slots: races and dead occupants --------------------------------------------------


def _attach_and_hold(reader_handle: Any, conn: Any, barrier: Any) -> None:
    if barrier is not None:
        barrier.wait(TIMEOUT)
    try:
        reader = ShmObjectStore.attach(reader_handle)
    except Exception as exc:  # reported, not raised: the test asserts on it
        conn.send(repr(exc))
        return
    conn.send(reader.reader_slot)
    conn.recv()


def test_readers_attaching_at_once_over_dead_readers_all_get_a_slot() -> None:
    n = 3
    writer = ShmObjectStore.create(1 << 16, n_readers=n)
    doomed = []
    for _ in range(n):
        conn, theirs = spawn.Pipe()
        p = spawn.Process(target=_attach_and_hold, args=(writer.handle(), theirs, None))
        p.start()
        assert isinstance(recv(conn), int)
        doomed.append((p, conn))  # keep our end open: the reader holds on until killed
    for p, _ in doomed:
        os.kill(p.pid, signal.SIGKILL)
        p.join(TIMEOUT)
    # Every slot is claimed by a dead process; n newcomers race to take them over.
    barrier = spawn.Barrier(n)
    conns, procs = [], []
    for _ in range(n):
        conn, theirs = spawn.Pipe()
        p = spawn.Process(target=_attach_and_hold, args=(writer.handle(), theirs, barrier))
        p.start()
        conns.append(conn)
        procs.append(p)
    try:
        slots = [recv(c) for c in conns]
        assert sorted(slots) == list(range(n)), slots
    finally:
        for c in conns:
            c.send("done")
        for p in procs:
            p.join(TIMEOUT)
    writer.close()


# -- 5. reference-counter saturation ---------------------------------------------------------------

MAX_OUTSTANDING = (1 << 20) - 1


def test_a_hot_item_and_a_stuck_reader_never_make_the_cache_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    truth = {"pixel_values": torch.arange(64, dtype=torch.float32), "n": 7}
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1) as p0:
        stuck = ShmReceiverCache(p0.handle())  # attached, never reads
        first, _ = p0.get_and_update_item((truth, "pu"), "hot")
        assert isinstance(first, ShmHandle)
        hits = 0
        with caplog.at_level(logging.WARNING, logger="mmcache"):
            while True:
                data, updates = p0.get_and_update_item(None, "hot")
                if not isinstance(data, ShmHandle):
                    break
                hits += 1
        assert hits + 1 == MAX_OUTSTANDING, "every reference the slot can count was issued"
        # The core says why, with a MemoryError of its own, and changes nothing.
        with pytest.raises(ReferencesSaturatedError, match="not reading") as saturated:
            p0._store.issue("hot")
        assert isinstance(saturated.value, MemoryError)
        assert p0._store.stats()["outstanding_refs"] == MAX_OUTSTANDING
        # P0 believed it cached: served uncached, from a copy of what the ring holds.
        assert updates == "pu" and data.keys() == truth.keys()
        assert torch.equal(data["pixel_values"], truth["pixel_values"]) and data["n"] == 7
        # With data in the request: that data, as is.
        fresh = {"pixel_values": torch.ones(3), "n": 1}
        assert p0.get_and_update_item((fresh, "pu2"), "hot") == (fresh, "pu2")
        stats = p0.stats()
        assert stats["uncached_saturated"] == 2
        assert stats["store_outstanding_refs"] == MAX_OUTSTANDING, "no orphan references"
        messages = [r.getMessage() for r in caplog.records]
        assert any("not reading" in m for m in messages), messages
        assert not any("no space for 0 bytes" in m for m in messages)
        # Once the reader reads one, the item is served by handle again.
        got = stuck.get_and_update_item(first, "hot")
        assert torch.equal(got["pixel_values"], truth["pixel_values"])
        again, _ = p0.get_and_update_item(None, "hot")
        assert isinstance(again, ShmHandle)
        stuck.close()


# -- 6. a closed reader with live views drains -----------------------------------------------------


def test_a_closed_reader_keeps_its_views_and_stops_receiving_references() -> None:
    item = {"x": torch.arange(4096, dtype=torch.int32)}
    ring = 6 * (16 * KiB + 4 * KiB)
    with ShmSenderCache(ring / GiB, max_object_size_mb=1, n_readers=2) as p0:
        closing = ShmReceiverCache(p0.handle(), copy=False)
        other = ShmReceiverCache(p0.handle())
        h, _ = p0.get_and_update_item((item, None), "kept")
        view = closing.get_and_update_item(h, "kept")["x"]
        other.get_and_update_item(h, "kept")
        closing.close()
        assert p0.stats()["store_readers_draining"] == 1
        for n in range(40):
            data, _ = p0.get_and_update_item(({"x": torch.full((4096,), n)}, None), f"n{n}")
            assert isinstance(data, ShmHandle), "the ring filled up for a closed reader"
            other.get_and_update_item(data, f"n{n}")
        assert p0.stats()["uncached_full"] == 0
        assert p0.is_cached_item("kept") and torch.equal(view, item["x"])
        with pytest.raises(ClosedError):
            closing.get_and_update_item(h, "kept")
        del view
        assert_slot_freed_and_reused(p0)
        other.close()


def assert_slot_freed_and_reused(p0: ShmSenderCache) -> None:
    """Once the draining reader's last view is gone (collected now), its slot is free, and a
    newcomer attaches and reads ``n39``."""
    gc.collect()
    assert p0.stats()["store_readers_draining"] == 0
    with ShmReceiverCache(p0.handle()) as newcomer:
        h, _ = p0.get_and_update_item(None, "n39")
        assert newcomer.get_and_update_item(h, "n39")["x"][0] == 39


@pytest.mark.parametrize("reader", ["ShmReceiverCache", "ShmReader"])
def test_a_reader_dropped_without_close_drains_as_a_closed_one(reader: str) -> None:
    """A worker that lets go of its cache (or core reader) without ``close()`` while its
    tensors live on: the slot drains as after ``close()``, instead of collecting one unread
    reference per new object until the ring is full of them."""
    item = {"x": torch.arange(4096, dtype=torch.int32)}
    ring = 6 * (16 * KiB + 4 * KiB)
    with ShmSenderCache(ring / GiB, max_object_size_mb=1, n_readers=1) as p0:
        # Attached before the put: the handle carries a reference for it (a view, not a copy).
        if reader == "ShmReceiverCache":
            cache = ShmReceiverCache(p0.handle(), copy=False)
            h, _ = p0.get_and_update_item((item, None), "kept")
            view = cache.get_and_update_item(h, "kept")["x"]
            del cache
        else:
            store = ShmObjectStore.attach(p0.handle())
            h, _ = p0.get_and_update_item((item, None), "kept")
            view = store.get_item(h, "kept", copy=False)["x"]
            del store
        gc.collect()
        assert p0.stats()["store_readers_draining"] == 1
        for n in range(40):
            data, _ = p0.get_and_update_item(({"x": torch.full((4096,), n)}, None), f"n{n}")
            assert isinstance(data, ShmHandle), "the ring filled up for a dropped reader"
        assert p0.stats()["uncached_full"] == 0
        assert torch.equal(view, item["x"])
        del view
        assert_slot_freed_and_reused(p0)


# -- 7. PID namespaces -----------------------------------------------------------------------------


# A new PID (and /proc) namespace; its init dies with the unshare process.
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _unshare_available() -> str | None:
    """Why a new PID namespace cannot be made here (None if it can)."""
    if shutil.which("unshare") is None:
        return "the unshare command is not installed"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -p is not permitted here: {probe.stderr.strip()}"
    return None


NAMESPACED_READER = textwrap.dedent(
    """
    import pickle, sys
    from mmcache._core import ShmObjectStore
    from mmcache import prune
    handle, puts = pickle.load(sys.stdin.buffer)
    reader = ShmObjectStore.attach(handle)
    print("attached", flush=True)
    pruned = prune(dry_run=True)  # what prune would remove from this namespace
    got = [bytes(reader.get(h, key)) for key, h, _ in puts[:1]]
    print("pruned", ",".join(pruned) or "-", flush=True)
    print("read", got[0] == puts[0][2], flush=True)
    sys.stdin.readline()  # hold the slot (and the unread handles) until told
    """
)


def test_liveness_holds_across_pid_namespaces() -> None:
    reason = _unshare_available()
    if reason is not None:
        pytest.skip(reason)
    import pickle

    writer = ShmObjectStore.create(3 * CHUNK)
    puts = [("a", writer.put("a", pattern(1)), pattern(1))]
    proc = subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", NAMESPACED_READER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=False,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(pickle.dumps((writer.handle(), puts)))
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"attached"
        pruned = proc.stdout.readline().split()
        assert writer.name.encode() not in pruned[1].split(b","), "prune took a live segment"
        assert proc.stdout.readline().strip() == b"read True", "a live writer looked gone"
        for n, key in enumerate("bcd"):  # the namespaced reader never reads these
            writer.put(key, pattern(2 + n))
        with pytest.raises(MemoryError):
            writer.put("e", pattern(5))  # b, c, d: unread by a reader alive elsewhere
        assert writer.stats()["readers_reclaimed"] == 0, "a live reader's slot was freed"
        info = _core.inspect_segment(writer.name)
        assert info["readers"][0]["alive"] and info["creator_alive"]
        assert writer.name not in prune(dry_run=True)
    finally:
        # unshare's death sends its child SIGKILL (--kill-child) before unshare can be
        # reaped, so once wait() returns the reader runs no more code; only then is its stdin
        # closed (an end of file seen first would let it close its slot cleanly, and nothing
        # would be left to reclaim).
        proc.kill()
        proc.wait(timeout=TIMEOUT)
        proc.communicate(timeout=TIMEOUT)  # closes the pipes
    # Once it is gone (whatever namespace it was in), its slot is reclaimed.

    def put_once_reclaimed() -> bool:
        try:
            writer.put("e", pattern(5))
        except MemoryError:
            return False
        return True

    wait_until(put_once_reclaimed, "the dead reader's slot was never reclaimed")
    assert writer.stats()["readers_reclaimed"] == 1
    writer.close()


NAMESPACED_WRITER = textwrap.dedent(
    """
    import sys
    from mmcache._core import ShmObjectStore
    writer = ShmObjectStore.create(1 << 16)
    print(writer.name, flush=True)
    sys.stdin.readline()
    """
)


def gone_or_not_live(name: str) -> bool:
    try:
        return _core.segment_status(name)[0] != "live"
    except FileNotFoundError:
        return True


def test_prune_in_another_namespace_never_removes_a_live_writers_segment() -> None:
    reason = _unshare_available()
    if reason is not None:
        pytest.skip(reason)
    proc = subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", NAMESPACED_WRITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        name = proc.stdout.readline().strip()
        # Its pid (1 or 2 in its namespace) means nothing here; its lock does.
        assert _core.segment_status(name)[0] == "live"
        assert name not in prune()
        assert name in _core.list_segments()
    finally:
        proc.kill()
        proc.communicate(timeout=TIMEOUT)  # reaps it and closes the pipes
    # Its init is killed as unshare dies, not before.
    wait_until(lambda: gone_or_not_live(name), "the writer never died")
    # (Any store's creation on this host may remove the orphan before this prune does.)
    assert name in prune() or not os.path.exists(f"{SHM}/{name}"), "its orphan was left"


# -- 8. damaged segments ---------------------------------------------------------------------------


def _writer_then_wait(conn: Any) -> None:
    store = ShmObjectStore.create(1 << 20)
    conn.send(store.name)
    conn.recv()


def test_prune_removes_truncated_and_garbage_segments_of_dead_writers() -> None:
    conn, theirs = spawn.Pipe()
    proc = spawn.Process(target=_writer_then_wait, args=(theirs,))
    proc.start()
    try:
        name = recv(conn)
        os.truncate(f"{SHM}/{name}", 4096)  # another process of the same user does this
        assert _core.segment_status(name)[0] == "live", "its writer still runs"
        assert name not in prune()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
    finally:
        proc.kill()
    garbage = f"mmc_garbage_{os.getpid()}"
    with open(f"{SHM}/{garbage}", "wb") as f:
        f.write(os.urandom(5000))
    fresh = f"mmc_fresh_{os.getpid()}"
    open(f"{SHM}/{fresh}", "wb").close()  # empty and new: may be a segment being created
    try:
        # Any store's creation on this host removes orphans: another test run may take these
        # before this test's prune does.
        try:
            status, why = _core.segment_status(name)
            assert status == "orphaned" and "bytes" in why, why
        except FileNotFoundError:
            pass
        removed = prune()
        assert not os.path.exists(f"{SHM}/{name}") and not os.path.exists(f"{SHM}/{garbage}")
        assert fresh not in removed
        with ShmObjectStore.create(1 << 16):  # nor does a creation touch it
            assert _core.segment_status(fresh)[0] == "undecided"
    finally:
        for leftover in (garbage, fresh):
            if os.path.exists(f"{SHM}/{leftover}"):
                os.unlink(f"{SHM}/{leftover}")


# -- 10. inspect on things that are not segments ---------------------------------------------------


@pytest.fixture
def not_segments() -> Iterator[dict[str, str]]:
    tag = f"{os.getpid()}_{time.monotonic_ns()}"
    names = {"fifo": f"mmc_fifo_{tag}", "directory": f"mmc_dir_{tag}", "link": f"mmc_link_{tag}"}
    os.mkfifo(f"{SHM}/{names['fifo']}")
    os.mkdir(f"{SHM}/{names['directory']}")
    os.symlink("/etc/passwd", f"{SHM}/{names['link']}")
    yield names
    os.unlink(f"{SHM}/{names['fifo']}")
    os.rmdir(f"{SHM}/{names['directory']}")
    os.unlink(f"{SHM}/{names['link']}")


def test_inspect_of_something_that_is_not_a_segment_fails_in_one_line(
    not_segments: dict[str, str],
) -> None:
    cases = {**not_segments, "outside": "../etc/passwd", "nested": "a/b"}
    for kind, name in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "mmcache", "inspect", name],
            capture_output=True,
            text=True,
            timeout=60,  # a FIFO opened for reading without O_NONBLOCK would hang here
        )
        assert result.returncode != 0, kind
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (kind, result.stderr)
        assert result.stdout == ""
    # And the listing/pruning commands walk past them.
    listing = subprocess.run(
        [sys.executable, "-m", "mmcache", "inspect"], capture_output=True, text=True, timeout=60
    )
    assert listing.returncode == 0 and "Traceback" not in listing.stderr
    assert all(name not in prune(dry_run=True) for name in not_segments.values())


# -- 11. sizes that are not numbers ---------------------------------------------------------------


@pytest.mark.parametrize("capacity_gb", [float("inf"), float("nan"), -1.0, 1e30])
def test_capacities_that_are_not_sizes_are_value_errors(capacity_gb: float) -> None:
    for mode in ("processor_only", "lru", "shm"):
        with pytest.raises(ValueError, match="capacity_gb"):
            make_caches(mode, capacity_gb=capacity_gb)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "capacity_gb", [4 << 30, 2**40, 16384.5, 1e300, pytest.param(2**2000, id="2**2000")]
)
@pytest.mark.parametrize("mode", ["processor_only", "lru", "shm"])
def test_a_capacity_in_bytes_is_a_value_error_saying_capacity_gb_is_in_gib(
    mode: str, capacity_gb: float
) -> None:
    # capacity_gb=4 << 30 (4 GiB, in bytes) was a 4 EiB LRU, which never evicts and so grows
    # until the process runs out of memory, and for shm the core's "capacity
    # 4611686018427387904 is too large (at most 17592186044416 bytes)", naming no argument
    # the caller passed. A bound past 2**44 bytes (the ring's) is no cache of one host.
    message = f"^capacity_gb is in GiB: {re.escape(repr(capacity_gb))} GiB asked, more than 16384"
    with pytest.raises(ValueError, match=message):
        make_caches(mode, capacity_gb=capacity_gb)  # type: ignore[arg-type]


def test_the_largest_capacity_is_the_rings_and_sizes_stay_exact() -> None:
    # 16 TiB is a bound an LRU takes (the ring would need /dev/shm to hold it).
    sender, downstream = make_caches("lru", capacity_gb=16384)
    assert isinstance(sender, SenderCache) and isinstance(downstream, ReceiverCache)
    assert sender.stats()["capacity_bytes"] == 2**44
    sender.close()
    downstream.close()
    # The usual sizes are still the same bytes, to the byte (P0 and P1 of lru mirror them).
    assert capacity_bytes(0.5) == GiB // 2 and capacity_bytes(1.75) == 7 * GiB // 4
    assert capacity_bytes(3) == 3 * GiB and capacity_bytes(1e-9) == int(1e-9 * GiB)


class _Forged:
    """Pickles as a call of ``unpickler(*args)``: what a hostile pickle of a handle runs."""

    def __init__(self, unpickler: Callable[..., Any], *args: Any) -> None:
        self.call = (unpickler, args)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.call


_SECRET = b"\0" * 32
_READER_FIELDS: dict[str, Any] = {
    "name": "x",
    "capacity": MiB,
    "n_readers": 1,
    "max_object_size": MiB,
    "layout_version": 1,
}
# In the unpicklers' order: max_writers before layout_version.
_WRITER_FIELDS = {
    "name": "x",
    "capacity": MiB,
    "n_readers": 1,
    "max_object_size": MiB,
    "max_writers": 1,
    "layout_version": 1,
}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("capacity", -1),
        ("capacity", 2**64),
        ("n_readers", -1),
        ("n_readers", 2**40),
        ("n_readers", 2**70),
        ("max_writers", -1),
        ("max_writers", 2**40),
        ("max_object_size", -1),
        ("max_objects", -1),
        ("max_objects", 2**64),
    ],
)
def test_an_integer_argument_out_of_range_is_a_value_error_naming_it(name: str, value: int) -> None:
    # Was PyO3's OverflowError ("can't convert negative int to unsigned", "out of range
    # integral type conversion attempted"), naming neither the argument nor its range.
    kwargs: dict[str, Any] = {"capacity": MiB, name: value}
    with pytest.raises(ValueError, match=f"^{name} must be .*, got {value}\\b"):
        ShmObjectStore.create(**kwargs)
    if name in ("n_readers", "max_writers"):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            ShmSenderCache(1 / 1024, **{name: value})
        with pytest.raises(ValueError, match=f"^{name} must be"):
            make_caches("shm", capacity_gb=1 / 1024, **{name: value})  # type: ignore[arg-type]
    # The handles' fields, built or unpickled (a pickle can hold any int).
    for handle, unpickler, fields in (
        (_core.ReaderHandle, _core._reader_handle, _READER_FIELDS),  # type: ignore[attr-defined]
        (_core.WriterHandle, _core._writer_handle, _WRITER_FIELDS),  # type: ignore[attr-defined]
    ):
        if name not in fields:
            continue
        changed = {**fields, name: value}
        with pytest.raises(ValueError, match=f"^{name} must be"):
            handle(**changed, secret=_SECRET)
        forged = pickle.dumps(_Forged(unpickler, *changed.values(), _SECRET))
        with pytest.raises(ValueError, match=f"^{name} must be"):
            pickle.loads(forged)
    # Not an int at all stays a TypeError that names the argument.
    with pytest.raises(TypeError, match=name):
        ShmObjectStore.create(**{**kwargs, name: 1.5})


@pytest.mark.parametrize("value", ["2", 2.0, None])
@pytest.mark.parametrize(
    "name", ["capacity", "n_readers", "max_writers", "max_object_size", "max_objects"]
)
def test_an_integer_argument_that_is_no_int_is_a_type_error_naming_it(
    name: str, value: object
) -> None:
    # n_readers="2" (from an environment variable or a command line) was PyO3's "'str'
    # object cannot be interpreted as an integer": its message named no argument (PyO3 puts
    # the name in a note, which a log of str(error) loses).
    if value is None and name in ("max_object_size", "max_objects"):
        return  # None is their default: no limit asked

    def refused(make: Callable[..., object], **kwargs: Any) -> None:
        with pytest.raises(TypeError) as refusal:
            make(**kwargs)
        message = str(refusal.value)
        assert message.startswith(f"{name} must be an int ("), message
        assert message.endswith(f"), not {type(value).__name__}"), message

    refused(ShmObjectStore.create, **{"capacity": MiB, name: value})
    if name in ("n_readers", "max_writers"):
        refused(ShmSenderCache, capacity_gb=1 / 1024, **{name: value})
        refused(make_caches, mode="shm", capacity_gb=1 / 1024, **{name: value})
    for handle, fields in (
        (_core.ReaderHandle, _READER_FIELDS),
        (_core.WriterHandle, _WRITER_FIELDS),
    ):
        if name in fields:
            refused(handle, **{**fields, name: value}, secret=_SECRET)


def _name_takers() -> list[Callable[[object], object]]:
    """Every entry point that takes a segment name, called with ``name`` alone varied."""
    from mmcache.maintenance import inspect

    return [
        lambda name: ShmObjectStore.create(MiB, name=name),  # type: ignore[arg-type]
        lambda name: ShmSenderCache(1 / 1024, name=name),  # type: ignore[arg-type]
        lambda name: make_caches("shm", capacity_gb=1 / 1024, name=name),  # type: ignore[arg-type]
        inspect,
        _core.inspect_segment,
        _core.segment_status,
        _core.unlink_segment,
        _core.remove_orphaned_segment,
        lambda name: _core.ReaderHandle(**{**_READER_FIELDS, "name": name}, secret=_SECRET),
        lambda name: _core.WriterHandle(**{**_WRITER_FIELDS, "name": name}, secret=_SECRET),
        lambda name: pickle.loads(
            pickle.dumps(
                _Forged(_core._reader_handle, *{**_READER_FIELDS, "name": name}.values(), _SECRET)  # type: ignore[attr-defined]
            )
        ),
        lambda name: pickle.loads(
            pickle.dumps(
                _Forged(_core._writer_handle, *{**_WRITER_FIELDS, "name": name}.values(), _SECRET)  # type: ignore[attr-defined]
            )
        ),
    ]


@pytest.mark.parametrize("value", [3, b"x", 1.5])
def test_a_segment_name_that_is_no_str_is_a_type_error_naming_it(value: object) -> None:
    # Was PyO3's "'int' object is not an instance of 'str'": the argument was named only in
    # a note ("while processing 'name'"), which a log of str(error) loses.
    for take in _name_takers():
        with pytest.raises(TypeError) as refusal:
            take(value)
        message = str(refusal.value)
        assert message.startswith("name must be a str"), message
        assert message.endswith(f"not {type(value).__name__}"), message


def test_a_segment_name_that_is_not_utf8_is_a_value_error_naming_it() -> None:
    # "\udcff" is how Python decodes the byte 0xff of a file name (os.listdir, sys.argv):
    # it was a UnicodeEncodeError about the 'utf-8' codec, naming no argument. No segment
    # has such a name (every name this package makes is UTF-8).
    for take in _name_takers():
        with pytest.raises(ValueError, match=r"^name 'mmc_\\udcff' is not valid UTF-8") as refusal:
            take("mmc_\udcff")
        assert not isinstance(refusal.value, UnicodeError)


def test_an_int_of_another_type_is_an_int() -> None:
    with ShmSenderCache(1 / 1024, n_readers=np.int64(2), max_writers=np.uint8(3)) as p0:  # type: ignore[arg-type]
        assert p0.handle().n_readers == 2 and p0.max_writers == 3


@pytest.mark.parametrize("monotonic_id", [-1, 2**64])
def test_a_monotonic_id_out_of_range_is_a_value_error_naming_it(monotonic_id: int) -> None:
    # No object has such an id: it was PyO3's OverflowError, naming nothing.
    with ShmObjectStore.create(MiB) as writer:
        writer.put("k", b"x")
        assert writer.pin_object("k") is not None
        with pytest.raises(ValueError, match=r"^monotonic_id must be an integer in"):
            writer.unpin_object("k", monotonic_id)
        with pytest.raises(ValueError, match=r"^monotonic_id must be an integer in"):
            writer.read_meta("k", monotonic_id=monotonic_id)
        with pytest.raises(ValueError, match=r"^pinned must be a monotonic id from pin_object"):
            writer.issue_unpinning("k", monotonic_id)


@pytest.mark.parametrize(("address", "monotonic_id"), [(-1, 1), (2**64, 1), (0, -1), (0, 2**64)])
def test_an_unpickled_item_handle_out_of_range_is_a_value_error(
    address: int, monotonic_id: int
) -> None:
    forged = pickle.dumps(_Forged(_core._shm_handle, address, monotonic_id, b"s" * 20))  # type: ignore[attr-defined]
    name = "address" if address != 0 else "monotonic_id"
    with pytest.raises(ValueError, match=f"^{name} must be an integer in"):
        pickle.loads(forged)
    with pytest.raises(ValueError, match=f"^{name} must be an integer in"):
        ShmHandle(address=address, monotonic_id=monotonic_id, signature=b"s" * 20)


@pytest.mark.parametrize("limit_mb", [float("inf"), 1e30])
def test_object_size_limits_beyond_the_ring_are_clamped(limit_mb: float) -> None:
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=limit_mb) as p0:
        assert 0 < p0.stats()["max_object_size"] < 1 * MiB
    with pytest.raises(ValueError, match="max_object_size_mb"):
        ShmSenderCache(1 * MiB / GiB, max_object_size_mb=float("nan"))


@pytest.mark.parametrize("limit_mb", ["128", None, b"1"])
def test_an_object_size_limit_that_is_no_number_is_a_type_error_naming_it(limit_mb: Any) -> None:
    # Was "'>' not supported between instances of 'str' and 'int'" (naming neither).
    with pytest.raises(TypeError, match=r"^max_object_size_mb must be a number of MiB, not "):
        ShmSenderCache(1 * MiB / GiB, max_object_size_mb=limit_mb)


# -- 14. a write into a zero-copy view explains itself ---------------------------------------------

WRITES_INTO_ITS_VIEW = textwrap.dedent(
    """
    import torch
    from mmcache import ShmReceiverCache, ShmSenderCache
    p0 = ShmSenderCache(1 / 1024, max_object_size_mb=1)
    worker = ShmReceiverCache(p0.handle(), copy=False)
    handle, _ = p0.get_and_update_item(({"x": torch.ones(1000)}, None), "a")
    tensor = worker.get_and_update_item(handle, "a")["x"]
    tensor.mul_(2)
    print("survived")
    """
)


@pytest.mark.parametrize("faulthandler", [False, True])
def test_an_in_place_op_on_a_zero_copy_tensor_dies_explaining_why(faulthandler: bool) -> None:
    flags = ["-X", "faulthandler"] if faulthandler else []
    result = subprocess.run(
        [sys.executable, *flags, "-c", WRITES_INTO_ITS_VIEW],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == -signal.SIGSEGV, result
    assert "survived" not in result.stdout
    explained = [line for line in result.stderr.splitlines() if line.startswith("mmcache:")]
    assert len(explained) == 1, result.stderr
    assert "read-only zero-copy view" in explained[0] and "copy=True" in explained[0]
    if faulthandler:
        assert "Fatal Python error: Segmentation fault" in result.stderr
    # Other segfaults are not blamed on mmcache.
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ctypes, mmcache, torch; "
            "from mmcache import make_caches; make_caches('shm', capacity_gb=0.001); "
            "ctypes.string_at(0)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode == -signal.SIGSEGV and "mmcache:" not in other.stderr


SENDS_ITSELF_SIGBUS = textwrap.dedent(
    """
    import os, signal, sys
    from mmcache import ShmSenderCache
    if sys.argv[1] == "ignored":
        signal.signal(signal.SIGBUS, signal.SIG_IGN)
    with ShmSenderCache(1 / 1024):
        os.kill(os.getpid(), signal.SIGBUS)
        print("after the first", flush=True)
        os.kill(os.getpid(), signal.SIGBUS)
        print("after the second", flush=True)
    """
)


@pytest.mark.parametrize("disposition", ["default", "ignored"])
def test_a_fault_signal_sent_by_kill_keeps_the_disposition_before_mmcaches(
    disposition: str,
) -> None:
    """No fault and no instruction to run again: the explainer hands the signal on at once,
    as the disposition before it says (the default kills at the first; ignored stays so)."""
    result = subprocess.run(
        [sys.executable, "-c", SENDS_ITSELF_SIGBUS, disposition],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if disposition == "default":
        assert result.returncode == -signal.SIGBUS and "after" not in result.stdout, result
    else:
        assert result.returncode == 0 and "after the second" in result.stdout, result
    assert "mmcache:" not in result.stderr
