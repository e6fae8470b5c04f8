"""Micro-benchmarks of the shared-memory store, for ``mmcache bench`` and ``benches/``.

Each figure is the median time of one operation, and the same time as a multiple of a numpy
memcpy of the same number of bytes measured in the same run (so numbers from different
machines compare):

- ``put``: write an object into the ring (and give its reference back, so the ring recycles);
- ``lookup``: ``is_cached`` of a present key;
- ``get (copy)`` / ``get (zero-copy)``: a reader resolves a handle into bytes, or into a
  read-only view, in 1 to 4 reader *processes* reading the same handles at once; their
  throughput is the bytes all readers got over the wall time of the concurrent section.

Performance is measured here, never asserted by a test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from mmcache._core import ShmObjectStore

__all__ = ["SIZES", "BenchResult", "render", "run_benchmarks"]

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
    #: Bytes per second through the operation, all readers together (``None`` for a lookup,
    #: which moves no bytes).
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


def _store_for(size: int, n_readers: int, objects: int) -> ShmObjectStore:
    """A store with room for ``objects`` objects of ``size`` bytes."""
    slot = size + 64 * KiB  # the object plus its chunk header, generously
    return ShmObjectStore.create(objects * slot + MiB, n_readers=n_readers, max_object_size=slot)


def _in_process(size: int, budget_s: float, memcpy_s: float) -> list[BenchResult]:
    """``put`` and ``lookup`` in this process (the writer's operations)."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    results = []
    with _store_for(size, 1, 8) as store:

        def put(i: int) -> None:
            store.release(store.put(f"{_KEY}-{i}", payload.data))

        times = _timings(put, budget_s)
        results.append(_result("put", size, 1, times, memcpy_s))
        store.release(store.put(_KEY, payload.data))
        times = _timings(lambda i: store.is_cached(_KEY), budget_s)
        results.append(_result("lookup", size, 1, times, memcpy_s))
    return results


def _result(
    op: str, size: int, readers: int, times: Sequence[float], memcpy_s: float
) -> BenchResult:
    median = statistics.median(times)
    return BenchResult(
        op, size, readers, median, None if op == "lookup" else size / median, memcpy_s
    )


def _reader_process(conn: Connection) -> None:
    """A reader of the pool: for each task, attach, receive the handles (the start signal),
    read every one, report the timings, detach. ``None`` ends it."""
    while (task := conn.recv()) is not None:
        reader_handle, copy = task
        with ShmObjectStore.attach(reader_handle) as reader:
            conn.send("attached")
            handles = conn.recv()
            times = []
            began = time.perf_counter()
            for handle in handles:
                start = time.perf_counter()
                data = reader.get(handle, _KEY, copy=copy)
                times.append(time.perf_counter() - start)
                del data
            conn.send((times, began, time.perf_counter()))


class _ReaderPool:
    """Reader processes started once (spawn) and reused for every size and reader count."""

    def __init__(self, size: int) -> None:
        ctx = get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for _ in range(size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_reader_process, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def read(
        self, store: ShmObjectStore, count: int, readers: int, copy: bool
    ) -> tuple[list[float], float]:
        """Have ``readers`` processes attach to ``store``, then read ``count`` handles of its
        object at once: every per-get time, and the wall time from the first start to the
        last end. (Handles are issued once every reader is attached: a handle issued before
        a reader took its slot is not that reader's to acknowledge.)"""
        conns = self._conns[:readers]
        for conn in conns:
            conn.send((store.handle(), copy))
        for conn in conns:
            conn.recv()  # every reader attached
        handles = [store.get_cached(_KEY) for _ in range(count)]
        for conn in conns:
            conn.send(handles)
        reports = [conn.recv() for conn in conns]
        times = [t for report in reports for t in report[0]]
        wall = max(r[2] for r in reports) - min(r[1] for r in reports)
        return times, wall

    def close(self) -> None:
        """Stop the reader processes."""
        for conn in self._conns:
            conn.send(None)
            conn.close()
        for proc in self._procs:
            proc.join(10)


def _get(
    pool: _ReaderPool, size: int, readers: int, copy: bool, count: int, memcpy_s: float
) -> BenchResult:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with _store_for(size, readers, 2) as store:
        store.release(store.put(_KEY, payload.data))
        times, wall = pool.read(store, count, readers, copy)
    op = "get (copy)" if copy else "get (zero-copy)"
    return BenchResult(
        op, size, readers, statistics.median(times), readers * count * size / wall, memcpy_s
    )


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
    finally:
        pool.close()
    return results


def _size(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:,.2f} µs" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def render(results: Sequence[BenchResult], console: Console) -> None:
    """Print the results as one table."""
    table = Table(title="mmcache bench: shared-memory store", title_justify="left")
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
