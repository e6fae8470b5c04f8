"""Which shared-memory segments a test run left behind, so that the run can remove them and
nothing else (``tests/conftest.py``).

Other people's test runs share ``/dev/shm`` with this one, and a segment whose creator died
cannot tell who its creator's parent was.  So a watcher process
(``python tests/segment_watcher.py ROOT_PID``) sees each ``mmc_`` segment as it is created
(inotify), looks its creator up while the creator still lives (the pid a generated name
``mmc_<pid in base 36>_<random>`` carries) and notes it when the creator descends from
``ROOT_PID``.  When its standard input closes it prints the noted segments that still exist,
``NAME PID`` a line, and exits.  A segment whose creator died before the watcher looked it up,
or that was created with a name of its own, is not noted: it is left alone.

The watcher is a process, not a thread, so that tests may fork the test process safely.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import subprocess
import sys
from pathlib import Path

__all__ = ["SegmentWatcher", "descends_from", "remove_orphans"]

SHM = Path("/dev/shm")
PREFIX = "mmc_"
_IN_CREATE, _IN_MOVED_TO, _IN_Q_OVERFLOW = 0x100, 0x80, 0x4000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (alive or a zombie), or ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": the ppid


def descends_from(pid: int, root: int) -> bool:
    """Whether process ``pid`` is ``root`` or one of its descendants (``False`` once gone)."""
    while pid > 0:
        if pid == root:
            return True
        parent = parent_pid(pid)
        if parent is None or parent == pid:
            return False
        pid = parent
    return False


def creator_in_name(name: str) -> int | None:
    """The creator pid a generated segment name carries, or ``None`` for another name."""
    parts = name.split("_")
    if len(parts) != 3 or f"{parts[0]}_" != PREFIX or len(parts[2]) != 8:
        return None
    try:
        return int(parts[1], 36)
    except ValueError:
        return None


def _segments() -> set[str]:
    return {name for name in os.listdir(SHM) if name.startswith(PREFIX)}


def _watch(root: int) -> None:
    """The watcher process: note segments until standard input closes, then print them."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0 or libc.inotify_add_watch(fd, bytes(SHM), _IN_CREATE | _IN_MOVED_TO) < 0:
        raise OSError(ctypes.get_errno(), "inotify on /dev/shm")
    seen = _segments()  # what was there before the run: never ours
    ours: dict[str, int] = {}

    def note(names: set[str]) -> None:
        for name in names - seen:
            seen.add(name)
            pid = creator_in_name(name)
            if pid is not None and descends_from(pid, root):
                ours[name] = pid

    print("watching", flush=True)
    while True:
        readable, _, _ = select.select([fd, sys.stdin], [], [])
        if fd in readable:
            try:
                events = os.read(fd, 1 << 16)
            except BlockingIOError:
                events = b""
            names, at = set(), 0
            while at < len(events):
                _, mask, _, length = _EVENT.unpack_from(events, at)
                raw = events[at + _EVENT.size : at + _EVENT.size + length]
                at += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    names |= _segments()  # events were lost: look at everything
                name = raw.rstrip(b"\0").decode(errors="replace")
                if name.startswith(PREFIX):
                    names.add(name)
            note(names)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1 << 10):
            break
    present = _segments()
    for name, pid in sorted(ours.items()):
        if name in present:
            print(name, pid)


class SegmentWatcher:
    """Starts the watcher process for the process tree of ``root`` (default: this process);
    :meth:`stop` returns what it noted."""

    def __init__(self, root: int | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(os.getpid() if root is None else root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        if self._proc.stdout.readline() != "watching\n":  # it sees every creation from now on
            self._proc.kill()
            raise RuntimeError("the segment watcher did not start")

    def stop(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Stop watching; the noted segments that still exist, with their creators' pids."""
        out, _ = self._proc.communicate("", timeout=timeout_s)
        return {name: int(pid) for name, pid in (line.split() for line in out.splitlines())}


def remove_orphans(noted: dict[str, int]) -> list[str]:
    """Remove the segments of ``noted`` (name: creator pid) whose creator has died and that
    no writer holds (``remove_orphaned_segment`` judges them); returns their names."""
    from mmcache import MmcacheError, _core

    removed = []
    for name, pid in sorted(noted.items()):
        if parent_pid(pid) is not None:
            continue  # the creator lives (or its pid names another process now)
        try:
            if not _core.remove_orphaned_segment(name):
                continue  # not orphaned, or gone meanwhile
        except (OSError, MmcacheError):
            continue  # unreadable: leave it
        removed.append(name)
    return removed


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
