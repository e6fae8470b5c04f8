"""vLLM's processor caches against mmcache's, in a running vLLM engine (``make bench-engine``).

Four configurations (``--configs``), each its own engine (a process tree: the frontend, the
engine core, its worker), started one after another with the same workload: vLLM's own
``lru`` and ``shm`` caches, and mmcache's (``MMCACHE_VLLM=1``) in the same two modes.  Two
frontends (``--frontends``): ``llm``, this script's child running ``LLM``'s engine (below),
and ``serve``, vLLM's API server under an HTTP load generator (``bench_serve.py``).  The
workload, the model and the engine's arguments are both frontends' (``engine_workload.py``);
within a frontend every configuration must give every request the same tokens (greedy
decoding), or the script exits 1 after its table.

The ``llm`` frontend
--------------------

The model is the tiny Qwen2-VL of ``tests_engine/models.py`` (vLLM's dummy weights) with its
real image and video processors, allowed images of up to 1344 x 1344 pixels
(``mm_processor_kwargs``), so that a processed image is 1.2 to 10.6 MB of uint8 patches.
The requests come from :func:`mmcache.simulate.workload.request_stream`: 1 or 2 distinct
images each, drawn from a catalogue with a Zipf popularity (sides 448 to 1344 pixels, one
in four at least 1344 x 1092, noise, made before the clock starts); every few requests also
carry a video (16 or 12 frames of 448 x 448, 9.6 or 7.2 MB processed) from a small catalogue
of its own.  Requests go through
``LLM``'s engine (``llm.llm_engine.add_request``, which renders the prompt in the calling
thread, as ``LLM.generate`` does) in a closed loop that keeps ``--concurrency`` requests in
flight, so a request's first token does not wait for the rendering of the whole batch.

Reported per configuration:

* requests/s over the timed loop; TTFT p50/p99 from ``RequestOutput.metrics`` (vLLM's
  ``first_token_latency``: from the start of the request's render to the frontend's
  processing of its first token);
* frontend CPU ms per request: ``getrusage`` of this process (every thread) over the loop,
  and its minor page faults per request (``frontend_page_faults``, in the JSON);
  render ms per request: wall time of ``add_request`` (the render and the send);
  engine CPU ms per request: the engine core and its worker (``psutil``);
* bytes moved between processes per request: what the frontend's cache put into its ring
  (``shm``) and the item payloads that travel with the request over vLLM's IPC (``lru``
  misses, and in ``shm`` items served uncached), counted by wrapping the frontend cache's
  ``get_and_update_item`` and sizing items with vLLM's ``MultiModalCache.get_item_size``;
  for vLLM's ``shm`` also what its ring allocated (``ring_alloc``, serialization included);
  for mmcache ``shm`` the store's ``puts`` counter checks the count of puts;
* start-up: the construction of ``LLM`` until it returns (ready);
* the slice of requests that carry an item of at least 8 MiB (processed): their TTFT and
  render time.

The caches are sized so that items of any size here are admitted
(``mm_shm_cache_max_object_size_mb``) and the working set exceeds the cache
(``--cache-gb``).  After each engine exits, the ring it used must be gone from ``/dev/shm``.

Run (the engine's venv, ``.venv-engine`` of ``make test-engine``)::

    make bench-engine                       # the defaults (llm only): a few minutes
    .venv-engine/bin/python benches/bench_engine.py --requests 120 --rounds 2 --json out.json
    .venv-engine/bin/python benches/bench_engine.py --frontends llm,serve \\
        --configs mmcache-shm,vllm-shm
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_serve
from engine_workload import (
    CONFIGS,
    LARGE_BYTES,
    MAX_TOKENS,
    descendants_cpu_seconds,
    engine_env,
    image_sides,
    llm_args,
    media,
    percentile,
    prompt_text,
    segments_left,
    workload,
    write_model,
)

CHILD_DEADLINE_S = 1800
"""Only stops a hung engine (the machine is shared)."""


# -- the child: one engine, the timed loop --------------------------------------------------


class Traffic:
    """What the frontend's cache outputs, counted by wrapping its ``get_and_update_item``:
    items written into a ring (a handle out for data in), items sent with their data, hits
    that send nothing (``lru``) or a handle (``shm``).  Item sizes are vLLM's own."""

    def __init__(self, cache: Any) -> None:
        from vllm.multimodal.cache.base import MultiModalCache

        self.size_of = MultiModalCache.get_item_size
        self.counts: collections.Counter[str] = collections.Counter()
        self.item_bytes: dict[str, int] = {}
        """Every item's processed size, by hash (known from its first miss)."""
        self.request_hashes: list[str] = []
        """The hashes the current request looked up."""
        original = cache.get_and_update_item

        def counted(mm_item: Any, mm_hash: str) -> Any:
            out = original(mm_item, mm_hash)
            self.request_hashes.append(mm_hash)
            data = out[0]
            if mm_item is not None:
                size = self.size_of(mm_item[0])
                self.item_bytes[mm_hash] = size
                self.counts["misses"] += 1
                self.counts["processed_bytes"] += size
            if data is not None and "address" in data:
                self.counts["handles"] += 1
                if mm_item is not None:
                    self.counts["ring_bytes"] += self.item_bytes[mm_hash]
            elif data is not None:
                self.counts["ipc_items"] += 1
                self.counts["ipc_bytes"] += self.size_of(data)
            self.counts["lookups"] += 1
            return out

        cache.get_and_update_item = counted


