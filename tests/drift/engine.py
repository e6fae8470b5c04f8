"""The engine the drift fuzzer plays around the caches of one mode: P0 stages a request
(``is_cached``, touch every hash, ``get_and_update``), P1 or the workers resolve it, a miss
is recovered the way the specification says (P0 invalidates, then retries once with the
data attached), and the oracle is checked after every operation (see :mod:`tests.drift`).
Each mode's model (``*_model.py``) subclasses :class:`EngineModel`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmcache.errors import CacheMissError
from tests.drift.stats import FuzzStats
from tests.drift.truth import Universe, count_arrays, fingerprint

__all__ = ["EngineModel", "OracleFailure", "Staged", "assembled"]

GiB = 1 << 30


class OracleFailure(AssertionError):
    """An oracle of the drift fuzzer failed: the caches did something they must never do."""


Staged = tuple[list[Any] | None, CacheMissError | None]
"""P0's part of one attempt: ``(outputs, None)``, or ``(None, miss)`` when P0 itself missed."""


def assembled(outputs: list[Any] | None, ids: Sequence[int]) -> list[Any]:
    """The outputs of a staged attempt, which P0 must have assembled (oracle b)."""
    if outputs is None:
        raise OracleFailure(f"(b) P0 could not assemble request {list(ids)}")
    return outputs


def is_subsequence(sub: Sequence[str], seq: Sequence[str]) -> bool:
    it = iter(seq)
    return all(any(x == y for y in it) for x in sub)


