"""Session-wide fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.segment_watcher import SegmentWatcher, remove_orphans


@pytest.fixture(scope="session", autouse=True)
def segments_left_behind() -> Iterator[None]:
    """At the end of the session, remove the shared-memory segments that this run's processes
    created during the run and left behind when they died (a test that kills a writer, a
    run a failing test killed).  Segments that were there before, those of other process
    trees (other people's test runs share /dev/shm) and those of live processes are left
    alone (``tests/segment_watcher.py`` says how ours are told apart)."""
    watcher = SegmentWatcher()  # if this process dies first, its closed pipe stops the watcher
    yield
    remove_orphans(watcher.stop())
