"""mmcache's plugin in a real vLLM engine, in every cache mode, against vLLM without a cache.

For each model, one engine without mmcache and without a processor cache generates the
expected tokens (``conftest.expected_tokens``); then one engine per case, with
``MMCACHE_VLLM=1``, runs the same rounds of requests.  The rounds repeat images within and
across rounds (so every cache hits) and bring more items than the caches hold (so they evict;
in ``shm`` mode some items are larger than ``mm_shm_cache_max_object_size_mb`` and travel
without the ring).  Then each engine clears its engine-side caches alone and runs the first
round again (a drift), is sent two requests vLLM rejects (``shm`` mode), and exits, or is
killed with its whole process tree.  The frontend's cache is also made to see an
invalidation arrive from another thread in the middle of a request, as vLLM 0.32's frontend
makes it.

Every test runs on the engines it applies to: the cases are parametrized per test (module
scoped, so each engine starts once), and none is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engines import Engine, EngineError, Prompt
from workloads import (
    EXPECTED_CACHES,
    MAX_TOKENS,
    MODELS,
    Model,
    check_every_process_built,
    is_mmcache_class,
    mode_args,
    run_rounds,
)

import mmcache
from mmcache import _core


@dataclasses.dataclass(frozen=True)
class Case:
    """An engine with the plugin."""

    model: str
    mode: str
    world_size: int = 1
    """Workers (tensor parallel size)."""
    killed: bool = False
    """Whether the engine ends by SIGKILL of its whole process tree (else it exits)."""


CASES = {
    "llava-lru": Case("llava", "lru"),
    "llava-shm-tp2": Case("llava", "shm", world_size=2),
    "llava-processor_only": Case("llava", "processor_only"),
    "qwen2_vl-shm-killed": Case("qwen2_vl", "shm", killed=True),
}


# -- running the engines ----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What one engine did and left behind."""

    case: Case
    frontend_pid: int
    tokens: list[list[list[int]]]
    records: list[dict[str, Any]]
    cache: dict[str, Any]
    ring_name: str | None
    ring: dict[str, Any] | None
    """``mmcache.inspect`` of the ring after the last round, while the engine ran."""
    rejections: list[str]
    """What vLLM raised for requests it rejected in the frontend (``shm`` mode)."""
    ring_after_rejections: dict[str, Any] | None
    exit_status: int | None
    """``None`` when killed."""
    left_behind: dict[str, Any]
    """After SIGKILL: the ring's ``segment_status``, whether ``prune`` lists it, whether
    it was there before and after it was unlinked (as ``prune`` does)."""
    drift_tokens: list[list[int]]
    """The first round again, after the engine-side caches alone were cleared."""
    resent: int
    """How many requests of that round failed on a drift and were sent again."""
    invalidating: dict[str, Any]
    """The first request again, its cached items invalidated from another thread between
    the lookup and the updates (``generate_invalidating``)."""


def generate_resending(engine: Engine, prompts: list[Prompt]) -> tuple[list[list[int]], int]:
    """The tokens of ``prompts``, each request vLLM failed (a drift: it reports the items
    the engine core lacks, and the frontend forgets them) sent once more, as a client
    does; and how many were."""
    tokens, reasons = engine.generate(prompts, MAX_TOKENS)
    failed = [i for i, reason in enumerate(reasons) if reason == "error"]
    if failed:
        again, reasons = engine.generate([prompts[i] for i in failed], MAX_TOKENS)
        assert "error" not in reasons
        for i, resent in zip(failed, again, strict=True):
            tokens[i] = resent
    return tokens, len(failed)


def rejected_requests(model: Model) -> list[Prompt]:
    """Requests vLLM rejects in the frontend after processing their images: one whose text
    fits the model but not with its image (224 x 448: 256 tokens for LLaVA, 128 for
    Qwen2-VL), and one with two images for one placeholder."""
    too_long = model.image_prompt([[31, 224, 448]])
    too_long["text"] += " w5" * (model.llm["max_model_len"] - 100)
    two_images = {**model.image_prompt([[32, 64, 48]]), "images": [[32, 64, 48], [33, 48, 64]]}
    return [too_long, two_images]


