"""Drift fuzzer: a model of P0, P1 and the workers that drives the real caches with random
request streams and random faults between the sides, and checks an oracle after every step.

The model plays the engine.  For every request P0 asks ``is_cached`` for each hash, touches
every hash, then calls ``get_and_update`` (``None`` for the items it believes cached); the
outputs travel to P1 (``lru``: a :class:`~mmcache.ReceiverCache`) or, as small handles, to
every worker (``shm``: one :class:`~mmcache.ShmReceiverCache` each), which resolve
:class:`~mmcache.Feature` objects.  On a :class:`~mmcache.CacheMissError` the engine recovers
the way the specification says: P0 ``invalidate`` s the reported hashes and retries the
request once, with its data attached.  When P0 itself raises (an item it reported cached was
gone by the time of its update) the request never left P0 and P0 applied none of it, but
P0's view of P1 is stale, so the engine invalidates every hash of the request before the
retry.

Faults injected between the sides: a request lost after P0 applied it (rejected), two
requests applied in different orders on the two sides, a duplicated delivery, P1 cleared or
restarted alone (a worker restarted, in ``shm`` mode), P0 cleared alone, two P0 frontends
sharing one P1, ``is_cached`` answered and then the item evicted before the update (another
request served in between), handles invalidated or cleared while in flight, payloads
stripped by the engine, zero-copy views held across everything.  In mode ``remote`` (the
``lru`` pipeline whose P0 sits behind a remote tier on a real Valkey, shared with a second
host): the server killed and restarted, stalled (SIGSTOP), stored values with a flipped byte,
a deleted chunk or another schema version's header, two hosts putting one item at once, a
host with the wrong secret.

Oracle, checked after every step (a failure raises :class:`OracleFailure`):

(a) every resolved item equals the truth for its hash, bit for bit (tensors and arrays by
    dtype, shape and bytes; zero-copy views held across steps are re-checked every step);
(b) every request succeeds on its first or its second attempt;
(c) with no fault injected since the last resynchronisation, P0 and P1 hold the same keys in
    the same recency order (``lru``); nothing is left pinned, referenced or viewed once a
    request is done (``shm``);
(d) nothing raises but :class:`~mmcache.CacheMissError`, and that only where a fault could
    have caused it.

Run it for a while with ``python -m mmcache.fuzz --seconds 600 [--seed S]``; it prints what
it exercised and exits with status 1 on the first oracle failure, printing how to replay the
failing episode (``--seed S --episode E``).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import random
import struct
import sys
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmcache.caches import ProcessorOnlyCache, ReceiverCache, SenderCache
from mmcache.errors import CacheMissError
from mmcache.items import Feature, ShmHandle, content_hash, item_size
from mmcache.shm import ShmReceiverCache, ShmSenderCache

try:  # Items carry torch tensors whenever torch is installed (it is an optional extra).
    import torch
except ImportError:  # pragma: no cover - the test extras always install torch
    torch = None  # type: ignore[assignment]

__all__ = [
    "FAULTS",
    "MODES",
    "FuzzStats",
    "Model",
    "OracleFailure",
    "Universe",
    "fingerprint",
    "main",
    "make_model",
    "run_episode",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

MODES = ("lru", "shm", "processor_only", "remote")

FAULTS: dict[str, tuple[str, ...]] = {
    "lru": (
        "lost",  # P0 applied the request, P1 never saw it (rejected request)
        "dup",  # P1 applies one request twice
        "replay",  # P1 gets an old request's outputs again, much later
        "p1_clear",  # P1 cleared alone
        "p1_restart",  # P1 restarted alone (a fresh, empty ReceiverCache)
        "p1_clear_inflight",  # P1 cleared between P0's update and P1's
        "p0_clear",  # P0 cleared alone
        "other_frontend",  # a second P0 frontend sends to the same P1
    ),
    "shm": (
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
    ),
    "processor_only": (
        "p0_clear",  # P0 cleared between requests
    ),
    # The lru pipeline with P0 behind a remote tier on a real Valkey shared with a second
    # host; its faults plus the remote tier's.
    "remote": (
        "lost",
        "p1_clear",
        "p0_clear",
        "other_host",  # the second host serves the request (it shares what the first made)
        "server_restart",  # the server killed and restarted empty, then the request
        "server_stall",  # the request served while the server is stopped (SIGSTOP)
        "flip_byte",  # a byte of a stored value flipped, then the second host fetches it
        "delete_chunk",  # a chunk of a stored value deleted, then ...
        "old_version",  # a stored value's header rewritten to another schema version, ...
        "race_put",  # both hosts put one item at once, then the second host fetches it
        "wrong_secret",  # a host with another secret serves the request
    ),
}
"""Per mode, the faults :meth:`Model.request` can inject (plus ``"none"``).  Two further
faults are operations of their own: :meth:`Model.reorder` and :meth:`Model.interleave`."""


class OracleFailure(AssertionError):
    """An oracle of the drift fuzzer failed: the caches did something they must never do."""


def _assembled(outputs: list[Any] | None, ids: Sequence[int]) -> list[Any]:
    """The outputs of a staged attempt, which P0 must have assembled (oracle b)."""
    if outputs is None:
        raise OracleFailure(f"(b) P0 could not assemble request {list(ids)}")
    return outputs


# --------------------------------------------------------------------------------------------
# Counters


@dataclass
class FuzzStats:
    """What a fuzzing run exercised."""

    episodes: int = 0
    steps: int = 0
    requests: int = 0  # requests submitted to P0 (lost ones included)
    attempts: int = 0  # deliveries of a request to P1 / the workers, retries included
    retries: int = 0  # second attempts after a CacheMissError
    p0_misses: int = 0  # first attempts on which P0 itself raised CacheMissError
    p1_misses: int = 0  # first attempts on which P1 / a worker raised CacheMissError
    duplicate_misses: int = 0  # duplicated deliveries answered with CacheMissError
    replay_misses: int = 0  # replayed old deliveries answered with CacheMissError
    replays_resolved: int = 0  # replayed old deliveries resolved (to the right data)
    mirror_checks: int = 0  # fault-free states in which P0's and P1's keys were compared
    items_checked: int = 0  # resolved items compared with the truth
    tensors_checked: int = 0  # tensors and arrays compared bit for bit
    checks: int = 0  # oracle checks evaluated (items, key sets, counters)
    uncached: int = 0  # items P0 served uncached (oversize, or no room left: lru or ring)
    resyncs: int = 0
    remote_served: int = 0  # items the remote tier supplied instead of processing
    remote_misses: int = 0  # remote lookups that failed or did not verify (each a miss)
    faults: Counter[str] = field(default_factory=Counter)
    modes: Counter[str] = field(default_factory=Counter)

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def summary(self) -> str:
        lines = [
            f"episodes {self.episodes}  steps {self.steps}  "
            f"modes {dict(sorted(self.modes.items()))}",
            f"requests {self.requests}  attempts {self.attempts}  retries {self.retries}  "
            f"(first-attempt misses: P0 {self.p0_misses}, P1/workers {self.p1_misses})",
            f"faults {self.total_faults}  {dict(sorted(self.faults.items()))}",
            f"checks {self.checks}  items checked {self.items_checked}  "
            f"tensors/arrays checked bit for bit {self.tensors_checked}  "
            f"served uncached {self.uncached}  duplicate-delivery misses "
            f"{self.duplicate_misses}  resyncs {self.resyncs}",
            f"replays of old deliveries: resolved {self.replays_resolved}, missed "
            f"{self.replay_misses}  fault-free P0/P1 key-set comparisons {self.mirror_checks}",
            f"remote tier: items served {self.remote_served}, failed or unverifiable lookups "
            f"{self.remote_misses}",
        ]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The truth: items, their hashes and their bit-exact fingerprints

# (name, fraction of the capacity, weight)
SIZE_CLASSES = (
    ("tiny", 0.002, 5),
    ("small", 0.03, 6),
    ("medium", 0.12, 4),
    ("large", 0.3, 2),
    ("huge", 0.6, 1),
    ("oversize", 1.3, 1),
)

_TORCH_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int32", "int64", "float64")


def _torch_from_bytes(raw: bytes, dtype_name: str, shape: tuple[int, ...]) -> Any:
    arr = np.frombuffer(bytearray(raw), dtype=np.uint8)
    return torch.from_numpy(arr).view(getattr(torch, dtype_name)).reshape(shape)


class Universe:
    """The truth: item ``i`` (deterministic in ``seed`` and ``i``), its hash and its prompt
    updates.  Item sizes are drawn relative to ``capacity`` (tiny to larger than it)."""

    def __init__(self, seed: int, capacity: int, n_ids: int) -> None:
        self.seed = seed
        self.capacity = capacity
        self.n_ids = n_ids
        self._items: dict[int, dict[str, Any]] = {}
        self._hashes: dict[int, str] = {}
        self._prints: dict[int, Any] = {}
        self._by_hash: dict[str, int] = {}

    def item(self, i: int) -> dict[str, Any]:
        if i not in self._items:
            self._items[i] = self._make(i)
            # Fingerprinted before any cache sees it, so that a cache changing the very
            # object it was given cannot go unnoticed.
            self._prints[i] = fingerprint(self._items[i])
        return self._items[i]

    def hash(self, i: int) -> str:
        if i not in self._hashes:
            h = content_hash(self.item(i), modality="image")
            self._hashes[i] = h
            self._by_hash[h] = i
        return self._hashes[i]

    def hashes(self, ids: Sequence[int]) -> list[str]:
        return [self.hash(i) for i in ids]

    def id_of(self, mm_hash: str) -> int:
        return self._by_hash[mm_hash]

    def fingerprint(self, i: int) -> Any:
        self.item(i)
        return self._prints[i]

    def prompt_updates(self, i: int) -> tuple[str, int, int]:
        return ("image", i, 1 + i % 7)

    def size(self, i: int) -> int:
        return item_size(self.item(i))

    def _make(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, i])
        weights = np.array([w for _, _, w in SIZE_CLASSES], dtype=float)
        cls = int(rng.choice(len(SIZE_CLASSES), p=weights / weights.sum()))
        name, frac, _ = SIZE_CLASSES[cls]
        target = max(8, int(self.capacity * frac * rng.uniform(0.6, 1.2)))
        item: dict[str, Any] = {"id": i, "size_class": name}
        item["image_grid_thw"] = np.array([1, 1 + i % 5, 2 + i % 3], dtype=np.int64)
        body = target - 24
        # The main payload: a torch tensor with random bits (NaN patterns included), or a
        # numpy array when torch is missing or for variety.
        dtype_name = _TORCH_DTYPES[int(rng.integers(len(_TORCH_DTYPES)))]
        share = float(rng.uniform(0.5, 1.0)) if rng.random() < 0.3 else 1.0
        main_bytes = max(0, int(body * share))
        if torch is not None and rng.random() < 0.8:
            itemsize = torch.empty((), dtype=getattr(torch, dtype_name)).element_size()
            n = main_bytes // itemsize
            cols = int(rng.integers(1, 9))
            shape = (n // cols, cols) if n >= cols and rng.random() < 0.7 else (n,)
            n = math.prod(shape)
            t = _torch_from_bytes(rng.bytes(n * itemsize), dtype_name, shape)
            if len(shape) == 2 and rng.random() < 0.15:
                t = t.t()  # a non-contiguous view: the caches must make it contiguous
            item["pixel_values"] = t
        else:
            np_dtype = np.dtype(rng.choice(["<f4", "<f8", "<u2", "<i8", "|u1"]))
            n = main_bytes // np_dtype.itemsize
            item["pixel_values"] = np.frombuffer(rng.bytes(n * np_dtype.itemsize), np_dtype)
        rest = body - item_size(item["pixel_values"])
        if rest > 64 and rng.random() < 0.5:
            item["embeds"] = np.frombuffer(rng.bytes((rest // 4) * 4), "<f4").reshape(-1, 1)
        extras = rng.random()
        if extras < 0.25:
            item["meta"] = {
                "tags": ["img", i, 0.5 + i, None, True],
                "raw": rng.bytes(int(rng.integers(0, 600))),
                "pair": (i, f"name-{i}"),
            }
        elif extras < 0.35 and torch is not None:
            item["scale"] = torch.tensor(float(i) / 3.0, dtype=torch.float64)  # 0-dim
            item["empty"] = np.zeros((0, 3), dtype=np.float32)
        return item


def fingerprint(value: Any) -> Any:
    """A canonical, bit-exact description of a value (tensors and arrays by kind, dtype,
    shape and bytes; floats by their bits), for comparing a resolved item with the truth."""
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("T", str(t.dtype), tuple(t.shape), raw)
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return ("A", arr.dtype.str, arr.shape, arr.tobytes())
    if isinstance(value, Mapping):
        return ("M", tuple(sorted((k, fingerprint(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("L", tuple(fingerprint(v) for v in value))
    if isinstance(value, tuple):
        return ("U", tuple(fingerprint(v) for v in value))
    if isinstance(value, bool):
        return ("B", value)
    if isinstance(value, float):
        return ("F", struct.pack("<d", value))
    if isinstance(value, int | str | bytes) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, np.generic):
        return ("G", value.dtype.str, value.tobytes())
    return ("?", type(value).__qualname__, repr(value))


def _count_arrays(fp: Any) -> int:
    if not isinstance(fp, tuple) or not fp:
        return 0
    if fp[0] in ("T", "A"):
        return 1
    if fp[0] == "M":
        return sum(_count_arrays(v) for _, v in fp[1])
    if fp[0] in ("L", "U"):
        return sum(_count_arrays(v) for v in fp[1])
    return 0


def _is_subsequence(sub: Sequence[str], seq: Sequence[str]) -> bool:
    it = iter(seq)
    return all(any(x == y for y in it) for x in sub)


def _wire(data: Any) -> Any:
    """What the engine's IPC delivers: a handle travels as its three fields."""
    if isinstance(data, ShmHandle):
        fields = (data.address, data.monotonic_id, bytes(data.signature))
        return ShmHandle(address=fields[0], monotonic_id=fields[1], signature=fields[2])
    return data


