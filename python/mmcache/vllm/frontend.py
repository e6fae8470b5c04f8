"""The methods of vLLM's frontend the adapter wraps, so that a request vLLM rejects after
the processor cache issued its handles, or whose caller stops waiting for it, gives them back
(they would never reach a worker, and the ring would keep their references for good).

* ``BaseRenderer._process_multimodal``, the render of a prompt's multimodal data (the cache
  lookups, the HF processor, the prompt's replacements, which fail for more items than
  placeholders), runs in :func:`~mmcache.vllm.sender.rendering`.
* ``InputProcessor.process_inputs`` checks a rendered prompt (its length, among others) and
  makes the engine's request of it: when it raises, the handles in the rendered prompt go
  back to the ring (and those of a prompt it rendered itself, through ``rendering``).

* ``InputProcessor.__init__`` binds ``process_inputs_async`` (``AsyncLLM``'s path: the
  blocking ``process_inputs`` on the renderer's thread pool). vLLM's binding drops the
  thread's result when the awaiting request is cancelled (a client that goes away while its
  images are processed), and with it the handles of a request nobody will send; the
  adapter's binding gives them back when that thread finishes.

These methods are the same in vLLM 0.32 and 0.33, and are bound by vLLM's constructors into
their async variants (``make_async``), so wrapping them on the classes before the engine is
built (the plugin's :func:`~mmcache.vllm.install`) covers ``LLM`` and ``AsyncLLM`` alike.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from vllm.renderers.base import BaseRenderer
from vllm.v1.engine.input_processor import InputProcessor

from mmcache.vllm.sender import _SenderAdapter, rendering

__all__ = ["wrap"]

_ORIGINAL = "__mmcache_original__"


def _rendered_items(prompt: Any) -> Iterator[Any]:
    """The multimodal items of a rendered prompt (``{"type": ...}``), encoder's included."""
    if not isinstance(prompt, Mapping):
        return
    for part in (prompt, prompt.get("encoder_prompt"), prompt.get("decoder_prompt")):
        if isinstance(part, Mapping) and isinstance(part.get("mm_kwargs"), Mapping):
            for items in part["mm_kwargs"].values():
                yield from items


def _process_multimodal(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_multimodal(self: Any, *args: Any, **kwargs: Any) -> Any:
        with rendering():
            return original(self, *args, **kwargs)

    return process_multimodal


def _process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def process_inputs(self: Any, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            with rendering():
                return original(self, request_id, prompt, *args, **kwargs)
        except BaseException:
            cache = self.renderer.mm_processor_cache
            if isinstance(cache, _SenderAdapter) and isinstance(prompt, Mapping):
                cache.release_unsent(list(_rendered_items(prompt)))
            raise

    return process_inputs


def _release_abandoned(processor: Any, done: Future[Any]) -> None:
    """Give back the handles of the request ``done`` made, which its caller abandoned (a
    ``process_inputs`` that raised gave them back itself)."""
    if done.cancelled() or done.exception() is not None:
        return
    cache = processor.renderer.mm_processor_cache
    if isinstance(cache, _SenderAdapter):
        cache.release_unsent([feature.data for feature in done.result().mm_features or ()])


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        executor = getattr(self.renderer, "_executor", None)
        if executor is None or not hasattr(self, "process_inputs_async"):
            return  # not the frontend this module knows: vLLM's binding stays

        async def process_inputs_async(*args: Any, **kwargs: Any) -> Any:
            # vLLM's make_async, keeping hold of the thread's future.
            submitted = executor.submit(self.process_inputs, *args, **kwargs)
            try:
                return await asyncio.wrap_future(submitted)
            except asyncio.CancelledError:
                submitted.add_done_callback(functools.partial(_release_abandoned, self))
                raise

        self.process_inputs_async = process_inputs_async

    return init


def wrap() -> None:
    """Wrap the three methods (idempotent)."""
    for cls, name, wrapper in (
        (BaseRenderer, "_process_multimodal", _process_multimodal),
        (InputProcessor, "process_inputs", _process_inputs),
        (InputProcessor, "__init__", _init),
    ):
        method = getattr(cls, name)
        if not hasattr(method, _ORIGINAL):
            wrapped = wrapper(method)
            setattr(wrapped, _ORIGINAL, method)
            setattr(cls, name, wrapped)
