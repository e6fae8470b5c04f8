"""Several writers on one store (the core, ``mmcache._core``):

- ``is_cached`` of a key this writer put, and of a key another writer put;
- a hit (``issue``) on this writer's and on another writer's object, and ``issue`` +
  ``release``;
- ``pin`` + ``unpin`` (a touched hit's bookkeeping);
- aggregate put throughput of 4 KiB objects from 1, then 2 writer processes at once (each
  joined to the same store, taking turns in rounds), and its ratio.

Lookups and hits are timed as loops (``timeit``, best of several repeats, per call), so the
nanoseconds are not the clock's; a reader is attached, so hits issue references as an
engine's do. Every process runs with one OpenBLAS thread (none uses BLAS). Performance is
measured here, never asserted by a test.

    python benches/bench_writers.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import timeit
from pathlib import Path
from typing import Any

# The writer processes never use BLAS, and on a small machine the idle threads OpenBLAS starts
# with numpy (which mmcache imports) take CPU time from them: one thread, in every process.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from mmcache._core import ShmObjectStore, WriterHandle

KiB, MiB = 1 << 10, 1 << 20
OBJECT = 4 * KiB


def per_call(call: Any, number: int, repeat: int) -> float:
    """Seconds per call: the best of ``repeat`` loops of ``number`` calls."""
    return min(timeit.repeat(call, number=number, repeat=repeat)) / number


def lookups_and_hits(quick: bool) -> list[dict[str, Any]]:
    number, repeat = (20_000, 3) if quick else (200_000, 7)
    mine = ShmObjectStore.create(64 * MiB, n_readers=1, max_writers=2)
    other = ShmObjectStore.join(mine.writer_handle())
    reader = ShmObjectStore.attach(mine.handle())
    own, theirs = "a" * 64, "b" * 64  # content hashes are 64 hex characters
    reader.resolve(mine.put(own, bytes(OBJECT)), own)
    reader.resolve(other.put(theirs, bytes(OBJECT)), theirs)
    rows = []
    for label, key in (("own", own), ("another writer's", theirs)):
        lookup = per_call(lambda key=key: mine.is_cached(key), number, repeat)
        issued: list[Any] = []
        issue = per_call(
            lambda key=key, issued=issued: issued.append(mine.issue(key)), number // 4, repeat
        )
        for handle in issued:
            mine.release(handle)

        def hit_and_release(key: str = key) -> None:
            mine.release(mine.issue(key))

        both = per_call(hit_and_release, number // 4, repeat)

        def pin_unpin(key: str = key) -> None:
            mine.pin(key)
            mine.unpin(key)

        pins = per_call(pin_unpin, number // 4, repeat)
        rows += [
            {"op": f"is_cached, {label} key", "ns": lookup * 1e9},
            {"op": f"issue, {label} object", "ns": issue * 1e9},
            {"op": f"issue + release, {label} object", "ns": both * 1e9},
            {"op": f"pin + unpin, {label} object", "ns": pins * 1e9},
        ]
    reader.close()
    other.close()
    mine.close()
    return rows


def _putter(handle: WriterHandle, prefix: str, count: int, ready: Any, go: Any, out: Any) -> None:
    """Join, wait for the start, put ``count`` objects (giving each handle back), report."""
    writer = ShmObjectStore.join(handle)
    payload = os.urandom(OBJECT)
    keys = [f"{prefix}-{i:08d}" for i in range(count)]
    ready.set()
    go.wait()
    began = time.perf_counter()
    for key in keys:
        writer.release(writer.put(key, payload))
    out.put((began, time.perf_counter()))
    writer.close()


def put_throughput(writers: int, count: int, round_: int) -> float:
    """Puts per second of ``writers`` processes putting at once into one store (no reader
    attached: every object is reclaimable, the ring wraps many times)."""
    ctx = mp.get_context("spawn")
    store = ShmObjectStore.create(16 * MiB, max_writers=writers + 1)
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(writers)]
    procs = [
        ctx.Process(
            target=_putter,
            args=(store.writer_handle(), f"r{round_}w{w}", count, readies[w], go, out),
        )
        for w in range(writers)
    ]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait()
    go.set()
    spans = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    store.close()
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return writers * count / wall


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = lookups_and_hits(args.quick)
    count, rounds = (5_000, 1) if args.quick else (40_000, 3)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(rounds):
        for writers in (1, 2):  # taking turns, so both see the same load
            rates[writers].append(put_throughput(writers, count, round_))
    for writers, measured in rates.items():
        rate = statistics.median(measured)
        rows.append(
            {
                "op": f"put {OBJECT // KiB} KiB, {writers} writer process(es)",
                "puts_per_s": rate,
                "ns": 1e9 / rate,
                "rounds": measured,
            }
        )
    ratio = statistics.median(rates[2]) / statistics.median(rates[1])
    rows.append({"op": "put throughput, 2 writers / 1", "ratio": ratio})
    report(rows, args.json)
    return 0


def report(rows: list[dict[str, Any]], json_path: Path | None, width: int = 45) -> None:
    """Print ``rows`` (their ``op``, then each figure but the per-round ones) and the load
    average; write both to ``json_path`` when given (bench_stats.py reports alike)."""
    load = os.getloadavg()
    for row in rows:
        figures = ", ".join(
            f"{k}={v:,.1f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in row.items()
            if k not in ("op", "rounds")
        )
        print(f"{row['op']:<{width}} {figures}")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    if json_path is not None:
        json_path.write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
