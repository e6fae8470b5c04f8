"""P0, the frontend: the cache protocol of an engine's input processor, and the measurements.

For each request P0 hashes every item, asks its cache which are cached, processes only the
others, touches every hash, then updates its cache item by item and sends P1 what the cache
returns: the data, ``None`` (P1 holds it: ``lru``) or a handle (``shm``). When P1 or a worker
reports a :class:`~mmcache.CacheMissError`, P0 invalidates the missing hashes and sends the
request once more: the retry processes them again and carries every item's data (in ``lru``
also that of items P0 believes P1 holds: after lost updates the two LRUs evict in different
orders, and other requests in flight may have made P1 drop one before the retry arrives). With
``inject_drift`` P0 loses some requests after updating its cache (as when a request is
rejected before the engine sees it) and resubmits them, so the caches drift apart.

With a remote tier (``--remote``) P0's cache is a :class:`~mmcache.remote.TieredSenderCache`:
``is_cached`` also finds items another host (or this one, before an eviction) processed, and
P0 skips processing them; what P0 does process is published for the other hosts.  P0 asks in
single flight (``claim=True``, ``wait_s=claim_wait_s``): an item another host is processing
at that moment is waited for rather than processed twice.

With several frontends (``--frontends``) each P0 serves its turn of the host's requests; in
``shm`` mode they share one store and ask it in single flight too (``claim=True``,
``wait_s=claim_wait_s``): an image another frontend is processing is waited for, and counted
in ``claim_waits``.

P0 also keeps the truth: the digest of every tensor it produced for each hash, which every
worker checks what it receives against.  For an item the remote tier supplied, P0 takes the
digests of the item it fetched; the driver checks those against the digests of whichever host
processed it, so a wrong remote item counts as wrong tensors even though every worker of this
host agreed with P0.

The request stream is drawn lazily and each upload made when its request arrives (the time
that takes is the simulated client's, excluded from latency and throughput), so memory does
not grow with ``--requests``.
"""

from __future__ import annotations

import itertools
import pickle
import queue
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mmcache import (
    CacheMissError,
    Feature,
    ShmHandle,
    ShmSenderCache,
    content_hash,
    make_caches,
)
from mmcache.caches import BaseSenderCache, SenderOutput
from mmcache.factory import Mode
from mmcache.simulate import wire
from mmcache.simulate.config import (
    ITEM_BYTES,
    MAX_FRONTENDS,
    SimulationConfig,
    SimulationError,
)
from mmcache.simulate.workload import (
    TARGET_SIDE,
    Catalogue,
    process,
    request_stream,
    tensor_digests,
)

if TYPE_CHECKING:
    from mmcache.remote import TieredSenderCache

#: Request latencies kept for the percentiles (a uniform sample of all of them).
LATENCY_SAMPLES = 100_000


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

    requests: int = 0  # completed requests
    items: int = 0  # items of completed requests
    lookups: int = 0  # items looked up in P0's cache, every attempt included
    hits: int = 0  # lookups P0 did not process: found locally, or after a claim wait
    claim_waits: int = 0  # ... that another frontend was processing: waited for, then found
    remote_hits: int = 0  # lookups the remote tier answered instead of processing
    processed: int = 0  # items run through the processor
    dropped: int = 0  # attempts lost on purpose (inject_drift)
    retries: int = 0  # attempts resent after a miss
    unrecovered: int = 0  # requests whose one retry missed again
    baseline_bytes: int = 0  # tensor bytes mode none sends for the completed requests


