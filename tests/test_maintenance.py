"""``inspect`` and ``prune`` (the functions and the commands) against real segments."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmcache import SegmentCorruptError, _core, inspect, prune

MiB = 1 << 20
SHM = "/dev/shm"
TIMEOUT = 120
#: The core's test hook: a creation waits this long once its segment is locked and sized but
#: has no header yet (``segment::pause_in_creation_for_tests``), or, with ``..._AT`` set to
#: ``locked``, once it is locked, still empty.
PAUSE_IN_CREATION = "MMCACHE_TEST_PAUSE_IN_CREATION_S"
PAUSE_IN_CREATION_AT = "MMCACHE_TEST_PAUSE_IN_CREATION_AT"


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
    with contextlib.suppress(FileNotFoundError):  # normally pruned already
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
    as_json = mmcache("inspect", "--json")
    assert as_json.returncode == 0
    listed = {entry["name"]: entry for entry in json.loads(as_json.stdout)}
    assert listed[live_store.name]["status"] == "live"


def test_inspect_of_a_missing_segment_fails_clearly() -> None:
    result = mmcache("inspect", "mmc_no_such_segment")
    assert result.returncode == 1
    assert "no segment named 'mmc_no_such_segment'" in result.stderr
    with pytest.raises(FileNotFoundError):
        inspect("mmc_no_such_segment")


def gone(name: str) -> bool:
    """Whether the segment ``name`` no longer exists: any store's creation on this host
    removes orphans, so another test run may take a test's orphan before its prune does."""
    return name not in _core.list_segments()


@pytest.fixture
def unlinked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names this process removes from now on (``prune`` removes through
    ``_core.remove_orphaned_segment``), whatever other processes remove meanwhile."""
    names: list[str] = []
    remove = _core.remove_orphaned_segment

    def recording(name: str) -> bool:
        removed = remove(name)
        if removed:
            names.append(name)
        return removed

    monkeypatch.setattr(_core, "remove_orphaned_segment", recording)
    return names


# The live store first: its creation would remove an orphan made before it.
def test_prune_removes_a_segment_whose_creator_was_killed(
    live_store: _core.ShmObjectStore, orphan: str, unlinked: list[str]
) -> None:
    listed = prune(dry_run=True)
    assert unlinked == [], "a dry run removed something"
    assert orphan in listed or gone(orphan)
    assert live_store.name not in listed
    removed = prune()
    assert orphan in removed or gone(orphan)
    assert unlinked == removed and live_store.name not in removed
    assert gone(orphan)
    assert live_store.name in _core.list_segments()  # a live creator's segment stays
    assert orphan not in prune()


def test_prune_commands_list_and_remove_orphans_and_leave_live_segments(
    live_store: _core.ShmObjectStore, orphan: str
) -> None:
    dry = mmcache("prune", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {orphan}" in dry.stdout or gone(orphan)
    result = mmcache("prune")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    removed = [line.removeprefix("removed ") for line in lines if line.startswith("removed ")]
    assert removed or lines == ["no segment left behind by a dead process"]
    assert gone(orphan) and all(gone(name) for name in removed)
    assert live_store.name not in dry.stdout + result.stdout
    assert live_store.name in _core.list_segments()


# --------------------------------------------------------------------------------------------
# Creation prunes: a segment outlives no creator, and never one that still makes or uses it


def creating(name: str, pause_s: float, at: str = "sized") -> subprocess.Popen[str]:
    """A process that creates the segment ``name`` and stops ``pause_s`` half-way through
    (locked and sized, no header yet; ``at="locked"``: locked, not sized), then prints
    ``created`` and keeps the store until its standard input closes."""
    code = (
        "import sys; from mmcache import _core\n"
        "store = _core.ShmObjectStore.create(1 << 20, name=sys.argv[1])\n"
        "print('created', flush=True); sys.stdin.read(); store.close()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, PAUSE_IN_CREATION: str(pause_s), PAUSE_IN_CREATION_AT: at},
    )


def wait_until_half_made(name: str) -> None:
    """Wait until the segment ``name`` exists with its size: its creator is in the pause."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            if os.stat(f"{SHM}/{name}").st_size > 0:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    pytest.fail(f"{name} was never created")


def half_made_name() -> str:
    return f"mmc_halfmade_{os.getpid()}_{time.monotonic_ns()}"


