"""``bench_engine.py --frontends serve``: each configuration behind vLLM's OpenAI-compatible
API server (``vllm serve``), driven by a closed-loop HTTP load generator.

The server is the tests' (``tests_engine/engines.Server``: vLLM's own ``vllm`` command run
by ``serve_cli.py``, ready once ``/health`` answers, the tests' probe plugin in every
process); its flags are the ``LLM`` arguments of the ``llm`` frontend, plus
:data:`~engine_workload.CHAT_TEMPLATE`, so a request's prompt is the one ``llm`` renders.
Each request of the same stream is one user message: its images as data URLs (JPEG or PNG),
its video as ``video/jpeg`` frames, and the text, sent as a streaming chat completion with
greedy decoding.  Bodies are encoded before the clock starts; ``--concurrency`` coroutines
(aiohttp, one connection each) keep that many requests in flight.

Reported per configuration, over the timed loop: requests/s; TTFT from the request's send to
the first streamed chunk that carries a token; the CPU seconds of the API server process
(its every thread: HTTP, media decoding, rendering, the processor cache) and of the engine
core and its worker (``psutil``), per request; the hit ratio of the API server's cache (the
probe's statistics).  Bytes moved between processes are the ``llm`` frontend's figures: the
same caches see the same items.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_workload import (
    CONFIGS,
    MAX_TOKENS,
    PROMPT_TEXT,
    TESTS_ENGINE,
    VIDEOS,
    descendants_cpu_seconds,
    image_sides,
    llm_args,
    media,
    processed_bytes,
    segments_left,
)

REQUEST_DEADLINE_S = 1800
"""Only stops a hung request (the machine is shared)."""


def data_url(image: Any, image_format: str) -> str:
    """``image`` (PIL) as a ``data:image/...`` URL; PNG keeps the pixels, JPEG (quality 90)
    is what clients usually send."""
    encoded = io.BytesIO()
    if image_format == "png":
        image.save(encoded, format="PNG")
    else:
        image.save(encoded, format="JPEG", quality=90)
    return f"data:image/{image_format};base64," + base64.b64encode(encoded.getvalue()).decode()


def video_url(frames: Any) -> str:
    """A video (frames x height x width x RGB) as vLLM's ``video/jpeg`` data URL: each
    frame a base64 JPEG, comma-separated."""
    from PIL import Image

    parts = []
    for frame in frames:
        encoded = io.BytesIO()
        Image.fromarray(frame).save(encoded, format="JPEG", quality=90)
        parts.append(base64.b64encode(encoded.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def request_bodies(
    requests: list[dict[str, Any]],
    sides: list[tuple[int, int]],
    args: argparse.Namespace,
    served_model: str,
) -> tuple[list[bytes], bytes]:
    """Every request's JSON body, and the warm-up request's (an image outside the
    catalogue), encoded once (each image and video once)."""
    images, videos = media([list(side) for side in sides], args.seed)
    image_urls = [data_url(image, args.image_format) for image in images]
    video_urls = [video_url(frames) for frames in videos]

    def body(image_indices: list[int], video: int | None) -> bytes:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": image_urls[i]}} for i in image_indices
        ]
        if video is not None:
            content.append({"type": "video_url", "video_url": {"url": video_urls[video]}})
        content.append({"type": "text", "text": PROMPT_TEXT})
        return json.dumps(
            {
                "model": served_model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            }
        ).encode()

    bodies = [body(r["images"], r["video"]) for r in requests]
    return bodies, body([len(images) - 1], None)


def item_sizes(request: dict[str, Any], sides: list[tuple[int, int]]) -> list[int]:
    """The processed size of each of ``request``'s items."""
    sizes = [processed_bytes(*sides[i]) for i in request["images"]]
    if request["video"] is not None:
        _, frames, width, height = VIDEOS[request["video"]]
        sizes.append(processed_bytes(width, height, frames))
    return sizes


