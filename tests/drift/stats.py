"""What a drift-fuzzing run exercised: the counters every model adds to."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["FuzzStats"]


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
    mw: Counter[str] = field(default_factory=Counter)  # multi_writer: what its writers did

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
        if self.mw:
            lines.append(f"multi_writer: {dict(sorted(self.mw.items()))}")
        return "\n".join(lines)
