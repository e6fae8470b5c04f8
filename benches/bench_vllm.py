"""mmcache against vLLM 0.33's shared-memory store, on the same items, interleaved.

Three columns: vLLM's ``SingleWriterShmObjectStorage`` with its default ``MsgpackSerde``;
mmcache's core (``ShmObjectStore`` moving the same payload as raw parts, no codec); and
mmcache's cache API (``ShmSenderCache`` / ``ShmReceiverCache``: what an engine calls, codec
included). Every figure is measured in several rounds, the systems taking turns within each
round, and the median over rounds is reported, with the machine's load average.

The item is three float32 tensors (1/4, 1/2 and 1/4 of its bytes; vLLM gets them as a
``MultiModalKwargsItem`` of three batched fields): 4 KiB for the table of the issue, and
1 MiB, compared with a memcpy of the same bytes. Timed sections run with the cyclic garbage
collector off, as ``timeit`` does, in P0 and in the worker alike.

Needs vLLM 0.33 importable next to mmcache: ``make bench-vllm`` runs it in the ``.venv-vllm``
that ``make test-vllm`` builds. By hand, install vLLM alone plus what its store and serde
import, e.g. into a scratch virtualenv that also sees mmcache's:

    pip install vllm==0.33.0 --no-deps
    pip install psutil pyzmq urllib3 regex pydantic cbor2 "transformers>=5.16.1,<5.21" \\
        aiohttp requests openai openai-harmony pybase64 cloudpickle msgspec uvloop py-cpuinfo

Run: ``python benches/bench_vllm.py [--rounds N] [--json PATH]`` (about two minutes).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import multiprocessing as mp
import os
import statistics
import time
import timeit
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    import vllm
    import vllm.v1.serial_utils
    from vllm.distributed.device_communicators.shm_object_storage import (
        MsgpackSerde,
        SingleWriterShmObjectStorage,
        SingleWriterShmRingBuffer,
    )
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )
except ImportError as exc:  # pragma: no cover - the message is the point
    raise SystemExit(
        f"this benchmark needs vLLM 0.33 importable ({exc}); see the module docstring:\n"
        "  pip install vllm==0.33.0 --no-deps  (plus the few modules its store imports)"
    ) from exc

from mmcache import ShmReceiverCache, ShmSenderCache, serde
from mmcache._core import ShmObjectStore
from mmcache.bench import three_tensor_item

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
E2E_RING = 16 * MiB  # the end-to-end runs keep two batches of 4 KiB items in flight
SYSTEMS = ("vllm", "core", "cache")
BATCH = 64  # items per message in the end-to-end runs


def vllm_item(fields: dict[str, torch.Tensor]) -> MultiModalKwargsItem:
    return MultiModalKwargsItem(
        {k: MultiModalFieldElem(data=v, field=MultiModalBatchedField()) for k, v in fields.items()}
    )


def ring_for(nbytes: int, objects: int) -> int:
    """A ring for ``objects`` items of ``nbytes`` (as ``mmcache bench`` sizes its own): every
    system gets the same, small enough that a put's destination is as warm as ``mmcache
    bench``'s."""
    return objects * (nbytes + 64 * KiB) + MiB


def quiet_vllm() -> None:
    """vLLM pins decoded tensors when its platform claims pinned memory; without a GPU that
    fails, and mmcache's copies are unpinned by default: compare like with like."""
    vllm.v1.serial_utils.PIN_MEMORY = False


# ------------------------------------------------------------------------------------------
# The three systems, as (writer, reader, put, resolve, hit, lookup)
# ------------------------------------------------------------------------------------------


class Vllm:
    def __init__(self, n_readers: int, lock: Any, ring: int) -> None:
        quiet_vllm()
        self.ring = SingleWriterShmRingBuffer(ring, create=True)
        self.writer = SingleWriterShmObjectStorage(2 * MiB, n_readers, self.ring, MsgpackSerde)
        self.lock = lock

    def reader_handle(self) -> Any:
        handle = self.writer.handle()
        handle.reader_lock = self.lock
        return handle

    def put(self, key: str, item: Any) -> tuple[int, int, list[int], str]:
        address, monotonic_id = self.writer.put(key, item)
        return address, monotonic_id, self.writer.get_signature(key), key

    def close(self) -> None:
        self.ring.close()


