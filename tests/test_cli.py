"""The ``mmcache`` command line: help, bad input, and ``bench`` (simulate has its own file).

Every command runs as ``python -m mmcache ...`` in a subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmcache.cli import CLI_EXTRA_MODULES, main


def mmcache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmcache", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("command", ["simulate", "bench", "inspect", "prune"])
def test_every_command_has_help_with_examples(command: str) -> None:
    result = mmcache(command, "--help")
    assert result.returncode == 0
    assert "examples:" in result.stdout and f"mmcache {command}" in result.stdout


def test_top_level_help_lists_the_commands() -> None:
    result = mmcache("--help")
    assert result.returncode == 0
    assert all(c in result.stdout for c in ("simulate", "bench", "inspect", "prune"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice"),
        (["simulate", "--no-such-flag"], "unrecognized arguments"),
        (["simulate", "--mode", "bogus"], "invalid choice"),
        (["simulate", "--requests", "0"], "must be at least 1"),
        (["simulate", "--requests", "many"], "not a whole number"),
        (["simulate", "--mode", "lru", "--compare"], "not allowed with argument"),
        (["simulate", "--capacity-gb", "0"], "cannot hold one request"),
        (["simulate", "--capacity-gb", "1000000"], "/dev/shm"),
        (["simulate", "--capacity-gb", "inf"], "--capacity-gb must be a finite number"),
        (["simulate", "--capacity-gb", "nan"], "--capacity-gb must be a finite number"),
        (["simulate", "--capacity-gb", "-1"], "--capacity-gb must be a finite number"),
        (["simulate", "--mode", "none", "--capacity-gb", "-1"], "--capacity-gb must be a finite"),
        (["simulate", "--mode", "lru", "--capacity-gb", "1e9"], "--capacity-gb must be at most"),
        (["simulate", "--inflight", "100000"], "--inflight must be between 1 and"),
        (["simulate", "--workers", "100000"], "--workers must be between 1 and"),
        (["simulate", "--workers", "0"], "--workers must be between 1 and"),
        (["simulate", "--inject-drift", "2"], "--inject-drift must be between 0 and"),
        (["simulate", "--catalogue", "10000000000"], "--catalogue must be at most"),
        (["simulate", "--zipf", "1000"], "--zipf must be between 0 and"),
        (["simulate", "--zipf", "nan"], "--zipf must be between 0 and"),
        (["simulate", "--seed", "-1"], "--seed must be between 0 and"),
        (["simulate", "--max-items", "1000"], "--max-items must be at most"),
        (["simulate", "--hosts", "0"], "must be at least 1"),
        (["simulate", "--hosts", "9"], "--hosts must be between 1 and"),
        (["simulate", "--remote", "redis://auto", "--mode", "none"], "--remote needs a P0 cache"),
        (["simulate", "--remote", "http://127.0.0.1:1"], "--remote http://127.0.0.1:1: expected"),
        (["simulate", "--remote", "memcached://auto"], "expected redis://"),
        # Refused before any process starts, naming the flag and what is missing.
        (["simulate", "--remote", "redis://"], "--remote redis://: no host"),
        (["simulate", "--remote", "valkey://:6379"], "--remote valkey://: no host"),
        (["simulate", "--remote", "mooncake://"], "--remote mooncake://: no host"),
        (["simulate", "--remote", "mooncake://master"], "--remote mooncake://: no port"),
        (["simulate", "--remote", "redis://host:notaport"], "--remote redis://: bad port"),
        (["simulate", "--remote", "redis://host:99999"], "--remote redis://: bad port"),
        # A bracket left open: urlsplit's own ValueError was a traceback.
        (["simulate", "--remote", "redis://[::1"], "--remote redis://: bad host"),
        (["simulate", "--remote", "valkey://u:secret@[::1:6379"], "--remote valkey://: bad host"),
        (["simulate", "--json", "/no/such/directory/out.json"], "does not exist"),
        (["bench", "--json", "/no/such/directory/out.json"], "does not exist"),
        # Refused before the run, not after it.
        (["simulate", "--json", "/"], "--json /: is a directory"),
        (["simulate", "--plot", "/"], "--plot /: is a directory"),
        (["bench", "--json", "/"], "--json /: is a directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    result = mmcache(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stderr  # a URL's password is never echoed


def _without(modules: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in which ``modules`` cannot be imported (as if
    the ``cli`` extra were not installed)."""
    block = f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", block + code], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("missing", CLI_EXTRA_MODULES)
