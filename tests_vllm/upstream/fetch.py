"""Lay out vLLM 0.33.0's own ``tests/multimodal/test_cache.py`` to run against mmcache.

The file is vLLM's, so it is not kept in this repository: this script downloads vLLM's
source distribution from PyPI (once; the archive is cached and its SHA-256 checked), takes
the test file and the light helpers it imports, and adds this project's shims beside them:
``conftest.py`` (replacing vLLM's heavy one: installs mmcache, deselects the tests listed
there with their reasons) and ``utils.py`` (the one helper of vLLM's ``tests/utils.py`` the
file imports).  Usage: ``python fetch.py RUN_DIR CACHE_DIR``; then run pytest in RUN_DIR.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.33.0"
SDIST = f"vllm-{VERSION}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
INDEX = "https://pypi.org/simple/vllm/"

FROM_VLLM = [
    "tests/__init__.py",
    "tests/ci_envs.py",
    "tests/models/__init__.py",
    "tests/models/registry.py",
    "tests/models/utils.py",
    "tests/multimodal/__init__.py",
    "tests/multimodal/test_cache.py",
]
"""The test file and the helpers it imports (``tests/utils.py`` is replaced by a shim: the
real one imports vLLM's whole server stack)."""

HERE = Path(__file__).parent
SHIMS = {
    "tests/conftest.py": HERE / "conftest.py",
    "tests/utils.py": HERE / "utils_shim.py",
    "tests/mmcache_standin.py": HERE.parent / "standin.py",
}


def _sdist_url() -> str:
    """The source distribution's URL, from PyPI's simple index (PEP 691 JSON)."""
    request = urllib.request.Request(
        INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == SDIST:
            return str(entry["url"])
    raise SystemExit(f"{SDIST} is not on {INDEX}")


def sdist(cache_dir: Path) -> Path:
    """The verified archive, downloaded into ``cache_dir`` unless already there."""
    path = cache_dir / SDIST
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != SDIST_SHA256:
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        with (
            urllib.request.urlopen(_sdist_url(), timeout=600) as response,
            open(partial, "wb") as out,
        ):
            shutil.copyfileobj(response, out)
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            partial.unlink()
            raise SystemExit(f"{SDIST}: SHA-256 {digest}, expected {SDIST_SHA256}")
        partial.rename(path)
    return path


def lay_out(run_dir: Path, cache_dir: Path) -> None:
    """Fill ``run_dir`` with vLLM's files and our shims (replacing what was there)."""
    shutil.rmtree(run_dir / "tests", ignore_errors=True)
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist(cache_dir)) as archive:
        for name in FROM_VLLM:
            source = archive.extractfile(prefix + name)
            if source is None:
                raise SystemExit(f"{SDIST} has no {name}")
            target = run_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    for name, shim in SHIMS.items():
        shutil.copyfile(shim, run_dir / name)
    # Our own pytest settings: vLLM's live in its pyproject.toml, which is not laid out.
    (run_dir / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    cpu_test\n    skip_global_cleanup\n"
        "asyncio_default_fixture_loop_scope = function\n"
    )


if __name__ == "__main__":
    lay_out(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
