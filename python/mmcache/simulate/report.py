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
  bytes P0 wrote into the shared-memory ring instead (the items the store took: an item two
  frontends processed at once is written once);
- ``processing_s_saved``: items P0 did not process times the mean processing time;
- ``evictions``, ``served_uncached``, ``dropped_updates`` (``--inject-drift``), ``retries``
  (requests resent after a cache miss), ``unrecovered`` (a retry that missed again),
  ``wrong_tensors`` (out of ``tensors_checked``, plus every tensor the remote tier supplied that
  differs from what processing the image gave on any host): the last two must be 0.

With ``--hosts N`` the figures are sums over the hosts (throughput: all requests over the
longest host's time) and ``per_host`` breaks them down.  With ``--frontends N`` (N P0s per
host, each serving its turn of the host's requests) the figures are sums over the frontends
too (throughput: all requests over the longest frontend's time), ``per_frontend`` breaks
them down (``host``, ``frontend``, ``requests``, ``requests_per_s``, ``hit_ratio``,
``items_processed``, ``claim_waits``, ...), and:

- ``hit_ratio`` counts as hits the lookups P0 did not process: cached, or waited for;
- ``claim_waits``: lookups of an item another frontend had claimed (was processing), waited
  for and then found in the store (single flight; a wait that times out processes the item
  again, which shows in ``processed_per_image``);
- ``distinct_images`` and ``processed_per_image`` as below (1.0: each image processed once by
  one frontend; evictions add to it as they do with one frontend).

With ``--remote``:

- ``distinct_images``: images requested on any host; ``processed_per_image``: items processed
  (on all hosts) per distinct image - 1.0 means each image was processed once, anywhere;
- ``remote_hits``: lookups the remote tier answered, so P0 did not process the item;
  ``cross_host_hits``: those of items another host had processed (none of this host's
  frontends had: with several, each keeping a cache of its own, they fetch each other's);
  ``remote_processing_s_saved``: remote hits times the mean processing time;
- ``remote_get_p50_ms`` ... ``remote_put_p99_ms``: latency of the calls that reached the store
  (a get is one request's batch); ``remote_puts``: items published; ``remote_errors``: failed
  calls and values that did not verify (each a miss);
- ``remote_claims``: misses a host claimed (single flight: it processes them while the others
  wait); ``remote_claim_waits``: misses found claimed by another host and waited for, of which
  ``remote_claim_wait_hits`` arrived in time (the rest were processed twice).

The target "items processed with the remote tier / without it" shows beside the ratio its
floor for the run's workload: distinct images over items processed without the tier (each
image processed once, anywhere).

Time spent making the simulated clients' uploads is excluded from latency and throughput.
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
#: With the remote tier, items processed per distinct image across all hosts ("about once").
TARGET_PROCESSED_PER_IMAGE = 1.1
#: Several frontends against one: the least speed-up, and items processed per distinct image
#: at most this multiple of one frontend's (single flight: no image processed twice at once).
TARGET_FRONTENDS_SPEEDUP = 1.4
TARGET_FRONTENDS_PROCESSED = 1.05


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

#: Rows shown when a run has several hosts or a remote tier.
_HOST_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("hosts", "hosts", "{:,}".format),
    ("distinct_images", "distinct images (all hosts)", "{:,}".format),
    ("processed_per_image", "items processed per distinct image", "{:.2f}".format),
]
#: Rows shown when a run has several frontends.
_FRONTEND_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("frontends", "frontends", "{:,}".format),
    ("claim_waits", "claim waits (another frontend's item)", "{:,}".format),
]
_REMOTE_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("remote_hits", "remote hits", "{:,}".format),
    ("cross_host_hits", "cross-host hits", "{:,}".format),
    ("remote_processing_s_saved", "processing saved by the remote tier", "{:,.1f} s".format),
    ("remote_get_p50_ms", "remote get p50", "{:,.2f} ms".format),
    ("remote_get_p99_ms", "remote get p99", "{:,.2f} ms".format),
    ("remote_put_p50_ms", "remote put p50", "{:,.2f} ms".format),
    ("remote_put_p99_ms", "remote put p99", "{:,.2f} ms".format),
    ("remote_puts", "remote puts", "{:,}".format),
    ("remote_errors", "remote errors", "{:,}".format),
    ("remote_claims", "remote claims (single flight)", "{:,}".format),
    ("remote_claim_waits", "waits for another host's claim", "{:,}".format),
    ("remote_claim_wait_hits", "... served from the tier", "{:,}".format),
]


