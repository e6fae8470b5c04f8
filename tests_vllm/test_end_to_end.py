"""vLLM's cache processes end to end: P0 here, the engine core and two workers spawned
(fresh interpreters that install mmcache through the plugin entry point), every request
carried by vLLM's IPC encoder, every resolved item checked against what P0 produced."""

from __future__ import annotations

import multiprocessing as mp
import random
from typing import Any

import pytest
from vllm.multimodal.cache import processor_cache_from_config
from vllm.v1.serial_utils import MsgpackEncoder

import mmcache.vllm as mv
from processes import digest, serve
from test_adapter import vllm_p0_request
from vllm_helpers import MiB, feature, kwargs_item


def qualified(cls: type) -> str:
    """The name a spawned process reports for its cache's class."""
    return f"{cls.__module__}.{cls.__qualname__}"


class Peer:
    """A spawned engine-core or worker process and its end of the pipe."""

    def __init__(self, role: str, config_kwargs: dict[str, Any]) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(
            target=serve, args=(role, config_kwargs, child), daemon=True
        )
        self.process.start()
        child.close()
        # Hang guards only: a spawned vLLM process imports slowly on a loaded machine.
        if not self.conn.poll(900):
            raise TimeoutError(f"the {role} process did not start")
        self.cache_class = self.conn.recv()

    def ask(self, message: Any) -> Any:
        self.conn.send(message)
        if not self.conn.poll(600):
            raise TimeoutError("no answer")
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.process.join(60)
        if self.process.exitcode is None:
            self.process.kill()


@pytest.fixture
def plugin_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned processes inherit MMCACHE_VLLM=1 (and the ring P0 publishes)."""
    monkeypatch.setenv(mv.ENABLE_ENV, "1")


def encode(features: list[Any]) -> list[bytes]:
    return [bytes(buf) for buf in MsgpackEncoder().encode(features)]


def test_shm_mode_two_workers_read_every_item_through_vllms_ipc(plugin_enabled: None) -> None:
    rng = random.Random(3)
    truth = {f"img-{i}": kwargs_item(i, n_bytes=300_000) for i in range(12)}
    digests = {h: digest(item) for h, item in truth.items()}
    config = {"mode": "shm", "capacity_bytes": 2 * MiB, "world_size": 2, "max_object_mb": 1}
    from vllm_helpers import vllm_config

    p0 = processor_cache_from_config(vllm_config(**config))
    workers = [Peer("worker", config) for _ in range(2)]
    sent: list[tuple[list[bytes], list[str | None]]] = []
    replays = {"same": 0, "miss": 0}
    try:
        receiver = qualified(mv.MmcacheShmReceiverCache)
        assert [w.cache_class for w in workers] == [receiver, receiver]
        for n in range(60):
            hashes = [rng.choice(list(truth)) for _ in range(rng.randint(1, 4))]
            data = vllm_p0_request(p0, hashes, truth)
            features = [
                feature(d, h, offset=8 * i)
                for i, (d, h) in enumerate(zip(data, hashes, strict=True))
            ]
            expected: list[str | None] = [digests[h] for h in hashes]
            if n % 3 == 0:  # a prefix-covered payload the scheduler stripped
                features.append(feature(None, "stripped", offset=100))
                expected.append(None)
            message = encode(features)
            for worker in workers:
                assert worker.ask(message) == ("ok", expected)
            sent.append((message, expected))
            if n % 5 == 4:  # the scheduler resends a preempted request, same handles
                old_message, old_expected = sent[rng.randrange(len(sent))]
                for worker in workers:
                    answer = worker.ask(old_message)
                    if answer[0] == "ok":
                        assert answer == ("ok", old_expected), "a replay read other data"
                        replays["same"] += 1
                    else:
                        assert answer[:2] == ("miss", "StaleShmHandleError")
                        replays["miss"] += 1
        assert replays["same"] > 0
        stats = p0.ring.stats()
        assert stats["hits"] > 0 and stats["store_evictions"] > 0
    finally:
        for worker in workers:
            worker.stop()
        p0.close()
    assert all(w.process.exitcode == 0 for w in workers)


def test_lru_mode_drift_is_recovered_with_one_retry(plugin_enabled: None) -> None:
    rng = random.Random(8)
    truth = {f"img-{i}": kwargs_item(i, n_bytes=2_000) for i in range(10)}
    config = {"mode": "lru", "capacity_bytes": 40_000}
    from vllm_helpers import vllm_config

    p0 = processor_cache_from_config(vllm_config(**config))
    engine = Peer("engine", config)
    retries = drifted = 0
    try:
        assert engine.cache_class == qualified(mv.MmcacheLruReceiverCache)
        for n in range(40):
            if n % 10 == 5:  # the engine's cache is reset without P0's (drift)
                assert engine.ask("clear") == "cleared"
            hashes = [rng.choice(list(truth)) for _ in range(rng.randint(1, 4))]
            features = [
                feature(d, h)
                for d, h in zip(vllm_p0_request(p0, hashes, truth), hashes, strict=True)
            ]
            answer = engine.ask(encode(features))
            if answer[0] == "miss":
                drifted += 1
                assert answer[1] == "MultiModalCacheMissError"
                for h in answer[2]:  # what vLLM's frontend does with the miss
                    p0.invalidate(h)
                retries += 1
                data = vllm_p0_request(p0, hashes, truth)
                answer = engine.ask(
                    encode([feature(d, h) for d, h in zip(data, hashes, strict=True)])
                )
            assert answer == ("ok", [digest(truth[h]) for h in hashes])
        assert drifted > 0 and retries == drifted
    finally:
        engine.stop()
    assert engine.process.exitcode == 0
