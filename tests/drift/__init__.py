"""Drift fuzzer: a model of P0, P1 and the workers that drives the real caches with random
request streams and random faults between the sides, and checks an oracle after every step.

The model plays the engine.  For every request P0 asks ``is_cached`` for each hash, touches
every hash, then calls ``get_and_update`` (``None`` for the items it believes cached); the
outputs travel to P1 (``lru``: a :class:`~mmcache.ReceiverCache`) or, as small handles, to
every worker (``shm``: one :class:`~mmcache.ShmReceiverCache` each), which resolve
:class:`~mmcache.Feature` objects.  On a :class:`~mmcache.CacheMissError` the engine recovers
the way the specification says: P0 ``invalidate`` s the reported hashes and retries the
request once, with its data attached.  When P0 itself raises (an item it reported cached was
gone by the time of its update) the request never left P0 and P0 applied none of it, but
P0's view of P1 is stale, so the engine invalidates every hash of the request before the
retry.

Faults injected between the sides: a request lost after P0 applied it (rejected), two
requests applied in different orders on the two sides, a duplicated delivery, P1 cleared or
restarted alone (a worker restarted, in ``shm`` mode), P0 cleared alone, two P0 frontends
sharing one P1, ``is_cached`` answered and then the item evicted before the update (another
request served in between), handles invalidated or cleared while in flight, payloads
stripped by the engine, zero-copy views held across everything.  In mode ``remote`` (the
``lru`` pipeline whose P0 sits behind a remote tier on a real Valkey, shared with a second
host): the server killed and restarted, stalled (SIGSTOP), stored values with a flipped byte,
a deleted chunk or another schema version's header, two hosts putting one item at once, a
host with the wrong secret.

Oracle, checked after every step (a failure raises :class:`~tests.drift.engine.OracleFailure`):

(a) every resolved item equals the truth for its hash, bit for bit (tensors and arrays by
    dtype, shape and bytes; zero-copy views held across steps are re-checked every step);
(b) every request succeeds on its first or its second attempt;
(c) with no fault injected since the last resynchronisation, P0 and P1 hold the same keys in
    the same recency order (``lru``); nothing is left pinned, referenced or viewed once a
    request is done (``shm``);
(d) nothing raises but :class:`~mmcache.CacheMissError`, and that only where a fault could
    have caused it.

Mode ``multi_writer`` (:mod:`.multi_writer_model`) is concurrent rather than stepped: 2-4
writer processes (:mod:`.multi_writer_proc`, threads in each) share one small ring and race
on a small key space (concurrent puts of one key, claims and waits, evictions, invalidations,
clears) while readers resolve every writer's handles; writers are SIGKILLed at each crash
point of the core (``_core.CRASH_POINTS``) and at random moments (claim holders among them)
and replaced by writers that join in the dead one's slot.  Its oracle is the same in kind:
no wrong bytes or metadata ever, no hang (bounded waits, an episode deadline), no slot held
twice, and after the episode a consistent store and no segment left in ``/dev/shm``.

One module per concern: :mod:`.truth` (the items and their bit-exact fingerprints),
:mod:`.engine` (:class:`EngineModel`: the engine's loop and the oracle), one model per mode
(:mod:`.lru_model`, :mod:`.shm_model`, :mod:`.processor_only_model`, :mod:`.remote_model`,
:mod:`.multi_writer_model` with its writer process :mod:`.multi_writer_proc`),
:mod:`.driver` (random episodes), :mod:`.stats` (what a run exercised).  The hypothesis
state machines of ``tests/test_drift_fuzz.py`` drive the models; for long runs, from the
repository root::

    python -m tests.drift --seconds 600 [--seed S] [--mode lru ...]

(``--model`` is an alias of ``--mode``; every mode runs unless restricted.)

It prints what it exercised and exits with status 1 on the first oracle failure, printing
how to replay the failing episode (``--seed S --episode E``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.drift.driver import FAULTS, MODELS, MODES, make_model, run_episode
    from tests.drift.engine import EngineModel, OracleFailure
    from tests.drift.stats import FuzzStats
    from tests.drift.truth import Universe, fingerprint

# Imported on first use (PEP 562): a writer process of the multi-writer model imports
# ``tests.drift.multi_writer_proc``, which must not pay for torch and the engine models.
_EXPORTS = {
    "FAULTS": "driver",
    "MODELS": "driver",
    "MODES": "driver",
    "make_model": "driver",
    "run_episode": "driver",
    "EngineModel": "engine",
    "OracleFailure": "engine",
    "FuzzStats": "stats",
    "Universe": "truth",
    "fingerprint": "truth",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "FAULTS",
    "MODELS",
    "MODES",
    "EngineModel",
    "FuzzStats",
    "OracleFailure",
    "Universe",
    "fingerprint",
    "make_model",
    "run_episode",
]
