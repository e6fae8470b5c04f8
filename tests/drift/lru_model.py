"""``lru`` mode: P0's ``SenderCache`` mirrors P1's ``ReceiverCache``; the faults that split
them (lost, duplicated, replayed, reordered deliveries; one side cleared or restarted; a
second frontend on the same P1)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from mmcache.caches import ReceiverCache, SenderCache
from mmcache.errors import CacheMissError
from mmcache.items import Feature
from tests.drift.engine import EngineModel

__all__ = ["LruModel"]


class LruModel(EngineModel):
    """``lru``: P0 ``SenderCache`` frontends (one, or two sharing P1), P1 ``ReceiverCache``."""

    mode = "lru"
    faults: tuple[str, ...] = (
        "lost",  # P0 applied the request, P1 never saw it (rejected request)
        "dup",  # P1 applies one request twice
        "replay",  # P1 gets an old request's outputs again, much later
        "p1_clear",  # P1 cleared alone
        "p1_restart",  # P1 restarted alone (a fresh, empty ReceiverCache)
        "p1_clear_inflight",  # P1 cleared between P0's update and P1's
        "p0_clear",  # P0 cleared alone
        "other_frontend",  # a second P0 frontend sends to the same P1
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frontends = [SenderCache(self.capacity_gb)]
        self.p1 = ReceiverCache(self.capacity_gb)
        self._uncached_seen = 0  # items the frontends served uncached, as last counted

    def frontend(self) -> SenderCache:
        return self.frontends[0]

    def _check_p0_output(self, data: Any, i: int) -> None:
        if data is not None:
            self._check_item(data, i, "P0 (data to send)")

    def _deliver(
        self, ids: Sequence[int], outputs: list[Any], *, exposed: bool, retry: bool = False
    ) -> None:
        hashes = self.universe.hashes(ids)
        features = [
            Feature(data=data, mm_hash=h, modality="image", position=k)
            for k, ((data, _), h) in enumerate(zip(outputs, hashes, strict=True))
        ]
        try:
            self.p1.get_and_update_features(features)
        except CacheMissError as miss:
            self._check_miss_list(miss, hashes, "P1")
            missing = set(miss.mm_hashes)
            for f, i in zip(features, ids, strict=True):
                if f.mm_hash not in missing:
                    self._check_item(f.data, i, "P1")
            raise
        for f, i in zip(features, ids, strict=True):
            self._check_item(f.data, i, "P1")

    def _fault_lost(self, ids: list[int]) -> None:
        self.stats.requests += 1
        self._stage(self.frontend(), ids, attach_all=False)  # rejected: P1 never sees it
        self.drifted = True

    def _fault_dup(self, ids: list[int]) -> None:
        outputs = self._serve(self.frontend(), ids)
        self.drifted = True
        try:
            self._deliver(ids, outputs, exposed=True)
        except CacheMissError:
            self.stats.duplicate_misses += 1

    def _fault_replay(self, ids: list[int]) -> None:
        if not self.history:
            self._serve(self.frontend(), ids)
            return
        old_ids, outputs = self.history[len(ids) * 7 % len(self.history)]
        self.drifted = True
        try:
            self._deliver(old_ids, outputs, exposed=True)
            self.stats.replays_resolved += 1
        except CacheMissError:
            self.stats.replay_misses += 1

    def _fault_p1_clear(self, ids: list[int]) -> None:
        self.p1.clear_cache()
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_p1_restart(self, ids: list[int]) -> None:
        self.p1.close()
        self.p1 = ReceiverCache(self.capacity_gb)
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_p1_clear_inflight(self, ids: list[int]) -> None:
        fe = self.frontend()
        self.stats.requests += 1
        staged = self._stage(fe, ids, attach_all=False)
        self.drifted = True
        self._finish(fe, ids, staged, exposed=True, before_deliver=self.p1.clear_cache)

    def _fault_p0_clear(self, ids: list[int]) -> None:
        self.frontend().clear_cache()
        self.drifted = True
        self._serve(self.frontend(), ids, exposed=True)

    def _fault_other_frontend(self, ids: list[int]) -> None:
        if len(self.frontends) == 1:
            self.frontends.append(SenderCache(self.capacity_gb))
        self.drifted = True
        self._serve(self.frontends[1], ids, exposed=True)

    def _resync(self) -> None:
        for fe in self.frontends:
            fe.clear_cache()
        self.p1.clear_cache()

    def _p0_keys(self) -> list[Hashable]:
        """The keys of P0's own cache, the one P1 mirrors."""
        return self.frontend().keys()

    def check(self) -> None:
        if not self.drifted:
            self.stats.mirror_checks += 1
            p0, p1 = self._p0_keys(), self.p1.keys()
            self._check(
                p0 == p1,
                f"(c) with no fault injected P0 and P1 disagree: P0 holds {len(p0)} keys, "
                f"P1 {len(p1)}; only on P0: {len(set(p0) - set(p1))}, only on P1: "
                f"{len(set(p1) - set(p0))}, same set: {set(p0) == set(p1)}",
            )
        uncached = 0
        for fe in self.frontends:
            stats = fe.stats()
            self._check(stats["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")
            uncached += stats["uncached_oversize"] + stats["uncached_full"]
        self.stats.uncached += uncached - self._uncached_seen
        self._uncached_seen = uncached
        self._check(self.p1.stats()["used_bytes"] <= self.capacity, "(d) P1 exceeds its capacity")

    def _close(self) -> None:
        for fe in self.frontends:
            fe.close()
        self.p1.close()
