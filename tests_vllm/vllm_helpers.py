"""Configs and items shared by the tests of ``mmcache.vllm``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)

import mmcache

MODEL = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"
"""The stand-in multimodal model the tests configure vLLM with (see standin.py)."""

GiB = 1 << 30
MiB = 1 << 20


def vllm_config(
    mode: str,
    capacity_bytes: float,
    *,
    world_size: int = 1,
    max_object_mb: int = 16,
    data_parallel_size: int = 1,
    api_process_count: int = 1,
    api_process_rank: int = 0,
) -> Any:
    """A config whose cache factories pick ``mode`` (``processor_only``: through DP=2), of
    API server ``api_process_rank`` among ``api_process_count`` (``-1``: their launcher and
    engine core)."""
    shm_only = {"mm_shm_cache_max_object_size_mb": max_object_mb} if mode == "shm" else {}
    return VllmConfig(
        model_config=ModelConfig(
            model=MODEL,
            mm_processor_cache_gb=capacity_bytes / GiB,
            mm_processor_cache_type="lru" if mode == "processor_only" else mode,
            **shm_only,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=world_size,
            data_parallel_size=2 if mode == "processor_only" else data_parallel_size,
            _api_process_count=api_process_count,
            _api_process_rank=api_process_rank,
        ),
    )


def kwargs_item(seed: int, n_bytes: int = 4096) -> Any:
    """A distinct item with every kind of field vLLM 0.33 has (batched, flat with slices,
    shared), a bfloat16 tensor, a list of tensors and plain numbers."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8, generator=g)
    embeds = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    return MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(
                data=pixels, field=MultiModalBatchedField(keep_on_cpu=False)
            ),
            "image_embeds": MultiModalFieldElem(
                data=embeds,
                field=MultiModalFlatField(slices=[slice(0, 2), slice(2, 4, 1)], dim=0),
            ),
            "nested": MultiModalFieldElem(
                data=[torch.arange(seed, seed + 3), torch.ones(2, 2)],
                field=MultiModalFlatField(slices=[[slice(None, 1)], [slice(1, None)]], dim=1),
            ),
            "grid_thw": MultiModalFieldElem(
                data=torch.tensor([1, seed, 7]),
                field=MultiModalSharedField(batch_size=2, keep_on_cpu=True),
            ),
            "scale": MultiModalFieldElem(data=seed + 0.5, field=MultiModalBatchedField()),
        }
    )


def same_item(a: Any, b: Any) -> bool:
    """Same keys, field types and attributes, and bit-identical data of the same dtypes."""

    def same_data(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, list | tuple):
            return type(x) is type(y) and len(x) == len(y) and all(map(same_data, x, y))
        return type(x) is type(y) and bool(x == y)

    return (
        isinstance(b, MultiModalKwargsItem)
        and a.keys() == b.keys()
        and all(a[k].field == b[k].field and same_data(a[k].data, b[k].data) for k in a)
    )


def feature(data: Any, mm_hash: str, offset: int = 0) -> Any:
    return MultiModalFeatureSpec(
        data=data,
        modality="image",
        identifier=mm_hash,
        mm_position=PlaceholderRange(offset=offset, length=4),
        mm_hash=mm_hash,
    )


def mmcache_warnings(records: list[logging.LogRecord]) -> list[str]:
    """The messages of mmcache's warnings (and worse) among ``records`` (caplog's)."""
    return [
        r.getMessage()
        for r in records
        if r.name.startswith("mmcache") and r.levelno >= logging.WARNING
    ]


def items_travel_with_their_data(p0: Any, worker: Any) -> None:
    """Assert that ``p0`` (a frontend's cache with no ring: the processor-only fallback)
    sends a new item itself, and that ``worker`` passes it through."""
    item = kwargs_item(1)
    sent, _ = p0.get_and_update_item((item, []), "a")
    assert sent is item  # data travels by IPC
    features = [feature(sent, "a")]
    worker.get_and_update_features(features)
    assert features[0].data is item


def outstanding(p0: Any) -> int:
    """The references P0's ring has issued that its one reader has not read or given back."""
    (reader,) = mmcache.inspect(p0.ring.name)["readers"]
    return int(reader["outstanding"])


@contextmanager
def shm_caches(capacity_bytes: int) -> Iterator[tuple[Any, Any]]:
    """P0's cache of a ring of ``capacity_bytes`` and one worker's (its reader slot claimed,
    so references count); the worker keeps a quarter of the ring for replays."""
    from vllm.multimodal.cache import (
        processor_cache_from_config,
        worker_receiver_cache_from_config,
    )

    config = vllm_config("shm", capacity_bytes)
    p0 = processor_cache_from_config(config)
    worker = worker_receiver_cache_from_config(config, object())
    yield p0, worker
    worker._shm_cache.close()
    p0.close()
