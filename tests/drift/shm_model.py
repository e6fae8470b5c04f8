"""``shm`` mode: P0's ``ShmSenderCache`` writes the ring, P1 forwards handles, each worker
resolves them through its own ``ShmReceiverCache`` (copying or zero-copy); the faults that
disturb handles in flight (lost, leaked, duplicated, replayed, invalidated, stripped) and
restarts on either side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmcache.errors import CacheMissError
from mmcache.items import Feature, ShmHandle
from mmcache.shm import ShmReceiverCache, ShmSenderCache
from tests.drift.engine import EngineModel, OracleFailure, assembled

__all__ = ["ShmModel"]

MiB = 1 << 20


def _wire(data: Any) -> Any:
    """What the engine's IPC delivers: a handle travels as its three fields."""
    if isinstance(data, ShmHandle):
        fields = (data.address, data.monotonic_id, bytes(data.signature))
        return ShmHandle(address=fields[0], monotonic_id=fields[1], signature=fields[2])
    return data


class ShmModel(EngineModel):
    """``shm``: P0 ``ShmSenderCache`` (the ring's writer), P1 forwards handles, each worker a
    ``ShmReceiverCache`` (its own reader slot; ``copy=False`` workers get zero-copy views)."""

    mode = "shm"
    faults: tuple[str, ...] = (
        "lost",  # handles issued, request rejected: the engine releases them
        "lost_leak",  # ... and the engine forgets to release them
        "dup",  # a worker gets the same handles twice (before the other workers read them)
        "replay",  # a worker gets an old request's handles again, after the ring moved on
        "p0_clear",  # P0 cleared alone between requests
        "p0_clear_inflight",  # P0 cleared while the request's handles are in flight
        "invalidate_inflight",  # one hash invalidated while its handle is in flight
        "worker_restart",  # a worker restarted between requests
        "worker_restart_inflight",  # a worker restarted while handles are in flight
        "strip",  # the engine strips a payload (None) on its way to one worker
        "hold_views",  # a zero-copy worker keeps the request's tensors alive
    )

    def __init__(
        self,
        *,
        n_workers: int = 1,
        copies: Sequence[bool] = (True,),
        max_object_fraction: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_object_size_mb = self.capacity * max_object_fraction / MiB
        self.p0 = ShmSenderCache(
            self.capacity_gb,
            max_object_size_mb=self.max_object_size_mb,
            n_readers=n_workers,
        )
        self.copies = [bool(copies[k % len(copies)]) for k in range(n_workers)]
        self.workers = [ShmReceiverCache(self.p0.handle(), copy=c) for c in self.copies]
        self.suspect: set[str] = set()  # hashes a duplicated delivery may have over-acked
        self.leaky = False  # references were deliberately leaked (until the next resync)
        self.held: list[tuple[int, int, Any]] = []  # (worker, id, resolved item) views kept
        self.hold_next = False
        self.strip_next: dict[int, frozenset[int]] = {}

    def frontend(self) -> ShmSenderCache:
        return self.p0

    def _check_p0_output(self, data: Any, i: int) -> None:
        if isinstance(data, ShmHandle):
            return
        # Served uncached (too large, or the ring is full of protected objects).
        self.stats.uncached += 1
        self._check_item(data, i, "P0 (served uncached)")

    def _read(
        self,
        worker: int,
        ids: Sequence[int],
        outputs: list[Any],
        *,
        strip: frozenset[int] = frozenset(),
    ) -> list[str]:
        """One worker resolves the request; returns the hashes it reported missing."""
        hashes = self.universe.hashes(ids)
        features = [
            Feature(
                data=None if k in strip else _wire(data), mm_hash=h, modality="image", position=k
            )
            for k, ((data, _), h) in enumerate(zip(outputs, hashes, strict=True))
        ]
        missing: list[str] = []
        try:
            self.workers[worker].get_and_update_features(features)
        except CacheMissError as miss:
            self._check_miss_list(miss, hashes, f"worker {worker}")
            missing = miss.mm_hashes
        for k, (f, i) in enumerate(zip(features, ids, strict=True)):
            if k in strip:
                self._check(f.data is None, "(a) a stripped payload did not stay None")
            elif isinstance(f.data, ShmHandle):
                self._check(
                    f.mm_hash in missing,
                    f"(d) worker {worker} left a handle unresolved without reporting it",
                )
            else:
                self._check_item(f.data, i, f"worker {worker}")
                if self.hold_next and not self.copies[worker]:
                    self.held.append((worker, i, f.data))
        return missing

    def _deliver(
        self,
        ids: Sequence[int],
        outputs: list[Any],
        *,
        exposed: bool,
        retry: bool = False,
        workers: Sequence[int] | None = None,
    ) -> None:
        hashes = self.universe.hashes(ids)
        strip = {} if retry else self.strip_next
        missing: set[str] = set()
        for w in range(len(self.workers)) if workers is None else workers:
            missing |= set(self._read(w, ids, outputs, strip=strip.get(w, frozenset())))
        if missing:
            raise CacheMissError([h for h in dict.fromkeys(hashes) if h in missing])

    def _miss_explained(self, miss: CacheMissError, side: str) -> bool:
        return side == "p1" and set(miss.mm_hashes) <= self.suspect

    _reorder_exposes = False  # every handle holds a reference: order does not matter

    def _on_reorder(self) -> None:
        pass

    def _after_p0_miss(self) -> None:
        # get_and_update raised without leaving a reference behind (it checks the request
        # before issuing any handle, and gives back what it issued if it still misses
        # part-way): the reference-count oracle stays on.
        pass

    # -- faults --------------------------------------------------------------------------

    def _fault_lost(self, ids: list[int]) -> None:
        self.stats.requests += 1
        outputs, _ = self._stage(self.p0, ids, attach_all=False)
        if outputs is not None:
            self.p0.release_handles(data for data, _ in outputs)

    def _fault_lost_leak(self, ids: list[int]) -> None:
        self.stats.requests += 1
        self._stage(self.p0, ids, attach_all=False)
        self.leaky = True

    def _fault_dup(self, ids: list[int]) -> None:
        self.stats.requests += 1
        outputs, p0_miss = self._stage(self.p0, ids, attach_all=False)
        if p0_miss is not None:
            self._finish(self.p0, ids, (outputs, p0_miss), exposed=False)
            return
        outputs = assembled(outputs, ids)
        hashes = self.universe.hashes(ids)
        self.stats.attempts += 1
        # Worker 0 reads the request twice before any other worker reads it.
        first = self._read(0, ids, outputs)
        if first and not set(first) <= self.suspect:
            raise OracleFailure(f"(d) worker 0 missed {first} on a fresh request")
        if self._read(0, ids, outputs):
            self.stats.duplicate_misses += 1
        self.suspect |= set(hashes)
        if len(self.workers) > 1:
            # Pressure on the ring: everything reclaimable may be evicted now.  Worker 0's
            # second reading must not have released what the other workers still need.
            filler = [(i + 1) % self.n_ids for i in ids]
            self._serve(self.p0, filler, exposed=True)
            for w in range(1, len(self.workers)):
                missed = self._read(w, ids, outputs)
                self._check(
                    not missed,
                    f"(d) a duplicated delivery to worker 0 released {missed} before worker "
                    f"{w} read them",
                )
        if first:
            # Worker 0 missed (an earlier duplicate over-acknowledged): recover.
            self._recover(self.p0, ids, CacheMissError(first), "p1")
            self.stats.retries += 1
            self.stats.attempts += 1
            retry, _ = self._stage(self.p0, ids, attach_all=True)
            retry = assembled(retry, ids)
            try:
                self._deliver(ids, retry, exposed=False, retry=True)
            except CacheMissError as exc:
                raise OracleFailure(f"(b) request {ids} failed its retry: {exc.mm_hashes}") from exc

    def _fault_replay(self, ids: list[int]) -> None:
        if not self.history:
            self._serve(self.p0, ids)
            return
        old_ids, outputs = self.history[len(ids) * 7 % len(self.history)]
        worker = len(ids) % len(self.workers)
        # Every worker read these handles long ago: the objects may be evicted and their
        # bytes reused.  Same data or a miss, never foreign bytes.
        if self._read(worker, old_ids, outputs):
            self.stats.replay_misses += 1
        else:
            self.stats.replays_resolved += 1
        self.suspect |= set(self.universe.hashes(old_ids))

    def _fault_p0_clear(self, ids: list[int]) -> None:
        self.p0.clear_cache()  # nothing in flight: no request may miss because of it
        self._serve(self.p0, ids)

    def _fault_p0_clear_inflight(self, ids: list[int]) -> None:
        self.stats.requests += 1
        staged = self._stage(self.p0, ids, attach_all=False)
        self._finish(self.p0, ids, staged, exposed=True, before_deliver=self.p0.clear_cache)

    def _fault_invalidate_inflight(self, ids: list[int]) -> None:
        self.stats.requests += 1
        staged = self._stage(self.p0, ids, attach_all=False)
        victim = self.universe.hash(ids[len(ids) // 2])
        self._finish(
            self.p0, ids, staged, exposed=True, before_deliver=lambda: self.p0.invalidate(victim)
        )

    def _restart_worker(self, w: int) -> None:
        # A restarted worker is a new process: the old one's views died with it (a closed
        # reader keeps its slot until its last view is gone).
        self.held = [entry for entry in self.held if entry[0] != w]
        self.workers[w].close()
        self.workers[w] = ShmReceiverCache(self.p0.handle(), copy=self.copies[w])

    def _fault_worker_restart(self, ids: list[int]) -> None:
        self._restart_worker(len(ids) % len(self.workers))
        self._serve(self.p0, ids)

    def _fault_worker_restart_inflight(self, ids: list[int]) -> None:
        self.stats.requests += 1
        staged = self._stage(self.p0, ids, attach_all=False)
        w = len(ids) % len(self.workers)
        self._finish(
            self.p0, ids, staged, exposed=True, before_deliver=lambda: self._restart_worker(w)
        )

    def _fault_strip(self, ids: list[int]) -> None:
        # The engine strips the first payload on its way to the last worker (it does not need
        # it, e.g. a prefix-cache hit); that worker never reads the handle, so its reference
        # stays until a clear.
        self.strip_next = {len(self.workers) - 1: frozenset({0})}
        self.leaky = True
        try:
            self._serve(self.p0, ids)
        finally:
            self.strip_next = {}

    def _fault_hold_views(self, ids: list[int]) -> None:
        self.hold_next = True
        try:
            self._serve(self.p0, ids)
        finally:
            self.hold_next = False

    def drop_views(self) -> None:
        self.held.clear()
        self.check()

    def _resync(self) -> None:
        self.p0.clear_cache()
        self.suspect.clear()
        self.leaky = False  # clear() gives back the references of abandoned handles

    def check(self) -> None:
        # Held zero-copy views never change, whatever happened since (eviction, clear,
        # invalidation, a restarted worker).
        for _, i, resolved in self.held:
            self._check_item(resolved, i, "a held zero-copy view")
        stats = self.p0.stats()
        self._check(stats["store_pinned"] == 0, f"(c) {stats['store_pinned']} objects left pinned")
        if not self.leaky:
            self._check(
                stats["store_outstanding_refs"] == 0,
                f"(c) {stats['store_outstanding_refs']} references outstanding after every "
                f"worker read every handle",
            )
        if not self.held:
            self._check(stats["store_views"] == 0, f"(c) {stats['store_views']} views alive")
        self._check(
            stats["store_bytes_in_use"] <= stats["store_capacity"], "(d) ring over capacity"
        )

    def _close(self) -> None:
        self.held.clear()
        for w in self.workers:
            w.close()
        self.p0.close()
