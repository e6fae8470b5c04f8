"""The wheel `make wheel` built installs and works without a Rust toolchain.

It is installed into a fresh virtual environment whose PATH has no cargo or rustc, with
``pip install --only-binary=:all:`` (nothing can be built from source; the dependencies come
from PyPI or pip's cache), and run from a directory outside the source tree, so the source
package cannot be imported by accident: the README's engine example, and ``mmcache simulate``
on a tiny workload. The wheel must hold the product and nothing else.

torch alone is not installed again: it is gigabytes (a CUDA build with its NVIDIA libraries),
and a second copy once filled a CI machine's disk. The fresh venv sees the test venv's torch
and what torch requires through links (`share_torch`); pip installs mmcache and every other
dependency of it into the fresh venv itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
RUST_TOOLS = ("cargo", "rustc")
# Deadlines that only stop a hung step (torch is a large install).
INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 300

# What the wheel must hold: the compiled core, its stub and the typing marker.
REQUIRED_FILES = (
    "mmcache/__init__.py",
    "mmcache/_core.abi3.so",
    "mmcache/_core.pyi",
    "mmcache/py.typed",
)
# The extras the README's install section lists.
REQUIRED_EXTRAS = {"torch", "cli", "remote", "mooncake", "vllm"}
# Test machinery that must stay out of the product: the drift fuzzer, tests, and fault
# injection into test servers (stopping one with SIGSTOP).
TEST_FILE = re.compile(r"(^|/)(fuzz[^/]*|tests?|test_[^/]*|conftest\.py)(/|$)")
FAULT_INJECTION = re.compile(r"\bSIGSTOP\b")
# A workload that still hits, misses and evicts in seconds (as in tests/test_simulate.py).
TINY = [
    "--requests",
    "24",
    "--catalogue",
    "40",
    "--capacity-gb",
    "0.03",
    "--inflight",
    "2",
    "--workers",
    "2",
    "--seed",
    "0",
]


def the_wheel() -> Path:
    wheels = sorted(DIST.glob("mmcache-*.whl"))
    assert len(wheels) == 1, f"`make wheel` leaves one wheel in {DIST}, found {wheels}"
    return wheels[0]


def test_wheel_holds_the_product_and_nothing_else() -> None:
    with zipfile.ZipFile(the_wheel()) as wheel:
        names = wheel.namelist()
        sources = {name: wheel.read(name).decode() for name in names if name.endswith(".py")}
        metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    problems = [f"missing {name}" for name in REQUIRED_FILES if name not in names]
    problems += [
        f"not part of the package: {name}"
        for name in names
        if not name.startswith("mmcache/") and ".dist-info/" not in name
    ]
    problems += [f"test machinery: {name}" for name in names if TEST_FILE.search(name)]
    problems += [
        f"fault injection: {n}" for n, text in sources.items() if FAULT_INJECTION.search(text)
    ]
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, flags=re.M))
    problems += [f"missing the extra {extra!r}" for extra in sorted(REQUIRED_EXTRAS - extras)]
    assert not problems, "\n".join(problems)


@dataclass(frozen=True)
class FreshVenv:
    """A virtual environment holding the wheel, and the environment to run it in."""

    path: Path
    env: dict[str, str]
    workdir: Path  # outside the source tree

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args,
            input=stdin,
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")


def environment_without_rust(venv: Path) -> dict[str, str]:
    """This process's environment with the venv first on PATH, no directory that holds cargo
    or rustc, and nothing that points Python or cargo elsewhere."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
        and not key.startswith(("CARGO", "RUSTUP", "RUSTC"))
    }
    dirs = [str(venv / "bin")] + [
        d
        for d in env.get("PATH", "").split(os.pathsep)
        if d and not any((Path(d) / tool).exists() for tool in RUST_TOOLS)
    ]
    env["PATH"] = os.pathsep.join(dirs)
    return env


# The venv the other suites run in (`make build`), whose torch the fresh venv shares.
TORCH_PYTHON = ROOT / ".venv" / "bin" / "python"

# Run by TORCH_PYTHON: torch and every distribution it requires there, each as its name, the
# folder its files are relative to, and its top-level files and folders.
TORCH_CLOSURE = """
import json, re
from importlib import metadata
from packaging.requirements import Requirement
seen, todo = {}, ["torch"]
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue  # required on another platform or Python only
    tops = sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."})
    seen[name] = [dist.metadata["Name"], str(dist.locate_file("")), tops]
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(json.dumps(list(seen.values())))
"""


