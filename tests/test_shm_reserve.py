"""A ring is ready at once and reserved afterwards (SPEC §5, guarantee 5 kept).

Creation reserves only the header and slot tables; a background thread the creator's first put
starts reserves the rest, and every access of a writer reserves what it touches first. These
tests check that creation leaves the ring unreserved and starts no thread, that puts into space
nobody reserved yet work and read back, that the background reservation finishes, and that a
tmpfs filled up after creation gives `ShmTooSmallError` at a put, never a SIGBUS, which
`ShmSenderCache` serves uncached (in a private tmpfs: `unshare -rm`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mmcache._core import ShmObjectStore

SHM = "/dev/shm"
MiB = 1 << 20


def allocated(name: str) -> tuple[int, int]:
    """(bytes of the segment's file allocated in tmpfs, its size)."""
    st = os.stat(os.path.join(SHM, name))
    return st.st_blocks * 512, st.st_size


def content(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_puts_into_space_nobody_reserved_yet_work_and_read_back(monkeypatch):
    # The background reservation waits, so every put below lands in unreserved pages.
    monkeypatch.setenv("MMCACHE_TEST_RESERVE_DELAY_S", "5")
    writer = ShmObjectStore.create(64 * MiB, n_readers=1)
    try:
        held, size = allocated(writer.name)
        assert held < size // 8, f"creation reserved {held} of {size} bytes"
        reader = ShmObjectStore.attach(writer.handle())
        # ~3 laps of the ring: the first reserves as it goes, the next reuse what it did.
        for i in range(150):
            data = content(i, MiB - 1000 + i)
            handle = writer.put(f"k{i}", data)
            assert bytes(reader.resolve(handle, f"k{i}")) == data
        held, size = allocated(writer.name)
        assert held > size // 2, "the puts reserved the ring they wrote"
        reader.close()
    finally:
        writer.close()


def test_the_background_reservation_reserves_the_whole_segment():
    writer = ShmObjectStore.create(64 * MiB)
    try:
        writer.release(writer.put("first", b"starts the background reservation"))
        deadline = time.monotonic() + 120  # only stops a hung test
        while (state := allocated(writer.name))[0] < state[1]:
            if time.monotonic() > deadline:
                pytest.fail(f"hung: reserved {state[0]} of {state[1]} bytes")
            time.sleep(0.02)
    finally:
        writer.close()


def test_the_first_put_starts_the_reservation_thread_not_the_creation():
    # In a process of its own, so that no other store's thread is counted.
    script = textwrap.dedent(
        """
        import os
        from mmcache._core import ShmObjectStore

        def threads():  # counted, not named: a new thread names itself a moment later
            return len(os.listdir(f"/proc/{os.getpid()}/task"))

        before = threads()
        writer = ShmObjectStore.create(64 << 20)
        print(threads() - before)
        writer.release(writer.put("k", b"x" * 1000))
        print(threads() - before)
        writer.release(writer.put("k2", b"x" * 1000))
        print(threads() - before)
        writer.close()
        """
    )
    # The delay keeps the thread alive while it is counted.
    env = {**os.environ, "MMCACHE_TEST_RESERVE_DELAY_S": "5"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "1"], out.stdout


def test_a_joined_writer_reserves_what_it_touches(monkeypatch):
    monkeypatch.setenv("MMCACHE_TEST_RESERVE_DELAY_S", "5")
    first = ShmObjectStore.create(32 * MiB, n_readers=1, max_writers=2)
    try:
        second = ShmObjectStore.join(first.writer_handle())
        reader = ShmObjectStore.attach(first.handle())
        for i in range(40):
            w = (first, second)[i % 2]
            data = content(i, MiB + i)
            assert bytes(reader.resolve(w.put(f"k{i}", data), f"k{i}")) == data
        reader.close()
        second.close()
    finally:
        first.close()


# A private tmpfs of 32 MiB holds a ring of 24 MiB, which creation accepts; a file then takes
# what is left, so the ring's pages nobody reserved yet cannot be allocated any more.
FILL_DEV_SHM = textwrap.dedent(
    """
    def fill_dev_shm():
        # A file takes what is left of /dev/shm.
        with open("/dev/shm/filler", "wb") as f:
            try:
                while True:
                    f.write(b"x" * (1 << 20))
                    f.flush()
            except OSError:
                pass
    """
)
FULL_TMPFS = FILL_DEV_SHM + textwrap.dedent(
    """
    import os, sys
    from mmcache._core import ShmObjectStore, ShmTooSmallError
    MiB = 1 << 20
    writer = ShmObjectStore.create(24 * MiB, n_readers=1)
    reader = ShmObjectStore.attach(writer.handle())
    fill_dev_shm()
    stored = refused = 0
    for i in range(60):
        data = bytes([i % 251]) * (MiB + i)
        try:
            handle = writer.put(f"k{i}", data)
        except ShmTooSmallError as exc:
            assert isinstance(exc, MemoryError) and "shm-size" in str(exc), exc
            refused += 1
            continue
        assert bytes(reader.resolve(handle, f"k{i}")) == data, i
        stored += 1
    reader.close()
    writer.close()
    print(f"stored {stored} refused {refused}")
    """
)


def private_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def run_in_private_tmpfs(
    program: str,
    *args: str,
    options: str = "size=32m",
    reserve_delay_s: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the Python ``program`` (with ``args``) in a mount namespace of its own whose
    /dev/shm is a fresh tmpfs mounted with ``options``; ``reserve_delay_s`` holds the ring's
    background reservation back (``MMCACHE_TEST_RESERVE_DELAY_S``). It must exit with 0."""
    script = f'mount -t tmpfs -o {options} tmpfs /dev/shm && exec {sys.executable} -c "$@"'
    env = dict(os.environ)
    if reserve_delay_s is not None:
        env["MMCACHE_TEST_RESERVE_DELAY_S"] = reserve_delay_s
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", program, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    return done


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
@pytest.mark.parametrize("delay", ["60", "0"], ids=["puts-reserve", "background-reserves"])
def test_a_tmpfs_filled_after_creation_gives_shm_too_small_at_a_put_never_sigbus(delay):
    done = run_in_private_tmpfs(FULL_TMPFS, reserve_delay_s=delay)
    stored, refused = (int(w) for w in done.stdout.split()[1::2])
    assert stored + refused == 60
    if delay != "0":
        # Nothing reserved the ring ahead of the filler: the puts that needed more found none.
        assert refused > 0


# The same at the cache level: what P0 (vLLM's frontend among them) calls for each request.
# `sys.argv[1]` items go in before another process fills /dev/shm (none: no store lock was
# ever taken); every call after that must answer.
FULL_TMPFS_CACHE = FILL_DEV_SHM + textwrap.dedent(
    """
    import sys
    import numpy as np
    from mmcache import ShmHandle, ShmReceiverCache, ShmSenderCache
    MiB = 1 << 20
    p0 = ShmSenderCache(24 / 1024, max_object_size_mb=4, max_writers=2, n_readers=2)
    p1 = ShmReceiverCache(p0.handle())
    def item(i):
        return {"x": np.full(MiB + i, i % 251, dtype=np.uint8)}
    before = [f"before{i}" for i in range(int(sys.argv[1]))]
    for i, h in enumerate(before):
        handle, _ = p0.get_and_update_item((item(i), None), h)
        p1.get_and_update([handle], [h])
    fill_dev_shm()
    # A second frontend and a second worker that start only now (a process of their own
    # maps the segment afresh: it reserves the pages it touches, by the granule).
    writers = [p0, ShmSenderCache.join(p0.writer_handle())]
    readers = [p1, ShmReceiverCache(p0.handle())]
    raised, uncached = [], 0
    for i in range(20):
        h = f"k{i}"
        p, worker = writers[i % 2], readers[i % 2]
        p.begin_request()
        try:
            assert p.is_cached([h, *before], claim=True) == [False] + [True] * len(before)
            for key in (h, *before):
                p.touch_sender_cache_item(key)
            out, _ = p.get_and_update_item((item(i), None), h)
            uncached += isinstance(out, dict)
            assert isinstance(out, ShmHandle) or np.array_equal(out["x"], item(i)["x"]), i
            (got,) = worker.get_and_update([out], [h])
            assert np.array_equal(got["x"], item(i)["x"]), h
            for j, key in enumerate(before):  # still hits, and read back whole
                handle, _ = p.get_and_update_item((None, None), key)
                assert isinstance(handle, ShmHandle), type(handle)
                (got,) = worker.get_and_update([handle], [key])
                assert np.array_equal(got["x"], item(j)["x"]), key
        except MemoryError as exc:
            raised.append(type(exc).__name__)
        finally:
            p.end_request()
    p0.release_handles([p0.get_and_update_item((None, None), h)[0] for h in before])
    p0.invalidate((*before, "k0")[0])
    stats = p0.stats()
    assert stats["store_objects"] == max(len(before) - 1, 0), stats
    assert stats["store_writers_attached"] == 2, stats
    p0.clear_cache()
    assert writers[1].is_cached([*before, "k1"]) == [False] * (len(before) + 1)
    counted = stats["uncached_no_space"] + writers[1].stats()["uncached_no_space"]
    for cache in (*readers, *reversed(writers)):
        cache.close()
    print("raised", len(raised), sorted(set(raised)), "uncached", uncached, "counted", counted)
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
@pytest.mark.parametrize(
    "before",
    [
        # Before any store lock was taken the key index is unreserved, and tmpfs cannot
        # hold it: lookups, touches, claims, invalidate, stats and clear must still answer,
        # and a writer can still join.
        pytest.param("0", id="nothing-before"),
        pytest.param("2", id="two-items-before"),
    ],
)
def test_a_tmpfs_filled_after_creation_serves_items_uncached_and_never_raises(before) -> None:
    done = run_in_private_tmpfs(FULL_TMPFS_CACHE, before, reserve_delay_s="60")
    words = done.stdout.split()
    assert words[:3] == ["raised", "0", "[]"], done.stdout
    # The background reservation waits, so nothing reserved the ring ahead of the filler: the
    # new items found no room, were served uncached and counted as such.
    uncached, counted = int(words[4]), int(words[6])
    assert uncached == counted > 0, done.stdout
    assert "/dev/shm is full" in done.stderr, done.stderr


# Small objects are carved from a writer's allocation buffer (up to 256 KiB, reserved in one
# go); with less than that left in /dev/shm, the buffer cannot be reserved, but each object on
# its own still fits (the pages the failed attempt allocated are the ring's, and stay so).
SMALL_ITEMS_IN_WHAT_IS_LEFT = textwrap.dedent(
    """
    import os
    from mmcache._core import ShmObjectStore, ShmTooSmallError
    MiB, KiB = 1 << 20, 1 << 10
    writer = ShmObjectStore.create(24 * MiB, n_readers=1)
    reader = ShmObjectStore.attach(writer.handle())
    first = bytes(range(256)) * 4096  # 1 MiB: put on its own, it starts the (delayed) thread
    assert bytes(reader.resolve(writer.put("first", first), "first")) == first
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as f:  # leaves 192 KiB of /dev/shm
        f.write(b"x" * (st.f_bavail * st.f_frsize - 192 * KiB))
    stored = refused = 0
    for i in range(40):
        data = bytes([i]) * 4000
        try:
            handle = writer.put(f"s{i}", data)
        except ShmTooSmallError:
            refused += 1
            continue
        assert bytes(reader.resolve(handle, f"s{i}")) == data, i
        stored += 1
    stats = writer.stats()
    assert stats["objects"] == stats["chunks"] == stored + 1, stats
    assert stats["chunks_reserved"] == 0, stats
    reader.close()
    writer.close()
    print(f"stored {stored} refused {refused}")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_small_items_that_fit_in_what_is_left_of_dev_shm_are_stored():
    done = run_in_private_tmpfs(SMALL_ITEMS_IN_WHAT_IS_LEFT, reserve_delay_s="60")
    stored, refused = (int(w) for w in done.stdout.split()[1::2])
    assert stored + refused == 40
    # 192 KiB hold about 40 blocks of 4 KiB: what the buffer could not have, the objects can.
    assert stored >= 20, done.stdout


# Room freed again: the ring takes it again (README "Small /dev/shm"), whether or not a lock
# (which reserves the key index) was taken before the fill, and whether or not the background
# reservation ran into the filler (it stops at its first failure; nothing relies on it).
FREED_TMPFS_CACHE = FILL_DEV_SHM + textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from mmcache import ShmHandle, ShmReceiverCache, ShmSenderCache
    MiB = 1 << 20
    p0 = ShmSenderCache(24 / 1024, max_object_size_mb=8, max_writers=2, n_readers=2)
    p1 = ShmReceiverCache(p0.handle())
    def item(i, size=MiB):
        return {"x": np.full(size + i, i % 251, dtype=np.uint8)}
    before = [f"before{i}" for i in range(int(sys.argv[1]))]
    for i, h in enumerate(before):
        handle, _ = p0.get_and_update_item((item(i), None), h)
        p1.get_and_update([handle], [h])
    fill_dev_shm()
    writers = [p0, ShmSenderCache.join(p0.writer_handle())]
    readers = [p1, ShmReceiverCache(p0.handle())]
    def put(i, h):
        p = writers[i % 2]
        p.begin_request()
        try:
            out, _ = p.get_and_update_item((item(i), None), h)
            for worker in readers:
                (got,) = worker.get_and_update([out], [h])
                assert np.array_equal(got["x"], item(i)["x"]), h
        finally:
            p.end_request()
        return isinstance(out, ShmHandle)
    full = [put(i, f"full{i}") for i in range(8)]
    os.unlink("/dev/shm/filler")
    for j, h in enumerate(before):  # still hits
        handle, _ = p0.get_and_update_item((None, None), h)
        assert isinstance(handle, ShmHandle), h
        for worker in readers:
            (got,) = worker.get_and_update([handle], [h])
            assert np.array_equal(got["x"], item(j)["x"]), h
    uncached = [w.stats()["uncached_no_space"] for w in writers]
    # Two laps of the ring: every new item is cached again, by either writer.
    freed = [put(i, f"freed{i}") for i in range(40)]
    assert all(freed), freed
    assert [w.stats()["uncached_no_space"] for w in writers] == uncached
    assert writers[1].is_cached(["freed39", "freed38"], claim=True) == [True, True]
    stats = p0.stats()
    assert stats["store_objects"] > 0 and stats["store_claims"] == 0, stats
    for cache in (*readers, *reversed(writers)):
        cache.close()
    assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
    print("cached while full", sum(full), "of", len(full), "no_space", sum(uncached))
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
@pytest.mark.parametrize("delay", ["60", "0"], ids=["puts-reserve", "background-reserves"])
@pytest.mark.parametrize("before", ["0", "2"], ids=["nothing-before", "two-items-before"])
def test_a_tmpfs_that_frees_up_again_lets_the_ring_cache_new_items_again(delay, before):
    done = run_in_private_tmpfs(FREED_TMPFS_CACHE, before, reserve_delay_s=delay)
    words = done.stdout.split()
    cached, no_space = int(words[3]), int(words[-1])
    assert cached + no_space == 8, done.stdout
    if delay != "0":
        # Nothing reserved the ring ahead of the filler: while full, new items were served
        # uncached and counted so (the background reservation may have finished first).
        assert no_space > 0, done.stdout


# A put of an object larger than what /dev/shm has left is refused before anything changes:
# nothing of it is visible, the ring's counts are as before, and what does fit still goes in.
LARGE_PUT_INTO_A_FULL_TMPFS = textwrap.dedent(
    """
    import os
    from mmcache._core import ShmObjectStore, ShmTooSmallError
    MiB = 1 << 20
    writer = ShmObjectStore.create(24 * MiB, n_readers=1, max_writers=2)
    other = ShmObjectStore.join(writer.writer_handle())
    reader = ShmObjectStore.attach(writer.handle())
    first = os.urandom(MiB)
    assert bytes(reader.resolve(writer.put("first", first), "first")) == first
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as f:  # leaves 3 MiB of /dev/shm
        f.write(b"x" * (st.f_bavail * st.f_frsize - 3 * MiB))
    counts = ("bytes_in_use", "objects", "chunks", "chunks_reserved", "outstanding_refs")
    def ring():
        stats = writer.stats()
        return {k: stats[k] for k in counts}
    was = ring()
    large = os.urandom(8 * MiB)
    try:
        writer.put("large", large)
        raise AssertionError("an 8 MiB put into 3 MiB of /dev/shm was not refused")
    except ShmTooSmallError:
        pass
    assert ring() == was, (ring(), was)
    for w in (writer, other):
        assert w.is_cached("large") is False and w.keys() == ["first"]
        assert w.try_get_cached("large") is None
    assert bytes(reader.resolve(other.get_cached("first"), "first")) == first
    smaller = os.urandom(2 * MiB)
    assert bytes(reader.resolve(other.put("smaller", smaller), "smaller")) == smaller
    os.unlink("/dev/shm/filler")
    assert bytes(reader.resolve(writer.put("large", large), "large")) == large
    stats = writer.stats()
    assert stats["objects"] == stats["chunks"] == 3 and stats["chunks_reserved"] == 0, stats
    reader.close()
    other.close()
    writer.close()
    print("ok")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_a_large_put_into_a_full_tmpfs_is_refused_whole_and_changes_nothing():
    done = run_in_private_tmpfs(LARGE_PUT_INTO_A_FULL_TMPFS, reserve_delay_s="60")
    assert done.stdout.split() == ["ok"], done.stdout


# A tmpfs mounted without a size limit (`size=0`) reports no blocks at all (statvfs: 0 total,
# 0 free): it is not full, it has no limit, and a ring must be made in it.
UNLIMITED_TMPFS = textwrap.dedent(
    """
    import os
    import numpy as np
    from mmcache import ShmHandle, ShmReceiverCache, ShmSenderCache
    from mmcache._core import ShmObjectStore
    from mmcache.simulate.config import SimulationConfig
    MiB = 1 << 20
    st = os.statvfs("/dev/shm")
    assert st.f_blocks == st.f_bavail == 0, st
    writer = ShmObjectStore.create(64 * MiB, n_readers=1)
    reader = ShmObjectStore.attach(writer.handle())
    data = os.urandom(3 * MiB)
    assert bytes(reader.resolve(writer.put("k", data), "k")) == data
    reader.close()
    writer.close()
    p0 = ShmSenderCache(1 / 16)
    p1 = ShmReceiverCache(p0.handle())
    item = {"x": np.arange(MiB, dtype=np.uint8)}
    handle, _ = p0.get_and_update_item((item, None), "h")
    assert isinstance(handle, ShmHandle), type(handle)
    (got,) = p1.get_and_update([handle], ["h"])
    assert np.array_equal(got["x"], item["x"])
    p1.close()
    p0.close()
    SimulationConfig(mode="shm", capacity_gb=0.25).validate()
    assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
    print("ok")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_a_dev_shm_without_a_size_limit_holds_a_ring():
    done = run_in_private_tmpfs(UNLIMITED_TMPFS, options="size=0")
    assert done.stdout.split() == ["ok"], done.stdout


# /dev/shm with bytes to spare but no file left to give (its inodes used up by other
# processes' files): a ring cannot be created, and says so as a too-small /dev/shm does (the
# MemoryError vLLM's frontend falls back on), until a file goes.
NO_FILES_LEFT = textwrap.dedent(
    """
    import os
    from mmcache import ShmSenderCache, ShmTooSmallError
    taken = []
    try:
        while True:
            name = f"/dev/shm/other{len(taken)}"
            open(name, "x").close()
            taken.append(name)
    except OSError:
        pass
    assert taken and os.statvfs("/dev/shm").f_bavail > 0
    try:
        ShmSenderCache(1 / 1024).close()
    except ShmTooSmallError as exc:
        assert "inodes are used up" in str(exc), exc
        print("refused")
    os.remove(taken.pop())
    p0 = ShmSenderCache(1 / 1024)
    assert p0.get_and_update_item(({"x": b"abc"}, None), "h")[0] is not None
    p0.close()
    assert sorted(os.listdir("/dev/shm")) == sorted(os.path.basename(n) for n in taken)
    print("created")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_a_dev_shm_out_of_files_refuses_a_ring_as_a_too_small_one_does():
    done = run_in_private_tmpfs(NO_FILES_LEFT, options="size=32m,nr_inodes=16")
    assert done.stdout.split() == ["refused", "created"], done.stdout


# What was stored before /dev/shm filled up is found by a writer that joins after it, in a
# mapping of its own (nothing in it reserved past the slot tables): its lock-free lookups,
# `keys` and `stats` read a key index that the first lock's taker reserved whole, by the
# granule, so reserving it again needs no room, and nothing is taken for a miss. Its claims
# are recorded, its invalidate and clear are seen by the other writers.
STORED_BEFORE_SEEN_BY_A_LATE_WRITER = FILL_DEV_SHM + textwrap.dedent(
    """
    import os
    from mmcache._core import ShmObjectStore
    MiB = 1 << 20
    w = ShmObjectStore.create(24 * MiB, n_readers=1, max_writers=3)
    r = ShmObjectStore.attach(w.handle())
    data = {f"a{i}": os.urandom(MiB + i) for i in range(4)}
    for k, d in data.items():
        assert bytes(r.resolve(w.put(k, d), k)) == d
    assert w.claim("c")
    fill_dev_shm()
    j = ShmObjectStore.join(w.writer_handle())
    assert sorted(j.keys()) == sorted(data), j.keys()
    assert [j.is_cached(k) for k in (*data, "zz")] == [True] * 4 + [False]
    s = j.stats()
    assert (s["objects"], s["chunks"], s["claims"]) == (4, 4, 1), s
    assert j.claim("a0") is False and j.claim("c") is False and j.claim("new") is True
    assert w.claim("new") is False  # recorded, not granted unrecorded
    j.invalidate("a1")
    assert not w.is_cached("a1") and sorted(w.keys()) == ["a0", "a2", "a3"]
    assert bytes(r.resolve(j.get_cached("a2"), "a2")) == data["a2"]
    k = ShmObjectStore.join(w.writer_handle())
    k.clear()
    assert w.keys() == [] and j.keys() == [] and w.stats()["objects"] == 0
    assert w.stats()["bytes_in_use"] == 0, w.stats()
    for x in (k, j, r, w):
        x.close()
    assert os.listdir("/dev/shm") == ["filler"], os.listdir("/dev/shm")
    print("ok")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_what_was_stored_before_dev_shm_filled_is_found_by_a_writer_joining_after():
    done = run_in_private_tmpfs(STORED_BEFORE_SEEN_BY_A_LATE_WRITER, reserve_delay_s="60")
    assert done.stdout.split() == ["ok"], done.stdout


# The first lock's reservation of the key index fails part way (/dev/shm has less left than
# the index): part of the index is allocated, no lock was taken, nothing was filed. Every
# writer, the one whose reservation failed and one that joins, answers that nothing is stored
# or claimed (lookups, keys, stats, claims granted unrecorded, invalidate, unclaim, clear,
# wait_for) without an error; once room is freed the index is reserved and used as usual.
INDEX_RESERVED_PART_WAY = textwrap.dedent(
    """
    import os
    from mmcache._core import ShmObjectStore, ShmTooSmallError
    MiB, KiB = 1 << 20, 1 << 10
    w = ShmObjectStore.create(24 * MiB, n_readers=1, max_writers=2)
    r = ShmObjectStore.attach(w.handle())
    name = "/dev/shm/" + w.name
    before = os.stat(name).st_blocks * 512
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as f:  # leaves less than the key index (~700 KiB)
        f.write(b"x" * (st.f_bavail * st.f_frsize - 200 * KiB))
    d = os.urandom(MiB)
    try:
        w.put("k", d)
        raise AssertionError("a put with no room for the key index was not refused")
    except ShmTooSmallError:
        pass
    grew = os.stat(name).st_blocks * 512 - before
    assert grew > 100 * KiB, grew  # part of the index is allocated
    j = ShmObjectStore.join(w.writer_handle())
    for x in (w, j):
        assert x.is_cached("k") is False and x.keys() == [] and x.try_get_cached("k") is None
        s = x.stats()
        assert (s["objects"], s["chunks"], s["claims"], s["bytes_in_use"]) == (0, 0, 0, 0), s
        assert x.claim("k") is True
        x.invalidate("k")
        x.unclaim("k")
        x.clear()
        assert x.wait_for(["k"], 0.01) == [False]
    os.unlink("/dev/shm/filler")
    assert bytes(r.resolve(j.put("k", d), "k")) == d
    assert w.is_cached("k") and w.keys() == ["k"] and j.claim("x") and not w.claim("x")
    assert (w.stats()["claims"], w.stats()["objects"]) == (1, 1), w.stats()
    for x in (j, r, w):
        x.close()
    print("ok")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_a_key_index_reserved_part_way_answers_that_nothing_is_stored():
    done = run_in_private_tmpfs(INDEX_RESERVED_PART_WAY, reserve_delay_s="60")
    assert done.stdout.split() == ["ok"], done.stdout


# A refill of the allocation buffer whose bounded sweep first keeps a window (a pinned chunk
# K at the hand) and only then finds no tmpfs room for the next one (the never-reserved tail
# of the ring, after K): its ShmTooSmall comes after the sweep judged K. The object is then
# reserved on its own (in what /dev/shm has left), and the ring stays consistent: no block
# left judged or reserved, the gauges exact (a clear leaves 0 bytes in use).
REFILL_FAILS_AFTER_A_KEPT_WINDOW = textwrap.dedent(
    """
    import os
    from mmcache._core import ShmObjectStore, ShmTooSmallError
    MiB, KiB = 1 << 20, 1 << 10
    w = ShmObjectStore.create(24 * MiB, n_readers=1, max_object_size=12 * MiB)
    r = ShmObjectStore.attach(w.handle())
    big = 12 * MiB - 64 * KiB
    def put(key, data):
        assert bytes(r.resolve(w.put(key, data), key)) == data
    put("P", b"p" * big)  # [0, S)
    put("K", os.urandom(504 * KiB))  # [S, S + ~512 KiB), then a tail nobody reserved
    w.pin("K")
    put("Q", b"q" * big)  # does not fit in the tail: wraps, evicts P, leaves the hand at K
    assert not w.is_cached("P") and w.is_cached("K")
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as f:  # less than a buffer is left
        f.write(b"x" * (st.f_bavail * st.f_frsize - 128 * KiB))
    data = {f"s{i}": bytes([i]) * 4000 for i in range(20)}
    refused = []
    for key, d in data.items():
        try:
            put(key, d)
        except ShmTooSmallError:
            refused.append(key)
    assert refused == [], refused
    s = w.stats()
    assert s["objects"] == s["chunks"] == 22 and s["chunks_reserved"] == 0, s
    assert sorted(w.keys()) == sorted(["K", "Q", *data]), w.keys()
    for key, d in data.items():
        assert bytes(r.resolve(w.get_cached(key), key)) == d
    os.unlink("/dev/shm/filler")
    w.unpin("K")
    for i in range(60):  # laps of the ring over what the failed refill judged
        put(f"b{i}", os.urandom(MiB + i))
    s = w.stats()
    assert s["objects"] == s["chunks"] and s["chunks_reserved"] == 0, s
    w.clear()
    s = w.stats()
    assert (s["bytes_in_use"], s["objects"], s["chunks"]) == (0, 0, 0), s
    r.close()
    w.close()
    print("ok")
    """
)


@pytest.mark.skipif(not private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_a_refill_that_finds_no_tmpfs_room_after_keeping_a_window_leaves_the_ring_whole():
    done = run_in_private_tmpfs(
        REFILL_FAILS_AFTER_A_KEPT_WINDOW, options="size=40m", reserve_delay_s="60"
    )
    assert done.stdout.split() == ["ok"], done.stdout
