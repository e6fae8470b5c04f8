"""GPU check: host-to-device copies of a resolved item, pinned (``pin_memory=True``) against
plain ``copy=True`` tensors.

The item is one 3x448x448 float32 image (2.4 MB). P0 writes it into the ring; workers resolve
it four ways, and each resolved tensor is copied to the GPU (``copy_(..., non_blocking=True)``
into a preallocated device tensor, then a synchronize), many times:

- ``copy=True``: an ordinary (pageable) tensor, the baseline;
- ``copy=False, pin_memory=True``: a zero-copy view of the ring, whose mapping the receiver
  registered with CUDA at attach: a DMA straight out of shared memory, no CPU copy at all;
- ``copy=True, pin_memory=True``: copied into torch's pinned memory;
- a tensor from ``torch.empty(pin_memory=True)``, for reference.

Prints one table (median GB/s per case and the ratio to the baseline; the issue's target is
pinned >= 3x) and checks every device copy bit for bit. Runs in well under two minutes on a
CUDA machine; without one it says so and exits 0. Exit status 1 if a check fails.

Run: ``python benches/gpu_check.py [--iterations N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from mmcache import ShmReceiverCache, ShmSenderCache

SHAPE = (3, 448, 448)


def h2d_seconds(src: torch.Tensor, dst: torch.Tensor, iterations: int) -> float:
    """Median seconds of one host-to-device copy of ``src`` into ``dst``."""
    for _ in range(5):  # warm up
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to do")
        return 0

    item = {"pixel_values": torch.rand(SHAPE, generator=torch.Generator().manual_seed(0))}
    nbytes = item["pixel_values"].nbytes
    device = torch.device("cuda")
    dst = torch.empty(SHAPE, device=device)
    failures: list[str] = []
    rows: list[tuple[str, bool, float]] = []

    with ShmSenderCache(0.25, n_readers=3) as sender:
        receivers: dict[str, tuple[ShmReceiverCache, Any]] = {}
        for name, copy, pin in [
            ("copy=True (pageable, baseline)", True, False),
            ("copy=False, pin_memory=True (ring registered)", False, True),
            ("copy=True, pin_memory=True (pinned copy)", True, True),
        ]:
            receivers[name] = (ShmReceiverCache(sender.handle(), copy=copy, pin_memory=pin), pin)
        handle, _ = sender.get_and_update_item((item, None), "image")
        resolved: dict[str, torch.Tensor] = {}
        for name, (receiver, pin) in receivers.items():
            if pin and not receiver.pinned:
                failures.append(f"{name}: pinning did not take effect (see the warning above)")
            h = handle if not resolved else sender.get_and_update_item(None, "image")[0]
            out = receiver.get_and_update_item(h, "image")
            if out is None:
                raise RuntimeError("the item was not resolved")
            resolved[name] = out["pixel_values"]
            if receiver.pinned and not resolved[name].is_pinned():
                failures.append(f"{name}: the receiver is pinned but its tensor is not")
        resolved["torch.empty(pin_memory=True) (reference)"] = torch.empty(
            SHAPE, pin_memory=True
        ).copy_(item["pixel_values"])
        for name, tensor in resolved.items():
            # Cleared first: every case copies the same item, so a case whose copies moved
            # nothing would otherwise pass the check on what the previous case left.
            dst.zero_()
            seconds = h2d_seconds(tensor, dst, args.iterations)
            if not torch.equal(dst.cpu(), item["pixel_values"]):
                failures.append(f"{name}: the device copy differs from the item")
            rows.append((name, tensor.is_pinned(), seconds))
        del resolved, tensor
        for receiver, _ in receivers.values():
            receiver.close()

    baseline = rows[0][2]
    print(
        f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"{nbytes / 1e6:.1f} MB item, median of {args.iterations} copies, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'resolved as':<48} {'is_pinned':>9} {'H2D µs':>9} {'GB/s':>7} {'vs baseline':>12}")
    for name, pinned, seconds in rows:
        print(
            f"{name:<48} {pinned!s:>9} {seconds * 1e6:>9.1f} "
            f"{nbytes / seconds / 1e9:>7.1f} {baseline / seconds:>11.2f}x"
        )
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
