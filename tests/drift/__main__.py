"""``python -m tests.drift`` (from the repository root): the drift fuzzer for long runs.

It runs random episodes until ``--seconds`` have passed, prints what it exercised, and on
the first oracle failure (or any other error) exits with status 1, printing the episode's
last steps and the command that replays it (``--seed S --episode E``).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from tests.drift.driver import MODES, run_episode
from tests.drift.engine import OracleFailure
from tests.drift.stats import FuzzStats
from tests.drift.truth import torch


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzzer with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.drift",
        description="Drift fuzzer: random request streams and faults through the real caches, "
        "checked against the truth after every step.",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=None, help="seed (default: random)")
    parser.add_argument("--steps", type=int, default=400, help="operations per episode")
    parser.add_argument(
        "--mode",
        "--model",
        choices=MODES,
        action="append",
        help="restrict to these modes (repeatable; --model is an alias)",
    )
    parser.add_argument(
        "--episode", type=int, default=None, help="replay this one episode, printing each step"
    )
    parser.add_argument(
        "--retry-invalidates",
        choices=("reported", "request"),
        default="reported",
        help="what P0 invalidates before a retry after P1 missed: the reported hashes (the "
        "specification's protocol, default) or every hash of the request",
    )
    args = parser.parse_args(argv)
    options: dict[str, Any] = {"retry_invalidates": args.retry_invalidates}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    modes = tuple(args.mode or MODES)
    logging.getLogger("mmcache").setLevel(logging.ERROR)  # uncached items are expected here
    stats = FuzzStats()
    print(
        f"mmcache drift fuzzer: seed {seed}, modes {', '.join(modes)}, "
        f"torch {'yes' if torch is not None else 'no (numpy items only)'}",
        flush=True,
    )
    start = time.monotonic()
    deadline = start + args.seconds
    episode = args.episode if args.episode is not None else 0
    last_report = start
    while True:
        log: list[str] = []
        try:
            run_episode(seed, episode, stats, steps=args.steps, modes=modes, log=log, **options)
        except Exception as exc:  # OracleFailure, or anything the caches raised (oracle d)
            kind = "ORACLE FAILURE" if isinstance(exc, OracleFailure) else "UNEXPECTED ERROR"
            print(f"\n{kind} in episode {episode} (seed {seed}):", file=sys.stderr)
            traceback.print_exc()
            tail = log if args.episode is not None else [log[0], "  ...", *log[-12:]]
            print("\n".join(tail), file=sys.stderr)
            replay = f"python -m tests.drift --seed {seed} --episode {episode}"
            replay += f" --steps {args.steps}"
            replay += "".join(f" --mode {m}" for m in args.mode or ())
            replay += f" --retry-invalidates {args.retry_invalidates}"
            print(f"replay: {replay}", file=sys.stderr)
            print(stats.summary(), file=sys.stderr)
            return 1
        if args.episode is not None:
            print("\n".join(log))
            break
        episode += 1
        now = time.monotonic()
        if now >= deadline:
            break
        if now - last_report >= 30:
            last_report = now
            print(
                f"[{now - start:6.0f}s] episodes {stats.episodes} requests {stats.requests} "
                f"faults {stats.total_faults} retries {stats.retries} checks {stats.checks}",
                flush=True,
            )
    print(f"clean after {time.monotonic() - start:.0f}s (seed {seed})")
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
