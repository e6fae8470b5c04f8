"""What the engine tests send and expect: the tiny models' prompts, rounds and settings.

Images are ``[seed, width, height]`` and videos ``[seed, frames, width, height]`` of noise
(``engine_process.media`` makes them; ``image_data_url`` too, for the API server).
"""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Callable
from typing import Any

from engine_process import image
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
    image_prompt: Callable[[list[list[int]]], Prompt]
    """A prompt with one placeholder per image."""
    llm: dict[str, Any]
    """``LLM`` arguments every engine of this model gets."""
    rounds: list[list[Prompt]]
    cache_gb: float
    """The processor cache (and ring) size of every mode: a few items."""
    max_object_mb: int


COMMON = {"dtype": "float32", "enforce_eager": True, "seed": 0, "disable_log_stats": True}
MODELS = {
    "llava": Model(
        lambda images: llava_prompt(*images),
        {**COMMON, "max_model_len": 1024, "limit_mm_per_prompt": {"image": 2}},
        LLAVA_ROUNDS,
        cache_gb=2 / 1024,
        max_object_mb=1,
    ),
    "qwen2_vl": Model(
        lambda images: qwen2_vl_prompt(tuple(images)),
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


def run_rounds(engine: Engine, model: Model) -> list[list[list[int]]]:
    return [engine.generate(prompts, MAX_TOKENS)[0] for prompts in model.rounds]


def image_data_url(spec: list[int]) -> str:
    """The image ``spec`` as a PNG data URL (lossless: the same pixels as in a prompt)."""
    png = io.BytesIO()
    image(*spec).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def is_mmcache_class(qualified: str | None, expected: str | None) -> bool:
    """Whether ``qualified`` (``module.Class``) is mmcache's class ``expected`` (both
    ``None``: no cache)."""
    if qualified is None or expected is None:
        return qualified is expected
    module, _, name = qualified.rpartition(".")
    return name == expected and module.split(".")[:2] == ["mmcache", "vllm"]


def check_every_process_built(
    records: list[dict[str, Any]], mode: str, world_size: int, frontend_pids: list[int]
) -> None:
    """The frontends (one per API server), the engine core and ``world_size`` workers, each a
    process of its own, built mmcache's cache of ``mode`` (vLLM's factories, mmcache's
    classes)."""
    expected = EXPECTED_CACHES[mode]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_role.setdefault(record["role"], []).append(record)
    assert sorted(by_role) == ["engine_core", "frontend", "worker"]
    assert sorted(r["pid"] for r in by_role["frontend"]) == sorted(frontend_pids)
    assert len(by_role["engine_core"]) == 1
    workers = {r["pid"] for r in by_role["worker"]}
    assert len(workers) == len(by_role["worker"]) == world_size
    assert by_role["engine_core"][0]["pid"] not in workers | set(frontend_pids)
    for role, role_records in by_role.items():
        for record in role_records:
            assert is_mmcache_class(record["cache"], expected[role]), record
