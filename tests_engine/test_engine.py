"""mmcache's plugin in a real vLLM engine, in every cache mode, against vLLM without a cache.

For each model, one engine without mmcache and without a processor cache generates the
expected tokens; then one engine per cache mode, with ``MMCACHE_VLLM=1``, runs the same
rounds of requests.  The rounds repeat images within and across rounds (so every cache
hits) and bring more items than the caches hold (so they evict; in ``shm`` mode some items
are larger than ``mm_shm_cache_max_object_size_mb`` and travel without the ring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mmcache
from engines import Engine, Prompt

MAX_TOKENS = 8


# -- the workloads ----------------------------------------------------------------------------


def llava_prompt(*images: list[int]) -> Prompt:
    """LLaVA 1.5's prompt format, one ``<image>`` per image (``[seed, width, height]``)."""
    text = "USER: " + "<image> " * len(images) + "w17 w23 ASSISTANT:"
    return {"text": text, "images": list(images)}


def qwen2_vl_prompt(
    images: tuple[list[int], ...] = (), videos: tuple[list[int], ...] = ()
) -> Prompt:
    """Qwen2-VL's placeholders, images then videos (``[seed, frames, width, height]``)."""
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    return {
        "text": image * len(images) + video * len(videos) + " w17 w23",
        "images": list(images),
        "videos": list(videos),
    }


# LLaVA resizes every image to 3 x 224 x 224 float32 (588 KiB): a ring of 2 MiB holds three.
A, B, C = [1, 64, 48], [2, 300, 200], [3, 224, 224]
D, E, F = [4, 90, 160], [5, 500, 375], [6, 32, 32]
LLAVA_ROUNDS = [
    [llava_prompt(A), llava_prompt(B), llava_prompt(A, C)],
    [llava_prompt(A), llava_prompt(D), llava_prompt(E, F)],
    [llava_prompt(B, A), llava_prompt(C), llava_prompt(F)],
    [llava_prompt(A), llava_prompt(E)],
]

# Qwen2-VL keeps an image's size, and vLLM hands its model the patches as uint8 (it normalizes
# them on the device): 56 x 56 is 16 patches of 2 x 14 x 14 RGB (18 KiB); 224 x 224 and
# 448 x 112 are 256 patches (294 KiB: the 1 MiB ring holds three); 224 x 448 is 512 (588 KiB);
# 448 x 448 is 1024 (1.2 MiB: above the 1 MiB largest object, so it never enters the ring).
# A video of 4 frames of 112 x 112 is 128 patches, one of 8 frames of 224 x 224 1024.
TINY, BIG = [11, 56, 56], [12, 448, 448]
M1, M2, M3 = [13, 224, 224], [14, 224, 224], [15, 224, 224]
WIDE, TALL = [16, 448, 112], [17, 224, 448]
CLIP, LONG_CLIP = [21, 4, 112, 112], [22, 8, 224, 224]
QWEN2_VL_ROUNDS = [
    [qwen2_vl_prompt((TINY,)), qwen2_vl_prompt((M1,)), qwen2_vl_prompt((TINY, BIG))],
    [qwen2_vl_prompt((M1,)), qwen2_vl_prompt(videos=(CLIP,)), qwen2_vl_prompt((M2, TINY))],
    [
        qwen2_vl_prompt((BIG,), (CLIP,)),
        qwen2_vl_prompt((M3, WIDE)),
        qwen2_vl_prompt(videos=(LONG_CLIP,)),
    ],
    [qwen2_vl_prompt((M1,)), qwen2_vl_prompt((M2,), (LONG_CLIP,)), qwen2_vl_prompt((TALL,))],
]


@dataclasses.dataclass(frozen=True)
class Model:
    llm: dict[str, Any]
    """``LLM`` arguments every engine of this model gets."""
    rounds: list[list[Prompt]]
    cache_gb: float
    """The processor cache (and ring) size of every mode: a few items."""
    max_object_mb: int


COMMON = {"dtype": "float32", "enforce_eager": True, "seed": 0, "disable_log_stats": True}
MODELS = {
    "llava": Model(
        {**COMMON, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}},
        LLAVA_ROUNDS,
        cache_gb=2 / 1024,
        max_object_mb=1,
    ),
    "qwen2_vl": Model(
        {**COMMON, "max_model_len": 2048, "limit_mm_per_prompt": {"image": 2, "video": 1}},
        QWEN2_VL_ROUNDS,
        cache_gb=1 / 1024,
        max_object_mb=1,
    ),
}


