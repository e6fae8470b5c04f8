"""vLLM's processor caches against mmcache's, in a running vLLM engine (``make bench-engine``).

Four configurations, each its own engine (a process tree: this script as the frontend, the
engine core, its worker), started one after another with the same workload: vLLM's own
``lru`` and ``shm`` caches, and mmcache's (``MMCACHE_VLLM=1``) in the same two modes.

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
* frontend CPU ms per request: ``getrusage`` of this process (every thread) over the loop;
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

    make bench-engine                       # the defaults: a few minutes
    .venv-engine/bin/python benches/bench_engine.py --requests 120 --rounds 2 --json out.json
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

HERE = Path(__file__).resolve().parent
TESTS_ENGINE = HERE.parent / "tests_engine"

CONFIGS = {
    "vllm-lru": {"mmcache": False, "mode": "lru"},
    "vllm-shm": {"mmcache": False, "mode": "shm"},
    "mmcache-lru": {"mmcache": True, "mode": "lru"},
    "mmcache-shm": {"mmcache": True, "mode": "shm"},
}

MAX_SIDE = 1344
MIN_SIDE = 448
LARGE_MIN_HEIGHT = 1092
"""A 1344 x 1092 image is 7488 patches of 2 x 14 x 14 x 3 bytes: 8.8 MB, over 8 MiB."""
LARGE_BYTES = 8 << 20
"""The slice of requests with an item at least this large (processed)."""
VIDEOS = [[0, 16, 448, 448], [1, 12, 448, 448]]
"""``[seed, frames, width, height]`` (each frame keeps 448 x 448: 9.6 and 7.2 MB)."""
MAX_TOKENS = 4
CHILD_DEADLINE_S = 1800
"""Only stops a hung engine (the machine is shared)."""


# -- the workload ---------------------------------------------------------------------------


def image_sides(seed: int, catalogue: int) -> list[tuple[int, int]]:
    """Each catalogue image's ``(width, height)``, multiples of 28 from 448 to 1344; every
    fourth is 1344 wide and 1092 to 1344 high, at least 8.8 MB processed."""
    import numpy as np

    rng = np.random.default_rng([seed, 0xB16])
    steps = (MAX_SIDE - MIN_SIDE) // 28 + 1
    large_steps = (MAX_SIDE - LARGE_MIN_HEIGHT) // 28 + 1
    return [
        (MAX_SIDE, LARGE_MIN_HEIGHT + 28 * int(rng.integers(large_steps)))
        if index % 4 == 0
        else (MIN_SIDE + 28 * int(rng.integers(steps)), MIN_SIDE + 28 * int(rng.integers(steps)))
        for index in range(catalogue)
    ]


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests: ``images`` (catalogue indices) and ``video`` (an index or ``None``)."""
    from mmcache.simulate.workload import request_stream

    images = request_stream(
        requests=args.requests,
        catalogue=args.catalogue,
        zipf=args.zipf,
        max_items=2,
        seed=args.seed,
    )
    return [
        {"images": indices, "video": (i // args.video_every) % len(VIDEOS)}
        if i % args.video_every == args.video_every - 1
        else {"images": indices, "video": None}
        for i, indices in enumerate(images)
    ]


def prompt_text(n_images: int, n_videos: int) -> str:
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    return image * n_images + video * n_videos + " w17 w23"


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

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def child(config: dict[str, Any]) -> dict[str, Any]:
    """Run one engine (this process is its frontend) through the workload."""
    import numpy as np
    from PIL import Image

    images = []
    for index, (width, height) in enumerate(config["sides"]):
        rng = np.random.default_rng([config["seed"], index])
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        images.append(Image.fromarray(pixels))
    videos = [
        np.random.default_rng([config["seed"], 0x1D, seed]).integers(
            0, 256, (frames, height, width, 3), dtype=np.uint8
        )
        for seed, frames, width, height in VIDEOS
    ]

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
    warm = np.random.default_rng([config["seed"], 0xA1]).integers(0, 256, (224, 224, 3))
    images.append(Image.fromarray(warm.astype(np.uint8)))
    run([{"images": [len(images) - 1], "video": None}])
    traffic.counts.clear()
    traffic.item_bytes.clear()

    requests = config["requests"]
    usage0, engine0 = resource.getrusage(resource.RUSAGE_SELF), engine_cpu_seconds()
    profiler = cProfile.Profile() if config["profile"] else None
    wall0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    done = run(requests)
    if profiler is not None:
        profiler.disable()
    wall_s = time.perf_counter() - wall0
    frontend_cpu_s = cpu_seconds(resource.getrusage(resource.RUSAGE_SELF)) - cpu_seconds(usage0)
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


def write_model(directory: Path) -> Path:
    """The tests' tiny Qwen2-VL, with room for 8192 positions: a request here has up to
    two 1344 x 1344 images (2304 tokens each) or an image and a video."""
    sys.path.insert(0, str(TESTS_ENGINE))
    import models

    models.write_qwen2_vl(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["max_position_embeddings"] = 8192
    config_path.write_text(json.dumps(config))
    return directory


def llm_args(model: Path, mode: str, cache_gb: float) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "disable_log_stats": False,  # RequestOutput.metrics (TTFT)
        "max_model_len": 8192,
        "max_num_batched_tokens": 8192,
        "limit_mm_per_prompt": {"image": 2, "video": 1},
        "mm_processor_kwargs": {"max_pixels": MAX_SIDE * MAX_SIDE},
        "mm_processor_cache_type": mode,
        "mm_processor_cache_gb": cache_gb,
    }
    if mode == "shm":
        args["mm_shm_cache_max_object_size_mb"] = 64  # every item here is below 16 MiB
    return args


def run_engine(
    name: str, args: argparse.Namespace, model: Path, requests: list[Any], work: Path
) -> dict[str, Any]:
    """One configuration's engine, started and run to its end by a child process."""
    spec = CONFIGS[name]
    directory = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
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
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_VLLM")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CACHE_ROOT=str(directory / "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(directory / "hf-home"),
    )
    if spec["mmcache"]:
        env["MMCACHE_VLLM"] = "1"
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
    left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    result["shm_left"] = [n for n in left if n.startswith(("mmct", "mmcache", "vllm_mm_"))]
    result["ring_left"] = result["ring"] is not None and result["ring"] in os.listdir("/dev/shm")
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (times in ms, bytes in MB per request)."""
    records = result["requests"]
    n = len(records)
    large = [r for r in records if r["max_item_bytes"] >= LARGE_BYTES]
    traffic = result["traffic"]
    moved = traffic.get("ring_bytes", 0) + traffic.get("ipc_bytes", 0)
    lookups = traffic.get("lookups", 0)
    return {
        "requests": n,
        "startup_s": result["startup_s"],
        "rps": n / result["wall_s"],
        "ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in records], 50),
        "ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in records], 99),
        "frontend_cpu_ms": 1e3 * result["frontend_cpu_s"] / n,
        "render_ms": 1e3 * statistics.fmean(r["render_s"] for r in records),
        "engine_cpu_ms": 1e3 * result["engine_cpu_s"] / n,
        "moved_mb": moved / n / 1e6,
        "ring_mb": traffic.get("ring_bytes", 0) / n / 1e6,
        "ipc_mb": traffic.get("ipc_bytes", 0) / n / 1e6,
        "ring_alloc_mb": traffic.get("ring_alloc_bytes", 0) / n / 1e6,
        # What the requests' items weigh, hits included: in ``lru`` the engine core sends
        # every item's data on to the worker with the scheduler's output.
        "items_mb": sum(r["item_bytes"] for r in records) / n / 1e6,
        "render_thread_cpu_ms": 1e3 * statistics.fmean(r["render_thread_cpu_s"] for r in records),
        "hit_ratio": 1 - traffic.get("misses", 0) / lookups if lookups else float("nan"),
        "large_requests": len(large),
        "large_ttft_p50_ms": 1e3 * percentile([r["ttft_s"] for r in large], 50),
        "large_ttft_p99_ms": 1e3 * percentile([r["ttft_s"] for r in large], 99),
        "large_render_ms": 1e3 * statistics.fmean(r["render_s"] for r in large)
        if large
        else float("nan"),
        "ipc_items": traffic.get("ipc_items", 0),
        "mmcache_puts": result.get("mmcache_stats", {}).get("store_puts"),
        "shm_left": result["shm_left"] + ([result["ring"]] if result["ring_left"] else []),
    }


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


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    lines = [
        "| config | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for name, row in rows:
        cells = [fmt.format(row[key]) for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="cProfile the frontend's timed loop (the renderer's thread) into DIR/CONFIG.pstats",
    )
    args = parser.parse_args()
    names = args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r} (one of {', '.join(CONFIGS)})")

    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        args.profile = args.profile.resolve()
    requests = workload(args)
    runs: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as work:
        model = write_model(Path(work) / "qwen2_vl")
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                load = os.getloadavg()[0]
                result = run_engine(name, args, model, requests, Path(work))
                row = summary(result)
                row.update(
                    config=name, round=round_, load_before=load, load_after=os.getloadavg()[0]
                )
                runs.append(row)
                raw.append({"config": name, "round": round_, **result})
                print(f"round {round_} {name}: " + json.dumps(row), file=sys.stderr, flush=True)
    rows = [(f"{r['config']} (round {r['round']})", r) for r in runs]
    print(table(rows))
    left = sorted({n for r in runs for n in r["shm_left"]})
    print(f"segments of ours left in /dev/shm: {left or 'none'}")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args), "runs": runs, "raw": raw}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
