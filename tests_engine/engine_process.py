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
* ``generate_stepped``: ``requests`` added, stepped and aborted one engine step at a time
  (see :func:`generate_stepped`): for preemption and aborts.
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

import itertools
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


def generate_stepped(llm: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """``requests`` through the engine one step at a time (``LLMEngine``'s ``add_request``,
    ``step``, ``abort_request``: the engine core gets the abort as from ``AsyncLLM.abort``).

    Each request: ``prompt``, ``max_tokens``, optional ``priority``; ``start_after``
    ``[i, n]`` adds it once request ``i`` has ``n`` tokens (or finished), else it is added
    first; ``abort_after`` ``n`` aborts it once it has ``n`` tokens (``0``: as soon as it is
    added, before the engine core can have scheduled it behind the requests running).
    Answers each request's ``request_ids`` (the frontend's), ``token_ids``,
    ``finish_reasons`` and ``tokens_at_abort``."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    call = next(_stepped)
    ids = [f"stepped-{call}-{i}" for i in range(len(requests))]
    tokens: list[list[int]] = [[] for _ in requests]
    reasons: list[str | None] = [None] * len(requests)
    added: set[int] = set()
    aborted: dict[int, int] = {}

    def done(i: int) -> bool:
        return reasons[i] is not None or i in aborted

    def add_ready() -> None:
        for i, spec in enumerate(requests):
            after = spec.get("start_after")
            if i in added or (after and not (done(after[0]) or len(tokens[after[0]]) >= after[1])):
                continue
            # The tiny models' end-of-text token would end a request before its preemption.
            params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
            engine.add_request(
                ids[i], media(spec["prompt"]), params, priority=spec.get("priority", 0)
            )
            added.add(i)

    def abort_ready() -> None:
        for i, spec in enumerate(requests):
            limit = spec.get("abort_after")
            if i in added and not done(i) and limit is not None and len(tokens[i]) >= limit:
                engine.abort_request([ids[i]])
                aborted[i] = len(tokens[i])

    add_ready()
    abort_ready()
    while not all(done(i) for i in range(len(requests))):
        for output in engine.step():
            i = ids.index(output.request_id)
            if i in aborted:
                continue
            tokens[i] = list(output.outputs[0].token_ids)
            if output.finished:
                reasons[i] = output.outputs[0].finish_reason
        add_ready()
        abort_ready()
    return {
        "request_ids": ids,
        "token_ids": tokens,
        "finish_reasons": reasons,
        "tokens_at_abort": [aborted.get(i) for i in range(len(requests))],
    }


_stepped = itertools.count()


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
            elif op == "generate_stepped":
                reply = generate_stepped(llm, command["requests"])
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
