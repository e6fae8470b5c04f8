"""Shim for vLLM's ``tests/utils.py``, whose import pulls in vLLM's whole server stack.

``test_cache.py`` needs one helper from it: a decorator that runs a test in a process of
its own.  Written here for this project (a fork, the child's exit status is the verdict).
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any


def create_new_process_for_each_test(
    method: str | None = None,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Run the decorated test in a forked child; the test fails if the child fails."""

    def decorate(func: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(func)
        def run_in_child(*args: Any, **kwargs: Any) -> None:
            pid = os.fork()
            if pid == 0:
                status = 0
                try:
                    func(*args, **kwargs)
                except BaseException:
                    traceback.print_exc()
                    status = 1
                os._exit(status)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise AssertionError(f"{func.__name__} failed in its own process")

        return run_in_child

    return decorate
