"""A segment's name across processes racing to create, join, close and sweep it.

Each test holds one process at one system call for seconds with strace's fault injection
(``-e inject=SYSCALL:delay_enter=…`` or ``delay_exit``): a delay any process may suffer
(preemption, a page fault, SIGSTOP), long enough for the others to act in. Nothing else is
changed; every verdict is the code's own.

* A sweep (every store's creation, ``prune``) judges a segment orphaned, then removes its
  name: the name must not pass to a new store in between.
* The last writer to close removes the name: a successor made under it meanwhile survives.
* A join that overlaps the death of the last writer either fails, or the segment it joined
  keeps its name.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import mmcache
from mmcache import _core

SHM = Path("/dev/shm")
SYS_FCNTL, SYS_UNLINK, SYS_UNLINKAT = 72, 87, 263  # x86_64
DELAY_US = 3_000_000
DEADLINE_S = 60  # only stops a hung test

pytestmark = pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="system call numbers are x86_64's"
)


def traced(code: str, inject: str, **popen: object) -> subprocess.Popen[bytes]:
    """``python -c code`` under strace, its system calls ``inject`` names delayed."""
    syscalls = inject.split(":", maxsplit=1)[0]
    return subprocess.Popen(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            f"trace={syscalls}",
            "-e",
            f"inject={inject}",
            sys.executable,
            "-c",
            code,
        ],
        **popen,  # type: ignore[call-overload]
    )


def tracee(strace: subprocess.Popen[bytes]) -> int:
    """The pid of the Python process strace started."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        children = Path(f"/proc/{strace.pid}/task/{strace.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    pytest.fail("strace started no process")


def wait_in_syscall(pid: int, numbers: set[int]) -> None:
    """Return once ``pid`` sits in one of the system calls ``numbers`` (held there)."""
    deadline = time.monotonic() + DEADLINE_S
    last = ""
    while time.monotonic() < deadline:
        try:
            last = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        except (OSError, IndexError):
            last = ""
        if last.isdigit() and int(last) in numbers:
            return
        time.sleep(0.01)
    pytest.fail(f"pid {pid} never reached system calls {numbers} (last: {last!r})")


def fresh_name() -> str:
    return f"mmc_race_{uuid.uuid4().hex[:10]}"


def test_a_sweep_never_removes_a_store_made_under_the_name_it_judged_orphaned() -> None:
    name = fresh_name()
    # A writer made `name`, then was killed: an orphan.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import os; from mmcache import _core; "
            f"w = _core.ShmObjectStore.create(1 << 16, name={name!r}); os.kill(os.getpid(), 9)",
        ],
        check=False,
    )
    assert _core.segment_status(name)[0] == "orphaned"
    # Another process's creation sweeps orphans, held at its removal of one.
    sweeper = traced(
        "from mmcache import _core; _core.ShmObjectStore.create(1 << 16).close()",
        f"unlink,unlinkat:delay_enter={DELAY_US}",
    )
    wait_in_syscall(tracee(sweeper), {SYS_UNLINK, SYS_UNLINKAT})
    # The writer restarted under its name: its creation removes the orphan, makes the store.
    successor = _core.ShmObjectStore.create(1 << 16, name=name)
    try:
        assert sweeper.wait(DEADLINE_S) == 0
        assert (SHM / name).exists(), "the sweep removed the successor's live segment"
        _core.ShmObjectStore.attach(successor.handle()).close()
    finally:
        successor.close()
    assert not (SHM / name).exists()


