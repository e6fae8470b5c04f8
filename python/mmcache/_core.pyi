"""Type stubs for the Rust core, ``mmcache._core`` (kept honest by ``mypy.stubtest``)."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, final

from typing_extensions import Buffer, disjoint_base

__version__: str
LAYOUT_VERSION: int
PART_ALIGNMENT: int
"""Every part of a multi-part ``put`` starts at a multiple of this many bytes of the payload."""
MAX_WRITERS: int
"""The most writers one store takes (``max_writers``' bound)."""
OUT_OF_BAND_BYTES: int
"""``bytes`` values at least this long travel as their own part instead of in the header."""
PAYLOAD_FORMAT_VERSION: int
"""The item payload format this build writes and reads (the digit after ``b"MMC"``)."""
CRASH_POINTS: tuple[str, ...]
"""Where a test can have a writer process killed (``MMCACHE_CRASH_POINT=<name>``, read when
the process makes its first writer; ``MMCACHE_CRASH_AFTER=<n>``: at the n-th pass)."""

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
    """Every writer of the segment closed it or exited."""

class NoReaderSlotError(MmcacheError):
    """Every reader slot of the segment is taken."""

class NoWriterSlotError(MmcacheError):
    """Every writer slot of the store is taken (``max_writers`` live writers)."""

class WrongProcessError(MmcacheError):
    """A writer or reader used in a process other than the one that created or attached it
    (after ``fork()``: create a new writer, or attach a new reader, in the child)."""

class ItemNotEncodableError(TypeError, ValueError):
    """An item the codec cannot hold: an unsupported value, one past a limit of the format,
    or a tensor without memory of its own. The message names the field."""

class ObjectTooLargeError(ValueError):
    """An object larger than the store's ``max_object_size``."""

class KeyExistsError(ValueError):
    """A put of a key that is already stored, by this writer or another (with several
    writers, another writer's put won the race)."""

class RingFullError(MemoryError):
    """No room in the ring: every chunk that could hold the object is still unread, pinned or
    viewed."""

class ReferencesSaturatedError(MemoryError):
    """One more reference would overflow a reader's count: that reader already holds the most
    unread references to the object it can count (nothing changed)."""

class ShmTooSmallError(MemoryError):
    """The host's ``/dev/shm`` cannot hold the segment, for want of bytes or of files (the
    message says how to make room)."""

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
class WriterHandle:
    """Everything another process needs to join a store as a writer: segment name, layout and
    the signing secret (same trust as a :class:`ReaderHandle`)."""

    def __new__(
        cls,
        *,
        name: str,
        capacity: int,
        n_readers: int,
        max_object_size: int,
        max_writers: int,
        layout_version: int,
        secret: bytes,
    ) -> WriterHandle: ...
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def max_writers(self) -> int: ...
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

@disjoint_base
class ShmObjectStore:
    """One named shared-memory ring. Never instantiated itself: :meth:`create` makes its first
    writer (a :class:`ShmWriter`), :meth:`join` another writer, :meth:`attach` a reader (a
    :class:`ShmReader`). What both roles have is here; each subclass has only its own role's
    methods."""

    @staticmethod
    def create(
        capacity: int,
        *,
        n_readers: int = 1,
        max_object_size: int | None = None,
        name: str | None = None,
        max_writers: int = 1,
        max_objects: int | None = None,
    ) -> ShmWriter:
        """The first writer of a new segment (``ShmTooSmallError`` if ``/dev/shm`` cannot hold
        it). ``max_writers`` writers (this one included) may be joined at once;
        ``max_objects`` sizes the key index (default: one per 16 KiB of ring, at least 4096);
        beyond it a put evicts first."""
    @staticmethod
    def join(writer_handle: WriterHandle) -> ShmWriter:
        """One more writer of ``writer_handle``'s store, in this process or another
        (``NoWriterSlotError`` when ``max_writers`` writers live; ``InvalidHandleError`` for a
        secret that is not the store's; ``FileNotFoundError`` once the last writer closed it;
        ``WriterGoneError`` if every writer died)."""
    @staticmethod
    def attach(handle: ReaderHandle) -> ShmReader:
        """A reader of ``handle``'s segment, in a reader slot of its own
        (``InvalidHandleError``, taking no slot, for a secret that is not the store's)."""
    @property
    def name(self) -> str: ...
    @property
    def capacity(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def max_writers(self) -> int: ...
    @property
    def is_writer(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def handle(self) -> ReaderHandle: ...
    def get(self, handle: ShmHandle, key: str, copy: bool = True) -> bytes | ShmView:
        """A reader's :meth:`ShmReader.resolve` (it consumes a reference), or the writer's own
        verified copy (``copy=False``: a :class:`ShmView` of it)."""
    def get_item(
        self, handle: ShmHandle, key: str, *, copy: bool = True, pin_memory: bool = False
    ) -> dict[str, Any]:
        """A reader's :meth:`ShmReader.resolve_item` (it consumes a reference), or the item
        decoded from the writer's own verified copy."""
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None:
        """Close the writer (the last writer to close unlinks the segment; waits for this
        writer's operations other threads have in progress) or detach the reader (its slot
        drains: freed now, or with its last zero-copy view); idempotent."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

@final
class ShmWriter(ShmObjectStore):
    """One writer of a ring (made by :meth:`ShmObjectStore.create` or
    :meth:`ShmObjectStore.join`). Every writer sees every object any writer stored; capacity,
    eviction and the counters are the store's. Safe to call from several threads."""

    @property
    def writer_slot(self) -> int:
        """This writer's slot among the store's ``max_writers``."""
    def writer_handle(self) -> WriterHandle:
        """What another process needs to :meth:`ShmObjectStore.join` this store."""
    def put(self, key: str, data: Buffer | Sequence[Buffer], *, meta: bytes = b"") -> ShmHandle:
        """Store ``data`` under ``key``, part by part, with ``meta`` beside it (any writer
        reads it with :meth:`read_meta`; readers never see it), and issue one reference
        (``ValueError`` for a duplicate key or a key over 4096 bytes or ``meta`` over 1 MiB,
        ``ObjectTooLargeError``, ``RingFullError``). A put of a key claimed by any writer ends
        the claim."""
    def put_item(self, key: str, item: Mapping[str, Any], *, meta: bytes = b"") -> ShmHandle:
        """Encode ``item`` and store it under ``key`` in one pass (``put``'s errors, and
        ``TypeError`` naming the field of a value the format cannot hold)."""
    def is_cached(self, key: str) -> bool:
        """Whether ``key`` is stored, by any writer (no reference, hit or recency change; no
        lock)."""
    def uncached(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` that are not stored (:meth:`is_cached` of each, in order): what a
        cache keeps about evicted objects, found at a cost that grows with ``keys``, not with
        the ring (:meth:`keys` walks its whole index)."""
    def issue(self, key: str) -> ShmHandle:
        """One more reference to ``key``'s object, as a handle (``KeyError`` if absent;
        ``ReferencesSaturatedError``, nothing changed, if a reader already holds as many
        unread references as it counts)."""
    def issue_if_present(self, key: str) -> ShmHandle | None:
        """:meth:`issue`, or ``None`` for an absent key."""
    def issue_unpinning(self, key: str, pinned: int | None) -> ShmHandle | None:
        """:meth:`issue_if_present`, and if the object issued is the one ``pinned`` names (a
        monotonic id from :meth:`pin_object`), one of this writer's pins on it undone in the
        same lookup (the handle's reference protects it from then on; the pin stays if
        ``ReferencesSaturatedError`` is raised)."""
    def read_stored(self, key: str) -> bytes:
        """A copy of ``key``'s payload, issuing no reference (``KeyError`` if absent)."""
    def read_meta(self, key: str, *, monotonic_id: int | None = None) -> bytes:
        """The metadata stored with ``key``'s object by whichever writer put it (``KeyError``
        if absent; with ``monotonic_id``, also if ``key`` now names an object other than the
        one with that id: a handle's ``monotonic_id`` identifies the metadata too)."""
    def claim(self, key: str) -> bool:
        """Single flight: ``True`` if this writer now holds ``key``'s claim (it computes the
        item, then puts it or calls :meth:`unclaim`), ``False`` if ``key`` is stored or
        another live writer claimed it. A claim ends at any writer's put of the key, this
        writer's :meth:`unclaim` or close, or this writer's death."""
    def unclaim(self, key: str) -> None:
        """Give up this writer's claim of ``key`` (a no-op if it holds none)."""
    def wait_for(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        """Wait up to ``timeout_s`` seconds for keys another live writer claimed; for each key,
        whether it is stored when this returns. Never waits on this writer's own claims, nor
        on keys that are unclaimed or whose claim's writer gave up or died (polls, the GIL
        released)."""
    def pin(self, key: str) -> None:
        """Protect ``key``'s object from eviction until a matching :meth:`unpin` (pins are
        counted; ``KeyError`` if absent)."""
    def pin_if_present(self, key: str) -> bool:
        """:meth:`pin`; whether ``key`` was there to pin (no ``KeyError``)."""
    def pin_object(self, key: str) -> int | None:
        """:meth:`pin_if_present`, returning the monotonic id of the object pinned (``None``
        if ``key`` is absent): undo it with :meth:`unpin_object` or :meth:`issue_unpinning`,
        which never reach a later object stored under the same key."""
    def unpin_object(self, key: str, monotonic_id: int) -> None:
        """Undo one of this writer's pins on ``key``'s object if it is still the one with
        ``monotonic_id`` (a no-op otherwise: invalidating or replacing it ended its pins)."""
    def unpin(self, key: str) -> None: ...
    def release(self, handle: ShmHandle) -> None:
        """Give back the references of a handle that will never reach the readers (only a
        handle this writer issued: another writer's is a no-op)."""
    def verify(self, handle: ShmHandle, key: str) -> bool:
        """Whether ``handle`` is ``key``'s current entry (no reference, hit or recency change)."""
    def invalidate(self, key: str) -> None:
        """Drop ``key`` for every writer (in-flight handles still read their own bytes)."""
    def clear(self) -> None:
        """Drop every object of the store (for every writer) and every unread reference."""
    def keys(self) -> list[str]: ...
    def get_cached(self, key: str) -> ShmHandle:
        """Alias of :meth:`issue` (SPEC.md's name)."""
    def try_get_cached(self, key: str) -> ShmHandle | None:
        """Alias of :meth:`issue_if_present`."""
    def get_stored(self, key: str) -> bytes:
        """Alias of :meth:`read_stored`."""
    def try_pin(self, key: str) -> bool:
        """Alias of :meth:`pin_if_present`."""

@disjoint_base
class CachedItemCheck:
    """The native base class of ``ShmSenderCache``: its ``is_cached_item`` as a C method (no
    Python frame; a call of it is specialised as a method's). Whether ``mm_hash`` is stored
    (the writer's lock-free lookup) and its prompt updates are in ``kept`` (the cache's
    dict); for a key stored but not kept, the cache's ``_learn_prompt_updates`` answers."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self: ...
    def _check_with(self, writer: ShmWriter, kept: dict[str, Any]) -> None:
        """Answer ``is_cached_item`` from ``writer``'s lookups and the prompt updates kept in
        ``kept`` (once: ``RuntimeError`` after)."""
    def is_cached_item(self, mm_hash: str) -> bool:
        """Whether ``mm_hash`` is cached: stored in the ring and its prompt updates kept (or
        learnt) by this cache. No lock, no recency change."""
    @staticmethod
    def _method_for(subclass: type[CachedItemCheck]) -> Callable[[CachedItemCheck, str], bool]:
        """``is_cached_item`` as a method of exactly ``subclass`` (to be set as its
        attribute: CPython specialises a call of it on that class's instances)."""

@final
class ShmReader(ShmObjectStore):
    """One reader of a ring, in a reader slot of its own (made by
    :meth:`ShmObjectStore.attach`)."""

    @property
    def reader_slot(self) -> int: ...
    def resolve(self, handle: ShmHandle, key: str, *, copy: bool = True) -> bytes | ShmView:
        """Verify ``handle`` for ``key`` (signature, bounds, id) before reading and again
        after, consume one of this reader's references, and return the bytes or
        (``copy=False``) a read-only zero-copy view that keeps the object alive."""
    def resolve_item(
        self, handle: ShmHandle, key: str, *, copy: bool = True, pin_memory: bool = False
    ) -> dict[str, Any]:
        """:meth:`resolve` and decode: read-only zero-copy views (``copy=False``), or one copy
        per value, tensors in torch memory (pinned with ``pin_memory=True``, copies only)."""
    def view_mapping(self) -> tuple[int, int]:
        """``(address, length)`` of this reader's read-only mapping, which views point into."""

def encode_item(item: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """An item as ``(part 0, [part 1, ...])``: the header and read-only views of the item's
    own tensor, array and long ``bytes`` memory."""

def pack_item(item: Mapping[str, Any]) -> bytes:
    """An item's whole payload (part 0, then each part at its aligned offset), encoded and
    copied in one call."""

def decode_item(payload: Buffer, *, copy: bool = True) -> dict[str, Any]:
    """The item in a payload: copies, or (``copy=False``) views of ``payload``'s memory."""

def part_offsets(lengths: Sequence[int]) -> tuple[list[int], int]:
    """Where each part of a payload starts, given every part's length (part 0 included), and
    the payload's length: every part starts at the next multiple of :data:`PART_ALIGNMENT`
    (``OverflowError`` past 64 bits)."""

def inspect_segment(name: str) -> dict[str, Any]:
    """Read a live segment's header without attaching as a reader (never writes to it)."""

def segment_status(name: str) -> tuple[str, str]:
    """``("live" | "orphaned" | "undecided", why)`` for the segment ``name`` (what ``prune``
    acts on)."""

def list_segments() -> list[str]:
    """Names of the segments this package created on this host (live or orphaned)."""

def unlink_segment(name: str) -> None:
    """Remove a segment's name (its memory is freed once every process unmaps it)."""

def remove_orphaned_segment(name: str) -> bool:
    """Remove the segment ``name`` if it is orphaned, judged again under a lock every remover
    takes (so the name cannot pass to a new store in between); whether it was removed."""

def generate_segment_name() -> str:
    """A fresh name of the kind :meth:`ShmObjectStore.create` generates, for a store another
    process is to create with it: this one then knows the name even if that process dies
    while creating it, and can remove what it left."""
