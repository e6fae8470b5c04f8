"""P0, the frontend: the cache protocol of an engine's input processor, and the measurements.

For each request P0 hashes every item, asks its cache which are cached, processes only the
others, touches every hash, then updates its cache item by item and sends P1 what the cache
returns: the data, ``None`` (P1 holds it: ``lru``) or a handle (``shm``). When P1 or a worker
reports a :class:`~mmcache.CacheMissError`, P0 invalidates the missing hashes and sends the
request once more: the retry processes them again and carries their data. With
``inject_drift`` P0 loses some requests after updating its cache (as when a request is
rejected before the engine sees it) and resubmits them, so the caches drift apart.

P0 also keeps the truth: the digest of every tensor it produced for each hash, which every
worker checks what it receives against.
"""

from __future__ import annotations

import pickle
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

import numpy as np

from mmcache import Feature, ShmHandle, ShmSenderCache, content_hash, make_caches
from mmcache.caches import BaseSenderCache, SenderOutput
from mmcache.factory import Mode
from mmcache.simulate import wire
from mmcache.simulate.config import (
    ITEM_BYTES,
    RunMetrics,
    SimulationConfig,
    SimulationError,
)
from mmcache.simulate.workload import TARGET_SIDE, load_workload, process, tensor_digests


@dataclass
class _Pending:
    """A request between its first send and its completion."""

    images: list[int]
    hashes: list[str]
    started: float
    attempt: int = 0
    retried: bool = False
    awaiting: set[int] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)


@dataclass
class _Counts:
    """What P0 counts during a run."""

    items: int = 0  # items of completed requests
    lookups: int = 0  # items looked up in P0's cache, every attempt included
    hits: int = 0  # lookups that found the item cached
    processed: int = 0  # items run through the processor
    invalidated: int = 0  # cached hashes invalidated after a receiver missed them
    dropped: int = 0  # attempts lost on purpose (inject_drift)
    retries: int = 0  # attempts resent after a miss
    unrecovered: int = 0  # requests whose one retry missed again
    shm_bytes: int = 0  # tensor bytes written into the ring
    baseline_bytes: int = 0  # tensor bytes mode none sends for the completed requests


