"""Looking after shared-memory segments: inspect a live one, prune those left behind.

A segment outlives its creator only when the creator was killed before it could unlink it
(SIGKILL, an out-of-memory kill, a power cut of the container). :func:`prune` finds such
segments among those this package created on this host and removes them — judging liveness
by the writer's lock on the segment, so it is right across PID namespaces; every store's
creation does the same first, so they do not wait for someone to run it. :func:`inspect`
reads a live segment's header, never writing to it and without taking a reader slot.
"""

from __future__ import annotations

import logging
from typing import Any

from mmcache import _core

__all__ = ["inspect", "prune"]

logger = logging.getLogger("mmcache")


def inspect(name: str) -> dict[str, Any]:
    """Counters, occupancy, writer slots and per-reader outstanding references of the live
    segment ``name``.

    Everything the segment header publishes (``capacity``, ``bytes_in_use``, ``objects``,
    ``creator_pid``, ``creator_alive`` (whether any writer lives), ``max_writers``,
    ``writers`` with each writer slot's ``pid``, ``epoch`` and whether it is ``alive``,
    ``readers`` with each slot's ``outstanding`` references, and the store's counters), plus
    ``name`` and ``occupancy`` (``bytes_in_use`` as a fraction of ``capacity``).
    ``FileNotFoundError`` if there is no such segment; ``SegmentCorruptError`` if it is not a
    valid mmcache segment.
    """
    info = dict(_core.inspect_segment(name))
    capacity = info.get("capacity", 0)
    info["name"] = name
    info["occupancy"] = info.get("bytes_in_use", 0) / capacity if capacity else 0.0
    return info


def prune(*, dry_run: bool = False) -> list[str]:
    """Remove the segments this package created whose writers are all gone.

    Returns their names, sorted; with ``dry_run=True`` only lists them. A segment one of
    whose writers still runs — in any PID namespace: writers hold a lock on their segment that
    the kernel drops only when they die — is never touched. Truncated or garbage ``mmc_``
    segments whose writer is gone are removed too; a name that may still be being created,
    or that another mmcache version made and whose creator may run, is left and logged.
    """
    orphans = []
    for name in sorted(_core.list_segments()):
        try:
            status, why = _core.segment_status(name)
        except FileNotFoundError:
            continue  # unlinked between listing and reading: nothing left to prune
        except (_core.MmcacheError, OSError) as exc:
            logger.warning("skipping segment %s: %s", name, exc)
            continue
        if status == "undecided":
            logger.info("leaving segment %s: %s", name, why)
        if status != "orphaned":
            continue
        if not dry_run:
            # Judged again under a lock every remover takes: the name may have passed to a
            # new store since (a writer restarted under it), or be gone (another prune).
            try:
                removed = _core.remove_orphaned_segment(name)
            except (_core.MmcacheError, OSError) as exc:
                logger.warning("cannot remove segment %s: %s", name, exc)
                continue
            if not removed:
                continue
        orphans.append(name)
    return orphans
