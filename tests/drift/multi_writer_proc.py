"""One writer process of the ``multi_writer`` model (:mod:`tests.drift.multi_writer_model`),
run as ``python -m tests.drift.multi_writer_proc`` by the model's coordinator.

It reads its configuration (a pickled :class:`WriterConfig`) from stdin, joins the store with
the configuration's ``WriterHandle`` and runs ``threads`` threads of random writer operations
on a small shared key space: the engine's path (``is_cached``, then a hit's ``issue`` or a
``put``, with or without a ``claim`` and a bounded ``wait_for``), a claim held across a pause
(where an external SIGKILL finds a claim holder), ``read_stored`` and ``read_meta`` checked
against the truth, pins, a released ("rejected request") handle, ``invalidate`` and a rare
``clear``.  Every handle it issues goes to stdout as a frame, for the coordinator to hand to
every reader.  A configuration armed with a crash point has ``MMCACHE_CRASH_POINT`` set in
this process's environment by the coordinator; its operation mix is biased towards that point.

The process imports only the standard library and the core (not torch, not
:mod:`tests.drift`'s engine models): the coordinator starts many of these per run.  It exits
0 after its operations and a clean ``close``, 3 after sending an ``("error", text)`` frame
when the oracle failed here (a writer read wrong bytes or wrong metadata) or the core raised
what it must not.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import signal
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, BinaryIO

from mmcache._core import (
    ObjectTooLargeError,
    RingFullError,
    ShmObjectStore,
    ShmWriter,
    WriterHandle,
    part_offsets,
)

__all__ = [
    "WriterConfig",
    "expected_payload",
    "item",
    "item_matches",
    "meta",
    "parts",
    "prompt_updates",
    "read_frames",
    "size_of",
]

#: Item sizes, as fractions of the ring's capacity, and their weights: many small objects
#: and a few large ones keep the small ring evicting; the last class exceeds
#: ``max_object_size`` (a put refused with ``ObjectTooLargeError``).
SIZE_CLASSES = ((0.004, 6), (0.02, 6), (0.06, 3), (0.15, 2), (0.6, 1))


@dataclass(frozen=True)
class WriterConfig:
    """What one writer process does (deterministic in ``seed`` but for the scheduling)."""

    handle: WriterHandle
    universe: int  # seed of the truth (every key's bytes and metadata)
    n_keys: int
    seed: int
    threads: int
    ops_per_thread: int
    crash_point: str | None  # armed point (the environment arms it; this biases the mix)
    wait_s: float  # bound of every wait_for
    hold_s: float  # how long a "held claim" is held before its put
    linger: bool = False  # after its operations, wait for stdin's EOF before closing
    layer: str = "store"  # "store": the core's ShmWriter; "cache": ShmSenderCache.join


# -- the truth (shared with the coordinator) --------------------------------------------------


@lru_cache(maxsize=4096)
def size_of(universe: int, key: str, capacity: int) -> int:
    rng = random.Random(f"size:{universe}:{key}")
    fractions, weights = zip(*SIZE_CLASSES, strict=True)
    fraction = rng.choices(fractions, weights)[0]
    return max(2, int(capacity * fraction * rng.uniform(0.5, 1.0)))


@lru_cache(maxsize=4096)
def parts(universe: int, key: str, capacity: int) -> tuple[bytes, bytes]:
    """Key ``key``'s object: two parts of random bytes derived from the key (two parts, so
    a put can die between them: ``put.mid_copy``)."""
    data = random.Random(f"bytes:{universe}:{key}").randbytes(size_of(universe, key, capacity))
    cut = len(data) // 3
    return data[:cut], data[cut:]


def expected_payload(universe: int, key: str, capacity: int) -> bytes:
    """What a reader must resolve a handle of ``key`` to: the parts at their aligned offsets."""
    first, second = parts(universe, key, capacity)
    offsets, total = part_offsets([len(first), len(second)])
    return first + bytes(offsets[1] - len(first)) + second + bytes(total - offsets[1] - len(second))


def meta(universe: int, key: str) -> bytes:
    """The metadata (prompt updates) stored with ``key``, whichever writer put it."""
    return f"prompt updates of {key} in {universe}".encode() * (1 + len(key) % 3)


def item(universe: int, key: str, capacity: int) -> dict[str, Any]:
    """Key ``key`` as an item (``cache`` layer): its two parts as arrays."""
    import numpy as np  # only the cache layer pays for it

    first, second = parts(universe, key, capacity)
    return {"a": np.frombuffer(first, np.uint8), "b": np.frombuffer(second, np.uint8)}


def item_matches(resolved: Any, universe: int, key: str, capacity: int) -> bool:
    """Whether a resolved item is key ``key``'s, bit for bit."""
    first, second = parts(universe, key, capacity)
    return (
        isinstance(resolved, dict)
        and set(resolved) == {"a", "b"}
        and all(str(resolved[k].dtype) == "uint8" for k in ("a", "b"))
        and bytes(memoryview(resolved["a"])) == first
        and bytes(memoryview(resolved["b"])) == second
    )


