"""A writer SIGKILLed at every crash point of the core (``_core.CRASH_POINTS``): in the
middle of allocating while it holds the ring lock (and the index lock), between reserving
and filling a block, in the middle of a copy, while publishing, right after a hit took its
protection, right after filing a claim, part-way through a clear. For each, with real
processes:

- the other writer and the reader carry on: puts, hits and reads of every other object, bit
  for bit (a lock the victim held is taken over and what it left half done repaired);
- nothing the victim left half-written is ever readable; what it completed stays cached;
- its claims are void, its reservation and protections too: its space is reclaimed;
- its writer slot can be joined again.

``MMCACHE_CRASH_POINT`` names the point (read by the core when the victim makes its first
writer); ``MMCACHE_CRASH_AFTER`` lets earlier passes through, so a put-path victim completes
one object before dying in the next.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from typing import Any

import numpy as np
import pytest

from mmcache import WriterHandle, _core
from mmcache._core import ShmObjectStore, ShmReader, ShmWriter

KiB = 1024
RING = 256 * KiB
PART = 3000  # bytes of each of an object's two parts: about 6 KiB a chunk, ~40 in the ring
#: Parts of a small object (a key starting with "s"): carved from the writer's allocation
#: buffer (a ring this size gives each writer an 8 KiB one).
SMALL_PART = 100
TIMEOUT = 120

ctx = mp.get_context("spawn")

#: What the victim does to reach each crash point, and how often the point is passed first.
SCENARIOS: dict[str, tuple[str, int]] = {
    "alloc.locked": ("put", 2),
    "alloc.marked": ("put", 2),
    # (the victim's first put takes free room: only its second evicts keyed chunks)
    "alloc.unindexed": ("put", 1),
    "alloc.evicted": ("put", 2),
    "alloc.coalesced": ("put", 2),
    "alloc.reserved": ("put", 2),
    "lab.announced": ("put small", 2),
    "lab.split": ("put small", 2),
    "put.reserved": ("put", 2),
    "put.mid_copy": ("put", 2),
    "put.filled": ("put", 2),
    "publish.filing": ("put", 2),
    "publish.id": ("put", 2),
    "publish.live": ("put", 2),
    "put.published": ("put", 2),
    "issue.protected": ("issue", 1),
    "claim.recorded": ("claim", 1),
    "clear.partway": ("clear", 1),
}
#: The keys a putting victim uses: small objects (from its allocation buffer) or not.
PREFIXES = {"put": "v", "put small": "s"}


pytestmark = pytest.mark.usefixtures("hang_deadline")


def parts(key: str) -> list[bytes]:
    """An object's two parts: random bytes derived from its key (small ones for a key
    starting with "s")."""
    size = SMALL_PART if key.startswith("s") else PART
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    data = np.random.default_rng(seed).integers(0, 256, 2 * size, dtype=np.uint8).tobytes()
    return [data[:size], data[size:]]


def payload(key: str) -> bytes:
    """What a reader gets for ``key``: part 1 starts at the next 64-byte boundary."""
    first, second = parts(key)
    return first + bytes(-len(first) % 64) + second


def meta(key: str) -> bytes:
    return f"prompt updates of {key}".encode()


def _victim(handle: WriterHandle, point: str, after: int, action: str, conn: Any) -> None:
    os.environ["MMCACHE_CRASH_POINT"] = point
    os.environ["MMCACHE_CRASH_AFTER"] = str(after)
    writer = ShmObjectStore.join(handle)
    conn.send(writer.writer_slot)
    if action.startswith("put"):
        prefix = PREFIXES[action]
        for i in range(1000):
            writer.put(f"{prefix}{i}", parts(f"{prefix}{i}"), meta=meta(f"{prefix}{i}"))
    elif action == "issue":
        for _ in range(1000):
            writer.issue("a1")
    elif action == "claim":
        writer.claim("claimed")
    elif action == "clear":
        writer.clear()
    conn.send("survived")


def check_readable(store: ShmWriter, reader: ShmReader, key: str) -> None:
    """``key`` reads back whole, bit for bit, through a fresh hit, with its metadata."""
    assert reader.resolve(store.issue(key), key) == payload(key), key
    assert store.read_meta(key) == meta(key), key


@pytest.mark.parametrize("point", _core.CRASH_POINTS)
def test_a_writer_killed_at_a_crash_point_wedges_nobody(point: str) -> None:
    action, after = SCENARIOS[point]  # every crash point has a scenario here
    store = ShmObjectStore.create(RING, n_readers=1, max_writers=2)
    reader: ShmReader = ShmObjectStore.attach(store.handle())
    # Fill the ring with objects the reader has read: the victim's puts evict some.
    ours = [f"a{i}" for i in range(RING // (2 * PART + 256))]
    for key in ours:
        assert reader.resolve(store.put(key, parts(key), meta=meta(key)), key) == payload(key)
    mine, theirs = ctx.Pipe()
    victim = ctx.Process(target=_victim, args=(store.writer_handle(), point, after, action, theirs))
    victim.start()
    try:
        assert mine.poll(TIMEOUT) and mine.recv() == 1, "the victim joined in slot 1"
        victim.join(TIMEOUT)
        assert victim.exitcode == -signal.SIGKILL, f"the victim did not die at {point}"
        assert not mine.poll(0), "the victim got past its crash point"
    finally:
        if victim.is_alive():
            victim.kill()
            victim.join(TIMEOUT)

    # The survivors carry on; what the victim completed is whole, nothing else readable.
    if action.startswith("put"):
        first, second = (f"{PREFIXES[action]}{i}" for i in range(2))
        assert store.is_cached(first), "the victim's first put completed"
        check_readable(store, reader, first)
        cached = store.is_cached(second)
        assert cached == (point == "put.published"), f"{second} cached after {point}: {cached}"
        if cached:
            check_readable(store, reader, second)
    for key in ours:
        if store.is_cached(key):
            check_readable(store, reader, key)
    if action == "claim":
        assert store.wait_for(["claimed"], 600) == [False], "the dead writer's claim is void"
        assert store.claim("claimed")
        store.unclaim("claimed")
    # The victim's space comes back: fill the ring three times over.
    for i in range(3 * len(ours)):
        key = f"b{i}"
        assert reader.resolve(store.put(key, parts(key), meta=meta(key)), key) == payload(key)
    stats = store.stats()
    assert stats["chunks_reserved"] == 0, "a dead writer's reservation was reclaimed"
    assert 0 < stats["bytes_in_use"] <= stats["capacity"]
    assert stats["objects"] == len(store.keys())
    assert stats["claims"] == 0
    if action == "issue":
        # The references of the hit it never returned stay owed until a clear.
        assert stats["outstanding_refs"] == 1
        store.clear()
        assert store.stats()["outstanding_refs"] == 0
    for key in store.keys():
        check_readable(store, reader, key)
    # Its writer slot can be joined again.
    with ShmObjectStore.join(store.writer_handle()) as again:
        assert again.writer_slot == 1
        assert again.stats()["writers_reclaimed"] == 1
        key = "after"
        assert reader.resolve(again.put(key, parts(key), meta=meta(key)), key) == payload(key)
        assert store.read_meta(key) == meta(key)
    reader.close()
    store.close()
