"""Signals around starting child processes."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["sigint_ignored"]


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored meanwhile, so children started here inherit it ignored: Ctrl-C then
    reaches the parent only, which stops them in order instead of each dying mid-message.
    Only the main thread may change a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