class _LatencySample:
    """A uniform sample of at most ``size`` values out of all those added (reservoir
    sampling), so percentiles cost bounded memory however long the run."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self._rng.randrange(self.seen)
            if slot < self.size:
                self.values[slot] = value


class _Inbox:
    """What P1 and the workers send this frontend, read by a thread of its own as it arrives,
    up to each one's last message (its ``stats``). P0 must never stop reading while it
    processes images or sends: P1 blocked on a full pipe to P0 reads no more of P0's requests,
    and P0 blocked on a full pipe to P1 would wait for it for good (miss replies name up to a
    request's every hash, so a few hundred of them fill a pipe)."""

    def __init__(self, conns: list[Connection]) -> None:
        self._messages: queue.SimpleQueue[tuple[Connection, dict[str, Any]] | BaseException] = (
            queue.SimpleQueue()
        )
        threading.Thread(
            target=self._read, args=(conns,), name="mmcache-simulate-inbox", daemon=True
        ).start()

    def _read(self, conns: list[Connection]) -> None:
        open_conns = list(conns)
        try:
            while open_conns:
                for ready in wait(open_conns):
                    conn = cast(Connection, ready)
                    header, _ = wire.recv(conn)
                    self._messages.put((conn, header))
                    if header["type"] == "stats":
                        open_conns.remove(conn)
        except BaseException as e:  # a peer gone (EOFError), for the main thread to raise
            self._messages.put(e)

    def next(self) -> tuple[Connection, dict[str, Any]]:
        """The next message and the connection it came on, waiting for it."""
        message = self._messages.get()
        if isinstance(message, BaseException):
            raise message
        return message


class _Frontend:
    """P0: turns the request stream into messages, recovers from misses, measures."""

    def __init__(
        self,
        config: SimulationConfig,
        host: int,
        frontend: int,
        local: BaseSenderCache | None,
        tiered: TieredSenderCache | None,
        engine: Connection,
        results: list[Connection],
        events: Connection,
    ) -> None:
        self.config = config
        self.host = host
        self.frontend = frontend
        self.local = local
        self.tiered = tiered
        self.cache: BaseSenderCache | None = tiered or local
        # With several frontends, the store they share (single flight through it).
        self.shared = local if config.frontends > 1 and isinstance(local, ShmSenderCache) else None
        self.engine = engine
        self.results = results
        self.events = events
        self.n_requests = config.frontend_requests(frontend)
        # The host's stream, dealt out in turn between its frontends.
        stream = request_stream(
            requests=config.requests,
            catalogue=config.catalogue,
            zipf=config.zipf,
            max_items=config.max_items,
            seed=config.seed,
            host=host,
        )
        self.requests = itertools.islice(stream, frontend, None, config.frontends)
        self.catalogue = Catalogue(config.catalogue, config.seed)
        self.drift = np.random.default_rng([config.seed, 0xD81F7, host, frontend])
        self.image_of: dict[str, int] = {}
        self.processed_truth: dict[str, dict[str, bytes]] = {}
        self.remote_truth: dict[str, dict[str, bytes]] = {}
        # Remote hits of images this frontend had not processed, per image: the driver counts
        # as cross-host those no other frontend of the host processed either.
        self.fetched_unprocessed: dict[int, int] = {}
        self.seen = np.zeros(config.catalogue, dtype=bool)
        self.pending: dict[int, _Pending] = {}
        self.latencies = _LatencySample(LATENCY_SAMPLES, seed=host * MAX_FRONTENDS + frontend)
        self.traffic = wire.Traffic()
        self.counts = _Counts()
        self.processing_s = 0.0
        self.upload_s = 0.0

    # The request loop

    def run(self) -> dict[str, Any]:
        """Serve this frontend's requests, stop its part of the pipeline and return its
        figures."""
        for conn in [self.engine, *self.results]:
            header, _ = wire.recv(conn)
            if header["type"] != "ready":
                raise SimulationError(f"expected a ready message, got {header['type']!r}")
        inbox = _Inbox([self.engine, *self.results])
        started = time.perf_counter()
        submitted = 0
        while submitted < self.n_requests or self.pending:
            while submitted < self.n_requests and len(self.pending) < self.config.inflight:
                self._submit(submitted)
                submitted += 1
            self._receive(*inbox.next())
        elapsed = time.perf_counter() - started - self.upload_s
        return self._finish(elapsed, inbox)

    def _submit(self, rid: int) -> None:
        images = next(self.requests)
        upload_started = time.perf_counter()
        uploads = [self.catalogue[i] for i in images]  # the client's part, not timed
        started = time.perf_counter()
        self.upload_s += started - upload_started
        hashes = [content_hash(data, size=TARGET_SIDE) for data in uploads]
        for h, i in zip(hashes, images, strict=True):
            self.image_of[h] = i
            self.seen[i] = True
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
            if isinstance(self.local, ShmSenderCache):
                self.local.release_handles(handles)
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
        if self.cache is None or self.local is None:
            outputs = [self._process(h, i) for h, i in zip(hashes, pending.images, strict=True)]
        else:
            local = self.local.is_cached(hashes)
            cached = self._is_cached(self.cache, hashes)
            self._note_remote_hits(hashes, local, cached)
            # Neither here before nor fetched: another frontend put it meanwhile (waited for).
            waited = [
                hit and not was and (self.tiered is None or self.tiered.fetched(h) is None)
                for h, was, hit in zip(hashes, local, cached, strict=True)
            ]
            inputs = [
                None if hit else self._process(h, i)
                for h, i, hit in zip(hashes, pending.images, cached, strict=True)
            ]
            outputs = self._update(self.cache, inputs, pending)
            if pending.retried:
                self._attach_all_data(pending, inputs, outputs)
            # An item processed after all (evicted before the update) is no hit.
            local = [was and item is None for was, item in zip(local, inputs, strict=True)]
            waited = [other and item is None for other, item in zip(waited, inputs, strict=True)]
            self.counts.hits += sum(local) + sum(waited)
            self.counts.claim_waits += sum(waited)
        buffers: list[memoryview] = []
        entries = [
            wire.encode_feature(
                Feature(data=data, mm_hash=h, identifier=h, digests=self._truth(h), image=i),
                buffers,
            )
            for h, i, (data, _prompt_updates) in zip(hashes, pending.images, outputs, strict=True)
        ]
        handles = [data for data, _ in outputs if isinstance(data, ShmHandle)]
        return entries, buffers, handles

    def _attach_all_data(
        self, pending: _Pending, inputs: list[Any], outputs: list[SenderOutput]
    ) -> None:
        """A retry carries every item's data to P1, also where P0's cache answered ``None``
        (``lru``: P1 holds it): once updates were lost, P1's LRU evicts in another order than
        P0's, so with other requests in flight P1 may drop, before this retry reaches it, an
        item that P0 still believes it holds (docs/reference.md, "Threads")."""
        for j, (h, image) in enumerate(zip(pending.hashes, pending.images, strict=True)):
            if outputs[j][0] is None:
                inputs[j] = outputs[j] = self._process(h, image)

    def _update(
        self, cache: BaseSenderCache, inputs: list[Any], pending: _Pending
    ) -> list[SenderOutput]:
        """Touch every hash of the request, then update the cache item by item.

        With frontends sharing the store, another one's put may evict an item between this
        P0's ``is_cached`` and its touch: the update then raises (changing nothing) and P0
        processes what it missed (``inputs`` gets the items) and updates again."""
        while True:
            for h in pending.hashes:
                cache.touch_sender_cache_item(h)
            try:
                return cache.get_and_update(inputs, pending.hashes)
            except CacheMissError as miss:
                # Not the cache's to fix: it has no bytes of an item evicted before the touch.
                if self.shared is None:
                    raise
                for j, (h, image) in enumerate(zip(pending.hashes, pending.images, strict=True)):
                    if inputs[j] is None and h in miss.mm_hashes:
                        inputs[j] = self._process(h, image)

    def _is_cached(self, cache: BaseSenderCache, hashes: list[str]) -> list[bool]:
        """Which of ``hashes`` P0 need not process. In single flight where others may be
        processing the same items (another host through the remote tier, another frontend
        through the shared store): each miss is claimed, and items claimed elsewhere are
        waited for up to ``claim_wait_s``."""
        wait_s = self.config.claim_wait_s
        if self.tiered is not None:
            return self.tiered.is_cached(hashes, claim=True, wait_s=wait_s)
        if self.shared is not None:
            return self.shared.is_cached(hashes, claim=True, wait_s=wait_s)
        return cache.is_cached(hashes)

    def _note_remote_hits(self, hashes: list[str], local: list[bool], cached: list[bool]) -> None:
        """Count what the remote tier supplied and take the digests of what it fetched."""
        if self.tiered is None:
            return
        for h, local_hit, hit in zip(hashes, local, cached, strict=True):
            if local_hit or not hit:
                continue
            fetched = self.tiered.fetched(h)
            if fetched is None:
                continue
            self.counts.remote_hits += 1
            if h not in self.processed_truth:
                image = self.image_of[h]
                self.fetched_unprocessed[image] = self.fetched_unprocessed.get(image, 0) + 1
            digests = tensor_digests(fetched[0])
            known = self.remote_truth.setdefault(h, digests)
            if known != digests:  # the tier supplied two different items for one hash
                self.remote_truth[h] = dict.fromkeys(digests, b"")

    def _truth(self, mm_hash: str) -> dict[str, bytes] | None:
        """The digests this P0 recorded for ``mm_hash``; ``None`` for an item another
        frontend of the store processed (the workers keep what they received of it, and the
        driver checks that against what that frontend processed)."""
        truth = self.processed_truth.get(mm_hash) or self.remote_truth.get(mm_hash)
        if truth is None and self.shared is None:
            raise SimulationError(f"no truth for {mm_hash}: it was neither processed nor fetched")
        return truth

    def _process(self, mm_hash: str, image: int) -> tuple[dict[str, np.ndarray], Any]:
        """Run the processor on one image and record (or check) the truth for its hash."""
        started = time.perf_counter()
        processed = process(self.catalogue[image])
        self.processing_s += time.perf_counter() - started
        self.counts.processed += 1
        digests = tensor_digests(processed.tensors)
        if self.processed_truth.setdefault(mm_hash, digests) != digests:
            raise SimulationError(f"processing image {image} twice gave different tensors")
        return processed.tensors, processed.prompt_update

    def _receive(self, conn: Connection, header: dict[str, Any]) -> None:
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
            self.cache.invalidate(h)
        self._send(rid, drift=False)

    def _complete(self, rid: int, pending: _Pending) -> None:
        del self.pending[rid]
        self.latencies.add((time.perf_counter() - pending.started) * 1e3)
        self.counts.requests += 1
        self.counts.items += len(pending.hashes)
        self.counts.baseline_bytes += len(pending.hashes) * ITEM_BYTES * (1 + self.config.workers)
        wire.send(self.events, {"type": "progress", "done": self.counts.requests})

    # The end of the run

    def _finish(self, elapsed: float, inbox: _Inbox) -> dict[str, Any]:
        """Tell P1 and the workers this frontend is done, gather their counters for it and
        return its figures."""
        wire.send(self.engine, {"type": "stop"}, traffic=self.traffic)
        last: dict[Connection, dict[str, Any]] = {}
        while len(last) <= len(self.results):
            conn, header = inbox.next()
            if header["type"] != "stats":
                raise SimulationError(f"a {header['type']!r} message after the last request")
            last[conn] = header
        engine = last[self.engine]
        workers = [last[conn] for conn in self.results]
        if self.tiered is not None:
            self.tiered.flush()  # what this host processed reaches the others before the end
        counts = self.counts
        stats = self.cache.stats() if self.cache is not None else {}
        deferred: dict[tuple[int, tuple[tuple[str, bytes], ...]], int] = {}
        for worker in workers:
            for image, digests, times in worker["deferred"]:
                key = (image, tuple((name, digest) for name, digest in digests))
                deferred[key] = deferred.get(key, 0) + times
        report: dict[str, Any] = {
            "host": self.host,
            "frontend": self.frontend,
            "requests": counts.requests,
            "items": counts.items,
            "elapsed_s": elapsed,
            "latencies_ms": self.latencies.values,
            "lookups": counts.lookups,
            "hits": counts.hits,
            "claim_waits": counts.claim_waits,
            "remote_hits": counts.remote_hits,
            "fetched_unprocessed": list(self.fetched_unprocessed.items()),
            "processed": counts.processed,
            "processing_s": self.processing_s,
            "bytes_moved": self.traffic.total + engine["bytes"] + sum(w["bytes"] for w in workers),
            "payload_bytes_moved": self.traffic.payload_bytes + engine["payload_bytes"],
            "baseline_bytes": counts.baseline_bytes,
            # Items written into the ring: the store's counter, not a count of the handles
            # P0 was given for items it processed (a put of a key another frontend stored
            # meanwhile is a hit on that object). The same store for every frontend of a host.
            "store_puts": stats.get("store_puts", 0),
            "evictions": self._evictions(stats),
            # The store's counter, the same for every frontend sharing it (not theirs to add).
            "evictions_shared": "store_evictions" in stats,
            # Every reason (too large, no room, references saturated, /dev/shm used up).
            "served_uncached": sum(n for k, n in stats.items() if k.startswith("uncached_")),
            "dropped": counts.dropped,
            "retries": counts.retries,
            "unrecovered": counts.unrecovered,
            "tensors_checked": sum(w["checked"] for w in workers),
            "wrong_tensors": sum(w["wrong"] for w in workers),
            # What the workers received for items without a truth here: [image, digests, n].
            "deferred_truth": [[i, list(d), n] for (i, d), n in deferred.items()],
            "seen": np.packbits(self.seen).tobytes(),
            # The driver checks what the tier supplied against what any host processed.
            "processed_truth": self._by_image(self.processed_truth),
            "remote_truth": self._by_image(self.remote_truth),
            "remote": None,
        }
        if self.tiered is not None:
            store = self.tiered.remote
            report["remote"] = {
                "puts": stats["remote_puts"],
                "errors": stats["remote_errors"],
                "claims": stats["remote_claims"],
                "claim_waits": stats["remote_claim_waits"],
                "claim_wait_hits": stats["remote_claim_wait_hits"],
                "latencies_s": store.latencies(),
            }
        return report

    def _by_image(self, truths: dict[str, dict[str, bytes]]) -> list[list[Any]]:
        """``[image, [[tensor name, digest], ...]]`` for each hash of ``truths``."""
        return [[self.image_of[h], sorted(d.items())] for h, d in truths.items()]

    def _evictions(self, stats: dict[str, int]) -> int | None:
        """Items the cache dropped to make room (``None`` without a cache)."""
        if self.cache is None:
            return None
        # The caches' own counters: P0's processing is no count of insertions (a retry
        # reprocesses items its cache holds, to carry their data; an item served uncached
        # is processed and never stored).
        return stats["store_evictions"] if "store_evictions" in stats else stats["evictions"]


def frontend_main(
    config: SimulationConfig,
    host: int,
    frontend: int,
    remote: dict[str, str] | None,
    ring: str | None,
    engine: Connection,
    results: list[Connection],
    events: Connection,
) -> None:
    """A P0 process: make the cache of ``config.mode`` (behind the remote tier ``remote``:
    its ``url``, ``namespace`` and ``secret``; in mode ``shm`` a ring named ``ring``, which
    frontend 0 creates and the host's other frontends join), hand P1 and the workers what
    they need, serve this frontend's share of the workload, report the figures to the
    driver. SIGTERM closes the cache (the last writer of a ring unlinks it) before exiting."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    tiered: TieredSenderCache | None = None
    local: BaseSenderCache | None = None
    try:
        store = None
        if remote is not None:
            from mmcache.remote import RemoteStore

            store = RemoteStore(
                remote["url"], namespace=remote["namespace"], secret=remote["secret"]
            )
        setup: dict[str, Any] = {"type": "setup"}
        if frontend > 0 and config.mode == "shm":
            local = _join(engine)
        else:
            local, downstream = make_caches(
                cast(Mode, config.mode),
                capacity_gb=config.capacity_gb,
                n_readers=config.workers,
                name=ring,
                # Several frontends share one store in mode shm only; in the others each
                # has its own cache (refused by make_caches if asked to share).
                max_writers=config.frontends if config.mode == "shm" else 1,
            )
            setup["downstream"] = pickle.dumps(downstream)
            if config.frontends > 1 and isinstance(local, ShmSenderCache):
                setup["writer"] = pickle.dumps(local.writer_handle())
        if store is not None and local is not None:
            from mmcache.remote import TieredSenderCache

            tiered = TieredSenderCache(local, store)
    except (MemoryError, ValueError, ImportError) as exc:
        wire.send(
            events,
            {
                "type": "error",
                "config": True,
                "message": f"cannot create the {config.label} cache: {exc}",
            },
        )
        if local is not None:
            local.close()
        return
    try:
        with wire.exit_when_peer_gone():
            wire.send(engine, setup)
            p0 = _Frontend(config, host, frontend, local, tiered, engine, results, events)
            wire.send(events, {"type": "result", "report": p0.run()})
    finally:
        if tiered is not None:
            tiered.close()  # publishes what is queued, closes the local cache too
        elif local is not None:
            local.close()


def _join(engine: Connection) -> ShmSenderCache:
    """Join the store frontend 0 created, with the writer handle P1 relays."""
    message, _ = wire.recv(engine)
    if message["type"] != "join":
        raise SimulationError(f"expected a join message, got {message['type']!r}")
    return ShmSenderCache.join(pickle.loads(message["writer"]))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