def speedups(runs: Sequence[RunMetrics]) -> dict[str, float]:
    """Each run's requests/s over the ``none`` mode's (empty without a ``none`` run)."""
    base = next((r for r in runs if r.mode == "none"), None)
    if base is None:
        return {}
    return {r.label: r.requests_per_s / base.requests_per_s for r in runs}


def _local(runs: Sequence[RunMetrics], mode: str, frontends: int) -> RunMetrics | None:
    """The run of ``mode`` with ``frontends`` frontends and no remote tier, if any."""
    return next(
        (r for r in runs if r.mode == mode and r.frontends == frontends and r.remote is None),
        None,
    )


def targets(runs: Sequence[RunMetrics]) -> list[dict[str, Any]]:
    """The project's targets, where the runs include the modes they compare (runs with the
    same number of frontends; ``lru`` runs with one)."""
    found = _remote_targets(runs)
    none = next((r for r in runs if r.mode == "none" and r.remote is None), None)
    shm = _local(runs, "shm", none.frontends) if none else None
    if shm and none:
        ratio = shm.requests_per_s / none.requests_per_s
        found.append(
            {
                "target": f"shm requests/s >= {TARGET_SPEEDUP:g}x none",
                "value": f"{ratio:.2f}x",
                "met": ratio >= TARGET_SPEEDUP,
            }
        )
    lru, shm = _local(runs, "lru", 1), _local(runs, "shm", 1)
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
    return found + _frontend_targets(runs)


def _frontend_targets(runs: Sequence[RunMetrics]) -> list[dict[str, Any]]:
    """Each run with several frontends against the same run with one: throughput, hit
    ratio, and items processed per distinct image (single flight)."""
    found = []
    for many in runs:
        one = next(
            (
                r
                for r in runs
                if r.frontends == 1 and r.mode == many.mode and r.remote == many.remote
            ),
            None,
        )
        if many.frontends == 1 or one is None or not one.processed_per_image:
            continue
        ratio = many.requests_per_s / one.requests_per_s
        gap = many.hit_ratio - one.hit_ratio
        per_image = many.processed_per_image / one.processed_per_image
        n = f"{many.label}:"
        found += [
            {
                "target": f"{n} requests/s >= {TARGET_FRONTENDS_SPEEDUP:g}x one frontend",
                "value": f"{ratio:.2f}x",
                "met": ratio >= TARGET_FRONTENDS_SPEEDUP,
            },
            {
                "target": f"{n} hit ratio within {TARGET_HIT_GAP * 100:g} points of one frontend",
                "value": f"{gap * 100:+.1f} points",
                "met": gap >= -TARGET_HIT_GAP,
            },
            {
                "target": f"{n} items processed per distinct image <= "
                f"{TARGET_FRONTENDS_PROCESSED:g}x one frontend's",
                "value": f"{many.processed_per_image:.3f} vs {one.processed_per_image:.3f} "
                f"({per_image:.3f}x)",
                "met": per_image <= TARGET_FRONTENDS_PROCESSED,
            },
        ]
    return found


def _remote_targets(runs: Sequence[RunMetrics]) -> list[dict[str, Any]]:
    """With a remote tier: each image processed about once across the hosts, and (with the
    same run without the tier beside it, as many frontends) how much processing that saved."""
    tiered_runs = [r for r in runs if r.remote is not None]
    if not tiered_runs:
        return []
    # The run asked for: with several frontends, --compare puts the same run with one before it.
    tiered = max(tiered_runs, key=lambda r: r.frontends)
    per_image = tiered.processed_per_image
    found = [
        {
            "target": f"items processed per distinct image <= {TARGET_PROCESSED_PER_IMAGE:g} "
            f"across {tiered.hosts} host(s) with the remote tier",
            "value": f"{per_image:.2f}",
            "met": per_image <= TARGET_PROCESSED_PER_IMAGE,
        }
    ]
    alone = _local(runs, tiered.mode, tiered.frontends)
    if alone is not None and alone.items_processed:
        floor = tiered.distinct_images / alone.items_processed
        found.append(
            {
                "target": "items processed with the remote tier / without it (lower is better)",
                "value": f"{tiered.items_processed / alone.items_processed:.2f} "
                f"(floor {floor:.2f}: each distinct image once)",
                "met": tiered.items_processed < alone.items_processed,
            }
        )
    return found


