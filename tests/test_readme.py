"""The README's engine example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_engine_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    features = namespace["features"]
    assert isinstance(features, list) and len(features) == 3
    # The example closed its caches: nothing is left in /dev/shm.
    from mmcache import _core

    assert namespace["p0"].name not in _core.list_segments()  # type: ignore[attr-defined]


def test_readme_several_frontends_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "ShmSenderCache.join(" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)
    from mmcache import _core

    front_a = namespace["front_a"]
    assert namespace["updates_b"] == namespace["updates_a"] == ["<image>"] * 256
    assert front_a.name not in _core.list_segments()  # type: ignore[attr-defined]
