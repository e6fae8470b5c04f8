"""Signals around starting child processes, and SIGTERM as an exception."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Terminated", "sigint_ignored", "sigterm_raises"]


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


class Terminated(BaseException):
    """SIGTERM arrived (see :func:`sigterm_raises`). A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` takes it for a failure."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread meanwhile, so that ``kill``,
    ``timeout`` or a cancelled job unwinds as Ctrl-C does (the ``finally`` blocks stop the
    children, remove the segments and a server's files) instead of killing the process on
    the spot. Only the main thread may change a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
