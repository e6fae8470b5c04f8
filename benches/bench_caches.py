"""Per-item cost of the caches for one image item, against pickle through a pipe.

The item is a 3x448x448 float32 tensor (2.4 MB), as a vision processor produces.  For each
case the P0 (sender) call and the P1/worker (receiver) call are timed separately, per item,
and the median is reported; all cases run in this process except the baseline, which sends
the item pickled through a ``multiprocessing`` pipe to a child that unpickles it and replies
(one round trip per item).  In ``lru`` mode a miss still ships the item by the engine's own
IPC (the baseline's cost) on top of the cache work shown.

A second table gives the cost of the calls themselves on the hot paths (a 1 KiB item, so
no payload work): ns per call in thread CPU time (steadier than wall time on a shared
machine), the minimum of 15 repeats.  It is where the caches' locks and per-thread request
state show.  Its first row is the baseline of the lookups: a method doing one dict lookup,
as vLLM's writer answers ``is_cached``.  The ``shm`` writer hit is timed twice with the
reader attached: interleaved with the reader's resolve (then the resolve's own time is
subtracted: the hit pays for what the resolve evicted from the CPU's caches), and alone (the
handles read after each repeat).

Run: ``python benches/bench_caches.py [--iterations N]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
import timeit
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from mmcache import ReceiverCache, SenderCache, ShmReceiverCache, ShmSenderCache

SHAPE = (3, 448, 448)
UPDATES = [("image", 0, 256)]


def make_item() -> dict[str, Any]:
    return {"pixel_values": torch.rand(SHAPE, dtype=torch.float32)}


def _echo(conn: Connection) -> None:
    """Child of the baseline: unpickle each item, reply with one byte."""
    while (raw := conn.recv_bytes()) != b"stop":
        pickle.loads(raw)
        conn.send_bytes(b"k")


def bench_pickle_pipe(item: dict[str, Any], iterations: int) -> float:
    """Median µs of dumps + send + recv + loads + a 1-byte reply."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,))
    proc.start()
    times = []
    for _ in range(iterations + 5):
        t0 = time.perf_counter_ns()
        parent.send_bytes(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        parent.recv_bytes()
        times.append(time.perf_counter_ns() - t0)
    parent.send_bytes(b"stop")
    proc.join()
    return statistics.median(times[5:]) / 1000


def bench_pair(
    p0: Callable[[int], Any], p1: Callable[[int, Any], Any], iterations: int
) -> tuple[float, float]:
    """Median µs of ``p0(i)`` and of ``p1(i, p0's output)``, timed separately."""
    p0_times, p1_times = [], []
    for i in range(iterations + 5):
        t0 = time.perf_counter_ns()
        sent = p0(i)
        t1 = time.perf_counter_ns()
        got = p1(i, sent)
        t2 = time.perf_counter_ns()
        del got  # a zero-copy view must go before its object can be reclaimed
        p0_times.append(t1 - t0)
        p1_times.append(t2 - t1)
    return statistics.median(p0_times[5:]) / 1000, statistics.median(p1_times[5:]) / 1000


def run(iterations: int = 200) -> list[dict[str, Any]]:
    """Every case's median P0 and P1/worker µs per item, baseline first."""
    item = make_item()
    rows = [
        {
            "case": "pickle + Pipe round trip (baseline)",
            "p0": None,
            "p1": None,
            "total": bench_pickle_pipe(item, iterations),
        }
    ]

    def add(case: str, times: tuple[float, float]) -> None:
        rows.append({"case": case, "p0": times[0], "p1": times[1], "total": sum(times)})

    sender, receiver = SenderCache(4), ReceiverCache(4)
    sender.get_and_update_item((item, UPDATES), "hit")
    receiver.get_and_update_item(item, "hit")
    add(
        "lru hit",
        bench_pair(
            lambda i: sender.get_and_update_item(None, "hit")[0],
            lambda i, data: receiver.get_and_update_item(data, "hit"),
            iterations,
        ),
    )
    add(
        "lru miss (cache work; the item still travels by IPC)",
        bench_pair(
            lambda i: sender.get_and_update_item((item, UPDATES), f"miss{i}")[0],
            lambda i, data: receiver.get_and_update_item(data, f"miss{i}"),
            iterations,
        ),
    )

    with ShmSenderCache(0.25) as shm:
        for copy in (False, True):
            label = "zero-copy" if copy is False else "copy"
            with ShmReceiverCache(shm.handle(), copy=copy) as worker:
                key = f"hit-{label}"
                worker.get_and_update_item(shm.get_and_update_item((item, UPDATES), key)[0], key)
                # bench_pair calls its lambdas before it returns, in this iteration (B023).
                add(
                    f"shm hit, {label}",
                    bench_pair(
                        lambda i: shm.get_and_update_item(None, key)[0],  # noqa: B023
                        lambda i, handle: worker.get_and_update_item(handle, key),  # noqa: B023
                        iterations,
                    ),
                )
                add(
                    f"shm miss, {label}",
                    bench_pair(
                        lambda i: shm.get_and_update_item((item, UPDATES), f"miss-{label}{i}")[0],  # noqa: B023
                        lambda i, handle: worker.get_and_update_item(handle, f"miss-{label}{i}"),  # noqa: B023
                        iterations,
                    ),
                )
                # Off the clock: a hit that read back other bytes must not look fast.
                got = worker.get_and_update_item(shm.get_and_update_item(None, key)[0], key)
                if got is None or not torch.equal(got["pixel_values"], item["pixel_values"]):
                    raise RuntimeError(f"shm, {label}: the item read back differs")
                del got
        if shm.stats()["uncached_full"] or shm.stats()["uncached_oversize"]:
            raise RuntimeError(f"the benchmark's ring served items uncached: {shm.stats()}")
    return rows


def call_ns(call: Callable[[], object], number: int) -> float:
    """ns per ``call()`` in thread CPU time, the minimum of 15 repeats."""
    runs = timeit.repeat(call, number=number, repeat=15, timer=time.thread_time)
    return min(runs) / number * 1e9


class DictLookup:
    """vLLM's writer lookup: a method doing ``key in self.key_index``."""

    def __init__(self, key: str) -> None:
        self.key_index = {key: (0, 0)}

    def is_cached(self, key: str) -> bool:
        return key in self.key_index


def hits_ns(sender: ShmSenderCache, reader: ShmReceiverCache, number: int) -> float:
    """ns per writer hit (touch + update) with ``reader`` attached, the minimum of 15 repeats
    of ``number`` hits, the handles read after each repeat (untimed)."""
    best = float("inf")
    for _ in range(15):
        handles = []
        start = time.thread_time()
        for _ in range(number):
            sender.touch_sender_cache_item("h")
            handles.append(sender.get_and_update_item(None, "h")[0])
        best = min(best, time.thread_time() - start)
        for handle in handles:
            reader.get_and_update_item(handle, "h")
    return best / number * 1e9


def run_calls(number: int = 20_000) -> dict[str, float]:
    """ns per call of the hot paths: a pure query, a writer hit (touch, then update with
    ``None``) and a receiver hit, in ``lru`` and ``shm`` mode."""
    item = {"x": torch.zeros(256, dtype=torch.float32)}
    sender, receiver = SenderCache(1), ReceiverCache(1)
    sender.get_and_update_item((item, UPDATES), "h")
    receiver.get_and_update_item(item, "h")

    def lru_writer_hit() -> None:
        sender.touch_sender_cache_item("h")
        sender.get_and_update_item(None, "h")

    index = DictLookup("h")
    rows = {
        "dict lookup in a method (vLLM's is_cached)": call_ns(lambda: index.is_cached("h"), number),
        "lru is_cached_item": call_ns(lambda: sender.is_cached_item("h"), number),
        "lru writer hit (touch + update)": call_ns(lru_writer_hit, number),
        "lru receiver hit": call_ns(lambda: receiver.get_and_update_item(None, "h"), number),
    }
    with (
        ShmSenderCache(0.01, max_writers=2) as shm,
        ShmSenderCache.join(shm.writer_handle()) as other,
        ShmReceiverCache(shm.handle()) as worker,
    ):
        shm.get_and_update_item((item, UPDATES), "h")
        n = number // 10  # each issued handle is read once: keep the unread ones few
        handles = iter([shm.get_and_update_item(None, "h")[0] for _ in range(15 * n)])

        def shm_writer_hit() -> None:
            shm.touch_sender_cache_item("h")
            worker.get_and_update_item(shm.get_and_update_item(None, "h")[0], "h")

        def shm_foreign_hit() -> None:  # a hit on the item another writer put
            other.touch_sender_cache_item("h")
            worker.get_and_update_item(other.get_and_update_item(None, "h")[0], "h")

        rows["shm is_cached_item"] = call_ns(lambda: shm.is_cached_item("h"), number)
        resolve = call_ns(lambda: worker.get_and_update_item(next(handles), "h"), n)
        rows["shm writer hit (touch + update)"] = call_ns(shm_writer_hit, n) - resolve
        rows["shm writer hit, timed alone (reads after)"] = hits_ns(shm, worker, n)
        shm_foreign_hit()  # the first one reads the prompt updates from the ring
        rows["shm other writer's item hit (touch + update)"] = call_ns(shm_foreign_hit, n) - resolve
        rows["shm receiver hit (resolve, copy)"] = resolve
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    rows = run(args.iterations)
    baseline = rows[0]["total"]
    mb = torch.empty(SHAPE).nbytes / 1e6
    print(f"item: float32 {SHAPE} ({mb:.1f} MB); median µs per item over {args.iterations} runs")
    print(f"{'case':<54} {'P0':>9} {'P1/worker':>10} {'total':>9} {'speedup':>9}")
    for row in rows:
        p0 = "" if row["p0"] is None else f"{row['p0']:.1f}"
        p1 = "" if row["p1"] is None else f"{row['p1']:.1f}"
        ratio = baseline / row["total"]
        print(f"{row['case']:<54} {p0:>9} {p1:>10} {row['total']:>9.1f} {ratio:>8.1f}x")
    print(f"\n{'hot path, 1 KiB item':<54} {'ns/call':>9}")
    for case, ns in run_calls().items():
        print(f"{case:<54} {ns:>9.0f}")


if __name__ == "__main__":
    main()
