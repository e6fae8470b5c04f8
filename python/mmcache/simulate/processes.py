"""The simulated serving pipelines, one process each: P0, P1 and the workers, supervised.

Started with the ``spawn`` method and wired with :mod:`multiprocessing` connections carrying
:mod:`~mmcache.simulate.wire` messages (msgpack headers, tensors out of band)::

    driver (this process: names the rings, supervises, shows progress, removes what is left)
      │ events ▲ (one pipe per P0)
      P0 frontend 0..F-1 ──requests──▶ P1 engine core ──requests──▶ worker 0 … worker N-1
        ▲               ◀──misses────                                   │
        └─────────────────────────────── results (a pipe per P0) ───────┘

With ``--frontends F`` each host runs F P0s, dealt its requests in turn, sending to the one
P1 and the same workers (in ``shm`` mode frontend 0 creates the ring and the others join it
through P1). With ``--hosts N`` the driver runs N such pipelines at once, each its own P0s,
P1, workers and ring (stand-ins for hosts), sharing only the remote tier (``--remote``;
``redis://auto`` and friends start a real server for the run).  :mod:`.frontend` is P0,
:mod:`.engine` is P1 and the workers. Ctrl-C reaches the driver only; it then stops every
child, and the last P0 of a ring to close unlinks it.  A child that dies ends the run with
one line naming it. The driver names each ring before its P0s start, so once every child
has exited it removes whatever P0s killed while creating or using their ring left, however
the run ended.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import numpy as np

from mmcache import _core
from mmcache.signals import sigint_ignored
from mmcache.simulate import wire
from mmcache.simulate.config import (
    AUTO_REMOTES,
    ITEM_BYTES,
    ConfigError,
    RunMetrics,
    SimulationConfig,
    SimulationError,
    shown_remote,
)
from mmcache.simulate.engine import engine_core_main, worker_main
from mmcache.simulate.frontend import frontend_main

__all__ = ["run_config", "run_configs", "run_modes"]

#: What produced the simulated items: part of the remote tier's namespace.
PROCESSOR_ID = "mmcache-simulate/clip448@1"


class _Pipeline:
    """One host: its P0s (frontends), P1 and the workers, and the pipes between them."""

    def __init__(
        self, ctx: Any, config: SimulationConfig, host: int, remote: dict[str, str] | None
    ) -> None:
        self.host = host
        of_host = f" of host {host}" if config.hosts > 1 else ""
        n = config.frontends
        engine_ends = [ctx.Pipe() for _ in range(n)]  # (frontend's end, P1's end)
        inbox = [ctx.Pipe(duplex=False) for _ in range(config.workers)]
        # outbox[k][rank]: worker rank -> frontend k
        outbox = [[ctx.Pipe(duplex=False) for _ in range(config.workers)] for _ in range(n)]
        events = [ctx.Pipe(duplex=False) for _ in range(n)]
        self.events = [receiver for receiver, _ in events]
        # Frontend 0 creates the ring under the name the driver picks (the others join it):
        # the driver knows it even if every P0 dies before it could say.
        self.ring = _core.generate_segment_name() if config.mode == "shm" else None
        self.processes = [
            *(
                ctx.Process(
                    target=frontend_main,
                    args=(
                        config,
                        host,
                        k,
                        remote,
                        self.ring,
                        engine_ends[k][0],
                        [r for r, _ in outbox[k]],
                        events[k][1],
                    ),
                    name=f"P0 (frontend{f' {k}' if n > 1 else ''}){of_host}",
                )
                for k in range(n)
            ),
            ctx.Process(
                target=engine_core_main,
                args=([p1 for _, p1 in engine_ends], [w for _, w in inbox]),
                name=f"P1 (engine core){of_host}",
            ),
            *(
                ctx.Process(
                    target=worker_main,
                    args=(rank, inbox[rank][0], [outbox[k][rank][1] for k in range(n)]),
                    name=f"worker {rank}{of_host}",
                )
                for rank in range(config.workers)
            ),
        ]
        self._child_ends = list(
            chain(
                chain(*engine_ends),
                (sender for _, sender in events),
                *inbox,
                *(chain(*pipes) for pipes in outbox),
            )
        )
        self.reports: list[dict[str, Any]] = []

    def start(self) -> None:
        for proc in self.processes:
            proc.start()
        for conn in self._child_ends:
            conn.close()

    def cleanup(self) -> None:
        """Once every process of the pipeline has exited: close the driver's end and remove
        the ring if every P0 died before one could (while creating it, or later)."""
        for events in self.events:
            events.close()
        if self.ring is None:
            return
        try:
            # Only this run's P0s use this name, and they are gone: the ring is left over
            # whatever its state (even an empty, unlocked file: `prune` would wait on it).
            if _core.segment_status(self.ring)[0] != "live":
                _core.unlink_segment(self.ring)
        except FileNotFoundError:
            pass  # P0 closed it, or died before it created it


def run_config(
    config: SimulationConfig, on_progress: Callable[[int], None] | None = None
) -> RunMetrics:
    """Run ``config``'s pipelines (one per host, sharing its remote tier) to the end and
    return the metrics summed over the hosts.

    ``on_progress(completed_requests)`` is called as requests complete. On any exit (the end,
    an error, Ctrl-C) every child process is stopped, every shared-memory segment is gone and a
    server started for the run is stopped.
    """
    ctx = get_context("spawn")
    with _remote_tier(config) as remote:
        pipelines = [_Pipeline(ctx, config, host, remote) for host in range(config.hosts)]
        processes = [proc for p in pipelines for proc in p.processes]
        finished = False
        try:
            with _child_environment(), sigint_ignored():
                for pipeline in pipelines:
                    pipeline.start()
            _supervise(config, pipelines, on_progress)
            finished = True
        finally:
            _stop(processes, grace_s=10.0 if finished else 0.0)
            for pipeline in pipelines:
                pipeline.cleanup()
    reports = [r for p in pipelines for r in p.reports]  # in the order they finished
    return _combine(config, sorted(reports, key=lambda r: (r["host"], r["frontend"])))


def _supervise(
    config: SimulationConfig,
    pipelines: list[_Pipeline],
    on_progress: Callable[[int], None] | None,
) -> None:
    """Relay the pipelines' events until every P0 reported its figures; raise
    :class:`SimulationError` naming the first process that failed."""
    events = {conn: p for p in pipelines for conn in p.events}
    done = dict.fromkeys(events, 0)  # completed requests, per P0
    sentinels = {proc.sentinel: proc for p in pipelines for proc in p.processes}
    while events:
        for ready in wait([*events, *sentinels], timeout=1.0):
            conn = cast(Connection, ready)
            pipeline = events.get(conn)
            if pipeline is None:
                proc = sentinels.pop(cast(int, ready))
                proc.join()
                if proc.exitcode != 0:  # P1 or a worker exits 0 after the stop message
                    raise _failure(config, pipelines)
                continue
            try:
                header, _ = wire.recv(conn)
            except (EOFError, OSError):  # P0 is gone without a word
                raise _failure(config, pipelines) from None
            kind = header["type"]
            if kind == "progress":
                done[conn] = header["done"]
                if on_progress is not None:
                    on_progress(sum(done.values()))
            elif kind == "error":
                error = ConfigError if header["config"] else SimulationError
                raise error(header["message"])
            elif kind == "result":
                pipeline.reports.append(header["report"])
                del events[conn]


def _failure(config: SimulationConfig, pipelines: list[_Pipeline]) -> SimulationError:
    """The error that names the process whose death ended the run.

    When one process dies its peers exit too (their pipes close: status
    :data:`~.wire.PEER_GONE`), in an order nobody controls; the cause is the process killed
    by a signal, else a P0 that failed otherwise, else the first that did.  The others get a
    moment to be reaped first, so the cause is known.
    """
    processes = [proc for p in pipelines for proc in p.processes]
    deadline = time.monotonic() + 2.0
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    failed = [proc for proc in processes if proc.exitcode not in (None, 0)]
    if not failed:
        return SimulationError(
            f"P0 (frontend) closed its connection to the driver during the {config.label} run"
        )
    killed = [proc for proc in failed if cast(int, proc.exitcode) < 0]
    causes = [proc for proc in failed if proc.exitcode != wire.PEER_GONE] or failed
    frontends = [proc for proc in causes if proc.name.startswith("P0")]
    culprit = (killed or frontends or causes)[0]
    code = cast(int, culprit.exitcode)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code} (its traceback, if any, is above)"
    return SimulationError(f"{culprit.name} {how} during the {config.label} run")


@contextlib.contextmanager
def _remote_tier(config: SimulationConfig) -> Iterator[dict[str, str] | None]:
    """What every host needs to share the remote tier of ``config`` (``None`` without one):
    its URL (a server started for the run for ``*://auto``, stopped afterwards), a namespace
    of this run's own and a secret shared by its hosts."""
    if config.remote is None:
        yield None
        return
    from mmcache.remote.local_server import ServerUnavailable, start_mooncake_master, start_valkey

    run = secrets.token_hex(8)
    tier = {"namespace": f"{PROCESSOR_ID}/{run}", "secret": secrets.token_hex(16)}
    if config.remote not in AUTO_REMOTES:
        yield {**tier, "url": config.remote}
        return
    try:
        server = start_mooncake_master() if config.remote.startswith("mooncake") else start_valkey()
    except ServerUnavailable as exc:
        raise ConfigError(f"--remote {config.remote}: {exc}") from None
    try:
        yield {**tier, "url": server.url}
    finally:
        server.close()


def _stop(processes: Sequence[Any], *, grace_s: float) -> None:
    """Let the children exit by themselves for ``grace_s``, then ask those still running to
    stop (SIGTERM: P0 then unlinks its ring), then kill what is left."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Start children with one BLAS thread each, like an engine's processes sharing cores."""
    settings = dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _combine(config: SimulationConfig, reports: list[dict[str, Any]]) -> RunMetrics:
    """One run's metrics from its frontends' reports, every host's (see :mod:`.report` for
    the meanings)."""

    def total(name: str) -> Any:
        return sum(r[name] for r in reports)

    # Each frontend's wrong tensors include those of the items it did not verify itself, so
    # the per-host and per-frontend rows add up to the run's.
    unverified = [_wrong_unverified_tensors(reports, of=r) for r in reports]
    for report, wrong in zip(reports, unverified, strict=True):
        report["wrong_tensors"] += wrong
    for report in reports:
        report["cross_host_hits"] = _cross_host_hits(reports, of=report)
    elapsed = max(r["elapsed_s"] for r in reports)
    requests, items, lookups, processed = (
        total(n) for n in ("requests", "items", "lookups", "processed")
    )
    mean_processing_s = total("processing_s") / processed if processed else 0.0
    latencies = np.array([v for r in reports for v in r["latencies_ms"]])
    seen = np.zeros(config.catalogue, dtype=bool)
    for r in reports:
        seen |= np.unpackbits(np.frombuffer(r["seen"], np.uint8), count=config.catalogue) > 0
    hosts = [[r for r in reports if r["host"] == host] for host in range(config.hosts)]
    per_host = [_summary(of_host) for of_host in hosts]
    remote = [r["remote"] for r in reports if r["remote"] is not None]
    remote_latency = {
        op: np.array([v for r in remote for v in r["latencies_s"][op]]) * 1e3
        for op in ("get", "put")
    }
    evictions = [_evictions(of_host) for of_host in hosts]
    # Every frontend of a host read its store's counter; the last read is the highest.
    puts = sum(max(r["store_puts"] for r in of_host) for of_host in hosts)
    return RunMetrics(
        mode=config.mode,
        label=config.label,
        hosts=config.hosts,
        remote=None if config.remote is None else shown_remote(config.remote),
        requests=requests,
        items=items,
        workers=config.workers,
        elapsed_s=elapsed,
        requests_per_s=requests / elapsed,
        items_per_s=items / elapsed,
        latency_p50_ms=float(np.percentile(latencies, 50)),
        latency_p99_ms=float(np.percentile(latencies, 99)),
        hit_ratio=total("hits") / lookups if lookups else 0.0,
        items_processed=processed,
        processing_s=total("processing_s"),
        processing_s_saved=(lookups - processed) * mean_processing_s,
        bytes_moved=total("bytes_moved"),
        payload_bytes_moved=total("payload_bytes_moved"),
        bytes_saved=total("baseline_bytes") - total("payload_bytes_moved"),
        shm_bytes_written=puts * ITEM_BYTES,
        evictions=None if None in evictions else sum(e for e in evictions if e is not None),
        served_uncached=total("served_uncached"),
        dropped_updates=total("dropped"),
        retries=total("retries"),
        unrecovered=total("unrecovered"),
        tensors_checked=total("tensors_checked"),
        wrong_tensors=total("wrong_tensors"),
        distinct_images=int(seen.sum()),
        remote_hits=total("remote_hits"),
        cross_host_hits=total("cross_host_hits"),
        remote_processing_s_saved=total("remote_hits") * mean_processing_s,
        remote_puts=sum(r["puts"] for r in remote),
        remote_errors=sum(r["errors"] for r in remote),
        remote_claims=sum(r["claims"] for r in remote),
        remote_claim_waits=sum(r["claim_waits"] for r in remote),
        remote_claim_wait_hits=sum(r["claim_wait_hits"] for r in remote),
        **{
            f"remote_{op}_p{q}_ms": float(np.percentile(v, q)) if v.size else 0.0
            for op, v in remote_latency.items()
            for q in (50, 99)
        },
        per_host=per_host,
        frontends=config.frontends,
        claim_waits=total("claim_waits"),
        per_frontend=[_summary([r]) for r in reports] if config.frontends > 1 else [],
    )


def _evictions(reports: list[dict[str, Any]]) -> int | None:
    """One host's evictions: its shared store's counter (every frontend read it; the last
    read is the highest), or the sum of its frontends' own caches'."""
    counts: list[int | None] = [r["evictions"] for r in reports]
    known = [c for c in counts if c is not None]
    if len(known) < len(counts):
        return None
    return max(known) if reports[0]["evictions_shared"] else sum(known)


def _cross_host_hits(reports: list[dict[str, Any]], *, of: dict[str, Any]) -> int:
    """The remote hits of the frontend that reported ``of`` (one of ``reports``) that were
    another host's work: of images it had not processed when it fetched them, and no other
    frontend of its host processed (their items reach it through the tier too when they
    keep a cache each, or when the shared store evicted them)."""
    processed_here = {
        image
        for r in reports
        if r["host"] == of["host"] and r is not of
        for image, _ in r["processed_truth"]
    }
    return sum(n for image, n in of["fetched_unprocessed"] if image not in processed_here)


def _wrong_unverified_tensors(reports: list[dict[str, Any]], *, of: dict[str, Any]) -> int:
    """Tensors P0 could not give the workers a truth for, checked against what processing
    the same image gave on any host or frontend (or that none of them processed at all):
    those the remote tier supplied, and those a frontend served from another frontend's
    work (the workers recorded what they received): those of the frontend that reported
    ``of``, one of ``reports``."""
    truth: dict[int, list[Any]] = {}
    for r in reports:
        for image, digests in r["processed_truth"]:
            if truth.setdefault(image, digests) != digests:
                raise SimulationError(f"image {image} was processed into different tensors twice")
    remote: int = sum(
        _differing(digests, truth.get(image, [])) for image, digests in of["remote_truth"]
    )
    shared: int = sum(
        times * _differing(digests, truth.get(image, []))
        for image, digests, times in of["deferred_truth"]
    )
    return remote + shared


def _differing(received: list[Any], truth: list[Any]) -> int:
    """The tensors of ``received`` and ``truth`` (``[name, digest]`` pairs) that differ,
    one missing on either side included: what a worker counts against its P0's truth."""
    got, expected = dict(received), dict(truth)
    return sum(got.get(name) != expected.get(name) for name in {**got, **expected})


def _summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One host's or one frontend's figures (``reports``: its frontends')."""

    def total(name: str) -> Any:
        return sum(r[name] for r in reports)

    lookups = total("lookups")
    summary: dict[str, Any] = {"host": reports[0]["host"]}
    if len(reports) == 1:
        summary["frontend"] = reports[0]["frontend"]
    return {
        **summary,
        "requests": total("requests"),
        "requests_per_s": total("requests") / max(r["elapsed_s"] for r in reports),
        "hit_ratio": total("hits") / lookups if lookups else 0.0,
        "items_processed": total("processed"),
        "claim_waits": total("claim_waits"),
        "remote_hits": total("remote_hits"),
        "cross_host_hits": total("cross_host_hits"),
        "remote_errors": sum((r["remote"] or {}).get("errors", 0) for r in reports),
        "wrong_tensors": total("wrong_tensors"),
    }


def run_configs(
    configs: Sequence[SimulationConfig],
    on_progress: Callable[[str, int, int], None] | None = None,
) -> list[RunMetrics]:
    """Run each of ``configs`` in turn (the same seeded workload, whatever else differs).

    ``on_progress(label, done, total)`` reports each run's completed requests. Raises
    :class:`ConfigError` for a configuration that cannot run, before starting anything.
    """
    for config in configs:
        config.validate()
    report = on_progress or (lambda label, done, total: None)
    return [
        run_config(
            config,
            lambda done, c=config: report(c.label, done, c.requests * c.hosts),  # type: ignore[misc]
        )
        for config in configs
    ]


def run_modes(
    config: SimulationConfig,
    modes: Sequence[str],
    on_progress: Callable[[str, int, int], None] | None = None,
) -> list[RunMetrics]:
    """:func:`run_configs` of ``config`` in each of ``modes``."""
    return run_configs([config.with_mode(mode) for mode in modes], on_progress)
