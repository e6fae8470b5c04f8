"""A thread that runs the calls given to it one at a time, so that a test decides exactly how
two threads' calls interleave (the per-thread request brackets, say)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["Actor"]


class Actor:
    """Runs calls in a thread of its own, one at a time, each to its end (60 s at most)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.submit(fn, *args).result(timeout=60)

    def close(self) -> None:
        self._pool.shutdown()
