"""Faults injected into the real servers of :mod:`mmcache.remote.local_server`: a crash
(SIGKILL), a stall (SIGSTOP: the server keeps its connections and answers nothing), the
resume after it, and a restart on the same ports."""

from __future__ import annotations

import os
import signal

from mmcache.remote.local_server import LocalServer

__all__ = ["kill", "restart", "resume", "stall"]


def _signal(server: LocalServer, signum: signal.Signals) -> None:
    if server.pid is None:
        raise RuntimeError(f"{server!r} is not running")
    os.kill(server.pid, signum)


def kill(server: LocalServer) -> None:
    """SIGKILL the server (a crash) and reap it."""
    _signal(server, signal.SIGKILL)
    server.stop()


def stall(server: LocalServer) -> None:
    """Stop the server (SIGSTOP) until :func:`resume`."""
    _signal(server, signal.SIGSTOP)


def resume(server: LocalServer) -> None:
    """Continue a stalled server (SIGCONT)."""
    _signal(server, signal.SIGCONT)


def restart(server: LocalServer) -> None:
    """Kill the server and start a fresh, empty one on the same ports."""
    kill(server)
    server.start()