class EngineModel:
    """P0 (one or two frontends), P1 and the workers of one cache mode, driven as an engine
    would drive them, with the oracle checked after every operation.

    Each mode's subclass names its ``mode`` and the ``faults`` :meth:`request` can inject
    (besides ``"none"``: a method ``_fault_<name>`` each).

    Operations: :meth:`request` (with a fault from :attr:`faults` or ``"none"``),
    :meth:`reorder`, :meth:`interleave`, :meth:`resync` (clear every side),
    :meth:`drop_views`; :meth:`close` at the end.  Request items are ids ``0..n_ids-1`` of
    the model's :class:`Universe`.
    """

    mode = ""
    faults: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        seed: int,
        capacity: int,
        n_ids: int,
        stats: FuzzStats | None = None,
        retry_invalidates: str = "reported",
    ) -> None:
        if retry_invalidates not in ("reported", "request"):
            raise ValueError(
                f"retry_invalidates must be 'reported' or 'request', not {retry_invalidates!r}"
            )
        self.retry_invalidates = retry_invalidates
        self.universe = Universe(seed, capacity, n_ids)
        self.capacity = capacity
        self.capacity_gb = capacity / GiB  # what the caches' constructors take
        self.n_ids = n_ids
        self.stats = stats if stats is not None else FuzzStats()
        self.drifted = False  # a fault since the last resync may have split P0 from P1
        self.history: deque[tuple[list[int], list[Any]]] = deque(maxlen=16)  # for replays
        self.closed = False
        self.stats.modes[self.mode] += 1

    # -- operations ----------------------------------------------------------------------

    def request(self, ids: Sequence[int], fault: str = "none") -> None:
        """Serve one request of items ``ids``, injecting ``fault``; then check the oracle."""
        ids = self._ids(ids)
        if fault != "none":
            if fault not in self.faults:
                raise ValueError(f"mode {self.mode} has no fault {fault!r}")
            self.stats.faults[fault] += 1
        getattr(self, f"_fault_{fault}")(ids)
        self.check()

    def reorder(self, ids_a: Sequence[int], ids_b: Sequence[int]) -> None:
        """P0 updates for A then B; P1 / the workers get B then A."""
        ids_a, ids_b = self._ids(ids_a), self._ids(ids_b)
        self.stats.faults["reorder"] += 1
        fe = self.frontend()
        self.stats.requests += 2
        staged_a = self._stage(fe, ids_a, attach_all=False)
        staged_b = self._stage(fe, ids_b, attach_all=False)
        self._on_reorder()
        self._finish(fe, ids_b, staged_b, exposed=self._reorder_exposes)
        self._finish(fe, ids_a, staged_a, exposed=self._reorder_exposes)
        self.check()

    def interleave(self, ids_a: Sequence[int], ids_b: Sequence[int]) -> None:
        """A's ``is_cached`` is answered, then B is served in full (it may evict A's items),
        then A's update runs on the stale answer."""
        ids_a, ids_b = self._ids(ids_a), self._ids(ids_b)
        self.stats.faults["interleave"] += 1
        fe = self.frontend()
        self.stats.requests += 1
        staged_a = self._stage(
            fe, ids_a, attach_all=False, after_is_cached=lambda: self._serve(fe, ids_b)
        )
        self._finish(fe, ids_a, staged_a, exposed=True)
        self.check()

    def resync(self) -> None:
        """Clear every side together (what the engine does on sleep/pause): no drift left."""
        self.stats.resyncs += 1
        self._resync()
        self.drifted = False
        self.check()

    def drop_views(self) -> None:
        """Let go of zero-copy views kept by workers (``shm``)."""
        self.check()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> EngineModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine ----------------------------------------------------------------------

    def frontend(self) -> Any:
        raise NotImplementedError

    def _ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) % self.n_ids for i in ids]
        if not ids:
            raise ValueError("a request has at least one item")
        return ids

    def _stage(
        self,
        fe: Any,
        ids: Sequence[int],
        *,
        attach_all: bool,
        after_is_cached: Callable[[], object] | None = None,
    ) -> Staged:
        """P0's part of one attempt: ``is_cached``, touch every hash, ``get_and_update``.
        Returns ``(outputs, None)`` or ``(None, CacheMissError)`` when P0 itself missed."""
        u = self.universe
        hashes = u.hashes(ids)
        flags = [False] * len(ids) if attach_all else fe.is_cached(hashes)
        self._check(len(flags) == len(ids), "(d) is_cached returned the wrong number of answers")
        if after_is_cached is not None:
            after_is_cached()
        for h in hashes:
            fe.touch_sender_cache_item(h)
        inputs = [
            None if cached else (u.item(i), u.prompt_updates(i))
            for cached, i in zip(flags, ids, strict=True)
        ]
        try:
            outputs = fe.get_and_update(inputs, hashes)
        except CacheMissError as miss:
            fe.release_sender_touches()
            self._check_miss_list(miss, hashes, "P0")
            if attach_all:
                raise OracleFailure(
                    f"(d) P0 raised CacheMissError {miss.mm_hashes} for a request with every "
                    f"item's data attached (ids {ids})"
                ) from miss
            return None, miss
        self._check(len(outputs) == len(ids), "(d) get_and_update returned the wrong count")
        for (data, updates), i in zip(outputs, ids, strict=True):
            self._check(
                updates == u.prompt_updates(i),
                f"(a) P0 returned prompt updates {updates!r} for item {i}, "
                f"expected {u.prompt_updates(i)!r}",
            )
            self._check_p0_output(data, i)
        return outputs, None

    def _finish(
        self,
        fe: Any,
        ids: Sequence[int],
        staged: Staged,
        *,
        exposed: bool,
        before_deliver: Callable[[], object] | None = None,
    ) -> list[Any]:
        """Deliver a staged attempt; on a miss recover and retry once.  Returns the outputs
        of the attempt that succeeded."""
        outputs, p0_miss = staged
        self.stats.attempts += 1
        if p0_miss is not None:
            miss, side = p0_miss, "p0"
        else:
            outputs = assembled(outputs, ids)
            if before_deliver is not None:
                before_deliver()
            try:
                self._deliver(ids, outputs, exposed=exposed)
                self.history.append((list(ids), outputs))
                return outputs
            except CacheMissError as exc:
                miss, side = exc, "p1"
        self._judge_first_miss(ids, miss, side, exposed)
        self._recover(fe, ids, miss, side)
        self.stats.retries += 1
        self.stats.attempts += 1
        outputs, p0_miss = self._stage(fe, ids, attach_all=True)
        outputs = assembled(outputs, ids)
        try:
            self._deliver(ids, outputs, exposed=False, retry=True)
        except CacheMissError as exc:
            raise OracleFailure(
                f"(b) request {ids} failed its retry: CacheMissError {exc.mm_hashes} "
                f"(first attempt: {side} missed {miss.mm_hashes})"
            ) from exc
        self.history.append((list(ids), outputs))
        return outputs

    def _serve(self, fe: Any, ids: Sequence[int], *, exposed: bool = False) -> list[Any]:
        self.stats.requests += 1
        return self._finish(fe, ids, self._stage(fe, ids, attach_all=False), exposed=exposed)

    def _judge_first_miss(
        self, ids: Sequence[int], miss: CacheMissError, side: str, exposed: bool
    ) -> None:
        """Oracle (d): a first-attempt miss is allowed only where a fault could cause it."""
        if side == "p0":
            self.stats.p0_misses += 1
        else:
            self.stats.p1_misses += 1
        self.stats.checks += 1
        if exposed or self._miss_explained(miss, side):
            return
        raise OracleFailure(
            f"(d) CacheMissError {miss.mm_hashes} from {side} on request {list(ids)} with no "
            f"fault that could explain it"
        )

    def _recover(self, fe: Any, ids: Sequence[int], miss: CacheMissError, side: str) -> None:
        """The engine's answer to a miss, before its one retry."""
        if side == "p0":
            # P0 raised before applying anything, but its answer to is_cached was stale, so
            # its view of P1 cannot be trusted for this request: forget all of it on P0 (the
            # retry carries every item's data).
            for h in dict.fromkeys(self.universe.hashes(ids)):
                fe.invalidate(h)
            self._after_p0_miss()
        else:
            reported = self.retry_invalidates == "reported"
            for h in dict.fromkeys(miss.mm_hashes if reported else self.universe.hashes(ids)):
                fe.invalidate(h)

    # -- mode hooks ----------------------------------------------------------------------

    _reorder_exposes = True

    def _on_reorder(self) -> None:
        self.drifted = True

    def _after_p0_miss(self) -> None:
        self.drifted = True

    def _miss_explained(self, miss: CacheMissError, side: str) -> bool:
        return self.drifted

    def _check_p0_output(self, data: Any, i: int) -> None:
        """What P0 returns for item ``i``: the item itself or what stands for it."""
        raise NotImplementedError

    def _deliver(
        self, ids: Sequence[int], outputs: list[Any], *, exposed: bool, retry: bool = False
    ) -> None:
        raise NotImplementedError

    def _resync(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Invariants that hold between operations."""

    def _fault_none(self, ids: list[int]) -> None:
        self._serve(self.frontend(), ids)

    # -- oracle helpers ------------------------------------------------------------------

    def _check(self, ok: bool, message: str) -> None:
        self.stats.checks += 1
        if not ok:
            raise OracleFailure(message)

    def _check_item(self, resolved: Any, i: int, where: str) -> None:
        """Oracle (a): ``resolved`` is item ``i``, bit for bit."""
        u = self.universe
        self.stats.items_checked += 1
        self.stats.checks += 1
        expected = u.fingerprint(i)
        self.stats.tensors_checked += count_arrays(expected)
        # The lru receiver hands back the very object P0 sent: compare it in full now and
        # then (it could have been changed in place), the fast way otherwise.
        if resolved is u.item(i) and self.stats.items_checked % 16:
            return
        if fingerprint(resolved) != expected:
            got = resolved.get("id") if isinstance(resolved, Mapping) else type(resolved)
            raise OracleFailure(
                f"(a) {where} resolved item {i} ({u.hash(i)[:12]}) to different data "
                f"(it carries id {got!r})"
            )

    def _check_miss_list(self, miss: CacheMissError, hashes: Sequence[str], who: str) -> None:
        self._check(
            bool(miss.mm_hashes) and is_subsequence(miss.mm_hashes, hashes),
            f"(d) {who}'s CacheMissError lists {miss.mm_hashes}, not missing hashes of the "
            f"request in request order",
        )
