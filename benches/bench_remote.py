"""The remote tier over loopback against real servers: get / put throughput of one item by
size, and the round trips of a request's ``contains``.

A fresh ``valkey-server`` (and, where Mooncake's libraries are present, a ``mooncake_master``
with a writer and a reader client in this process) is started on free loopback ports.  For
each size an item of one float32 tensor is put once, then fetched ``--iterations`` times with
``RemoteStore.get`` - the whole path: fetch, verify the keyed BLAKE3 digest, decode - and the
median is reported with the payload bytes per second.  ``contains`` of 16 keys counts the
commands redis-py sends to the server in one call (socket writes).  Baselines, timed
interleaved with the get (one of each per round): a plain redis-py ``GET`` of a raw value of
the same size on the same Valkey server, and a numpy copy of the same size into a new array
(its allocation and first-touch page faults included, as a get's decode has them).  The load
average is printed with the table: on a small machine it moves the figures more than anything.

Run: ``python benches/bench_remote.py [--iterations N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis

from mmcache import content_hash
from mmcache.remote import RemoteStore
from mmcache.remote.local_server import (
    LocalServer,
    ServerUnavailable,
    start_mooncake_master,
    start_valkey,
)

MiB = 1 << 20
SIZES = (64 << 10, 1 * MiB, 4 * MiB, 16 * MiB)


def _median_s(call: Callable[[], object], iterations: int) -> float:
    return _interleaved_medians_s({"call": call}, iterations)["call"]


def _interleaved_medians_s(
    calls: dict[str, Callable[[], object]], iterations: int
) -> dict[str, float]:
    """The median time of each call, timed in rounds of one call of each (so a change of load
    during the run moves them all alike)."""
    for call in calls.values():
        call()  # warm: connections, buffers
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iterations):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _item(size: int) -> dict[str, Any]:
    return {"pixel_values": np.random.default_rng(size).random(size // 4, dtype=np.float32)}


def bench_store(
    name: str, store: RemoteStore, iterations: int, raw: redis.Redis | None = None
) -> list[dict[str, Any]]:
    """Get / put of one item by size; with ``raw`` (a client of the same Redis/Valkey server),
    a plain ``GET`` of a raw value of each size too."""
    rows = []
    for size in SIZES:
        item = _item(size)
        key = content_hash(name, size)
        put_s = _median_s(
            lambda item=item: store.put(content_hash(time.perf_counter_ns()), item), 5
        )
        store.put(key, item)
        got = store.get(key)
        if got is None or not np.array_equal(got["pixel_values"], item["pixel_values"]):
            raise RuntimeError(f"{name}: the {size}-byte item did not come back intact")
        src = np.ones(size, np.uint8)
        calls: dict[str, Callable[[], object]] = {
            "get": lambda key=key: store.get(key),
            "memcpy": lambda src=src: np.copyto(np.empty_like(src), src),
        }
        if raw is not None:
            raw_key = f"bench/raw/{size}"
            raw.set(raw_key, np.random.default_rng(size).bytes(size))
            calls["raw_get"] = lambda raw_key=raw_key: raw.get(raw_key)
        medians = _interleaved_medians_s(calls, iterations)
        row = {
            "backend": name,
            "size": size,
            "get_ms": medians["get"] * 1e3,
            "get_gb_per_s": size / medians["get"] / 1e9,
            "put_ms": put_s * 1e3,
            "memcpy_ms": medians["memcpy"] * 1e3,
        }
        if "raw_get" in medians:
            row["raw_get_ms"] = medians["raw_get"] * 1e3
            row["raw_get_gb_per_s"] = size / medians["raw_get"] / 1e9
        rows.append(row)
    return rows


def contains_round_trips(store: RemoteStore) -> int:
    """Commands sent to the server by one ``contains`` of 16 keys (one pipeline = one)."""
    sends = 0
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        nonlocal sends
        sends += 1
        real(self, command, check_health)

    keys = [content_hash("contains", i) for i in range(16)]
    store.contains(keys)
    redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        store.contains(keys)
    finally:
        redis.connection.AbstractConnection.send_packed_command = real  # type: ignore[method-assign]
    return sends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    with start_valkey() as valkey:
        store = RemoteStore(valkey.url, namespace="bench@1", secret="bench", timeout_s=5)
        with redis.Redis.from_url(valkey.url) as raw:
            rows += bench_store("valkey", store, args.iterations, raw)
        trips = contains_round_trips(store)
        store.close()
    master: LocalServer | None = None
    try:
        master = start_mooncake_master()
        with RemoteStore(
            master.url + "&segment_mb=512", namespace="bench@1", secret="bench", timeout_s=5
        ) as mc:
            rows += bench_store("mooncake", mc, args.iterations)
    except (ServerUnavailable, ImportError) as exc:
        print(f"mooncake: skipped ({exc})")
    finally:
        if master is not None:
            master.close()
    load = (load_before, os.getloadavg()[0])
    print(
        f"{'backend':9} {'size':>9} {'get':>10} {'GB/s':>6} {'raw GET':>10} {'GB/s':>6}"
        f" {'put':>10} {'memcpy':>9}"
    )
    for r in rows:
        raw_get = (
            f"{r['raw_get_ms']:8.2f}ms {r['raw_get_gb_per_s']:6.2f}" if "raw_get_ms" in r else ""
        )
        print(
            f"{r['backend']:9} {r['size'] / MiB:8.3g}M {r['get_ms']:8.2f}ms"
            f" {r['get_gb_per_s']:6.2f} {raw_get:>17} {r['put_ms']:8.2f}ms"
            f" {r['memcpy_ms']:7.3f}ms"
        )
    print(f"contains of 16 keys: {trips} round trip(s) to the server")
    print(f"load average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"rows": rows, "contains_round_trips": trips, "load_average": load}, indent=2
            )
        )


if __name__ == "__main__":
    main()
