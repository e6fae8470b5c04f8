"""docs/reference.md keeps up with the API."""

import inspect
import re
from pathlib import Path

import mmcache

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def test_reference_names_every_public_member() -> None:
    """It mentions every name `mmcache` exports and every public member of its classes, so a
    name added to the API cannot go undocumented."""
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", REFERENCE.read_text()))
    missing = []
    for name in mmcache.__all__:
        obj = getattr(mmcache, name)
        if name not in named:
            missing.append(name)
        if inspect.isclass(obj):
            missing += [
                f"{name}.{member}"
                for member in vars(obj)
                if not member.startswith("_") and member not in named
            ]
    assert not missing, f"docs/reference.md does not mention {missing}"
