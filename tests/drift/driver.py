"""Random episodes over the models: a fresh model of a random mode and configuration per
episode, driven by random operations and faults; deterministic in ``(seed, episode)`` (the
``multi_writer`` mode's schedule is; its processes' interleaving is not)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from tests.drift.engine import EngineModel
from tests.drift.lru_model import LruModel
from tests.drift.multi_writer_model import MODE as MULTI_WRITER
from tests.drift.multi_writer_model import run_multi_writer_episode
from tests.drift.processor_only_model import ProcessorOnlyModel
from tests.drift.remote_model import RemoteModel
from tests.drift.shm_model import ShmModel
from tests.drift.stats import FuzzStats

__all__ = ["ENGINE_MODES", "FAULTS", "MODELS", "MODES", "make_model", "run_episode"]

KiB = 1 << 10

MODELS: dict[str, type[EngineModel]] = {
    model.mode: model for model in (LruModel, ShmModel, ProcessorOnlyModel, RemoteModel)
}
ENGINE_MODES = tuple(MODELS)
"""The modes whose model is an :class:`EngineModel` (stepped, single process)."""
MODES = (*ENGINE_MODES, MULTI_WRITER)
"""Every mode: the engine models' and ``multi_writer`` (writer processes sharing one store,
:mod:`tests.drift.multi_writer_model`)."""

FAULTS: dict[str, tuple[str, ...]] = {mode: model.faults for mode, model in MODELS.items()}
"""Per mode, the faults :meth:`EngineModel.request` can inject (plus ``"none"``).  Two further
faults are operations of their own: :meth:`EngineModel.reorder` and
:meth:`EngineModel.interleave`."""


def make_model(
    mode: str,
    *,
    seed: int,
    capacity: int,
    n_ids: int,
    stats: FuzzStats | None = None,
    retry_invalidates: str = "reported",
    **kwargs: Any,
) -> EngineModel:
    """The model of ``mode`` (one of :data:`MODES`); ``kwargs`` go to the ``shm`` model
    (``n_workers``, ``copies``, ``max_object_fraction``)."""
    return MODELS[mode](
        seed=seed,
        capacity=capacity,
        n_ids=n_ids,
        stats=stats,
        retry_invalidates=retry_invalidates,
        **kwargs,
    )


def _random_ids(rng: random.Random, n_ids: int) -> list[int]:
    n = rng.randint(1, 6)
    # Skewed popularity: low ids recur much more often.
    return [
        min(n_ids - 1, int(rng.paretovariate(1.2)) - 1)
        if rng.random() < 0.7
        else rng.randrange(n_ids)
        for _ in range(n)
    ]


def _episode_config(rng: random.Random, mode: str) -> dict[str, Any]:
    if mode == "shm":
        capacity = rng.choice([96, 128, 192, 256, 384]) * KiB
        n_workers = rng.choice([1, 1, 2, 2, 3])
        return {
            "capacity": capacity,
            "n_ids": rng.randint(3, 40),
            "n_workers": n_workers,
            "copies": [rng.random() < 0.5 for _ in range(n_workers)],
            "max_object_fraction": rng.choice([0.25, 0.5, 0.9]),
        }
    return {"capacity": rng.choice([2, 4, 8, 16, 32, 64]) * KiB, "n_ids": rng.randint(3, 40)}


def run_episode(
    seed: int,
    episode: int,
    stats: FuzzStats,
    *,
    steps: int,
    modes: Sequence[str] = ENGINE_MODES,
    log: list[str] | None = None,
    fault_rate: float | None = None,
    **model_options: Any,
) -> None:
    """One episode: a fresh model of a random mode and configuration, ``steps`` random
    operations.  ``fault_rate`` (by default drawn per episode, from fault-free to one
    request in three) is the share of requests that inject a fault; reorders and
    interleavings come at a tenth of it each.  Deterministic in ``(seed, episode)``; raises
    :class:`OracleFailure` (or whatever the caches raised).  A ``multi_writer`` episode
    (``modes`` includes it only when asked: it starts processes) takes neither ``steps`` nor
    the engine models' options."""
    mode = modes[episode % len(modes)]
    if mode == MULTI_WRITER:
        run_multi_writer_episode(seed, episode, stats, log=log, fault_rate=fault_rate)
        return
    rng = random.Random(f"{seed}:{episode}")
    config = _episode_config(rng, mode)
    rate = rng.choice([0.0, 0.02, 0.1, 0.3]) if fault_rate is None else fault_rate
    if log is not None:
        log.append(f"episode {episode}: mode {mode} fault rate {rate} {config}")
    faults = FAULTS[mode]
    with make_model(
        mode, seed=rng.randrange(2**32), stats=stats, **config, **model_options
    ) as model:
        stats.episodes += 1
        for step in range(steps):
            r = rng.random()
            if r < 0.03:
                op: tuple[Any, ...] = ("resync",)
            elif r < 0.03 + rate / 10:
                op = ("reorder", _random_ids(rng, model.n_ids), _random_ids(rng, model.n_ids))
            elif r < 0.03 + rate / 5:
                op = ("interleave", _random_ids(rng, model.n_ids), _random_ids(rng, model.n_ids))
            elif r < 0.05 + rate / 5 and mode == "shm":
                op = ("drop_views",)
            else:
                fault = rng.choice(faults) if rng.random() < rate else "none"
                op = ("request", _random_ids(rng, model.n_ids), fault)
            if log is not None:
                log.append(f"  step {step}: {op}")
            getattr(model, op[0])(*op[1:])
            stats.steps += 1
