"""The vocabulary of a simulation: its configuration, its metrics and its errors."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mmcache.factory import MODES
from mmcache.simulate.workload import TARGET_SIDE

#: Bytes of one processed item: float32 pixel values plus the two int64 original sides.
ITEM_BYTES = 3 * TARGET_SIDE * TARGET_SIDE * 4 + 2 * 8
#: Workers beyond this many per CPU core only measure the machine's scheduler.
MAX_WORKERS_PER_CPU = 4
#: The drift rate is capped so that a lost request is resubmitted a bounded number of times.
MAX_DRIFT = 0.5


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

    def with_mode(self, mode: str) -> SimulationConfig:
        """The same run in another cache mode."""
        return replace(self, mode=mode)

    def validate(self) -> None:
        """Raise :class:`ConfigError`, with a one-line reason, for a run that cannot work."""
        cpus = os.cpu_count() or 1
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        for name in ("requests", "catalogue", "max_items", "inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 1 <= self.workers <= MAX_WORKERS_PER_CPU * cpus:
            raise ConfigError(
                f"--workers must be between 1 and {MAX_WORKERS_PER_CPU * cpus} on this machine "
                f"({cpus} CPUs), not {self.workers}"
            )
        if not (math.isfinite(self.zipf) and self.zipf >= 0):
            raise ConfigError(f"--zipf must be a finite number >= 0, not {self.zipf}")
        if not 0 <= self.inject_drift <= MAX_DRIFT:
            raise ConfigError(
                f"--inject-drift must be between 0 and {MAX_DRIFT}, not {self.inject_drift}"
            )
        if self.mode == "none":
            return
        needed = self.max_items * ITEM_BYTES
        if not (math.isfinite(self.capacity_gb) and self.capacity_gb * 2**30 >= needed):
            raise ConfigError(
                f"--capacity-gb {self.capacity_gb:g} cannot hold one request's {self.max_items} "
                f"items of {ITEM_BYTES / 2**20:.1f} MiB in mode {self.mode}; use at least "
                f"{math.ceil(needed / 2**30 * 1000) / 1000:g}"
            )
        if self.mode == "shm":
            free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
            if self.capacity_gb * 2**30 > free:
                raise ConfigError(
                    f"--capacity-gb {self.capacity_gb:g} is more than the {free / 2**30:.2f} GiB "
                    "free in /dev/shm; lower it or enlarge /dev/shm (docker: --shm-size)"
                )


@dataclass
class RunMetrics:
    """What one simulated run measured (see :mod:`mmcache.simulate.report` for the meaning)."""

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

    def to_dict(self) -> dict[str, Any]:
        """The metrics as plain JSON-friendly values."""
        return asdict(self)

    @property
    def ok(self) -> bool:
        """Every worker got the right tensors, and every drift was recovered by one retry."""
        return self.wrong_tensors == 0 and self.unrecovered == 0
