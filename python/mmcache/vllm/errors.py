"""The adapter's errors, as vLLM's callers expect them.

A miss is vLLM's ``MultiModalCacheMissError`` listing every missing hash (the engine core's
retry path).  A malformed, forged or foreign handle is :class:`InvalidShmHandleError` (a
``ValueError``, as vLLM's own receiver raises); a genuine handle whose object the ring no
longer holds is :class:`StaleShmHandleError`, both a ``MultiModalCacheMissError`` and a
``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.multimodal.cache.base import MultiModalCacheMissError

from mmcache.errors import CacheMissError, InvalidHandleError

__all__ = ["InvalidShmHandleError", "StaleShmHandleError", "invalid_handle", "vllm_errors"]


class InvalidShmHandleError(InvalidHandleError, ValueError):
    """A handle item that is malformed, forged, out of range or signed for another key.

    A ``ValueError`` (what vLLM's own shared-memory caches raise for bad handles) and an
    mmcache :class:`~mmcache.errors.InvalidHandleError`.  Its message names the "SHM handle
    signature" as vLLM's does.
    """


class StaleShmHandleError(MultiModalCacheMissError, ValueError):  # type: ignore[misc]
    """Genuine handles whose objects the ring no longer holds (evicted, overwritten or
    cleared before the reader got to them): a miss, never another item's data.

    A ``MultiModalCacheMissError`` listing every such hash of the request, and a
    ``ValueError`` whose message says the data "has been modified or is invalid", as vLLM's
    own receiver reports it.
    """

    def __init__(self, mm_hashes: list[str]) -> None:
        super().__init__(mm_hashes)
        self.args = (
            f"the shared-memory objects of {mm_hashes} are gone: each has been modified or is "
            "invalid (evicted, overwritten or cleared after its handle was issued); retry the "
            "request with its multi-modal data attached",
        )


def invalid_handle(mm_hash: str, detail: str) -> InvalidShmHandleError:
    """The error for a handle item of ``mm_hash`` that is not acceptable, and why."""
    return InvalidShmHandleError(
        f"invalid SHM handle signature for mm_hash={mm_hash!r}: {detail}; only handles this "
        "cache issued for this key are accepted"
    )


@contextmanager
def vllm_errors(miss_error: type[Exception] = MultiModalCacheMissError) -> Iterator[None]:
    """Raise mmcache's misses (as ``miss_error(mm_hashes)``) and bad handles as the
    exceptions vLLM's callers expect."""
    try:
        yield
    except CacheMissError as miss:
        raise miss_error(miss.mm_hashes) from miss
    except InvalidShmHandleError:
        raise
    except InvalidHandleError as exc:
        raise InvalidShmHandleError(f"invalid SHM handle signature: {exc}") from exc
