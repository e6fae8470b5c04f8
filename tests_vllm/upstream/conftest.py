"""Our replacement for vLLM's ``tests/conftest.py`` when its ``test_cache.py`` runs against
mmcache (``fetch.py`` lays both out; vLLM's own conftest loads models and GPUs).

Before the test module is imported it: runs vLLM on CPU and offline against stand-in models
(see ``mmcache_standin``), calls ``mmcache.vllm.install()`` and checks that vLLM's factories
now build mmcache's classes (without a multimodal stand-in they would return ``None`` and
every test would pass without touching a cache).  It deselects the tests in
:data:`DESELECTED`, each for the reason given, and fails the run if one of them no longer
exists.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(Path(__file__).parent.parent / "hf-home")

from tests.mmcache_standin import write_hf_cache

write_hf_cache(Path(os.environ["HF_HOME"]))

from vllm.config import ModelConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.multimodal import cache as vllm_cache  # noqa: E402

import mmcache.vllm as mmcache_vllm  # noqa: E402

mmcache_vllm.install()

DESELECTED = {
    "test_shm_receiver_handles_prefix_covered_items": (
        "eager freeing: after the worker reads a handle it calls the FIFO store's "
        "free_unused() and asserts the object is gone at once; mmcache reclaims an "
        "acknowledged object when the ring needs its space (the CLOCK hand), and has no "
        "free_unused. The part of the test that matters (a stripped data=None feature "
        "beside a handle is skipped, the handle resolves) is covered by "
        "tests_vllm/test_end_to_end.py"
    ),
    "test_cache_eviction_shm_cache": (
        "FIFO order: asserts that a protected object at the head of vLLM's FIFO ring "
        "blocks every new insert (image_G is not cached beside the protected image_A) and "
        "reads the FIFO store's private key_index; mmcache's ring is a CLOCK that steps "
        "over protected objects and evicts an unprotected one, so image_G is cached (by "
        "design, see README 'Use it in vLLM')"
    ),
    "test_shm_handle_issued_before_cache_clear": (
        "eager freeing: after a clear and a new put under the same key, asserts the old "
        "handle fails; mmcache keeps the old object readable by its own handle (verified, "
        "its own data) until the ring reuses its space, and a worker keeps the objects it "
        "read last alive so that a replayed handle still reads. The guarantee the test is "
        "for (never another item's data) holds and is tested in tests_vllm/"
    ),
    "test_sleep_wake_preserves_mm_cache_consistency": (
        "needs a CUDA GPU and Qwen/Qwen2-VL-2B-Instruct's weights from the hub"
    ),
}
"""Test names (all parametrisations) left out, and why."""


def _check_factories_build_mmcache() -> None:
    """vLLM's factories must return mmcache's classes for the stand-in model."""
    from vllm.multimodal.cache import engine_receiver_cache_from_config, processor_cache_from_config

    for name, cls in mmcache_vllm.REPLACEMENTS.items():
        if getattr(vllm_cache, name) is not cls:
            raise pytest.UsageError(f"install() did not rebind vllm.multimodal.cache.{name}")
    config = VllmConfig(
        model_config=ModelConfig(
            model="llava-hf/llava-onevision-qwen2-0.5b-ov-hf", mm_processor_cache_gb=0.001
        ),
        parallel_config=ParallelConfig(data_parallel_size=1),
    )
    built = (processor_cache_from_config(config), engine_receiver_cache_from_config(config))
    expected = (mmcache_vllm.MmcacheLruSenderCache, mmcache_vllm.MmcacheLruReceiverCache)
    if tuple(map(type, built)) != expected:
        raise pytest.UsageError(
            f"vLLM's factories built {built}, not mmcache's caches: is the stand-in model "
            "recognised as multimodal?"
        )


_check_factories_build_mmcache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    names = {item.originalname for item in items if isinstance(item, pytest.Function)}
    unknown = set(DESELECTED) - names
    if unknown:
        raise pytest.UsageError(f"deselected tests that no longer exist: {sorted(unknown)}")
    keep = [i for i in items if getattr(i, "originalname", i.name) not in DESELECTED]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("deselected vLLM tests (mmcache differs by design)")
    for name, reason in DESELECTED.items():
        terminalreporter.write_line(f"{name}: {reason}")