def ending_by_sigkill(engine: Engine, ring_name: str | None) -> dict[str, Any]:
    """SIGKILL the engine's whole tree; then what it left of its ring (if it had one),
    which is unlinked here as ``mmcache prune`` would (``prune`` itself would also remove
    other jobs' segments on this machine)."""
    engine.kill()
    if ring_name is None:
        return {}
    path = Path("/dev/shm") / ring_name
    left = {
        "existed": path.exists(),
        "status": _core.segment_status(ring_name)[0],
        "listed_by_prune": ring_name in mmcache.prune(dry_run=True),
    }
    _core.unlink_segment(ring_name)
    left["exists_after_unlink"] = path.exists()
    return left


ALL_CASES = list(CASES)
RING_CASES = [name for name, case in CASES.items() if case.mode == "shm"]
EXITING_CASES = [name for name, case in CASES.items() if not case.killed]
KILLED_CASES = [name for name, case in CASES.items() if case.killed]


def on(cases: list[str]) -> pytest.MarkDecorator:
    """Run a test on the engines of ``cases`` (the module-scoped ``case`` fixture)."""
    return pytest.mark.parametrize("case", cases, indirect=True)


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def run(
    case: str,
    start_engine: Callable[..., Engine],
    model_dir: Callable[[str], Path],
    expected_tokens: Callable[[str], list[list[list[int]]]],
) -> Run:
    spec = CASES[case]
    model = MODELS[spec.model]
    expected_tokens(spec.model)  # its engine runs first: one engine at a time
    llm = {
        "model": str(model_dir(spec.model)),
        **model.llm,
        **mode_args(model, spec.mode),
        "tensor_parallel_size": spec.world_size,
    }
    rejections: list[str] = []
    ring_after_rejections = None
    with start_engine(llm, mmcache=True) as engine:
        tokens = run_rounds(engine, model)
        engine.ask("reset_engine_cache")
        drift_tokens, resent = generate_resending(engine, model.rounds[0])
        invalidating = engine.ask(
            "generate_invalidating", prompts=model.rounds[0][:1], max_tokens=MAX_TOKENS
        )
        cache = engine.ask("cache")
        ring_name = engine.ask("ring")["name"]
        ring = None
        if ring_name is not None:
            ring = mmcache.inspect(ring_name)
            for prompt in rejected_requests(model):
                with pytest.raises(EngineError) as rejection:
                    engine.generate([prompt], MAX_TOKENS)
                rejections.append(str(rejection.value))
            ring_after_rejections = mmcache.inspect(ring_name)
        if spec.killed:
            exit_status, left_behind = None, ending_by_sigkill(engine, ring_name)
        else:
            exit_status, left_behind = engine.exit(), {}
    return Run(
        case=spec,
        frontend_pid=engine.process.pid,
        tokens=tokens,
        records=engine.records(),
        cache=cache,
        ring_name=ring_name,
        ring=ring,
        rejections=rejections,
        ring_after_rejections=ring_after_rejections,
        exit_status=exit_status,
        left_behind=left_behind,
        drift_tokens=drift_tokens,
        resent=resent,
        invalidating=invalidating,
    )


# -- the checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_the_expected_tokens_depend_on_the_images(
    name: str, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """The comparisons below can fail: the tiny models' tokens follow every image's pixels
    (the first round's prompts differ only in their images, one of them in its second)."""
    first_round = expected_tokens(name)[0]
    assert len({tuple(tokens) for tokens in first_round}) == len(first_round)