async def stream_chat(session: Any, url: str, body: bytes) -> dict[str, Any]:
    """One streaming chat completion: its TTFT (to the first chunk with a token), its
    latency and its token ids."""
    tokens: list[int] = []
    ttft_s = None
    chunk: Any = None  # the last one, for the error of a stream without a token
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise SystemExit(f"the server answered {r.status}: {(await r.read())[:2000]!r}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: ") :])
            for choice in chunk.get("choices", ()):
                new = choice.get("token_ids") or []
                if ttft_s is None and (new or choice.get("delta", {}).get("content")):
                    ttft_s = time.perf_counter() - started
                tokens += new
    if ttft_s is None:
        raise SystemExit(f"no token streamed for a request: {chunk}")
    return {"ttft_s": ttft_s, "latency_s": time.perf_counter() - started, "tokens": tokens}


async def closed_loop(url: str, bodies: list[bytes], concurrency: int) -> list[dict[str, Any]]:
    """``bodies`` in order, ``concurrency`` in flight; each request's record, in order."""
    import aiohttp

    records: list[dict[str, Any]] = [{} for _ in bodies]
    next_index = iter(range(len(bodies)))

    async def client(session: aiohttp.ClientSession) -> None:
        for index in next_index:
            records[index] = await stream_chat(session, url, bodies[index])

    timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return records


def cpu_seconds(process: Any) -> tuple[float, float]:
    """CPU seconds of ``process`` itself (the API server) and of its descendants (the
    engine core, the worker)."""
    times = process.cpu_times()
    return times.user + times.system, descendants_cpu_seconds(process)


def run_server(
    name: str, args: argparse.Namespace, model: Path, requests: list[Any], work: Path
) -> dict[str, Any]:
    """One configuration behind ``vllm serve``, through the workload."""
    sys.path.insert(0, str(TESTS_ENGINE))
    import probe
    import psutil
    from engines import Server, cli_args

    spec = CONFIGS[name]
    directory = Path(tempfile.mkdtemp(prefix=f"serve-{name}-", dir=work))
    probe_path = directory / "probe"
    probe.write_entry_point(probe_path)
    llm = llm_args(model, spec["mode"], args.cache_gb)
    served_model = llm.pop("model")
    flags = [*cli_args(llm), "--chat-template", str(model / "chat_template.jinja")]
    sides = image_sides(args.seed, args.catalogue)
    bodies, warm_body = request_bodies(requests, sides, args, served_model)
    url = "/v1/chat/completions"

    shm_before = set(os.listdir("/dev/shm"))
    started = time.perf_counter()
    with Server(
        directory, served_model, flags, mmcache=spec["mmcache"], probe_path=probe_path
    ) as server:
        startup_s = time.perf_counter() - started
        url = f"http://127.0.0.1:{server.port}{url}"
        asyncio.run(closed_loop(url, [warm_body], 1))  # lazy initialisations, not timed
        process = psutil.Process(server.process.pid)
        (stats0,) = server.frontend_stats().values()
        frontend0, engine0 = cpu_seconds(process)
        wall0 = time.perf_counter()
        records = asyncio.run(closed_loop(url, bodies, args.concurrency))
        wall_s = time.perf_counter() - wall0
        frontend1, engine1 = cpu_seconds(process)
        (stats1,) = server.frontend_stats().values()
        caches = {r["role"]: r["cache"] for r in server.records()}
        (ring,) = {r.get("ring") for r in server.records() if r["role"] == "frontend"}
        exit_status = server.stop()
    if exit_status != 0:
        raise SystemExit(f"{name}: vllm serve exited {exit_status}; {server.log_path}")
    time.sleep(0.5)
    for record, request in zip(records, requests, strict=True):
        sizes = item_sizes(request, sides)
        record["max_item_bytes"] = max(sizes)
        record["item_bytes"] = sum(sizes)
    return {
        "startup_s": startup_s,
        "wall_s": wall_s,
        "frontend_cpu_s": frontend1 - frontend0,
        "engine_cpu_s": engine1 - engine0,
        "hits": stats1["hits"] - stats0["hits"],
        "lookups": stats1["total"] - stats0["total"],
        "requests": records,
        "ring": ring,
        "caches": caches,
        "shm_left": segments_left(shm_before, ring),
    }