def test_the_next_creation_removes_a_half_made_segment_whose_creator_was_killed() -> None:
    name = half_made_name()
    creator = creating(name, pause_s=TIMEOUT)
    try:
        wait_until_half_made(name)
        assert _core.segment_status(name)[0] == "live", "its creator holds it while making it"
        creator.kill()
        creator.communicate(timeout=TIMEOUT)
        assert creator.returncode == -signal.SIGKILL
        # Decided at once, whatever its age: its creator's lock is gone (unless another
        # creation on this host removed it first).
        with contextlib.suppress(FileNotFoundError):
            assert _core.segment_status(name)[0] == "orphaned"
        with _core.ShmObjectStore.create(1 << 16) as store:
            assert not os.path.exists(f"{SHM}/{name}"), "a half-made segment outlived its creator"
            assert store.name in _core.list_segments()
    finally:
        creator.kill()
        creator.communicate()
        if os.path.exists(f"{SHM}/{name}"):
            _core.unlink_segment(name)


def test_a_creation_never_removes_a_segment_another_process_is_still_creating() -> None:
    name = half_made_name()
    creator = creating(name, pause_s=3.0)
    assert creator.stdout is not None
    try:
        wait_until_half_made(name)
        # Another store's creation (and prune) run while the first is half-made and young.
        with _core.ShmObjectStore.create(1 << 16):
            assert os.path.exists(f"{SHM}/{name}"), "a creation removed a segment being made"
        assert name not in prune()
        assert creator.stdout.readline() == "created\n"
        info = inspect(name)
        assert info["creator_alive"] is True and info["capacity"] == 1 << 20
    finally:
        creator.communicate("", timeout=TIMEOUT)  # told to go, it closes its store
        if os.path.exists(f"{SHM}/{name}"):
            _core.unlink_segment(name)
    assert creator.returncode == 0


# --------------------------------------------------------------------------------------------
# Names: anyone may put any file name in /dev/shm, and the commands print the names they find


#: Rich markup, an emoji code and a terminal escape (red text): none may act on the output.
HOSTILE = "[bold]x[/bold]:smile:\x1b[31m"


@pytest.fixture
def hostile_store() -> Iterator[_core.ShmObjectStore]:
    """A live segment whose name is full of what a terminal or rich would interpret."""
    name = f"mmc_hostile_{os.getpid()}_{time.monotonic_ns()}_{HOSTILE}".replace("/", "")
    with _core.ShmObjectStore.create(1 << 20, name=name) as store:
        yield store


def test_inspect_prints_a_hostile_name_as_it_is_never_as_markup_or_terminal_escapes(
    hostile_store: _core.ShmObjectStore,
) -> None:
    name = hostile_store.name
    assert "\x1b" in name and "[bold]" in name
    shown = ascii(name)  # what the commands print for a name with control characters
    for args in (("inspect", name), ("inspect",)):
        result = mmcache(*args)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout, f"{args}: a terminal escape reached the output"
        # The table may wrap the title: compare without white space (the name has none).
        unwrapped = "".join(result.stdout.split())
        assert shown in unwrapped, f"{args}: {result.stdout[:300]!r}"


