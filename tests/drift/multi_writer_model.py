"""``multi_writer`` mode: several writer processes share one store (SPEC.md §3.9), with threads
in each, while readers resolve every writer's handles, and writers die.

Unlike the engine models this one is concurrent, not stepped: one episode is one store (a
small ring, so puts keep evicting), 2-4 writer *positions* and 1-2 readers.  Each position
runs a sequence of writer processes (:mod:`tests.drift.multi_writer_proc`, 2-3 threads each,
joined with the store's ``WriterHandle``), at one of two layers: the core's ``ShmWriter``
(``store``) or the engine's loop around ``ShmSenderCache.join`` (``cache``: ``is_cached`` with
``claim``/``wait_s``, prompt updates stored with the item and checked on every hit, items of
arrays).  Every process but a position's last dies:

* ``crash:<point>``: armed with a crash point of the core (``_core.CRASH_POINTS``:
  ``MMCACHE_CRASH_POINT`` and a random ``MMCACHE_CRASH_AFTER``), it SIGKILLs itself there
  (holding the store's locks mid-eviction, mid-copy, mid-publish, during a hit, right after
  filing a claim, part-way through a clear);
* ``kill_external``: the coordinator SIGKILLs it at a random moment after it joined (often a
  claim holder: the writers hold claims across pauses, and the others ``wait_for`` them).

When one dies, a replacement process joins in its place and must get a writer slot: the
store has exactly one slot per position besides the coordinator's, so once every slot has
been taken, only the dead writer's.  The
writers race on a small key space, so several put the same key at once (one wins, the others
get "already stored" and take a hit), claim the same keys and wait for each other, evict
each other's objects, invalidate and clear.  Every handle a writer issues travels (a frame on
its stdout) to every reader, a thread of the coordinator with its own reader slot.

Oracle:

(a) every handle resolves to the truth for its key, bit for bit (or is stale after a clear);
    a writer's ``read_stored`` and ``read_meta`` (``cache``: the prompt updates
    ``get_and_update`` returns) are the key's own, whichever writer put it;
(b) no hang: every wait is bounded; an episode that has not ended after ``hang_s`` dumps the
    writers' stacks (SIGUSR1, ``faulthandler``) and fails;
(c) a replacement always joins, never in a slot a live writer holds; after the episode (every writer
    gone) the store holds no claim and no reservation, every object reads back whole, a clear
    gives back every reference and the ring fills three times over; the segment is gone from
    ``/dev/shm`` once every process has closed it (the coordinator closes last, or, in every
    other episode, closes first and the last writer process unlinks it, once the readers
    have read every handle: after the last writer, a reader gets ``WriterGoneError``);
(d) nothing raises what the core must not (a writer's unexpected exception fails the run).

The schedule (which position dies how, at which pass or after how long) is deterministic in
``(seed, episode)`` and printed on failure; the interleaving is the scheduler's.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mmcache._core import (
    CRASH_POINTS,
    ShmObjectStore,
    ShmReader,
    ShmWriter,
    StaleHandleError,
    pack_item,
)
from mmcache.prompt_updates import PromptUpdatesCodec
from tests.drift.engine import OracleFailure
from tests.drift.multi_writer_proc import (
    WriterConfig,
    expected_payload,
    item,
    item_matches,
    meta,
    prompt_updates,
    read_frames,
)
from tests.drift.stats import FuzzStats

__all__ = ["FAULTS", "MODE", "Incarnation", "plan_episode", "run_multi_writer_episode"]

MODE = "multi_writer"
KiB = 1 << 10
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

FAULTS: tuple[str, ...] = (*(f"crash:{p}" for p in CRASH_POINTS), "kill_external")
"""What can end a writer process (each position's last process ends cleanly)."""


@dataclass(frozen=True)
class Incarnation:
    """One writer process of a position: how it ends."""

    crash_point: str | None = None  # armed: dies at this point's ``crash_after``-th pass
    crash_after: int = 1
    kill_after_s: float | None = None  # killed by the coordinator this long after joining

    @property
    def is_last(self) -> bool:
        return self.crash_point is None and self.kill_after_s is None

    def describe(self) -> str:
        if self.crash_point is not None:
            return f"crash at {self.crash_point} (pass {self.crash_after})"
        if self.kill_after_s is not None:
            return f"SIGKILL {self.kill_after_s:.2f}s after joining"
        return "clean"


@dataclass
class EpisodePlan:
    capacity: int
    n_readers: int
    n_keys: int
    threads: int
    ops_per_thread: int
    coordinator_closes_first: bool
    positions: list[list[Incarnation]]
    seed: int
    layer: str  # "store" (the core's writers) or "cache" (ShmSenderCache.join)

    def describe(self) -> list[str]:
        lines = [
            f"  ring {self.capacity // KiB} KiB, {self.n_readers} reader(s), {self.n_keys} "
            f"keys, {len(self.positions)} writer positions of {self.threads} threads, "
            f"{self.ops_per_thread} ops a thread, {self.layer} layer, coordinator closes "
            f"{'first' if self.coordinator_closes_first else 'last'}"
        ]
        for p, incarnations in enumerate(self.positions):
            lines.append(f"  position {p}: " + " -> ".join(i.describe() for i in incarnations))
        return lines


def plan_episode(
    rng: random.Random,
    episode: int,
    *,
    points: Sequence[str] | None = None,
    fault_rate: float | None = None,
    layer: str | None = None,
) -> EpisodePlan:
    """The episode's configuration and fault schedule.  ``points``: the crash points to arm,
    spread over the positions (default: a random draw from ``CRASH_POINTS``)."""
    n_writers = rng.choice([2, 3, 3, 4])
    rate = rng.choice([0.5, 1.0]) if fault_rate is None else fault_rate
    if points is None:
        n_faults = sum(rng.random() < rate for _ in range(2 * n_writers))
        todo: list[str | None] = [
            rng.choice(CRASH_POINTS) if rng.random() < 0.75 else None for _ in range(n_faults)
        ]
    else:
        todo = list(points)
        todo += [None] * max(1, len(todo) // 4)  # and some external kills
    rng.shuffle(todo)
    positions: list[list[Incarnation]] = [[] for _ in range(n_writers)]
    for k, point in enumerate(todo):
        if point is None:
            dies = Incarnation(kill_after_s=rng.uniform(0.05, 1.5))
        else:
            dies = Incarnation(crash_point=point, crash_after=rng.randint(1, 4))
        positions[k % n_writers].append(dies)
    for incarnations in positions:
        incarnations.append(Incarnation())
    return EpisodePlan(
        capacity=rng.choice([128, 192, 256]) * KiB,
        n_readers=rng.choice([1, 2]),
        n_keys=rng.randint(12, 48),
        threads=rng.choice([2, 3]),
        ops_per_thread=rng.randint(80, 200),
        coordinator_closes_first=episode % 2 == 1,
        positions=positions,
        seed=rng.randrange(2**32),
        layer=layer if layer is not None else ("store", "cache")[episode // 2 % 2],
    )


@dataclass
class _Process:
    """One running writer process."""

    position: int
    number: int  # which incarnation of its position
    spec: Incarnation
    popen: subprocess.Popen[bytes]
    stderr: IO[bytes]
    forwarder: threading.Thread
    joined: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # lingering, ops done
    slot: int | None = None
    joined_at: float = 0.0
    # When it surely held its slot, by its own CLOCK_MONOTONIC stamps: from its join to the
    # last frame it sent (its "closing" frame, or the last handle before it was killed).
    held_from: float = 0.0
    held_until: float = 0.0
    killed: bool = False


class _Episode:
    def __init__(self, plan: EpisodePlan, stats: FuzzStats, log: list[str], hang_s: float) -> None:
        self.plan = plan
        self.stats = stats
        self.log = log
        self.hang_s = hang_s
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.store: ShmWriter | None = ShmObjectStore.create(
            plan.capacity,
            n_readers=plan.n_readers,
            max_object_size=plan.capacity // 2,
            max_writers=len(plan.positions) + 1,
        )
        self.name = self.store.name
        self.capacity = plan.capacity
        self.writer_handle = self.store.writer_handle()
        self.readers: list[ShmReader] = [
            ShmObjectStore.attach(self.store.handle()) for _ in range(plan.n_readers)
        ]
        self.queues: list[queue.SimpleQueue[tuple[str, Any] | None]] = [
            queue.SimpleQueue() for _ in self.readers
        ]
        self.reader_threads = [
            threading.Thread(target=self._read_loop, args=(r,), daemon=True)
            for r in range(plan.n_readers)
        ]
        self.dead_slots: set[int] = set()  # slots a killed writer left
        self.unread = 0  # handles forwarded to a reader and not resolved yet
        self.released_last = False  # the lingering last writers were told to close
        # (slot, from, until, who): when each writer surely held its slot (_check_slots).
        self.held: list[tuple[int, float, float, str]] = []
        self.coordinator_slot = self.store.writer_slot
        self.running: dict[int, _Process] = {}

    def note(self, text: str) -> None:
        with self.lock:
            self.log.append(f"  t={time.monotonic() - self.start:6.2f}s {text}")

    def fail(self, text: str) -> None:
        with self.lock:
            self.failures.append(text)

    # -- readers ---------------------------------------------------------------------------

    def _read_loop(self, r: int) -> None:
        reader, q = self.readers[r], self.queues[r]
        rng = random.Random(f"{self.plan.seed}:reader:{r}")
        try:
            while (message := q.get()) is not None:
                key, handle = message
                copy = rng.random() < 0.5
                try:
                    if self.plan.layer == "cache":
                        resolved = reader.resolve_item(handle, key, copy=copy)
                        ok = item_matches(resolved, self.plan.seed, key, self.capacity)
                        del resolved  # zero-copy views keep the object alive
                    else:
                        got = reader.resolve(handle, key, copy=copy)
                        expected = expected_payload(self.plan.seed, key, self.capacity)
                        ok = bytes(memoryview(got)) == expected
                        del got
                except StaleHandleError:  # a clear (or a killed clear) dropped it
                    with self.lock:
                        self.stats.mw["stale_handles"] += 1
                    continue
                finally:
                    with self.lock:
                        self.unread -= 1
                if not ok:
                    self.fail(f"(a) reader {r} resolved a handle of {key!r} to foreign bytes")
                with self.lock:
                    self.stats.mw["handles_resolved"] += 1
                    self.stats.items_checked += 1
                    self.stats.checks += 1
        except Exception as exc:  # (d): a reader raised what it must not
            self.fail(f"(d) reader {r} raised {exc!r}")

    # -- writers ---------------------------------------------------------------------------

    def _spawn(self, position: int, number: int) -> None:
        spec = self.plan.positions[position][number]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_CRASH_")}
        ops = self.plan.ops_per_thread
        if spec.crash_point is not None:
            env["MMCACHE_CRASH_POINT"] = spec.crash_point
            env["MMCACHE_CRASH_AFTER"] = str(spec.crash_after)
            # It runs until it dies there, or the budget runs out ("unreached"): a generous
            # one, as some points are rare on a busy machine (`lab.split` needs 1-4 carves
            # with room left, and a ring the others keep full takes buffers back early).
            ops *= 40
        elif spec.kill_after_s is not None:
            ops *= 10
        config = WriterConfig(
            handle=self.writer_handle,
            universe=self.plan.seed,
            n_keys=self.plan.n_keys,
            seed=self.plan.seed + 7919 * (position + 1) + 104729 * number,
            threads=self.plan.threads,
            ops_per_thread=ops,
            crash_point=spec.crash_point,
            wait_s=0.5,
            hold_s=0.05,
            linger=self.plan.coordinator_closes_first and spec.is_last,
            layer=self.plan.layer,
        )
        # Closed when the process has exited (``_on_exit``, or the abort in ``run``).
        stderr = tempfile.TemporaryFile()  # noqa: SIM115
        popen = subprocess.Popen(
            [sys.executable, "-m", "tests.drift.multi_writer_proc"],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert popen.stdin is not None and popen.stdout is not None
        proc = _Process(position, number, spec, popen, stderr, threading.Thread())
        proc.forwarder = threading.Thread(
            target=self._forward, args=(proc, popen.stdout), daemon=True
        )
        proc.forwarder.start()
        popen.stdin.write(pickle.dumps(config))
        if config.linger:
            popen.stdin.flush()  # closed when the coordinator has left
        else:
            popen.stdin.close()
        self.running[position] = proc
        self.note(f"position {position} #{number} started (pid {popen.pid}): {spec.describe()}")

    def _forward(self, proc: _Process, stdout: IO[bytes]) -> None:
        """Hands each handle a writer issued to every reader."""
        for message in read_frames(stdout):
            kind = message[0]
            if kind == "handle":
                with self.lock:
                    self.unread += len(self.queues)
                for q in self.queues:
                    q.put((message[1], message[2]))
                proc.held_until = message[3]
            elif kind == "joined":
                self._joined(proc, message[1], message[2])
            elif kind == "closing":
                proc.held_until = message[1]
            elif kind == "done":
                proc.done.set()
            elif kind == "counts":
                with self.lock:
                    self.stats.mw.update(message[1])
            elif kind == "error":
                self.fail(f"writer at position {proc.position} #{proc.number}: {message[1]}")
        stdout.close()

    def _joined(self, proc: _Process, slot: int, at: float) -> None:
        if slot in self.dead_slots:
            with self.lock:
                self.stats.mw["slot_reused"] += 1
        proc.slot = slot
        proc.held_from = proc.held_until = at
        proc.joined_at = time.monotonic()
        proc.joined.set()
        self.note(f"position {proc.position} #{proc.number} joined slot {slot}")

    def _check_slots(self) -> None:
        """Oracle (c): no two writers held one slot at once (a replacement reuses a dead
        writer's slot once every other slot has been taken).  Judged on the intervals each
        writer surely held its slot (its own stamps), so no frame order between pipes can
        fake an overlap."""
        by_slot: dict[int | None, list[tuple[float, float, str]]] = {}
        for slot, start, end, who in self.held:
            by_slot.setdefault(slot, []).append((start, end, who))
        for slot, spans in by_slot.items():
            spans.sort()
            for (_, end, who), (start, _, other) in itertools.pairwise(spans):
                if start < end:
                    self.fail(f"(c) {other} joined slot {slot} while {who} held it")

    def _stderr_tail(self, proc: _Process) -> str:
        proc.stderr.seek(0)
        return proc.stderr.read().decode(errors="replace")[-3000:]

    def _on_exit(self, proc: _Process, rc: int) -> None:
        proc.forwarder.join(30)
        if proc.slot is not None:
            who = f"position {proc.position} #{proc.number} (pid {proc.popen.pid})"
            self.held.append((proc.slot, proc.held_from, proc.held_until, who))
        spec = proc.spec
        what = f"position {proc.position} #{proc.number} (slot {proc.slot})"
        if rc == -signal.SIGKILL and (proc.killed or spec.crash_point is not None):
            fault = "kill_external" if proc.killed else f"crash:{spec.crash_point}"
            with self.lock:
                self.stats.faults[fault] += 1
            if proc.slot is not None:
                self.dead_slots.add(proc.slot)
            self.note(f"{what} died: {fault}")
        elif rc == 0:
            if spec.crash_point is not None:
                with self.lock:
                    self.stats.mw[f"unreached:{spec.crash_point}"] += 1
            elif spec.kill_after_s is not None:
                with self.lock:
                    self.stats.mw["kill_missed"] += 1
            self.note(f"{what} finished cleanly")
        else:
            self.fail(
                f"(d) writer {what} exited with status {rc} ({spec.describe()}):\n"
                f"{self._stderr_tail(proc)}"
            )
        proc.stderr.close()

    def _replace(self, proc: _Process) -> None:
        """Start the next process of a finished one's position (if any)."""
        del self.running[proc.position]
        if proc.number + 1 < len(self.plan.positions[proc.position]):
            with self.lock:
                self.stats.mw["replacements"] += 1
            self._spawn(proc.position, proc.number + 1)

    def _hang(self) -> None:
        for proc in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGUSR1)
        time.sleep(2)
        stacks = "\n".join(
            f"--- position {p.position} #{p.number}:\n{self._stderr_tail(p)}"
            for p in self.running.values()
        )
        self.fail(f"(b) the episode did not end within {self.hang_s:.0f}s:\n{stacks}")

    def _maybe_close_coordinator(self) -> None:
        """In every other episode the coordinator leaves first, once every position runs its
        last (clean) process, which waits for it; then, once those have done their work and
        the readers have read every handle (after the last writer leaves, a reader gets
        ``WriterGoneError``), the writer processes close: the last one unlinks the segment."""
        if not self.plan.coordinator_closes_first or self.released_last:
            return
        if len(self.running) < len(self.plan.positions):
            return
        for proc in self.running.values():
            last = proc.number + 1 == len(self.plan.positions[proc.position])
            if not last or not proc.joined.is_set():
                return
        if self.store is not None:
            self.held.append(
                (self.coordinator_slot, self.start, time.monotonic(), "the coordinator")
            )
            self.store.close()
            self.store = None
            self.note("coordinator closed its writer")
        with self.lock:
            unread = self.unread
        if unread or not all(proc.done.is_set() for proc in self.running.values()):
            return
        self.released_last = True
        for proc in self.running.values():
            assert proc.popen.stdin is not None
            proc.popen.stdin.close()
        self.note("the last writers were told to close")

    def run(self) -> None:
        for t in self.reader_threads:
            t.start()
        try:
            for position in range(len(self.plan.positions)):
                self._spawn(position, 0)
            deadline = self.start + self.hang_s
            while self.running and not self.failures:
                time.sleep(0.01)
                for proc in list(self.running.values()):
                    rc = proc.popen.poll()
                    if rc is None:
                        kill_after = proc.spec.kill_after_s
                        if (
                            kill_after is not None
                            and proc.joined.is_set()
                            and time.monotonic() >= proc.joined_at + kill_after
                        ):
                            proc.killed = True
                            proc.popen.kill()
                        continue
                    self._on_exit(proc, rc)
                    self._replace(proc)
                self._maybe_close_coordinator()
                if time.monotonic() > deadline:
                    self._hang()
        finally:
            for proc in self.running.values():  # only after a failure
                proc.popen.kill()
                if proc.popen.stdin is not None:
                    proc.popen.stdin.close()
                proc.popen.wait()
                proc.stderr.close()
            self.running.clear()
            for q in self.queues:
                q.put(None)
            for t in self.reader_threads:
                t.join(self.hang_s)
                if t.is_alive():
                    self.fail("(b) a reader did not finish its handles")
        if self.store is not None:
            self.held.append(
                (self.coordinator_slot, self.start, time.monotonic(), "the coordinator")
            )
        self._check_slots()
        if not self.failures:
            self._check_store()
        self._close()
        if self.failures:
            raise OracleFailure("\n".join(self.failures))

    # -- after the episode -----------------------------------------------------------------

    def _check_store(self) -> None:
        store = self.store
        if store is None:
            return
        u = self.plan.seed
        keys = store.keys()
        codec = PromptUpdatesCodec()
        for key in keys:
            self.stats.checks += 2
            if self.plan.layer == "cache":
                payload = pack_item(item(u, key, self.capacity))
                meta_ok = codec.decode(store.read_meta(key)) == prompt_updates(u, key)
            else:
                payload = expected_payload(u, key, self.capacity)
                meta_ok = store.read_meta(key) == meta(u, key)
            if store.read_stored(key) != payload:
                self.fail(f"(a) {key!r} reads back other bytes after the episode")
            if not meta_ok:
                self.fail(f"(a) {key!r} reads back other metadata after the episode")
        store.clear()  # gives back the references dead writers left owed
        if store.stats()["outstanding_refs"] != 0:
            self.fail("(c) references outstanding after a clear")
        # The dead writers' space came back: fill the ring three times over.
        written, i = 0, 0
        while written < 3 * self.capacity:
            key = f"fill{i}"
            handle = store.put(key, [key.encode() * 64, key.encode() * 256], meta=b"fill")
            for reader in self.readers:
                if reader.resolve(handle, key) != store.read_stored(key):
                    self.fail(f"(a) {key!r} resolved to foreign bytes after the episode")
            written += 320 * len(key)
            i += 1
        # Dead writers' reservations are reclaimed by the allocator's sweep, their claims
        # when the index needs room or by stats(): after the fill, nothing of theirs is left.
        stats = store.stats()
        for what in ("claims", "chunks_reserved"):
            if stats[what] != 0:
                self.fail(f"(c) {stats[what]} {what} left after the fill, every other writer gone")
        if not 0 <= stats["bytes_in_use"] <= stats["capacity"]:
            self.fail(f"(c) bytes_in_use {stats['bytes_in_use']} out of range")
        if stats["objects"] != len(store.keys()):
            self.fail(f"(c) {stats['objects']} objects counted, {len(store.keys())} keyed")
        self.stats.mw["episode_checks"] += 1

    def _close(self) -> None:
        for reader in self.readers:
            reader.close()
        if self.store is not None:
            self.store.close()
            self.store = None
        # Oracle (c): every process of the store has closed it or died, the last writer
        # closed it: the segment is gone.
        path = Path("/dev/shm") / self.name.lstrip("/")
        if path.exists():
            path.unlink()  # ours: this episode's segment, by its own name
            self.fail(f"(c) segment {self.name} left in /dev/shm after every process closed it")


def run_multi_writer_episode(
    seed: int,
    episode: int,
    stats: FuzzStats,
    *,
    log: list[str] | None = None,
    points: Sequence[str] | None = None,
    fault_rate: float | None = None,
    layer: str | None = None,
    hang_s: float = 120.0,
) -> None:
    """One episode of the ``multi_writer`` model (see the module's docstring); raises
    :class:`OracleFailure`.  The schedule is deterministic in ``(seed, episode)`` (and
    ``points``, the crash points to arm; default: drawn at random).  ``layer``: what the
    writers are, ``"store"`` (the core's ``ShmWriter``) or ``"cache"``
    (``ShmSenderCache.join``); default: two episodes of each in turn."""
    rng = random.Random(f"{seed}:{episode}")
    plan = plan_episode(rng, episode, points=points, fault_rate=fault_rate, layer=layer)
    log = log if log is not None else []
    log.append(f"episode {episode}: mode {MODE}")
    log.extend(plan.describe())
    stats.modes[MODE] += 1
    stats.episodes += 1
    _Episode(plan, stats, log, hang_s).run()
