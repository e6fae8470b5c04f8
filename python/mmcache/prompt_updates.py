"""Prompt updates stored beside an item in the ring, so every writer of a store returns them.

When several writers share one store (SPEC §3.9), a hit on an item another writer put must
return the prompt updates that writer gave.  They travel with the item, as the store's
metadata (``put_item(..., meta=)``; readers never see it), encoded by
:class:`PromptUpdatesCodec`:

* ``"plain"`` (the default): the package's native item codec, which holds plain data (``None``,
  ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists, tuples and ``str``-keyed dicts of
  them; tensors and arrays too) and never runs code when decoding; of exactly those types
  (a namedtuple or an ``IntEnum`` would come back as its base, so it is not shareable);
* ``"pickle"``: :mod:`pickle`, for engines whose prompt updates are objects (vLLM's are
  dataclasses); only a writer that opted in decodes it (every writer of a store holds its
  secret, so they trust each other as much as the process that made them);
* ``(dumps, loads)``: the engine's own pair of functions.

The first byte of the metadata says which was used, so a writer never decodes another
codec's bytes: prompt updates it cannot decode (or that no codec could encode: the metadata
is then empty) are *not shareable*, and the cache treats the item as not cached for this
writer (:mod:`mmcache.shm`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias

import numpy as np

from mmcache import _core

__all__ = [
    "MAX_META_BYTES",
    "NOT_SHAREABLE",
    "KeptPromptUpdates",
    "PromptUpdatesCodec",
    "PromptUpdatesCodecSpec",
]

MAX_META_BYTES = 1 << 20
"""The most metadata the store keeps beside an object (longer prompt updates stay local)."""

PromptUpdatesCodecSpec: TypeAlias = (
    Literal["plain", "pickle"] | tuple[Callable[[Any], bytes], Callable[[bytes], Any]]
)
"""What ``prompt_updates_codec=`` takes: ``"plain"``, ``"pickle"`` or ``(dumps, loads)``."""

NOT_SHAREABLE: Any = object()
"""What :meth:`PromptUpdatesCodec.decode` returns for metadata this writer cannot decode."""

_PLAIN, _PICKLE, _CUSTOM = b"p", b"k", b"c"


class PromptUpdatesCodec:
    """Prompt updates to metadata bytes and back, tagged with the codec that wrote them."""

    def __init__(self, spec: PromptUpdatesCodecSpec = "plain") -> None:
        self.dumps: Callable[[Any], bytes]
        self.loads: Callable[[bytes], Any]
        if spec == "plain":
            self.tag, self.dumps, self.loads = _PLAIN, _plain_dumps, _plain_loads
        elif spec == "pickle":
            self.tag, self.dumps, self.loads = _PICKLE, _pickle_dumps, pickle.loads
        elif isinstance(spec, tuple) and len(spec) == 2 and all(map(callable, spec)):
            self.tag, (self.dumps, self.loads) = _CUSTOM, spec
        else:
            raise ValueError(
                "prompt_updates_codec must be 'plain', 'pickle' or a (dumps, loads) pair of "
                f"functions, not {spec!r}"
            )
        self.name = {_PLAIN: "plain", _PICKLE: "pickle", _CUSTOM: "custom"}[self.tag]

    def encode(self, prompt_updates: Any) -> bytes:
        """The metadata for ``prompt_updates``; ``b""`` (not shareable) when this codec cannot
        encode them or they exceed :data:`MAX_META_BYTES`."""
        try:
            data = self.dumps(prompt_updates)
        except Exception:  # whatever the codec refuses (the engine's pair raises its own)
            return b""
        if not isinstance(data, bytes | bytearray) or len(data) + 1 > MAX_META_BYTES:
            return b""
        return self.tag + data

    def decode(self, meta: bytes) -> Any:
        """The prompt updates in ``meta``, or :data:`NOT_SHAREABLE` when it holds none this
        writer may decode (empty, another codec's, or undecodable)."""
        if meta[:1] != self.tag and meta[:1] != _PLAIN:
            return NOT_SHAREABLE
        loads = self.loads if meta[:1] == self.tag else _plain_loads
        try:
            return loads(meta[1:])
        except Exception:  # bytes another writer wrote: any failure means "not shareable"
            return NOT_SHAREABLE


def comes_back_as_is(prompt_updates: Any) -> bool:
    """Whether the item codec gives ``prompt_updates`` back exactly as they are: plain data of
    exactly the types it decodes to (a namedtuple would come back a tuple, an ``IntEnum`` an
    int, another object not at all)."""
    return _exactly_plain(prompt_updates, 0)


def _plain_dumps(prompt_updates: Any) -> bytes:
    if not comes_back_as_is(prompt_updates):
        raise TypeError("not plain data of exactly the types it decodes to")
    return _core.pack_item({"u": prompt_updates})


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_NESTING = 64  # the codec's own limit


def _exactly_plain(value: Any, depth: int) -> bool:
    """Whether ``value`` is plain data whose every part is of exactly a type the codec gives
    back: a subclass (a namedtuple, an ``IntEnum``, a ``defaultdict``) would reach the other
    writers as its base type, so such prompt updates are not shareable instead."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if depth >= _NESTING:
        return False
    if kind is list or kind is tuple:
        return all(_exactly_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) is str and _exactly_plain(v, depth + 1) for k, v in value.items())
    # Arrays, numpy's scalars and tensors come back as exactly their own types.
    if kind is np.ndarray or (issubclass(kind, np.generic) and kind.__module__ == "numpy"):
        return True
    return (kind.__module__, kind.__qualname__) == ("torch", "Tensor")


def _plain_loads(data: bytes) -> Any:
    return _core.decode_item(data)["u"]


def _pickle_dumps(prompt_updates: Any) -> bytes:
    return pickle.dumps(prompt_updates, protocol=pickle.HIGHEST_PROTOCOL)


PRUNE_STEP = 128
"""Kept keys a writer looks up per update while it forgets those of evicted objects."""


class KeptPromptUpdates:
    """A writer's prompt updates of the objects it put or hit (``entries``: key -> (monotonic id
    of the object they belong to, or None, prompt updates)), which forgets those of evicted
    objects a few at a time.

    Forgetting is amortised (a pass starts once twice as many are kept as after the last one)
    and spread: each :meth:`keep` during a pass looks up at most :data:`PRUNE_STEP` kept keys,
    in the order they were kept, so no update waits on a walk of everything kept (a ring of
    65,536 objects made one put in ~130,000 wait 20-60 ms). ``entries`` is changed in place
    only: a C method reads it (``CachedItemCheck``). Not thread-safe: the cache's lock.
    """

    def __init__(self, uncached: Callable[[list[str]], Iterable[str]]) -> None:
        self.entries: dict[str, tuple[int | None, Any]] = {}
        self._uncached = uncached  # those of the keys the store no longer holds
        self._prune_at = 64
        self._order: list[str] = []  # keys as kept, each at most once per pass
        self._cursor: int | None = None  # where the pass under way has reached in `_order`
        self._survivors: list[str] = []  # keys the pass found stored, in order
        self._seen: set[str] = set()  # every key of `_survivors`

    def keep(self, key: str, monotonic_id: int | None, prompt_updates: Any) -> None:
        if key not in self.entries:
            self._order.append(key)
        self.entries[key] = (monotonic_id, prompt_updates)
        if self._cursor is not None or len(self.entries) >= self._prune_at:
            self._prune_step()

    def _prune_step(self) -> None:
        """Look up the pass's next keys; forget those no longer stored. A key kept again
        after it was forgotten (or invalidated) may be in `_order` twice: the pass keeps its
        first survivor only."""
        start = self._cursor or 0
        end = start + PRUNE_STEP
        keys = [key for key in self._order[start:end] if key in self.entries]
        gone = set(self._uncached(keys))
        for key in keys:
            if key in gone:
                self.entries.pop(key, None)
            elif key not in self._seen:
                self._seen.add(key)
                self._survivors.append(key)
        if end < len(self._order):
            self._cursor = end
            return
        self._order, self._survivors, self._seen = self._survivors, [], set()
        self._cursor = None
        self._prune_at = max(64, 2 * len(self.entries))

    def clear(self) -> None:
        self.entries.clear()
        self._order, self._survivors, self._seen = [], [], set()
        self._cursor = None
        self._prune_at = 64
