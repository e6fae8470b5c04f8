"""Fault tolerance of the shared-memory caches with real processes (spawned, then killed).

- a worker SIGKILLed while it holds zero-copy views and unread handles: the writer reclaims
  its slot and what it held, keeps caching, and never frees what a live worker still needs;
- the writer SIGKILLed: a worker gets ``WriterGoneError`` (a clear error, not a crash) and
  ``prune()`` removes the orphaned segment, leaving live ones alone;
- a handle delivered twice to one worker: the same data or ``CacheMissError``, never other
  bytes, and the replay does not release the object for another worker;
- a stream of forged handles: every one rejected with ``InvalidHandleError`` before any
  shared memory is read, and the worker lives on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import (
    CacheMissError,
    Feature,
    InvalidHandleError,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    StaleHandleError,
    WriterGoneError,
    _core,
    prune,
)
from mmcache._core import ShmObjectStore

KiB = 1024
MiB = 1 << 20
GiB = 1 << 30
OBJ = 60 * KiB  # payload bytes of one test item (its tensor), plus a small array
TIMEOUT = 120  # seconds to wait for a child's answer (a hang fails the test, not CI)

ctx = mp.get_context("spawn")


def make_item(key: str, n_bytes: int = OBJ) -> dict[str, Any]:
    """The truth for ``key``: random bits (so any foreign byte shows) in a torch tensor and
    a numpy array."""
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little") % (2**63)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=g)
    return {
        "pixel_values": raw.view(torch.float32).reshape(-1, 16),
        "grid": np.array([1, len(key), seed % 97], dtype=np.int64),
        "key": key,
    }


def same(resolved: Any, key: str, n_bytes: int = OBJ) -> bool:
    want = make_item(key, n_bytes)
    return (
        isinstance(resolved, dict)
        and resolved.keys() == want.keys()
        and resolved["key"] == key
        and isinstance(resolved["pixel_values"], torch.Tensor)
        and resolved["pixel_values"].dtype == torch.float32
        and resolved["pixel_values"].shape == want["pixel_values"].shape
        # bit for bit (NaN patterns included), not ==
        and resolved["pixel_values"].contiguous().view(torch.uint8).numpy().tobytes()
        == want["pixel_values"].view(torch.uint8).numpy().tobytes()
        and np.array_equal(resolved["grid"], want["grid"])
    )


def p0_put(p0: ShmSenderCache, key: str, n_bytes: int = OBJ) -> Any:
    """P0's update for ``key`` (data attached): a handle, or the item served uncached."""
    data, updates = p0.get_and_update_item((make_item(key, n_bytes), f"pu-{key}"), key)
    assert updates == f"pu-{key}"
    return data


def wire(handle: ShmHandle) -> tuple[int, int, bytes]:
    """How an engine ships a handle: its three fields."""
    return handle.address, handle.monotonic_id, bytes(handle.signature)


def unwire(fields: tuple[int, int, bytes]) -> ShmHandle:
    return ShmHandle(address=fields[0], monotonic_id=fields[1], signature=fields[2])


def sigkill(proc: Any) -> None:
    """Kill ``proc`` outright, as the OOM killer would, and wait for it."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL


def reap(proc: Any) -> None:
    """Make sure a test's child process is gone, whatever the test did."""
    if proc.is_alive():
        proc.kill()
        proc.join()


def recv(conn: Any) -> Any:
    assert conn.poll(TIMEOUT), "the child process did not answer"
    return conn.recv()


def resolve(cache: ShmReceiverCache, batch: list[tuple[str, Any]]) -> list[Feature]:
    features = [Feature(data=unwire(w), mm_hash=k) for k, w in batch]
    cache.get_and_update_features(features)
    return features


# -- a worker killed while holding views and unread handles ------------------------------


def _worker_killed_while_holding(reader_handle: Any, conn: Any) -> None:
    cache = ShmReceiverCache(reader_handle, copy=False)
    conn.send("attached")
    held: list[Feature] = []
    while True:
        batch = conn.recv()
        features = resolve(cache, batch)
        held.extend(features)  # zero-copy views, kept alive until the process dies
        conn.send([same(f.data, k) for f, (k, _) in zip(features, batch, strict=True)])


