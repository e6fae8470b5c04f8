"""ShmReceiverCache(pin_memory=True): registration of the reader's mapping with CUDA, and the
fallback (one warning, the plain path) wherever pinning cannot be done.

CUDA itself is replaced by a recorder here, so these run the same on every machine;
``benches/gpu_check.py`` exercises the real thing on a GPU."""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from item_checks import same_item
from mmcache import ShmReceiverCache, ShmSenderCache, pinning

GiB = 1 << 30


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; fails registration with ``error``."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, length: int, flags: int) -> int:
        self.registered.append((address, length, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def cudaGetErrorString(self, error: int) -> str:
        return "cudaErrorNotSupported"


@pytest.fixture
def sender() -> Iterator[ShmSenderCache]:
    with ShmSenderCache(16 / 1024, max_object_size_mb=2) as cache:
        yield cache


def fake_cuda(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudart) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def item(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(3, 32, 32, generator=g), "grid": torch.tensor([1, 2, 3])}


def resolve(sender: ShmSenderCache, receiver: ShmReceiverCache, key: str, data: Any) -> Any:
    handle, _ = sender.get_and_update_item((data, None), key)
    return receiver.get_and_update_item(handle, key)


@pytest.mark.parametrize("copy", [True, False])
def test_without_cuda_one_warning_and_the_plain_path(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch, copy: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"pin_memory=True\): no CUDA device") as caught:
        receiver = ShmReceiverCache(sender.handle(), copy=copy, pin_memory=True)
    assert len(caught) == 1
    with receiver, warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing more while resolving
        assert not receiver.pinned
        for i in range(3):
            data = item(i)
            out = resolve(sender, receiver, f"k{i}", data)
            assert same_item(data, out)
            assert not out["pixel_values"].is_pinned()


def test_zero_copy_registers_the_read_only_mapping_once_and_close_unregisters(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cudart = FakeCudart()
    fake_cuda(monkeypatch, cudart)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        receiver = ShmReceiverCache(sender.handle(), copy=False, pin_memory=True)
    address, length = receiver._store.view_mapping()
    assert cudart.registered == [(address, length, pinning.HOST_REGISTER_FLAGS)]
    assert pinning.HOST_REGISTER_FLAGS == 0x01 | 0x08  # portable | read-only
    assert receiver.pinned
    data = item(0)
    out = resolve(sender, receiver, "k", data)
    assert same_item(data, out)
    assert address <= out["pixel_values"].data_ptr() < address + length
    assert cudart.registered == [(address, length, pinning.HOST_REGISTER_FLAGS)], "once"
    receiver.close()
    assert cudart.unregistered == [address]
    receiver.close()
    assert cudart.unregistered == [address], "close is idempotent"
    assert not receiver.pinned
    assert same_item(data, out), "views outlive close (unpinned)"


def test_a_dropped_receiver_unregisters_too(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cudart = FakeCudart()
    fake_cuda(monkeypatch, cudart)
    receiver = ShmReceiverCache(sender.handle(), copy=False, pin_memory=True)
    address = cudart.registered[0][0]
    del receiver
    gc.collect()
    assert cudart.unregistered == [address]


def test_refused_registration_warns_once_and_resolves_unpinned(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    cudart = FakeCudart(error=801)
    fake_cuda(monkeypatch, cudart)
    refused = "cudaHostRegister .* failed: cudaErrorNotSupported"
    with pytest.warns(RuntimeWarning, match=refused) as caught:
        receiver = ShmReceiverCache(sender.handle(), copy=False, pin_memory=True)
    assert len(caught) == 1
    with receiver:
        assert not receiver.pinned
        data = item(1)
        assert same_item(data, resolve(sender, receiver, "k", data))
    assert cudart.unregistered == [], "nothing was registered"


def test_pinned_copies_ask_torch_for_pinned_memory(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_cuda = torch.cuda.is_available()
    fake_cuda(monkeypatch, FakeCudart())
    with ShmReceiverCache(sender.handle(), copy=True, pin_memory=True) as receiver:
        assert receiver.pinned
        data = item(2)
        handle, _ = sender.get_and_update_item((data, None), "k")
        if real_cuda:
            out = receiver.get_and_update_item(handle, "k")
            assert same_item(data, out) and out["pixel_values"].is_pinned()
        else:
            # torch's pinned allocator refuses without a device: the request reached it (its
            # RuntimeError is the cause of the decoder's MemoryError).
            with pytest.raises(MemoryError, match="pinned memory") as refused:
                receiver.get_and_update_item(handle, "k")
            assert isinstance(refused.value.__cause__, RuntimeError)


def test_a_forked_child_leaves_its_parents_registration_alone(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The registration is the parent's (a child has no CUDA context of its own: torch refuses
    # to initialise CUDA there): closing or dropping the inherited receiver in the child
    # must neither raise nor unregister anything.
    cudart = FakeCudart()
    fake_cuda(monkeypatch, cudart)

    def refused(*args: Any) -> None:
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    receiver = ShmReceiverCache(sender.handle(), copy=False, pin_memory=True)
    address = cudart.registered[0][0]
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            monkeypatch.setattr(torch.cuda, "synchronize", refused)
            receiver.close()
            code = 0 if cudart.unregistered == [] else 2
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        receiver.close()
    assert cudart.unregistered == [address]


def test_close_frees_the_reader_slot_even_if_cuda_fails_to_unregister(
    sender: ShmSenderCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch, FakeCudart())
    receiver = ShmReceiverCache(sender.handle(), copy=False, pin_memory=True)

    def failed(*args: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", failed)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        receiver.close()
    # The one reader slot was given back all the same: a new reader attaches.
    ShmReceiverCache(sender.handle()).close()
