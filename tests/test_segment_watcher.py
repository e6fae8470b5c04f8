"""The session's clean-up of /dev/shm (``tests/conftest.py``) removes what this process tree
left behind, and nothing that belongs to a live process or to another process tree."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from mmcache import _core
from tests.segment_watcher import SegmentWatcher, descends_from, remove_orphans

CREATE = (
    "import sys; from mmcache import _core\n"
    "store = _core.ShmObjectStore.create(1 << 16)\n"
    "print(store.name, flush=True); sys.stdin.read(); store.close()\n"  # until told to go
)


def _creator(*prefix: str) -> tuple[subprocess.Popen[str], str]:
    """A process that creates a segment and keeps it until its stdin closes."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", CREATE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_the_process_tree_is_followed_up_to_its_root() -> None:
    with subprocess.Popen(["sleep", "30"]) as child:
        assert descends_from(child.pid, os.getpid())
        assert not descends_from(os.getpid(), child.pid)
        child.kill()
    assert not descends_from(child.pid, os.getpid())  # gone: it cannot be placed


def test_only_segments_this_tree_made_during_the_run_whose_creator_died_are_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Any store's creation on this host removes orphans, so another test run may remove the
    # killed creators' segments first: what matters is what `remove_orphans` tries to unlink.
    unlinked: list[str] = []
    unlink = _core.unlink_segment

    def recording(name: str) -> None:
        unlinked.append(name)
        unlink(name)

    monkeypatch.setattr(_core, "unlink_segment", recording)
    earlier, earlier_name = _creator()  # there before the run started
    watcher = SegmentWatcher()
    with subprocess.Popen(["sleep", "60"]) as stranger_root:
        stranger = SegmentWatcher(root=stranger_root.pid)  # a tree this process is not in
        killed, killed_name = _creator()
        alive, alive_name = _creator()
        try:
            for proc in (killed, earlier):
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
            noted = watcher.stop()
            assert noted == {killed_name: killed.pid, alive_name: alive.pid}
            assert remove_orphans(stranger.stop()) == []  # none of them is the stranger's
            assert unlinked == []
            assert remove_orphans(noted) in ([killed_name], [])  # [] if removed already
            assert unlinked in ([killed_name], [])  # never the one there before
            segments = _core.list_segments()
            assert killed_name not in segments
            assert alive_name in segments  # its creator lives
        finally:
            stranger_root.kill()
            alive.communicate("")  # told to go, it closes its segment
            with contextlib.suppress(FileNotFoundError):
                unlink(earlier_name)
    assert alive_name not in _core.list_segments()