def count_ring_allocations(cache: Any, traffic: Traffic) -> None:
    """vLLM's ``shm``: what its ring allocates (serialized objects, headers included)."""
    ring = cache._shm_cache.ring_buffer
    allocate = ring.allocate_buf

    def counted(size: int) -> Any:
        allocated = allocate(size)  # a MemoryError (full ring) allocates nothing
        traffic.counts["ring_alloc_bytes"] += size
        return allocated

    ring.allocate_buf = counted


def ring_name(cache: Any, mmcache: bool) -> str | None:
    """The shared-memory segment the frontend's cache writes (``None``: none)."""
    if cache is None:
        return None
    if mmcache:
        ring = getattr(cache, "ring", None)
        return None if ring is None else str(ring.name)
    shm = getattr(cache, "_shm_cache", None)
    return None if shm is None else str(shm.ring_buffer.shared_memory.name)


def cpu_seconds(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def engine_cpu_seconds() -> float:
    """CPU time of this process's children (the engine core and what it started)."""
    import psutil

    return descendants_cpu_seconds(psutil.Process())


def child(config: dict[str, Any]) -> dict[str, Any]:
    """Run one engine (this process is its frontend) through the workload."""
    images, videos = media(config["sides"], config["seed"])

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    started = time.perf_counter()
    llm = LLM(**config["llm"])
    startup_s = time.perf_counter() - started

    cache = llm.llm_engine.renderer.mm_processor_cache
    traffic = Traffic(cache)
    if not config["mmcache"] and config["mode"] == "shm":
        count_ring_allocations(cache, traffic)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, output_kind=RequestOutputKind.FINAL_ONLY
    )

    def prompt(request: dict[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = {"image": [images[i] for i in request["images"]]}
        if request["video"] is not None:
            data["video"] = [videos[request["video"]]]
        text = prompt_text(len(request["images"]), int(request["video"] is not None))
        return {"prompt": text, "multi_modal_data": data}

    engine = llm.llm_engine
    ids = itertools.count()

    def run(requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        pending = collections.deque(requests)
        done: dict[str, dict[str, Any]] = {}
        in_flight: dict[str, dict[str, Any]] = {}
        while pending or in_flight:
            while pending and len(in_flight) < config["concurrency"]:
                request_id = str(next(ids))
                traffic.request_hashes = []
                t0, c0 = time.perf_counter(), time.thread_time()
                engine.add_request(request_id, prompt(pending.popleft()), params)
                in_flight[request_id] = {
                    "render_s": time.perf_counter() - t0,
                    "render_thread_cpu_s": time.thread_time() - c0,
                    "hashes": traffic.request_hashes,
                }
            for output in engine.step():
                if output.finished:
                    record = in_flight.pop(output.request_id)
                    record["ttft_s"] = output.metrics.first_token_latency
                    record["tokens"] = list(output.outputs[0].token_ids)
                    done[output.request_id] = record
        return done

    # One request of an image outside the catalogue first: lazy initialisations are not
    # timed (the image stays cached, a few KiB).
    run([{"images": [len(images) - 1], "video": None}])
    traffic.counts.clear()
    traffic.item_bytes.clear()

    requests = config["requests"]
    usage0, engine0 = resource.getrusage(resource.RUSAGE_SELF), engine_cpu_seconds()
    # The render thread's CPU time, not wall time: on a loaded machine the wall time of a
    # call is mostly its wait for a core.
    profiler = cProfile.Profile(time.thread_time) if config["profile"] else None
    wall0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    done = run(requests)
    if profiler is not None:
        profiler.disable()
    wall_s = time.perf_counter() - wall0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    frontend_cpu_s = cpu_seconds(usage1) - cpu_seconds(usage0)
    engine_cpu_s = engine_cpu_seconds() - engine0

    records = [done[k] for k in sorted(done, key=int)]
    for record in records:
        sizes = [traffic.item_bytes.get(h, 0) for h in record.pop("hashes")]
        record["max_item_bytes"] = max(sizes, default=0)
        record["item_bytes"] = sum(sizes)
    result = {
        "startup_s": startup_s,
        "wall_s": wall_s,
        "frontend_cpu_s": frontend_cpu_s,
        "frontend_page_faults": usage1.ru_minflt - usage0.ru_minflt,
        "engine_cpu_s": engine_cpu_s,
        "traffic": dict(traffic.counts),
        "requests": records,
        "ring": ring_name(cache, config["mmcache"]),
        "cache_class": f"{type(cache).__module__}.{type(cache).__qualname__}",
    }
    if profiler is not None:
        profiler.dump_stats(config["profile"])
    if config["mmcache"] and hasattr(cache, "_sender") and hasattr(cache._sender, "stats"):
        result["mmcache_stats"] = cache._sender.stats()
    return result


def child_main(config_path: str, result_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    result = child(config)
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(result_path)


# -- the parent: one engine per configuration, the table ------------------------------------


def run_engine(
    name: str, args: argparse.Namespace, model: Path, requests: list[Any], work: Path
) -> dict[str, Any]:
    """One configuration's engine, started and run to its end by a child process."""
    spec = CONFIGS[name]
    directory = Path(tempfile.mkdtemp(prefix=f"llm-{name}-", dir=work))
    config = {
        "mmcache": spec["mmcache"],
        "mode": spec["mode"],
        "llm": llm_args(model, spec["mode"], args.cache_gb),
        "sides": image_sides(args.seed, args.catalogue),
        "seed": args.seed,
        "concurrency": args.concurrency,
        "requests": requests,
        "profile": str(args.profile / f"{name}.pstats") if args.profile else None,
    }
    (directory / "config.json").write_text(json.dumps(config))
    env = engine_env(directory, spec["mmcache"])
    shm_before = set(os.listdir("/dev/shm"))
    result_path = directory / "result.json"
    argv = [sys.executable, __file__, "--child", str(directory / "config.json"), str(result_path)]
    with (directory / "engine.log").open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
        try:
            returncode = process.wait(CHILD_DEADLINE_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever the tree left
            process.wait()
    if returncode != 0 or not result_path.exists():
        tail = "\n".join((directory / "engine.log").read_text().splitlines()[-40:])
        raise SystemExit(
            f"{name}: the engine failed ({returncode}); {directory}/engine.log:\n{tail}"
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    time.sleep(0.5)
    result["shm_left"] = segments_left(shm_before, result["ring"])
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (times in ms, bytes in MB per request); what only the ``llm``
    frontend measures (render, bytes moved) is missing from a ``serve`` run's."""
    records = result["requests"]
    n = len(records)
    large = [r for r in records if r["max_item_bytes"] >= LARGE_BYTES]
    row = {
        "requests": n,
        "startup_s": result["startup_s"],
        "rps": n / result["wall_s"],
        "ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in records], 50),
        "ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in records], 99),
        "frontend_cpu_ms": 1e3 * result["frontend_cpu_s"] / n,
        "engine_cpu_ms": 1e3 * result["engine_cpu_s"] / n,
        # What the requests' items weigh, hits included: in ``lru`` the engine core sends
        # every item's data on to the worker with the scheduler's output.
        "items_mb": sum(r["item_bytes"] for r in records) / n / 1e6,
        "large_requests": len(large),
        "large_ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in large], 50),
        "large_ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in large], 99),
        "shm_left": result["shm_left"],
    }
    if "hits" in result:  # serve: the API server's cache statistics (probe.py)
        row["hit_ratio"] = result["hits"] / result["lookups"] if result["lookups"] else NAN
    if "traffic" not in result:
        return row
    traffic = result["traffic"]
    lookups = traffic.get("lookups", 0)
    return row | {
        "render_ms": 1e3 * statistics.fmean(r["render_s"] for r in records),
        "render_thread_cpu_ms": 1e3 * statistics.fmean(r["render_thread_cpu_s"] for r in records),
        "frontend_page_faults": result["frontend_page_faults"] / n,
        "moved_mb": (traffic.get("ring_bytes", 0) + traffic.get("ipc_bytes", 0)) / n / 1e6,
        "ring_mb": traffic.get("ring_bytes", 0) / n / 1e6,
        "ipc_mb": traffic.get("ipc_bytes", 0) / n / 1e6,
        "ring_alloc_mb": traffic.get("ring_alloc_bytes", 0) / n / 1e6,
        "hit_ratio": 1 - traffic.get("misses", 0) / lookups if lookups else NAN,
        "large_render_ms": 1e3 * statistics.fmean(r["render_s"] for r in large) if large else NAN,
        "ipc_items": traffic.get("ipc_items", 0),
        "mmcache_puts": result.get("mmcache_stats", {}).get("store_puts"),
    }


NAN = float("nan")
COLUMNS = [
    ("startup_s", "start-up s", "{:.1f}"),
    ("rps", "req/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("frontend_cpu_ms", "frontend CPU ms/req", "{:.0f}"),
    ("render_ms", "render ms/req", "{:.0f}"),
    ("engine_cpu_ms", "engine CPU ms/req", "{:.0f}"),
    ("ring_mb", "ring MB/req", "{:.2f}"),
    ("ipc_mb", "IPC MB/req", "{:.2f}"),
    ("hit_ratio", "hits", "{:.0%}"),
    ("large_ttft_p50_ms", "≥8MiB TTFT p50", "{:.0f}"),
    ("large_ttft_p99_ms", "≥8MiB TTFT p99", "{:.0f}"),
    ("large_render_ms", "≥8MiB render ms", "{:.0f}"),
]
"""A figure a run does not have is ``–`` (``serve``: no render time, no bytes moved)."""


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| config | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for name, row in rows:
        cells = [fmt.format(row[key]) if key in row else "–" for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def token_mismatches(runs: list[dict[str, Any]]) -> list[str]:
    """Each run whose requests' tokens differ from the first run's of its frontend (the
    same requests, greedy decoding: every cache must give the same tokens)."""
    first: dict[str, dict[str, Any]] = {}
    mismatches = []
    for run in runs:
        reference = first.setdefault(run["frontend"], run)
        tokens = [r["tokens"] for r in run["requests"]]
        expected = [r["tokens"] for r in reference["requests"]]
        if tokens != expected:
            differ = sum(a != b for a, b in zip(tokens, expected, strict=True))
            mismatches.append(
                f"{run['frontend']} {run['config']} (round {run['round']}): {differ} of "
                f"{len(tokens)} requests' tokens differ from {reference['config']}'s"
            )
    return mismatches


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--catalogue", type=int, default=16, help="distinct images")
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--video-every", type=int, default=6, help="1 request in N has a video")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument(
        "--cache-gb", type=float, default=0.0625, help="mm_processor_cache_gb (each cache)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="each round runs every config")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument(
        "--frontends",
        default="llm",
        help="comma-separated: llm (LLM's engine in this script's child), serve (vllm serve "
        "and an HTTP load generator)",
    )
    parser.add_argument(
        "--image-format",
        choices=["jpeg", "png"],
        default="jpeg",
        help="serve: how images travel in the chat requests (data URLs)",
    )
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="llm: cProfile the frontend's timed loop (the renderer's thread, its CPU time) "
        "into DIR/CONFIG.pstats",
    )
    args = parser.parse_args()
    names = args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r} (one of {', '.join(CONFIGS)})")
    frontends = args.frontends.split(",")
    for frontend in frontends:
        if frontend not in FRONTENDS:
            parser.error(f"unknown frontend {frontend!r} (one of {', '.join(FRONTENDS)})")

    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        args.profile = args.profile.resolve()
    requests = workload(args.requests, args.catalogue, args.zipf, args.video_every, args.seed)
    runs: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as work:
        model = write_model(Path(work) / "qwen2_vl")
        for frontend in frontends:
            for round_ in range(args.rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    load = os.getloadavg()[0]
                    result = FRONTENDS[frontend](name, args, model, requests, Path(work))
                    row = summary(result)
                    row.update(
                        config=name,
                        frontend=frontend,
                        round=round_,
                        load_before=load,
                        load_after=os.getloadavg()[0],
                    )
                    runs.append(row)
                    raw.append({"config": name, "frontend": frontend, "round": round_, **result})
                    label = f"{frontend} round {round_} {name}"
                    print(f"{label}: " + json.dumps(row), file=sys.stderr, flush=True)
    rows = [(f"{r['config']} {r['frontend']} (round {r['round']})", r) for r in runs]
    print(table(rows))
    left = sorted({n for r in runs for n in r["shm_left"]})
    print(f"segments of ours left in /dev/shm: {left or 'none'}")
    mismatches = token_mismatches(raw)
    print("tokens: " + ("; ".join(mismatches) or "the same in every configuration"))
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args), "runs": runs, "raw": raw}, indent=1, default=str)
        )
    if mismatches:
        raise SystemExit(1)


FRONTENDS = {"llm": run_engine, "serve": bench_serve.run_server}


if __name__ == "__main__":
    main()
