"""P1, the engine core, and the workers.

P1 resolves each request's features with its :class:`~mmcache.ReceiverCache` (``lru`` mode)
and forwards their tensors to every worker; without a cache of its own (``none``,
``processor_only``, ``shm``: handles) it passes each message on as it came. A miss
goes back to P0. Each worker resolves handles with its own
:class:`~mmcache.ShmReceiverCache` (``shm``: zero-copy views of the ring), checks every
tensor against the digest P0 recorded for its hash, and reports to P0.

With several frontends P1 serves them all (each message tagged with its frontend's index)
and every worker answers the frontend that sent the request. An item a frontend served from
another frontend's work comes without a truth: the worker records the digests it received,
per image, and the driver checks them against what that other frontend processed.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from mmcache import CacheMissError, ReceiverCache, ShmReceiverCache, _core
from mmcache.simulate import wire
from mmcache.simulate.config import SimulationError
from mmcache.simulate.workload import tensor_digests


def engine_core_main(frontends: list[Connection], workers: list[Connection]) -> None:
    """P1's process: resolve each request's features with the ``lru`` receiver cache (if any)
    and forward them to every worker; report misses to the P0 that sent the request."""
    with wire.exit_when_peer_gone():
        _engine_core(frontends, workers)


def _setup(frontends: list[Connection], workers: list[Connection]) -> Any:
    """Take the downstream cache from frontend 0 (it made the cache); in ``shm`` mode with
    several frontends, hand the others its writer handle so they join its store, and wait
    until each has. Returns the downstream cache (pickled as P0 sent it)."""
    setup, _ = wire.recv(frontends[0])
    writer = setup.get("writer")
    for frontend in frontends[1:]:
        if writer is not None:
            wire.send(frontend, {"type": "join", "writer": writer})
        joined, _ = wire.recv(frontend)
        if joined["type"] != "setup":
            raise SimulationError(f"expected a setup message, got {joined['type']!r}")
    return setup["downstream"]


def _engine_core(frontends: list[Connection], workers: list[Connection]) -> None:
    # What P1 sends on behalf of each frontend's requests, to report to that frontend.
    traffic = [wire.Traffic() for _ in frontends]
    pickled = _setup(frontends, workers)
    downstream = pickle.loads(pickled)
    receiver = downstream if isinstance(downstream, ReceiverCache) else None
    reader = pickled if isinstance(downstream, _core.ReaderHandle) else None
    for worker in workers:
        wire.send(worker, {"type": "setup", "reader": reader}, traffic=traffic[0])
    for k, frontend in enumerate(frontends):
        wire.send(frontend, {"type": "ready"}, traffic=traffic[k])
    index = {conn: k for k, conn in enumerate(frontends)}
    while index:
        for ready in wait(list(index)):
            conn = cast(Connection, ready)
            k = index[conn]
            header, buffers = wire.recv(conn)
            header["frontend"] = k
            if header["type"] == "stop":  # that frontend's figures; the others go on
                for worker in workers:
                    wire.send(worker, header, traffic=traffic[k])
                totals = {"bytes": traffic[k].total, "payload_bytes": traffic[k].payload_bytes}
                wire.send(conn, {"type": "stats", **totals})
                del index[conn]
            else:
                _forward(header, buffers, receiver, conn, workers, traffic[k])


def _forward(
    header: dict[str, Any],
    buffers: list[bytes],
    receiver: ReceiverCache | None,
    frontend: Connection,
    workers: list[Connection],
    traffic: wire.Traffic,
) -> None:
    """Resolve one request (``lru``) and send it to every worker, or report its miss."""
    if receiver is None:
        # Nothing to resolve here (no cache, or handles for the workers): pass the
        # message on as it came.
        for worker in workers:
            wire.send(worker, header, [memoryview(b) for b in buffers], traffic=traffic)
        return
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
        return
    out: list[memoryview] = []
    header["features"] = [wire.encode_feature(f, out) for f in features]
    for worker in workers:
        wire.send(worker, header, out, traffic=traffic)


# --------------------------------------------------------------------------------------------
# The workers


@dataclass
class _Tally:
    """What a worker counts for one frontend."""

    traffic: wire.Traffic = field(default_factory=wire.Traffic)
    checked: int = 0
    wrong: int = 0
    # (image, digests) -> times received, for items whose truth the frontend did not have
    # (another frontend processed them): the driver checks these against that frontend's.
    deferred: Counter[tuple[int, tuple[tuple[str, bytes], ...]]] = field(default_factory=Counter)

    def stats(self) -> dict[str, Any]:
        return {
            "type": "stats",
            "bytes": self.traffic.total,
            "checked": self.checked,
            "wrong": self.wrong,
            "deferred": [[image, list(d), n] for (image, d), n in self.deferred.items()],
        }


def worker_main(rank: int, inbox: Connection, outboxes: list[Connection]) -> None:
    """A worker's process: resolve handles with its own ring reader (``shm``), verify every
    tensor against P0's digest, and report to the P0 (one of ``outboxes``) that sent it."""
    with wire.exit_when_peer_gone():
        _worker(rank, inbox, outboxes)


def _worker(rank: int, inbox: Connection, outboxes: list[Connection]) -> None:
    tallies = [_Tally() for _ in outboxes]
    setup, _ = wire.recv(inbox)
    reader = setup["reader"]
    try:
        receiver = (
            ShmReceiverCache(pickle.loads(reader), copy=False) if reader is not None else None
        )
    except FileNotFoundError:  # P0 died before this worker attached, and its ring is gone
        raise SystemExit(wire.PEER_GONE) from None
    running = set(range(len(outboxes)))
    try:
        for outbox, tally in zip(outboxes, tallies, strict=True):
            wire.send(outbox, {"type": "ready", "rank": rank}, traffic=tally.traffic)
        while running:
            header, buffers = wire.recv(inbox)
            k = header.get("frontend", 0)
            if header["type"] == "stop":
                wire.send(outboxes[k], tallies[k].stats())
                running.discard(k)
                continue
            reply = _serve(header, buffers, receiver, tallies[k].deferred)
            tallies[k].checked += reply["checked"]
            tallies[k].wrong += reply["wrong"]
            wire.send(outboxes[k], reply, traffic=tallies[k].traffic)
    finally:
        if receiver is not None:
            receiver.close()


def _serve(
    header: dict[str, Any],
    buffers: list[bytes],
    receiver: ShmReceiverCache | None,
    deferred: Counter[tuple[int, tuple[tuple[str, bytes], ...]]],
) -> dict[str, Any]:
    """Resolve and verify one request's features (those without a truth: their digests go
    to ``deferred``). Zero-copy views of shared memory die on return, which lets their
    objects be reclaimed."""
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
        truth = feature.extra["digests"]
        data = feature.data if isinstance(feature.data, Mapping) else {}
        if truth is None:
            received = tensor_digests(data)
            deferred[feature.extra["image"], tuple(sorted(received.items()))] += 1
            checked += len(received)
            continue
        # Every tensor P0 produced and every tensor received: one missing on either side
        # is wrong (a received tensor P0 never produced would otherwise pass unverified).
        for name in {**truth, **data}:
            checked += 1
            value, expected = data.get(name), truth.get(name)
            if value is None or expected is None or tensor_digests({name: value})[name] != expected:
                wrong += 1
    return {
        "type": "done",
        "rid": header["rid"],
        "attempt": header["attempt"],
        "missing": missing,
        "checked": checked,
        "wrong": wrong,
    }