def test_a_sigkilled_worker_holding_views_and_unread_handles_is_reclaimed() -> None:
    ring = 12 * (OBJ + 4 * KiB)  # room for about a dozen items
    with ShmSenderCache(ring / GiB, max_object_size_mb=1, n_readers=2) as p0:
        live = ShmReceiverCache(p0.handle())  # the other worker, in this process
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_killed_while_holding, args=(p0.handle(), child))
        proc.start()
        try:
            assert recv(parent) == "attached"
            # The doomed worker reads (and keeps views of) v0, v1; it never reads u0..u2.
            viewed = {k: p0_put(p0, k) for k in ("v0", "v1")}
            parent.send([(k, wire(h)) for k, h in viewed.items()])
            assert recv(parent) == [True, True], "zero-copy views resolved to the truth"
            unread = {k: p0_put(p0, k) for k in ("u0", "u1", "u2")}
            assert all(isinstance(h, ShmHandle) for h in unread.values())
            for k, h in {**viewed, **unread}.items():
                assert same(resolve(live, [(k, wire(h))])[0].data, k)
            # A handle the live worker has not read yet: it must survive everything below.
            pending = p0_put(p0, "pending")
            assert isinstance(pending, ShmHandle)

            # The ring fills with objects the doomed worker never acknowledges: once it is
            # full the writer serves items uncached rather than overwrite them.
            served = []
            for n in range(40):
                data = p0_put(p0, f"fill{n}")
                served.append(data)
                if isinstance(data, ShmHandle):
                    assert same(resolve(live, [(f"fill{n}", wire(data))])[0].data, f"fill{n}")
                else:
                    assert same(data, f"fill{n}")  # served uncached: the item itself
                    break
            assert not isinstance(served[-1], ShmHandle), "the ring never filled up"
            assert p0.stats()["uncached_full"] >= 1
            assert p0.is_cached(["v0", "u0"]) == [True, True]  # held for the doomed worker

            sigkill(proc)
        finally:
            reap(proc)

        # The writer reclaims the dead worker's slot when it needs room, and keeps caching.
        for n in range(20):
            h = p0_put(p0, f"after{n}")
            assert isinstance(h, ShmHandle), "still serving uncached after the worker died"
            assert same(resolve(live, [(f"after{n}", wire(h))])[0].data, f"after{n}")
        stats = p0.stats()
        assert stats["store_readers_reclaimed"] == 1
        assert p0.is_cached(["v0", "v1", "u0"]) == [False, False, False], "not reclaimed"
        # ... without freeing what the live worker still needed.
        assert same(resolve(live, [("pending", wire(pending))])[0].data, "pending")
        # The slot is free again: a new worker attaches and reads.
        with ShmReceiverCache(p0.handle()) as newcomer:
            h = p0_put(p0, "new")
            assert same(resolve(newcomer, [("new", wire(h))])[0].data, "new")
            assert same(resolve(live, [("new", wire(h))])[0].data, "new")
        assert p0.stats()["store_outstanding_refs"] == 0
        live.close()


# -- a worker that writes into its zero-copy tensors ---------------------------------------


def _worker_writing_into_its_views(reader_handle: Any, conn: Any) -> None:
    cache = ShmReceiverCache(reader_handle, copy=False)
    conn.send("attached")  # before the put: it holds a reference, so the read is zero-copy
    item = resolve(cache, conn.recv())[0].data
    conn.send("resolved")
    # An in-place op, as model code often does. The view's pages are mapped read-only, so
    # this faults (the process dies with SIGSEGV) instead of changing the shared object.
    item["pixel_values"].mul_(0)
    conn.send("wrote")


