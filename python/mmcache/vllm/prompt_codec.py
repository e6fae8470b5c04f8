"""vLLM's prompt updates as bytes, so that every API server sharing a ring returns them.

A hit on an item another API server put must return the prompt updates that server gave:
they are stored with the item (:mod:`mmcache.prompt_updates`, as a ``(dumps, loads)``
codec).  vLLM's are ``ResolvedPromptUpdate`` dataclasses that plain :mod:`pickle` cannot
take, for the functions they hold:

* ``PromptUpdateDetails.is_embed``, a closure (``select_token_id`` and its kind) that vLLM
  only ever calls on the details' own ``full`` tokens (``_apply_matches`` and
  ``_iter_placeholders`` in ``vllm/multimodal/processing/processor.py``, 0.32 and 0.33).  It
  is stored as the mask it gives for them, which :class:`PrecomputedMask` returns.
* ``PromptIndex`` targets (``PromptIndexTargets.start()``, ``prefix(seq)``, ``end()``), whose
  lambdas and closures ``cloudpickle`` (a dependency of vLLM) stores by value.

Decoding runs code, which is why the store keeps prompt updates only for writers that opted
in; every writer of a ring holds its secret, so they trust each other as much as the process
that started them.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle
import torch
from vllm.multimodal.processing.processor import PromptUpdateDetails

__all__ = ["PROMPT_UPDATES_CODEC", "PrecomputedMask", "dumps", "loads"]


class PrecomputedMask:
    """``is_embed`` of a ``PromptUpdateDetails`` whose content is ``full``: the mask the
    original function gave for ``full`` (a copy of it each call, as the original made a new
    one).  ``ValueError`` for other tokens, which vLLM never passes."""

    def __init__(self, full: list[int], mask: torch.Tensor) -> None:
        self.full = list(full)
        self.mask = mask

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        if list(tokens) != self.full:
            raise ValueError(
                "mmcache stored this is_embed as its mask for the details' own tokens; it "
                "cannot be applied to other tokens"
            )
        return self.mask.clone()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is PromptUpdateDetails
            and obj.is_embed is not None
            and not isinstance(obj.is_embed, PrecomputedMask)
        ):
            mask = PrecomputedMask(obj.full, obj.is_embed(obj.full))
            return PromptUpdateDetails, (obj.full, mask)
        return super().reducer_override(obj)


def dumps(prompt_updates: Any) -> bytes:
    """``prompt_updates`` (vLLM's, or any picklable value) as bytes for :func:`loads`."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(prompt_updates)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """What :func:`dumps` was given (its ``is_embed`` functions as :class:`PrecomputedMask`)."""
    return pickle.loads(data)


PROMPT_UPDATES_CODEC = (dumps, loads)
"""The ``prompt_updates_codec`` of the plugin's rings."""
