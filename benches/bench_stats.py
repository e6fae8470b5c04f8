"""What a writer's ``stats()`` costs the other writers (the core, ``mmcache._core``).

A ring (1 GiB by default) is filled with small objects (~64 k of 16,000 bytes), a reader
attached. One writer process then puts continuously (each put's handle given back at once, so
the ring keeps wrapping), and its put latencies are taken in two phases of equal length:
alone, then while another writer process calls ``stats()`` in a loop. Printed: the puts'
median, p99, p99.9 and worst latency in each phase, and how long one ``stats()`` takes.
Latencies include the Python call (about a microsecond). Performance is measured here, never
asserted by a test.

    python benches/bench_stats.py [--quick] [--capacity-mib N] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as in bench_writers.py

from bench_writers import report

from mmcache._core import ShmObjectStore, WriterHandle

MiB = 1 << 20
OBJECT = 16_000  # bytes: with its chunk header, a 1 GiB ring holds ~66 k of them


def _putter(
    handle: WriterHandle, seconds: float, phases: int, ready: Any, go: Any, out: Any
) -> None:
    """Put for ``seconds`` in each of ``phases`` phases (each started by ``go``), reporting
    every put's latency in nanoseconds per phase."""
    writer = ShmObjectStore.join(handle)
    payload = os.urandom(OBJECT)
    clock = time.perf_counter_ns
    n = 0
    for phase in range(phases):
        ready.set()
        go[phase].wait()
        latencies = []
        end = clock() + int(seconds * 1e9)
        while True:
            key = f"p{n:09d}"
            n += 1
            began = clock()
            writer.release(writer.put(key, payload))
            done = clock()
            latencies.append(done - began)
            if done >= end:
                break
        out.put(latencies)
    writer.close()


def _stats_loop(handle: WriterHandle, ready: Any, stop: Any, out: Any) -> None:
    """Call ``stats()`` until ``stop`` is set, reporting each call's duration (ns)."""
    writer = ShmObjectStore.join(handle)
    clock = time.perf_counter_ns
    durations = []
    ready.set()
    while not stop.is_set():
        began = clock()
        writer.stats()
        durations.append(clock() - began)
    out.put(durations)
    writer.close()


def summary(ns: list[int]) -> dict[str, float]:
    """Median, p99, p99.9 and worst, in microseconds."""
    ordered = sorted(ns)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3

    return {
        "count": float(len(ordered)),
        "p50_us": at(0.5),
        "p99_us": at(0.99),
        "p99.9_us": at(0.999),
        "max_us": ordered[-1] / 1e3,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 256 MiB ring, 2 s phases")
    parser.add_argument("--capacity-mib", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    capacity = (256 if args.quick else args.capacity_mib) * MiB
    seconds = 2.0 if args.quick else args.seconds
    store = ShmObjectStore.create(
        capacity, n_readers=1, max_writers=3, max_objects=2 * (capacity // OBJECT)
    )
    reader = ShmObjectStore.attach(store.handle())
    payload = bytes(OBJECT)
    fill = capacity // OBJECT + capacity // OBJECT // 16  # a little over one lap
    for i in range(fill):
        store.release(store.put(f"fill{i:09d}", payload))
    filled = store.stats()
    began = time.perf_counter_ns()
    store.stats()
    alone = time.perf_counter_ns() - began

    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), [ctx.Event(), ctx.Event()], ctx.Queue()
    putter = ctx.Process(target=_putter, args=(store.writer_handle(), seconds, 2, ready, go, out))
    putter.start()
    ready.wait()
    ready.clear()
    go[0].set()
    quiet = out.get(timeout=600)
    ready.wait()
    stats_ready, stop, stats_out = ctx.Event(), ctx.Event(), ctx.Queue()
    looper = ctx.Process(
        target=_stats_loop, args=(store.writer_handle(), stats_ready, stop, stats_out)
    )
    looper.start()
    stats_ready.wait()
    go[1].set()
    loud = out.get(timeout=600)
    stop.set()
    durations = stats_out.get(timeout=600)
    putter.join()
    looper.join()
    reader.close()
    store.close()

    rows = [
        {"op": "put, alone", **summary(quiet)},
        {"op": "put, another writer calling stats()", **summary(loud)},
        {"op": "stats(), a put running", **summary(durations)},
    ]
    print(
        f"ring {capacity // MiB} MiB, {filled['chunks']} chunks, {filled['objects']} objects; "
        f"one stats() with nothing else running: {alone / 1e3:,.0f} us"
    )
    print(f"stats() calls: median {statistics.median(durations) / 1e3:,.0f} us")
    report(rows, args.json, width=40)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
