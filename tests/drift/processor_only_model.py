"""``processor_only`` mode: P0 caches whole items and nothing downstream mirrors it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmcache.caches import ProcessorOnlyCache
from mmcache.errors import CacheMissError
from tests.drift.engine import EngineModel

__all__ = ["ProcessorOnlyModel"]


class ProcessorOnlyModel(EngineModel):
    """``processor_only``: P0 caches full items; nothing downstream."""

    mode = "processor_only"
    faults: tuple[str, ...] = (
        "p0_clear",  # P0 cleared between requests
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.p0 = ProcessorOnlyCache(self.capacity_gb)

    def frontend(self) -> ProcessorOnlyCache:
        return self.p0

    def _check_p0_output(self, data: Any, i: int) -> None:
        self._check_item(data, i, "P0 (processor cache)")

    def _deliver(
        self, ids: Sequence[int], outputs: list[Any], *, exposed: bool, retry: bool = False
    ) -> None:
        pass  # P0's outputs are the items themselves, checked as they came out

    _reorder_exposes = False

    def _on_reorder(self) -> None:
        pass

    def _after_p0_miss(self) -> None:
        pass

    def _miss_explained(self, miss: CacheMissError, side: str) -> bool:
        return False

    def _fault_p0_clear(self, ids: list[int]) -> None:
        self.p0.clear_cache()
        self._serve(self.p0, ids)

    def _resync(self) -> None:
        self.p0.clear_cache()

    def check(self) -> None:
        self._check(self.p0.stats()["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")

    def _close(self) -> None:
        self.p0.close()
