"""``mmcache simulate``: the workload, the wire format, and the real command in every mode.

The command runs as a subprocess (``python -m mmcache simulate``) over a tiny workload; each
run takes a few seconds on two cores. Nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

import mmcache.simulate as simulate_package
from mmcache import Feature, _core, content_hash, make_caches
from mmcache.cli import main
from mmcache.simulate import ConfigError, RunMetrics, SimulationConfig, run_configs, wire
from mmcache.simulate.engine import _serve, worker_main
from mmcache.simulate.frontend import _Frontend, _Inbox, _Pending
from mmcache.simulate.report import render
from mmcache.simulate.workload import (
    TARGET_SIDE,
    Catalogue,
    decode_image,
    encode_image,
    process,
    request_stream,
    tensor_digests,
)
from tests.segment_watcher import creator_in_name

# A workload small enough for seconds per mode, big enough to hit, miss and evict: its 23
# distinct images of 2.3 MiB do not fit in 0.03 GiB (13 items). Two requests in flight keep
# at most 8 items unread, so the ring always has room and never serves an item uncached.
TINY = [
    "--requests",
    "24",
    "--catalogue",
    "40",
    "--capacity-gb",
    "0.03",
    "--inflight",
    "2",
    "--seed",
    "0",
]


def simulate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``mmcache simulate`` to its end and check that, however it ended, the run left
    none of its rings behind (the driver names them: ``mmc_<its pid>_…``)."""
    with subprocess.Popen(
        [sys.executable, "-m", "mmcache", "simulate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    left = [name for name in _core.list_segments() if creator_in_name(name) == proc.pid]
    assert not left, f"the run left its ring(s) {left} behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def figures(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def run_metrics(**changes: Any) -> RunMetrics:
    """The figures of a run that never ran: 1 for each one a run must report, ``changes``
    over them."""
    required = {
        name: 1
        for name, spec in RunMetrics.__dataclass_fields__.items()
        if spec.default is spec.default_factory  # the required fields (both MISSING)
    }
    return RunMetrics(**{**required, **changes})


def segments_by_creator() -> dict[str, int]:
    """Every mmcache segment on this host, with its creator's pid (other test suites may be
    creating and removing their own meanwhile)."""
    found = {}
    for name in _core.list_segments():
        try:
            found[name] = _core.inspect_segment(name)["creator_pid"]
        except (FileNotFoundError, _core.MmcacheError):
            continue  # removed, or still being created, since it was listed
    return found


# --------------------------------------------------------------------------------------------
# The workload


def test_images_decode_to_what_was_encoded() -> None:
    picture = Catalogue(5, seed=1)._picture(3)
    assert np.array_equal(decode_image(encode_image(picture)), picture)


def test_decode_refuses_foreign_bytes() -> None:
    with pytest.raises(ValueError, match="not an image"):
        decode_image(b"\x89PNG\r\n\x1a\n" + bytes(64))


def test_catalogue_images_are_distinct_and_reproducible() -> None:
    first, again = Catalogue(10, seed=7), Catalogue(10, seed=7)
    assert first[4] == again[4]
    assert len({first[i] for i in range(10)}) == 10
    assert Catalogue(10, seed=8)[4] != first[4]


def test_processor_output_looks_like_a_vision_processor() -> None:
    out = process(Catalogue(3, seed=0)[1])
    pixels, sizes = out.tensors["pixel_values"], out.tensors["image_sizes"]
    assert pixels.shape == (3, 448, 448) and pixels.dtype == np.float32
    assert sizes.dtype == np.int64 and 384 <= sizes[0] <= 960 and 512 <= sizes[1] <= 1280
    assert -3 < pixels.mean() < 3 and pixels.std() > 0.1  # normalised, not constant
    assert out.prompt_update["num_tokens"] == 256


def test_processing_is_deterministic_and_digests_see_one_changed_value() -> None:
    image = Catalogue(2, seed=0)[0]
    a, b = process(image).tensors, process(image).tensors
    assert tensor_digests(a) == tensor_digests(b)
    changed = dict(a, pixel_values=a["pixel_values"].copy())
    changed["pixel_values"][2, 447, 447] += 1e-3
    assert tensor_digests(changed)["pixel_values"] != tensor_digests(a)["pixel_values"]
    assert tensor_digests(changed)["image_sizes"] == tensor_digests(a)["image_sizes"]


def test_request_stream_is_seeded_and_requests_hold_distinct_images() -> None:
    def make(seed: int) -> list[list[int]]:
        return list(request_stream(requests=300, catalogue=50, zipf=1.2, max_items=4, seed=seed))

    requests = make(0)
    assert requests == make(0) and requests != make(1)
    assert all(1 <= len(r) <= 4 and len(set(r)) == len(r) for r in requests)
    assert {len(r) for r in requests} == {1, 2, 3, 4}
    assert all(0 <= i < 50 for r in requests for i in r)


def test_zipf_skews_popularity() -> None:
    def top_share(zipf: float) -> float:
        counts = Counter(
            i
            for r in request_stream(requests=2000, catalogue=100, zipf=zipf, max_items=1, seed=0)
            for i in r
        )
        return sum(n for _, n in counts.most_common(10)) / 2000

    assert top_share(0.0) < 0.2  # uniform: the top tenth of the catalogue gets about a tenth
    assert top_share(1.5) > 0.6


def test_wire_round_trips_items_handles_and_counts_traffic() -> None:
    sender, receiver = Pipe()
    item = {
        "pixel_values": np.arange(12, dtype=np.float32).reshape(3, 4),
        "image_sizes": np.array([5, 7]),
    }
    buffers: list[memoryview] = []
    fields = wire.encode_item(item, buffers)
    handle = _core.ShmHandle(address=4096, monotonic_id=9, signature=bytes(range(16)))
    traffic = wire.Traffic()
    wire.send(
        sender, {"item": fields, "handle": wire.encode_handle(handle)}, buffers, traffic=traffic
    )
    header, received = wire.recv(receiver)
    decoded = wire.decode_item(header["item"], received)
    assert decoded.keys() == item.keys()
    assert all(
        np.array_equal(decoded[k], item[k]) and decoded[k].dtype == item[k].dtype for k in item
    )
    assert wire.decode_handle(header["handle"]) == handle
    assert traffic.payload_bytes == 48 + 16 and traffic.header_bytes > 0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "shm", "capacity_gb": 0.0}, "cannot hold one request"),
        ({"mode": "lru", "capacity_gb": 0.005}, "cannot hold one request"),
        ({"workers": 0}, "--workers"),
        ({"workers": 10_000}, "--workers"),
        ({"inject_drift": 0.9}, "--inject-drift"),
        ({"zipf": -1.0}, "--zipf"),
        ({"requests": 0}, "--requests"),
        ({"mode": "shm", "capacity_gb": 1e6}, "/dev/shm"),
        ({"mode": "bogus"}, "unknown mode"),
        ({"frontends": 0}, "--frontends"),
        ({"frontends": 9}, "--frontends"),
        ({"frontends": 3, "requests": 2}, "leaves a frontend without requests"),
        ({"frontends": 2, "mode": "lru"}, "P1's cache mirrors the LRU of one P0"),
        ({"claim_wait_s": float("nan")}, "--claim-wait-s"),
        ({"claim_wait_s": -1.0}, "--claim-wait-s"),
        ({"mode": "shm", "capacity_gb": float("inf")}, "--capacity-gb must be a finite number"),
        ({"mode": "lru", "capacity_gb": float("nan")}, "--capacity-gb must be a finite number"),
        # Found by a P0 once every process had started, naming the API's capacity_gb.
        ({"mode": "none", "capacity_gb": float("nan")}, "--capacity-gb must be a finite number"),
        ({"mode": "none", "capacity_gb": -1.0}, "--capacity-gb must be a finite number"),
        ({"mode": "lru", "capacity_gb": 20000.0}, "--capacity-gb must be at most 16384 GiB"),
        ({"mode": "none", "capacity_gb": 1e300}, "--capacity-gb must be at most 16384 GiB"),
        ({"inflight": 10**6}, "--inflight"),
        ({"remote": "redis://"}, "no host"),
    ],
)
def test_impossible_configurations_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimulationConfig(**changes).validate()