def mode_args(model: Model, mode: str) -> dict[str, Any]:
    """vLLM's arguments for one cache mode.  ``processor_only`` is what vLLM chooses by
    itself when several API servers share the engine (``_api_process_count > 1``)."""
    if mode == "processor_only":
        return {"mm_processor_cache_gb": model.cache_gb, "_api_process_count": 2}
    args = {"mm_processor_cache_type": mode, "mm_processor_cache_gb": model.cache_gb}
    if mode == "shm":
        args["mm_shm_cache_max_object_size_mb"] = model.max_object_mb
    return args


EXPECTED_CACHES: dict[str, dict[str, str | None]] = {
    "lru": {
        "frontend": "MmcacheLruSenderCache",
        "engine_core": "MmcacheLruReceiverCache",
        "worker": None,
    },
    "shm": {
        "frontend": "MmcacheShmSenderCache",
        "engine_core": None,
        "worker": "MmcacheShmReceiverCache",
    },
    "processor_only": {
        "frontend": "MmcacheProcessorOnlyCache",
        "engine_core": None,
        "worker": None,
    },
}
"""The cache each process builds with the plugin (``None``: vLLM builds none there)."""

CASES = {
    "llava-lru": ("llava", "lru", 1),
    "llava-shm-tp2": ("llava", "shm", 2),
    "llava-processor_only": ("llava", "processor_only", 1),
    "qwen2_vl-shm": ("qwen2_vl", "shm", 1),
}
"""Engines with the plugin: model, cache mode, workers (tensor parallel size)."""


# -- running the engines ----------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What one engine did and left behind."""

    mode: str
    world_size: int
    frontend_pid: int
    tokens: list[list[list[int]]]
    records: list[dict[str, Any]]
    cache: dict[str, Any]
    ring_name: str | None
    ring: dict[str, Any] | None
    """``mmcache.inspect`` of the ring after the last round, while the engine ran."""
    exit_status: int
    drift_tokens: list[list[int]]
    """The first round again, after the engine-side caches alone were cleared."""
    resent: int
    """How many requests of that round failed on a drift and were sent again."""


def run_rounds(engine: Engine, model: Model) -> list[list[list[int]]]:
    return [engine.generate(prompts, MAX_TOKENS)[0] for prompts in model.rounds]


def generate_resending(engine: Engine, prompts: list[Prompt]) -> tuple[list[list[int]], int]:
    """The tokens of ``prompts``, each request vLLM failed (a drift: it reports the items
    the engine core lacks, and the frontend forgets them) sent once more, as a client
    does; and how many were."""
    tokens, reasons = engine.generate(prompts, MAX_TOKENS)
    failed = [i for i, reason in enumerate(reasons) if reason == "error"]
    if failed:
        again, reasons = engine.generate([prompts[i] for i in failed], MAX_TOKENS)
        assert "error" not in reasons
        for i, resent in zip(failed, again):
            tokens[i] = resent
    return tokens, len(failed)


@pytest.fixture(scope="module")
def expected_tokens(
    start_engine: Callable[..., Engine], model_dir: Callable[[str], Path]
) -> Callable[[str], list[list[list[int]]]]:
    """``expected_tokens(model)``: the tokens of vLLM without mmcache and without a processor
    cache (every item processed anew), from one engine per model, run when first needed."""
    tokens: dict[str, list[list[list[int]]]] = {}

    def of(name: str) -> list[list[list[int]]]:
        if name not in tokens:
            model = MODELS[name]
            llm = {"model": str(model_dir(name)), **model.llm, "mm_processor_cache_gb": 0}
            with start_engine(llm, mmcache=False) as engine:
                tokens[name] = run_rounds(engine, model)
                assert engine.exit() == 0
        return tokens[name]

    return of


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def run(
    case: str,
    start_engine: Callable[..., Engine],
    model_dir: Callable[[str], Path],
    expected_tokens: Callable[[str], list[list[list[int]]]],
) -> Run:
    name, mode, world_size = CASES[case]
    model = MODELS[name]
    expected_tokens(name)  # its engine runs first: one engine at a time
    llm = {
        "model": str(model_dir(name)),
        **model.llm,
        **mode_args(model, mode),
        "tensor_parallel_size": world_size,
    }
    with start_engine(llm, mmcache=True) as engine:
        tokens = run_rounds(engine, model)
        engine.ask("reset_engine_cache")
        drift_tokens, resent = generate_resending(engine, model.rounds[0])
        cache = engine.ask("cache")
        ring_name = engine.ask("ring")["name"]
        ring = mmcache.inspect(ring_name) if ring_name is not None else None
        exit_status = engine.exit()
    return Run(
        mode=mode,
        world_size=world_size,
        frontend_pid=engine.process.pid,
        tokens=tokens,
        records=engine.records(),
        cache=cache,
        ring_name=ring_name,
        ring=ring,
        exit_status=exit_status,
        drift_tokens=drift_tokens,
        resent=resent,
    )