def test_a_worker_writing_into_its_zero_copy_tensor_cannot_change_what_anyone_reads() -> None:
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1, n_readers=2) as p0:
        other = ShmReceiverCache(p0.handle())
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_writing_into_its_views, args=(p0.handle(), child))
        proc.start()
        try:
            assert recv(parent) == "attached"
            h = p0_put(p0, "shared")
            parent.send([("shared", wire(h))])
            assert recv(parent) == "resolved"
            proc.join(TIMEOUT)
            assert proc.exitcode == -signal.SIGSEGV, "the write into read-only memory faults"
        finally:
            reap(proc)
        again, _ = p0.get_and_update_item(None, "shared")  # a later hit
        assert same(resolve(other, [("shared", wire(h))])[0].data, "shared")
        assert same(resolve(other, [("shared", wire(again))])[0].data, "shared")
        other.close()


# -- the writer killed ------------------------------------------------------------------


def _writer_killed(conn: Any, keys: list[str]) -> None:
    p0 = ShmSenderCache(1 * MiB / GiB, n_readers=1)
    outputs = p0.get_and_update([(make_item(k), f"pu-{k}") for k in keys], keys)
    conn.send(
        (p0.handle(), p0.name, [(k, wire(h)) for k, (h, _) in zip(keys, outputs, strict=True)])
    )
    conn.recv()  # wait to be killed (never unlinks its segment)


def test_a_sigkilled_writer_gives_a_clear_error_and_its_segment_is_pruned() -> None:
    parent, child = ctx.Pipe()
    keys = ["w0", "w1", "w2"]
    proc = ctx.Process(target=_writer_killed, args=(child, keys))
    proc.start()
    with ShmSenderCache(1 * MiB / GiB) as bystander:  # a live segment prune must not touch
        try:
            reader_handle, name, batch = recv(parent)
            worker = ShmReceiverCache(reader_handle)
            assert same(resolve(worker, batch[:1])[0].data, "w0")
            sigkill(proc)
        finally:
            reap(proc)
        # A clear error for every read, not a crash and not data.
        for _ in range(3):
            with pytest.raises(WriterGoneError):
                resolve(worker, batch[1:])
        assert not isinstance(WriterGoneError("x"), CacheMissError)  # retrying cannot help
        # Any store's creation on this host removes an orphan: another test run may take
        # this one first, so each check below allows for it being gone already.
        with contextlib.suppress(FileNotFoundError):
            assert _core.inspect_segment(name)["creator_alive"] is False
        listed = prune(dry_run=True)
        assert name in listed or name not in _core.list_segments()
        assert bystander.name not in listed
        assert name in prune() or name not in _core.list_segments()
        assert not os.path.exists(f"/dev/shm/{name}")
        assert bystander.name in _core.list_segments(), "prune removed a live segment"
        with pytest.raises(FileNotFoundError):
            ShmReceiverCache(reader_handle)
        assert name not in prune()
        worker.close()  # the orphan's memory goes once its last mapping does
        # The process that watched the writer die carries on using shared memory.
        h = p0_put(bystander, "still")
        with ShmReceiverCache(bystander.handle()) as w:
            assert same(resolve(w, [("still", wire(h))])[0].data, "still")


# -- a handle delivered twice ------------------------------------------------------------


def _duplicating_worker(reader_handle: Any, conn: Any) -> None:
    """Resolves every batch it is sent; reports per feature 'ok', 'miss' or 'WRONG'."""
    cache = ShmReceiverCache(reader_handle)
    conn.send("attached")
    while (batch := conn.recv()) is not None:
        features = [Feature(data=unwire(w), mm_hash=k) for k, w in batch]
        missing: list[str] = []
        try:
            cache.get_and_update_features(features)
        except CacheMissError as miss:
            missing = miss.mm_hashes
        report = []
        for f, (k, _) in zip(features, batch, strict=True):
            if isinstance(f.data, ShmHandle):
                report.append("miss" if k in missing else "UNREPORTED")
            else:
                report.append("ok" if same(f.data, k) else "WRONG")
        conn.send(report)
    cache.close()


