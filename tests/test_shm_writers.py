"""Several P0 caches on one ring (SPEC §3.9): ``ShmSenderCache(..., max_writers=N)``,
``writer_handle()`` and ``ShmSenderCache.join``, with real processes (spawned and forked):

- a joined cache in another process hits the items the first one put, with the prompt updates
  the putting writer gave, and the other way round; readers resolve both writers' handles to
  the tensors put (every one checked);
- prompt updates travel with the item, plain data by default, pickled or through the engine's
  own pair only when asked; an item whose prompt updates a writer cannot decode is not cached
  for it, and its update issues a handle to the stored object; a key evicted (or
  invalidated) and put again by another writer gives that writer's updates;
- single flight: a claim in one process makes the other wait for its put (one process
  processes the item); a claimer killed with SIGKILL voids its claim at once; claims end with
  the update, an item served uncached, ``release_sender_touches`` and a request that raised;
  a writer never waits on its own claims, nor two requests that claimed each other's items
  on each other;
- threads of several processes hammer one small ring with claims and waits while a reader
  checks every handle;
- ``NoWriterSlotError``, the last close unlinks, ``make_caches(max_writers=)``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from item_checks import same_item
from mmcache import (
    CacheMissError,
    NoWriterSlotError,
    ShmHandle,
    ShmReceiverCache,
    ShmSenderCache,
    WriterHandle,
    _core,
    make_caches,
)

TIMEOUT = 120  # seconds to wait for a child's answer (a hang fails the test, not CI)
NEVER = 3600.0  # a wait_s no test may sit out: only a claim that ends can end the wait

CONTEXTS = ["spawn", "fork"]


pytestmark = pytest.mark.usefixtures("hang_deadline")


def item(key: str, n: int = 256) -> dict[str, torch.Tensor]:
    """The item every writer computes for ``key`` (its values depend on the key)."""
    seed = sum(key.encode()) * 7919 + len(key)
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n + seed % 97, generator=gen), "i": torch.tensor([seed])}


def updates(key: str, writer: str) -> list[Any]:
    """Plain prompt updates naming the key and the writer that computed them."""
    return [("key", key), {"writer": writer, "n": len(key)}, None, 1.5, b"\x00"]


@dataclasses.dataclass(frozen=True)
class PromptUpdate:
    """Prompt updates as vLLM has them: objects, which only pickle carries."""

    key: str
    writer: str


def recv(conn: Any) -> Any:
    assert conn.poll(TIMEOUT), "the child process did not answer"
    return conn.recv()


def check_handle(reader: ShmReceiverCache, data: Any, key: str, n: int = 256) -> None:
    """``data`` is a handle: the reader resolves it to ``key``'s item, bit for bit."""
    assert isinstance(data, ShmHandle), f"{key}: expected a handle, got {type(data)}"
    assert same_item(reader.get_and_update_item(data, key), item(key, n)), key


# -- a second writer in another process ------------------------------------------------------


@contextlib.contextmanager
def two_writers_and_a_reader() -> Iterator[tuple[ShmSenderCache, ShmSenderCache, ShmReceiverCache]]:
    """Writers `a` and `b` of one small ring, and a reader of it."""
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        yield a, b, reader


def put_checked(writer: ShmSenderCache, reader: ShmReceiverCache, key: str, who: str) -> None:
    """`writer` puts `key`'s item with `who`'s updates, and `reader` resolves its handle."""
    handle, got = writer.get_and_update_item((item(key), updates(key, who)), key)
    assert got == updates(key, who)
    check_handle(reader, handle, key)


def _joined_writer(handle: WriterHandle, conn: Any) -> None:
    """Join, hit the parent's item, put one of its own, report, and close when told."""
    cache = ShmSenderCache.join(handle)
    try:
        seen = cache.is_cached(["p0-item", "p1-item"])
        hit = cache.get_and_update_item(None, "p0-item")
        put = cache.get_and_update_item((item("p1-item"), updates("p1-item", "p1")), "p1-item")
        conn.send((seen, hit, put, tuple(cache.make_stats())))
        recv(conn)  # the parent hit our item
        conn.send(tuple(cache.make_stats()))
    finally:
        cache.close()
    conn.send("closed")


