"""The drift fuzzer's ``multi_writer`` model (:mod:`tests.drift.multi_writer_model`) in CI:
writer processes sharing one store, SIGKILLed at every crash point of the core and at random
moments, replaced in the dead writer's slot, while readers check every handle.

Two episodes with a deterministic schedule arm every point of ``_core.CRASH_POINTS`` once,
the first with the core's writers, the second with ``ShmSenderCache.join`` caches (about a
minute on two loaded cores); a point no writer reached (its budget of operations ran out
first) is armed again in up to three more episodes. The test fails unless each point actually
killed a writer, so a schedule that stops reaching a point is noticed.  Longer runs:
``python -m tests.drift --model multi_writer --seconds 600``.
"""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest

from mmcache import _core
from tests.drift import FuzzStats, OracleFailure
from tests.drift import multi_writer_model as mw

SEED = 18


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """A wedged coordinator stops with a traceback instead of hanging the run (the episode's
    own hang check fires first); it never judges how long anything took."""
    faulthandler.dump_traceback_later(900, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_every_crash_point_kills_a_writer_and_no_reader_sees_wrong_bytes() -> None:
    stats = FuzzStats()
    points = list(_core.CRASH_POINTS)
    half = (len(points) + 1) // 2
    log: list[str] = []
    try:
        # Episode 0: the core's writers, the coordinator closes last; episode 1: writers are
        # ShmSenderCache.join caches, the last writer process unlinks the segment.
        for episode, (armed, layer) in enumerate(
            ((points[:half], "store"), (points[half:], "cache"))
        ):
            mw.run_multi_writer_episode(SEED, episode, stats, log=log, points=armed, layer=layer)
        # A writer armed with a point may run out of operations before it passes there (a
        # rare point, such as `lab.split`, on a busy machine): the points no writer died at
        # are armed again, in up to three more episodes (odd ones: the coordinator closes
        # first, as in episode 1), each with a schedule of its own. Episode 5 is skipped: four
        # writers share its ring, whose share per writer slot makes buffers too small to carve
        # its objects from, so it never reaches `lab.split`.
        for episode in (3, 7, 9):
            missed = [point for point in points if stats.faults[f"crash:{point}"] == 0]
            if not missed:
                break
            mw.run_multi_writer_episode(SEED, episode, stats, log=log, points=missed, layer="store")
    except OracleFailure:
        print("\n".join(log))
        raise
    summary = stats.summary()
    for point in points:
        assert stats.faults[f"crash:{point}"] >= 1, f"no writer died at {point}:\n{summary}"
    assert stats.faults["kill_external"] >= 1, summary
    assert stats.mw["replacements"] >= len(points), summary
    assert stats.mw["slot_reused"] >= 1, summary  # a dead writer's slot was joined again
    assert stats.mw["episode_checks"] == 1, summary  # the episode the coordinator closed last
    # The writers raced: concurrent puts of one key, claims, hits, waits; readers resolved.
    for what in ("put", "hit", "put_lost_race", "claimed", "claim_held", "verified", "handle"):
        assert stats.mw[what] > 0, f"{what} never happened:\n{summary}"
    assert stats.mw["handles_resolved"] > 100, summary


def test_the_oracle_catches_a_reader_that_gets_foreign_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = mw.expected_payload

    def wrong_for_k000(universe: int, key: str, capacity: int) -> bytes:
        data = real(universe, key, capacity)
        return data[::-1] if key == "k000" and len(set(data)) > 1 else data

    monkeypatch.setattr(mw, "expected_payload", wrong_for_k000)
    with pytest.raises(OracleFailure, match=r"\(a\).*k000"):
        mw.run_multi_writer_episode(SEED, 2, FuzzStats(), points=[], layer="store")