@pytest.mark.parametrize("args", [["simulate", "--requests", "1"], ["prune"], ["--help"]])
def test_without_the_cli_extra_the_command_names_it_in_one_line(
    missing: str, args: list[str]
) -> None:
    run_cli = f"import runpy; sys.argv = ['mmcache', *{args!r}]\n"
    result = _without((missing,), run_cli + "runpy.run_module('mmcache', run_name='__main__')")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"mmcache: error: the command needs {missing}, which is not installed: "
        "pip install 'mmcache[cli]'"
    ]
    assert result.stdout == ""


def test_the_library_imports_without_the_cli_extra() -> None:
    # Every module but the command's own (and the vLLM adapter, which needs vLLM).
    code = f"""
import importlib, pathlib
import mmcache
root = pathlib.Path(mmcache.__file__).parent
skip = ("mmcache.simulate", "mmcache.bench", "mmcache.vllm", "mmcache.__main__")
names = [
    ".".join(("mmcache", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    for path in sorted(root.rglob("*.py"))
]
for name in names:
    if not name.startswith(skip):
        importlib.import_module(name)
extras = {CLI_EXTRA_MODULES!r}
loaded = [m for m, module in sys.modules.items() if module and m.split(".")[0] in extras]
print(len(names), loaded)
"""
    result = _without(CLI_EXTRA_MODULES, code)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(" ", 1)
    assert int(count) > 10 and loaded.strip() == "[]"


def test_main_returns_the_exit_status_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--capacity-gb", "0"]) == 2
    assert "cannot hold one request" in capsys.readouterr().err
    assert main(["prune", "--dry-run"]) == 0


