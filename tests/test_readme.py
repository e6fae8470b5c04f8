"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

from mmcache.remote.local_server import LocalServer

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


def test_readme_remote_example_runs(server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    block = next(b for b in blocks if "RemoteStore(" in b)
    url = '"redis://cache.internal:6379"'
    assert url in block, "the example's URL, replaced by the test server's"
    monkeypatch.setenv("MMCACHE_REMOTE_SECRET", "a secret the hosts share")
    namespace: dict[str, object] = {}
    exec(compile(block.replace(url, repr(server.url)), "README.md", "exec"), namespace)
    from mmcache.remote import TieredSenderCache

    p0 = namespace["p0"]
    assert isinstance(p0, TieredSenderCache)
    with p0:
        assert p0.is_cached(["0" * 64]) == [False]
        assert namespace["reader_handle"].n_readers == 8  # type: ignore[attr-defined]
