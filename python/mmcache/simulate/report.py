"""What ``mmcache simulate`` shows and writes: tables, the JSON figures and the PNG chart.

Metrics (one :class:`~mmcache.simulate.processes.RunMetrics` per mode):

- ``requests_per_s`` / ``items_per_s``: completed requests (items) over the wall time from the
  first request to the last completion (process start-up not included);
- ``latency_p50_ms`` / ``latency_p99_ms``: from P0 receiving a request to every worker having
  verified it, retries included;
- ``hit_ratio``: the fraction of P0's item lookups that found the item cached (so P0 did not
  process it);
- ``bytes_moved``: everything sent between processes over pipes (headers and tensors);
  ``bytes_saved``: tensor bytes the ``none`` mode would have sent for the same requests
  (P0 → P1 and P1 → each worker) minus the tensor bytes sent; ``shm_bytes_written``: tensor
  bytes P0 wrote into the shared-memory ring instead;
- ``processing_s_saved``: items P0 did not process times the mean processing time;
- ``evictions``, ``served_uncached``, ``dropped_updates`` (``--inject-drift``), ``retries``
  (requests resent after a cache miss), ``unrecovered`` (a retry that missed again),
  ``wrong_tensors`` (out of ``tensors_checked``): the last two must be 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mmcache.simulate.config import RunMetrics, SimulationConfig

#: Required speed-up of ``shm`` over ``none``, and the largest hit-ratio gap to ``lru``.
TARGET_SPEEDUP = 3.0
TARGET_HIT_GAP = 0.02


def _bytes(value: float) -> str:
    """``value`` bytes in B, KiB, MiB or GiB."""
    if abs(value) < 1024:
        return f"{value:,.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:,.2f} {unit}"
    return f"{value / 1024:,.2f} GiB"


_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("requests_per_s", "requests/s", "{:,.1f}".format),
    ("items_per_s", "items/s", "{:,.1f}".format),
    ("latency_p50_ms", "latency p50", "{:,.1f} ms".format),
    ("latency_p99_ms", "latency p99", "{:,.1f} ms".format),
    ("hit_ratio", "hit ratio", "{:.1%}".format),
    ("items_processed", "items processed", "{:,}".format),
    ("processing_s_saved", "processing saved", "{:,.1f} s".format),
    ("bytes_moved", "bytes moved between processes", _bytes),
    ("bytes_saved", "bytes saved", _bytes),
    ("shm_bytes_written", "bytes written to shared memory", _bytes),
    ("evictions", "evictions", lambda v: "-" if v is None else f"{v:,}"),
    ("served_uncached", "served uncached", "{:,}".format),
    ("dropped_updates", "dropped updates (injected)", "{:,}".format),
    ("retries", "drift retries", "{:,}".format),
    ("unrecovered", "unrecovered requests", "{:,}".format),
    ("wrong_tensors", "wrong tensors", "{:,}".format),
    ("tensors_checked", "tensors checked", "{:,}".format),
    ("elapsed_s", "elapsed", "{:,.1f} s".format),
]


def speedups(runs: Sequence[RunMetrics]) -> dict[str, float]:
    """Each mode's requests/s over the ``none`` mode's (empty without a ``none`` run)."""
    base = next((r for r in runs if r.mode == "none"), None)
    if base is None:
        return {}
    return {r.mode: r.requests_per_s / base.requests_per_s for r in runs}


def targets(runs: Sequence[RunMetrics]) -> list[dict[str, Any]]:
    """The project's targets, where the runs include the modes they compare."""
    by_mode = {r.mode: r for r in runs}
    shm, lru, none = by_mode.get("shm"), by_mode.get("lru"), by_mode.get("none")
    found = []
    if shm and none:
        ratio = shm.requests_per_s / none.requests_per_s
        found.append(
            {
                "target": f"shm requests/s >= {TARGET_SPEEDUP:g}x none",
                "value": f"{ratio:.2f}x",
                "met": ratio >= TARGET_SPEEDUP,
            }
        )
    if shm and lru:
        ratio = shm.requests_per_s / lru.requests_per_s
        found.append(
            {"target": "shm requests/s ahead of lru", "value": f"{ratio:.2f}x", "met": ratio > 1.0}
        )
        gap = shm.hit_ratio - lru.hit_ratio
        found.append(
            {
                "target": f"shm hit ratio within {TARGET_HIT_GAP * 100:g} points of lru",
                "value": f"{gap * 100:+.1f} points",
                "met": gap >= -TARGET_HIT_GAP,
            }
        )
    return found


def render(config: SimulationConfig, runs: Sequence[RunMetrics], console: Console) -> None:
    """Print the runs as one table (a column per mode), then speed-ups and targets."""
    title = (
        f"mmcache simulate: {config.requests} requests of 1-{config.max_items} images, "
        f"catalogue {config.catalogue} (zipf {config.zipf:g}), {config.workers} workers, "
        f"{config.capacity_gb:g} GiB cache, seed {config.seed}"
    )
    console.print(title)
    table = Table()
    table.add_column("metric")
    for run in runs:
        table.add_column(run.mode, justify="right")
    for key, label, fmt in _ROWS:
        table.add_row(label, *(fmt(getattr(run, key)) for run in runs))
    factors = speedups(runs)
    if len(runs) > 1 and factors:
        table.add_row(
            "speed-up vs none", *(f"{factors[run.mode]:.2f}x" for run in runs), style="bold"
        )
    console.print(table)
    for target in targets(runs):
        mark = "[green]met[/]" if target["met"] else "[red]missed[/]"
        console.print(f"target: {target['target']}: {target['value']} ({mark})")


def to_json(config: SimulationConfig, runs: Sequence[RunMetrics]) -> dict[str, Any]:
    """The figures of a simulation as a JSON-ready mapping."""
    workload = {k: v for k, v in asdict(config).items() if k != "mode"}
    return {
        "config": workload,
        "runs": {run.mode: run.to_dict() for run in runs},
        "speedup_vs_none": speedups(runs),
        "targets": targets(runs),
        "ok": all(run.ok for run in runs),
    }


def write_json(path: Path, config: SimulationConfig, runs: Sequence[RunMetrics]) -> None:
    """Write :func:`to_json` to ``path``."""
    path.write_text(json.dumps(to_json(config, runs), indent=2) + "\n")


def write_plot(path: Path, runs: Sequence[RunMetrics]) -> None:
    """A PNG with two panels: requests/s per mode, and p50/p99 latency per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [run.mode for run in runs]
    positions = range(len(runs))
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    bars = throughput.bar(modes, [run.requests_per_s for run in runs], color="tab:blue")
    throughput.bar_label(bars, fmt="%.1f")
    throughput.set_title("throughput")
    throughput.set_ylabel("requests/s")
    width = 0.4
    latency.bar(
        [p - width / 2 for p in positions], [r.latency_p50_ms for r in runs], width, label="p50"
    )
    latency.bar(
        [p + width / 2 for p in positions], [r.latency_p99_ms for r in runs], width, label="p99"
    )
    latency.set_xticks(list(positions), modes)
    latency.set_title("request latency")
    latency.set_ylabel("ms")
    latency.legend()
    figure.suptitle("mmcache simulate")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