# -- the checks -------------------------------------------------------------------------------


def is_mmcache_class(qualified: str | None, expected: str | None) -> bool:
    """Whether ``qualified`` (``module.Class``) is mmcache's class ``expected`` (both
    ``None``: no cache)."""
    if qualified is None or expected is None:
        return qualified is expected
    module, _, name = qualified.rpartition(".")
    return name == expected and module.split(".")[:2] == ["mmcache", "vllm"]


@pytest.mark.parametrize("name", list(MODELS))
def test_the_expected_tokens_depend_on_the_images(
    name: str, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """The comparisons below can fail: the tiny models' tokens follow every image's pixels
    (the first round's prompts differ only in their images, one of them in its second)."""
    first_round = expected_tokens(name)[0]
    assert len({tuple(tokens) for tokens in first_round}) == len(first_round)


def test_tokens_are_those_of_vllm_without_a_cache(
    case: str, run: Run, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    assert run.tokens == expected_tokens(CASES[case][0])


def test_a_drift_is_resent_and_recovers(
    case: str, run: Run, expected_tokens: Callable[[str], list[list[list[int]]]]
) -> None:
    """With the engine core's and the workers' caches cleared behind the frontend's back, the
    first round again: in ``lru`` mode the items the frontend thought cached are missing in
    the engine core, vLLM fails those requests as retryable and the frontend forgets the
    items, so sending them again yields vLLM's tokens; in the other modes nothing the
    requests need was in those caches (a worker's kept views of the ring are not)."""
    assert run.drift_tokens == expected_tokens(CASES[case][0])[0]
    if run.mode == "lru":
        assert run.resent > 0
    else:
        assert run.resent == 0


def test_every_process_built_mmcaches_cache(run: Run) -> None:
    """The frontend, the engine core and every worker, each a process of its own, built
    mmcache's cache of the mode (vLLM's factories, mmcache's classes)."""
    expected = EXPECTED_CACHES[run.mode]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for record in run.records:
        by_role.setdefault(record["role"], []).append(record)
    assert sorted(by_role) == ["engine_core", "frontend", "worker"]
    assert [r["pid"] for r in by_role["frontend"]] == [run.frontend_pid]
    assert len(by_role["engine_core"]) == 1
    workers = {r["pid"] for r in by_role["worker"]}
    assert len(workers) == len(by_role["worker"]) == run.world_size
    assert by_role["engine_core"][0]["pid"] not in workers | {run.frontend_pid}
    for role, records in by_role.items():
        for record in records:
            assert is_mmcache_class(record["cache"], expected[role]), record


def test_the_frontend_cache_hit(run: Run) -> None:
    """The rounds repeat images: the frontend's cache (mmcache's) served some from cache."""
    assert is_mmcache_class(run.cache["class"], EXPECTED_CACHES[run.mode]["frontend"])
    assert 0 < run.cache["hits"] < run.cache["total"]


def test_the_ring(run: Run) -> None:
    """In ``shm`` mode the ring (one reader slot per worker) took items, served hits and
    evicted, and after the last round every handle the workers were given had been read;
    in the other modes there is no ring."""
    if run.mode != "shm":
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


def test_a_clean_exit_leaves_nothing(run: Run) -> None:
    assert run.exit_status == 0
    if run.ring_name is not None:
        assert not (Path("/dev/shm") / run.ring_name).exists()
