"""Page-locked ("pinned") host memory, so tensors resolved from the ring reach a CUDA device by
DMA (``.to("cuda", non_blocking=True)``) instead of through a staging copy.

Two ways, both through torch (imported only here, and only when pinning is asked for):

* zero-copy views: the reader's read-only mapping of the ring is registered with CUDA once
  (``cudaHostRegister`` with the read-only and portable flags, through torch's cudart
  binding), so every view into it is pinned memory;
* copies: the copy buffers come from torch's pinned allocator (``pin_memory=True``).

Pinning is best effort: :func:`pinning_unavailable` says why it cannot be done here, and the
caller falls back to plain memory with one warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

__all__ = ["HOST_REGISTER_FLAGS", "pinning_unavailable", "register_read_only"]

logger = logging.getLogger("mmcache")

_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context
_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads it
HOST_REGISTER_FLAGS = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY
"""The flags a read-only mapping is registered with."""

# This process's token, new in every forked child: a registration belongs to the process
# that made it.  A forked child inherits the receiver (and its finalizer) but not the CUDA
# context, which torch refuses to initialise there.  Not a PID: PIDs of different PID
# namespaces can be equal.
_process = [object()]
os.register_at_fork(after_in_child=lambda: _process.__setitem__(0, object()))


def pinning_unavailable() -> str | None:
    """Why host memory cannot be pinned in this process, or ``None`` if it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def _cuda_error(cudart: Any, err: Any) -> str:
    try:
        return f"{cudart.cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # the message is all this is for
        return str(err)


def register_read_only(address: int, length: int) -> Callable[[], None]:
    """Register ``length`` bytes of read-only host memory at ``address`` with CUDA; return the
    function that unregisters them (call it before the memory is unmapped; in a forked child
    it does nothing).

    Raises ``RuntimeError`` when CUDA refuses (no device, a driver without read-only
    registration, too little lockable memory, ...).
    """
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it untyped
    err = cudart.cudaHostRegister(address, length, HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {length} bytes failed: {_cuda_error(cudart, err)}")

    registered_in = _process[0]

    def unregister() -> None:
        if _process[0] is not registered_in:
            return  # a forked child's copy: the registration is its parent's
        # A DMA from this memory may still be queued (non_blocking copies): let it finish.
        torch.cuda.synchronize()
        err = cudart.cudaHostUnregister(address)
        if int(err) != 0:
            logger.warning("cudaHostUnregister failed: %s", _cuda_error(cudart, err))

    return unregister