def render(config: SimulationConfig, runs: Sequence[RunMetrics], console: Console) -> None:
    """Print the runs as one table (a column per run), then speed-ups and targets; with
    several hosts, a table per run with each host's figures."""
    hosts = f", {config.hosts} hosts" if config.hosts > 1 else ""
    hosts += f", {config.frontends} frontends" if config.frontends > 1 else ""
    title = (
        f"mmcache simulate: {config.requests} requests of 1-{config.request_items} images"
        f"{' per host' if hosts else ''}, catalogue {config.catalogue} (zipf {config.zipf:g}), "
        f"{config.workers} workers, {config.capacity_gb:g} GiB cache, seed {config.seed}{hosts}"
    )
    console.print(title)
    table = Table()
    table.add_column("metric")
    for run in runs:
        table.add_column(run.label, justify="right")
    rows = list(_ROWS)
    if any(run.frontends > 1 for run in runs):
        rows += _FRONTEND_ROWS
    if any(run.hosts > 1 or run.frontends > 1 or run.remote is not None for run in runs):
        rows += _HOST_ROWS
    if any(run.remote is not None for run in runs):
        rows += _REMOTE_ROWS
    remote_keys = {key for key, _, _ in _REMOTE_ROWS}
    for key, label, fmt in rows:
        table.add_row(
            label,
            *(
                "-" if key in remote_keys and run.remote is None else fmt(getattr(run, key))
                for run in runs
            ),
        )
    factors = speedups(runs)
    if len(runs) > 1 and factors:
        table.add_row(
            "speed-up vs none", *(f"{factors[run.label]:.2f}x" for run in runs), style="bold"
        )
    console.print(table)
    for run in runs:
        if run.hosts > 1:
            _render_hosts(run, console)
        if run.frontends > 1:
            _render_frontends(run, console)
    for target in targets(runs):
        mark = "[green]met[/]" if target["met"] else "[red]missed[/]"
        console.print(f"target: {target['target']}: {target['value']} ({mark})")


def _render_hosts(run: RunMetrics, console: Console) -> None:
    table = Table(title=f"{run.label}: per host", title_justify="left")
    columns = [
        ("host", "host", "{}"),
        ("requests", "requests", "{:,}"),
        ("requests_per_s", "req/s", "{:,.1f}"),
        ("hit_ratio", "hits", "{:.1%}"),
        ("items_processed", "processed", "{:,}"),
    ]
    if run.remote is not None:  # without a tier there is no figure of one (the rows say "-")
        columns += [
            ("remote_hits", "remote", "{:,}"),
            ("cross_host_hits", "cross-host", "{:,}"),
            ("remote_errors", "errors", "{:,}"),
        ]
    columns.append(("wrong_tensors", "wrong", "{:,}"))
    for _, title, _ in columns:
        table.add_column(title, justify="right")
    for host in run.per_host:
        table.add_row(*(fmt.format(host[name]) for name, _, fmt in columns))
    console.print(table)


def _render_frontends(run: RunMetrics, console: Console) -> None:
    table = Table(title=f"{run.label}: per frontend", title_justify="left")
    columns = [
        ("requests", "requests", "{:,}"),
        ("requests_per_s", "req/s", "{:,.1f}"),
        ("hit_ratio", "hits", "{:.1%}"),
        ("items_processed", "processed", "{:,}"),
        ("claim_waits", "claim waits", "{:,}"),
        ("wrong_tensors", "wrong", "{:,}"),
    ]
    table.add_column("frontend", justify="right")
    for _, title, _ in columns:
        table.add_column(title, justify="right")
    for frontend in run.per_frontend:
        name = f"{frontend['host']}.{frontend['frontend']}" if run.hosts > 1 else ""
        table.add_row(
            name or str(frontend["frontend"]),
            *(fmt.format(frontend[key]) for key, _, fmt in columns),
        )
    console.print(table)


def to_json(config: SimulationConfig, runs: Sequence[RunMetrics]) -> dict[str, Any]:
    """The figures of a simulation as a JSON-ready mapping."""
    workload = {k: v for k, v in asdict(config).items() if k not in ("mode", "remote")}
    return {
        "config": workload,
        "runs": {
            run.label: {**run.to_dict(), "processed_per_image": run.processed_per_image}
            for run in runs
        },
        "speedup_vs_none": speedups(runs),
        "targets": targets(runs),
        "ok": all(run.ok for run in runs),
    }


def write_json(path: Path, config: SimulationConfig, runs: Sequence[RunMetrics]) -> None:
    """Write :func:`to_json` to ``path``."""
    path.write_text(json.dumps(to_json(config, runs), indent=2) + "\n")


def plot_format(path: Path) -> str:
    """The format of the chart written to ``path``: its extension's, or PNG without one."""
    return path.suffix[1:].lower() or "png"


def write_plot(path: Path, runs: Sequence[RunMetrics]) -> None:
    """A PNG with two panels: requests/s per mode, and p50/p99 latency per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [run.label for run in runs]
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
    # The format named, not left to matplotlib: it would write `chart` as `chart.png`.
    figure.savefig(path, dpi=100, format=plot_format(path))
    plt.close(figure)
