"""How the process that makes the ring tells the others where it is.

P0's shared-memory sender publishes its ``ReaderHandle`` (segment name, layout and signing
secret) in the environment variable :data:`READER_HANDLE_ENV`, which the engine core and the
workers inherit: vLLM builds P0's cache before it starts them, and a worker attaches in its
cache's constructor.  With several API servers (``vllm serve --api-server-count N``) the
launcher makes the ring before it starts any of them (:mod:`mmcache.vllm.launcher`) and
publishes its ``WriterHandle`` in :data:`WRITER_HANDLE_ENV` too, by which each API server
joins the ring as one of its writers.

A process's environment is readable by its own user only (``/proc/PID/environ`` is 0400),
the same boundary the segment already has (mode 0600): whoever can read the secret there can
read and write the segment anyway.  The secret is what keeps API clients from forging
handles, and they never see it; nothing here logs it.

Imports nothing of vLLM or torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

from mmcache._core import ReaderHandle, WriterHandle

__all__ = [
    "READER_HANDLE_ENV",
    "WRITER_HANDLE_ENV",
    "publish",
    "publish_writer",
    "published_handle",
    "published_writer_handle",
    "withdraw",
]

READER_HANDLE_ENV = "MMCACHE_VLLM_READER_HANDLE"
"""Where P0's shared-memory sender publishes its ``ReaderHandle`` for the workers (JSON;
empty when P0 runs without a ring)."""

WRITER_HANDLE_ENV = "MMCACHE_VLLM_WRITER_HANDLE"
"""Where the launcher of several API servers publishes the ring's ``WriterHandle`` for them
(JSON; empty when it could not make a ring)."""

_Handle = TypeVar("_Handle", ReaderHandle, WriterHandle)

_FIELDS = ("name", "capacity", "n_readers", "max_object_size", "layout_version")


def _encode(handle: ReaderHandle | WriterHandle | None, extra: tuple[str, ...] = ()) -> str:
    """``handle`` as the JSON of its fields (the secret in hex); ``""`` for ``None``."""
    if handle is None:
        return ""
    fields: dict[str, Any] = {name: getattr(handle, name) for name in _FIELDS + extra}
    fields["secret"] = handle.secret.hex()
    return json.dumps(fields)


def _decode(env: str, make: Callable[..., _Handle], remedy: str) -> _Handle | None:
    """The handle published in ``env``, ``None`` when published empty; ``RuntimeError``
    naming ``remedy`` when nothing was published, ``ValueError`` naming ``env`` (and not
    its value, which holds the secret) when what was published is no such handle."""
    value = os.environ.get(env)
    if value is None:
        raise RuntimeError(f"no shared-memory ring was published ({env} is not set): {remedy}")
    if not value:
        return None
    try:
        fields: dict[str, Any] = json.loads(value)
        fields["secret"] = bytes.fromhex(fields["secret"])
        return make(**fields)
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        # (The exception's own text names a field or a position, never a value.)
        raise ValueError(
            f"{env} holds no {make.__name__} ({type(exc).__name__}: {exc}): it was not "
            "published by this mmcache (a stale or edited environment?); unset it, and "
            "start vLLM again"
        ) from None


def publish(handle: ReaderHandle | None) -> str:
    """Put ``handle`` (``None``: no ring) where child processes find it; returns the value."""
    value = _encode(handle)
    os.environ[READER_HANDLE_ENV] = value
    return value


def publish_writer(handle: WriterHandle | None) -> str:
    """Put the writer handle ``handle`` (``None``: no ring) where the API servers find it;
    returns the value."""
    value = _encode(handle, ("max_writers",))
    os.environ[WRITER_HANDLE_ENV] = value
    return value


def withdraw(value: str, env: str = READER_HANDLE_ENV) -> None:
    """Take back what :func:`publish` (or, with :data:`WRITER_HANDLE_ENV`,
    :func:`publish_writer`) returned, unless something else was published since."""
    if os.environ.get(env) == value:
        del os.environ[env]


def published_handle() -> ReaderHandle | None:
    """The ``ReaderHandle`` P0 published, ``None`` when it runs without a ring;
    ``RuntimeError`` when nothing was published."""
    return _decode(
        READER_HANDLE_ENV,
        ReaderHandle,
        "the frontend must run vLLM with mmcache too (MMCACHE_VLLM=1) and build its cache "
        "before it starts the engine",
    )


def published_writer_handle() -> WriterHandle | None:
    """The ``WriterHandle`` the launcher of several API servers published, ``None`` when it
    made no ring; ``RuntimeError`` when nothing was published."""
    return _decode(
        WRITER_HANDLE_ENV,
        WriterHandle,
        "the launcher of the API servers (vllm serve --api-server-count N) must run with "
        "mmcache too (MMCACHE_VLLM=1)",
    )
