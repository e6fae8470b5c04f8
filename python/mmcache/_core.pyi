"""Type stubs for the Rust core, ``mmcache._core`` (kept honest by ``mypy.stubtest``)."""

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, final

from typing_extensions import Buffer, Self

__version__: str
LAYOUT_VERSION: int
PART_ALIGNMENT: int
"""Every part of a multi-part ``put`` starts at a multiple of this many bytes of the payload."""
OUT_OF_BAND_BYTES: int
"""``bytes`` values at least this long travel as their own part instead of in the header."""
PAYLOAD_FORMAT_VERSION: int
"""The item payload format this build writes and reads (the digit after ``b"MMC"``)."""

class MmcacheError(Exception):
    """Base class of every error the shared-memory core raises on its own account."""

class SegmentCorruptError(MmcacheError):
    """A segment's header or a chunk failed validation (corrupt, foreign or incompatible)."""

class ClosedError(MmcacheError):
    """The store (or the cache around it) was closed."""

class InvalidHandleError(MmcacheError):
    """A handle that is forged, truncated, out of range or signed for another key."""

class StaleHandleError(MmcacheError):
    """A genuine handle whose object is gone (evicted, overwritten, invalidated, cleared)."""

class WriterGoneError(MmcacheError):
    """The writer process of a segment exited."""

class NoReaderSlotError(MmcacheError):
    """Every reader slot of the segment is taken."""

class WrongProcessError(MmcacheError):
    """A writer or reader used in a process other than the one that created or attached it
    (after ``fork()``: create a new writer, or attach a new reader, in the child)."""

class ObjectTooLargeError(ValueError):
    """An object larger than the store's ``max_object_size``."""

class RingFullError(MemoryError):
    """No room in the ring: every chunk that could hold the object is still unread, pinned or
    viewed."""

@final
class ShmHandle:
    """Where one object lives: ring address, monotonic id and a keyed signature."""

    def __new__(cls, *, address: int, monotonic_id: int, signature: bytes) -> ShmHandle: ...
    @property
    def address(self) -> int: ...
    @property
    def monotonic_id(self) -> int: ...
    @property
    def signature(self) -> bytes: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

@final
class ReaderHandle:
    """Everything a reader process needs to attach: segment name, layout and signing key."""

    def __new__(
        cls,
        *,
        name: str,
        capacity: int,
        n_readers: int,
        max_object_size: int,
        layout_version: int,
        secret: bytes,
    ) -> ReaderHandle: ...
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def layout_version(self) -> int: ...
    @property
    def secret(self) -> bytes: ...
    def __reduce__(self) -> tuple[Any, ...]: ...

@final
class ShmView:
    """A read-only, zero-copy view of one object's bytes (buffer protocol).

    While it (or any memoryview, array or tensor made from it) is alive, the object cannot be
    reclaimed and the mapping stays open.
    """

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class PartView:
    """A read-only view of one part of an encoded item (a tensor's, array's or ``bytes``
    value's own bytes), keeping the object that holds them alive."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class ShmObjectStore:
    """One named shared-memory ring: created by its single writer, attached by readers."""

    @staticmethod
    def create(
        capacity: int,
        *,
        n_readers: int = 1,
        max_object_size: int | None = None,
        name: str | None = None,
    ) -> ShmObjectStore: ...
    @staticmethod
    def attach(handle: ReaderHandle) -> ShmObjectStore: ...
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def is_writer(self) -> bool: ...
    @property
    def reader_slot(self) -> int | None: ...
    @property
    def closed(self) -> bool: ...
    def handle(self) -> ReaderHandle: ...
    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> ShmHandle: ...
    def is_cached(self, key: str) -> bool: ...
    def get_cached(self, key: str) -> ShmHandle:
        """One more reference to ``key``'s object (``KeyError`` if absent; ``MemoryError``,
        nothing changed, if a reader already holds as many unread references as it counts)."""
    def get_stored(self, key: str) -> bytes:
        """The writer's copy of ``key``'s payload, issuing no reference (``KeyError`` if absent)."""
    def pin(self, key: str) -> None: ...
    def unpin(self, key: str) -> None: ...
    def release(self, handle: ShmHandle) -> None: ...
    def verify(self, handle: ShmHandle, key: str) -> bool:
        """Whether ``handle`` is ``key``'s current entry (no reference, hit or recency change)."""
    def invalidate(self, key: str) -> None: ...
    def clear(self) -> None: ...
    def keys(self) -> list[str]: ...
    def get(self, handle: ShmHandle, key: str, copy: bool = True) -> bytes | ShmView: ...
    def put_item(self, key: str, item: Mapping[str, Any]) -> ShmHandle:
        """Encode ``item`` and store it under ``key`` in one pass (``put``'s errors, and
        ``TypeError`` naming the field of a value the format cannot hold)."""
    def get_item(
        self, handle: ShmHandle, key: str, *, copy: bool = True, pin_memory: bool = False
    ) -> dict[str, Any]:
        """``get`` and decode: read-only zero-copy views (``copy=False``), or one copy per
        value, tensors in torch memory (pinned with ``pin_memory=True``, copies only)."""
    def try_get_cached(self, key: str) -> ShmHandle | None:
        """``get_cached``, or ``None`` for an absent key."""
    def try_pin(self, key: str) -> bool:
        """``pin``; whether ``key`` was there to pin (no ``KeyError``)."""
    def view_mapping(self) -> tuple[int, int]:
        """``(address, length)`` of a reader's read-only mapping, which views point into."""
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

def encode_item(item: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """An item as ``(part 0, [part 1, ...])``: the header and read-only views of the item's
    own tensor, array and long ``bytes`` memory."""

def decode_item(payload: Buffer, *, copy: bool = True) -> dict[str, Any]:
    """The item in a payload: copies, or (``copy=False``) views of ``payload``'s memory."""

def inspect_segment(name: str) -> dict[str, Any]:
    """Read a live segment's header without attaching as a reader (never writes to it)."""

def segment_status(name: str) -> tuple[str, str]:
    """``("live" | "orphaned" | "undecided", why)`` for the segment ``name`` (what ``prune`` acts on)."""

def list_segments() -> list[str]:
    """Names of the segments this package created on this host (live or orphaned)."""

def unlink_segment(name: str) -> None:
    """Remove a segment's name (its memory is freed once every process unmaps it)."""
