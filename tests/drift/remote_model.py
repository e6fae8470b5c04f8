"""``remote`` mode: the ``lru`` pipeline with P0 behind the remote tier on a real Valkey
server shared with a second host; its faults plus the remote tier's (the server killed,
restarted or stalled, stored values damaged, racing puts, a host with the wrong secret)."""

from __future__ import annotations

import itertools
import struct
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import redis

from mmcache.caches import ReceiverCache, SenderCache
from mmcache.remote import RemoteStore, TieredSenderCache
from mmcache.remote.envelope import HEADER_SIZE
from mmcache.remote.local_server import LocalServer, start_valkey
from tests.drift.lru_model import LruModel
from tests.servers import restart, resume, stall

__all__ = ["RemoteModel"]


class RemoteModel(LruModel):
    """``remote``: the ``lru`` pipeline with P0 behind a :class:`~mmcache.remote.
    TieredSenderCache` on a real Valkey server, and a second host (its own P0 and P1) on the
    same store.  Values are chunked at 4 KiB so small items exercise chunking too.  After
    every request both hosts' publishing is flushed, so the store holds what they made.
    Oracle (a) covers the tier: whatever a host resolves came through it or was processed,
    and must be the truth; its stores' failures are counted, never raised."""

    mode = "remote"
    faults: tuple[str, ...] = (
        "lost",
        "p1_clear",
        "p0_clear",
        "other_host",  # the second host serves the request (it shares what the first made)
        "server_restart",  # the server killed and restarted empty, then the request
        "server_stall",  # the request served while the server is stopped (SIGSTOP)
        "flip_byte",  # a byte of a stored value flipped, then the second host fetches it
        "delete_chunk",  # a chunk of a stored value deleted, then ...
        "old_version",  # a stored value's header rewritten to another schema version, ...
        "race_put",  # both hosts put one item at once, then the second host fetches it
        "wrong_secret",  # a host with another secret serves the request
    )
    SECRET = "fuzz secret"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._namespace = f"fuzz/{self.universe.seed}/{next(_REMOTE_NAMESPACES)}"
        self._server = _remote_server()
        self.frontends[0].close()
        self.frontends[0] = self._host(self.SECRET)
        self.other = self._host(self.SECRET)
        self.other_p1 = ReceiverCache(self.capacity_gb)
        self._counted = 0

    def _host(self, secret: str) -> Any:
        store = RemoteStore(
            self._server.url + "?chunk_kb=4",
            namespace=self._namespace,
            secret=secret,
            timeout_s=0.05,
            breaker_cooldown_s=0.05,
        )
        return TieredSenderCache(SenderCache(self.capacity_gb), store)

    def frontend(self) -> Any:  # a TieredSenderCache
        return self.frontends[0]

    def _tiered(self) -> list[Any]:
        return [self.frontends[0], self.other]

    def _serve_on_other_host(self, ids: list[int], host: Any = None, p1: Any = None) -> None:
        """Serve ``ids`` on another host (the second one by default): its P0 forgets them
        first, so every item comes from the remote tier or from processing."""
        host, p1 = host or self.other, p1 or self.other_p1
        for h in self.universe.hashes(ids):
            host.invalidate(h)
        saved = self.frontends[0], self.p1
        self.frontends[0], self.p1 = host, p1
        try:
            self._serve(host, ids, exposed=True)
        finally:
            self.frontends[0], self.p1 = saved

    def request(self, ids: Sequence[int], fault: str = "none") -> None:
        super().request(ids, fault)
        for host in self._tiered():
            self._check(host.flush(30.0), "(d) a host's publishing did not finish")

    def _raw(self) -> Any:
        return redis.Redis.from_url(self._server.url)

    def _stored_keys(self, ids: list[int], *, chunked: bool) -> list[str]:
        """Store keys of this request's items: their manifests or whole values, or (with
        ``chunked``) the chunks of those that have them."""
        prefix = f"mmc/{self._namespace}/"
        with self._raw() as raw:
            found: list[str] = []
            for h in dict.fromkeys(self.universe.hashes(ids)):
                pattern = f"{prefix}{h}/chunk/*" if chunked else f"{prefix}{h}"
                found += sorted(k.decode() for k in raw.scan_iter(match=pattern))
            return found

    def _damage(self, ids: list[int], harm: Callable[[Any, str], object], chunked: bool) -> None:
        keys = self._stored_keys(ids, chunked=chunked)
        if keys:
            with self._raw() as raw:
                harm(raw, keys[len(ids) % len(keys)])
        self._serve_on_other_host(ids)

    def _fault_other_host(self, ids: list[int]) -> None:
        self._serve_on_other_host(ids)

    def _fault_server_restart(self, ids: list[int]) -> None:
        restart(self._server)
        self._serve(self.frontend(), ids)

    def _fault_server_stall(self, ids: list[int]) -> None:
        stall(self._server)
        try:
            self._serve(self.frontend(), ids)
            for host in self._tiered():
                host.flush(30.0)  # puts time out against the stopped server
        finally:
            resume(self._server)

    def _fault_flip_byte(self, ids: list[int]) -> None:
        def flip(raw: Any, name: str) -> None:
            value = bytearray(raw.get(name) or b"")
            if value:
                value[len(value) * 7 // 11] ^= 0x20
                raw.set(name, bytes(value))

        self._damage(ids, flip, chunked=len(ids) % 2 == 0)

    def _fault_delete_chunk(self, ids: list[int]) -> None:
        self._damage(ids, lambda raw, name: raw.delete(name), chunked=True)

    def _fault_old_version(self, ids: list[int]) -> None:
        def rewrite(raw: Any, name: str) -> None:
            value = bytearray(raw.get(name) or b"")
            # The envelope header starts a whole value and ends a chunked value's manifest.
            at = {b"MMCR": 0, b"MMCK": len(value) - HEADER_SIZE}.get(bytes(value[:4]))
            if at is not None:
                value[at + 4 : at + 6] = struct.pack("<H", 0xFFFF)
                raw.set(name, bytes(value))

        self._damage(ids, rewrite, chunked=False)

    def _fault_race_put(self, ids: list[int]) -> None:
        i = ids[0]
        h = self.universe.hash(i)
        with self._raw() as raw:
            names = list(raw.scan_iter(match=f"mmc/{self._namespace}/{h}*"))
            if names:
                raw.delete(*names)
        record = {"item": self.universe.item(i), "prompt_updates": self.universe.prompt_updates(i)}
        start = threading.Barrier(2)

        def put(host: Any) -> None:
            start.wait()
            host.remote.put(h, record)

        threads = [threading.Thread(target=put, args=(host,)) for host in self._tiered()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._serve_on_other_host(ids)

    def _fault_wrong_secret(self, ids: list[int]) -> None:
        # A secret of its own: values it publishes verify for nobody else, and no one's for it.
        secret = f"stranger {next(_REMOTE_NAMESPACES)}"
        stranger, p1 = self._host(secret), ReceiverCache(self.capacity_gb)
        try:
            self._serve_on_other_host(ids, stranger, p1)
            self._check(
                stranger.stats()["remote_served"] == 0,
                "(a) a host with the wrong secret was served from the remote tier",
            )
        finally:
            stranger.close()
            p1.close()

    def _p0_keys(self) -> list[Hashable]:
        keys: list[Hashable] = self.frontend().local.keys()
        return keys

    def check(self) -> None:
        super().check()  # (c) and (d) for this host's P0s and P1
        counted = 0
        for host in self._tiered():
            stats = host.stats()
            if host is self.other:
                self._check(stats["used_bytes"] <= self.capacity, "(d) P0 exceeds its capacity")
            counted += stats["remote_served"]
        self.stats.remote_served += counted - self._counted
        self._counted = counted

    def _resync(self) -> None:
        super()._resync()
        self.other.clear_cache()
        self.other_p1.clear_cache()

    def _close(self) -> None:
        self.stats.remote_misses += sum(host.stats()["remote_errors"] for host in self._tiered())
        super()._close()
        self.other.close()
        self.other_p1.close()


_REMOTE_NAMESPACES = itertools.count()
_REMOTE_SERVER: list[LocalServer] = []


def _remote_server() -> LocalServer:
    """One real Valkey server for the remote models of this process (started on first use;
    it dies with this process)."""
    if not _REMOTE_SERVER:
        _REMOTE_SERVER.append(start_valkey())
    return _REMOTE_SERVER[0]
