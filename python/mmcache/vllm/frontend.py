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
  blocking ``process_inputs`` on the renderer's thread pool), and ``BaseRenderer.__init__``
  binds ``_process_multimodal_async`` (``vllm serve``'s path: the render on the renderer's
  multimodal thread). vLLM's bindings drop the thread's result when the awaiting request is
  cancelled (a client that goes away while its images are processed), and with it the
  handles of a request nobody will send; the adapter's bindings give them back when that
  thread finishes.

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


def _rendered_items(prompt: Any) -> Iterator[tuple[Any, str | None]]:
    """The multimodal items of a rendered prompt (``{"type": ...}``), encoder's included,
    each with its hash (``None`` where the prompt has none for it)."""
    if not isinstance(prompt, Mapping):
        return
    for part in (prompt, prompt.get("encoder_prompt"), prompt.get("decoder_prompt")):
        if isinstance(part, Mapping) and isinstance(part.get("mm_kwargs"), Mapping):
            hashes = part.get("mm_hashes")
            for modality, items in part["mm_kwargs"].items():
                known = hashes.get(modality) if isinstance(hashes, Mapping) else None
                known = list(known) if isinstance(known, list | tuple) else []
                for i, item in enumerate(items):
                    yield item, known[i] if i < len(known) else None


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
            _release_render(self.renderer, prompt)
            raise

    return process_inputs


def _cache_of(renderer: Any) -> _SenderAdapter | None:
    """``renderer``'s processor cache when it is one of the adapter's senders."""
    cache = renderer.mm_processor_cache
    return cache if isinstance(cache, _SenderAdapter) else None


def _release_request(processor: Any, request: Any) -> None:
    """Give back the handles of ``request``, an engine request ``processor`` made."""
    if (cache := _cache_of(processor.renderer)) is not None:
        features = request.mm_features or ()
        cache.release_unsent(
            [feature.data for feature in features],
            [feature.mm_hash or feature.identifier for feature in features],
        )


def _release_render(renderer: Any, prompt: Any) -> None:
    """Give back the handles of ``prompt``, a prompt ``renderer`` rendered."""
    if (cache := _cache_of(renderer)) is not None:
        rendered = list(_rendered_items(prompt))
        cache.release_unsent([item for item, _ in rendered], [h for _, h in rendered])


def _release_abandoned(release: Callable[[Any], None], done: Future[Any]) -> None:
    """Give back the handles of what ``done`` made, which its caller abandoned (a call that
    raised gave them back itself)."""
    if not done.cancelled() and done.exception() is None:
        release(done.result())


def _keeping_future(
    executor: Any, blocking: Callable[..., Any], release: Callable[[Any], None]
) -> Callable[..., Any]:
    """vLLM's ``make_async(blocking, executor=executor)``, keeping hold of the thread's
    future: when the awaiting caller is cancelled, ``release`` gets the thread's result once
    it finishes."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        submitted = executor.submit(blocking, *args, **kwargs)
        try:
            return await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:
            submitted.add_done_callback(functools.partial(_release_abandoned, release))
            raise

    return run


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        executor = getattr(getattr(self, "renderer", None), "_executor", None)
        if executor is None or not hasattr(self, "process_inputs_async"):
            return  # not the frontend this module knows: vLLM's binding stays
        release = functools.partial(_release_request, self)
        self.process_inputs_async = _keeping_future(executor, self.process_inputs, release)

    return init


def _renderer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        executor = getattr(self, "_mm_executor", None)
        if executor is None or not hasattr(self, "_process_multimodal_async"):
            return  # not the renderer this module knows: vLLM's binding stays
        release = functools.partial(_release_render, self)
        self._process_multimodal_async = _keeping_future(
            executor, self._process_multimodal, release
        )

    return init


def wrap() -> None:
    """Wrap the four methods (idempotent)."""
    for cls, name, wrapper in (
        (BaseRenderer, "_process_multimodal", _process_multimodal),
        (InputProcessor, "process_inputs", _process_inputs),
        (InputProcessor, "__init__", _init),
        (BaseRenderer, "__init__", _renderer_init),
    ):
        method = getattr(cls, name)
        if not hasattr(method, _ORIGINAL):
            wrapped = wrapper(method)
            setattr(wrapped, _ORIGINAL, method)
            setattr(cls, name, wrapped)
