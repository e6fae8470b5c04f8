"""Our five classes skip their vLLM base's constructor (it would build the store they
replace), so whatever vLLM's inherited methods read on ``self`` must come from ours.

The attributes are found, not listed: every method (and property) our class inherits from a
vLLM class without overriding it is parsed, and each attribute it loads on its first
parameter (``self.x``, ``self.x += ...``) must be present on a constructed instance.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.multimodal.cache import (
    engine_receiver_cache_from_config,
    processor_cache_from_config,
    worker_receiver_cache_from_config,
)
from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache
from vllm.multimodal.cache.lru import LruKeyReplicatedReceiverCache, LruKeyReplicatedSenderCache
from vllm.multimodal.cache.shm import ShmObjectStoreReceiverCache, ShmObjectStoreSenderCache

import mmcache.vllm as mv
from vllm_helpers import MiB, vllm_config


def _functions(value: Any) -> list[Callable[..., Any]]:
    """The functions behind a class attribute whose code runs with an instance."""
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    if isinstance(value, classmethod):
        return [value.__func__]
    return [value] if inspect.isfunction(value) else []


def attributes_read(function: Callable[..., Any]) -> set[str]:
    """The attributes ``function`` loads on its first parameter."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef)
    if not definition.args.args:
        return set()
    me = definition.args.args[0].arg

    def on_me(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return node.attr if node.value.id == me else None
        return None

    read = set()
    for node in ast.walk(definition):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read.add(on_me(node))
        elif isinstance(node, ast.AugAssign):
            read.add(on_me(node.target))
    read.discard(None)
    return read  # type: ignore[return-value]


def inherited_from_vllm(cls: type) -> Iterator[tuple[str, Callable[..., Any]]]:
    """``(owner.name, function)`` for what ``cls`` inherits from vLLM and does not override."""
    for name in dir(cls):
        owner = next(c for c in cls.__mro__ if name in vars(c))
        if owner.__module__.partition(".")[0] == "vllm":
            for function in _functions(vars(owner)[name]):
                yield f"{owner.__qualname__}.{name}", function


def required_attributes(cls: type) -> dict[str, set[str]]:
    """For ``cls``, each attribute vLLM's inherited code reads, and which methods read it."""
    required: dict[str, set[str]] = {}
    for where, function in inherited_from_vllm(cls):
        for attribute in attributes_read(function):
            required.setdefault(attribute, set()).add(where)
    return required


def missing_attributes(cache: Any) -> dict[str, list[str]]:
    """What vLLM's inherited code would read on ``cache`` and not find, and where."""
    return {
        attribute: sorted(where)
        for attribute, where in required_attributes(type(cache)).items()
        if not hasattr(cache, attribute)
    }


@pytest.mark.parametrize(
    "vllm_class",
    [
        MultiModalProcessorOnlyCache,
        LruKeyReplicatedSenderCache,
        LruKeyReplicatedReceiverCache,
        ShmObjectStoreSenderCache,
        ShmObjectStoreReceiverCache,
    ],
)
def test_the_check_catches_a_constructor_that_sets_nothing(vllm_class: type) -> None:
    # A subclass that skips vLLM's constructor, as ours do, and sets nothing in its place.
    bare = type("Bare", (vllm_class,), {"__init__": lambda self: None})()
    assert set(missing_attributes(bare)) & {"_cache", "_shm_cache"}


@pytest.fixture(
    params=[
        "processor_only",
        "lru_sender",
        "lru_receiver",
        "shm_sender",
        "shm_receiver",
        "shm_sender_without_ring",
    ]
)
def cache(request: pytest.FixtureRequest) -> Iterator[Any]:
    """One of our classes as vLLM's factories build it (the last: the ``/dev/shm``
    fallback, which builds no ring)."""
    role = request.param
    if role == "processor_only":
        yield processor_cache_from_config(vllm_config("processor_only", MiB))
    elif role.startswith("lru"):
        config = vllm_config("lru", MiB)
        sender = role == "lru_sender"
        yield (processor_cache_from_config if sender else engine_receiver_cache_from_config)(config)
    elif role == "shm_sender_without_ring":
        stat = os.statvfs("/dev/shm")
        p0 = processor_cache_from_config(vllm_config("shm", 2 * stat.f_bavail * stat.f_frsize))
        assert p0.ring is None
        yield p0
        p0.close()
    else:
        config = vllm_config("shm", 4 * MiB)
        p0 = processor_cache_from_config(config)
        try:
            if role == "shm_sender":
                yield p0
            else:
                worker = worker_receiver_cache_from_config(config, object())
                yield worker
                worker._shm_cache.close()
        finally:
            p0.close()


def test_every_attribute_vllms_inherited_methods_read_is_set(cache: Any) -> None:
    assert type(cache) in mv.REPLACEMENTS.values()
    missing = missing_attributes(cache)
    assert not missing, f"{type(cache).__name__} lacks what vLLM's methods read: {missing}"
