"""P0's cache with a shared remote tier behind it: ``TieredSenderCache(local, remote)``.

It wraps any P0 cache (``ProcessorOnlyCache``, ``SenderCache``, ``ShmSenderCache``) without
changing it, and slots into the engine's loop where the local cache already sits:

1. ``is_cached(hashes)`` answers from the local cache, then asks the remote tier - once, for
   all the request's local misses - and reports the items it found there as cached too (so
   the engine does not process them).  What it fetched waits, verified, until the update.
2. ``get_and_update(inputs, hashes)`` hands the local cache the fetched item wherever the
   engine passed ``None`` for a remote hit, so the local cache takes it in exactly as if P0
   had processed it (written into the ring, or sent to P1, as the mode does; a hit, should
   the local cache hold the hash by then).
3. Every item P0 did process (data passed for a hash the local cache did not hold) is
   published to the remote tier by a writer thread after the update; the request never waits
   for it.  A full publishing queue drops the item (counted), never blocks.

**Single flight across hosts.**  ``is_cached(hashes, claim=True, wait_s=T)`` claims, in the
same round trip as the lookup, each miss nobody else claimed: a short-lived marker beside the
item's key in the store naming this cache's random :attr:`~TieredSenderCache.host_id`, which
expires by itself after ``claim_ttl_s`` (so a host that dies holding claims frees them).  A
miss another host claimed is waited for, up to ``T`` seconds for the whole call: the lookup
is repeated with backoff (2 ms, doubling, at most 50 ms apart) until the item is there (a
remote hit), the claim is gone without it (the claimer gave up or died: this host claims
and processes it) or the time is up (this host processes it); the local hits of a call that
waited are looked up again after the wait (one evicted meanwhile is a local miss, asked of
the tier and claimed there and in the local cache as the others were, not waited for).
This host's own claims are never waited on.  A request never waits for another host
holding claims: before such a wait it gives up every claim it holds, in the store and in
the local cache, its earlier lookups' included (a wait inside the local cache, for another
writer of this host's ring, keeps the store claims: a host waiting on those holds none
itself), and after the wait it claims again those and the call's misses still missing (a
miss another host claimed meanwhile is waited for in turn), so two hosts whose requests claimed each
other's items (in turns: vLLM looks a request up once per modality) never wait for each
other.  A claim ends when the claimer publishes the item (dropped by the writer
thread once the put returns, so a waiter finds the item before it finds the claim gone) or
gives up: an update without data for it, an update that raises, ``release_sender_touches``,
the end of its request (``end_request``: its update never came), ``close`` (if a put of the
item is pending then - another request processed it too - the claim ends once that put
returns); the claimer drops only its own claim (compare-and-delete).  A claim ends too once
another request of this host has stored the item (the claim has nothing left to guard).
Every claim call is one call of the store, under its deadline and circuit breaker: a failing
store costs one deadline and ends the wait (everything is processed here).  Claims need a
store that holds them
(:attr:`RemoteStore.supports_claims <mmcache.remote.RemoteStore.supports_claims>`:
Redis/Valkey); over Mooncake Store ``claim`` and ``wait_s`` change nothing.

**Threads.**  Several threads may call one cache at once (an engine's pool of preprocessing
threads), as every cache allows (:mod:`mmcache.caches`): the cache's lock guards the tier's
own state (the fetched items, the claims held, the counters) and is never held across a call
to the store or to the local cache, so a thread waiting on the remote tier (a lookup, a wait
for another host's claim) holds up no other thread's local hits.  What a request has is the
calling thread's, as its request bracket is (passed on to the local cache): a fetched item
waits for the update of every request whose :meth:`~TieredSenderCache.is_cached` found it
(until the end of the request, inside a bracket), so one thread's update never takes it from
another; and a claim belongs to the request that took it - only that request's update,
``release_sender_touches`` or ``end_request`` (or ``close``) ends it.  Threads of one host
share its :attr:`~TieredSenderCache.host_id`, so a request never waits on a claim another request of
this host holds: it processes the item too, as a writer's threads do with its local claims.
:meth:`~TieredSenderCache.close` may run while other threads call in.

Both waiting rooms are bounded by count and by bytes (:func:`~mmcache.items.item_size`): the
items waiting to be published (until their put returns) and the fetched items waiting for
their update.

The local tiers and their guarantees are unchanged: the local cache sees the same calls in the
same order as without the tier, only with data where the tier supplied it.  The remote record
of an item is the item and its prompt updates, stored as one item
(``{"item": ..., "prompt_updates": ...}``); prompt updates the item codec cannot give back as
they are (an object; a namedtuple or an ``IntEnum``, which would come back as their base
types) keep that item local (counted as ``remote_unencodable``).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from mmcache.arguments import check_hash_list, check_item_list, flag, wait_seconds
from mmcache.caches import BaseSenderCache, SenderInput, SenderOutput
from mmcache.items import Item, item_size
from mmcache.lru import CacheInfo
from mmcache.prompt_updates import comes_back_as_is
from mmcache.protection import Holds, RequestState
from mmcache.remote.store import RemoteStore, check_claim_ttl_s, is_shareable_key
from mmcache.remote.waiting import Fetched, Publisher

__all__ = ["TieredSenderCache"]

MiB = 1 << 20
_T = TypeVar("_T")
_FIRST_POLL_S = 0.002  # the first look again at items another host claimed ...
_MAX_POLL_S = 0.05  # ... doubling up to this


def _takes_claims(cache: BaseSenderCache) -> bool:
    """Whether ``cache.is_cached`` takes ``claim`` and ``wait_s`` (single flight between the
    writers of one host)."""
    try:
        parameters = inspect.signature(cache.is_cached).parameters
    except (TypeError, ValueError):
        return False
    return {"claim", "wait_s"} <= parameters.keys()


class _Claim:
    """A claim in the store that one request of this host holds; its identity tells the
    request's current claim from a stale one (ended, lapsed, or taken anew since)."""

    __slots__ = ("lapses",)

    def __init__(self, lapses: float) -> None:
        self.lapses = lapses  # time.monotonic() when the store lets it lapse