def test_more_workers_than_a_ring_has_reader_slots_are_refused_on_a_big_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 4 workers per CPU allow 256 on 64 CPUs, but a ring has 64 reader slots: the run was
    # accepted and P0 died making its ring ("n_readers must be between 1 and 64", a
    # traceback and exit status 1) instead of a usage error before anything started.
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    with pytest.raises(ConfigError, match="--workers must be at most 64 in mode shm"):
        SimulationConfig(mode="shm", workers=65).validate()
    with pytest.raises(ConfigError, match="--workers must be at most 64 in mode shm"):
        run_configs(SimulationConfig(mode="lru", workers=100).compared())  # --compare
    # The other modes have no reader slots: the CPUs are their only bound.
    SimulationConfig(mode="lru", workers=100).validate()
    SimulationConfig(mode="shm", workers=64).validate()


def test_capacity_zero_is_fine_without_a_cache() -> None:
    SimulationConfig(mode="none", capacity_gb=0.0).validate()


def test_a_catalogue_smaller_than_max_items_needs_room_for_its_images_only() -> None:
    # A request holds distinct images, so a catalogue of 2 makes requests of 1 or 2 items
    # whatever --max-items says (4 by default): a cache of 2 items serves them all.
    workload = ["--requests", "4", "--catalogue", "2", "--capacity-gb", "0.005"]
    result = simulate("--mode", "lru", *workload, "--inflight", "1")
    assert result.returncode == 0, result.stderr
    assert "4 requests of 1-2 images" in result.stdout
    # One image short of the largest request is still refused, naming its size.
    with pytest.raises(ConfigError, match="one request's 2 items"):
        SimulationConfig(mode="lru", catalogue=2, capacity_gb=0.004).validate()


