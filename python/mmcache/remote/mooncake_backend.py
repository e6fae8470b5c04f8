"""Mooncake Store backend: ``MooncakeDistributedStore`` from the ``mooncake-transfer-engine``
wheels, over TCP (or RDMA where the wheel and the hosts have it).

URL: ``mooncake://MASTER_HOST:PORT`` with optional query parameters

* ``metadata`` - the transfer engine's metadata server (default: the master's built-in HTTP
  one, ``http://MASTER_HOST:8080/metadata``);
* ``segment_mb`` - memory this process contributes to the store's pool (default 256; the
  writer client mounts it, so items this host publishes live in this process);
* ``buffer_mb`` - each client's transfer buffer (default 64): the largest value it can put;
* ``protocol`` (``tcp``), ``device`` (RDMA device names), ``local_hostname`` (default: the
  address this host reaches the master from).

Two clients, as Mooncake's own integrations do: one reads, one writes (the writer thread's
puts never queue behind a request's gets).  The client's calls block in C++ with no deadline
of their own, so each runs on the client's own daemon thread and the caller waits at most
until the deadline; a call still stuck past it keeps that thread busy, later calls time out
behind it, and the store's circuit breaker stops calling until it answers again.  One
exception: ``setup()`` holds the GIL while it waits for the master, so a client is set up only
after the master's ports accept connections (a dead master then costs nothing); a master that
accepts connections but stalls during a client's set-up freezes that process until Mooncake
gives up (about 90 s in 0.3.13).  Set-up happens once per client.  Reads are
zero-copy where the API allows: ``batch_get_into`` writes each value straight into a buffer
mmcache allocated, which the decoded item's arrays then view; a value whose ``get_size`` is
over the reader's bound is :data:`~.backend.TOO_LARGE`, never allocated.

Mooncake's client logs to stderr on its own (info lines at set-up, errors for expected events
such as a metadata key not yet registered); mmcache does not silence it.
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import numpy as np

from mmcache.remote.backend import (
    TOO_LARGE,
    Fetched,
    RemoteTimeout,
    RemoteUnreachable,
    ValueTooLarge,
    WriteRefused,
    redact_url,
)
from mmcache.remote.envelope import HEADER_SIZE

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["MooncakeBackend", "import_mooncake"]

MiB = 1 << 20
_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
_NO_AVAILABLE_HANDLE = -200  # a put the store has no room for (its segments full)
_T = TypeVar("_T")


OS_LIBRARIES_HINT = (
    "Mooncake's wheel needs libibverbs, libnuma and libcurl from the OS "
    "(Debian/Ubuntu: apt-get install libibverbs1 libnuma1 libcurl4)"
)
"""What to install when the client or ``mooncake_master`` cannot load an OS library."""


def lacks_os_library(message: str) -> bool:
    """Whether the loader's ``message`` names a library :data:`OS_LIBRARIES_HINT` covers."""
    return "libibverbs" in message or "libnuma" in message or "libcurl" in message


def import_mooncake() -> Any:
    """``mooncake.store``, or an ``ImportError`` that says what to install."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        missing = str(exc)
        if lacks_os_library(missing):
            hint = OS_LIBRARIES_HINT
        else:
            hint = "install it with: pip install 'mmcache[mooncake]'"
        raise ImportError(
            f"the mooncake:// backend cannot load Mooncake ({missing}); {hint}"
        ) from exc


class _CallThread:
    """One daemon thread running a client's blocking calls, so a caller can stop waiting at
    its deadline (a stuck call cannot hold up the interpreter's exit either)."""

    def __init__(self, name: str) -> None:
        self._inbox: SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._inbox.get()) is not None:
            call, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # handed to the waiting caller
                    future.set_exception(exc)

    def call(self, function: Callable[[], _T], deadline: float, what: str) -> _T:
        future: Future[_T] = Future()
        self._inbox.put((function, future))
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            future.cancel()
            raise RemoteTimeout(f"Mooncake {what} did not answer before the deadline") from None

    def close(self, last: Callable[[], object]) -> None:
        """Run ``last`` after the calls already queued, then stop (without waiting)."""
        self._inbox.put((last, Future()))
        self._inbox.put(None)


def _mib(query: dict[str, str], name: str, default: float, shown_url: str) -> float:
    try:
        value = float(query.get(name, default))
    except ValueError:
        value = -1.0
    if not 0 < value < 1 << 30:
        raise ValueError(f"{name} must be a positive number of MiB in {shown_url!r}")
    return value


def _local_address(host: str, port: int) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        address: str = probe.getsockname()[0]
        return address


class _Client:
    """One ``MooncakeDistributedStore``, set up lazily (so a master that is down at start
    costs a miss, not an exception) and called on its own thread."""

    def __init__(self, module: Any, config: dict[str, Any], segment: int, role: str) -> None:
        self._module = module
        self._config = config
        self._segment = segment
        self._store: Any = None
        self._thread = _CallThread(f"mmcache-mooncake-{role}")

    def run(self, what: str, deadline: float, function: Callable[[Any], _T]) -> _T:
        def call() -> _T:
            if self._store is None:
                self._store = self._setup(deadline)
            return function(self._store)

        return self._thread.call(call, deadline, what)

    def _setup(self, deadline: float) -> Any:
        c = self._config
        # setup() holds the GIL while it waits for an unreachable master (about 90 s in
        # 0.3.13), which would freeze the whole engine: call it only once the master's RPC
        # and metadata ports accept connections.
        for host, port in c["endpoints"]:
            try:
                socket.create_connection(
                    (host, port), max(0.01, deadline - time.monotonic())
                ).close()
            except OSError as exc:
                raise RemoteUnreachable(
                    f"Mooncake master {host}:{port} unreachable: {exc}"
                ) from exc
        store = self._module.MooncakeDistributedStore()
        rc = store.setup(
            c["local_hostname"],
            c["metadata"],
            self._segment,
            c["buffer"],
            c["protocol"],
            c["device"],
            c["master"],
        )
        if rc != 0:
            raise RemoteUnreachable(f"Mooncake setup with master {c['master']} failed ({rc})")
        return store

    def close(self) -> None:
        def close_store() -> None:
            if self._store is not None:
                self._store.close()
                self._store = None

        self._thread.close(close_store)