def vllm_reader(handle: Any) -> Callable[[Any], Any]:
    quiet_vllm()
    reader = SingleWriterShmObjectStorage.create_from_handle(handle)
    return lambda h: reader.get(*h)


def core_reader(handle: Any) -> Callable[[Any], Any]:
    reader = ShmObjectStore.attach(handle)
    return lambda h: reader.resolve(h[0], h[1])


def cache_reader(handle: Any, copy: bool = True) -> Callable[[Any], Any]:
    receiver = ShmReceiverCache(handle, copy=copy)
    return lambda h: receiver.get_and_update_item(h[0], h[1])


READERS: dict[str, Callable[[Any], Callable[[Any], Any]]] = {
    "vllm": vllm_reader,
    "core": core_reader,
    "cache": cache_reader,
}


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------


def per_op(op: Callable[[], object], n: int) -> float:
    """Seconds per call of ``op`` over ``n`` calls, each result dropped at once (as a caller
    that uses it and moves on), with the cyclic garbage collector off as ``timeit`` has it:
    one full collection of a heap holding torch costs tens of milliseconds, a lottery that
    would swamp microsecond operations."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(n):
            op()
        return (time.perf_counter() - start) / n
    finally:
        gc.enable()


def micro(stmt: str, env: dict[str, Any], n: int) -> float:
    """Seconds per execution of a tiny statement (best of 5 loops of ``n``)."""
    return min(timeit.Timer(stmt, globals=env).repeat(5, n)) / n


def fresh_keys(prefix: str) -> Iterator[str]:
    return (f"{prefix}-{i}" for i in itertools.count())


def same_item(got: Any, fields: dict[str, torch.Tensor], system: str) -> None:
    """Raise unless ``got`` (vLLM's item, the core's payload or the cache API's item) holds
    ``fields``' tensors: checked once per figure, off the clock, so a read that returns the
    wrong bytes cannot look fast."""
    if isinstance(got, MultiModalKwargsItem):
        got = {name: elem.data for name, elem in got.items()}
    elif not isinstance(got, dict):
        got = serde.decode(got)
    if got.keys() != fields.keys() or not all(torch.equal(got[k], v) for k, v in fields.items()):
        raise RuntimeError(f"{system}: the item read back differs from the one written")


def bench_puts(nbytes: int, n: int, lock: Any) -> dict[str, float]:
    """P0 inserts ``n`` new items (no reader attached: the rings recycle freely). Each put is
    what a P0 miss costs up to its handle: vLLM's sender cache signs it after the put, as
    mmcache's put does."""
    fields = three_tensor_item(nbytes, 0)
    item, updates = vllm_item(fields), ["<image>"]
    header, buffers = serde.encode(fields)
    parts = [header, *buffers]
    out = {}
    ring = ring_for(nbytes, 8)
    v = Vllm(0, lock, ring)  # no reader to wait for, as for mmcache's unattached rings
    keys = fresh_keys("v")
    out["vllm"] = per_op(lambda: v.put(next(keys), item), n)
    v.close()
    with ShmObjectStore.create(ring, max_object_size=2 * MiB) as store:
        keys = fresh_keys("c")
        out["core"] = per_op(lambda: store.put(next(keys), parts), n)
    with ShmSenderCache(ring / GiB, max_object_size_mb=2) as sender:
        keys = fresh_keys("a")
        out["cache"] = per_op(lambda: sender.get_and_update_item((fields, updates), next(keys)), n)
    return out


def bench_resolves(nbytes: int, n: int, lock: Any) -> dict[str, float]:
    """A worker resolves ``n`` handles of one stored item (in this process, copying)."""
    fields = three_tensor_item(nbytes, 1)
    out = {}
    ring = ring_for(nbytes, 2)
    v = Vllm(1, lock, ring)
    handle = v.put("x", vllm_item(fields))
    read = vllm_reader(v.reader_handle())
    out["vllm"] = per_op(lambda: read(handle), n)
    same_item(read(handle), fields, "vllm")
    v.close()
    header, buffers = serde.encode(fields)
    with ShmObjectStore.create(ring, max_object_size=2 * MiB) as store:
        read = core_reader(store.handle())
        store.put("x", [header, *buffers])
        handles = iter([(store.issue("x"), "x") for _ in range(n)])
        out["core"] = per_op(lambda: read(next(handles)), n)
        same_item(read((store.issue("x"), "x")), fields, "core")
    for copy in (True, False):
        with ShmSenderCache(ring / GiB, max_object_size_mb=2) as sender:
            read = cache_reader(sender.handle(), copy)
            sender.get_and_update_item((fields, None), "x")
            issued = iter([(sender.get_and_update_item(None, "x")[0], "x") for _ in range(n)])
            # per_op calls the lambda before it returns, in this iteration (B023).
            label = "cache" if copy else "cache zero-copy"
            out[label] = per_op(lambda: read(next(issued)), n)  # noqa: B023
            same_item(read((sender.get_and_update_item(None, "x")[0], "x")), fields, label)
    return out


def bench_hits_and_lookups(lock: Any) -> dict[str, float]:
    """P0's hit (touch, then update with no data) and its pure lookup, of a present key."""
    fields = three_tensor_item(4 * KiB, 2)
    header, buffers = serde.encode(fields)
    out = {}
    ring = ring_for(4 * KiB, 2)
    v = Vllm(1, lock, ring)
    v.put("x", vllm_item(fields))
    w = v.writer
    # A hit as vLLM's sender cache does it: touch, then (get_and_update_item) look the key
    # up, take a reference, sign the handle.
    out["hit vllm"] = micro(
        "t(k); i(k); g(k); s(k)",
        {"t": w.touch, "i": w.is_cached, "g": w.get_cached, "s": w.get_signature, "k": "x"},
        5000,
    )
    out["lookup vllm"] = micro("f(k)", {"f": w.is_cached, "k": "x"}, 50000)
    v.close()
    with ShmObjectStore.create(ring) as store:
        store.put("x", [header, *buffers])
        out["hit core"] = micro(
            "p(k); g(k); u(k)",
            {"p": store.pin, "g": store.issue, "u": store.unpin, "k": "x"},
            20000,
        )
        out["lookup core"] = micro("f(k)", {"f": store.is_cached, "k": "x"}, 50000)
    with ShmSenderCache(ring / GiB) as sender:
        sender.get_and_update_item((fields, None), "x")
        out["hit cache"] = micro(
            "t(k); g(None, k)",
            {"t": sender.touch_sender_cache_item, "g": sender.get_and_update_item, "k": "x"},
            20000,
        )
        out["lookup cache"] = micro("f(k)", {"f": sender.is_cached_item, "k": "x"}, 50000)
    return out


def bench_create(nbytes: int, n: int) -> dict[str, float]:
    """Median seconds to create a writer over a new ring of ``nbytes`` (vLLM: its ring and its
    object store; mmcache: ``ShmObjectStore.create``, ring and key index) and to close it.
    The systems alternate; a pause after each close lets the previous ring's memory go (and
    mmcache's background reservation stop), so no creation pays for another's teardown."""
    times: dict[str, list[float]] = {"vllm": [], "core": []}
    for _ in range(n):
        for system, samples in times.items():
            gc.collect()
            time.sleep(0.3)
            start = time.perf_counter()
            if system == "vllm":
                ring = SingleWriterShmRingBuffer(nbytes, create=True)
                SingleWriterShmObjectStorage(2 * MiB, 1, ring, MsgpackSerde)
                samples.append(time.perf_counter() - start)
                ring.close()
            else:
                store = ShmObjectStore.create(nbytes, n_readers=1)
                samples.append(time.perf_counter() - start)
                store.close()
    return {system: statistics.median(t) for system, t in times.items()}


def bench_memcpy(nbytes: int, n: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return per_op(lambda: np.copyto(dst, src), n)


# ------------------------------------------------------------------------------------------
# End to end: P0 here, one worker process
# ------------------------------------------------------------------------------------------


def _worker(system: str, handle: Any, conn: Connection) -> None:
    """Resolve every batch of handles received; report each batch done."""
    read = READERS[system](handle)
    gc.collect()
    gc.disable()  # as on P0's side: see per_op (nothing here makes reference cycles)
    conn.send("ready")
    while (batch := conn.recv()) is not None:
        for h in batch:
            read(h)
        conn.send(len(batch))


class EndToEnd:
    """P0 (this process) puts batches of new items and sends their handles to one worker,
    which resolves them; two batches in flight, so both sides work at once."""

    def __init__(self, nbytes: int, lock: Any) -> None:
        self.fields = three_tensor_item(nbytes, 3)
        self.vllm_item = vllm_item(self.fields)
        header, buffers = serde.encode(self.fields)
        self.parts = [header, *buffers]
        self.vllm = Vllm(1, lock, E2E_RING)
        self.store = ShmObjectStore.create(E2E_RING, max_object_size=2 * MiB)
        self.sender = ShmSenderCache(E2E_RING / GiB, max_object_size_mb=2)
        keys = {s: fresh_keys(s) for s in SYSTEMS}
        self.put: dict[str, Callable[[], Any]] = {
            "vllm": lambda: self.vllm.put(next(keys["vllm"]), self.vllm_item),
            "core": lambda: self._core_put(next(keys["core"])),
            "cache": lambda: self._cache_put(next(keys["cache"])),
        }
        handles = {
            "vllm": self.vllm.reader_handle(),
            "core": self.store.handle(),
            "cache": self.sender.handle(),
        }
        ctx = mp.get_context("spawn")
        self.conns: dict[str, Connection] = {}
        self.procs = []
        for system in SYSTEMS:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(system, handles[system], theirs), daemon=True)
            proc.start()
            self.conns[system] = mine
            self.procs.append(proc)
        for conn in self.conns.values():
            conn.recv()  # attached before anything is written

    def _core_put(self, key: str) -> Any:
        return self.store.put(key, self.parts), key

    def _cache_put(self, key: str) -> Any:
        return self.sender.get_and_update_item((self.fields, None), key)[0], key

    def items_per_s(self, system: str, batches: int) -> float:
        conn, put = self.conns[system], self.put[system]
        in_flight = 0
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        for _ in range(batches):
            conn.send([put() for _ in range(BATCH)])
            in_flight += 1
            if in_flight == 2:
                conn.recv()
                in_flight -= 1
        while in_flight:
            conn.recv()
            in_flight -= 1
        elapsed = time.perf_counter() - start
        gc.enable()
        return batches * BATCH / elapsed

    def close(self) -> None:
        for conn in self.conns.values():
            conn.send(None)
        for proc in self.procs:
            proc.join(10)
        self.vllm.close()
        self.store.close()
        self.sender.close()


# ------------------------------------------------------------------------------------------


def run(rounds: int, only_create: bool = False) -> dict[str, Any]:
    lock = mp.get_context("spawn").Lock()
    samples: dict[str, list[float]] = {}

    def add(prefix: str, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            samples.setdefault(f"{prefix} {name}".strip(), []).append(value)

    if only_create:
        for _ in range(rounds):
            add("create 4GiB", bench_create(4 * GiB, 3))
        return {name: statistics.median(values) for name, values in samples.items()}

    e2e = EndToEnd(4 * KiB, lock)
    try:
        for _ in range(rounds):
            add("put 4KiB", bench_puts(4 * KiB, 2000, lock))
            add("resolve 4KiB", bench_resolves(4 * KiB, 2000, lock))
            add("", bench_hits_and_lookups(lock))
            for system in SYSTEMS:
                add("e2e 4KiB", {system: e2e.items_per_s(system, 40)})
            add("memcpy", {"1MiB": bench_memcpy(MiB, 200)})
            add("put 1MiB", bench_puts(MiB, 40, lock))
            add("resolve 1MiB", bench_resolves(MiB, 40, lock))
            add("create 4GiB", bench_create(4 * GiB, 3))
    finally:
        e2e.close()
    return {name: statistics.median(values) for name, values in samples.items()}


def create_row(m: dict[str, float]) -> str:
    return "| create a 4 GiB ring (writer ready), ms | {:.2f} | {:.2f} ({:.2f}x vLLM) |".format(
        m["create 4GiB vllm"] * 1e3,
        m["create 4GiB core"] * 1e3,
        m["create 4GiB core"] / m["create 4GiB vllm"],
    )


def report(m: dict[str, float], load: tuple[str, str]) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:,.1f}"

    def ns(x: float) -> str:
        return f"{x * 1e9:,.0f}"

    def gbs(seconds: float, nbytes: int) -> str:
        return f"{nbytes / seconds / 1e9:.2f}"

    put = {s: m[f"put 4KiB {s}"] for s in SYSTEMS}
    res = {s: m[f"resolve 4KiB {s}"] for s in SYSTEMS}
    e2e = {s: m[f"e2e 4KiB {s}"] for s in SYSTEMS}
    lines = [
        f"vLLM {vllm.__version__} vs mmcache; torch {torch.__version__}; "
        f"median of rounds; load average {load[0]} (start) / {load[1]} (end)",
        "",
        "| 4 KiB item of 3 tensors | vLLM 0.33 | mmcache core | mmcache cache API |",
        "|---|---|---|---|",
        "| P0 put (GB/s) | {} | {} ({:.1f}x) | {} ({:.1f}x) |".format(
            gbs(put["vllm"], 4 * KiB),
            gbs(put["core"], 4 * KiB),
            put["vllm"] / put["core"],
            gbs(put["cache"], 4 * KiB),
            put["vllm"] / put["cache"],
        ),
        "| worker resolve, copy, µs | {} | {} | {} ({:.1f}x faster; zero-copy {}) |".format(
            us(res["vllm"]),
            us(res["core"]),
            us(res["cache"]),
            res["vllm"] / res["cache"],
            us(m["resolve 4KiB cache zero-copy"]),
        ),
        (
            "| end to end, 1 worker, items/s "
            "| {:,.1f} k | {:,.1f} k ({:.1f}x) | {:,.1f} k ({:.1f}x) |"
        ).format(
            e2e["vllm"] / 1e3,
            e2e["core"] / 1e3,
            e2e["core"] / e2e["vllm"],
            e2e["cache"] / 1e3,
            e2e["cache"] / e2e["vllm"],
        ),
        "| writer hit (touch + get_and_update_item(None)), ns | {} | {} | {} |".format(
            ns(m["hit vllm"]), ns(m["hit core"]), ns(m["hit cache"])
        ),
        "| `is_cached_item`, ns | {} | {} | {} |".format(
            ns(m["lookup vllm"]), ns(m["lookup core"]), ns(m["lookup cache"])
        ),
        "",
        "| 1 MiB item of 3 tensors | µs | x memcpy |",
        "|---|---|---|",
    ]
    memcpy = m["memcpy 1MiB"]
    for name, key in [
        ("memcpy (numpy)", "memcpy 1MiB"),
        ("vLLM put", "put 1MiB vllm"),
        ("core put", "put 1MiB core"),
        ("cache API put (P0 miss)", "put 1MiB cache"),
        ("vLLM get", "resolve 1MiB vllm"),
        ("core get, copy", "resolve 1MiB core"),
        ("cache API resolve, copy=True", "resolve 1MiB cache"),
        ("cache API resolve, zero-copy", "resolve 1MiB cache zero-copy"),
    ]:
        lines.append(f"| {name} | {us(m[key])} | {m[key] / memcpy:.2f} |")
    lines += ["", "| start-up | vLLM 0.33 | mmcache core |", "|---|---|---|", create_row(m)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the medians as JSON")
    parser.add_argument(
        "--only-create", action="store_true", help="only the ring creation row (seconds)"
    )
    args = parser.parse_args()
    start_load = f"{os.getloadavg()[0]:.2f}"
    medians = run(args.rounds, args.only_create)
    end_load = f"{os.getloadavg()[0]:.2f}"
    if args.only_create:
        print(f"median of rounds; load average {start_load} (start) / {end_load} (end)")
        print(create_row(medians))
    else:
        print(report(medians, (start_load, end_load)))
    if args.json:
        args.json.write_text(json.dumps(medians, indent=2) + "\n")


if __name__ == "__main__":
    main()