class _Frontend:
    """P0: turns the request stream into messages, recovers from misses, measures."""

    def __init__(
        self,
        config: SimulationConfig,
        cache: BaseSenderCache | None,
        engine: Connection,
        results: list[Connection],
        events: Connection,
        workload: Path,
    ) -> None:
        self.config = config
        self.cache = cache
        self.engine = engine
        self.results = results
        self.events = events
        self.requests, self.images = load_workload(workload)
        self.drift = np.random.default_rng([config.seed, 0xD81F7])
        self.truth: dict[str, dict[str, bytes]] = {}
        self.pending: dict[int, _Pending] = {}
        self.latencies: list[float] = []
        self.traffic = wire.Traffic()
        self.counts = _Counts()
        self.processing_s = 0.0

    # The request loop

    def run(self) -> dict[str, Any]:
        """Serve every request, stop the pipeline and return the metrics."""
        for conn in [self.engine, *self.results]:
            header, _ = wire.recv(conn)
            if header["type"] != "ready":
                raise SimulationError(f"expected a ready message, got {header['type']!r}")
        started = time.perf_counter()
        submitted = 0
        while submitted < len(self.requests) or self.pending:
            while submitted < len(self.requests) and len(self.pending) < self.config.inflight:
                self._submit(submitted)
                submitted += 1
            for ready in wait([self.engine, *self.results]):
                self._receive(cast(Connection, ready))
        elapsed = time.perf_counter() - started
        return self._finish(elapsed)

    def _submit(self, rid: int) -> None:
        started = time.perf_counter()
        images = self.requests[rid]
        hashes = [content_hash(self.images[i], size=TARGET_SIDE) for i in images]
        self.pending[rid] = _Pending(images, hashes, started)
        self._send(rid, drift=True)

    def _send(self, rid: int, *, drift: bool) -> None:
        """Assemble and send the next attempt of ``rid``; with ``drift``, possibly lose it
        after P0's cache was updated, and resubmit it (a rejected request)."""
        pending = self.pending[rid]
        while True:
            pending.attempt += 1
            entries, buffers, handles = self._assemble(pending)
            if not (drift and self.drift.random() < self.config.inject_drift):
                break
            self.counts.dropped += 1
            if isinstance(self.cache, ShmSenderCache):
                self.cache.release_handles(handles)
        header = {"type": "request", "rid": rid, "attempt": pending.attempt, "features": entries}
        wire.send(self.engine, header, buffers, traffic=self.traffic)
        pending.awaiting = set(range(self.config.workers))
        pending.missing = []

    def _assemble(
        self, pending: _Pending
    ) -> tuple[list[dict[str, Any]], list[memoryview], list[ShmHandle]]:
        """P0's cache protocol for one request: is_cached, process the misses, touch every
        hash, then update item by item. Returns the message entries, their buffers and the
        handles issued."""
        hashes = pending.hashes
        self.counts.lookups += len(hashes)
        outputs: list[SenderOutput]
        if self.cache is None:
            outputs = [self._process(h, i) for h, i in zip(hashes, pending.images, strict=True)]
        else:
            cached = self.cache.is_cached(hashes)
            inputs = [
                None if hit else self._process(h, i)
                for h, i, hit in zip(hashes, pending.images, cached, strict=True)
            ]
            for h in hashes:
                self.cache.touch_sender_cache_item(h)
            outputs = self.cache.get_and_update(inputs, hashes)
            self.counts.hits += sum(cached)
            self.counts.shm_bytes += sum(
                ITEM_BYTES
                for inp, out in zip(inputs, outputs, strict=True)
                if inp is not None and isinstance(out[0], ShmHandle)
            )
        buffers: list[memoryview] = []
        entries = [
            wire.encode_feature(
                Feature(data=data, mm_hash=h, identifier=h, digests=self.truth[h]), buffers
            )
            for h, (data, _prompt_updates) in zip(hashes, outputs, strict=True)
        ]
        handles = [data for data, _ in outputs if isinstance(data, ShmHandle)]
        return entries, buffers, handles

    def _process(self, mm_hash: str, image: int) -> tuple[dict[str, np.ndarray], Any]:
        """Run the processor on one image and record (or check) the truth for its hash."""
        started = time.perf_counter()
        processed = process(self.images[image])
        self.processing_s += time.perf_counter() - started
        self.counts.processed += 1
        digests = tensor_digests(processed.tensors)
        if self.truth.setdefault(mm_hash, digests) != digests:
            raise SimulationError(f"processing image {image} twice gave different tensors")
        return processed.tensors, processed.prompt_update

    def _receive(self, conn: Connection) -> None:
        header, _ = wire.recv(conn)
        pending = self.pending[header["rid"]]
        if header["attempt"] != pending.attempt:
            raise SimulationError(
                f"a reply to attempt {header['attempt']} of request {header['rid']} "
                f"arrived during attempt {pending.attempt}"
            )
        pending.missing.extend(h for h in header["missing"] if h not in pending.missing)
        if conn is self.engine:  # P1 missed: the workers never saw this attempt
            pending.awaiting.clear()
        else:
            pending.awaiting.discard(self.results.index(conn))
        if pending.awaiting:
            return
        if pending.missing:
            self._recover(header["rid"], pending)
        else:
            self._complete(header["rid"], pending)

    def _recover(self, rid: int, pending: _Pending) -> None:
        """Invalidate what a receiver missed and send the request once more, with its data."""
        if self.cache is None:
            raise SimulationError(f"request {rid} missed {pending.missing}, but P0 has no cache")
        if pending.retried:  # the one retry did not recover: a broken guarantee, reported
            self.counts.unrecovered += 1
            self._complete(rid, pending)
            return
        pending.retried = True
        self.counts.retries += 1
        for h in pending.missing:
            self.counts.invalidated += self.cache.is_cached_item(h)
            self.cache.invalidate(h)
        self._send(rid, drift=False)

    def _complete(self, rid: int, pending: _Pending) -> None:
        del self.pending[rid]
        self.latencies.append(time.perf_counter() - pending.started)
        self.counts.items += len(pending.hashes)
        self.counts.baseline_bytes += len(pending.hashes) * ITEM_BYTES * (1 + self.config.workers)
        wire.send(self.events, {"type": "progress", "done": len(self.latencies)})

    # The end of the run

    def _finish(self, elapsed: float) -> dict[str, Any]:
        """Stop P1 and the workers, gather their counters and compute the metrics."""
        wire.send(self.engine, {"type": "stop"}, traffic=self.traffic)
        engine, _ = wire.recv(self.engine)
        workers = [wire.recv(conn)[0] for conn in self.results]
        counts = self.counts
        moved = self.traffic.total + engine["bytes"] + sum(w["bytes"] for w in workers)
        payload = self.traffic.payload_bytes + engine["payload_bytes"]
        lookups, hits, processed = counts.lookups, counts.hits, counts.processed
        mean_processing_s = self.processing_s / processed if processed else 0.0
        latencies_ms = np.array(self.latencies) * 1e3
        stats = self.cache.stats() if self.cache is not None else {}
        return RunMetrics(
            mode=self.config.mode,
            requests=len(self.latencies),
            items=counts.items,
            workers=self.config.workers,
            elapsed_s=elapsed,
            requests_per_s=len(self.latencies) / elapsed,
            items_per_s=counts.items / elapsed,
            latency_p50_ms=float(np.percentile(latencies_ms, 50)),
            latency_p99_ms=float(np.percentile(latencies_ms, 99)),
            hit_ratio=hits / lookups if lookups else 0.0,
            items_processed=processed,
            processing_s=self.processing_s,
            processing_s_saved=(lookups - processed) * mean_processing_s,
            bytes_moved=moved,
            payload_bytes_moved=payload,
            bytes_saved=counts.baseline_bytes - payload,
            shm_bytes_written=counts.shm_bytes,
            evictions=self._evictions(stats),
            served_uncached=stats.get("uncached_oversize", 0) + stats.get("uncached_full", 0),
            dropped_updates=counts.dropped,
            retries=counts.retries,
            unrecovered=counts.unrecovered,
            tensors_checked=sum(w["checked"] for w in workers),
            wrong_tensors=sum(w["wrong"] for w in workers),
        ).to_dict()

    def _evictions(self, stats: dict[str, int]) -> int | None:
        """Items the cache dropped to make room (``None`` without a cache)."""
        if self.cache is None:
            return None
        if "store_evictions" in stats:
            return stats["store_evictions"]
        # An LRU stores every item P0 processed, except those served uncached.
        inserted = self.counts.processed - stats["uncached_oversize"]
        return inserted - stats["entries"] - self.counts.invalidated


def frontend_main(
    config: SimulationConfig,
    workload: Path,
    engine: Connection,
    results: list[Connection],
    events: Connection,
) -> None:
    """P0's process: make the cache of ``config.mode``, hand P1 and the workers what they need,
    serve the workload, report the metrics to the driver. SIGTERM closes the cache (unlinking
    a shared-memory ring) before exiting."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        cache, downstream = make_caches(
            cast(Mode, config.mode),
            capacity_gb=config.capacity_gb,
            n_readers=config.workers,
        )
    except (MemoryError, ValueError) as exc:
        wire.send(
            events,
            {
                "type": "error",
                "config": True,
                "message": f"cannot create the {config.mode} cache: {exc}",
            },
        )
        return
    try:
        if isinstance(cache, ShmSenderCache):
            wire.send(events, {"type": "segment", "name": cache.name})
        wire.send(engine, {"type": "setup", "downstream": pickle.dumps(downstream)})
        metrics = _Frontend(config, cache, engine, results, events, workload).run()
        wire.send(events, {"type": "result", "metrics": metrics})
    finally:
        if cache is not None:
            cache.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
