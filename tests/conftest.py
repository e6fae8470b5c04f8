"""Session-wide fixtures, and the Valkey servers the remote tier's tests share."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest
import redis

from mmcache.remote.local_server import LocalServer, start_valkey
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


# The remote tier's tests (test_remote*.py): one server per module, a namespace per test.


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    with start_valkey() as srv:
        yield srv


@pytest.fixture
def raw(server: LocalServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


_namespaces = iter(range(10**9))


@pytest.fixture
def namespace() -> str:
    """A namespace of its own for each test: tests share one server, never a key."""
    return f"test/{next(_namespaces)}@1"


@pytest.fixture
def own_server() -> Iterator[LocalServer]:
    """A server this test may kill, stall and restart."""
    with start_valkey() as srv:
        yield srv


@pytest.fixture
def hang_deadline() -> Iterator[None]:
    """A hung call (a lock never released, a wait never ending, a survivor wedged by a dead
    writer) stops the run with every thread's traceback instead of hanging it; it never
    judges how long anything took. For modules of several processes: ``pytestmark =
    pytest.mark.usefixtures("hang_deadline")``."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
