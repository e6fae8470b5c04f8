"""The two methods of vLLM's frontend the adapter wraps, so that a request vLLM rejects after
the processor cache issued its handles gives them back (they would never reach a worker,
and the ring would keep their references for good).

* ``BaseRenderer._process_multimodal``, the render of a prompt's multimodal data (the cache
  lookups, the HF processor, the prompt's replacements, which fail for more items than
  placeholders), runs in :func:`~mmcache.vllm.sender.rendering`.
* ``InputProcessor.process_inputs`` checks a rendered prompt (its length, among others) and
  makes the engine's request of it: when it raises, the handles in the rendered prompt go
  back to the ring (and those of a prompt it rendered itself, through ``rendering``).

Both methods are the same in vLLM 0.32 and 0.33, and are bound by vLLM's constructors into
their async variants (``make_async``), so wrapping them on the classes before the engine is
built (the plugin's :func:`~mmcache.vllm.install`) covers ``LLM`` and ``AsyncLLM`` alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
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


def wrap() -> None:
    """Wrap the two methods (idempotent)."""
    for cls, name, wrapper in (
        (BaseRenderer, "_process_multimodal", _process_multimodal),
        (InputProcessor, "process_inputs", _process_inputs),
    ):
        method = getattr(cls, name)
        if not hasattr(method, _ORIGINAL):
            wrapped = wrapper(method)
            setattr(wrapped, _ORIGINAL, method)
            setattr(cls, name, wrapped)
