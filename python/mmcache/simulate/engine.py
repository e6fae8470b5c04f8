"""P1, the engine core, and the workers.

P1 resolves each request's features with its :class:`~mmcache.ReceiverCache` (``lru`` mode)
and forwards their tensors to every worker; without a cache of its own (``none``,
``processor_only``, ``shm``: handles) it passes each message on as it came. A miss
goes back to P0. Each worker resolves handles with its own
:class:`~mmcache.ShmReceiverCache` (``shm``: zero-copy views of the ring), checks every
tensor against the digest P0 recorded for its hash, and reports to P0.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

from mmcache import CacheMissError, ReceiverCache, ShmReceiverCache, WriterGoneError, _core
from mmcache.simulate import wire
from mmcache.simulate.workload import tensor_digests


@contextlib.contextmanager
def _quiet_when_peer_exits() -> Iterator[None]:
    """Exit with status 1, without a traceback, when a peer process went away (P0 stopped
    on Ctrl-C, or failed: its own traceback says why; the driver names a P0 that was
    killed): a pipe closed, or P0's ring reports its writer gone."""
    try:
        yield
    except (EOFError, BrokenPipeError, ConnectionResetError, WriterGoneError):
        raise SystemExit(1) from None


def engine_core_main(frontend: Connection, workers: list[Connection]) -> None:
    """P1's process: resolve each request's features with the ``lru`` receiver cache (if any)
    and forward them to every worker; report misses to P0."""
    with _quiet_when_peer_exits():
        _engine_core(frontend, workers)


def _engine_core(frontend: Connection, workers: list[Connection]) -> None:
    traffic = wire.Traffic()
    setup, _ = wire.recv(frontend)
    downstream = pickle.loads(setup["downstream"])
    receiver = downstream if isinstance(downstream, ReceiverCache) else None
    reader = setup["downstream"] if isinstance(downstream, _core.ReaderHandle) else None
    for worker in workers:
        wire.send(worker, {"type": "setup", "reader": reader}, traffic=traffic)
    wire.send(frontend, {"type": "ready"}, traffic=traffic)
    while True:
        header, buffers = wire.recv(frontend)
        if header["type"] == "stop":
            for worker in workers:
                wire.send(worker, header, traffic=traffic)
            totals = {"bytes": traffic.total, "payload_bytes": traffic.payload_bytes}
            wire.send(frontend, {"type": "stats", **totals})
            return
        if receiver is None:
            # Nothing to resolve here (no cache, or handles for the workers): pass the
            # message on as it came.
            for worker in workers:
                wire.send(worker, header, [memoryview(b) for b in buffers], traffic=traffic)
            continue
        features = [wire.decode_feature(entry, buffers) for entry in header["features"]]
        try:
            receiver.get_and_update_features(features)
        except CacheMissError as miss:
            reply = {
                "type": "miss",
                "rid": header["rid"],
                "attempt": header["attempt"],
                "missing": miss.mm_hashes,
            }
            wire.send(frontend, reply, traffic=traffic)
            continue
        out: list[memoryview] = []
        header["features"] = [wire.encode_feature(f, out) for f in features]
        for worker in workers:
            wire.send(worker, header, out, traffic=traffic)


# --------------------------------------------------------------------------------------------
# The workers


def worker_main(rank: int, inbox: Connection, outbox: Connection) -> None:
    """A worker's process: resolve handles with its own ring reader (``shm``), verify every
    tensor against P0's digest, and report to P0."""
    with _quiet_when_peer_exits():
        _worker(rank, inbox, outbox)


def _worker(rank: int, inbox: Connection, outbox: Connection) -> None:
    traffic = wire.Traffic()
    setup, _ = wire.recv(inbox)
    reader = setup["reader"]
    try:
        receiver = (
            ShmReceiverCache(pickle.loads(reader), copy=False) if reader is not None else None
        )
    except FileNotFoundError:  # P0 died before this worker attached, and its ring is gone
        raise SystemExit(1) from None
    checked = wrong = 0
    try:
        wire.send(outbox, {"type": "ready", "rank": rank}, traffic=traffic)
        while True:
            header, buffers = wire.recv(inbox)
            if header["type"] == "stop":
                wire.send(
                    outbox,
                    {"type": "stats", "bytes": traffic.total, "checked": checked, "wrong": wrong},
                )
                return
            reply = _serve(header, buffers, receiver)
            checked += reply["checked"]
            wrong += reply["wrong"]
            wire.send(outbox, reply, traffic=traffic)
    finally:
        if receiver is not None:
            receiver.close()


def _serve(
    header: dict[str, Any], buffers: list[bytes], receiver: ShmReceiverCache | None
) -> dict[str, Any]:
    """Resolve and verify one request's features. Zero-copy views of shared memory die on
    return, which lets their objects be reclaimed."""
    features = [wire.decode_feature(entry, buffers) for entry in header["features"]]
    missing: list[str] = []
    if receiver is not None:
        try:
            receiver.get_and_update_features(features)
        except CacheMissError as miss:
            missing = miss.mm_hashes
    checked = wrong = 0
    for feature in features:
        if feature.mm_hash in missing:
            continue
        for name, expected in feature.extra["digests"].items():
            checked += 1
            value = feature.data.get(name) if isinstance(feature.data, Mapping) else None
            if value is None or tensor_digests({name: value})[name] != expected:
                wrong += 1
    return {
        "type": "done",
        "rid": header["rid"],
        "attempt": header["attempt"],
        "missing": missing,
        "checked": checked,
        "wrong": wrong,
    }
