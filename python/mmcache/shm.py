"""The shared-memory caches: P0 writes each item once into a ring, every worker reads it.

P0's :class:`ShmSenderCache` is a writer (a :class:`~mmcache._core.ShmWriter`) of one ring and
hands out small :class:`ShmHandle` s; each worker's :class:`ShmReceiverCache` attaches as one
reader (a :class:`~mmcache._core.ShmReader`) and turns handles back into items.  Every handle a
writer issues holds one reference on its object, given back when every reader has read it (or
by :meth:`ShmSenderCache.release_handles` for a request that never reaches the readers), so an
object is never reclaimed while a handle to it is in flight.

Several frontends may share one ring (SPEC §3.9): each other one is a cache
:meth:`ShmSenderCache.join` ed from :meth:`ShmSenderCache.writer_handle`.  Prompt updates then
travel with their item, as the store's metadata (:mod:`mmcache.prompt_updates`; readers never
see it); each writer keeps the ones it put or decoded, tagged with the monotonic id of the
object they belong to.  With a single writer they stay in its memory.

Items go into the ring and come out of it through the native codec (``serde``'s format):
``put_item`` encodes straight into the object's chunk and ``resolve_item`` decodes straight
out of it, so the cache API costs little more than the store itself.

Threads: the core's writer and reader are thread-safe (each writer operation is atomic; a
handle is only ever issued for an object the ring still holds).  :class:`ShmSenderCache` adds
its lock for its own state (prompt updates, claims, statistics), held across each call (a
batched call checks and issues as one step no other thread's eviction can split), and takes
it for the calls into the core's writer that may wait long on a core lock, so that a thread
waits on the Python lock, which releases the GIL; lookups (lock-free in the core), touches
and waits for other writers' claims take none.  A touch's pin is the calling thread's, one
core pin of the object, counted in the core (per writer) and undone by the object's
monotonic id, so two requests touching one item keep it pinned until both let go, and an
undo never reaches a later object under the same key.  Claims are counted across threads in
Python: two requests claiming one item keep it claimed until both let go.
:class:`ShmReceiverCache` keeps no shared state in Python and takes no lock: worker threads
resolve (and copy) in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from mmcache import serde
from mmcache._core import (
    CachedItemCheck,
    KeyExistsError,
    ReaderHandle,
    ShmObjectStore,
    ShmWriter,
    WriterHandle,
)
from mmcache.arguments import (
    capacity_bytes,
    check_hash_list,
    check_list,
    check_max_object_size_mb,
    check_mm_hash,
    check_mm_hash_type,
    flag,
    wait_seconds,
)
from mmcache.caches import BaseSenderCache, SenderInput, SenderOutput, logger, split_sender_input
from mmcache.errors import (
    CacheMissError,
    InvalidHandleError,
    ObjectTooLargeError,
    ReferencesSaturatedError,
    RingFullError,
    ShmTooSmallError,
)
from mmcache.items import Item, ShmHandle
from mmcache.lru import CacheInfo, HitCounter
from mmcache.prompt_updates import (
    MAX_META_BYTES,
    NOT_SHAREABLE,
    KeptPromptUpdates,
    PromptUpdatesCodec,
    PromptUpdatesCodecSpec,
)
from mmcache.protection import Hold, Holds, RequestState
from mmcache.shm_receiver import ShmReceiverCache

__all__ = ["ShmReceiverCache", "ShmSenderCache"]

MiB = 1 << 20
_PUT_ATTEMPTS = 3  # lookups and puts of one item, each put losing to another writer's


class _Request(RequestState):
    """One thread's request, as :class:`ShmSenderCache` sees it: the base's (whether it is
    open), the items it pinned (key -> the monotonic id of the object pinned) and the
    single-flight claims it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.pins: dict[str, int] = {}
        self.claims: dict[str, Hold] = {}

    def __reduce__(self) -> tuple[type[_Request], tuple[()]]:
        return _Request, ()