@pytest.mark.parametrize("method", CONTEXTS)
def test_joined_writer_in_another_process(method: str) -> None:
    ctx = mp.get_context(method)
    with (
        ShmSenderCache(0.02, max_writers=2) as p0,
        ShmReceiverCache(p0.handle()) as reader,
    ):
        p0_out = p0.get_and_update_item((item("p0-item"), updates("p0-item", "p0")), "p0-item")
        check_handle(reader, p0_out[0], "p0-item")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_joined_writer, args=(p0.writer_handle(), child))
        proc.start()
        try:
            seen, (hit, hit_updates), (put, put_updates), child_stats = recv(parent)
            assert seen == [True, False]
            assert hit_updates == updates("p0-item", "p0"), "the putting writer's updates"
            assert put_updates == updates("p1-item", "p1")
            check_handle(reader, hit, "p0-item")
            check_handle(reader, put, "p1-item")
            assert child_stats == (1, 2), "a writer counts its own calls"
            # The parent hits the child's item, with the child's prompt updates.
            assert p0.is_cached_item("p1-item")
            p0.touch_sender_cache_item("p1-item")
            again, again_updates = p0.get_and_update_item(None, "p1-item")
            assert again_updates == updates("p1-item", "p1")
            check_handle(reader, again, "p1-item")
            assert tuple(p0.make_stats()) == (1, 2)
            store = p0.stats()
            assert store["store_puts"] == 2 and store["store_writers_attached"] == 2, store
            parent.send("go")
            assert recv(parent) == (1, 2), "the parent's hits are not the child's"
            assert recv(parent) == "closed"
        finally:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0
        # The child's item outlives the child; the segment lives while a writer lives.
        assert p0.is_cached_item("p1-item")
        assert p0.name in _core.list_segments()
        name = p0.name
    assert name not in _core.list_segments(), "the last writer to close unlinked it"


def test_last_close_unlinks_and_slots_run_out() -> None:
    first = ShmSenderCache(0.01, max_writers=2)
    handle = pickle.loads(pickle.dumps(first.writer_handle()))
    second = ShmSenderCache.join(handle)
    assert second.max_writers == 2 and second.name == first.name
    with pytest.raises(NoWriterSlotError, match="max_writers=2"):
        ShmSenderCache.join(handle)
    with pytest.raises(TypeError, match="WriterHandle"):
        ShmSenderCache.join(first.handle())  # type: ignore[arg-type]
    first.get_and_update_item((item("a"), None), "a")
    first.close()
    assert first.name in _core.list_segments(), "the joined writer still uses it"
    assert second.is_cached_item("a"), "items stay cached after their writer closed"
    third = ShmSenderCache.join(handle)  # the slot the first one left
    second.close()
    assert first.name in _core.list_segments()
    third.close()
    assert first.name not in _core.list_segments(), "the last writer to close unlinked it"


def test_clear_and_invalidate_reach_every_writer() -> None:
    with ShmSenderCache(0.01, max_writers=2) as a, ShmSenderCache.join(a.writer_handle()) as b:
        for key in ("x", "y"):
            handle, _ = a.get_and_update_item((item(key), updates(key, "a")), key)
            a.release_handles([handle])
        assert b.is_cached(["x", "y"]) == [True, True]
        b.invalidate("x")
        assert not a.is_cached_item("x") and a.is_cached_item("y")
        b.clear_cache()
        assert a.is_cached(["x", "y"]) == [False, False]


def test_make_caches_max_writers() -> None:
    p0, downstream = make_caches("shm", capacity_gb=0.01, max_writers=3)
    assert isinstance(p0, ShmSenderCache) and p0.max_writers == 3
    with p0, ShmSenderCache.join(p0.writer_handle()) as joined:
        assert joined.name == p0.name
        assert isinstance(downstream, _core.ReaderHandle) and downstream.name == p0.name


# -- prompt updates travel with the item -----------------------------------------------------


def test_unshareable_updates_are_not_cached_for_other_writers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """By default nothing is pickled: an object the plain codec cannot hold stays with its
    writer, the others process the item, and their update issues the stored object."""
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        mine = PromptUpdate("k", "a")
        put, put_updates = a.get_and_update_item((item("k"), mine), "k")
        assert put_updates is mine and a.is_cached_item("k"), "the putting writer keeps them"
        assert a.stats()["unshared_prompt_updates"] == 1
        assert "prompt_updates_codec='pickle'" in caplog.text
        assert b.is_cached(["k"]) == [False], "b cannot have the updates: it processes"
        with pytest.raises(CacheMissError):
            b.get_and_update([None], ["k"])
        theirs = PromptUpdate("k", "b")
        hit, hit_updates = b.get_and_update_item((item("k"), theirs), "k")
        assert hit_updates is theirs
        assert hit.monotonic_id == put.monotonic_id, "a handle to the stored object"
        assert b.stats()["store_puts"] == 1
        assert b.is_cached_item("k"), "b now has updates for that object"
        for handle in (put, hit):
            check_handle(reader, handle, "k")


