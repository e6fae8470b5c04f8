"""A writer SIGKILLed at every crash point of the core (``_core.CRASH_POINTS``): in the
middle of allocating while it holds the ring lock (and the index lock; between marking
another writer's allocation buffer taken and freeing it, too), between reserving
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


def put_and_read(store: ShmWriter, reader: ShmReader, key: str) -> None:
    """Put ``key`` and have the reader read it back, bit for bit (so nothing stays owed)."""
    assert reader.resolve(store.put(key, parts(key), meta=meta(key)), key) == payload(key)


def a_full_store() -> tuple[ShmWriter, ShmReader, list[str]]:
    """A store for two writers and one reader, its ring filled with objects the reader has
    read (the victim's puts evict some), and their keys."""
    store = ShmObjectStore.create(RING, n_readers=1, max_writers=2)
    reader: ShmReader = ShmObjectStore.attach(store.handle())
    ours = [f"a{i}" for i in range(RING // (2 * PART + 256))]
    for key in ours:
        put_and_read(store, reader, key)
    return store, reader, ours


def kill_victim_at(store: ShmWriter, point: str, after: int, action: str) -> None:
    """Have a writer joined in slot 1 do ``action`` armed with ``point``; it must die there
    (SIGKILL, at its ``after``-th pass), never get past it."""
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


def check_slot_joined_again(store: ShmWriter, reader: ShmReader) -> None:
    """The dead victim's writer slot is joined again, and its new occupant puts."""
    with ShmObjectStore.join(store.writer_handle()) as again:
        assert again.writer_slot == 1
        assert again.stats()["writers_reclaimed"] == 1
        put_and_read(again, reader, "after")
        assert store.read_meta("after") == meta("after")


#: The point with a test of its own (below): the victim reaches it only over a buffer that
#: the store's creator carved from first, and dies after a lap of puts, not at its second.
BUFFER_MARKED = "alloc.buffer_marked"


@pytest.mark.parametrize("point", [p for p in _core.CRASH_POINTS if p != BUFFER_MARKED])
def test_a_writer_killed_at_a_crash_point_wedges_nobody(point: str) -> None:
    action, after = SCENARIOS[point]  # every crash point has a scenario here
    store, reader, ours = a_full_store()
    kill_victim_at(store, point, after, action)

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
        put_and_read(store, reader, f"b{i}")
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
    check_slot_joined_again(store, reader)
    reader.close()
    store.close()


def test_a_sweep_killed_between_its_mark_and_its_cas_leaves_the_buffer_to_the_repair() -> None:
    # The store's creator (the owner) carves small objects from its allocation buffer, the
    # only one in the ring; the victim (large objects: no buffer of its own) puts until its
    # sweep reaches that buffer, marks it taken in the owner's carve word, and dies holding
    # the ring lock before the CAS that frees it: the buffer is left whole and marked.
    store, reader, ours = a_full_store()
    smalls = [f"s{i}" for i in range(4)]
    for key in smalls:
        put_and_read(store, reader, key)
    kill_victim_at(store, BUFFER_MARKED, 1, "put")

    # What anyone completed is whole: the owner's objects (a hit on one the dead sweep left
    # EVICTING takes the ring lock over, and its repair makes it live again), and the
    # victim's puts before the one it died in (it evicts forward from the hand, never its
    # own earlier puts).
    keys = store.keys()
    victims = sorted((k for k in keys if k.startswith("v")), key=lambda k: int(k[1:]))
    assert victims == [f"v{i}" for i in range(len(victims))], victims
    assert victims, "the victim put before its sweep reached the owner's buffer"
    for key in keys:
        check_readable(store, reader, key)
    # No sweep has run since the kill (none passed the marked buffer, to take it back): the
    # ring lock's first taker froze it by the mark, in its repair, and the owner's clear
    # gives back everything else. Left in place, the buffer would stay in use, reserved by a
    # writer that never carves from it again (its carve word names it taken), and the
    # owner's close would wait for it.
    store.clear()
    stats = store.stats()
    assert (stats["bytes_in_use"], stats["chunks"]) == (0, 0), stats
    # The owner carries on, small objects (from a new buffer) and large ones, filling the
    # ring three times over, each read back bit for bit.
    for i in range(3 * len(ours)):
        put_and_read(store, reader, f"s{len(smalls) + i}")
        put_and_read(store, reader, f"b{i}")
    stats = store.stats()
    assert stats["chunks_reserved"] == 0, "no reservation left behind"
    assert 0 < stats["bytes_in_use"] <= stats["capacity"]
    assert stats["objects"] == len(store.keys())
    for key in store.keys():
        check_readable(store, reader, key)
    check_slot_joined_again(store, reader)
    reader.close()
    store.close()  # waits for the owner's reservations: none is left