class _Request(RequestState):
    """One thread's request, as the tier sees it: the base's (whether it is open; ``holds``:
    the fetched items it waits for) and the claims it took."""

    def __init__(self) -> None:
        super().__init__()
        self.claims: dict[str, _Claim] = {}

    def __reduce__(self) -> tuple[type[_Request], tuple[()]]:
        return _Request, ()


class TieredSenderCache(BaseSenderCache):
    """``local`` (P0's cache of any mode) with the shared ``remote`` tier behind it (see the
    module's docstring).

    ``publish_queue`` (items) and ``publish_queue_mb`` bound the items waiting for the writer
    thread (beyond either, a processed item is not published: counted); ``prefetch_limit``
    (items) and ``prefetch_limit_mb`` bound the fetched items waiting for their update (the
    oldest is dropped first, e.g. of a request the engine abandoned).  ``claim_ttl_s`` is how
    long a claim lasts unless its holder ends it (see the module's docstring): longer than
    processing and publishing an item take, since past it another host may process the item
    too.  :meth:`close` closes both tiers.

    Thread-safe (see the module's docstring); the request bracket (:meth:`begin_request`,
    :meth:`end_request`) is the calling thread's and is passed on to the local cache.
    """

    def __init__(
        self,
        local: BaseSenderCache,
        remote: RemoteStore,
        *,
        publish_queue: int = 64,
        prefetch_limit: int = 256,
        publish_queue_mb: float = 1024,
        prefetch_limit_mb: float = 1024,
        claim_ttl_s: float = 5.0,
    ) -> None:
        super().__init__()
        if not isinstance(local, BaseSenderCache):  # make_caches' whole pair, a receiver...
            raise TypeError(
                "local must be a P0 cache (ProcessorOnlyCache, SenderCache or ShmSenderCache), "
                f"not {type(local).__qualname__}"
            )
        if not isinstance(remote, RemoteStore):  # a URL, say: else refused at the first lookup
            raise TypeError(
                f"remote must be a RemoteStore(url, namespace=...), not {type(remote).__qualname__}"
            )
        if publish_queue < 1 or prefetch_limit < 1:
            raise ValueError("publish_queue and prefetch_limit must be at least 1")
        # Finite: each is turned into a byte count (an infinite one would not be a bound).
        if not (0 < publish_queue_mb < math.inf and 0 < prefetch_limit_mb < math.inf):
            raise ValueError(
                "publish_queue_mb and prefetch_limit_mb must be positive finite numbers of MiB"
            )
        check_claim_ttl_s(claim_ttl_s)  # the store's, checked here before any claim is taken
        self.local = local
        self.remote = remote
        self.claim_ttl_s = float(claim_ttl_s)
        self.host_id = os.urandom(8).hex()
        """This cache's random id: what its claims in the store hold."""
        self._local_claims = _takes_claims(local)
        self._request: _Request = _Request()  # the calling thread's
        # Under the lock from here on.
        self._claims: dict[str, _Claim] = {}  # hash -> the claim a request of this host holds
        # No claim of `_claims` lapses before this (the earliest lapse of those noted since the
        # lapsed ones were last dropped: ended ones leave it earlier than it need be).
        self._first_lapse = math.inf
        self._prefetched = Fetched(prefetch_limit, int(prefetch_limit_mb * MiB))
        # The requests that wait for a fetched item (their is_cached found it): it is dropped
        # once the last of them has updated it (or given up).
        self._waiting = Holds(self._prefetched.__contains__, self._prefetched.pop)
        self._counts: Counter[str] = Counter()
        self._publisher = Publisher(
            remote, self.host_id, publish_queue, int(publish_queue_mb * MiB)
        )

    # -- lookups ---------------------------------------------------------------------------

    def is_cached(
        self, mm_hashes: Sequence[str], *, claim: bool = False, wait_s: float = 0.0
    ) -> list[bool]:
        """Cached locally, or found in the remote tier (one batched fetch for all local
        misses of the request; the fetched items wait for :meth:`get_and_update`).

        With ``claim``, each remote miss nobody claimed is claimed for this request until its
        update (or ``release_sender_touches``, ``end_request``, ``close``, or
        ``claim_ttl_s``); with
        ``wait_s``, misses another host claimed are waited for, at most ``wait_s`` seconds
        for the whole call, and reported cached if they arrive; the request holds no claim
        while it waits (here or in the local cache: it claims again after the wait what is
        still missing; see the module's docstring).  Both go to the local cache too where it
        takes them."""
        # Read into a list here: the local cache's lookup would use an iterator up.
        mm_hashes = check_hash_list(mm_hashes)
        # Checked here, whatever the local cache takes: a truthy non-bool would take claims.
        claim, wait_s = flag("claim", claim), wait_seconds(wait_s)
        end = time.monotonic() + wait_s
        local = (
            self.local.is_cached(mm_hashes, claim=claim, wait_s=wait_s)  # type: ignore[call-arg]
            if self._local_claims
            else self.local.is_cached(mm_hashes)
        )
        with self._lock:
            wanted = list(
                dict.fromkeys(
                    h
                    for h, hit in zip(mm_hashes, local, strict=True)
                    if not hit and not self._wait_for_fetched(h) and is_shareable_key(h)
                )
            )
            self._counts["remote_lookups"] += len(wanted)
        if wanted:
            if (claim or wait_s > 0) and self.remote.supports_claims:
                if self._fetch_in_single_flight(wanted, claim, end):
                    local = self._local_hits_again(mm_hashes, local, claim)
            else:
                records = self.remote.get_many(wanted)
                with self._lock:
                    for h, record in zip(wanted, records, strict=True):
                        self._take(h, record)
        with self._lock:
            return [
                hit or self._wait_for_fetched(h) for h, hit in zip(mm_hashes, local, strict=True)
            ]

    def _local_hits_again(
        self, mm_hashes: Sequence[str], local: list[bool], claim: bool
    ) -> list[bool]:
        """The local cache's answer ``local`` of before a wait, as it stands after it: a hit
        evicted during the wait (reported cached, its update would miss) is a local miss as
        the others were, asked of the tier (unless it failed) and, with ``claim``, claimed
        there and in the local cache, though no more waited for."""
        now = [
            hit and self.local.is_cached_item(h) for h, hit in zip(mm_hashes, local, strict=True)
        ]
        gone = dict.fromkeys(
            h for h, was, hit in zip(mm_hashes, local, now, strict=True) if was and not hit
        )
        if gone:
            with self._lock:
                missing = [h for h in gone if not self._wait_for_fetched(h)]
                # Not of a store that just failed (the wait's): it cost the wait one deadline.
                failed = self.remote.last_call_failed
                asked = [h for h in missing if is_shareable_key(h) and not failed]
                self._counts["remote_lookups"] += len(asked)
            found = self._fetch_claiming(asked, claim, set(asked))[0] if asked else set()
            if claim and self._local_claims:
                unfound = [h for h in missing if h not in found]
                self.local.is_cached(unfound, claim=True)  # type: ignore[call-arg]
        return now

    def _wait_for_fetched(self, mm_hash: str) -> bool:
        """Keep the item fetched for ``mm_hash`` until this thread's request has updated it;
        whether there is one (lock held)."""
        self._waiting.take(self._request.holds, mm_hash)
        return mm_hash in self._prefetched

    def _fetch_in_single_flight(self, wanted: list[str], claim: bool, end: float) -> bool:
        """Fetch ``wanted`` (claiming the misses nobody holds, with ``claim``); while another
        host holds some of them, until ``end``: give up the request's claims, wait until
        none of those is held elsewhere, claim again what is still missing (see the module's
        docstring).  Whether it waited."""
        now = time.monotonic()
        with self._lock:
            # Only once one may have lapsed: rebuilt at every lookup, the dict cost each one a
            # pass over every claim the host's requests hold (1.5 ms with 10,000 of them).
            if now >= self._first_lapse:
                self._claims = {h: c for h, c in self._claims.items() if c.lapses > now}
                self._first_lapse = min((c.lapses for c in self._claims.values()), default=math.inf)
        found, elsewhere = self._fetch_claiming(wanted, claim, set(wanted))
        missing = [h for h in wanted if h not in found]
        waited: set[str] = set()  # every miss found held by another host meanwhile
        hits = 0
        did_wait = False
        retaken: set[str] = set()  # the earlier lookups' claims, given up for a wait
        while True:
            with self._lock:
                self._counts["remote_claim_waits"] += len(set(elsewhere) - waited)
            waited.update(elsewhere)
            if not elsewhere or time.monotonic() >= end:
                break
            # A waiter holds no claim, so two requests that claimed each other's items (in
            # turns: vLLM looks a request up once per modality) never wait for each other:
            # every claim of the request goes, its earlier lookups' and the local cache's
            # too, and what is still missing is claimed again after the wait.
            held = self._give_up_remote_claims()
            held_locally = self.local.give_up_claims()
            did_wait = True
            arrived, elsewhere, failed = self._wait_for_others(elsewhere, end)
            hits += len(arrived)
            missing = [h for h in missing if h not in arrived]
            if held_locally:
                self.local.is_cached(held_locally, claim=True)  # type: ignore[call-arg]
            if failed:  # a failing store costs the wait one deadline: nothing is claimed again
                break
            again = missing if claim else []  # this call's misses, to claim again
            retaken.update(held)
            if again or held:
                asked = list(dict.fromkeys([*again, *held]))
                found, contested = self._fetch_claiming(asked, True, set(again), set(held))
                hits += len(found & waited)
                missing = [h for h in missing if h not in found]
                if claim:  # else elsewhere stays what the wait left: its timeouts
                    elsewhere = contested
        if elsewhere:
            # No more waiting, with misses still held elsewhere: the store claimed nothing
            # after such a key in its order (a host that would wait for one holds only keys
            # before it). This host waits no more, so it claims the rest now, asked apart;
            # else nobody held them while it processed them, and others did too.
            with self._lock:
                ours = [h for h in missing if claim and h not in elsewhere]
                unclaimed = [h for h in dict.fromkeys([*ours, *retaken]) if h not in self._claims]
            if unclaimed:
                self._fetch_claiming(unclaimed, True, set(ours), retaken)
        with self._lock:
            self._counts["remote_claim_wait_hits"] += hits
            self._counts["remote_claim_wait_timeouts"] += len(elsewhere)
            self._counts["remote_claim_wait_abandoned"] += len(waited) - hits - len(elsewhere)
        return did_wait

    def _wait_for_others(
        self, held_elsewhere: list[str], end: float
    ) -> tuple[set[str], list[str], bool]:
        """Look ``held_elsewhere`` up again (claiming nothing) with backoff until no other host
        holds any of them, ``end``, or the store fails: those that arrived meanwhile (kept for
        the update), those still held elsewhere (none once the store failed), and whether it
        failed."""
        arrived: set[str] = set()
        delay = _FIRST_POLL_S
        # This thread's latest call: the release of its claims before the wait, else the
        # lookup that found the claims, which answered.
        failed = self.remote.last_call_failed
        while held_elsewhere and not failed and (left := end - time.monotonic()) > 0:
            time.sleep(min(delay, left))
            delay = min(delay * 2, _MAX_POLL_S)
            found, held_elsewhere = self._fetch_claiming(held_elsewhere, False, set(held_elsewhere))
            arrived |= found
            failed = self.remote.last_call_failed
        return arrived, [] if failed else held_elsewhere, failed

    def _fetch_claiming(
        self,
        hashes: list[str],
        claim: bool,
        ours: Container[str],
        retaking: Container[str] = (),
    ) -> tuple[set[str], list[str]]:
        """One claiming lookup of ``hashes``: notes the claims it took (those on ``retaking``,
        given up for a wait, are not counted again) and, of ``ours`` (the hashes the call asks
        about, not an earlier lookup's claims taken again), keeps what it found for the coming
        update; those of ``ours`` it found, and those of ``ours`` another host holds."""
        results = self.remote.fetch_or_claim(
            hashes, self.host_id, claim=claim, claim_ttl_s=self.claim_ttl_s
        )
        # A failed lookup names this host the holder of claims it may have taken: noted, so
        # that they are released, but not counted as taken.
        failed = self.remote.last_call_failed
        found: set[str] = set()
        elsewhere: list[str] = []
        with self._lock:
            for h, (record, holder) in zip(hashes, results, strict=True):
                if h in ours and self._take(h, record):
                    found.add(h)
                elif holder == self.host_id:
                    if claim:
                        self._note_claim(h, counted=h not in retaking and not failed)
                elif holder is not None and h in ours:
                    elsewhere.append(h)
        return found, elsewhere

    def _note_claim(self, mm_hash: str, counted: bool = True) -> None:
        """The store says this host holds the claim on ``mm_hash``: this thread's request's
        now, unless a request of this host holds it already (this one, or another, which
        is never waited on: this request processes the item too, without a claim); counted
        in ``remote_claims`` unless not ``counted`` (taken again after a wait).  Lock held."""
        now = time.monotonic()
        current = self._claims.get(mm_hash)
        if current is not None and current.lapses > now:
            return
        self._counts["remote_claims"] += counted
        claim = self._claims[mm_hash] = _Claim(now + self.claim_ttl_s)
        self._first_lapse = min(self._first_lapse, claim.lapses)
        self._request.claims[mm_hash] = claim

    def _take(self, mm_hash: str, record: Item | None) -> bool:
        """Keep the fetched ``record`` of ``mm_hash`` until this thread's request has updated
        it; whether there was one (lock held)."""
        entry = self._unwrap(mm_hash, record)
        if entry is None:
            return False
        dropped = self._prefetched.add(mm_hash, entry)
        for h in dropped:
            self._waiting.forget(h)
        self._counts["remote_prefetch_dropped"] += len(dropped)
        self._waiting.take(self._request.holds, mm_hash)
        return True

    def is_cached_item(self, mm_hash: str) -> bool:
        """Cached locally, or fetched from the remote tier for the coming update (no network
        call: :meth:`is_cached` is the one that asks the remote tier)."""
        # No lock: one lookup in a dict, atomic by itself (the answer may be stale anyway).
        return self.local.is_cached_item(mm_hash) or mm_hash in self._prefetched

    def fetched(self, mm_hash: str) -> tuple[Item, Any] | None:
        """The ``(item, prompt_updates)`` :meth:`is_cached` fetched for ``mm_hash`` and the
        coming update will use, or ``None`` (to inspect or check it; do not modify it)."""
        with self._lock:
            return self._prefetched.get(mm_hash)

    # -- updates ---------------------------------------------------------------------------

    def get_and_update(
        self, items: Sequence[SenderInput], mm_hashes: Sequence[str]
    ) -> list[SenderOutput]:
        # Before the zips below, which would read one item's field names as items.
        items = check_item_list(items, "get_and_update")
        mm_hashes = check_hash_list(mm_hashes, "get_and_update")
        if len(items) != len(mm_hashes):
            raise ValueError(f"{len(items)} items but {len(mm_hashes)} mm_hashes")
        return self._update(
            items, mm_hashes, lambda inputs: self.local.get_and_update(inputs, mm_hashes)
        )

    def get_and_update_item(self, item: SenderInput, mm_hash: str) -> SenderOutput:
        return self._update(
            [item], [mm_hash], lambda inputs: self.local.get_and_update_item(inputs[0], mm_hash)
        )

    def _update(
        self,
        items: Sequence[SenderInput],
        mm_hashes: Sequence[str],
        update: Callable[[list[SenderInput]], _T],
    ) -> _T:
        """``update`` the local cache with the inputs it gets for ``items`` (fetched items
        where the engine passed ``None`` for a remote hit), publish what P0 processed and end
        this request's claims on ``mm_hashes``, and any request's claim on an item it
        publishes: once the item is stored if a put of it is pending (this update's, or
        another's), else at once.

        The local cache gets the fetched item even if it holds the hash meanwhile (another
        thread's update put it there): for a cached hash it is a hit all the same, and an
        item evicted in between is taken in again rather than missed."""
        with self._lock:
            inputs = [
                item if item is not None else self._prefetched.get(h)
                for item, h in zip(items, mm_hashes, strict=True)
            ]
            ended = self._end_claims(mm_hashes)
        fresh = self._fresh(items, mm_hashes)
        try:
            result = update(inputs)
        except BaseException:  # the fetched items stay for the retry
            self._release_claims(ended)
            raise
        with self._lock:
            for item, h in zip(items, mm_hashes, strict=True):
                if item is None:
                    self._counts["remote_served"] += self._prefetched.served(h)
            if not self._request.open:  # else a later update of the request may need them
                for h in mm_hashes:
                    self._waiting.give(self._request.holds, h)
        # Sized by the item alone: prompt updates never count (any picklable object, a
        # self-referring one too, which item_size would recurse into without end).
        queued = [
            h
            for h, (item, prompt_updates) in fresh.items()
            if self._publishable_updates(h, prompt_updates)
            and self._publisher.submit(
                h, {"item": item, "prompt_updates": prompt_updates}, size=item_size(item)
            )
        ]
        with self._lock:  # a stored item needs no claim: another request's on it ends too
            # Only what was queued: a dropped item is counted as dropped, not published.
            self._counts["remote_published"] += len(queued)
            for h in queued:
                if h not in ended and (claim := self._claims.get(h)) is not None:
                    ended[h] = claim
        self._release_claims(ended)
        return result

    def _publishable_updates(self, mm_hash: str, prompt_updates: Any) -> bool:
        """Whether the item codec gives ``prompt_updates`` back as they are (the ring's plain
        codec's test): it gives a subclass back as its base type (a namedtuple as a tuple, an
        IntEnum as an int), and refuses other objects.  Those keep the item local, counted
        and logged as the store counts what the codec refuses."""
        if comes_back_as_is(prompt_updates):
            return True
        self.remote._fault(
            "unencodable",
            f"item {mm_hash} is kept from the remote tier: its prompt updates are not plain "
            "data of exactly the types the item codec gives back (an object, a namedtuple or "
            "an IntEnum would come back as something else)",
        )
        return False

    def _end_claims(self, mm_hashes: Iterable[str]) -> dict[str, _Claim]:
        """This thread's request lets go of its claims on ``mm_hashes``: those that are still
        this host's claims, for the caller to :meth:`_release_claims` (lock held).  They stay
        this host's until then, so no other request takes them for its own meanwhile, and
        :meth:`close` releases them if it runs first."""
        mine = self._request.claims
        ended: dict[str, _Claim] = {}
        for h in dict.fromkeys(mm_hashes):
            claim = mine.pop(h, None)
            if claim is not None and self._claims.get(h) is claim:
                ended[h] = claim
        return ended

    def _release_claims(self, ended: Mapping[str, _Claim]) -> None:
        """Release ``ended`` in the store (once the put of the item returned, where one is
        pending), then forget those :meth:`close` has not taken meanwhile.  Lock not held."""
        if not ended:
            return
        self.remote.release_claims(self._publisher.release_after_put(list(ended)), self.host_id)
        with self._lock:
            for h, claim in ended.items():
                if self._claims.get(h) is claim:
                    del self._claims[h]

    def _fresh(
        self, items: Sequence[SenderInput], mm_hashes: Sequence[str]
    ) -> dict[str, tuple[Item, Any]]:
        """The items P0 processed for this update (data for a hash not cached locally)."""
        fresh: dict[str, tuple[Item, Any]] = {}
        for item, h in zip(items, mm_hashes, strict=True):
            if (
                isinstance(item, tuple | list)
                and len(item) == 2
                and isinstance(item[0], Mapping)
                and is_shareable_key(h)
                and not self.local.is_cached_item(h)
            ):
                fresh[h] = (item[0], item[1])
        return fresh

    def _unwrap(self, mm_hash: str, record: Item | None) -> tuple[Item, Any] | None:
        if record is None:
            return None
        item = record.get("item")
        if set(record) != {"item", "prompt_updates"} or not isinstance(item, Mapping):
            self._counts["remote_malformed"] += 1
            return None
        return item, record["prompt_updates"]

    # -- the request bracket ---------------------------------------------------------------

    def begin_request(self) -> None:
        """Open the calling thread's request here and in the local cache (see
        :meth:`BaseCache.begin_request <mmcache.caches.BaseCache.begin_request>`): the items
        it touches stay protected locally, and the items fetched for it stay here, until
        :meth:`end_request`."""
        super().begin_request()
        try:
            self.local.begin_request()
        except BaseException:
            with self._lock:
                self._request.open = False
            raise

    def end_request(self) -> None:
        """Close the calling thread's request here and in the local cache (a no-op when
        none is open).  Its claims end too: an item it claimed and never updated (the
        request raised) would otherwise stay claimed, and be claimed again by the thread's
        next request before a wait, while nobody processes it."""
        if self._request.open:
            super().end_request()
            self.local.end_request()
            self._give_up_remote_claims()

    def _end_request(self, keys: Sequence[str] | None) -> None:
        self._waiting.give_all(self._request.holds)

    # -- the rest of a P0 cache ------------------------------------------------------------

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self.local.touch_sender_cache_item(mm_hash)

    def release_sender_touches(self) -> None:
        """The local cache's; and this thread's request gives up what it had here: its
        claims end, its fetched items are no longer kept for it (their updates will never
        come)."""
        self.local.release_sender_touches()
        with self._lock:
            self._waiting.give_all(self._request.holds)
        self._give_up_remote_claims()

    def give_up_claims(self) -> list[str]:
        """The local cache's; and this thread's request gives up its claims in the store
        (released at once, or once a pending put of the item returned); the hashes it held
        in either."""
        return list(dict.fromkeys([*self.local.give_up_claims(), *self._give_up_remote_claims()]))

    def _give_up_remote_claims(self) -> list[str]:
        """This thread's request gives up its claims in the store; the hashes it held."""
        with self._lock:
            ended = self._end_claims(list(self._request.claims))
        self._release_claims(ended)
        return list(ended)

    def invalidate(self, mm_hash: str) -> None:
        """Forget ``mm_hash`` locally (the remote value stays: it is still that item)."""
        with self._lock:
            self._prefetched.pop(mm_hash)
            self._waiting.forget(mm_hash)
        self.local.invalidate(mm_hash)

    def clear_cache(self) -> None:
        """Clear the local cache (the remote tier is shared: it is not cleared)."""
        with self._lock:
            self._prefetched.clear()
            self._waiting.forget_all()
        self.local.clear_cache()

    def make_stats(self, *, delta: bool = False) -> CacheInfo:
        """The local cache's hit statistics."""
        return self.local.make_stats(delta=delta)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every published item has been put (at most ``timeout_s`` seconds);
        whether all were."""
        return self._publisher.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (waiting at most ``timeout_s``; what is still queued then
        is dropped, counted in ``remote_publish_dropped``), end the claims every
        request of this host holds (an update in flight's included), then close the local
        cache and the remote store.  Idempotent.

        Other threads may still be calling in: from then on the store answers their lookups
        misses, and nothing they process is published or claimed; the local cache answers
        them as it does once closed.  A claim that a lookup still in flight takes in the store
        after this lapses (``claim_ttl_s``), like a dead host's."""
        self._publisher.close(timeout_s)
        with self._lock:
            claimed = list(self._claims)
            self._claims.clear()
        self.remote.release_claims(claimed, self.host_id)
        self.local.close()
        self.remote.close()

    def stats(self) -> dict[str, int]:
        """The local cache's counters, this tier's (``remote_served``: fetched items handed to
        the local cache, each counted once however many requests used it,
        ``remote_lookups``, ``remote_published`` (processed items queued for the writer
        thread; those a full queue turned away, or :meth:`close` found still queued, are
        ``remote_publish_dropped``),
        ``remote_publish_failed``, ``remote_prefetch_dropped``, ``remote_malformed``; single
        flight: ``remote_claims`` taken, ``remote_claim_waits`` (misses found claimed by
        another host and waited for), of which ``remote_claim_wait_hits`` arrived in time,
        ``remote_claim_wait_abandoned`` lost their claim without arriving (the claimer gave
        up or died, or the store failed) and ``remote_claim_wait_timeouts`` were still
        claimed when the wait ended; each of those two was processed here) and the store's
        counters as ``remote_*`` (``remote_claims_released``; its latencies:
        ``remote.stats()``)."""
        with self._lock:
            own = {
                k: self._counts[k]
                for k in (
                    "remote_served",
                    "remote_lookups",
                    "remote_published",
                    "remote_prefetch_dropped",
                    "remote_malformed",
                    "remote_claims",
                    "remote_claim_waits",
                    "remote_claim_wait_hits",
                    "remote_claim_wait_abandoned",
                    "remote_claim_wait_timeouts",
                )
            }
        own["remote_publish_dropped"] = self._publisher.dropped
        own["remote_publish_failed"] = self._publisher.failed
        store = {f"remote_{k}": int(v) for k, v in self.remote.stats(latencies=False).items()}
        return {**self.local.stats(), **store, **own}