def test_a_handle_delivered_twice_gives_the_same_data_or_a_miss_and_spares_other_readers() -> None:
    ring = 10 * (OBJ + 4 * KiB)
    with ShmSenderCache(ring / GiB, max_object_size_mb=1, n_readers=2) as p0:
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=_duplicating_worker, args=(p0.handle(), child)) for _, child in pipes
        ]
        for p in procs:
            p.start()
        try:
            (a, _), (b, _) = pipes
            assert recv(a) == "attached" and recv(b) == "attached"
            # Request 1 holds k0 twice; request 2 holds k1 again (a hit: the same handle).
            r1 = [("k0", wire(p0_put(p0, "k0"))), ("k1", wire(p0_put(p0, "k1")))]
            r1.append(r1[0])
            h1, _ = p0.get_and_update_item(None, "k1")
            r2 = [("k1", wire(h1)), ("k2", wire(p0_put(p0, "k2")))]
            # Worker A gets the requests again and again before worker B reads anything.
            for n, batch in enumerate((r1, r2, r1, r2, r1)):
                a.send(batch)
                report = recv(a)
                if n < 2:
                    assert report == ["ok"] * len(batch), report  # first deliveries
                else:
                    assert set(report) <= {"ok", "miss"}, report  # duplicates
            # Pressure: abandoned requests make room by evicting everything reclaimable.
            for n in range(30):
                p0.release_handles([p0_put(p0, f"churn{n}")])
            # A's replays must not have released what B has not read yet.
            for batch in (r1, r2):
                b.send(batch)
                assert recv(b) == ["ok"] * len(batch)
            # Now everyone has read them: replays read the same bytes or miss, even after
            # the ring moved on and reused their space.
            for n in range(30):
                p0.release_handles([p0_put(p0, f"more{n}")])
            for conn in (a, b):
                for batch in (r1, r2):
                    conn.send(batch)
                    report = recv(conn)
                    assert set(report) <= {"ok", "miss"}, report
            assert not p0.is_cached_item("k0"), "the churn should have evicted k0"
            assert p0.stats()["store_outstanding_refs"] == 0
            for conn, _ in pipes:
                conn.send(None)
            for p in procs:
                p.join(TIMEOUT)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()


# -- forged handles ----------------------------------------------------------------------

N_FORGED = 4000


def _forge(
    rng: random.Random, genuine: list[tuple[str, ShmHandle]], foreign: ShmHandle, capacity: int
) -> tuple[str, ShmHandle | None, str]:
    """One forged (key, handle, kind); handle is None when ShmHandle refuses the fields."""
    i, j = rng.sample(range(len(genuine)), 2)
    (key, h), (other_key, other) = genuine[i], genuine[j]
    addr, mid, sig = h.address, h.monotonic_id, bytes(h.signature)
    kind = rng.choice(
        ["sig", "sig_len", "addr", "addr_far", "id", "key", "swap", "foreign", "random", "flip"]
    )
    if kind == "sig":
        sig = rng.randbytes(len(sig))
    elif kind == "sig_len":
        sig = rng.choice([b"", sig[: rng.randrange(len(sig))], sig + rng.randbytes(8)])
    elif kind == "addr":
        addr = rng.choice([addr + rng.choice([1, 8, 64, 128, -64]), rng.randrange(capacity)])
        addr = max(addr, 0)
    elif kind == "addr_far":
        addr = rng.choice([capacity, capacity + 64, 2**40, 2**63, 2**64 - 64, 2**64 - 1])
    elif kind == "id":
        mid = rng.choice([0, mid + 1, max(mid - 1, 0), 2**63, 2**64 - 1, rng.randrange(2**64)])
    elif kind == "key":
        key = rng.choice([other_key, "", key + "x", "k" * 1000, "ключ", key.upper()])
    elif kind == "swap":
        addr = other.address if other.address != addr else addr + 64
    elif kind == "foreign":
        addr, mid, sig = foreign.address, foreign.monotonic_id, bytes(foreign.signature)
    elif kind == "random":
        addr, mid = rng.randrange(2**64), rng.randrange(2**64)
        sig = rng.randbytes(rng.choice([0, 8, 16, 32, 64]))
    elif kind == "flip":
        i = rng.randrange(len(sig))
        sig = sig[:i] + bytes([sig[i] ^ (1 << rng.randrange(8))]) + sig[i + 1 :]
    if (addr, mid, sig) == (h.address, h.monotonic_id, bytes(h.signature)) and kind != "key":
        sig = bytes(b ^ 0xFF for b in sig) or b"\x01"  # never the genuine handle by chance
    try:
        return key, ShmHandle(address=addr, monotonic_id=mid, signature=sig), kind
    except ValueError:
        return key, None, kind  # refused as out of range when built: also a rejection