class MooncakeBackend:
    """A Mooncake Store whose master is at ``url`` (see the module's docstring); a value over
    ``max_value_bytes`` of payload is :data:`~.backend.TOO_LARGE`, never an allocation."""

    def __init__(self, url: str, *, timeout_s: float, max_value_bytes: int) -> None:
        shown = redact_url(url)
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
            raise ValueError(
                f"not a Mooncake URL: {shown!r} (expected mooncake://MASTER_HOST:PORT)"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        options = {"metadata", "segment_mb", "buffer_mb", "protocol", "device", "local_hostname"}
        unknown = set(query) - options
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} in Mooncake URL {shown!r}")
        if "@" in query.get("metadata", ""):
            # Mooncake's client logs every metadata request's URL in full.
            raise ValueError(
                "Mooncake logs its metadata server's URL as written: put no user:password in "
                f"the metadata= of {shown!r}"
            )
        segment_mb, buffer_mb = (
            _mib(query, name, default, shown)
            for name, default in (("segment_mb", 256), ("buffer_mb", 64))
        )
        self._buffer = int(buffer_mb * MiB)
        self._max_size = HEADER_SIZE + max_value_bytes  # a whole value: header and payload
        # A value arrives whole (batch_get_into): the store hashes its parts after the read.
        self.part_bytes = MiB
        module = import_mooncake()
        host, port = parts.hostname, parts.port
        metadata = query.get("metadata", f"http://{host}:8080/metadata")
        endpoints = [(host, port)]
        meta = urlsplit(metadata)
        if meta.scheme == "http" and meta.hostname:
            endpoints.append((meta.hostname, meta.port or 80))
        config = {
            "master": f"{host}:{port}",
            "endpoints": endpoints,
            "metadata": metadata,
            "protocol": query.get("protocol", "tcp"),
            "device": query.get("device", ""),
            "local_hostname": query.get("local_hostname") or _local_address(host, port),
            "buffer": self._buffer,
        }
        self._reader = _Client(module, config, 0, "read")
        self._writer = _Client(module, config, int(segment_mb * MiB), "write")

    def exists(self, keys: Sequence[str], deadline: float) -> list[bool]:
        found: list[int] = self._reader.run(
            "batch_is_exist", deadline, lambda s: s.batch_is_exist(list(keys))
        )
        if len(found) != len(keys) or (keys and all(f < 0 for f in found)):
            raise RemoteUnreachable(f"Mooncake batch_is_exist failed ({found[:1]})")
        return [f == 1 for f in found]

    def read(self, keys: Sequence[str], deadline: float) -> list[Fetched]:
        def fetch(store: Any) -> list[Fetched]:
            sizes = [store.get_size(key) for key in keys]
            out: list[Fetched] = [None] * len(keys)
            if any(size < 0 and size != _NOT_FOUND for size in sizes) and not any(
                size > 0 for size in sizes
            ):
                raise RemoteUnreachable(f"Mooncake get_size failed ({min(sizes)})")
            for i, size in enumerate(sizes):
                if size > self._max_size:  # refused before anything is allocated for it
                    out[i] = TOO_LARGE
            wanted = [i for i, size in enumerate(sizes) if 0 < size <= self._max_size]
            buffers = {i: np.empty(sizes[i], dtype=np.uint8) for i in wanted}
            for buffer in buffers.values():
                if store.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
                    raise RemoteUnreachable("Mooncake register_buffer failed")
            try:
                got = store.batch_get_into(
                    [keys[i] for i in wanted],
                    [buffers[i].ctypes.data for i in wanted],
                    [sizes[i] for i in wanted],
                )
            finally:
                for buffer in buffers.values():
                    store.unregister_buffer(buffer.ctypes.data)
            for i, n in zip(wanted, got, strict=True):
                # Gone between the size and the read, or short: a miss either way.
                out[i] = buffers[i].data if n == sizes[i] else None
            return out

        return self._reader.run("batch_get_into", deadline, fetch)

    def write(self, key: str, header: bytes, payload: Buffer, deadline: float) -> bool:
        size = len(header) + memoryview(payload).nbytes
        if size > self._buffer:
            raise ValueTooLarge(
                f"{size} bytes, more than the client's buffer_mb={self._buffer / MiB:g}"
            )

        def put(store: Any) -> bool:
            if store.is_exist(key) == 1:
                return False
            rc = store.put_parts(key, header, payload)
            if rc == _NO_AVAILABLE_HANDLE:  # the master answered: no room for it
                raise WriteRefused(f"Mooncake has no space for {size} bytes ({rc})")
            if rc != 0:
                raise RemoteUnreachable(f"Mooncake put_parts failed ({rc})")
            return True

        return self._writer.run("put_parts", deadline, put)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