def test_only_puts_count_as_unshared_prompt_updates(caplog: pytest.LogCaptureFixture) -> None:
    """``unshared_prompt_updates`` counts puts (and the warning names a put): data sent for
    an item another writer stored is a hit, and an item served uncached is put nowhere."""
    with (
        ShmSenderCache(0.01, max_writers=2, max_object_size_mb=0.5) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        put, _ = a.get_and_update_item((item("k"), updates("k", "a")), "k")
        hit, _ = b.get_and_update_item((item("k"), PromptUpdate("k", "b")), "k")
        assert hit.monotonic_id == put.monotonic_id, "a hit, not a put"
        big = {"x": torch.zeros(1 << 20, dtype=torch.uint8)}
        data, _ = b.get_and_update_item((big, PromptUpdate("big", "b")), "big")
        assert data is big and b.stats()["uncached_oversize"] == 1
        assert b.stats()["unshared_prompt_updates"] == 0
        assert "cannot be shared" not in caplog.text
        b.get_and_update_item((item("m"), PromptUpdate("m", "b")), "m")
        assert b.stats()["unshared_prompt_updates"] == 1 and "cannot be shared" in caplog.text
        a.release_handles([put])
        b.release_handles([hit])


@pytest.mark.parametrize(
    "codec",
    ["pickle", (lambda u: json.dumps(dataclasses.asdict(u)).encode(), json.loads)],
    ids=["pickle", "pair"],
)
def test_opt_in_codecs(codec: Any) -> None:
    with (
        ShmSenderCache(0.01, max_writers=3, prompt_updates_codec=codec) as a,
        ShmSenderCache.join(a.writer_handle(), prompt_updates_codec=codec) as b,
        ShmSenderCache.join(a.writer_handle()) as plain,
        ShmReceiverCache(a.handle()) as reader,
    ):
        a.get_and_update_item((item("k"), PromptUpdate("k", "a")), "k")
        plain.get_and_update_item((item("plain"), updates("plain", "plain")), "plain")
        assert b.is_cached(["k", "plain"]) == [True, True]
        handle, got = b.get_and_update_item(None, "k")
        want = PromptUpdate("k", "a")
        assert got == (want if codec == "pickle" else dataclasses.asdict(want))
        check_handle(reader, handle, "k")
        # Plain ones are read by every writer; a writer that did not opt in never decodes
        # the others.
        handle, got = b.get_and_update_item(None, "plain")
        assert got == updates("plain", "plain")
        check_handle(reader, handle, "plain")
        assert plain.is_cached(["k", "plain"]) == [False, True]
    with pytest.raises(ValueError, match="prompt_updates_codec"):
        ShmSenderCache(0.01, prompt_updates_codec="json")  # type: ignore[arg-type]


def test_reput_key_gives_the_new_objects_updates() -> None:
    """A key evicted (or invalidated) and put again by another writer never comes back with
    the first object's prompt updates."""
    with (
        ShmSenderCache(1 / 1024, max_writers=2, max_object_size_mb=0.1) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        handle, _ = a.get_and_update_item((item("k"), updates("k", "a")), "k")
        check_handle(reader, handle, "k")
        # Evicted by b's puts (each handle read, so nothing stays protected).
        n = 0
        while a.is_cached_item("k"):
            key = f"filler-{n}"
            n += 1
            filler, _ = b.get_and_update_item((item(key, 4096), None), key)
            assert same_item(reader.get_and_update_item(filler, key), item(key, 4096))
            assert n < 1000, "the ring never evicted k"
        handle, _ = b.get_and_update_item((item("k"), updates("k", "b")), "k")
        check_handle(reader, handle, "k")
        assert a.is_cached_item("k")
        handle, got = a.get_and_update_item(None, "k")
        assert got == updates("k", "b"), "the new object's updates"
        check_handle(reader, handle, "k")
        # Invalidated and put again: the same.
        a.invalidate("k")
        handle, _ = b.get_and_update_item((item("k"), updates("k", "b2")), "k")
        check_handle(reader, handle, "k")
        handle, got = a.get_and_update_item(None, "k")
        assert got == updates("k", "b2")
        check_handle(reader, handle, "k")


def test_reput_with_unshareable_updates_never_gives_the_old_ones() -> None:
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle(), prompt_updates_codec="pickle") as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        handle, _ = a.get_and_update_item((item("k"), updates("k", "a")), "k")
        check_handle(reader, handle, "k")
        b.invalidate("k")
        handle, _ = b.get_and_update_item((item("k"), PromptUpdate("k", "b")), "k")
        check_handle(reader, handle, "k")
        # Not cached for `a` (it cannot decode the new object's updates, and those it kept
        # are the old object's), and its lookup says so as its hit does.
        assert not a.is_cached_item("k") and a.is_cached(["k"]) == [False]
        with pytest.raises(CacheMissError):
            a.get_and_update([None], ["k"])
        handle, got = a.get_and_update_item((item("k"), updates("k", "a2")), "k")
        assert got == updates("k", "a2")
        check_handle(reader, handle, "k")


def test_an_update_after_another_writer_reput_the_key_gives_the_new_objects_updates() -> None:
    # `a` learnt "k"'s updates (its lookup), then `b` invalidated "k" and put it again with
    # other updates before `a`'s touch and update: `a`'s hit issues the new object, so it
    # must give the new object's updates, not those it kept for the old one.
    with two_writers_and_a_reader() as (a, b, reader):
        put_checked(a, reader, "k", "a")
        assert a.is_cached(["k"]) == [True]
        b.invalidate("k")
        put_checked(b, reader, "k", "b")
        a.begin_request()
        a.touch_sender_cache_item("k")
        handle, got = a.get_and_update_item(None, "k")
        a.end_request()
        assert got == updates("k", "b"), "the updates kept for the old object"
        check_handle(reader, handle, "k")
        assert a.stats()["store_pinned"] == 0


def test_an_update_unpins_only_the_object_its_touch_pinned() -> None:
    # `a`'s request pinned "k"'s first object; `b` replaced it; another request of `a` (another
    # thread) pinned the new one. The first request's update must undo its own pin (of an
    # object gone), never the other request's pin of the new object.
    with two_writers_and_a_reader() as (a, b, reader):
        put_checked(a, reader, "k", "a")
        a.touch_sender_cache_item("k")
        b.invalidate("k")
        put_checked(b, reader, "k", "b")
        pinned, updated = threading.Event(), threading.Event()

        def other_request() -> None:
            a.touch_sender_cache_item("k")
            pinned.set()
            assert updated.wait(TIMEOUT)
            a.release_sender_touches()  # this request is abandoned

        other = threading.Thread(target=other_request)
        other.start()
        try:
            assert pinned.wait(TIMEOUT)
            assert a.stats()["store_pinned"] == 1, "the other request's pin of the new object"
            handle, got = a.get_and_update_item(None, "k")
            assert got == updates("k", "b")
            check_handle(reader, handle, "k")
            assert a.stats()["store_pinned"] == 1, "the update undid another request's pin"
        finally:
            updated.set()
            other.join(TIMEOUT)
        assert a.stats()["store_pinned"] == 0


def test_a_saturated_hit_on_an_object_another_writer_reput_gives_its_updates() -> None:
    # A worker that never reads holds every reference its slot counts to "k"'s object, which
    # `b` put after `a`'s (of other updates) was invalidated: `a` serves the item uncached,
    # from what the ring holds, so with the updates stored with it, not those `a` kept.
    max_outstanding = (1 << 20) - 1
    with two_writers_and_a_reader() as (a, b, stuck):
        a.get_and_update_item((item("k"), updates("k", "a")), "k")
        b.invalidate("k")
        b.get_and_update_item((item("k"), updates("k", "b")), "k")
        for _ in range(max_outstanding - 1):
            b._store.issue("k")
        data, got = a.get_and_update_item(None, "k")
        assert a.stats()["uncached_saturated"] == 1
        assert same_item(data, item("k"))
        assert got == updates("k", "b"), "the updates kept for the old object"
        assert stuck.get_and_update_item(data, "k") is data  # (plain data: passed through)


def test_prompt_updates_too_large_to_share_stay_with_the_writer_that_put_them() -> None:
    # Plain data the codec encodes, but over the store's metadata limit: the item is put
    # without them (not shareable), never refused.
    huge = [("key", "k"), b"\x01" * (1 << 20)]
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        handle, got = a.get_and_update_item((item("k"), huge), "k")
        assert got is huge and a.stats()["unshared_prompt_updates"] == 1
        check_handle(reader, handle, "k")
        handle, got = a.get_and_update_item(None, "k")
        assert got == huge
        check_handle(reader, handle, "k")
        assert not b.is_cached_item("k"), "b cannot have a's updates"


class Modality(enum.IntEnum):
    IMAGE = 1


Span = collections.namedtuple("Span", "start length")


@pytest.mark.parametrize(
    "given",
    [
        [Span(3, 5)],
        {"modality": Modality.IMAGE},
        collections.defaultdict(list, {"image": [0, 4]}),
        collections.OrderedDict(a=1),
    ],
    ids=["namedtuple", "IntEnum", "defaultdict", "OrderedDict"],
)
def test_plain_prompt_updates_of_a_subclass_are_not_shared_as_their_base(given: Any) -> None:
    """The plain codec gives a subclass back as its base type (a namedtuple as a tuple):
    such prompt updates are not shareable, so the other writer processes the item itself
    rather than get other objects."""
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        assert a.get_and_update_item((item("k"), given), "k")[1] is given
        assert b.is_cached(["k"]) == [False] and a.stats()["unshared_prompt_updates"] == 1
        _, got = b.get_and_update_item((item("k"), given), "k")
        assert got is given


def test_a_key_put_by_another_writer_meanwhile_is_issued() -> None:
    """The engine processed a miss while another writer put the same key: the update issues
    the stored object instead of failing on the duplicate."""
    with (
        ShmSenderCache(0.01, max_writers=2, prompt_updates_codec="pickle") as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        assert b.is_cached(["k"]) == [False]
        put, _ = a.get_and_update_item((item("k"), PromptUpdate("k", "a")), "k")
        hit, got = b.get_and_update_item((item("k"), updates("k", "b")), "k")
        assert got == updates("k", "b") and hit.monotonic_id == put.monotonic_id
        assert b.stats()["store_puts"] == 1
        for handle in (put, hit):
            check_handle(reader, handle, "k")


def test_a_lost_race_whose_winner_is_gone_again_puts_anew() -> None:
    """The engine processed a miss while another writer put the same key, and that object was
    dropped again before this writer looked: the update stores its own item (no duplicate-key
    error reaches the engine)."""
    with (
        ShmSenderCache(0.01, max_writers=2, prompt_updates_codec="pickle") as a,
        ShmSenderCache.join(a.writer_handle()) as b,
        ShmReceiverCache(a.handle()) as reader,
    ):
        store = a._store
        put_item = store.put_item
        raced = []

        class Racing:
            """``a``'s writer, but ``b`` stores the key just before ``a``'s first put and
            drops it just after."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def put_item(self, key: str, data: Any, *, meta: bytes = b"") -> ShmHandle:
                if not raced:
                    raced.append(b.get_and_update_item((item(key), updates(key, "b")), key))
                    try:
                        return put_item(key, data, meta=meta)
                    finally:
                        b.invalidate(key)
                return put_item(key, data, meta=meta)

        a._store = Racing()
        try:
            handle, got = a.get_and_update_item((item("k"), updates("k", "a")), "k")
        finally:
            a._store = store
        assert raced and got == updates("k", "a")
        assert a.stats()["store_puts"] == 2
        b.release_handles([raced[0][0]])
        check_handle(reader, handle, "k")


# -- single flight ---------------------------------------------------------------------------


def _claimer(handle: WriterHandle, conn: Any, put: bool) -> None:
    """Claim "new", report, then (told to) put it, or (``put=False``) wait to be killed."""
    cache = ShmSenderCache.join(handle)
    conn.send(cache.is_cached(["new", "old"], claim=True))
    recv(conn)
    if put:
        out = cache.get_and_update_item((item("new"), updates("new", "claimer")), "new")
        conn.send(out)
    else:
        time.sleep(NEVER)
    cache.close()


@pytest.mark.parametrize("method", CONTEXTS)
def test_single_flight_across_processes(method: str) -> None:
    ctx = mp.get_context(method)
    with (
        ShmSenderCache(0.02, max_writers=2) as p0,
        ShmReceiverCache(p0.handle()) as reader,
    ):
        old, _ = p0.get_and_update_item((item("old"), updates("old", "p0")), "old")
        check_handle(reader, old, "old")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_claimer, args=(p0.writer_handle(), child, True))
        proc.start()
        try:
            assert recv(parent) == [False, True]
            assert p0.stats()["store_claims"] == 1
            # Claimed elsewhere: not claimed here, and waited for until it is put.
            results: list[list[bool]] = []
            waiter = threading.Thread(
                target=lambda: results.append(p0.is_cached(["new"], claim=True, wait_s=NEVER))
            )
            waiter.start()
            parent.send("go")
            handle, got = recv(parent)
            waiter.join(TIMEOUT)
            assert not waiter.is_alive() and results == [[True]]
            assert got == updates("new", "claimer")
            p0.touch_sender_cache_item("new")
            hit, hit_updates = p0.get_and_update_item(None, "new")
            assert hit_updates == updates("new", "claimer")
            stats = p0.stats()
            assert stats["store_puts"] == 2 and stats["store_claims"] == 0, stats
            for h in (handle, hit):
                check_handle(reader, h, "new")
        finally:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0


@pytest.mark.parametrize("method", CONTEXTS)
def test_a_dead_claimers_claim_is_void_at_once(method: str) -> None:
    ctx = mp.get_context(method)
    with ShmSenderCache(0.02, max_writers=2) as p0:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_claimer, args=(p0.writer_handle(), child, False))
        proc.start()
        try:
            assert recv(parent) == [False, False]
            results: list[list[bool]] = []
            waiter = threading.Thread(
                target=lambda: results.append(p0.is_cached(["new"], claim=True, wait_s=NEVER))
            )
            waiter.start()
            os.kill(proc.pid, signal.SIGKILL)
            # Only the claim's end can end a wait of NEVER seconds: it ends at the death.
            waiter.join(TIMEOUT)
            assert not waiter.is_alive(), "the waiter sat out the dead writer's claim"
            assert results == [[False]], "not put: this writer processes it"
        finally:
            proc.join(TIMEOUT)
        # The waiter took the claim over: the item is processed once, here.
        assert p0.stats()["store_claims"] == 1
        p0.get_and_update_item((item("new"), updates("new", "p0")), "new")
        assert p0.stats()["store_claims"] == 0


def test_claims_end_with_the_request() -> None:
    with (
        ShmSenderCache(0.01, max_writers=2, max_object_size_mb=0.01) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        assert a.is_cached(["big", "gone", "raised"], claim=True) == [False] * 3
        assert a.stats()["store_claims"] == 3
        assert b.is_cached(["big"], claim=True) == [False], "a holds it"
        # Served uncached (too large): the claim is given up.
        data, _ = a.get_and_update_item((item("big", 1 << 14), None), "big")
        assert isinstance(data, dict) and a.stats()["uncached_oversize"] == 1
        assert a.stats()["store_claims"] == 2
        # A request that raised ends its items' claims ("gone" is not one of them).
        with pytest.raises(TypeError):
            a.get_and_update([("not", "an item", "pair")], ["raised"])  # type: ignore[list-item]
        assert a.stats()["store_claims"] == 1
        a.release_sender_touches()
        assert a.stats()["store_claims"] == 0
        # Inside a request bracket, its end ends every claim the request took.
        a.begin_request()
        assert a.is_cached(["gone"], claim=True) == [False]
        assert a.stats()["store_claims"] == 1
        a.end_request()
        assert a.stats()["store_claims"] == 0
        assert a.is_cached(["gone"], claim=True) == [False]
        assert b.is_cached(["big", "gone"], claim=True) == [False, False]
        assert b.stats()["store_claims"] == 2, "b claimed big, which a gave up, not gone"
        b.close()
        assert a.stats()["store_claims"] == 1, "a writer's claims end with it"


def test_a_writer_never_waits_on_its_own_claims() -> None:
    with ShmSenderCache(0.01, max_writers=2) as cache:
        assert cache.is_cached(["k"], claim=True) == [False]
        results: list[list[bool]] = []
        other = threading.Thread(
            target=lambda: results.append(cache.is_cached(["k"], claim=True, wait_s=NEVER))
        )
        other.start()
        other.join(TIMEOUT)
        assert not other.is_alive() and results == [[False]], "another thread's claim"
        # Both requests hold the claim: it lasts until the last one lets go.
        cache.release_sender_touches()
        assert cache.stats()["store_claims"] == 1
        other = threading.Thread(target=cache.release_sender_touches)
        other.start()
        other.join(TIMEOUT)
        assert cache.stats()["store_claims"] == 1, "the other thread's request had let go"
        with pytest.raises(ValueError, match="wait_s"):
            cache.is_cached(["k"], wait_s=-1)


@pytest.mark.parametrize("wait_s", [-1, float("nan"), float("inf"), "1", True])
def test_a_bad_wait_is_a_value_error_and_gives_up_no_claim(wait_s: Any) -> None:
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        assert a.is_cached(["mine"], claim=True) == [False]
        assert b.is_cached(["theirs"], claim=True) == [False]
        with pytest.raises(ValueError, match="wait_s must be a finite number"):
            a.is_cached(["theirs"], claim=True, wait_s=wait_s)
        assert b.is_cached(["mine"], claim=True) == [False] and b.stats()["store_claims"] == 2


def test_a_wait_too_long_for_a_float_waits_until_the_claim_ends() -> None:
    """A finite ``wait_s`` past the largest float (an int) is a wait with no practical end,
    not an ``OverflowError`` raised once the request had given up its claims for the wait
    (they were lost)."""
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        assert a.is_cached(["mine"], claim=True) == [False]
        assert b.is_cached(["theirs"], claim=True) == [False]
        store = a._store

        class Waiting:
            """``a``'s writer, whose wait has ``b`` put the item it waits for first."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def wait_for(self, keys: list[str], timeout_s: float) -> list[bool]:
                b.get_and_update_item((item("theirs"), updates("theirs", "b")), "theirs")
                return store.wait_for(keys, timeout_s)

        a._store = Waiting()  # type: ignore[assignment]
        try:
            assert a.is_cached(["theirs"], claim=True, wait_s=10**400) == [True]
        finally:
            a._store = store
        assert b.is_cached(["mine"], claim=True) == [False], "a holds its claim again"
        assert a.stats()["store_claims"] == 1


def test_two_requests_that_claimed_each_others_items_never_wait_for_each_other() -> None:
    # Two engines' requests for the same two images, each claiming one first: were they to
    # wait holding their claims, each would wait for the other for wait_s.
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        claimed = threading.Barrier(2)
        looked_up: dict[str, list[bool]] = {}

        def request(cache: ShmSenderCache, mine: str, theirs: str) -> None:
            assert cache.is_cached([mine], claim=True) == [False]
            claimed.wait(TIMEOUT)
            looked_up[mine] = cache.is_cached([mine, theirs], claim=True, wait_s=NEVER)
            cache.release_sender_touches()

        threads = [
            threading.Thread(target=request, args=(a, "x", "y"), daemon=True),
            threading.Thread(target=request, args=(b, "y", "x"), daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads), "the two requests waited for each other"
        assert looked_up == {"x": [False, False], "y": [False, False]}
        assert a.stats()["store_claims"] == 0


def test_a_wait_takes_back_the_claims_of_the_requests_earlier_lookups() -> None:
    # vLLM looks a request up once per modality: the images' claims, given up while the
    # videos' lookup waits, are the request's again after the wait.
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        assert b.is_cached(["video"], claim=True) == [False]
        assert a.is_cached(["image"], claim=True) == [False]
        assert a.is_cached(["video"], claim=True, wait_s=0.05) == [False], "b holds it"
        assert a.stats()["store_claims"] == 2
        assert b.is_cached(["image"], claim=True) == [False]
        b.release_sender_touches()
        assert a.stats()["store_claims"] == 1, "a still holds the image's claim"
        a.release_sender_touches()
        assert a.stats()["store_claims"] == 0


def _evicting_claimer(handle: WriterHandle, conn: Any) -> None:
    """Claim "new"; told to, fill the ring until "old" is evicted, report it, put "new"."""
    cache = ShmSenderCache.join(handle)
    conn.send(cache.is_cached(["new"], claim=True))
    recv(conn)
    for i in range(1000):
        if not cache.is_cached_item("old"):
            break
        key = f"filler-{i}"
        cache.get_and_update_item((item(key, 1 << 18), updates(key, "claimer")), key)
    conn.send(cache.is_cached_item("old"))
    cache.get_and_update_item((item("new"), updates("new", "claimer")), "new")
    cache.close()


def test_a_hit_evicted_while_the_lookup_waits_is_reported_missing() -> None:
    """A lookup that waits for another writer's item answers for every hash as things stand
    after the wait: an item it found cached before the wait and that was evicted during it
    is a miss (the engine processes it), never a hit whose update then misses."""
    ctx = mp.get_context("fork")
    with ShmSenderCache(0.02, max_writers=2) as p0:
        p0.get_and_update_item((item("old"), updates("old", "p0")), "old")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_evicting_claimer, args=(p0.writer_handle(), child))
        proc.start()
        try:
            assert recv(parent) == [False]
            store = p0._store

            class Waiting:
                """``p0``'s writer, whose wait lets the claimer go on once it has begun."""

                def __getattr__(self, name: str) -> Any:
                    return getattr(store, name)

                def wait_for(self, keys: list[str], timeout_s: float) -> list[bool]:
                    parent.send("go")
                    return store.wait_for(keys, timeout_s)

            p0._store = Waiting()  # type: ignore[assignment]
            try:
                looked_up = p0.is_cached(["old", "new"], claim=True, wait_s=NEVER)
            finally:
                p0._store = store
            assert recv(parent) is False, "the claimer evicted old during the wait"
            assert looked_up == [False, True]
            # The engine processes what was reported missing; the rest is a hit.
            outputs = p0.get_and_update([(item("old"), updates("old", "p0")), None], ["old", "new"])
            assert [got for _, got in outputs] == [updates("old", "p0"), updates("new", "claimer")]
        finally:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0


def test_a_hit_evicted_while_the_lookup_waits_is_claimed_as_a_miss() -> None:
    """With ``claim``, a hit of before the wait that was evicted during it is a miss like
    any other: claimed by this writer (unclaimed, another writer's lookup of it would
    process it too instead of waiting for this one's put)."""
    with (
        ShmSenderCache(0.01, max_writers=2) as a,
        ShmSenderCache.join(a.writer_handle()) as b,
    ):
        a.get_and_update_item((item("old"), updates("old", "a")), "old")
        assert b.is_cached(["new"], claim=True) == [False]
        store = a._store

        class Waiting:
            """``a``'s writer, during whose wait ``b`` drops "old" and puts "new"."""

            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def wait_for(self, keys: list[str], timeout_s: float) -> list[bool]:
                b.invalidate("old")
                b.get_and_update_item((item("new"), updates("new", "b")), "new")
                return store.wait_for(keys, timeout_s)

        a._store = Waiting()  # type: ignore[assignment]
        try:
            assert a.is_cached(["old", "new"], claim=True, wait_s=NEVER) == [False, True]
        finally:
            a._store = store
        assert a.stats()["store_claims"] == 1, "a claimed old, which it now processes"
        assert b.is_cached(["old"], claim=True) == [False] and a.stats()["store_claims"] == 1
        a.get_and_update_item((item("old"), updates("old", "a")), "old")
        assert a.stats()["store_claims"] == 0, "its put ended the claim"


# -- threads of several processes ------------------------------------------------------------

KEYS = [f"img-{i}" for i in range(24)]


def _hammer(handle: WriterHandle, who: str, out: Any, seed: int) -> None:
    """Threads serving random requests through one joined cache: claims, waits, touches and
    updates; every output's prompt updates checked here, every handle sent to the reader."""
    cache = ShmSenderCache.join(handle)
    errors: list[str] = []

    def serve(thread: int) -> None:
        rng = random.Random(seed * 100 + thread)
        for _ in range(60):
            keys = rng.sample(KEYS, rng.randint(1, 3))
            cached = cache.is_cached(keys, claim=True, wait_s=0.05)
            for key in keys:
                cache.touch_sender_cache_item(key)
            inputs = [
                None if hit else (item(k, 8192), updates(k, f"{who}/{thread}"))
                for k, hit in zip(keys, cached, strict=True)
            ]
            try:
                outputs = cache.get_and_update(inputs, keys)
            except CacheMissError as exc:  # evicted since the lookup: resend with data
                for key in exc.mm_hashes:
                    cache.invalidate(key)
                inputs = [(item(k, 8192), updates(k, f"{who}/{thread}")) for k in keys]
                outputs = cache.get_and_update(inputs, keys)
            for key, (data, got) in zip(keys, outputs, strict=True):
                if got[0] != ("key", key):
                    errors.append(f"{key}: prompt updates {got}")
                if isinstance(data, ShmHandle):
                    out.put((key, data))
                elif not same_item(data, item(key, 8192)):
                    errors.append(f"{key}: uncached data differs")

    threads = [threading.Thread(target=serve, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("done", (who, errors, tuple(cache.make_stats()))))
    cache.close()


@pytest.mark.parametrize("method", CONTEXTS)
def test_threads_of_several_processes(method: str) -> None:
    ctx = mp.get_context(method)
    with (
        ShmSenderCache(0.25 / 1024, max_writers=3, max_object_size_mb=0.05) as p0,
        ShmReceiverCache(p0.handle()) as reader,
    ):
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_hammer, args=(p0.writer_handle(), f"w{i}", out, i))
            for i in range(2)
        ]
        for proc in procs:
            proc.start()
        done: dict[str, tuple[list[str], tuple[int, int]]] = {}
        resolved = 0
        try:
            while len(done) < len(procs):
                key, data = out.get(timeout=TIMEOUT)
                if key == "done":
                    done[data[0]] = (data[1], data[2])
                    continue
                check_handle(reader, data, key, 8192)
                resolved += 1
        finally:
            for proc in procs:
                proc.join(TIMEOUT)
                if proc.is_alive():
                    proc.kill()
        assert [p.exitcode for p in procs] == [0, 0]
        for who, (errors, (_, total)) in done.items():
            assert not errors, f"{who}: {errors[:5]}"
            assert total >= 180, (who, total)
        assert resolved > 0 and sum(hits for _, (hits, _) in done.values()) > 0
        assert p0.stats()["store_claims"] == 0, "every claim ended"
        assert p0.stats()["store_evictions"] > 0, "the ring was under pressure"