def _forged_stream_worker(reader_handle: Any, conn: Any) -> None:
    raw = ShmObjectStore.attach(reader_handle)
    cache = ShmReceiverCache(reader_handle)  # a second reader slot, through the cache API
    slot = raw.reader_slot
    conn.send("attached")
    genuine_wire, foreign_wire = conn.recv()
    genuine = [(k, unwire(w)) for k, w in genuine_wire]
    foreign = unwire(foreign_wire)
    before = _core.inspect_segment(reader_handle.name)["readers"]
    rng = random.Random(1234)
    counts: dict[str, int] = {}
    for n in range(N_FORGED):
        key, handle, kind = _forge(rng, genuine, foreign, reader_handle.capacity)
        if handle is None:
            counts["refused_at_construction"] = counts.get("refused_at_construction", 0) + 1
            continue
        try:
            if n % 4 == 0 and key:
                cache.get_and_update_features([Feature(data=handle, mm_hash=key)])
            else:
                raw.get(handle, key, copy=bool(n % 2))
        except InvalidHandleError:
            counts[kind] = counts.get(kind, 0) + 1
            continue
        except (StaleHandleError, CacheMissError) as exc:
            conn.send(("read before rejecting", kind, key, repr(handle), repr(exc)))
            return
        conn.send(("accepted", kind, key, repr(handle)))
        return
    after = _core.inspect_segment(reader_handle.name)["readers"]
    # The genuine handles still resolve, each exactly once per reader, to the truth.
    ok = all(same(bytes_to_item(raw, h, k), k, 4 * KiB) for k, h in genuine)
    ok_cache = all(same(resolve(cache, [(k, wire(h))])[0].data, k, 4 * KiB) for k, h in genuine)
    conn.send(("done", counts, before, after, slot, ok, ok_cache))
    cache.close()
    raw.close()


def bytes_to_item(raw: ShmObjectStore, handle: ShmHandle, key: str) -> Any:
    from mmcache import serde

    return serde.decode(raw.get(handle, key))


def test_a_forged_handle_stream_is_rejected_before_shared_memory_is_read() -> None:
    with ShmSenderCache(1 * MiB / GiB, max_object_size_mb=1, n_readers=2) as p0:
        with ShmSenderCache(1 * MiB / GiB) as other:  # signs with another key
            foreign = p0_put(other, "g0", 4 * KiB)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_forged_stream_worker, args=(p0.handle(), child))
            proc.start()
            try:
                assert recv(parent) == "attached"
                genuine = [(f"g{n}", p0_put(p0, f"g{n}", 4 * KiB)) for n in range(8)]
                assert all(isinstance(h, ShmHandle) for _, h in genuine)
                parent.send(([(k, wire(h)) for k, h in genuine], wire(foreign)))
                result = recv(parent)
                proc.join(TIMEOUT)
            finally:
                reap(proc)
        assert result[0] == "done", result
        _, counts, before, after, slot, ok, ok_cache = result
        assert proc.exitcode == 0, "the worker died"
        rejected = sum(v for k, v in counts.items() if k != "refused_at_construction")
        assert rejected >= 3000, counts
        assert {
            "sig",
            "sig_len",
            "addr",
            "addr_far",
            "id",
            "key",
            "swap",
            "foreign",
            "random",
            "flip",
        } <= counts.keys(), counts
        # Nothing was acknowledged or leased by the forgeries: the reader's counters did not
        # move until the genuine handles were read.
        assert [(r["refs"], r["acks"]) for r in before] == [(r["refs"], r["acks"]) for r in after]
        assert before[slot]["outstanding"] == len(genuine)
        assert ok and ok_cache, "genuine handles no longer resolve to the truth"
        stats = p0.stats()
        assert stats["store_outstanding_refs"] == 0 and stats["store_views"] == 0