def share_torch(fresh_site: Path, links: Path) -> list[str]:
    """Let the fresh venv see the test venv's torch (and what torch requires) instead of
    installing gigabytes again: one link per top-level file or folder of those distributions
    in `links`, and a `.pth` file that appends `links` to the fresh venv's path. Returns the
    distributions shared."""
    found = subprocess.run(
        [TORCH_PYTHON, "-c", TORCH_CLOSURE], capture_output=True, text=True, check=False
    )
    assert found.returncode == 0, f"`make build` installs torch into {TORCH_PYTHON}: {found}"
    links.mkdir()
    names = []
    for name, base, tops in json.loads(found.stdout):
        names.append(name)
        for top in tops:
            if not (links / top).exists():
                (links / top).symlink_to(Path(base) / top)
    (fresh_site / "shared-torch.pth").write_text(f"{links}\n")
    return names


@pytest.fixture(scope="module")
def venv() -> Iterator[FreshVenv]:
    root = Path(tempfile.mkdtemp(prefix="mmcache-wheel-"))
    try:
        assert not root.resolve().is_relative_to(ROOT)
        path, workdir = root / "venv", root / "work"
        workdir.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        fresh = FreshVenv(path, environment_without_rust(path), workdir)
        # No Rust toolchain can be found, by name, in the environment pip and mmcache run in.
        which = f"import shutil; print([shutil.which(t) for t in {RUST_TOOLS}])"
        found = fresh.run(fresh.python, "-c", which)
        assert found.stdout.strip() == "[None, None]", found
        site = fresh.run(
            fresh.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
        )
        shared = share_torch(Path(site.stdout.strip()), root / "shared-torch")
        assert "torch" in shared, shared
        install = subprocess.run(
            [
                *(fresh.python, "-m", "pip", "install", "--quiet", "--only-binary=:all:"),
                f"{the_wheel()}[cli]",
            ],
            cwd=workdir,
            env=fresh.env,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        assert install.returncode == 0, install.stdout + install.stderr
        yield fresh
    finally:
        shutil.rmtree(root, ignore_errors=True)


def readme_engine_example() -> str:
    """The Python block of the README's "Using it in an engine" section, as written there."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Using it in an engine\n(.*?)(?=^## )", readme, flags=re.S | re.M)
    assert section, "the README has a section 'Using it in an engine'"
    block = re.search(r"```python\n(.*?)```", section[1], flags=re.S)
    assert block, "that section has a Python example"
    return block[1]


# Runs the example (read from stdin) as a script would, then reports where mmcache came from
# and what the example left behind.
RUN_EXAMPLE = """
import json, sys
import mmcache
from mmcache import _core
namespace = {"__name__": "__main__"}
exec(compile(sys.stdin.read(), "README.md", "exec"), namespace)
print(json.dumps({
    "package": mmcache.__file__,
    "core": _core.__file__,
    "features": len(namespace["features"]),
    "segment_left": namespace["p0"].name in _core.list_segments(),
}))
"""


def test_readme_engine_example_runs_from_the_wheel(venv: FreshVenv) -> None:
    result = venv.run(venv.python, "-c", RUN_EXAMPLE, stdin=readme_engine_example())
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    # Imported from the fresh venv, never from the source tree.
    assert Path(report["package"]).is_relative_to(venv.path), report
    assert Path(report["core"]).name == "_core.abi3.so", report
    assert Path(report["core"]).is_relative_to(venv.path), report
    assert report["features"] == 3 and report["segment_left"] is False, report


def test_simulate_runs_from_the_wheel(venv: FreshVenv) -> None:
    out = venv.workdir / "figures.json"
    mmcache = str(venv.path / "bin" / "mmcache")
    result = venv.run(mmcache, "simulate", "--mode", "shm", *TINY, "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    run = figures["runs"]["shm"]
    assert figures["ok"] is True
    assert run["requests"] == 24 and run["items"] >= 24
    assert run["wrong_tensors"] == 0 and run["unrecovered"] == 0
    assert run["workers"] == 2 and run["tensors_checked"] > 0
    assert 0 < run["hit_ratio"] < 1