# --------------------------------------------------------------------------------------------
# The model


_Staged = tuple[list[Any] | None, CacheMissError | None]


class Model:
    """P0 (one or two frontends), P1 and the workers of one cache mode, driven as an engine
    would drive them, with the oracle checked after every operation.

    Operations: :meth:`request` (with a fault from ``FAULTS[mode]`` or ``"none"``),
    :meth:`reorder`, :meth:`interleave`, :meth:`resync` (clear every side),
    :meth:`drop_views`; :meth:`close` at the end.  Request items are ids ``0..n_ids-1`` of
    the model's :class:`Universe`.
    """

    mode = ""

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
            if fault not in FAULTS[self.mode]:
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

    def __enter__(self) -> Model:
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
    ) -> _Staged:
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
            None if cached else (u.item(i), u.prompt_updates(i)) for cached, i in zip(flags, ids)
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
        for (data, updates), i in zip(outputs, ids):
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
        staged: _Staged,
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
            outputs = _assembled(outputs, ids)
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
        outputs = _assembled(outputs, ids)
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
        self.stats.tensors_checked += _count_arrays(expected)
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
            bool(miss.mm_hashes) and _is_subsequence(miss.mm_hashes, hashes),
            f"(d) {who}'s CacheMissError lists {miss.mm_hashes}, not missing hashes of the "
            f"request in request order",
        )