def prompt_updates(universe: int, key: str) -> dict[str, Any]:
    """The prompt updates the engine gives with ``key`` (``cache`` layer; plain data)."""
    return {"key": key, "universe": universe, "spans": [len(key), universe % 97]}


def key_name(i: int) -> str:
    return f"k{i:03d}"


# -- frames ------------------------------------------------------------------------------------


def write_frame(out: BinaryIO, lock: threading.Lock, message: tuple[Any, ...]) -> None:
    body = pickle.dumps(message)
    with lock:
        out.write(struct.pack("<I", len(body)) + body)
        out.flush()


def read_frames(stream: BinaryIO) -> Any:
    """The frames of a writer's stdout, in order; stops at EOF or at a frame cut short (a
    writer killed while writing one)."""
    while True:
        head = stream.read(4)
        if len(head) < 4:
            return
        (n,) = struct.unpack("<I", head)
        body = stream.read(n)
        if len(body) < n:
            return
        yield pickle.loads(body)


# -- the writer --------------------------------------------------------------------------------


class _Failure(Exception):
    """The oracle failed inside this writer."""


class _Writer:
    def __init__(self, config: WriterConfig, store: ShmWriter, out: BinaryIO) -> None:
        self.config = config
        self.store = store
        self.out = out
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.capacity = store.capacity
        point = config.crash_point or ""
        self.claim_rate = 0.9 if point == "claim.recorded" else 0.5
        self.clear_rate = 0.05 if point == "clear.partway" else 0.0015

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def send(self, key: str, handle: Any) -> None:
        write_frame(self.out, self.lock, ("handle", key, handle, time.monotonic()))

    def check_meta(self, key: str, monotonic_id: int) -> None:
        try:
            got = self.store.read_meta(key, monotonic_id=monotonic_id)
        except KeyError:  # invalidated or cleared by another writer since the handle
            self.count("meta_gone")
            return
        if got != meta(self.config.universe, key):
            raise _Failure(f"(a) read_meta({key!r}) returned {got[:60]!r}: not its metadata")

    def put(self, key: str) -> Any:
        """``key``'s put; its handle, or ``None`` where another writer put it first (then a
        hit) or the ring refused it."""
        u = self.config.universe
        try:
            handle = self.store.put(key, list(parts(u, key, self.capacity)), meta=meta(u, key))
            self.count("put")
            return handle
        except ValueError as exc:
            if isinstance(exc, ObjectTooLargeError):
                self.count("too_large")
                return None
            if "already stored" not in str(exc):
                raise
            self.count("put_lost_race")  # a concurrent put of the same key won
            return self.store.issue_if_present(key)
        except RingFullError:
            self.count("ring_full")
            return None

    def serve(self, rng: random.Random, key: str) -> None:
        """The engine's path for one item."""
        handle = None
        if self.store.is_cached(key):
            handle = self.store.issue_if_present(key)
            self.count("hit" if handle is not None else "hit_evicted")
        if handle is None:
            if rng.random() < self.claim_rate:
                if self.store.claim(key):
                    self.count("claimed")
                    handle = self.put(key)
                    self.store.unclaim(key)  # a no-op after the put; needed if it failed
                else:
                    cached = self.store.wait_for([key], self.config.wait_s)
                    self.count("waited_cached" if cached[0] else "waited_missing")
                    handle = self.store.issue_if_present(key) if cached[0] else None
                    if handle is None:
                        handle = self.put(key)
            else:
                handle = self.put(key)
        if handle is None:
            return
        self.check_meta(key, handle.monotonic_id)
        if rng.random() < 0.03:  # a rejected request: its references come back
            self.store.release(handle)
            self.count("released")
        else:
            self.send(key, handle)

    def hold_claim(self, rng: random.Random, key: str) -> None:
        """Claim, compute for a while (a SIGKILL may come now), then put."""
        if not self.store.claim(key):
            return
        self.count("claim_held")
        time.sleep(rng.uniform(0, self.config.hold_s))
        handle = self.put(key)
        self.store.unclaim(key)
        if handle is not None:
            self.send(key, handle)

    def verify(self, key: str) -> None:
        try:
            got = self.store.read_stored(key)
        except KeyError:
            self.count("verify_absent")
            return
        if got != expected_payload(self.config.universe, key, self.capacity):
            raise _Failure(f"(a) read_stored({key!r}) returned bytes that are not its own")
        self.count("verified")

    def run_thread(self, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}:{index}")
        for _ in range(config.ops_per_thread):
            n = config.n_keys
            i = min(n - 1, int(rng.paretovariate(1.0)) - 1) if rng.random() < 0.6 else None
            key = key_name(rng.randrange(n) if i is None else i)
            r = rng.random()
            if r < 0.70:
                self.serve(rng, key)
            elif r < 0.80:
                self.hold_claim(rng, key)
            elif r < 0.88:
                self.verify(key)
            elif r < 0.93:
                if self.store.pin_if_present(key):
                    self.count("pinned")
                    self.store.unpin(key)
            elif r < 0.93 + self.clear_rate:
                self.store.clear()
                self.count("clear")
            else:
                self.store.invalidate(key)
                self.count("invalidate")

    def run(self) -> None:
        failures: list[str] = []

        def body(index: int) -> None:
            try:
                self.run_thread(index)
            except BaseException:  # oracle (a) here, or an error the core must not raise
                failures.append(traceback.format_exc())

        threads = [
            threading.Thread(target=body, args=(t,), name=f"writer-{t}")
            for t in range(self.config.threads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            write_frame(self.out, self.lock, ("error", "\n".join(failures)))
            raise SystemExit(3)


class _CacheWriter(_Writer):
    """The ``cache`` layer: the engine's loop around ``ShmSenderCache.join(writer_handle)``
    (``is_cached`` with ``claim``/``wait_s``, touch, ``get_and_update``; on P0's own
    ``CacheMissError`` the engine invalidates the request and retries it once with every
    item's data).  Prompt updates must come back as the putting writer gave them, from any
    writer; every handle goes to the readers."""

    def __init__(self, config: WriterConfig, cache: Any, out: BinaryIO) -> None:
        super().__init__(config, cache._store, out)
        self.cache = cache

    def request(self, rng: random.Random, keys: list[str], *, hold: bool = False) -> None:
        from mmcache.errors import CacheMissError
        from mmcache.items import ShmHandle

        u, cache = self.config.universe, self.cache
        claim = hold or rng.random() < self.claim_rate
        wait_s = self.config.wait_s if rng.random() < 0.5 else 0.0
        flags = cache.is_cached(keys, claim=claim, wait_s=wait_s)
        if hold:  # compute for a while holding the claims (a SIGKILL may come now)
            time.sleep(rng.uniform(0, self.config.hold_s))
        for k in keys:
            cache.touch_sender_cache_item(k)
        inputs = [
            None if f else (item(u, k, self.capacity), prompt_updates(u, k))
            for f, k in zip(flags, keys, strict=True)
        ]
        try:
            outputs = cache.get_and_update(inputs, keys)
        except CacheMissError:  # cached when asked, gone since: the engine's one retry
            cache.release_sender_touches()
            self.count("p0_miss")
            for k in dict.fromkeys(keys):
                cache.invalidate(k)
            for k in keys:
                cache.touch_sender_cache_item(k)
            outputs = cache.get_and_update(
                [(item(u, k, self.capacity), prompt_updates(u, k)) for k in keys], keys
            )
        handles = []
        for (data, updates), k in zip(outputs, keys, strict=True):
            if updates != prompt_updates(u, k):
                raise _Failure(f"(a) {k!r} came back with prompt updates {updates!r}")
            if isinstance(data, ShmHandle):
                handles.append((k, data))
                self.count("handle")
            elif not item_matches(data, u, k, self.capacity):
                raise _Failure(f"(a) {k!r} was served uncached as another item")
            else:
                self.count("uncached")
        if handles and rng.random() < 0.03:  # a rejected request: its references come back
            cache.release_handles(h for _, h in handles)
            self.count("released")
            return
        for k, h in handles:
            self.send(k, h)

    def run_thread(self, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}:{index}")
        n = config.n_keys
        for _ in range(config.ops_per_thread):
            keys = [
                key_name(min(n - 1, int(rng.paretovariate(1.0)) - 1))
                if rng.random() < 0.6
                else key_name(rng.randrange(n))
                for _ in range(rng.randint(1, 3))
            ]
            r = rng.random()
            if r < 0.80:
                self.request(rng, keys)
            elif r < 0.88:
                self.request(rng, keys, hold=True)
            elif r < 0.95:
                self.verify(keys[0])
            elif r < 0.95 + self.clear_rate:
                self.cache.clear_cache()
                self.count("clear")
            else:
                self.cache.invalidate(keys[0])
                self.count("invalidate")

    def verify(self, key: str) -> None:
        from mmcache._core import pack_item

        try:
            got = self.store.read_stored(key)
        except KeyError:
            self.count("verify_absent")
            return
        if got != pack_item(item(self.config.universe, key, self.capacity)):
            raise _Failure(f"(a) read_stored({key!r}) returned bytes that are not its own")
        self.count("verified")


def main() -> int:
    # Frames go to the real stdout; anything printed goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # the coordinator's "you hang: where?"
    config: WriterConfig = pickle.load(sys.stdin.buffer)  # one frame: stdin stays open
    writer: _Writer
    if config.layer == "cache":
        from mmcache.shm import ShmSenderCache

        cache = ShmSenderCache.join(config.handle)
        store: Any = cache
        writer = _CacheWriter(config, cache, out)
    else:
        store = ShmObjectStore.join(config.handle)
        writer = _Writer(config, store, out)
    # Timestamps on CLOCK_MONOTONIC (one clock for every process of the host) let the
    # coordinator order a join after another writer's close, whichever pipe it reads first.
    write_frame(out, writer.lock, ("joined", writer.store.writer_slot, time.monotonic()))
    try:
        writer.run()
        if config.linger:  # the coordinator says when to close (it left first)
            write_frame(out, writer.lock, ("done",))
            sys.stdin.buffer.read()
    finally:
        write_frame(out, writer.lock, ("counts", writer.counts))
        write_frame(out, writer.lock, ("closing", time.monotonic()))
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
