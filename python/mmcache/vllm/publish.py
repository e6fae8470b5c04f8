"""How P0 tells the engine core and the workers where its ring is.

P0's shared-memory sender publishes its ``ReaderHandle`` (segment name, layout and signing
secret) in the environment variable :data:`READER_HANDLE_ENV`, which the engine core and the
workers inherit: vLLM builds P0's cache before it starts them, and a worker attaches in its
cache's constructor.  A process's environment is readable by its own user only
(``/proc/PID/environ`` is 0400), the same boundary the segment already has (mode 0600):
whoever can read the secret there can read and write the segment anyway.  The secret is what
keeps API clients from forging handles, and they never see it.

Imports nothing of vLLM or torch.
"""

from __future__ import annotations

import json
import os

from mmcache._core import ReaderHandle

__all__ = ["READER_HANDLE_ENV", "publish", "published_handle", "withdraw"]

READER_HANDLE_ENV = "MMCACHE_VLLM_READER_HANDLE"
"""Where P0's shared-memory sender publishes its ``ReaderHandle`` for the workers (JSON;
empty when P0 runs without a ring)."""


def publish(handle: ReaderHandle | None) -> str:
    """Put ``handle`` (``None``: no ring) where child processes find it; returns the value."""
    value = ""
    if handle is not None:
        value = json.dumps(
            {
                "name": handle.name,
                "capacity": handle.capacity,
                "n_readers": handle.n_readers,
                "max_object_size": handle.max_object_size,
                "layout_version": handle.layout_version,
                "secret": handle.secret.hex(),
            }
        )
    os.environ[READER_HANDLE_ENV] = value
    return value


def withdraw(value: str) -> None:
    """Take back what :func:`publish` returned, unless something else was published since."""
    if os.environ.get(READER_HANDLE_ENV) == value:
        del os.environ[READER_HANDLE_ENV]


def published_handle() -> ReaderHandle | None:
    """The ``ReaderHandle`` P0 published, ``None`` when it runs without a ring;
    ``RuntimeError`` when nothing was published."""
    value = os.environ.get(READER_HANDLE_ENV)
    if value is None:
        raise RuntimeError(
            f"no shared-memory ring was published ({READER_HANDLE_ENV} is not set): the "
            "frontend must run vLLM with mmcache too (MMCACHE_VLLM=1) and build its cache "
            "before it starts the engine"
        )
    if not value:
        return None
    fields = json.loads(value)
    fields["secret"] = bytes.fromhex(fields["secret"])
    return ReaderHandle(**fields)