# --------------------------------------------------------------------------------------------
# The real command


@pytest.mark.parametrize("mode", ["none", "processor_only", "lru", "shm"])
def test_every_mode_serves_every_request_with_the_right_tensors(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = simulate("--mode", mode, *TINY, "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"][mode]
    assert run["requests"] == 24 and run["items"] > 24
    assert run["wrong_tensors"] == 0 and run["unrecovered"] == 0
    # Every worker checks both tensors of every item it receives.
    assert run["tensors_checked"] == 2 * 2 * run["items"]
    assert run["requests_per_s"] > 0 and run["latency_p99_ms"] >= run["latency_p50_ms"] > 0
    if mode == "none":
        assert run["hit_ratio"] == 0 and run["items_processed"] == run["items"]
        assert run["evictions"] is None and run["bytes_saved"] == 0
    else:
        assert 0 < run["hit_ratio"] < 1 and run["items_processed"] < run["items"]
        assert run["processing_s_saved"] > 0 and run["evictions"] > 0
    if mode == "lru":
        assert 0 < run["bytes_saved"] < run["bytes_moved"]
    if mode == "shm":
        # Only handles travel: no tensor bytes through pipes, all of them saved.
        assert run["payload_bytes_moved"] == 0 and run["shm_bytes_written"] > 0
        assert run["bytes_saved"] == run["items"] * 3 * (3 * 448 * 448 * 4 + 16)
    assert "wrong tensors" in result.stdout and mode in result.stdout


def test_compare_runs_every_mode_on_one_workload(tmp_path: Path) -> None:
    out, plot = tmp_path / "figures.json", tmp_path / "chart.png"
    result = simulate("--compare", *TINY, "--json", str(out), "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    data = figures(out)
    assert list(data["runs"]) == ["none", "processor_only", "lru", "shm"]
    assert data["ok"] is True and data["config"]["requests"] == 24
    assert data["speedup_vs_none"]["none"] == 1.0
    # The same seeded requests in every mode: the same items, and the caches that mirror
    # each other find the same hits.
    assert len({run["items"] for run in data["runs"].values()}) == 1
    assert data["runs"]["processor_only"]["hit_ratio"] == data["runs"]["lru"]["hit_ratio"]
    assert [t["target"] for t in data["targets"]] == [
        "shm requests/s >= 3x none",
        "shm requests/s ahead of lru",
        "shm hit ratio within 2 points of lru",
    ]
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "speed-up vs none" in result.stdout


@pytest.mark.parametrize("mode", ["lru", "shm"])
def test_injected_drift_is_recovered_by_one_retry(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = simulate("--mode", mode, *TINY, "--inject-drift", "0.3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"][mode]
    assert run["dropped_updates"] > 0
    assert run["wrong_tensors"] == 0 and run["unrecovered"] == 0 and run["requests"] == 24
    if mode == "lru":
        # A lost request leaves P0 believing P1 holds items it never got: P1 misses them.
        assert run["retries"] > 0
    else:
        # P0 owns the ring, so nothing drifts; the lost requests' handles were released.
        assert run["retries"] == 0 and run["served_uncached"] == 0


def test_a_cache_that_holds_the_whole_catalogue_reports_no_evictions_after_retries(
    tmp_path: Path,
) -> None:
    """0.2 GiB holds 87 items, more than the 40 images of the catalogue: nothing is ever
    evicted, whatever the drift. A retry reprocesses items P0's cache already holds (to carry
    their data to P1) without storing them again, which must not read as evictions."""
    out = tmp_path / "figures.json"
    tiny = [*TINY[:4], "--capacity-gb", "0.2", *TINY[6:]]
    result = simulate("--mode", "lru", *tiny, "--inject-drift", "0.3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["lru"]
    assert run["retries"] > 0 and run["served_uncached"] == 0
    assert run["evictions"] == 0


def test_an_lru_retry_carries_every_items_data_to_p1() -> None:
    """After lost updates P1's LRU evicts in another order than P0's mirror, so with other
    requests in flight an item P0 still believes P1 holds may be gone by the time the retry
    reaches P1: the retry sends every item's data, also where P0's cache answers ``None``."""
    config = SimulationConfig(mode="lru", requests=1, catalogue=4, capacity_gb=0.03, workers=1)
    p0_cache, _ = make_caches("lru", capacity_gb=config.capacity_gb)
    engine, _peer = Pipe()
    p0 = _Frontend(config, 0, 0, p0_cache, None, engine, [], engine)
    catalogue = Catalogue(config.catalogue, config.seed)
    images = [0, 1]
    hashes = [content_hash(catalogue[i], size=TARGET_SIDE) for i in images]
    pending = _Pending(images, hashes, started=0.0)

    def sent() -> list[bool]:
        """Which items the next attempt carries data for."""
        return ["item" in entry for entry in p0._assemble(pending)[0]]

    assert sent() == [True, True], "processed and sent"
    assert sent() == [False, False], "P1 holds both, as far as P0 knows"
    pending.retried = True
    assert sent() == [True, True]
    assert p0.counts.processed == 4 and p0.counts.hits == 2, "a retry's data is no hit"


def test_several_workers_each_verify_everything(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = simulate("--mode", "shm", *TINY, "--workers", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["shm"]
    assert run["workers"] == 3 and run["tensors_checked"] == 3 * 2 * run["items"]


def _pipeline_processes(pid: int) -> set[int]:
    """The children of ``pid`` started by multiprocessing's spawn (not its resource tracker,
    which exits by itself once its parent is gone)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            spawned = b"spawn_main" in (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == pid and spawned:
            found.add(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# Ctrl-C is SIGINT, which a process started in the background by a non-interactive shell
# (`make test &`, nohup) inherits as ignored, and Python keeps it ignored. A user at a terminal
# runs simulate with the default disposition: these runs start with it, whoever started pytest.
WITH_DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


def _ring_of(driver: int, deadline: float) -> tuple[str, int]:
    """The name of the simulation's shared-memory ring and the pid of its creator, P0."""
    while time.monotonic() < deadline:
        children = _pipeline_processes(driver)
        for name, pid in segments_by_creator().items():
            if pid in children:
                return name, pid
        time.sleep(0.1)
    pytest.fail("the simulation never created its ring")


#: Enough work to be interrupted at leisure.
WORK = ["--requests", "5000", "--catalogue", "20", "--capacity-gb", "0.05"]


def test_ctrl_c_stops_every_process_and_leaves_no_segment() -> None:
    proc = subprocess.Popen(
        [
            *WITH_DEFAULT_SIGINT,
            "-m",
            "mmcache",
            "simulate",
            *WORK,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ring, _ = _ring_of(proc.pid, time.monotonic() + 60)
        time.sleep(1.0)  # let requests flow
        children = _pipeline_processes(proc.pid)
        assert len(children) == 4  # P0, P1 and two workers
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not any(_running(child) for child in children)
    assert ring not in _core.list_segments()


def _children_of(pid: int) -> set[int]:
    """The child processes of ``pid`` (the pipeline's, and a server started for the run) but
    multiprocessing's resource tracker, which exits by itself once its parent is gone."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            tracker = b"resource_tracker" in (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == pid and not tracker:
            found.add(int(stat.parent.name))
    return found


def test_sigterm_stops_the_run_as_ctrl_c_does(tmp_path: Path) -> None:
    # SIGTERM (`timeout`, `kill`, a CI job cancelled) killed the driver on the spot: the
    # children went by themselves, but the directory of the Valkey started for the run
    # (its log) stayed in $TMPDIR after every such run.
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcache", "simulate", "--remote", "redis://auto", *WORK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        ring, _ = _ring_of(proc.pid, time.monotonic() + 60)
        time.sleep(1.0)  # let requests flow
        children = _children_of(proc.pid)
        assert len(children) == 5  # P0, P1, two workers and the server
        assert [p.name[:15] for p in tmp_path.iterdir()] == ["mmcache-valkey-"]
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines() == ["mmcache simulate: terminated"]
    assert not any(_running(child) for child in children)
    assert ring not in _core.list_segments()
    assert list(tmp_path.iterdir()) == []


def _request(
    item: dict[str, np.ndarray], digests: dict[str, bytes]
) -> tuple[dict[str, Any], list[bytes]]:
    """A request message with one feature, as a worker receives it."""
    buffers: list[memoryview] = []
    feature = Feature(data=item, mm_hash="h1", identifier="h1", digests=digests)
    header = {"rid": 0, "attempt": 1, "features": [wire.encode_feature(feature, buffers)]}
    return header, [bytes(b) for b in buffers]


def test_a_worker_whose_ring_is_gone_before_it_attaches_exits_quietly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # As when P0 dies before a worker attaches and the ring is removed meanwhile (by the
    # driver, or by any store's creation on the host): the driver names P0, not the worker.
    with _core.ShmObjectStore.create(1 << 16) as store:
        handle = store.handle()
    inbox, setup = Pipe(duplex=False)
    _, outbox = Pipe(duplex=False)
    wire.send(setup, {"type": "setup", "reader": pickle.dumps(handle)})
    with pytest.raises(SystemExit) as exit_status:
        worker_main(0, inbox, [outbox])
    assert exit_status.value.code == wire.PEER_GONE
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("hang_deadline")
def test_p0_reads_replies_while_it_sends() -> None:
    """P1 replies to each request before it reads the next (a miss names every hash of its
    request): a P0 that sends a burst before reading anything fills the pipe one way while P1
    fills it the other, and both wait for good. P0's inbox reads as replies come."""
    p0, p1 = Pipe()
    n = 300  # replies of 4 KiB: several times what a socket buffers

    def engine_core() -> None:
        for rid in range(n):
            wire.recv(p1)
            wire.send(p1, {"type": "miss", "rid": rid, "missing": ["f" * 64] * 64})
        wire.send(p1, {"type": "stats"})

    peer = threading.Thread(target=engine_core, daemon=True)
    peer.start()
    inbox = _Inbox([p0])
    for rid in range(n):
        wire.send(p0, {"type": "request", "rid": rid, "data": bytes(16 << 10)})
    got = [inbox.next() for _ in range(n + 1)]
    peer.join()
    assert [header.get("rid") for _, header in got] == [*range(n), None]
    assert {conn for conn, _ in got} == {p0}


def test_a_worker_counts_every_tensor_that_differs_from_the_truth() -> None:
    item = process(Catalogue(1, seed=0)[0]).tensors
    truth = tensor_digests(item)
    assert _serve(*_request(item, truth), None, Counter()) | {"rid": 0} == {
        "type": "done",
        "rid": 0,
        "attempt": 1,
        "missing": [],
        "checked": 2,
        "wrong": 0,
    }
    tampered = dict(item, image_sizes=item["image_sizes"] + 1)
    assert _serve(*_request(tampered, truth), None, Counter())["wrong"] == 1
    missing_field = {"pixel_values": item["pixel_values"]}
    assert _serve(*_request(missing_field, truth), None, Counter())["wrong"] == 1
    # A tensor P0 never produced is received, not verified: it is wrong too.
    extra_field = dict(item, attention_mask=np.ones(4, np.int64))
    reply = _serve(*_request(extra_field, truth), None, Counter())
    assert (reply["checked"], reply["wrong"]) == (3, 1)


def test_wrong_tensors_make_the_command_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def one_bad_run(configs: list[SimulationConfig], on_progress: Any) -> list[RunMetrics]:
        return [run_metrics(mode=configs[0].mode, unrecovered=0, evictions=None)]

    monkeypatch.setattr(simulate_package, "run_configs", one_bad_run)
    out = tmp_path / "figures.json"
    assert main(["simulate", "--mode", "lru", "--json", str(out)]) == 1
    assert "lru: 1 wrong tensors" in capsys.readouterr().err
    assert figures(out)["ok"] is False


# --------------------------------------------------------------------------------------------
# Bad input and runaway sizes (issue 8, item 9)


def _tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            fields = Path(f"/proc/{current}/statm").read_text().split()
        except OSError:
            continue
        total += int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def test_a_huge_request_count_is_generated_lazily_with_progress_and_bounded_memory() -> None:
    """99,999,999,999,999 requests: serving starts at once (the workload is not built up
    front), the progress bar shows the count, memory stays small; Ctrl-C ends it."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            *WITH_DEFAULT_SIGINT,
            "-m",
            "mmcache",
            "simulate",
            "--requests",
            "99999999999999",
            "--mode",
            "none",
            "--catalogue",
            "20",
            "--workers",
            "1",
        ],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "COLUMNS": "160"},
    )
    os.close(follower)
    screen = b""
    try:
        deadline = time.monotonic() + 120
        peak = 0
        while time.monotonic() < deadline and b"/99999999999999" not in screen:
            ready = select.select([leader], [], [], 0.5)[0]
            if ready:
                try:
                    screen += os.read(leader, 65536)
                except OSError:
                    break
            peak = max(peak, _tree_rss_bytes(proc.pid))
        assert b"/99999999999999" in screen, screen[-2000:]
        # Served requests tick up while memory stays where it was.
        time.sleep(3)
        peak = max(peak, _tree_rss_bytes(proc.pid))
        assert peak < 1.5 * 2**30
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
        proc.wait()
        os.close(leader)
    assert b"Traceback" not in screen


def _ring_being_made(driver: int, deadline: float) -> tuple[str, int]:
    """The name of the ring a pipeline process of ``driver`` holds open once it has its size
    (with the core's pause in creation: half-made), and that process's pid: P0's."""
    while time.monotonic() < deadline:
        for pid in _pipeline_processes(driver):
            try:
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    target = Path(os.readlink(fd))
                    if target.parent == Path("/dev/shm") and target.stat().st_size > 0:
                        return target.name, pid
                except OSError:
                    continue
        time.sleep(0.05)
    pytest.fail("the simulation never started creating its ring")


def test_a_p0_killed_while_creating_its_ring_leaves_no_segment() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcache", "simulate", "--mode", "shm", *TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The core's test hook: creation stops half-way (locked and sized, no header yet).
        env={**os.environ, "MMCACHE_TEST_PAUSE_IN_CREATION_S": "600"},
    )
    try:
        ring, p0 = _ring_being_made(proc.pid, time.monotonic() + 60)
        os.kill(p0, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "P0 (frontend)" in lines[0] and "SIGKILL" in lines[0], stderr
    assert ring not in _core.list_segments(), "the half-made ring outlived the run"


def _a_long_simulation() -> subprocess.Popen[str]:
    """``mmcache simulate`` with more requests than a test waits for (it kills a process)."""
    command = [sys.executable, "-m", "mmcache", "simulate", "--requests", "5000"]
    command += ["--catalogue", "20", "--capacity-gb", "0.05"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line_naming(stderr: str, who: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert who in lines[0] and "SIGKILL" in lines[0]


@pytest.mark.parametrize("attempt", range(3))
def test_sigkill_of_p0_ends_with_one_line_naming_it(attempt: int) -> None:
    proc = _a_long_simulation()
    try:
        ring, p0 = _ring_of(proc.pid, time.monotonic() + 60)
        time.sleep(0.5 + attempt * 0.7)  # let requests flow (a different moment each time)
        os.kill(p0, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    _one_line_naming(stderr, "P0 (frontend)")
    assert "Traceback" not in stderr and "EOFError" not in stderr
    assert ring not in _core.list_segments(), "the driver removes the ring P0 left"


def _a_worker_of(driver: int, ring: str, p0: int, deadline: float) -> int:
    """A worker of the simulation: a pipeline process other than P0 with its ring mapped
    (P1 passes the reader handle on without attaching)."""
    while time.monotonic() < deadline:
        for pid in _pipeline_processes(driver) - {p0}:
            try:
                if f"/dev/shm/{ring}" in Path(f"/proc/{pid}/maps").read_text():
                    return pid
            except OSError:
                continue
        time.sleep(0.1)
    pytest.fail("no worker attached to the ring")


def test_sigkill_of_a_worker_ends_with_one_line_naming_it() -> None:
    """The peers it leaves (P0 reading its results, P1) stop without a traceback of theirs,
    and the line names the worker, not them."""
    proc = _a_long_simulation()
    try:
        ring, p0 = _ring_of(proc.pid, time.monotonic() + 60)
        worker = _a_worker_of(proc.pid, ring, p0, time.monotonic() + 60)
        children = _pipeline_processes(proc.pid)
        time.sleep(0.5)  # let requests flow
        os.kill(worker, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    _one_line_naming(stderr, "worker")
    assert not any(_running(child) for child in children)
    assert ring not in _core.list_segments()


# --------------------------------------------------------------------------------------------
# Several hosts sharing a remote tier


def test_two_hosts_share_a_real_valkey_and_process_less_than_alone(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = simulate(
        *TINY,
        "--mode",
        "lru",
        "--remote",
        "redis://auto",
        "--hosts",
        "2",
        "--compare",
        "--json",
        str(out),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    runs = figures(out)["runs"]
    assert list(runs) == ["lru", "lru + redis"]
    alone, shared = runs["lru"], runs["lru + redis"]
    for run in (alone, shared):
        assert run["hosts"] == 2 and len(run["per_host"]) == 2
        assert run["requests"] == 2 * 24 and run["wrong_tensors"] == 0 and run["unrecovered"] == 0
        assert run["tensors_checked"] == 2 * 2 * run["items"]
    # The same requests on the same hosts: the tier only changes who processes what.
    assert (
        alone["items"] == shared["items"] and alone["distinct_images"] == shared["distinct_images"]
    )
    assert alone["remote_hits"] == 0 and shared["remote_hits"] > 0
    assert 0 < shared["cross_host_hits"] <= shared["remote_hits"]
    # Each host's local cache sees the same requests either way (an LRU: deterministic), so
    # every local miss is processed alone and either processed or fetched with the tier.
    assert shared["hit_ratio"] == alone["hit_ratio"]
    assert shared["items_processed"] + shared["remote_hits"] == alone["items_processed"]
    assert shared["remote_puts"] > 0 and shared["remote_errors"] == 0
    assert shared["remote_get_p99_ms"] >= shared["remote_get_p50_ms"] > 0
    assert sum(h["remote_hits"] for h in shared["per_host"]) == shared["remote_hits"]
    # Single flight: a claim ends in the item processed here or, given up for a wait (a
    # waiter holds no claim), in the item another host processed meanwhile (no store fault).
    assert 0 < shared["remote_claims"] <= shared["items_processed"] + shared["remote_hits"]
    assert alone["remote_claims"] == alone["remote_claim_waits"] == 0
    assert shared["remote_claim_wait_hits"] <= shared["remote_claim_waits"]
    assert "cross-host hits" in result.stdout and "per host" in result.stdout
    assert "remote claims (single flight)" in result.stdout


@pytest.mark.parametrize("remote", [None, "redis://auto"])
def test_the_per_host_table_shows_the_remote_tiers_columns_only_with_one(
    remote: str | None,
) -> None:
    # Without a tier the main table shows its rows as "-", but each host's row said 0 remote
    # hits, 0 cross-host hits and 0 errors, as if a tier had been there and done nothing.
    config = SimulationConfig(hosts=2, remote=remote)
    host = {"requests": 1, "requests_per_s": 1.0, "hit_ratio": 0.5, "items_processed": 1}
    host |= {"remote_hits": 0, "cross_host_hits": 0, "remote_errors": 0, "wrong_tensors": 0}
    run = run_metrics(
        mode="shm", hosts=2, remote=remote, per_host=[{**host, "host": h} for h in (0, 1)]
    )
    console = Console(record=True, width=200)
    render(config, [run], console)
    per_host = console.export_text().split(f"{run.label}: per host")[1]
    header = per_host.splitlines()[2]
    assert ("cross-host" in header and "errors" in header) == (remote is not None)
    assert "processed" in header and "wrong" in header


@pytest.mark.parametrize("scheme", ["reddis", "redis+sentinel"])
def test_a_remote_url_of_an_unknown_scheme_is_refused_without_its_credentials(
    scheme: str,
) -> None:
    with pytest.raises(ConfigError, match="expected redis://") as refused:
        SimulationConfig(remote=f"{scheme}://admin:hunter2@cache:6379").validate()
    assert "hunter2" not in str(refused.value)


def test_a_remote_urls_scheme_is_read_in_any_case_as_the_remote_tier_reads_it() -> None:
    # RemoteStore takes REDIS://... (a URL's scheme has no case); simulate refused it, saying
    # "--remote redis://cache:6379: expected redis://HOST:PORT ...".
    config = SimulationConfig(mode="lru", remote="REDIS://cache:6379")
    config.validate()
    assert config.remote == "redis://cache:6379" and config.label == "lru + redis"
    # What names a server to start for the run is found in any case too.
    assert SimulationConfig(remote="Valkey://auto").remote == "valkey://auto"
    with pytest.raises(ConfigError, match="no port"):
        SimulationConfig(remote="MoonCake://master").validate()


def test_the_remote_urls_credentials_reach_no_output_of_a_run(tmp_path: Path) -> None:
    """The report (its text and ``--json``) names the tier without its password."""
    out = tmp_path / "figures.json"
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://admin:hunter2@127.0.0.1:{s.getsockname()[1]}/0?password=hunter3"
    result = simulate(*TINY, "--mode", "lru", "--remote", url, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert figures(out)["runs"]["lru + redis"]["requests"] == 24
    for shown in (result.stdout, result.stderr, out.read_text()):
        assert "hunter" not in shown


def test_an_unreachable_remote_tier_costs_misses_not_requests(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
    result = simulate(*TINY, "--mode", "lru", "--remote", url, "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["lru + redis"]
    assert run["requests"] == 24 and run["wrong_tensors"] == 0
    assert run["remote_hits"] == 0 and run["remote_errors"] > 0
    assert run["items_processed"] > 0 and run["hit_ratio"] > 0  # processing and the LRU