@pytest.mark.parametrize("command", ["simulate", "bench", "inspect", "prune"])
def test_a_misspelled_flag_points_to_its_commands_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `mmcache --help` does not list a command's flags: the error must send the user to the
    # help that does, under the command's own name.
    with pytest.raises(SystemExit) as exit_:
        main([command, "--no-such-flag"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmcache {command}: error: unrecognized arguments: --no-such-flag")
    assert err.rstrip().endswith(f"(see mmcache {command} --help)")


def test_bench_quick_reports_every_operation_and_size(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = mmcache("bench", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    ops = {row["op"] for row in rows}
    core = {"memcpy (numpy)", "put (first lap)", "put", "lookup", "get (copy)", "get (zero-copy)"}
    cache = {"cache put", "cache lookup", "cache hit", "cache get (copy)", "cache get (zero-copy)"}
    assert ops == core | cache | {"put (full index)", "put (stalled reader)"}
    assert {row["size"] for row in rows} == {4 << 10, 64 << 10, 1 << 20, 16 << 20}
    # Only objects under 16 KiB fill the default key index before the ring.
    assert {row["size"] for row in rows if row["op"] == "put (full index)"} == {4 << 10}
    assert {row["readers"] for row in rows if row["op"].startswith("get")} == {1, 2}
    assert {row["readers"] for row in rows if row["op"].startswith("cache get")} == {1}
    assert all(row["seconds"] > 0 and row["vs_memcpy"] > 0 for row in rows)
    assert all(row["vs_memcpy"] == 1.0 for row in rows if row["op"] == "memcpy (numpy)")
    # A put into a ring its stalled reader keeps full fails: no bytes go anywhere (it showed
    # thousands of GiB/s, the payload's size over the time the refusal took).
    no_bytes = {"lookup", "cache lookup", "cache hit", "put (stalled reader)"}
    assert all((row["bytes_per_s"] is None) == (row["op"] in no_bytes) for row in rows)
    # Each size's rows: every cache row right after its core rows (1 and 2 readers).
    assert [row["op"] for row in rows if row["size"] == 4 << 10] == [
        "memcpy (numpy)",
        "put (first lap)",
        "put",
        "put (full index)",
        "put (stalled reader)",
        "cache put",
        "lookup",
        "cache lookup",
        "cache hit",
        "get (copy)",
        "get (copy)",
        "cache get (copy)",
        "get (zero-copy)",
        "get (zero-copy)",
        "cache get (zero-copy)",
    ]
    assert all(s in result.stdout for s in ("x memcpy", "16 MiB", "cache put"))


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``mmcache args`` with its stdout a pipe nobody reads any more (like ``| head -1``
    that has read its line, or ``| true``)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [sys.executable, "-m", "mmcache", *args],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(writer)


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["prune", "--dry-run"]])
def test_a_closed_output_pipe_ends_the_command_quietly(args: list[str]) -> None:
    result = _into_a_closed_pipe(*args)
    # As a command killed by SIGPIPE: 128 + 13, and nothing on stderr.
    assert (result.returncode, result.stderr) == (141, "")


def test_simulate_writes_its_json_even_when_its_output_pipe_closes_early(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = _into_a_closed_pipe(
        "simulate", "--requests", "10", "--catalogue", "5", "--json", str(out)
    )
    assert (result.returncode, result.stderr) == (141, "")
    assert json.loads(out.read_text())["runs"]


@pytest.mark.parametrize(
    ("command", "flag"), [("simulate", "--json"), ("simulate", "--plot"), ("bench", "--json")]
)
def test_an_output_file_that_cannot_be_created_is_refused_before_the_run(
    tmp_path: Path, command: str, flag: str
) -> None:
    # Its directory exists, but no file of that name can be made (the name is too long for
    # any file system): it was a traceback at the end of the run, the run's figures lost.
    out = tmp_path / ("x" * 300 + ".json")
    result = (
        mmcache(command, flag, str(out), "--requests", "1")
        if command == "simulate"
        else (mmcache(command, flag, str(out)))
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"mmcache {command}: error: {flag} " in result.stderr
    assert "cannot be written" in result.stderr
    assert result.stdout == ""  # nothing ran
    assert list(tmp_path.iterdir()) == []


def test_an_output_file_whose_write_fails_after_the_run_is_one_line_and_exit_status_1() -> None:
    # /dev/full takes an open and refuses every write (ENOSPC): a disk that filled up during
    # the run. The run's table is still shown, then one line says what was not written.
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    result = mmcache("simulate", "--requests", "2", "--catalogue", "2", "--json", "/dev/full")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "mmcache simulate: error: --json /dev/full: cannot be written "
        "(No space left on device); the figures are in the table above"
    ]
    assert "wrong tensors" in result.stdout


def _private_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _private_tmpfs_works(), reason="needs unshare -rm and a tmpfs mount")
def test_bench_on_a_small_dev_shm_ends_in_one_line_naming_the_fix() -> None:
    # Docker's default /dev/shm is 64 MiB; the benchmarks' rings need more (1 GiB for the
    # full-index rows). It was ShmTooSmallError's traceback, after seconds of other rows.
    script = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f'{sys.executable} -m mmcache bench --quick; echo "status $?"; ls -A /dev/shm'
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mmcache bench: error: ") and "--shm-size" in lines[0]
    # Exit status 1, and no segment left behind.
    assert result.stdout.strip().splitlines()[-1] == "status 1"


def test_a_plot_file_name_matplotlib_cannot_write_is_refused_before_the_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # matplotlib picks the format by the name's extension: an unknown one was its ValueError
    # traceback once the whole run was over.
    out = tmp_path / "chart.xyz"
    result = mmcache("simulate", "--requests", "1", "--plot", str(out))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"mmcache simulate: error: --plot {out}: matplotlib cannot write a .xyz file; "
        "name it .png (or .svg, .pdf, ...)"
    ]
    assert not out.exists()


def test_a_plot_file_name_without_an_extension_gets_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "chart"
    result = mmcache("simulate", "--requests", "2", "--catalogue", "2", "--plot", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert list(tmp_path.iterdir()) == [out]


def test_json_and_plot_into_one_file_are_refused_before_the_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # The chart was written over the figures: a run that ended with status 0 and no JSON.
    out = tmp_path / "figures"
    same = tmp_path / ".." / tmp_path.name / "figures"  # the same file, named otherwise
    result = mmcache("simulate", "--requests", "1", "--json", str(out), "--plot", str(same))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"mmcache simulate: error: --json {out} and --plot {same} name the same file "
        "(give each its own)"
    ]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_stops_bench_and_its_readers_in_one_line() -> None:
    # Ctrl-C reaches the whole foreground process group: each reader process printed its own
    # KeyboardInterrupt traceback before the command's one line.
    with subprocess.Popen(
        [sys.executable, "-m", "mmcache", "bench", "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell's foreground job
    ) as bench:

        def started() -> bool:
            # Both readers exist, and the benchmark is past starting them (it ignores
            # SIGINT only while it starts one).
            readers = [pid for pid in _children(bench.pid) if b"spawn_main" in _cmdline(pid)]
            return len(readers) >= 2 and not _ignores_sigint(bench.pid)

        deadline = time.monotonic() + 120
        while not started() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # polling /proc: nothing to wait on
        assert started(), "the readers never started"
        os.killpg(bench.pid, signal.SIGINT)
        _, err = bench.communicate(timeout=120)
    assert bench.returncode in (130, -signal.SIGINT), err
    assert err == "mmcache bench: interrupted\n"
