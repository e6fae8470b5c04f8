"""Check what `make wheel` built: one manylinux_2_17 x86_64 abi3 wheel and one sdist.

    python tests_wheel/check_dist.py DIST

The wheel's name must carry the tags pip matches on an older glibc (``cp311-abi3`` with
``manylinux_2_17_x86_64`` and its alias ``manylinux2014_x86_64``), and ``auditwheel show``
(the PyPA's check of the external libraries and symbol versions an extension uses) must find
it consistent with glibc 2.17 or older. The sdist must hold what a build from source needs.
Prints the wheel's name, size and auditwheel's report; exits with status 1 and the reason
otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import parse_wheel_filename

REQUIRED_TAGS = (
    Tag("cp311", "abi3", "manylinux_2_17_x86_64"),
    Tag("cp311", "abi3", "manylinux2014_x86_64"),
)
MAX_GLIBC = (2, 17)
# What pip needs to build the package from the sdist (with the locked dependencies).
SDIST_FILES = (
    "pyproject.toml",
    "Cargo.toml",
    "Cargo.lock",
    "src/lib.rs",
    "python/mmcache/__init__.py",
    "python/mmcache/_core.pyi",
)
# auditwheel wraps its report; the verdict is searched in the text with whitespace collapsed.
VERDICT = re.compile(r'consistent with the following platform tag: "manylinux_(\d+)_(\d+)_x86_64"')


def check(dist: Path) -> list[str]:
    """What is wrong with ``dist``'s artefacts (nothing: an empty list)."""
    wheels = sorted(dist.glob("mmcache-*.whl"))
    sdists = sorted(dist.glob("mmcache-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"expected one wheel and one sdist in {dist}, found {wheels + sdists}"]
    wheel = wheels[0]
    problems = []
    tags = parse_wheel_filename(wheel.name)[3]
    problems += [f"{wheel.name} lacks the tag {tag}" for tag in REQUIRED_TAGS if tag not in tags]
    auditwheel = Path(sys.executable).with_name("auditwheel")
    show = subprocess.run(
        [str(auditwheel), "show", str(wheel)], capture_output=True, text=True, check=False
    )
    print(show.stdout + show.stderr, end="")
    verdict = VERDICT.search(" ".join(show.stdout.split()))
    if show.returncode != 0 or verdict is None:
        problems.append(f"auditwheel finds {wheel.name} consistent with no manylinux tag")
    elif (int(verdict[1]), int(verdict[2])) > MAX_GLIBC:
        problems.append(
            f"{wheel.name} needs glibc {verdict[1]}.{verdict[2]}: a symbol newer than "
            f"{MAX_GLIBC[0]}.{MAX_GLIBC[1]} was linked"
        )
    with tarfile.open(sdists[0]) as sdist:
        members = {name.partition("/")[2] for name in sdist.getnames()}
    problems += [f"{sdists[0].name} lacks {name}" for name in SDIST_FILES if name not in members]
    for path in (wheel, sdists[0]):
        print(f"{path}: {path.stat().st_size / 1024:,.0f} KiB")
    return problems


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check(Path(sys.argv[1]))
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