class ShmSenderCache(CachedItemCheck, BaseSenderCache):
    """P0's cache in ``shm`` mode: a writer of a shared-memory ring.

    A hit returns ``(ShmHandle, prompt_updates)`` and issues one reference; a miss writes the
    item into the ring and returns its handle.  An item larger than ``max_object_size_mb``,
    or one that finds the ring full of protected objects (unread, pinned or viewed), is
    served uncached: the item itself is returned (tell it from a handle by type), counted in
    :meth:`stats` and logged once.  So is one for which ``/dev/shm``, filled by other
    processes after the ring was made, has no page left for the part of the ring it needs.

    A request that raises leaves no reference behind: :meth:`get_and_update` checks that
    every ``None`` item is cached (:class:`CacheMissError` listing every missing hash) and
    every other one a pair (``TypeError``) before it issues any handle, and should an item
    still fail part-way (a miss; an item the codec cannot hold), the handles issued for the
    items before it are given back before the error propagates (its claims and pins end with
    the request: at once, unless it runs inside :meth:`begin_request`).  Items it put
    before the failure stay cached: whole, and referenced by no handle.

    ``capacity_gb`` sizes the ring (:class:`~mmcache.errors.ShmTooSmallError`, a
    ``MemoryError``, at creation if ``/dev/shm`` cannot hold it); ``n_readers`` is the
    number of workers, each of which must read every handle. Items whose payload exceeds
    ``max_object_size_mb`` (or what the ring can hold) are served uncached.

    Several writers (SPEC §3.9): ``max_writers`` caches may share the store at once, this one
    included; each other one is made by :meth:`join` with :meth:`writer_handle`'s handle, in
    any process.  Every writer hits every writer's items and returns the prompt updates the
    putting writer gave: they are stored with the item, encoded by ``prompt_updates_codec``
    (:mod:`mmcache.prompt_updates`: ``"plain"`` data by default, never pickled unless
    ``"pickle"`` or a ``(dumps, loads)`` pair is passed).  An item whose prompt updates this
    writer cannot decode is not cached for it (:meth:`is_cached_item` is False, so the engine
    processes it; its update then issues a handle to the stored object).
    :meth:`is_cached` with ``claim``/``wait_s`` makes writers that receive the same new item
    at once process it once.
    """

    _lock: threading.RLock  # the base's: acquired by hand on the hit path (see there)

    def __init__(
        self,
        capacity_gb: float,
        *,
        max_object_size_mb: float = 128,
        n_readers: int = 1,
        name: str | None = None,
        max_writers: int = 1,
        prompt_updates_codec: PromptUpdatesCodecSpec = "plain",
    ) -> None:
        super().__init__()
        check_max_object_size_mb(max_object_size_mb)
        codec = PromptUpdatesCodec(prompt_updates_codec)
        # The core clamps the limit to what the ring can hold (a small ring with the default
        # limit is no error).
        capacity = capacity_bytes(capacity_gb)
        if capacity == 0:  # valid for the LRU caches (they cache nothing), not for a ring
            raise ValueError(
                f"capacity_gb must be positive for a shared-memory ring, not {capacity_gb!r}"
            )
        store = ShmObjectStore.create(
            capacity,
            n_readers=n_readers,
            # A limit beyond what the ring holds is clamped (by the core, to the ring).
            max_object_size=max(1, int(min(max_object_size_mb * MiB, 2**63))),
            name=name,
            max_writers=max_writers,
        )
        self._start(store, max_object_size_mb, codec)

    @classmethod
    def join(
        cls, writer_handle: WriterHandle, *, prompt_updates_codec: PromptUpdatesCodecSpec = "plain"
    ) -> ShmSenderCache:
        """One more writer of the store ``writer_handle`` names (from :meth:`writer_handle`),
        in this process or another: a P0 cache over the same ring
        (:class:`~mmcache.errors.NoWriterSlotError`, naming ``max_writers``, when every
        writer slot is taken; ``InvalidHandleError`` for a handle that is not the store's;
        ``FileNotFoundError`` once the last writer closed the store, which unlinks it;
        ``WriterGoneError`` once every writer died)."""
        if not isinstance(writer_handle, WriterHandle):
            raise TypeError(
                f"ShmSenderCache.join takes a WriterHandle (from writer_handle()), not a "
                f"{type(writer_handle).__qualname__}"
            )
        codec = PromptUpdatesCodec(prompt_updates_codec)
        cache = cls.__new__(cls)
        BaseSenderCache.__init__(cache)
        store = ShmObjectStore.join(writer_handle)
        cache._start(store, store.max_object_size / MiB, codec)
        return cache

    def _start(self, store: ShmWriter, asked_mb: float, codec: PromptUpdatesCodec) -> None:
        """Set up around ``store``, this cache's writer (``asked_mb``: the object size limit
        asked for, which the core may have lowered)."""
        self._store = store
        self._max_object_size = store.max_object_size
        self._asked_max_object_size_mb = asked_mb
        self._codec = codec
        # Only a store other writers can join needs the prompt updates beside each item.
        self._shares_updates = store.max_writers > 1
        # mm_hash -> (monotonic id of the object they belong to, or None: not known yet,
        # prompt updates). Written under the lock; read without it (one dict lookup).
        self._kept = KeptPromptUpdates(store.uncached)
        self._prompt_updates = self._kept.entries
        # `is_cached_item`, the hottest lookup, is `CachedItemCheck`'s: a C method reading
        # these two (no lock: the core's lookup is lock-free, and so is one lookup in a dict).
        self._check_with(store, self._prompt_updates)
        self._request: _Request = _Request()  # the calling thread's
        # Pins need no count here: each request's touch is one core pin of the object (counted
        # per writer in the core), undone by that request's update, by the object's monotonic
        # id, so never of a later object stored under the same key.
        # One core claim per miss claimed by any request in flight, until the last one lets go.
        self._claims = Holds(store.claim, store.unclaim)
        # Whether any request ever claimed (set once, under the lock): until then an update
        # has no claim to end, and skips looking for one (a writer alone never claims).
        self._claiming = False
        self._lookups = HitCounter()
        self._unshared = 0  # puts whose prompt updates no other writer can read

    @property
    def name(self) -> str:
        """The shared-memory segment's name."""
        return self._store.name

    @property
    def max_writers(self) -> int:
        """How many writers (this one included) may share the store at once."""
        return self._store.max_writers

    def handle(self) -> ReaderHandle:
        """Everything a worker needs to attach: ``ShmReceiverCache(cache.handle())``."""
        return self._store.handle()

    def writer_handle(self) -> WriterHandle:
        """Everything another process needs to :meth:`join` this store as one more writer
        (picklable; it carries the signing secret: same trust as :meth:`handle`)."""
        return self._store.writer_handle()

    # -- lookups ---------------------------------------------------------------------------

    def _learn_prompt_updates(self, mm_hash: str, monotonic_id: int) -> bool:
        """Read and keep the prompt updates another writer stored with ``mm_hash``'s object of
        ``monotonic_id`` (stored now, by ``is_cached_item``'s lookup); whether they could be had
        (it is still stored and they are shareable with this writer)."""
        with self._lock:
            kept = self._prompt_updates.get(mm_hash)
            if kept is not None and kept[0] == monotonic_id:
                return True  # this writer's other thread just put it, or learnt them
            try:
                meta = self._store.read_meta(mm_hash, monotonic_id=monotonic_id)
            except KeyError:
                return False  # replaced or gone since
            prompt_updates = self._codec.decode(meta)
            if prompt_updates is NOT_SHAREABLE:
                return False
            self._kept.keep(mm_hash, monotonic_id, prompt_updates)
            return True

    def is_cached(
        self, mm_hashes: Sequence[str], *, claim: bool = False, wait_s: float = 0.0
    ) -> list[bool]:
        """:meth:`is_cached_item` for each hash, with single flight between the writers of the
        store (SPEC §3.9).

        With ``claim``, each miss is claimed by this writer, for the calling thread's request,
        until this thread updates it (a put ends it for every writer; an item served uncached
        gives it up), :meth:`release_sender_touches`, the end of the request if it raised,
        :meth:`close`, or this process's death.  A miss another writer already claimed is not
        claimed.  With ``wait_s``, misses another live writer claimed are waited for, at most
        ``wait_s`` seconds for the whole call, and reported cached if they were put in time
        (after a wait every hash is answered as it stands then: a hit evicted meanwhile is a
        miss, claimed as the others are); claims of this writer (any of its threads) are
        never waited on, and a claim whose writer gave up or died ends the wait for it at
        once (with ``claim``, this writer then claims it).

        A request never waits while it holds claims: before a wait, the request gives up
        every claim it holds, its earlier calls' included (they are claimed again after the
        wait if still missing and nobody else claimed them meanwhile), so
        two requests that claimed each other's items in turns never wait for each other."""
        mm_hashes, claim = check_hash_list(mm_hashes), flag("claim", claim)
        wait_s = wait_seconds(wait_s)
        is_cached_item = self.is_cached_item  # (looked up once)
        cached = [is_cached_item(h) for h in mm_hashes]
        if not (claim or wait_s > 0) or all(cached):
            return cached
        misses = list(dict.fromkeys(h for h, hit in zip(mm_hashes, cached, strict=True) if not hit))
        contested = self._claim(misses) if claim else misses
        if wait_s > 0 and contested:
            # Every claim of the request, its earlier lookups' too (vLLM looks a request up
            # once per modality): all are taken back after the wait.
            held = self.give_up_claims()
            # Without the lock: the other threads' calls go on meanwhile (the wait polls the
            # core lock-free, the GIL released).
            self._store.wait_for(contested, wait_s)
            # Every hash looked up again: a hit of before the wait may have been evicted
            # during it (reported cached, its update would miss), a miss then like the others,
            # claimed with them.
            cached = [is_cached_item(h) for h in mm_hashes]
            if claim or held:
                misses = [h for h, hit in zip(mm_hashes, cached, strict=True) if not hit]
                wanted = dict.fromkeys([*held, *misses] if claim else held)
                self._claim([h for h in wanted if not self._store.is_cached(h)])
            return cached
        found = {h for h in misses if self.is_cached_item(h)}
        return [hit or h in found for h, hit in zip(mm_hashes, cached, strict=True)]

    def give_up_claims(self) -> list[str]:
        """The calling thread's request gives up every single-flight claim it holds (its
        touches stay); the hashes it held, to claim again with ``is_cached(hashes,
        claim=True)``."""
        with self._lock:
            held = list(self._request.claims)
            self._claims.give_all(self._request.claims)
        return held

    def _claim(self, mm_hashes: Sequence[str]) -> list[str]:
        """Claim each of ``mm_hashes`` nobody else holds, for this thread's request; those
        stored or claimed by another writer meanwhile."""
        contested = []
        with self._lock:
            self._claiming = True
            claims = self._request.claims
            for mm_hash in mm_hashes:
                # Asked of the core every time: a claim another request of this writer took
                # may have ended since (another writer put the item).
                if self._store.claim(mm_hash):
                    self._claims.take(claims, mm_hash)
                else:
                    contested.append(mm_hash)
        return contested

    # -- updates ---------------------------------------------------------------------------

    def get_and_update_item(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        request = self._request
        # The handle's reference protects the object from now on: this thread's pin from the
        # touch is undone, by the core call that issues it when that is the object pinned (one
        # lookup for both), else below; its claim has ended (a put) or is given up.
        try:
            pinned = request.pins.pop(mm_hash, None)
        except TypeError:  # unhashable
            check_mm_hash_type("get_and_update_item(item, mm_hash)", mm_hash)
            raise
        # The lock by hand, not `with`: a `with` looks up and calls `__enter__` and
        # `__exit__` (arguments packed for both), 70 ns of a hit's 800.
        lock = self._lock
        lock.acquire()
        try:
            self._lookups.total += 1
            if pinned is None and type(item) is tuple and len(item) == 2:
                # Data, for an item the engine found missing and processed: put at once,
                # with no lookup first (a stream of misses; a key stored since is a hit).
                return self._put(item, mm_hash, item[0], item[1])
            # The hot path first: a hit on an object whose prompt updates are kept here
            # (`_hit`'s first case, inlined: one call less on every hit; keep the two alike).
            handle = self._store.issue_unpinning(mm_hash, pinned)
            if handle is None:
                data, prompt_updates = split_sender_input(item, mm_hash)
                return self._put(item, mm_hash, data, prompt_updates)
            monotonic_id = handle.monotonic_id
            if monotonic_id == pinned:
                pinned = None
            kept = self._prompt_updates.get(mm_hash)
            if kept is not None and kept[0] == monotonic_id:
                self._lookups.hits += 1
                return handle, kept[1]
            return self._hit(handle, item, mm_hash)
        except ReferencesSaturatedError:
            self._lookups.hits += 1
            return self._serve_saturated(item, mm_hash)
        except TypeError:  # the core's, for a key that is not a str
            check_mm_hash_type("get_and_update_item(item, mm_hash)", mm_hash)
            raise
        except UnicodeEncodeError:
            # The core's for a key that is no UTF-8 (checked here, not on every call), or
            # the codec's for the prompt updates.
            check_mm_hash(mm_hash, "get_and_update_item(item, mm_hash)")
            raise
        finally:
            try:
                if pinned is not None and not self._store.closed:
                    self._store.unpin_object(mm_hash, pinned)
                if self._claiming and request.claims:
                    self._claims.give(request.claims, mm_hash)
            finally:
                lock.release()

    def _put(
        self, item: SenderInput, mm_hash: str, data: Item, prompt_updates: Any
    ) -> SenderOutput:
        """The one put path (lock held): store ``data`` (``item``'s) with its prompt updates
        and return its handle, or serve it uncached. A key stored since the engine found it
        missing (the put refuses it) is a hit on that object, and so is data the codec
        refuses for a key stored meanwhile (a hit ignores the data); ``ReferencesSaturatedError``
        when a reader holds the most references to it."""
        store = self._store
        meta = self._codec.encode(prompt_updates) if self._shares_updates else b""
        attempts = _PUT_ATTEMPTS
        while attempts:  # (not `for … in range`: a range object per put)
            attempts -= 1
            try:
                # No keyword unless there is metadata: PyO3 parses keywords at a cost.
                handle = (
                    store.put_item(mm_hash, data, meta=meta)
                    if meta
                    else store.put_item(mm_hash, data)
                )
            except KeyExistsError:
                pass  # stored meanwhile: issue its object, if still there
            except ObjectTooLargeError:
                self._serve_uncached("oversize", f"item {mm_hash} {self._too_large()}")
                return data, prompt_updates
            except RingFullError:
                self._serve_uncached(
                    "full",
                    f"no room for item {mm_hash}: every object in the shared-memory ring is "
                    "still unread, pinned or viewed (raise capacity_gb, or check that every "
                    "reader keeps up and aborted requests call release_handles)",
                )
                return data, prompt_updates
            except ShmTooSmallError:
                self._serve_uncached(
                    "no_space",
                    f"no room for item {mm_hash}: /dev/shm is full (other processes used the "
                    "space the ring had not taken yet, which it takes as it fills); free "
                    "/dev/shm or give it room beyond the ring (docker run --shm-size), and "
                    "the ring takes it again",
                )
                return data, prompt_updates
            except TypeError:
                if not store.is_cached(mm_hash):
                    raise
            else:
                if self._shares_updates and not meta:
                    self._unshared_put(mm_hash, prompt_updates)
                self._kept.keep(mm_hash, handle.monotonic_id, prompt_updates)
                return handle, prompt_updates
            stored = store.issue_if_present(mm_hash)
            if stored is not None:
                return self._hit(stored, item, mm_hash)
        # Put by another writer and evicted again, every time: serve it from here.
        self._serve_uncached("full", f"item {mm_hash} was evicted as fast as it was stored")
        return data, prompt_updates

    def _hit(self, handle: ShmHandle, item: SenderInput, mm_hash: str) -> SenderOutput:
        """A hit on ``handle`` (just issued; lock held), with its object's prompt updates."""
        kept = self._prompt_updates.get(mm_hash)
        if kept is not None and kept[0] == handle.monotonic_id:
            prompt_updates = kept[1]
        else:
            prompt_updates = self._hit_prompt_updates(handle, item, mm_hash)
        self._lookups.hits += 1
        return handle, prompt_updates

    def _hit_prompt_updates(self, handle: ShmHandle, item: SenderInput, mm_hash: str) -> Any:
        """The prompt updates of the object ``handle`` names (just issued, and not the object
        whose prompt updates are kept here; lock held), read from the store; when they are
        not shareable, those ``item`` carries (``CacheMissError``, the handle given back, if
        it carries none)."""
        monotonic_id = handle.monotonic_id
        prompt_updates = self._stored_prompt_updates(mm_hash, monotonic_id)
        if prompt_updates is NOT_SHAREABLE:
            try:
                _, prompt_updates = split_sender_input(item, mm_hash)
            except BaseException:
                self._store.release(handle)
                raise
        self._kept.keep(mm_hash, monotonic_id, prompt_updates)
        return prompt_updates

    def _stored_prompt_updates(self, mm_hash: str, monotonic_id: int | None) -> Any:
        """The prompt updates stored with ``mm_hash``'s object (the one ``monotonic_id``
        names, if given), or ``NOT_SHAREABLE``."""
        try:
            return self._codec.decode(self._store.read_meta(mm_hash, monotonic_id=monotonic_id))
        except KeyError:  # invalidated or replaced since the handle was issued
            return NOT_SHAREABLE

    def _serve_saturated(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        """``mm_hash`` is cached, but a reader already holds as many unread references to it
        as its slot can count: serve the item uncached, from the request's data if it came
        with any, else from a copy of what the ring holds (no reference is issued)."""
        self._serve_uncached(
            "saturated",
            f"item {mm_hash} is cached, but a worker already holds the most unread references "
            "to it that the ring can count: a worker is not reading (stuck, or aborted "
            "requests whose handles never went to release_handles)",
        )
        if item is not None:
            return split_sender_input(item, mm_hash)
        kept = self._prompt_updates.get(mm_hash)
        if kept is not None and (kept[0] is None or self._holds_object(mm_hash, kept[0])):
            prompt_updates = kept[1]
        else:  # none kept, or kept for an object another writer replaced since
            prompt_updates = self._stored_prompt_updates(mm_hash, None)
        if prompt_updates is NOT_SHAREABLE:
            raise CacheMissError([mm_hash])
        return serde.decode(self._store.read_stored(mm_hash)), prompt_updates

    def _holds_object(self, mm_hash: str, monotonic_id: int) -> bool:
        """Whether ``mm_hash`` names the object of ``monotonic_id`` now (lock held)."""
        try:
            self._store.read_meta(mm_hash, monotonic_id=monotonic_id)
        except KeyError:
            return False
        return True

    def _too_large(self) -> str:
        """Why an item too large for the ring is, naming the setting that would change it."""
        largest = f"{self._max_object_size / MiB:g} MiB"
        if self._max_object_size < self._asked_max_object_size_mb * MiB:
            return (
                f"is larger than the largest object this ring holds, {largest}: "
                f"max_object_size_mb={self._asked_max_object_size_mb:g} was lowered to what a "
                f"ring of {self._store.capacity / MiB:g} MiB holds (raise capacity_gb to cache "
                "items this large)"
            )
        return (
            f"is larger than max_object_size_mb={self._asked_max_object_size_mb:g} "
            f"({largest}; raise it to cache items this large)"
        )

    def _unshared_put(self, mm_hash: str, prompt_updates: Any) -> None:
        """``mm_hash`` was put without its prompt updates, which the codec cannot encode (of a
        store other writers can join): counted and logged once. Only once put: data that
        turns out a hit, or is served uncached, is stored by nobody."""
        self._unshared += 1
        if "unshared" not in self._warned:
            self._warned.add("unshared")
            logger.warning(
                "the prompt updates of item %s cannot be shared with the other writers "
                "(the %r codec cannot encode a %s, or they exceed %d bytes): the other "
                "writers process the item again. Pass prompt_updates_codec='pickle' (or a "
                "(dumps, loads) pair); further ones are counted in "
                "stats()['unshared_prompt_updates'].",
                mm_hash,
                self._codec.name,
                type(prompt_updates).__qualname__,
                MAX_META_BYTES,
            )

    def verify(self, handle: object, mm_hash: str) -> bool:
        """Whether ``handle`` is ``mm_hash``'s current entry in the ring: an
        :class:`ShmHandle` signed for ``mm_hash`` by this cache and naming the object stored
        under it now.  Side-effect free (no hit counted, no reference issued, no recency
        change), for validating a handle a client sent back."""
        check_mm_hash(mm_hash, "verify(handle, mm_hash)")
        if not isinstance(handle, ShmHandle):
            return False
        with self._lock:  # as in is_cached_item: wait here, not on the core's mutex
            return self._store.verify(handle, mm_hash)

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        """Pin ``mm_hash`` (if cached) until this thread's :meth:`get_and_update_item` of it,
        so writing the request's other items (or other threads' items) cannot evict it."""
        # No lock: the pins are this thread's, and a pin is one atomic core call (which waits
        # on the core's lock only for an object being evicted, held by a writer that needs
        # no GIL to finish).
        pins = self._request.pins
        try:
            if mm_hash not in pins:
                pinned = self._store.pin_object(mm_hash)
                if pinned is not None:
                    pins[mm_hash] = pinned
        except (TypeError, UnicodeEncodeError):
            # Unhashable, not a str (the core's), or no UTF-8: checked here, not on every call.
            check_mm_hash(mm_hash, "touch_sender_cache_item(mm_hash)")
            raise

    def release_sender_touches(self) -> None:
        """Unpin every item this thread touched, and give up every claim it took, whose
        update never came (an abandoned request)."""
        with self._lock:
            self._unpin(list(self._request.pins))
            self._claims.give_all(self._request.claims)

    def _unpin(self, keys: Iterable[str]) -> None:
        """Undo this thread's pins of ``keys`` (those it holds; lock held). A closed store
        dropped them all."""
        pins = self._request.pins
        for mm_hash in keys:
            pinned = pins.pop(mm_hash, None)
            if pinned is not None and not self._store.closed:
                self._store.unpin_object(mm_hash, pinned)

    def _end_request(self, keys: Sequence[str] | None) -> None:
        # Every item of a request that succeeded was unpinned (and its claim ended) by its
        # update; those of a request that raised will never get one.
        request = self._request
        if keys is None:
            self._unpin(list(request.pins))
            self._claims.give_all(request.claims)
            return
        self._unpin(keys)
        for mm_hash in keys:
            self._claims.give(request.claims, mm_hash)

    def _abandon(self, outputs: Sequence[SenderOutput]) -> None:
        # The request raised: the engine never sees these handles, so it cannot release them.
        self.release_handles(data for data, _ in outputs)

    def release_handles(self, handles: Iterable[object]) -> None:
        """Give back the references of handles that will never reach the readers (their
        request was aborted or rejected).  Anything that is not a handle is skipped, so the
        data of a request's features can be passed as is.  A handle the core refuses (forged,
        truncated) does not stop the others: stopping there would leave their references
        pinning the ring; the first such error is raised once all are given back."""
        check_list(handles, "release_handles", "handles", "release_handles([handle])")
        failure: Exception | None = None
        with self._lock:  # as in is_cached_item: wait here, not on the core's mutex
            for handle in handles:
                if isinstance(handle, ShmHandle):
                    try:
                        self._store.release(handle)
                    except InvalidHandleError as exc:
                        failure = failure or exc
        if failure is not None:
            raise failure

    def invalidate(self, mm_hash: str) -> None:
        """Drop ``mm_hash`` from the ring, for every writer.  Handles to it that are already
        in flight either still read their own data (their unread references protect it) or
        are a miss, never another item's data; the next update of ``mm_hash`` writes it
        anew."""
        check_mm_hash(mm_hash, "invalidate(mm_hash)")
        with self._lock:
            self._store.invalidate(mm_hash)  # drops its pins too
            self._prompt_updates.pop(mm_hash, None)

    def clear_cache(self, *, keep_in_flight: bool = False) -> None:
        """Drop every object (of every writer: the store is shared) and reset this cache's
        hit statistics.  Handles issued before either
        still read their own data or are a miss, never another item's data: monotonic ids
        keep counting, so they can never alias new data.

        By default every reference is dropped too, so objects of requests abandoned without
        :meth:`release_handles` stop pinning the ring, and a handle still in flight may
        miss.  With ``keep_in_flight=True`` every key is forgotten but the references stay:
        a handle in flight still reads its own data, and each object is reclaimed once it
        has been read (an abandoned reference keeps pinning its object).
        """
        keep_in_flight = flag("keep_in_flight", keep_in_flight)
        with self._lock:
            if keep_in_flight:
                for key in self._store.keys():
                    self._store.invalidate(key)
            else:
                self._store.clear()
            self._kept.clear()
            self._lookups.reset()

    def close(self) -> None:
        """Leave the store, giving up this writer's pins and claims; the last writer to close
        unlinks the segment (the items this one put stay cached for the others).
        Idempotent."""
        with self._lock:
            if not self._store.closed:
                self._claims.forget_all()
                self._store.close()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        delta = flag("delta", delta)
        with self._lock:
            return self._lookups.info(delta=delta)

    def stats(self) -> dict[str, int]:
        """This writer's hit counters, items served uncached and puts whose prompt updates
        no other writer can read (``unshared_prompt_updates``), and the store's counters
        (``store_*``, shared by every writer)."""
        # Outside the cache's lock: the store's walks the whole ring (milliseconds in a large
        # one), and this writer's other threads put and look up meanwhile.
        store = {f"store_{k}": v for k, v in self._store.stats().items()}
        with self._lock:
            own = {
                "hits": self._lookups.hits,
                "total": self._lookups.total,
                "max_object_size": self._max_object_size,
                "unshared_prompt_updates": self._unshared,
            }
            return {**own, **super().stats(), **store}


# `is_cached_item` (`CachedItemCheck`'s, a C method) as a method of exactly this class: CPython
# 3.11 specialises a call of a C method only on instances of exactly its class.
ShmSenderCache.is_cached_item = CachedItemCheck._method_for(ShmSenderCache)  # type: ignore[method-assign, assignment]