def test_prune_prints_a_hostile_name_as_it_is(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmcache import cli, maintenance

    name = f"mmc_{HOSTILE}"
    monkeypatch.setattr(maintenance, "prune", lambda *, dry_run=False: [name])
    assert cli.main(["prune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and f"would remove {name!a}" in out


def test_a_file_whose_name_is_not_utf8_is_never_listed_judged_or_removed() -> None:
    """Anyone may put a file whose name is not UTF-8 in /dev/shm, even one under our prefix
    or holding a copy of a segment. Every name this package makes is UTF-8, so such a file is
    never one of its segments: listing, prune and every store's creation pass over it, and
    ``mmcache inspect NAME`` of it says the name is not UTF-8 (it was a UnicodeEncodeError
    about the 'utf-8' codec)."""
    with _core.ShmObjectStore.create(1 << 16) as store:
        dead = (Path(SHM) / store.name).read_bytes()  # copied: a segment no writer holds
    tag = f"{os.getpid()}_{time.monotonic_ns()}".encode()
    paths = [b"%s/mmc_\xff%s" % (SHM.encode(), tag), b"%s/odd_\xfe%s" % (SHM.encode(), tag)]
    for path in paths:
        with open(path, "xb") as f:
            f.write(dead)
    try:
        listed = _core.list_segments()
        assert not any(tag.decode() in name for name in listed)
        for name in listed:
            name.encode()  # UTF-8: no surrogate stands for a byte of a name
        assert not any(tag.decode() in name for name in prune(dry_run=True))
        assert not any(tag.decode() in name for name in prune())
        with _core.ShmObjectStore.create(1 << 16):
            pass
        for args in (("inspect",), ("inspect", "--json"), ("prune",)):
            result = mmcache(*args)
            assert result.returncode == 0, (args, result.stderr)
        for path in paths:
            name = os.fsdecode(path.rsplit(b"/", 1)[1])  # as a shell passes it: surrogates
            result = mmcache("inspect", name)
            assert result.returncode == 1
            assert "is not valid UTF-8" in result.stderr, result.stderr
            assert "codec" not in result.stderr, result.stderr
        assert all(os.path.exists(path) for path in paths), "a foreign file was removed"
    finally:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


# --------------------------------------------------------------------------------------------
# Another mmcache version's segment: its layout is not this build's, nor (maybe) its locks


def test_another_versions_segment_under_a_chosen_name_is_never_removed() -> None:
    """Its name carries no creator pid (a generated one does), and that version may take no
    locks: nothing tells whether its creator still runs, so neither prune nor a store's
    creation may remove it (its readers would find no segment to attach to)."""
    with _core.ShmObjectStore.create(1 << 16) as store:
        ours = (Path(SHM) / store.name).read_bytes()
    version = int.from_bytes(ours[8:16], "little")  # the header: magic, layout version, ...
    name = f"other_version_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(ours[:8] + (version + 1).to_bytes(8, "little") + ours[16:])
    try:
        assert name in _core.list_segments()  # found by its magic
        status, why = _core.segment_status(name)
        assert status == "undecided", why
        assert name not in prune(dry_run=True)
        with _core.ShmObjectStore.create(1 << 16):
            assert path.exists(), "a store's creation removed another version's segment"
        assert name not in prune() and path.exists()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "content", [b"another program's data", b"\xff" * 4096], ids=["short", "page"]
)
def test_another_programs_file_under_a_chosen_name_is_never_removed(content: bytes) -> None:
    """Any program may keep a file in /dev/shm under the name a user picks for a store. One
    that holds no mmcache header (its first word neither the magic nor the zeros of a
    creator killed half-way) is not a segment: a creation under that name finds the name
    taken, and neither it nor a removal of orphans deletes the file (it did: the store was
    created over it, and the file was gone once the store closed)."""
    name = f"foreign_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(content)
    try:
        status, why = _core.segment_status(name)
        assert status == "undecided", why
        assert _core.remove_orphaned_segment(name) is False
        with pytest.raises(FileExistsError, match=name):
            _core.ShmObjectStore.create(1 << 16, name=name)
        assert path.read_bytes() == content
    finally:
        path.unlink(missing_ok=True)


def test_inspect_of_another_programs_file_says_whose_it_is() -> None:
    """`mmcache inspect` of a file another program keeps in /dev/shm (Python's ``psm_...``,
    say) called it a segment that "failed validation ... — recreate the cache": advice to
    delete someone else's file. It says it is another program's file, as the listing's
    status does, and leaves it alone."""
    name = f"foreign_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(b"another program's data")
    try:
        result = mmcache("inspect", name)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"mmcache inspect: error: {name}: {SHM}/{name} ")
        assert "another program's file" in line and "recreate" not in line
        with pytest.raises(SegmentCorruptError, match="not a shared-memory segment of mmcache"):
            inspect(name)
        assert path.read_bytes() == b"another program's data"
    finally:
        path.unlink(missing_ok=True)


def test_a_half_made_segment_under_a_chosen_name_is_still_replaced() -> None:
    """A creator killed between sizing its file and writing its header leaves zeros: the
    next creation under that name replaces it (what a restarted engine does)."""
    name = f"half_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(bytes(1 << 16))
    try:
        with _core.ShmObjectStore.create(1 << 16, name=name) as store:
            assert store.name == name and inspect(name)["creator_alive"] is True
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_an_empty_file_left_by_a_creator_killed_before_sizing_it_is_taken_over_by_name() -> None:
    """A creator killed between creating its file and sizing it leaves an empty file under
    its chosen name. While it lives (it holds its lock) nothing removes it; once it is dead,
    a creation under that name takes the file over (it was a ``FileExistsError`` until the
    file was ten seconds old, whose advice, ``mmcache prune``, removed nothing), ``inspect``
    says what the file is (it said "corrupt ... recreate the cache"), and prune leaves it:
    under a chosen name an empty file may be another program's."""
    name = f"unsized_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    creator = creating(name, pause_s=TIMEOUT, at="locked")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path.stat().st_size == 0
        assert _core.segment_status(name)[0] == "live", "its creator holds it while making it"
        with pytest.raises(SegmentCorruptError, match=r"empty .*its creator holds it"):
            inspect(name)
        with pytest.raises(FileExistsError, match=name):
            _core.ShmObjectStore.create(1 << 16, name=name)
        assert path.exists(), "a creation removed a file whose creator is about to size it"
        creator.kill()
        creator.communicate(timeout=TIMEOUT)
        assert creator.returncode == -signal.SIGKILL
        assert path.stat().st_size == 0
        with pytest.raises(
            SegmentCorruptError, match=r"empty .*no process holds it.*takes it over"
        ):
            inspect(name)
        assert name not in prune(dry_run=True) and path.exists()
        with _core.ShmObjectStore.create(1 << 16, name=name) as store:
            assert store.name == name and inspect(name)["creator_alive"] is True
        assert not path.exists()
    finally:
        creator.kill()
        creator.communicate()
        path.unlink(missing_ok=True)


def test_a_creation_waiting_for_an_empty_file_under_its_name_lets_other_threads_run() -> None:
    """A creation under a chosen name waits (up to ten seconds) for an empty file there to be
    judged; it waited holding the GIL, so no other thread of the process ran meanwhile. Here
    another thread, while the creation waits, makes the file another program's (it writes
    data into it): the creation must see that and find the name taken, never take over the
    file it was waiting for."""
    name = f"waited_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(b"")
    outcome: list[object] = []

    def create() -> None:
        try:
            with _core.ShmObjectStore.create(1 << 16, name=name) as store:
                outcome.append(store.name)
        except Exception as exc:  # the outcome is what the test asserts
            outcome.append(exc)

    creation = threading.Thread(target=create)
    creation.start()
    try:
        time.sleep(0.3)  # the creation is waiting (or about to): this thread runs anyway
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"another program's data")
        finally:
            os.close(fd)
        creation.join(TIMEOUT)
        assert len(outcome) == 1 and isinstance(outcome[0], FileExistsError), outcome
        assert path.read_bytes() == b"another program's data"
    finally:
        creation.join(TIMEOUT)
        path.unlink(missing_ok=True)


