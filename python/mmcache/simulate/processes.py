"""The simulated serving pipeline, one process each: P0, P1 and the workers, supervised.

Started with the ``spawn`` method and wired with :mod:`multiprocessing` connections carrying
:mod:`~mmcache.simulate.wire` messages (msgpack headers, tensors out of band)::

    driver (this process: supervises, shows progress, unlinks a segment left behind)
      │ events ▲
      P0 frontend ──requests──▶ P1 engine core ──requests──▶ worker 0 … worker N-1
        ▲        ◀──misses────                                   │
        └──────────────────────── results ───────────────────────┘

:mod:`.frontend` is P0, :mod:`.engine` is P1 and the workers. Ctrl-C reaches the driver
only; it then stops every child, and P0 closes (unlinks) its shared-memory ring.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, cast

from mmcache import _core
from mmcache.simulate import wire
from mmcache.simulate.config import ConfigError, RunMetrics, SimulationConfig, SimulationError
from mmcache.simulate.engine import engine_core_main, worker_main
from mmcache.simulate.frontend import frontend_main
from mmcache.simulate.workload import prepare_workload

__all__ = ["run_mode", "run_modes"]


def run_mode(
    config: SimulationConfig,
    workload: Path,
    on_progress: Callable[[int], None] | None = None,
) -> RunMetrics:
    """Run one mode's pipeline over the prepared ``workload`` and return its metrics.

    ``on_progress(completed_requests)`` is called as requests complete. On any exit (the end,
    an error, Ctrl-C) every child process is stopped and the shared-memory segment is gone.
    """
    ctx = get_context("spawn")
    to_engine, from_frontend = ctx.Pipe()
    worker_inbox = [ctx.Pipe(duplex=False) for _ in range(config.workers)]
    worker_outbox = [ctx.Pipe(duplex=False) for _ in range(config.workers)]
    events, events_sender = ctx.Pipe(duplex=False)
    processes = [
        ctx.Process(
            target=frontend_main,
            args=(config, workload, to_engine, [r for r, _ in worker_outbox], events_sender),
            name="P0 (frontend)",
        ),
        ctx.Process(
            target=engine_core_main,
            args=(from_frontend, [s for _, s in worker_inbox]),
            name="P1 (engine core)",
        ),
        *(
            ctx.Process(
                target=worker_main,
                args=(rank, worker_inbox[rank][0], worker_outbox[rank][1]),
                name=f"worker {rank}",
            )
            for rank in range(config.workers)
        ),
    ]
    segment = None
    finished = False
    try:
        with _single_threaded_children(), _sigint_ignored():
            for proc in processes:
                proc.start()
        for conn in chain([to_engine, from_frontend, events_sender], *worker_inbox, *worker_outbox):
            conn.close()
        sentinels = {proc.sentinel: proc for proc in processes}
        while True:
            for ready in wait([events, *sentinels], timeout=1.0):
                if ready is events:
                    header, _ = wire.recv(events)
                    kind = header["type"]
                    if kind == "segment":
                        segment = header["name"]
                    elif kind == "progress" and on_progress is not None:
                        on_progress(header["done"])
                    elif kind == "error":
                        error = ConfigError if header["config"] else SimulationError
                        raise error(header["message"])
                    elif kind == "result":
                        finished = True
                        return RunMetrics(**header["metrics"])
                else:
                    proc = sentinels.pop(cast(int, ready))
                    proc.join()
                    if proc.exitcode == 0:
                        continue  # P1 or a worker done after the stop message
                    raise SimulationError(
                        f"{proc.name} exited with status {proc.exitcode} during the {config.mode} "
                        "run (its traceback, if any, is above)"
                    )
    finally:
        events.close()
        _stop(processes, grace_s=10.0 if finished else 0.0)
        if segment is not None and segment in _core.list_segments():
            _core.unlink_segment(segment)  # P0 died before it could unlink its ring


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
def _sigint_ignored() -> Iterator[None]:
    """Start children with SIGINT ignored (they inherit it), so Ctrl-C reaches the driver
    only, which then stops them in order instead of each dying mid-message."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    """Start children with one BLAS thread each, like an engine's processes sharing cores."""
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_modes(
    config: SimulationConfig,
    modes: Sequence[str],
    on_progress: Callable[[str, int, int], None] | None = None,
) -> list[RunMetrics]:
    """Run ``config`` in each of ``modes`` (in order) over one seeded workload.

    ``on_progress(stage, done, total)`` reports the workload's generation (stage
    ``"images"``) and each mode's completed requests (stage: the mode). Raises
    :class:`ConfigError` for a configuration that cannot run, before starting anything.
    """
    for mode in modes:
        config.with_mode(mode).validate()
    report = on_progress or (lambda stage, done, total: None)
    with tempfile.TemporaryDirectory(prefix="mmcache-simulate-") as directory:
        workload = prepare_workload(config, Path(directory), lambda d, t: report("images", d, t))
        return [
            run_mode(
                config.with_mode(mode),
                workload,
                lambda done, mode=mode: report(mode, done, config.requests),  # type: ignore[misc]
            )
            for mode in modes
        ]