def test_the_last_writers_close_never_removes_a_successor_made_under_its_name() -> None:
    name = fresh_name()
    code = (
        "import sys; from mmcache import _core; "
        f"w = _core.ShmObjectStore.create(1 << 16, name={name!r}); print('up', flush=True); "
        "sys.stdin.readline(); w.close()"
    )
    inject = f"unlink,unlinkat:delay_enter={DELAY_US}"
    with traced(code, inject, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as old:
        assert old.stdout is not None and old.stdin is not None
        assert old.stdout.readline().strip() == b"up"
        old.stdin.write(b"close\n")
        old.stdin.flush()
        wait_in_syscall(tracee(old), {SYS_UNLINK, SYS_UNLINKAT})  # closing, about to unlink
        successor = _core.ShmObjectStore.create(1 << 16, name=name)
        try:
            assert old.wait(DEADLINE_S) == 0
            assert (SHM / name).exists(), "the old store's close removed its successor's segment"
            _core.ShmObjectStore.attach(successor.handle()).close()
        finally:
            successor.close()


CREATOR = """
import pickle, sys
from mmcache import _core
w = _core.ShmObjectStore.create(1 << 16, max_writers=2)
print(pickle.dumps(w.writer_handle()).hex(), flush=True)
sys.stdin.readline()
"""

JOINER = """
import os, pickle, sys
from mmcache import _core
handle = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
try:
    w = _core.ShmObjectStore.join(handle)
except Exception as e:
    print("refused", type(e).__name__, flush=True)
else:
    print("joined", os.path.exists("/dev/shm/" + w.name), flush=True)
    w.close()
"""


def test_a_join_overlapping_the_last_writers_death_fails_or_keeps_the_name() -> None:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    with (
        subprocess.Popen([sys.executable, "-c", CREATOR], **pipes) as creator,  # type: ignore[call-overload]
        subprocess.Popen([sys.executable, "-c", JOINER], **pipes) as joiner,  # type: ignore[call-overload]
    ):
        handle_hex = creator.stdout.readline().strip()
        name = pickle.loads(bytes.fromhex(handle_hex.decode())).name
        time.sleep(1.0)  # the joiner has imported mmcache and waits for the handle
        # The join's second fcntl returns late: after the membership lock, the joiner's first
        # look at the writers' shared lock.
        trace = ["strace", "-qq", "-p", str(joiner.pid), "-o", "/dev/null", "-e", "trace=fcntl"]
        with subprocess.Popen([*trace, "-e", f"inject=fcntl:delay_exit={DELAY_US}:when=2"]):
            deadline = time.monotonic() + DEADLINE_S
            status = Path(f"/proc/{joiner.pid}/status")
            while not re.search(r"TracerPid:\s*[1-9]", status.read_text()):
                assert time.monotonic() < deadline, "strace never attached"
                time.sleep(0.02)
            joiner.stdin.write(handle_hex + b"\n")
            joiner.stdin.flush()
            wait_in_syscall(joiner.pid, {SYS_FCNTL})
            time.sleep(0.3)  # well inside the delayed call
            creator.send_signal(signal.SIGKILL)  # the last writer dies mid-join
            creator.wait()
            pruned = mmcache.prune()
            answer = joiner.stdout.readline().decode().split()
            joiner.wait(DEADLINE_S)
    assert answer[:1] == ["refused"] or (answer == ["joined", "True"] and name not in pruned), (
        f"the join answered {answer} and prune removed {pruned}: a writer of a segment that "
        "no longer has a name"
    )
    mmcache.prune()


#: A thread's close() held at its unlink; made into a program by a first line that sets
#: ``name`` and what follows.
CLOSING = """
import os, threading, time
from pathlib import Path
from mmcache import _core
store = _core.ShmObjectStore.create(1 << 16, name=name)
first = threading.Thread(target=store.close)
first.start()
deadline = time.monotonic() + 60
# The first close is held at its unlink (strace): the store is closing, its name still there.
while Path(f"/proc/self/task/{first.native_id}/syscall").read_text().split()[0] not in (
    "87", "263"
):
    assert time.monotonic() < deadline, "the first close never reached its unlink"
    time.sleep(0.01)
"""


def test_a_close_that_overlaps_another_threads_close_returns_with_the_store_closed() -> None:
    name = fresh_name()
    inject = f"unlink,unlinkat:delay_enter={DELAY_US}"
    code = (
        f"name = {name!r}"
        + CLOSING
        + "store.close()\n"
        + "print('linked' if os.path.exists('/dev/shm/' + name) else 'gone', flush=True)\n"
        + "first.join()\n"
    )
    with traced(code, inject, stdout=subprocess.PIPE) as closers:
        assert closers.stdout is not None
        answer = closers.stdout.readline().decode().strip()
        assert closers.wait(DEADLINE_S) == 0
    # A second close() returning at once, mid-way through the first, would leave the name
    # there: a store re-created under it right after would fail with FileExistsError.
    assert answer == "gone", "close() returned while another thread's close was still closing"
    assert not (SHM / name).exists()


ATTACHER = """
import pickle, sys
from mmcache import _core
name, handle = sys.argv[1], pickle.loads(bytes.fromhex(sys.argv[2]))
try:
    _core.ShmObjectStore.attach(handle)
except FileNotFoundError:
    print("refused", sum(name in line for line in open("/proc/self/maps")), flush=True)
else:
    print("attached", flush=True)
"""


def test_an_attach_that_finds_the_name_gone_half_way_keeps_no_mapping_of_the_segment() -> None:
    """A reader opens the segment's file twice (its mapping, then its liveness locks): the
    last writer's close may remove the name in between. The attach then fails, and must not
    keep the segment mapped: its pages would stay allocated in /dev/shm while it runs."""
    with _core.ShmObjectStore.create(1 << 20) as store:
        handle = pickle.dumps(store.handle()).hex()
        path = SHM / store.name
        # The second open of the file finds no name (as after the last writer's unlink).
        result = subprocess.run(
            [
                "strace",
                "-f",
                "-qq",
                "-o",
                "/dev/null",
                "-P",
                str(path),
                "-e",
                "trace=open,openat",
                "-e",
                "inject=open,openat:error=ENOENT:when=2",
                sys.executable,
                "-c",
                ATTACHER,
                store.name,
                handle,
            ],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused", "0"], result.stdout


def test_a_forked_childs_close_never_waits_for_a_close_its_parent_has_in_progress() -> None:
    """A child forked while a thread of its parent closes the store inherits the store
    closing: that thread does not exist in the child, so the child's close() must return
    (its copy never acts for the parent) rather than wait for it."""
    name = fresh_name()
    code = (
        f"name = {name!r}"
        + CLOSING
        + "import signal\n"
        + "child = os.fork()\n"
        + "if child == 0:\n"
        + "    signal.alarm(20)  # ends a child that waits for ever\n"
        + "    store.close()\n"
        + "    os._exit(0)\n"
        + "status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])\n"
        + "print('child', status, flush=True)\n"
        + "first.join()\n"
    )
    inject = f"unlink,unlinkat:delay_enter={DELAY_US}"
    with traced(code, inject, stdout=subprocess.PIPE) as closers:
        assert closers.stdout is not None
        answer = closers.stdout.readline().decode().split()
        assert closers.wait(DEADLINE_S) == 0
    assert answer == ["child", "0"], f"the child's close() never returned: {answer}"
    assert not (SHM / name).exists()