def test_a_creation_under_a_name_whose_file_someone_keeps_locked_fails_clearly() -> None:
    """A creation under a chosen name first removes an orphan of that name, waiting for
    whoever else may be removing it (they lock the file a moment). A file of that name that
    another program keeps locked must not make it wait for ever: the name is taken."""
    name = f"locked_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(bytes(4096))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'r+b'); fcntl.lockf(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); sys.stdin.read()",
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    code = (
        "import sys; from mmcache import _core\n"
        "try:\n"
        "    _core.ShmObjectStore.create(1 << 16, name=sys.argv[1])\n"
        "except FileExistsError:\n"
        "    print('exists')\n"
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        try:
            creation = subprocess.run(
                [sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the creation waited for the lock on the name's file for ever")
        assert creation.stdout.split() == ["exists"], creation.stderr
        assert path.read_bytes() == bytes(4096), "the other program's file was changed"
    finally:
        holder.communicate("")
        path.unlink(missing_ok=True)


SHRINKER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
size, header = os.fstat(fd).st_size, os.pread(fd, 4096, 0)
print("shrinking", flush=True)
while True:
    os.ftruncate(fd, 0)
    time.sleep(0.0002)
    os.ftruncate(fd, size)
    os.pwrite(fd, header, 0)
    time.sleep(0.0002)
"""

JUDGE = """
import sys
from mmcache import MmcacheError, _core
judge = getattr(_core, sys.argv[2])
for _ in range(3000):
    try:
        judge(sys.argv[1])
    except (OSError, MmcacheError):
        pass
print("judged", flush=True)
"""


#: Where the layout keeps its liveness mode (``layout::header::LIVENESS``), and the code of
#: the pid fallback (``LIVENESS_PIDS``): whoever writes the file chooses either.
LIVENESS_WORD, LIVENESS_PIDS = 88, 2


@pytest.mark.parametrize(
    ("judge", "liveness"),
    [("segment_status", "locks"), ("segment_status", "pids"), ("inspect_segment", "locks")],
)
def test_judging_a_segment_that_another_process_keeps_shrinking_never_kills_the_judge(
    judge: str, liveness: str
) -> None:
    """Whoever can write a file in /dev/shm that looks like a segment can shrink it at any
    moment. Every store's creation judges every such file (to remove orphans), and
    ``mmcache inspect`` reads any such file it is given, so neither may touch it through a
    mapping: a shrunk file is a SIGBUS there."""
    with _core.ShmObjectStore.create(1 << 16) as store:
        header = bytearray((Path(SHM) / store.name).read_bytes())
    if liveness == "pids":
        header[LIVENESS_WORD : LIVENESS_WORD + 8] = LIVENESS_PIDS.to_bytes(8, "little")
    name = f"mmc_shrinking_{os.getpid()}_{time.monotonic_ns()}"
    path = Path(SHM) / name
    path.write_bytes(header)
    shrinker = subprocess.Popen(
        [sys.executable, "-c", SHRINKER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert shrinker.stdout is not None and shrinker.stdout.readline() == "shrinking\n"
        judge = subprocess.run(
            [sys.executable, "-c", JUDGE, name, judge],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    finally:
        shrinker.kill()
        shrinker.communicate()
        path.unlink(missing_ok=True)
    assert (judge.returncode, judge.stdout) == (0, "judged\n"), judge.stderr[-500:]
