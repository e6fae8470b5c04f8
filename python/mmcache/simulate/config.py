"""The vocabulary of a simulation: its configuration, its metrics and its errors."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mmcache.arguments import MAX_CAPACITY_GB
from mmcache.factory import MODES
from mmcache.simulate.workload import TARGET_SIDE

#: Bytes of one processed item: float32 pixel values plus the two int64 original sides.
ITEM_BYTES = 3 * TARGET_SIDE * TARGET_SIDE * 4 + 2 * 8
#: Workers beyond this many per CPU core only measure the machine's scheduler.
MAX_WORKERS_PER_CPU = 4
#: Reader slots of a ring (the core's limit on ``n_readers``): shm mode's bound on workers,
#: whatever the CPUs.
MAX_SHM_WORKERS = 64
#: The drift rate is capped so that a lost request is resubmitted a bounded number of times.
MAX_DRIFT = 0.5
#: The popularity table takes 16 bytes per catalogue image in every P0.
MAX_CATALOGUE = 1_000_000
#: Zipf exponents above this put all popularity on the first few images anyway.
MAX_ZIPF = 10.0
MAX_ITEMS = 64
MAX_SEED = 2**63 - 1
MAX_REQUESTS = 10**15
MAX_HOSTS = 8
#: Frontends (P0 processes) of one host: each is a writer slot of the host's store.
MAX_FRONTENDS = 8
#: Requests in flight per frontend, at most: far more than keeps every process of a run busy
#: (P0 reads its results as they come, so no number of them can wedge the pipes).
MAX_INFLIGHT = 256
#: How long a frontend waits, by default, for an image another frontend is processing.
CLAIM_WAIT_S = 5.0
#: ``--remote`` URLs that start a server for the run instead of naming one.
AUTO_REMOTES = ("redis://auto", "valkey://auto", "mooncake://auto")


def shown_remote(url: str) -> str:
    """``--remote`` as a message or a report may show it: without its credentials
    (``user:password@``, a ``password=`` option), which the URL may carry."""
    try:
        from mmcache.remote.backend import redact_url
    except ImportError:  # no remote extra: the scheme alone says which store was meant
        return url.split("://", 1)[0] + "://..." if "://" in url else "<a URL>"
    return redact_url(url)


class ConfigError(ValueError):
    """A simulation that cannot run as configured (bad value, or too little memory)."""


class SimulationError(RuntimeError):
    """A simulation that stopped before the end (a process failed or exited)."""


@dataclass(frozen=True)
class SimulationConfig:
    """One simulated run. The defaults make ``mmcache simulate``'s default workload."""

    mode: str = "shm"
    requests: int = 1000
    catalogue: int = 1000
    zipf: float = 1.2
    max_items: int = 4
    capacity_gb: float = 0.5
    workers: int = 2
    inflight: int = 4
    inject_drift: float = 0.0
    seed: int = 0
    #: URL of the remote tier every host shares (``redis://auto``: start one), or ``None``.
    remote: str | None = None
    #: Independent pipelines (each its own P0, P1, workers and ring): stand-ins for hosts.
    hosts: int = 1
    #: P0 processes per host, splitting its request stream and sharing its P1, workers and
    #: store (``shm``: one ring, single flight; ``none``/``processor_only``: a cache each).
    frontends: int = 1
    #: With several frontends (or a remote tier): how long a frontend waits for an item
    #: another one claimed (is processing) before processing it itself.
    claim_wait_s: float = CLAIM_WAIT_S

    def __post_init__(self) -> None:
        # A URL's scheme has no case, and the remote tier reads it so: the checks, the label
        # and which server ``*://auto`` starts read it in lower case too.
        if self.remote is not None:
            scheme, sep, rest = self.remote.partition("://")
            if sep:
                object.__setattr__(self, "remote", f"{scheme.lower()}{sep}{rest}")

    def with_mode(self, mode: str) -> SimulationConfig:
        """The same run in another cache mode."""
        return replace(self, mode=mode)

    def without_remote(self) -> SimulationConfig:
        """The same run without the remote tier."""
        return replace(self, remote=None)

    def with_frontends(self, frontends: int) -> SimulationConfig:
        """The same run with ``frontends`` P0 processes per host."""
        return replace(self, frontends=frontends)

    @property
    def label(self) -> str:
        """How a report names this run: the mode, the remote tier's scheme if any, and the
        number of frontends if more than one."""
        label = self.mode
        if self.remote is not None:
            label += f" + {self.remote.split(':', 1)[0]}"
        if self.frontends > 1:
            label += f", {self.frontends} frontends"
        return label

    def compared(self, modes: Sequence[str] = MODES) -> list[SimulationConfig]:
        """The runs ``--compare`` makes of this one: each of ``modes`` (with a remote tier:
        this mode without and with it); with several frontends, also this run with one
        frontend beside it, and ``lru`` with one frontend (its P1 mirrors one P0)."""
        runs = (
            [self.with_mode(mode) for mode in modes]
            if self.remote is None
            else [self.without_remote(), self]
        )
        if self.frontends == 1:
            return runs
        compared: list[SimulationConfig] = []
        for run in runs:
            if run.mode == "lru":
                compared.append(run.with_frontends(1))
                continue
            if run == self:
                compared.append(run.with_frontends(1))
            compared.append(run)
        return compared

    @property
    def request_items(self) -> int:
        """The most images one request holds: ``max_items``, or the whole catalogue when it
        is smaller (a request's images are distinct)."""
        return min(self.max_items, self.catalogue)

    def frontend_requests(self, frontend: int) -> int:
        """How many of a host's requests ``frontend`` serves: the stream is dealt out in
        turn (request ``i`` to frontend ``i % frontends``)."""
        return len(range(frontend, self.requests, self.frontends))

    def validate(self) -> None:
        """Raise :class:`ConfigError`, with a one-line reason, for a run that cannot work."""
        cpus = os.cpu_count() or 1
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        for name in ("requests", "catalogue", "max_items", "inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        for name, limit, why in (
            ("requests", MAX_REQUESTS, ""),
            ("catalogue", MAX_CATALOGUE, " (its popularity table lives in every P0)"),
            ("max_items", MAX_ITEMS, " images per request"),
        ):
            if getattr(self, name) > limit:
                raise ConfigError(f"--{name.replace('_', '-')} must be at most {limit:,}{why}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"--seed must be between 0 and {MAX_SEED}, not {self.seed}")
        if not 1 <= self.workers <= MAX_WORKERS_PER_CPU * cpus:
            raise ConfigError(
                f"--workers must be between 1 and {MAX_WORKERS_PER_CPU * cpus} on this machine "
                f"({cpus} CPUs), not {self.workers}"
            )
        if self.mode == "shm" and self.workers > MAX_SHM_WORKERS:
            raise ConfigError(
                f"--workers must be at most {MAX_SHM_WORKERS} in mode shm (a ring has "
                f"{MAX_SHM_WORKERS} reader slots), not {self.workers}"
            )
        if not 0 <= self.zipf <= MAX_ZIPF:  # also refuses nan
            raise ConfigError(f"--zipf must be between 0 and {MAX_ZIPF:g}, not {self.zipf}")
        if not 0 <= self.inject_drift <= MAX_DRIFT:
            raise ConfigError(
                f"--inject-drift must be between 0 and {MAX_DRIFT}, not {self.inject_drift}"
            )
        if not 1 <= self.inflight <= MAX_INFLIGHT:
            raise ConfigError(
                f"--inflight must be between 1 and {MAX_INFLIGHT}, not {self.inflight}"
            )
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ConfigError(f"--hosts must be between 1 and {MAX_HOSTS}, not {self.hosts}")
        self._validate_frontends()
        if self.remote is not None:
            self._validate_remote()
        self._validate_capacity()

    def _validate_capacity(self) -> None:
        # Every mode's P0 makes a cache of this capacity (``none``'s holds nothing).
        if not (math.isfinite(self.capacity_gb) and self.capacity_gb >= 0):
            raise ConfigError(
                f"--capacity-gb must be a finite number of GiB >= 0, not {self.capacity_gb}"
            )
        if self.mode != "none":
            needed = self.request_items * ITEM_BYTES
            if self.capacity_gb * 2**30 < needed:
                raise ConfigError(
                    f"--capacity-gb {self.capacity_gb:g} cannot hold one request's "
                    f"{self.request_items} items of {ITEM_BYTES / 2**20:.1f} MiB in mode "
                    f"{self.mode}; "
                    f"use at least {math.ceil(needed / 2**30 * 1000) / 1000:g}"
                )
        if self.mode == "shm":
            usage = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
            free = 0 if usage is None else usage.free
            # A tmpfs without a size limit (size=0) reports no blocks at all: nothing to check.
            limited = usage is None or usage.total > 0
            if limited and self.hosts * self.capacity_gb * 2**30 > free:
                each = f" for each of {self.hosts} hosts" if self.hosts > 1 else ""
                raise ConfigError(
                    f"--capacity-gb {self.capacity_gb:g}{each} is more than the "
                    f"{free / 2**30:.2f} GiB free in /dev/shm; lower it or enlarge /dev/shm "
                    "(docker: --shm-size)"
                )
        if self.capacity_gb > MAX_CAPACITY_GB:
            raise ConfigError(
                f"--capacity-gb must be at most {MAX_CAPACITY_GB} GiB (16 TiB, the most a cache "
                f"holds), not {self.capacity_gb:g}"
            )

    def _validate_frontends(self) -> None:
        if not 1 <= self.frontends <= MAX_FRONTENDS:
            raise ConfigError(
                f"--frontends must be between 1 and {MAX_FRONTENDS}, not {self.frontends}"
            )
        if self.requests < self.frontends:
            raise ConfigError(
                f"--requests {self.requests} leaves a frontend without requests: use at least "
                f"--frontends ({self.frontends})"
            )
        if not (math.isfinite(self.claim_wait_s) and self.claim_wait_s >= 0):
            raise ConfigError(
                f"--claim-wait-s must be a finite number of seconds >= 0, not {self.claim_wait_s}"
            )
        if self.mode == "lru" and self.frontends > 1:
            raise ConfigError(
                "--mode lru cannot run with --frontends above 1: P1's cache mirrors the LRU of "
                "one P0, and a second P0 would drift from it on every request (vLLM turns the "
                "IPC cache off with several API servers); use shm (one store every frontend "
                "shares) or processor_only (a cache per frontend)"
            )

    def _validate_remote(self) -> None:
        remote = self.remote or ""
        if self.mode == "none":
            raise ConfigError(
                "--remote needs a P0 cache to put remote hits in: use --mode processor_only, "
                "lru or shm"
            )
        scheme = remote.split("://", 1)[0] if "://" in remote else ""
        if scheme not in ("redis", "rediss", "valkey", "valkeys", "mooncake"):
            raise ConfigError(
                f"--remote {shown_remote(remote)}: expected redis://HOST:PORT, valkey://HOST:PORT, "
                f"mooncake://HOST:PORT or one of {', '.join(AUTO_REMOTES)}"
            )
        if remote.endswith("://auto"):
            if remote not in AUTO_REMOTES:
                raise ConfigError(
                    f"--remote {shown_remote(remote)}: only {', '.join(AUTO_REMOTES)} start a "
                    "server"
                )
            return
        # Checked here rather than by each P0 as it makes its cache: once, before anything
        # starts. Only the scheme is shown: the rest may hold a password.
        expected = f"expected {scheme}://HOST:PORT"
        try:
            parts = urlsplit(remote)
            hostname = parts.hostname
        except ValueError:  # an unclosed or invalid [IPv6] host
            raise ConfigError(
                f"--remote {scheme}://: bad host (an IPv6 address goes in brackets, "
                f"[::1]); {expected}"
            ) from None
        if not hostname:
            raise ConfigError(f"--remote {scheme}://: no host; {expected}")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(
                f"--remote {scheme}://: bad port (not a number from 0 to 65535); {expected}"
            ) from None
        if port is None and scheme == "mooncake":
            raise ConfigError(f"--remote {scheme}://: no port (the master's); {expected}")


@dataclass
class RunMetrics:
    """What one simulated run measured, summed over its hosts and their frontends (see
    :mod:`mmcache.simulate.report` for the meaning); ``per_host`` and ``per_frontend``
    break it down."""

    mode: str
    requests: int
    items: int
    workers: int
    elapsed_s: float
    requests_per_s: float
    items_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    hit_ratio: float
    items_processed: int
    processing_s: float
    processing_s_saved: float
    bytes_moved: int
    payload_bytes_moved: int
    bytes_saved: int
    shm_bytes_written: int
    evictions: int | None
    served_uncached: int
    dropped_updates: int
    retries: int
    unrecovered: int
    tensors_checked: int
    wrong_tensors: int
    label: str = ""
    hosts: int = 1
    remote: str | None = None
    distinct_images: int = 0
    remote_hits: int = 0
    cross_host_hits: int = 0
    remote_processing_s_saved: float = 0.0
    remote_puts: int = 0
    remote_errors: int = 0
    remote_claims: int = 0
    remote_claim_waits: int = 0
    remote_claim_wait_hits: int = 0
    remote_get_p50_ms: float = 0.0
    remote_get_p99_ms: float = 0.0
    remote_put_p50_ms: float = 0.0
    remote_put_p99_ms: float = 0.0
    per_host: list[dict[str, Any]] = field(default_factory=list)
    frontends: int = 1
    claim_waits: int = 0
    per_frontend: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.label = self.label or self.mode

    def to_dict(self) -> dict[str, Any]:
        """The metrics as plain JSON-friendly values."""
        return asdict(self)

    @property
    def processed_per_image(self) -> float:
        """Items processed per distinct image served (1.0: each processed once, anywhere)."""
        return self.items_processed / self.distinct_images if self.distinct_images else 0.0

    @property
    def ok(self) -> bool:
        """Every worker got the right tensors, and every drift was recovered by one retry."""
        return self.wrong_tensors == 0 and self.unrecovered == 0
