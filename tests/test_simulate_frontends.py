"""``mmcache simulate --frontends N``: N P0s per host, one P1, the same workers, one store.

The real command runs as a subprocess over a tiny workload (the helpers of
``tests/test_simulate.py``: each run checks that it left no ring behind). Nothing here
asserts a time.
"""

from __future__ import annotations

from collections import Counter
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import numpy as np

from mmcache import Feature, ShmHandle, ShmSenderCache, content_hash
from mmcache.simulate import SimulationConfig, wire
from mmcache.simulate.engine import _serve
from mmcache.simulate.frontend import _Frontend, _Pending
from mmcache.simulate.processes import _combine, _wrong_unverified_tensors
from mmcache.simulate.report import targets
from mmcache.simulate.workload import TARGET_SIDE, Catalogue, process, tensor_digests
from tests.test_simulate import TINY, figures, run_metrics, simulate


def test_two_frontends_serve_the_stream_between_them_and_every_tensor_verifies(
    tmp_path: Path,
) -> None:
    out = tmp_path / "figures.json"
    result = simulate("--frontends", "2", *TINY, "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = figures(out)
    assert data["ok"] is True and data["config"]["frontends"] == 2
    run = data["runs"]["shm, 2 frontends"]
    assert run["frontends"] == 2 and run["requests"] == 24
    assert run["wrong_tensors"] == 0 and run["unrecovered"] == 0
    # Every worker checked both tensors of every item of every frontend's requests, those
    # another frontend processed included.
    assert run["tensors_checked"] == 2 * 2 * run["items"]
    # The stream is dealt out in turn: 12 requests each; the totals are their sums.
    per_frontend = run["per_frontend"]
    assert [(f["host"], f["frontend"], f["requests"]) for f in per_frontend] == [
        (0, 0, 12),
        (0, 1, 12),
    ]
    for name in ("items_processed", "claim_waits", "wrong_tensors"):
        assert sum(f[name] for f in per_frontend) == run[name]
    assert all(f["requests_per_s"] > 0 and 0 < f["hit_ratio"] < 1 for f in per_frontend)
    assert 0 < run["hit_ratio"] < 1 and run["evictions"] > 0
    assert run["processed_per_image"] == run["items_processed"] / run["distinct_images"]
    # Only handles travel, whichever frontend wrote the item.
    assert run["payload_bytes_moved"] == 0 and run["shm_bytes_written"] > 0
    assert "per frontend" in result.stdout and "claim waits" in result.stdout


def test_single_flight_processes_each_image_once_across_the_frontends(tmp_path: Path) -> None:
    # Three images, a store that holds them all (nothing is evicted) and a claim wait longer
    # than the run's deadline (no wait can time out): whichever frontend first misses an
    # image processes it, the other waits for it or finds it. Exactly once per image, where
    # private caches (processor_only) may process an image once in each frontend.
    out = tmp_path / "figures.json"
    workload = ["--requests", "16", "--catalogue", "3", "--max-items", "2", "--inflight", "2"]
    result = simulate(
        "--frontends", "2", *workload, "--claim-wait-s", "600", "--json", str(out), timeout=300
    )
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["shm, 2 frontends"]
    assert run["evictions"] == 0 and run["wrong_tensors"] == 0
    assert run["items_processed"] == run["distinct_images"] <= 3
    assert run["processed_per_image"] == 1.0


def test_compare_with_frontends_shows_one_frontend_beside_n(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    tiny = ["--requests", "8", "--catalogue", "6", "--capacity-gb", "0.03", "--inflight", "2"]
    result = simulate("--frontends", "2", "--compare", *tiny, "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    data = figures(out)
    assert data["ok"] is True
    assert [(r["label"], r["frontends"]) for r in data["runs"].values()] == [
        ("none, 2 frontends", 2),
        ("processor_only, 2 frontends", 2),
        ("lru", 1),  # its P1 mirrors one P0: it runs with one
        ("shm", 1),
        ("shm, 2 frontends", 2),
    ]
    assert len({run["items"] for run in data["runs"].values()}) == 1  # one workload
    assert [t["target"] for t in data["targets"]] == [
        "shm requests/s >= 3x none",
        "shm requests/s ahead of lru",
        "shm hit ratio within 2 points of lru",
        "shm, 2 frontends: requests/s >= 1.4x one frontend",
        "shm, 2 frontends: hit ratio within 2 points of one frontend",
        "shm, 2 frontends: items processed per distinct image <= 1.05x one frontend's",
    ]
    assert "shm, 2 frontends: per frontend" in result.stdout


def test_compare_keeps_its_runs_with_one_frontend() -> None:
    assert [c.label for c in SimulationConfig().compared()] == [
        "none",
        "processor_only",
        "lru",
        "shm",
    ]
    remote = SimulationConfig(remote="redis://auto", frontends=3).compared()
    assert [c.label for c in remote] == [
        "shm, 3 frontends",
        "shm + redis",
        "shm + redis, 3 frontends",
    ]


def test_the_remote_tiers_targets_judge_the_run_asked_for_against_its_like() -> None:
    # `--remote URL --frontends 2 --compare` runs the mode with 2 frontends without the tier,
    # then with it with 1 and with 2 frontends. The tier's targets took the first run with the
    # tier (1 frontend) and held it against the one without (2 frontends).
    config = SimulationConfig(remote="redis://auto", frontends=2)
    processed = {(None, 2): 100, ("redis://auto", 1): 90, ("redis://auto", 2): 60}
    runs = [
        run_metrics(
            mode=c.mode,
            label=c.label,
            remote=c.remote,
            frontends=c.frontends,
            items_processed=processed[c.remote, c.frontends],
            distinct_images=50,
        )
        for c in config.compared()
    ]
    remote = [t for t in targets(runs) if "remote tier" in t["target"]]
    assert [t["value"] for t in remote] == [
        "1.20",  # 60 items processed for 50 images with 2 frontends
        "0.60 (floor 0.50: each distinct image once)",  # 60 with the tier, 100 without
    ]


def test_lru_with_several_frontends_is_refused_with_the_reason() -> None:
    result = simulate("--mode", "lru", "--frontends", "2", *TINY)
    assert result.returncode == 2
    assert "--mode lru cannot run with --frontends above 1" in result.stderr
    assert "Traceback" not in result.stderr


def _request(item: dict[str, np.ndarray]) -> tuple[dict[str, Any], list[bytes]]:
    """A request message with one feature its frontend has no truth for (another frontend
    processed image 7)."""
    buffers: list[memoryview] = []
    feature = Feature(data=item, mm_hash="h7", identifier="h7", digests=None, image=7)
    header = {"rid": 0, "attempt": 1, "features": [wire.encode_feature(feature, buffers)]}
    return header, [bytes(b) for b in buffers]


def test_items_another_frontend_processed_are_checked_against_its_truth() -> None:
    item = process(Catalogue(1, seed=0)[0]).tensors
    truth = sorted(tensor_digests(item).items())
    tampered = dict(item, image_sizes=item["image_sizes"] + 1)
    deferred: Counter[Any] = Counter()
    for received in (item, item, tampered):
        reply = _serve(*_request(received), None, deferred)
        assert reply["checked"] == 2 and reply["wrong"] == 0  # not known yet: deferred
    # What reaches the driver: the workers' records, and what the other frontend processed.
    records = [[image, [list(d) for d in digests], n] for (image, digests), n in deferred.items()]
    assert sorted(n for _, _, n in records) == [1, 2]

    def reports(processed: list[Any]) -> list[dict[str, Any]]:
        consumer = {"processed_truth": [], "remote_truth": [], "deferred_truth": records}
        producer = {"processed_truth": processed, "remote_truth": [], "deferred_truth": []}
        return [consumer, producer]

    def wrong(reports: list[dict[str, Any]]) -> list[int]:
        return [_wrong_unverified_tensors(reports, of=report) for report in reports]

    truth_lists = [list(d) for d in truth]
    assert wrong(reports([[7, truth_lists]])) == [1, 0]  # the consumer's tampered tensor
    # An image no frontend processed has no truth: everything received for it is wrong.
    assert wrong(reports([])) == [3 * 2, 0]


def _report(frontend: int, **figures: Any) -> dict[str, Any]:
    """A frontend's report to the driver: one request of one image, and ``figures``."""
    counts = ("requests", "items", "lookups", "hits", "processed", "tensors_checked")
    zeros = (
        "claim_waits", "remote_hits", "processing_s", "bytes_moved",
        "payload_bytes_moved", "baseline_bytes", "store_puts", "served_uncached", "dropped",
        "retries", "unrecovered", "wrong_tensors",
    )  # fmt: skip
    return {
        "host": 0,
        "frontend": frontend,
        **dict.fromkeys(counts, 1),
        **dict.fromkeys(zeros, 0),
        "elapsed_s": 1.0,
        "latencies_ms": [1.0],
        "evictions": 0,
        "evictions_shared": True,
        "seen": np.packbits(np.array([True, False])).tobytes(),
        "processed_truth": [],
        "remote_truth": [],
        "deferred_truth": [],
        "fetched_unprocessed": [],
        "remote": None,
        **figures,
    }


def test_per_frontend_wrong_tensors_add_up_to_the_run_s() -> None:
    # Frontend 1 served image 0 from frontend 0's work, and its workers received another
    # pixel_values than frontend 0 processed: frontend 1's wrong tensor, in its row too.
    truth = [["pixel_values", b"a"], ["image_sizes", b"b"]]
    received = [["pixel_values", b"x"], ["image_sizes", b"b"]]
    reports = [
        _report(0, processed_truth=[[0, truth]]),
        _report(1, deferred_truth=[[0, received, 1]]),
    ]
    run = _combine(SimulationConfig(frontends=2, catalogue=2), reports)
    assert run.wrong_tensors == 1
    assert [f["wrong_tensors"] for f in run.per_frontend] == [0, 1]
    assert [h["wrong_tensors"] for h in run.per_host] == [1]


def test_an_item_evicted_between_lookup_and_update_is_processed_after_all() -> None:
    # Another frontend's put may evict an item this P0 found cached before it touches it:
    # its update then misses, and P0 processes the item and updates again.
    config = SimulationConfig(frontends=2, catalogue=4)
    with ShmSenderCache(0.05, max_writers=2) as store:
        engine, _ = Pipe()
        frontend = _Frontend(config, 0, 0, store, None, engine, [], engine)
        image = 3
        mm_hash = content_hash(frontend.catalogue[image], size=TARGET_SIDE)
        pending = _Pending([image], [mm_hash], started=0.0)
        inputs: list[Any] = [None]  # "cached" when P0 looked, gone now
        ((handle, prompt_updates),) = frontend._update(store, inputs, pending)
        assert isinstance(handle, ShmHandle)
        assert prompt_updates == {"modality": "image", "num_tokens": 256}
        assert inputs[0] is not None and frontend.counts.processed == 1
        assert store.is_cached_item(mm_hash)
        store.release_handles([handle])


def test_remote_hits_of_another_frontends_work_on_the_same_host_are_no_cross_host_hits(
    tmp_path: Path,
) -> None:
    # processor_only: a cache per frontend, so frontend 1 fetches from the tier the images
    # frontend 0 of the same host processed (and the other way round). With one host there
    # is no other host whose work a hit could be.
    out = tmp_path / "figures.json"
    result = simulate(
        "--mode", "processor_only", "--frontends", "2", "--remote", "redis://auto", *TINY,
        "--json", str(out), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["processor_only + redis, 2 frontends"]
    assert run["hosts"] == 1 and run["remote_hits"] > 0 and run["wrong_tensors"] == 0
    assert run["cross_host_hits"] == 0
    assert [host["cross_host_hits"] for host in run["per_host"]] == [0]
    assert [f["cross_host_hits"] for f in run["per_frontend"]] == [0, 0]


def test_bytes_written_to_shared_memory_count_the_puts_the_store_made(tmp_path: Path) -> None:
    # One image, a store that holds it and never evicts it, frontends that do not wait for
    # each other's claims: both may process the image at once, but the store keeps the
    # first put and answers the second with the object stored (a hit): one item written.
    out = tmp_path / "figures.json"
    workload = ["--requests", "4", "--catalogue", "1", "--inflight", "1", "--capacity-gb", "0.01"]
    result = simulate("--frontends", "2", *workload, "--claim-wait-s", "0", "--json", str(out))
    assert result.returncode == 0, result.stderr
    run = figures(out)["runs"]["shm, 2 frontends"]
    assert run["evictions"] == 0 and run["served_uncached"] == 0 and run["wrong_tensors"] == 0
    assert 1 <= run["items_processed"] <= 2
    assert run["shm_bytes_written"] == 3 * TARGET_SIDE * TARGET_SIDE * 4 + 2 * 8


def test_an_unverified_item_counts_the_tensors_that_differ_not_all_of_them() -> None:
    # One of an item's two tensors differs from what its producer processed: one wrong
    # tensor per delivery, as a worker counts it against its own P0's truth; so for an item
    # the remote tier supplied. An item nobody processed has no truth: all of it is wrong.
    truth = [["image_sizes", b"b"], ["pixel_values", b"a"]]
    one_off = [["image_sizes", b"b"], ["pixel_values", b"x"]]
    producer = _report(0, processed_truth=[[0, truth]])
    consumer = _report(1, deferred_truth=[[0, one_off, 3]], remote_truth=[[0, one_off]])
    assert _wrong_unverified_tensors([producer, consumer], of=consumer) == 3 * 1 + 1
    unknown = _report(1, deferred_truth=[[1, one_off, 1]], remote_truth=[[1, one_off]])
    assert _wrong_unverified_tensors([producer, unknown], of=unknown) == 2 + 2
