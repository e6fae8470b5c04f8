"""One vLLM engine, run as a script by the tests (``python engine_process.py CONFIG``).

The script is the engine's frontend: it builds ``vllm.LLM(**CONFIG["llm"])`` (which starts
the engine-core process, which starts the workers), then answers commands, one JSON object a
line on stdin, with one JSON object a line on the stdout it was started with.  Everything
else the process prints (vLLM's logs) goes to stderr.  Whether mmcache is in the engine is
up to the environment it was started with (``MMCACHE_VLLM=1``), as in a real deployment.

Commands (``op``):

* ``generate``: ``prompts`` (each ``text``, ``images`` and ``videos``, see :func:`media`) and
  ``max_tokens``; greedy decoding of all prompts in one ``LLM.generate`` call.  Answers
  ``token_ids``, one list per prompt.
* ``generate_invalidating``: ``generate``, but once the frontend's cache has looked up a
  request's items and found some cached, another thread invalidates those before the
  request's items are updated, as vLLM 0.32's output handler does (it invalidates what the
  engine core reported missing, from the event loop, while the renderer's thread may be
  processing a request).  Also answers ``invalidated`` (those hashes) and ``still_cached``
  (whether the frontend's cache held each after the call).
* ``reset_engine_cache``: clear the caches of the engine core and the workers, not the
  frontend's (``reset_mm_cache`` of the engine-core client): the frontend's view of them
  drifts.
* ``cache``: the frontend's cache: its class, and its ``make_stats()`` since the start
  (``hits``, ``total``); ``class`` is ``None`` without a cache.
* ``ring``: the name of the shared-memory ring the frontend's cache publishes (``None``
  without one).
* ``exit``: shut the engine down and exit 0.

A command that raises answers ``error`` with the traceback, and the process goes on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import Any

import numpy as np
from PIL import Image


def image(seed: int, width: int, height: int) -> Image.Image:
    """A noise image, the same for the same arguments in every process."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def video(seed: int, frames: int, width: int, height: int) -> np.ndarray:
    """A noise video (frames x height x width x RGB), like :func:`image`."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def media(prompt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prompt for one of ours: ``images`` are ``[seed, width, height]``, ``videos``
    ``[seed, frames, width, height]``."""
    data: dict[str, Any] = {}
    if prompt.get("images"):
        data["image"] = [image(*spec) for spec in prompt["images"]]
    if prompt.get("videos"):
        data["video"] = [video(*spec) for spec in prompt["videos"]]
    return {"prompt": prompt["text"], "multi_modal_data": data}


def invalidating_after_first_lookup(cache: Any) -> list[str]:
    """Make ``cache``'s next lookup that finds items cached invalidate them from another
    thread before it returns (once); the list it returns fills with their hashes."""
    invalidated: list[str] = []
    lookup = cache.is_cached

    def is_cached(mm_hashes: list[str]) -> list[bool]:
        found = lookup(mm_hashes)
        cached = [h for h, hit in zip(mm_hashes, found, strict=True) if hit]
        if cached and not invalidated:
            invalidated.extend(cached)
            for mm_hash in cached:
                other = threading.Thread(target=cache.invalidate, args=(mm_hash,))
                other.start()
                other.join()
        return found

    cache.is_cached = is_cached
    return invalidated


def main() -> None:
    config = json.loads(sys.argv[1])
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints go to stderr with its logs

    from probe import class_name, published_ring
    from vllm import LLM, SamplingParams

    llm = LLM(**config["llm"])
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "exit":
                break
            if op in ("generate", "generate_invalidating"):
                cache = llm.llm_engine.renderer.mm_processor_cache
                if op == "generate_invalidating":
                    invalidated = invalidating_after_first_lookup(cache)
                params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"])
                try:
                    outputs = llm.generate(
                        [media(p) for p in command["prompts"]], params, use_tqdm=False
                    )
                finally:
                    if op == "generate_invalidating":
                        del cache.is_cached  # the class's again
                reply: dict[str, Any] = {
                    "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                    "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
                }
                if op == "generate_invalidating":
                    reply["invalidated"] = invalidated
                    reply["still_cached"] = [cache.is_cached_item(h) for h in invalidated]
            elif op == "reset_engine_cache":
                llm.llm_engine.engine_core.reset_mm_cache()
                reply = {}
            elif op == "cache":
                cache = llm.llm_engine.renderer.mm_processor_cache
                reply = {"class": class_name(cache)}
                if cache is not None:
                    stats = cache.make_stats()
                    reply.update(hits=stats.hits, total=stats.total)
            elif op == "ring":
                reply = {"name": published_ring()}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
    del llm


if __name__ == "__main__":
    main()
