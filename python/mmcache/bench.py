"""Micro-benchmarks of the shared-memory store, for ``mmcache bench`` and ``benches/``.

Each figure is the median time of one operation, and the same time as a multiple of a numpy
memcpy of the same number of bytes measured in the same run (so numbers from different
machines compare):

- ``put (first lap)``: write an object into a new ring, for each object of the first lap: its
  pages are touched for the first time (a page fault and a tmpfs allocation each, which the
  store reserves as it goes: creation reserves no ring pages);
- ``put``: write an object into the ring (and give its reference back, so the ring recycles),
  once the first lap is done;
- ``put (full index)``: the same, for objects under 16 KiB, into a 1 GiB ring whose key index
  (by default one object per 16 KiB of ring: 65,536) fills before its bytes do, so each put
  evicts an object for the index's room (and, like ``put (first lap)``'s, writes ring pages
  for the first time);
- ``put (stalled reader)``: a put into a 1 GiB ring that one attached reader stopped reading,
  full of its unread objects (its key index, for objects under 16 KiB): the put fails (P0
  serves the item uncached), and must find that out without sweeping the whole ring each time;
- ``lookup``: ``is_cached`` of a present key;
- ``get (copy)`` / ``get (zero-copy)``: a reader resolves a handle into bytes, or into a
  read-only view, in 1 to 4 reader *processes* reading the same handles at once; their
  throughput is the bytes all readers got over the wall time of the concurrent section.

Each is followed by its ``cache`` row: the same through the cache API an engine calls, for an
item of three float32 tensors of the same total size (codec included):

- ``cache put``: ``ShmSenderCache.get_and_update_item`` of a new item (after a first lap,
  untimed, as for ``put``);
- ``cache lookup``: ``is_cached_item``; ``cache hit``: ``touch_sender_cache_item`` and
  ``get_and_update_item(None)`` of a present item (P0's whole cost for a repeated item);
- ``cache get (copy)`` / ``cache get (zero-copy)``: ``ShmReceiverCache.get_and_update_item``
  in one reader process.

Each reader's last read is checked (off the clock) against what was written, so a read that
returns the wrong bytes cannot look fast. Performance is measured here, never asserted by a
test.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from mmcache._core import ReaderHandle, ShmHandle, ShmObjectStore, ShmReader, ShmWriter
from mmcache.errors import MmcacheError, RingFullError
from mmcache.shm import ShmReceiverCache, ShmSenderCache
from mmcache.signals import sigint_ignored

__all__ = ["SIZES", "BenchResult", "render", "run_benchmarks", "three_tensor_item"]

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
_KEY = "bench-object"


@dataclass(frozen=True)
class BenchResult:
    """One benchmark: an operation on payloads of ``size`` bytes with ``readers`` readers."""

    op: str
    size: int
    readers: int
    #: Median seconds per operation.
    seconds: float
    #: Bytes per second through the operation, all readers together (``None`` for one that
    #: moves no bytes: a lookup, a hit, a put that fails).
    bytes_per_s: float | None
    #: Median seconds of a numpy memcpy of ``size`` bytes, measured in the same run.
    memcpy_seconds: float

    @property
    def vs_memcpy(self) -> float:
        """How many memcpys of the same size one operation costs."""
        return self.seconds / self.memcpy_seconds

    def to_dict(self) -> dict[str, Any]:
        """The result, with ``vs_memcpy``, as JSON-ready values."""
        return {**asdict(self), "vs_memcpy": self.vs_memcpy}


def _timings(op: Callable[[int], object], budget_s: float, limit: int = 100_000) -> list[float]:
    """Seconds of each call ``op(0)``, ``op(1)``, ... until ``budget_s`` is spent (at least 5
    calls, after one untimed warm-up call)."""
    op(0)
    times = []
    deadline = time.perf_counter() + budget_s
    for i in range(1, limit):
        start = time.perf_counter()
        op(i)
        times.append(time.perf_counter() - start)
        if len(times) >= 5 and start > deadline:
            break
    return times


def _store_for(size: int, n_readers: int, objects: int) -> ShmWriter:
    """A store with room for ``objects`` objects of ``size`` bytes."""
    slot = size + 64 * KiB  # the object plus its chunk header, generously
    return ShmObjectStore.create(objects * slot + MiB, n_readers=n_readers, max_object_size=slot)


def three_tensor_item(size: int, seed: int = 0) -> dict[str, Any]:
    """The benchmarks' item: three float32 tensors of ``size`` bytes in all (1/4, 1/2 and
    1/4 of them), as a vision processor makes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = size // 4
    return {
        "pixel_values": torch.randn(n // 4, generator=g),
        "image_embeds": torch.randn(n // 2, generator=g),
        "image_grid": torch.randn(n // 4, generator=g),
    }


def _sender_for(size: int, n_readers: int, objects: int) -> ShmSenderCache:
    """A P0 cache with room for ``objects`` items of ``size`` bytes."""
    slot = size + 64 * KiB
    return ShmSenderCache(
        (objects * slot + MiB) / 2**30, max_object_size_mb=slot / MiB, n_readers=n_readers
    )


def _seconds(op: Callable[[], object]) -> float:
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _in_process(size: int, budget_s: float, memcpy_s: float) -> list[BenchResult]:
    """``put``, ``lookup`` and P0's cache calls in this process (the writer's operations)."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    results = []
    # Objects per ring: a first lap is this many puts.
    objects = 8
    with _store_for(size, 1, objects) as store:

        def put(i: int) -> None:
            store.release(store.put(f"{_KEY}-{i}", payload.data))

        first_lap = [_seconds(partial(put, -1 - i)) for i in range(objects)]
        results.append(_result("put (first lap)", size, 1, first_lap, memcpy_s))
        times = _timings(put, budget_s)
        results.append(_result("put", size, 1, times, memcpy_s))
        store.release(store.put(_KEY, payload.data))
        lookup_times = _timings(lambda i: store.is_cached(_KEY), budget_s)
    if size < _INDEX_SPAN:
        results.append(_full_index_put(payload, memcpy_s))
    results.append(_stalled_reader_put(payload, memcpy_s, budget_s))

    item = three_tensor_item(size)
    with _sender_for(size, 1, objects) as cache:

        def cache_put(i: int) -> None:
            handle, _ = cache.get_and_update_item((item, None), f"{_KEY}-{i}")
            cache.release_handles([handle])

        for i in range(objects):  # the first lap (its cost is the ``put (first lap)`` row's)
            cache_put(-1 - i)
        times = _timings(cache_put, budget_s)
        results.append(_result("cache put", size, 1, times, memcpy_s))
        results.append(_result("lookup", size, 1, lookup_times, memcpy_s))
        cache.get_and_update_item((item, None), _KEY)
        times = _timings(lambda i: cache.is_cached_item(_KEY), budget_s)
        results.append(_result("cache lookup", size, 1, times, memcpy_s))

        def hit(i: int) -> None:
            cache.touch_sender_cache_item(_KEY)
            handle, _ = cache.get_and_update_item(None, _KEY)
            cache.release_handles([handle])

        times = _timings(hit, budget_s)
        results.append(_result("cache hit", size, 1, times, memcpy_s))
    return results


#: Operations that move no bytes: lookups, a hit (a handle to what is there), a put that fails.
_NO_BYTES = ("lookup", "cache lookup", "cache hit", "put (stalled reader)")
#: Bytes of ring per object in a key index of the default size, and the ring of the rows
#: ``put (full index)`` and ``put (stalled reader)`` (what a sweep or scan walks grows with it).
_INDEX_SPAN, _BIG_RING = 16 * KiB, 1 << 30


def _full_index_put(payload: np.ndarray, memcpy_s: float) -> BenchResult:
    """``put (full index)``: the mean time of a lap of puts of ``payload`` (as many as the
    index holds) once the default index is full. A mean, not a median: making room costs
    some puts far more than others, in bursts, and a median would hide them."""
    size = payload.nbytes
    with ShmObjectStore.create(_BIG_RING, max_object_size=size + 64 * KiB) as store:

        def put(i: int) -> None:
            store.release(store.put(f"{_KEY}-{i}", payload.data))

        lap = store.stats()["max_objects"]
        for i in range(lap):  # fill the index (untimed)
            put(-1 - i)
        start = time.perf_counter()
        for i in range(lap):
            put(i)
        return _result("put (full index)", size, 1, [(time.perf_counter() - start) / lap], memcpy_s)


def _stalled_reader_put(payload: np.ndarray, memcpy_s: float, budget_s: float) -> BenchResult:
    """``put (stalled reader)``: the mean time of a failing put of ``payload`` into a 1 GiB
    ring full of objects its one reader has not read (nor will), for ``budget_s``. A mean, as
    for ``put (full index)``."""
    size = payload.nbytes
    with ShmObjectStore.create(_BIG_RING, max_object_size=size + 64 * KiB) as store:
        stalled = ShmObjectStore.attach(store.handle())
        filled = 0
        try:
            while True:  # fill the ring, or its index (untimed)
                store.put(f"{_KEY}-{filled}", payload.data)
                filled += 1
        except RingFullError:
            pass
        puts = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < budget_s or puts < 10:
            try:
                store.put(f"{_KEY}-new-{puts}", payload.data)
            except RingFullError:
                pass
            else:
                raise RuntimeError("a put found room in a ring its reader stopped reading")
            puts += 1
        stalled.close()
        return _result("put (stalled reader)", size, 1, [elapsed / puts], memcpy_s)


def _result(
    op: str, size: int, readers: int, times: Sequence[float], memcpy_s: float
) -> BenchResult:
    median = statistics.median(times)
    return BenchResult(
        op, size, readers, median, None if op in _NO_BYTES else size / median, memcpy_s
    )


def _digest(data: object) -> str:
    """A digest of what a read returned (bytes, a view, or an item of tensors), so that the
    benchmark can check it against what was written: a read that returns the wrong bytes must
    not look fast."""
    h = hashlib.blake2b()
    if isinstance(data, Mapping):
        for name in sorted(data):
            h.update(name.encode())
            h.update(np.ascontiguousarray(data[name]).tobytes())
    else:
        h.update(memoryview(data).cast("B"))  # type: ignore[arg-type]
    return h.hexdigest()


def _reader_process(conn: Connection) -> None:
    """A reader of the pool: for each task, attach (to the store, or as the cache API's
    receiver), receive the handles (the start signal), read every one, report the timings
    and (off the clock) the digest of the last read, detach. ``None`` (or the pool's end of
    the pipe closing), even in place of the handles, ends it: the pool stops its readers so
    when the benchmark was interrupted half-way through a task."""
    with contextlib.suppress(EOFError, ConnectionError):  # the pool's end of the pipe gone
        _serve_reads(conn)


def _serve_reads(conn: Connection) -> None:
    """:func:`_reader_process`'s loop."""
    while (task := conn.recv()) is not None:
        reader_handle, copy, through_cache = task
        read: Callable[[ShmHandle], object]
        reader: ShmReceiverCache | ShmReader
        try:
            if through_cache:
                # Imported for its side effect: decoding imports it on first use, which must
                # not be on the clock.
                import torch  # noqa: F401

                reader = cache = ShmReceiverCache(reader_handle, copy=copy)
                read = partial(cache.get_and_update_item, mm_hash=_KEY)
            else:
                reader = store = ShmObjectStore.attach(reader_handle)
                read = partial(store.resolve, key=_KEY, copy=copy)
        except (MmcacheError, OSError) as exc:
            # Told, not raised: the pool raises it in a normal run, and a pool that is
            # stopping (the benchmark interrupted, its store gone) ends this reader next.
            conn.send(f"cannot attach: {exc}")
            continue
        with reader:
            conn.send("attached")
            handles = conn.recv()
            if handles is None:  # stopped before the reads (see `_ReaderPool.close`)
                return
            times = []
            data = None
            began = time.perf_counter()
            for handle in handles:
                del data  # as soon as it was read, as a caller that uses it and moves on
                start = time.perf_counter()
                data = read(handle)
                times.append(time.perf_counter() - start)
            ended = time.perf_counter()
            conn.send((times, began, ended, _digest(data)))
            del data


class _ReaderPool:
    """Reader processes started once (spawn) and reused for every size and reader count."""

    def __init__(self, size: int) -> None:
        ctx = get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        try:
            for _ in range(size):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_reader_process, args=(theirs,), daemon=True)
                # Started with SIGINT ignored, which a child inherits through exec (Python
                # leaves an ignored SIGINT ignored): Ctrl-C reaches the whole foreground
                # process group, and only the benchmark is to stop (and stop its readers, in
                # `close`), not each reader with a KeyboardInterrupt traceback of its own.
                with sigint_ignored():
                    proc.start()
                theirs.close()
                self._conns.append(mine)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    def read(
        self,
        reader_handle: ReaderHandle,
        issue: Callable[[], ShmHandle],
        count: int,
        readers: int,
        copy: bool,
        expected: str,
        through_cache: bool = False,
    ) -> tuple[list[float], float]:
        """Have ``readers`` processes attach, then read ``count`` handles from ``issue`` at
        once: every per-get time, and the wall time from the first start to the last end.
        (Handles are issued once every reader is attached: a handle issued before a reader
        took its slot is not that reader's to acknowledge.) Raises unless every reader's last
        read has the digest ``expected``."""
        conns = self._conns[:readers]
        for conn in conns:
            conn.send((reader_handle, copy, through_cache))
        for conn in conns:
            attached = conn.recv()  # every reader attached
            if attached != "attached":
                raise RuntimeError(f"a reader process {attached}")
        handles = [issue() for _ in range(count)]
        for conn in conns:
            conn.send(handles)
        reports = [conn.recv() for conn in conns]
        if any(report[3] != expected for report in reports):
            raise RuntimeError("a reader read back other bytes than the writer put")
        times = [t for report in reports for t in report[0]]
        wall = max(r[2] for r in reports) - min(r[1] for r in reports)
        return times, wall

    def close(self) -> None:
        """Stop the reader processes (also half-way through a task, when the benchmark was
        interrupted or failed: a reader that is gone already is no error here)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
            conn.close()
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():  # stuck mid-read: nothing of it is needed any more
                proc.kill()
                proc.join()


def _get(
    pool: _ReaderPool, size: int, readers: int, copy: bool, count: int, memcpy_s: float
) -> BenchResult:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with _store_for(size, readers, 2) as store:
        store.release(store.put(_KEY, payload.data))
        times, wall = pool.read(
            store.handle(), lambda: store.issue(_KEY), count, readers, copy, _digest(payload)
        )
    op = "get (copy)" if copy else "get (zero-copy)"
    return BenchResult(
        op, size, readers, statistics.median(times), readers * count * size / wall, memcpy_s
    )


def _cache_get(
    pool: _ReaderPool, size: int, copy: bool, count: int, memcpy_s: float
) -> BenchResult:
    """One worker's ``get_and_update_item`` of handles to one item (P0's hits)."""
    with _sender_for(size, 1, 2) as cache:

        def issue() -> ShmHandle:
            handle, _ = cache.get_and_update_item(None, _KEY)
            if not isinstance(handle, ShmHandle):
                raise RuntimeError(f"the benchmark's ring served its item uncached: {handle!r}")
            return handle

        item = three_tensor_item(size)
        first, _ = cache.get_and_update_item((item, None), _KEY)
        cache.release_handles([first])
        times, wall = pool.read(
            cache.handle(), issue, count, 1, copy, _digest(item), through_cache=True
        )
    op = "cache get (copy)" if copy else "cache get (zero-copy)"
    return BenchResult(op, size, 1, statistics.median(times), count * size / wall, memcpy_s)


def _memcpy(size: int) -> Callable[[int], None]:
    """An operation that copies ``size`` bytes between two numpy arrays."""
    src = np.ones(size, np.uint8)
    dst = np.empty_like(src)

    def copy(i: int) -> None:
        np.copyto(dst, src)

    return copy


def run_benchmarks(
    *, quick: bool = False, sizes: Sequence[int] = SIZES, max_readers: int | None = None
) -> list[BenchResult]:
    """Run every benchmark; ``quick`` spends less time per figure and uses 1-2 readers
    instead of 1-4."""
    budget_s = 0.03 if quick else 0.2
    max_readers = max_readers or (2 if quick else 4)
    results = []
    pool = _ReaderPool(max_readers)
    try:
        for size in sizes:
            memcpy_times = _timings(_memcpy(size), budget_s)
            memcpy_s = statistics.median(memcpy_times)
            results.append(_result("memcpy (numpy)", size, 1, memcpy_times, memcpy_s))
            results.extend(_in_process(size, budget_s, memcpy_s))
            # Enough handles to fill the budget at memcpy speed, within sane bounds.
            count = int(min(2000, max(20, budget_s / (memcpy_s + 2e-6))))
            for copy in (True, False):
                for readers in range(1, max_readers + 1):
                    results.append(_get(pool, size, readers, copy, count, memcpy_s))
                results.append(_cache_get(pool, size, copy, count, memcpy_s))
    finally:
        pool.close()
    return results


def _size(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:,.2f} µs" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def render(results: Sequence[BenchResult], console: Console) -> None:
    """Print the results as one table."""
    table = Table(
        title="mmcache bench: shared-memory store, and the cache API (cache …) over it",
        title_justify="left",
    )
    for name in ("operation", "size", "readers", "median", "throughput", "x memcpy"):
        table.add_column(name, justify="left" if name == "operation" else "right")
    for r in results:
        table.add_row(
            r.op,
            _size(r.size),
            str(r.readers),
            _duration(r.seconds),
            "-" if r.bytes_per_s is None else f"{r.bytes_per_s / 2**30:,.2f} GiB/s",
            f"{r.vs_memcpy:,.2f}",
        )
    console.print(table)