@on(ALL_CASES)
def test_tokens_are_those_of_vllm_without_a_cache(
    run: Run, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    assert run.tokens == expected_tokens(run.case.model)


@on(ALL_CASES)
def test_a_drift_is_resent_and_recovers(
    run: Run, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """With the engine core's and the workers' caches cleared behind the frontend's back, the
    first round again: in ``lru`` mode the items the frontend thought cached are missing in
    the engine core, vLLM fails those requests as retryable and the frontend forgets the
    items, so sending them again yields vLLM's tokens; in the other modes nothing the
    requests need was in those caches (a worker's kept views of the ring are not)."""
    assert run.drift_tokens == expected_tokens(run.case.model)[0]
    if run.case.mode == "lru":
        assert run.resent > 0
    else:
        assert run.resent == 0


@on(ALL_CASES)
def test_an_invalidation_inside_a_request_waits_for_its_end(
    run: Run, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """vLLM 0.32's frontend invalidates what the engine core reported missing from its
    output handler, while its renderer may be between a request's lookup (which found the
    items cached) and their updates; vLLM 0.33 queues them itself.  The request still
    completes with vLLM's tokens (the invalidation did not turn its cached items into a
    miss), and the items are forgotten once it is done."""
    assert run.invalidating["invalidated"], "the first request found nothing cached"
    assert run.invalidating["token_ids"] == expected_tokens(run.case.model)[0][:1]
    assert run.invalidating["still_cached"] == [False] * len(run.invalidating["invalidated"])


@on(ALL_CASES)
def test_every_process_built_mmcaches_cache(run: Run) -> None:
    check_every_process_built(run.records, run.case.mode, run.case.world_size, [run.frontend_pid])


@on(ALL_CASES)
def test_the_frontend_cache_hit(run: Run) -> None:
    """The rounds repeat images: the frontend's cache (mmcache's) served some from cache."""
    assert is_mmcache_class(run.cache["class"], EXPECTED_CACHES[run.case.mode]["frontend"])
    assert 0 < run.cache["hits"] < run.cache["total"]


@on(ALL_CASES)
def test_the_ring(run: Run) -> None:
    """In ``shm`` mode the ring (one reader slot per worker) took items, served hits and
    evicted, and after the last round every handle the workers were given had been read;
    in the other modes there is no ring."""
    if run.case.mode != "shm":
        assert run.ring_name is None
        return
    ring = run.ring
    assert ring is not None
    assert ring["puts"] > 0 and ring["hits"] > 0 and ring["evictions"] > 0
    workers = {r["pid"] for r in run.records if r["role"] == "worker"}
    assert sorted(reader["pid"] for reader in ring["readers"]) == sorted(workers)
    for reader in ring["readers"]:
        assert reader["claimed"] and reader["alive"] and reader["refs"] > 0, reader
        assert reader["outstanding"] == 0, reader


@on(RING_CASES)
def test_vllm_rejects_requests_in_the_frontend(run: Run) -> None:
    """The requests of :func:`rejected_requests` fail as vLLM fails them, the engine lives."""
    assert len(run.rejections) == 2
    assert "longer than the maximum model length" in run.rejections[0]
    assert "Failed to apply prompt replacement" in run.rejections[1]


@on(RING_CASES)
def test_rejected_requests_give_their_references_back(run: Run) -> None:
    """Requests vLLM rejects in the frontend after their images were processed (and put in
    the ring) never reach a worker: the plugin gives their references back (the prompt's
    replacements fail in the render; the length check in ``process_inputs``)."""
    assert run.ring_after_rejections is not None
    outstanding = [reader["outstanding"] for reader in run.ring_after_rejections["readers"]]
    assert outstanding == [0] * run.case.world_size


@on(EXITING_CASES)
def test_a_clean_exit_leaves_nothing(run: Run) -> None:
    assert run.exit_status == 0
    if run.ring_name is not None:
        assert not (Path("/dev/shm") / run.ring_name).exists()


@on(KILLED_CASES)
def test_a_killed_engine_leaves_its_ring_to_prune(run: Run) -> None:
    """SIGKILL of the whole process tree: the ring is left behind, its writer gone, and
    ``mmcache prune`` finds it; unlinking it frees it."""
    assert run.left_behind == {
        "existed": True,
        "status": "orphaned",
        "listed_by_prune": True,
        "exists_after_unlink": False,
    }
