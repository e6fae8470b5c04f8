"""Messages between the simulated processes: a msgpack header, tensors out of band.

One message on a :class:`multiprocessing.connection.Connection` is one frame holding the
msgpack-encoded ``[header, buffer_count]`` followed by ``buffer_count`` raw frames, each a
tensor's bytes sent straight from its memory (no pickle, no copy into the header). Every
connection has a single sender, so the frames of two messages never interleave (with several
frontends, each worker has a connection to each of them).

Items are flat mappings of field name to array; :func:`encode_item` describes each array by
dtype and shape in the header and appends its bytes to the message's buffers, and
:func:`decode_item` views them back without copying. A request's features travel as
:func:`encode_feature` entries: the hash, the truth digests of its tensors (or, for an item
another frontend processed, its image index), and its data, its shared-memory handle or
nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from mmcache import Feature, ShmHandle, WriterGoneError

#: The exit status of a process that stopped because a peer went away: never the cause of
#: a failed run, so the driver names the peer.
PEER_GONE = 3


@contextlib.contextmanager
def exit_when_peer_gone() -> Iterator[None]:
    """Exit with :data:`PEER_GONE`, without a traceback, when a peer process went away (a
    pipe closed, or the ring reports its writer gone): the peer failed, or the driver stopped
    the run (Ctrl-C), and the driver says which."""
    try:
        yield
    except (EOFError, BrokenPipeError, ConnectionResetError, WriterGoneError):
        raise SystemExit(PEER_GONE) from None


@dataclass
class Traffic:
    """Bytes one process sent: message headers, and tensor payloads out of band."""

    header_bytes: int = 0
    payload_bytes: int = 0

    @property
    def total(self) -> int:
        """Everything sent."""
        return self.header_bytes + self.payload_bytes


def send(
    conn: Connection,
    header: Mapping[str, Any],
    buffers: Sequence[memoryview] = (),
    *,
    traffic: Traffic | None = None,
) -> None:
    """Send ``header`` and ``buffers`` as one message, adding what was sent to ``traffic``."""
    head = msgpack.packb([header, len(buffers)], use_bin_type=True)
    conn.send_bytes(head)
    for buffer in buffers:
        conn.send_bytes(buffer)
    if traffic is not None:
        traffic.header_bytes += len(head)
        traffic.payload_bytes += sum(b.nbytes for b in buffers)


def recv(conn: Connection) -> tuple[dict[str, Any], list[bytes]]:
    """Receive one message sent by :func:`send`: its header and its buffers."""
    header, count = msgpack.unpackb(conn.recv_bytes(), raw=False)
    return header, [conn.recv_bytes() for _ in range(count)]


def encode_item(item: Mapping[str, Any], buffers: list[memoryview]) -> list[list[Any]]:
    """Describe ``item``'s arrays as ``[name, dtype, shape, buffer index]`` rows; append
    their bytes to ``buffers``."""
    fields = []
    for name, value in item.items():
        array = np.ascontiguousarray(np.asarray(value))
        fields.append([name, array.dtype.str, list(array.shape), len(buffers)])
        buffers.append(array.data.cast("B"))
    return fields


def decode_item(fields: list[list[Any]], buffers: list[bytes]) -> dict[str, np.ndarray]:
    """The item :func:`encode_item` described, as read-only arrays over ``buffers``."""
    return {
        name: np.frombuffer(buffers[index], dtype=np.dtype(dtype)).reshape(shape)
        for name, dtype, shape, index in fields
    }


def encode_handle(handle: ShmHandle) -> list[Any]:
    """An :class:`ShmHandle` as its three fields."""
    return [handle.address, handle.monotonic_id, handle.signature]


def decode_handle(fields: list[Any]) -> ShmHandle:
    """Inverse of :func:`encode_handle`."""
    address, monotonic_id, signature = fields
    return ShmHandle(address=address, monotonic_id=monotonic_id, signature=signature)


def encode_feature(feature: Feature, buffers: list[memoryview]) -> dict[str, Any]:
    """A feature as a message entry: its hash, its digests (``None`` where its P0 has no
    truth for it: then its image index instead), and its data, handle or nothing."""
    entry: dict[str, Any] = {"hash": feature.mm_hash, "digests": feature.extra["digests"]}
    if entry["digests"] is None:
        entry["image"] = feature.extra["image"]
    if isinstance(feature.data, ShmHandle):
        entry["handle"] = encode_handle(feature.data)
    elif feature.data is not None:
        entry["item"] = encode_item(feature.data, buffers)
    return entry


def decode_feature(entry: dict[str, Any], buffers: list[bytes]) -> Feature:
    """Inverse of :func:`encode_feature` (arrays are views of ``buffers``)."""
    if "handle" in entry:
        data: Any = decode_handle(entry["handle"])
    elif "item" in entry:
        data = decode_item(entry["item"], buffers)
    else:
        data = None
    return Feature(
        data=data,
        mm_hash=entry["hash"],
        identifier=entry["hash"],
        digests=entry["digests"],
        image=entry.get("image"),
    )
