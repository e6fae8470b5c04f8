"""``inspect`` and ``prune`` (the functions and the commands) against real segments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from mmcache import _core, inspect, prune

MiB = 1 << 20


def mmcache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmcache", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def live_store() -> Iterator[_core.ShmObjectStore]:
    """A writer with one object and two readers: one read its handle, the other has not."""
    with _core.ShmObjectStore.create(4 * MiB, n_readers=2) as store:
        prompt = _core.ShmObjectStore.attach(store.handle())
        slow = _core.ShmObjectStore.attach(store.handle())
        handle = store.put("item-a", b"x" * 100_000)
        prompt.get(handle, "item-a")
        yield store
        prompt.close()
        slow.close()


@pytest.fixture
def orphan() -> Iterator[str]:
    """The name of a segment whose creator was killed with SIGKILL before it could unlink."""
    code = (
        "import sys, time; from mmcache import _core\n"
        "store = _core.ShmObjectStore.create(1 << 20)\n"
        "store.put('k', b'payload')\n"
        "print(store.name, flush=True); time.sleep(60)\n"
    )
    creator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert creator.stdout is not None
    name = creator.stdout.readline().strip()
    os.kill(creator.pid, signal.SIGKILL)
    creator.communicate()  # reaps it and closes the pipe
    yield name
    if name in _core.list_segments():
        _core.unlink_segment(name)


def test_inspect_reports_occupancy_objects_and_outstanding_references(
    live_store: _core.ShmObjectStore,
) -> None:
    info = inspect(live_store.name)
    assert info["name"] == live_store.name
    assert info["capacity"] == live_store.capacity
    assert info["objects"] == 1 and 100_000 <= info["bytes_in_use"] < live_store.capacity
    assert info["occupancy"] == pytest.approx(info["bytes_in_use"] / info["capacity"])
    assert info["creator_pid"] == os.getpid() and info["creator_alive"] is True
    # The first reader read the one handle; the second still owes it.
    assert [reader["outstanding"] for reader in info["readers"]] == [0, 1]


def test_inspect_command_prints_the_segment(live_store: _core.ShmObjectStore) -> None:
    result = mmcache("inspect", live_store.name)
    assert result.returncode == 0, result.stderr
    assert "bytes_in_use" in result.stdout and "outstanding" in result.stdout
    as_json = mmcache("inspect", live_store.name, "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["objects"] == 1


def test_inspect_without_a_name_lists_live_segments(live_store: _core.ShmObjectStore) -> None:
    result = mmcache("inspect")
    assert result.returncode == 0
    assert f"{live_store.name}  live" in result.stdout


def test_inspect_of_a_missing_segment_fails_clearly() -> None:
    result = mmcache("inspect", "mmc_no_such_segment")
    assert result.returncode == 1
    assert "no segment named 'mmc_no_such_segment'" in result.stderr
    with pytest.raises(FileNotFoundError):
        inspect("mmc_no_such_segment")


def test_prune_removes_a_segment_whose_creator_was_killed(
    orphan: str, live_store: _core.ShmObjectStore
) -> None:
    assert orphan in _core.list_segments()
    listed = prune(dry_run=True)
    assert orphan in listed and live_store.name not in listed
    assert orphan in _core.list_segments()  # a dry run removes nothing
    result = mmcache("prune")
    assert result.returncode == 0, result.stderr
    assert f"removed {orphan}" in result.stdout
    assert orphan not in _core.list_segments()
    assert live_store.name in _core.list_segments()  # a live creator's segment stays
    assert orphan not in prune()


def test_prune_dry_run_command_lists_without_removing(orphan: str) -> None:
    result = mmcache("prune", "--dry-run")
    assert result.returncode == 0
    assert f"would remove {orphan}" in result.stdout
    assert orphan in _core.list_segments()
