"""mmcache's own tests of ``mmcache.vllm``, run in ``.venv-vllm`` (``make test-vllm``).

vLLM runs on CPU and offline here, against the stand-in models of ``standin.py`` written
into a private Hugging Face home that child processes inherit.  ``upstream/`` holds the
shims for vLLM's own test file, which runs from its own directory (see ``fetch.py``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="mmcache-vllm-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)

from standin import write_hf_cache  # noqa: E402

write_hf_cache(Path(os.environ["HF_HOME"]))

import mmcache.vllm  # noqa: E402
from vllm_helpers import MiB, shm_caches  # noqa: E402

collect_ignore = ["upstream"]


@pytest.fixture(autouse=True)
def installed() -> Iterator[None]:
    """Every test runs with mmcache installed into vLLM and no ring published before it."""
    mmcache.vllm.install()
    published = (mmcache.vllm.READER_HANDLE_ENV, mmcache.vllm.WRITER_HANDLE_ENV)
    for env in published:
        os.environ.pop(env, None)
    yield
    for env in published:
        os.environ.pop(env, None)


@pytest.fixture
def shm_pair() -> Iterator[tuple[Any, Any]]:
    """:func:`shm_caches` of a 4 MiB ring; a module may define its own."""
    with shm_caches(4 * MiB) as pair:
        yield pair