class _LruModel(Model):
    """``lru``: P0 ``SenderCache`` frontends (one, or two sharing P1), P1 ``ReceiverCache``."""

    mode = "lru"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity_gb = self.capacity / GiB
        self.frontends = [SenderCache(self.capacity_gb)]
        self.p1 = ReceiverCache(self.capacity_gb)
        self._uncached_seen = 0  # items the frontends served uncached, as last counted

    def frontend(self) -> SenderCache:
        return self.frontends[0]

    def _check_p0_output(self, data: Any, i: int) -> None:
        if data is not None:
            self._check_item(data, i, "P0 (data to send)")

    def _deliver(
        self, ids: Sequence[int], outputs: list[Any], *, exposed: bool, retry: bool = False
    ) -> None:
        hashes = self.universe.hashes(ids)
        features = [
            Feature(data=data, mm_hash=h, modality="image", position=k)
            for k, ((data, _), h) in enumerate(zip(outputs, hashes))
        ]
        try:
            self.p1.get_and_update_features(features)
        except CacheMissError as miss:
            self._check_miss_list(miss, hashes, "P1")
            missing = set(miss.mm_hashes)
            for f, i in zip(features, ids):
                if f.mm_hash not in missing:
                    self._check_item(f.data, i, "P1")
            raise
        for f, i in zip(features, ids):
            self._check_item(f.data, i, "P1")

    def _fault_lost(self, ids: list[int]) -> None:
        self.stats.requests += 1
        self._stage(self.frontend(), ids, attach_all=False)  # rejected: P1 never sees it
        self.drifted = True

    def _fault_dup(self, ids: list[int]) -> None:
        outputs = self._serve(self.frontend(), ids)
        self.drifted = True
        try:
            self._deliver(ids, outputs, exposed=True)
        except CacheMissError:
            self.stats.duplicate_misses += 1

    def _fault_replay(self, ids: list[int]) -> None:
        if not self.history:
            self._serve(self.frontend(), ids)
            return
        old_ids, outputs = self.history[len(ids) * 7 % len(self.history)]
        self.drifted = True
        try:
            self._deliver(old_ids, outputs, exposed=True)
            self.stats.replays_resolved += 1
        except CacheMissError:
            self.stats.replay_misses += 1

    def _fault_p1_clear(self, ids: list[int]) -> None:
        self.p1.clear_cache()
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_p1_restart(self, ids: list[int]) -> None:
        self.p1.close()
        self.p1 = ReceiverCache(self.capacity_gb)
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_p1_clear_inflight(self, ids: list[int]) -> None:
        fe = self.frontend()
        self.stats.requests += 1
        staged = self._stage(fe, ids, attach_all=False)
        self.drifted = True
        self._finish(fe, ids, staged, exposed=True, before_deliver=self.p1.clear_cache)

    def _fault_p0_clear(self, ids: list[int]) -> None:
        self.frontend().clear_cache()
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_other_frontend(self, ids: list[int]) -> None:
        if len(self.frontends) == 1:
            self.frontends.append(SenderCache(self.capacity_gb))
        self.drifted = True
        self._serve(self.frontends[1], ids, exposed=True)

    def _resync(self) -> None:
        for fe in self.frontends:
            fe.clear_cache()
        self.p1.clear_cache()

    def _p0_keys(self) -> list[Hashable]:
        """The keys of P0's own cache, the one P1 mirrors."""
        return self.frontend().keys()

    def check(self) -> None:
        if not self.drifted:
            self.stats.mirror_checks += 1
            p0, p1 = self._p0_keys(), self.p1.keys()
            self._check(
                p0 == p1,
                f"(c) with no fault injected P0 and P1 disagree: P0 holds {len(p0)} keys, "
                f"P1 {len(p1)}; only on P0: {len(set(p0) - set(p1))}, only on P1: "
                f"{len(set(p1) - set(p0))}, same set: {set(p0) == set(p1)}",
            )
        uncached = 0
        for fe in self.frontends:
            stats = fe.stats()
            self._check(stats["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")
            uncached += stats["uncached_oversize"] + stats["uncached_full"]
        self.stats.uncached += uncached - self._uncached_seen
        self._uncached_seen = uncached
        self._check(self.p1.stats()["used_bytes"] <= self.capacity, "(d) P1 exceeds its capacity")

    def _close(self) -> None:
        for fe in self.frontends:
            fe.close()
        self.p1.close()


class _ProcessorOnlyModel(Model):
    """``processor_only``: P0 caches full items; nothing downstream."""

    mode = "processor_only"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.p0 = ProcessorOnlyCache(self.capacity / GiB)

    def frontend(self) -> ProcessorOnlyCache:
        return self.p0

    def _check_p0_output(self, data: Any, i: int) -> None:
        self._check_item(data, i, "P0 (processor cache)")

    def _deliver(
        self, ids: Sequence[int], outputs: list[Any], *, exposed: bool, retry: bool = False
    ) -> None:
        pass  # P0's outputs are the items themselves, checked as they came out

    _reorder_exposes = False

    def _on_reorder(self) -> None:
        pass

    def _after_p0_miss(self) -> None:
        pass

    def _miss_explained(self, miss: CacheMissError, side: str) -> bool:
        return False

    def _fault_p0_clear(self, ids: list[int]) -> None:
        self.p0.clear_cache()
        self._serve(self.p0, ids)

    def _resync(self) -> None:
        self.p0.clear_cache()

    def check(self) -> None:
        self._check(self.p0.stats()["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")

    def _close(self) -> None:
        self.p0.close()


class _ShmModel(Model):
    """``shm``: P0 ``ShmSenderCache`` (the ring's writer), P1 forwards handles, each worker a
    ``ShmReceiverCache`` (its own reader slot; ``copy=False`` workers get zero-copy views)."""

    mode = "shm"

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
            self.capacity / GiB,
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
            for k, ((data, _), h) in enumerate(zip(outputs, hashes))
        ]
        missing: list[str] = []
        try:
            self.workers[worker].get_and_update_features(features)
        except CacheMissError as miss:
            self._check_miss_list(miss, hashes, f"worker {worker}")
            missing = miss.mm_hashes
        for k, (f, i) in enumerate(zip(features, ids)):
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
        outputs, miss = self._stage(self.p0, ids, attach_all=False)
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
        outputs = _assembled(outputs, ids)
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
            retry = _assembled(retry, ids)
            try:
                self._deliver(ids, retry, exposed=False, retry=True)
            except CacheMissError as exc:
                raise OracleFailure(f"(b) request {ids} failed its retry: {exc.mm_hashes}")

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


class _RemoteModel(_LruModel):
    """``remote``: the ``lru`` pipeline with P0 behind a :class:`~mmcache.remote.
    TieredSenderCache` on a real Valkey server, and a second host (its own P0 and P1) on the
    same store.  Values are chunked at 4 KiB so small items exercise chunking too.  After
    every request both hosts' publishing is flushed, so the store holds what they made.
    Oracle (a) covers the tier: whatever a host resolves came through it or was processed,
    and must be the truth; its stores' failures are counted, never raised."""

    mode = "remote"
    SECRET = "fuzz secret"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._namespace = f"fuzz/{self.universe.seed}/{next(_REMOTE_NAMESPACES)}"
        self._server = _remote_server()
        self.frontends[0].close()
        self.frontends[0] = self._host(self.SECRET)
        self.other = self._host(self.SECRET)
        self.other_p1 = ReceiverCache(self.capacity_gb)
        self._counted = 0

    def _host(self, secret: str) -> Any:
        from mmcache.remote import RemoteStore, TieredSenderCache

        store = RemoteStore(
            self._server.url + "?chunk_kb=4",
            namespace=self._namespace,
            secret=secret,
            timeout_s=0.05,
            breaker_cooldown_s=0.05,
        )
        return TieredSenderCache(SenderCache(self.capacity_gb), store)

    def frontend(self) -> Any:  # a TieredSenderCache
        return self.frontends[0]

    def _tiered(self) -> list[Any]:
        return [self.frontends[0], self.other]

    def _serve_on_other_host(self, ids: list[int], host: Any = None, p1: Any = None) -> None:
        """Serve ``ids`` on another host (the second one by default): its P0 forgets them
        first, so every item comes from the remote tier or from processing."""
        host, p1 = host or self.other, p1 or self.other_p1
        for h in self.universe.hashes(ids):
            host.invalidate(h)
        saved = self.frontends[0], self.p1
        self.frontends[0], self.p1 = host, p1
        try:
            self._serve(host, ids, exposed=True)
        finally:
            self.frontends[0], self.p1 = saved

    def request(self, ids: Sequence[int], fault: str = "none") -> None:
        super().request(ids, fault)
        for host in self._tiered():
            self._check(host.flush(30.0), "(d) a host's publishing did not finish")

    def _raw(self) -> Any:
        import redis

        return redis.Redis.from_url(self._server.url)

    def _stored_keys(self, ids: list[int], *, chunked: bool) -> list[str]:
        """Store keys of this request's items: their manifests or whole values, or (with
        ``chunked``) the chunks of those that have them."""
        prefix = f"mmc/{self._namespace}/"
        with self._raw() as raw:
            found: list[str] = []
            for h in dict.fromkeys(self.universe.hashes(ids)):
                pattern = f"{prefix}{h}/chunk/*" if chunked else f"{prefix}{h}"
                found += sorted(k.decode() for k in raw.scan_iter(match=pattern))
            return found

    def _damage(self, ids: list[int], harm: Callable[[Any, str], object], chunked: bool) -> None:
        keys = self._stored_keys(ids, chunked=chunked)
        if keys:
            with self._raw() as raw:
                harm(raw, keys[len(ids) % len(keys)])
        self._serve_on_other_host(ids)

    def _fault_other_host(self, ids: list[int]) -> None:
        self._serve_on_other_host(ids)

    def _fault_server_restart(self, ids: list[int]) -> None:
        from tests.servers import restart

        restart(self._server)
        self._serve(self.frontend(), ids)

    def _fault_server_stall(self, ids: list[int]) -> None:
        from tests.servers import resume, stall

        stall(self._server)
        try:
            self._serve(self.frontend(), ids)
            for host in self._tiered():
                host.flush(30.0)  # puts time out against the stopped server
        finally:
            resume(self._server)

    def _fault_flip_byte(self, ids: list[int]) -> None:
        def flip(raw: Any, name: str) -> None:
            value = bytearray(raw.get(name) or b"")
            if value:
                value[len(value) * 7 // 11] ^= 0x20
                raw.set(name, bytes(value))

        self._damage(ids, flip, chunked=len(ids) % 2 == 0)

    def _fault_delete_chunk(self, ids: list[int]) -> None:
        self._damage(ids, lambda raw, name: raw.delete(name), chunked=True)

    def _fault_old_version(self, ids: list[int]) -> None:
        from mmcache.remote.envelope import HEADER_SIZE

        def rewrite(raw: Any, name: str) -> None:
            value = bytearray(raw.get(name) or b"")
            # The envelope header starts a whole value and ends a chunked value's manifest.
            at = {b"MMCR": 0, b"MMCK": len(value) - HEADER_SIZE}.get(bytes(value[:4]))
            if at is not None:
                value[at + 4 : at + 6] = struct.pack("<H", 0xFFFF)
                raw.set(name, bytes(value))

        self._damage(ids, rewrite, chunked=False)

    def _fault_race_put(self, ids: list[int]) -> None:
        import threading

        i = ids[0]
        h = self.universe.hash(i)
        with self._raw() as raw:
            names = [k for k in raw.scan_iter(match=f"mmc/{self._namespace}/{h}*")]
            if names:
                raw.delete(*names)
        record = {"item": self.universe.item(i), "prompt_updates": self.universe.prompt_updates(i)}
        start = threading.Barrier(2)

        def put(host: Any) -> None:
            start.wait()
            host.remote.put(h, record)

        threads = [threading.Thread(target=put, args=(host,)) for host in self._tiered()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._serve_on_other_host(ids)

    def _fault_wrong_secret(self, ids: list[int]) -> None:
        # A secret of its own: values it publishes verify for nobody else, and no one's for it.
        secret = f"stranger {next(_REMOTE_NAMESPACES)}"
        stranger, p1 = self._host(secret), ReceiverCache(self.capacity_gb)
        try:
            self._serve_on_other_host(ids, stranger, p1)
            self._check(
                stranger.stats()["remote_served"] == 0,
                "(a) a host with the wrong secret was served from the remote tier",
            )
        finally:
            stranger.close()
            p1.close()

    def _p0_keys(self) -> list[Hashable]:
        keys: list[Hashable] = self.frontend().local.keys()
        return keys

    def check(self) -> None:
        super().check()  # (c) and (d) for this host's P0s and P1
        counted = 0
        for host in self._tiered():
            stats = host.stats()
            if host is self.other:
                self._check(stats["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")
            counted += stats["remote_served"]
        self.stats.remote_served += counted - self._counted
        self._counted = counted

    def _resync(self) -> None:
        super()._resync()
        self.other.clear_cache()
        self.other_p1.clear_cache()

    def _close(self) -> None:
        self.stats.remote_misses += sum(host.stats()["remote_errors"] for host in self._tiered())
        super()._close()
        self.other.close()
        self.other_p1.close()


_REMOTE_NAMESPACES = itertools.count()
_REMOTE_SERVER: list[Any] = []


def _remote_server() -> Any:
    """One real Valkey server for the remote models of this process (started on first use;
    it dies with this process)."""
    if not _REMOTE_SERVER:
        from mmcache.remote.local_server import start_valkey

        _REMOTE_SERVER.append(start_valkey())
    return _REMOTE_SERVER[0]


def make_model(
    mode: str,
    *,
    seed: int,
    capacity: int,
    n_ids: int,
    stats: FuzzStats | None = None,
    retry_invalidates: str = "reported",
    **kwargs: Any,
) -> Model:
    """The model of ``mode`` (one of :data:`MODES`); ``kwargs`` go to the ``shm`` model
    (``n_workers``, ``copies``, ``max_object_fraction``)."""
    classes: dict[str, type[Model]] = {
        "lru": _LruModel,
        "shm": _ShmModel,
        "processor_only": _ProcessorOnlyModel,
        "remote": _RemoteModel,
    }
    cls = classes[mode]
    return cls(
        seed=seed,
        capacity=capacity,
        n_ids=n_ids,
        stats=stats,
        retry_invalidates=retry_invalidates,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# The long-running driver


def _random_ids(rng: random.Random, n_ids: int) -> list[int]:
    n = rng.randint(1, 6)
    # Skewed popularity: low ids recur much more often.
    return [min(n_ids - 1, int(rng.paretovariate(1.2)) - 1) if rng.random() < 0.7
            else rng.randrange(n_ids) for _ in range(n)]


def _episode_config(rng: random.Random, mode: str) -> dict[str, Any]:
    if mode == "shm":
        capacity = rng.choice([96, 128, 192, 256, 384]) * KiB
        n_workers = rng.choice([1, 1, 2, 2, 3])
        return {
            "capacity": capacity,
            "n_ids": rng.randint(3, 40),
            "n_workers": n_workers,
            "copies": [rng.random() < 0.5 for _ in range(n_workers)],
            "max_object_fraction": rng.choice([0.25, 0.5, 0.9]),
        }
    return {"capacity": rng.choice([2, 4, 8, 16, 32, 64]) * KiB, "n_ids": rng.randint(3, 40)}


def run_episode(
    seed: int,
    episode: int,
    stats: FuzzStats,
    *,
    steps: int,
    modes: Sequence[str] = MODES,
    log: list[str] | None = None,
    fault_rate: float | None = None,
    **model_options: Any,
) -> None:
    """One episode: a fresh model of a random mode and configuration, ``steps`` random
    operations.  ``fault_rate`` (by default drawn per episode, from fault-free to one
    request in three) is the share of requests that inject a fault; reorders and
    interleavings come at a tenth of it each.  Deterministic in ``(seed, episode)``; raises
    :class:`OracleFailure` (or whatever the caches raised)."""
    rng = random.Random(f"{seed}:{episode}")
    mode = modes[episode % len(modes)]
    config = _episode_config(rng, mode)
    rate = rng.choice([0.0, 0.02, 0.1, 0.3]) if fault_rate is None else fault_rate
    if log is not None:
        log.append(f"episode {episode}: mode {mode} fault rate {rate} {config}")
    faults = FAULTS[mode]
    with make_model(
        mode, seed=rng.randrange(2**32), stats=stats, **config, **model_options
    ) as model:
        stats.episodes += 1
        for step in range(steps):
            r = rng.random()
            if r < 0.03:
                op: tuple[Any, ...] = ("resync",)
            elif r < 0.03 + rate / 10:
                op = ("reorder", _random_ids(rng, model.n_ids), _random_ids(rng, model.n_ids))
            elif r < 0.03 + rate / 5:
                op = ("interleave", _random_ids(rng, model.n_ids), _random_ids(rng, model.n_ids))
            elif r < 0.05 + rate / 5 and mode == "shm":
                op = ("drop_views",)
            else:
                fault = rng.choice(faults) if rng.random() < rate else "none"
                op = ("request", _random_ids(rng, model.n_ids), fault)
            if log is not None:
                log.append(f"  step {step}: {op}")
            getattr(model, op[0])(*op[1:])
            stats.steps += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmcache.fuzz",
        description="Drift fuzzer: random request streams and faults through the real caches, "
        "checked against the truth after every step.",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random)")
    parser.add_argument("--steps", type=int, default=400, help="operations per episode")
    parser.add_argument(
        "--mode", choices=MODES, action="append", help="restrict to these modes (repeatable)"
    )
    parser.add_argument(
        "--episode", type=int, default=None, help="replay this one episode, printing each step"
    )
    parser.add_argument(
        "--retry-invalidates",
        choices=("reported", "request"),
        default="reported",
        help="what P0 invalidates before a retry after P1 missed: the reported hashes (the "
        "specification's protocol, default) or every hash of the request",
    )
    args = parser.parse_args(argv)
    options: dict[str, Any] = {"retry_invalidates": args.retry_invalidates}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    modes = tuple(args.mode or MODES)
    logging.getLogger("mmcache").setLevel(logging.ERROR)  # uncached items are expected here
    stats = FuzzStats()
    print(f"mmcache drift fuzzer: seed {seed}, modes {', '.join(modes)}, "
          f"torch {'yes' if torch is not None else 'no (numpy items only)'}", flush=True)
    start = time.monotonic()
    deadline = start + args.seconds
    episode = args.episode if args.episode is not None else 0
    last_report = start
    while True:
        log: list[str] = []
        try:
            run_episode(
                seed, episode, stats, steps=args.steps, modes=modes, log=log, **options
            )
        except Exception as exc:  # OracleFailure, or anything the caches raised (oracle d)
            kind = "ORACLE FAILURE" if isinstance(exc, OracleFailure) else "UNEXPECTED ERROR"
            print(f"\n{kind} in episode {episode} (seed {seed}):", file=sys.stderr)
            traceback.print_exc()
            tail = log if args.episode is not None else [log[0], "  ...", *log[-12:]]
            print("\n".join(tail), file=sys.stderr)
            replay = f"python -m mmcache.fuzz --seed {seed} --episode {episode}"
            replay += f" --steps {args.steps}"
            replay += "".join(f" --mode {m}" for m in args.mode or ())
            replay += f" --retry-invalidates {args.retry_invalidates}"
            print(f"replay: {replay}", file=sys.stderr)
            print(stats.summary(), file=sys.stderr)
            return 1
        if args.episode is not None:
            print("\n".join(log))
            break
        episode += 1
        now = time.monotonic()
        if now >= deadline:
            break
        if now - last_report >= 30:
            last_report = now
            print(f"[{now - start:6.0f}s] episodes {stats.episodes} requests {stats.requests} "
                  f"faults {stats.total_faults} retries {stats.retries} checks {stats.checks}",
                  flush=True)
    print(f"clean after {time.monotonic() - start:.0f}s (seed {seed})")
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
