"""What callers pass the caches, checked: the errors that name the argument and the call that
was meant (one value where a list goes, a hash, in a list or a feature's key too, of the
wrong type or no valid UTF-8, data that is no item, a flag that is no bool, a size function
that is none, a capacity in bytes), and ``capacity_gb`` as bytes."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

GiB = 1 << 30
MAX_CAPACITY_GB = 1 << 14
"""The most ``capacity_gb`` any cache takes: 16 TiB, the ring's limit (the core's), more
memory than one host gives a cache. Above it lies a capacity in bytes mistaken for GiB (of
any size from 16 KiB): an LRU that never evicts until the process runs out of memory."""


def check_list(values: object, method: str, what: str, one: str) -> None:
    """``TypeError`` for one value where ``method`` takes a list of ``what`` (``one``: the
    call meant): one str (or bytes), which is iterable too and would be read as a list of
    one-character ``what``, or anything not iterable (one feature, one handle), which would
    fail as "not iterable" deep inside."""
    if not isinstance(values, str | bytes):
        try:
            iter(values)  # type: ignore[call-overload]
            return
        except TypeError:
            pass
    raise TypeError(f"{method} takes a list of {what}, not one {type(values).__name__}: {one}")


def _one_item_call(method: str) -> str:
    """The calls meant by one item for batched ``method``'s list."""
    return f"{method}([item], [mm_hash]) or {method}_item(item, mm_hash)"


def check_item_list(items: Iterable[Any], method: str) -> Sequence[Any]:
    """:func:`check_list` for the ``items`` of ``method``, where one item (a mapping) is
    refused too: it is iterable, over its field names.  Returns them as a sequence (an
    iterator read into a list: the call reads them more than once)."""
    one = _one_item_call(method)
    if isinstance(items, Mapping):
        raise TypeError(f"{method} takes a list of items, not one {type(items).__name__}: {one}")
    check_list(items, method, "items", one)
    return items if isinstance(items, Sequence) else list(items)


_HASH_LIST_CALLS = {
    # method: (its arguments, the call meant by one hash)
    "is_cached": ("mm_hashes", "is_cached([mm_hash]) or is_cached_item(mm_hash)"),
    "get_and_update": ("items, mm_hashes", _one_item_call("get_and_update")),
    "settle_recency": ("mm_hashes", "settle_recency([mm_hash])"),
    "undo_recency": ("mm_hashes", "undo_recency([mm_hash])"),
}


def check_hash_list(mm_hashes: Iterable[str], method: str = "is_cached") -> Sequence[str]:
    """:func:`check_list` for the ``mm_hashes`` of ``method`` (one of ``_HASH_LIST_CALLS``),
    then :func:`check_hash_types`; returns them as a sequence (an iterator read into a list,
    as the check reads them)."""
    arguments, one = _HASH_LIST_CALLS[method]
    check_list(mm_hashes, method, "mm_hashes", one)
    if not isinstance(mm_hashes, Sequence):
        mm_hashes = list(mm_hashes)
    check_hash_types(mm_hashes, f"{method}({arguments})")
    return mm_hashes


def check_hash_types(keys: Sequence[object], call: str, name: str = "mm_hashes[{}]") -> None:
    """``TypeError`` naming ``call`` and the first of ``keys`` that is not a str (``name``,
    formatted with its index, says what it is): an int, a tuple or bytes is hashable, so an
    LRU would key items by it, where the ring (and SPEC) takes only a str."""
    # On every batched call (vLLM's is_cached): the common case, all exact strs, in the
    # cheapest loop (no index kept: 160 ns for five keys where enumerate took 270).
    for key in keys:
        if type(key) is not str:
            break
    else:
        return
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            raise TypeError(f"{call}: {name.format(i)} must be a str, not {type(key).__qualname__}")


def check_feature_list(features: object) -> None:
    """:func:`check_list` for the ``features`` of ``get_and_update_features``."""
    check_list(
        features, "get_and_update_features", "features", "get_and_update_features([feature])"
    )


def not_features(features: Sequence[object], error: AttributeError) -> TypeError:
    """The error for a list of ``features`` that holds something else (the data itself, say),
    which has no ``mm_hash`` or ``identifier`` to key it by (``error``: what reading them
    raised)."""
    # A list, not next(..., None): what it finds may be None itself.
    others = [f for f in features if not (hasattr(f, "mm_hash") and hasattr(f, "identifier"))]
    what = f"not of {type(others[0]).__qualname__}" if others else f"({error})"
    return TypeError(
        "get_and_update_features takes a list of features (with data, mm_hash and "
        f"identifier), {what}: pass data to get_and_update"
    )


def feature_keys(features: Sequence[Any]) -> list[str]:
    """The cache key of each of ``features`` (its ``mm_hash``, else its ``identifier``), read
    before anything is resolved: :func:`not_features`' error for a list that holds something
    else, :func:`check_hash_types`' for a key that is not a str."""
    try:
        keys = [f.mm_hash or f.identifier for f in features]
    except AttributeError as exc:
        raise not_features(features, exc) from None
    check_hash_types(
        keys,
        "get_and_update_features(features)",
        "features[{}]'s key (its mm_hash, else its identifier)",
    )
    return keys


def unstorable_hash(mm_hash: str) -> ValueError:
    """The error for an ``mm_hash`` that is not valid Unicode text (it holds a lone
    surrogate): the shared-memory ring keys objects by UTF-8, so every mode refuses it alike."""
    return ValueError(f"mm_hash {mm_hash!r} holds a lone surrogate (it is no valid UTF-8)")


def check_mm_hash(mm_hash: str, call: str) -> None:
    """:func:`check_mm_hash_type`'s error for an ``mm_hash`` of ``call`` that is not a str,
    :func:`unstorable_hash`'s for one that is no valid UTF-8."""
    if type(mm_hash) is not str:
        check_mm_hash_type(call, mm_hash)  # a subclass of str passes
    if not mm_hash.isascii():
        try:
            mm_hash.encode()
        except UnicodeEncodeError:
            raise unstorable_hash(mm_hash) from None


def check_mm_hash_type(call: str, mm_hash: object) -> None:
    """Called on a ``TypeError``: raise one naming ``call``'s ``mm_hash`` unless it is a str
    (the arguments swapped, a list where one hash goes); else return, for the caller to
    re-raise the original."""
    if not isinstance(mm_hash, str):
        message = f"{call}: mm_hash must be a str, not {type(mm_hash).__qualname__}"
        raise TypeError(message) from None


def receiver_type_error(cache: str, takes: str, item: object, mm_hash: str) -> TypeError:
    """What receiver ``cache`` raises for data that is not what it ``takes``."""
    # A pair is most likely P0's whole output for the item, sent as its data.
    pair = isinstance(item, tuple) and len(item) == 2
    hint = ": P0's output is (data, prompt_updates); send its data" if pair else ""
    return TypeError(
        f"{cache} takes {takes} as the data of {mm_hash}, not {type(item).__qualname__}{hint}"
    )


def check_getsizeof(getsizeof: object) -> None:
    """``TypeError`` unless ``getsizeof`` is callable: anything else failed at the first put
    (an int), or, ``None``, made the LRU count each item as 1 byte (cachetools' default)."""
    if not callable(getsizeof):
        raise TypeError(
            "getsizeof must be a function of an item returning its size in bytes, not "
            f"{type(getsizeof).__name__}"
        )


def flag(name: str, value: object) -> bool:
    """``value`` as a bool (``numpy.bool_`` too), or a ``TypeError`` naming ``name``: a
    truthy string ("no") or number would silently turn the option on."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {value!r}")


def wait_seconds(wait_s: object) -> float:
    """``wait_s`` (how long ``is_cached`` may wait for claims held elsewhere) as a float:
    ``ValueError`` naming it unless an int or a float (not a bool: ``wait_s=True`` would
    wait a second) that is finite and >= 0.  An int past the largest float is a wait with no
    practical end: the largest float, not an ``OverflowError`` part-way through the call."""
    if isinstance(wait_s, int | float) and not isinstance(wait_s, bool) and 0 <= wait_s < math.inf:
        return sys.float_info.max if wait_s > sys.float_info.max else float(wait_s)
    raise ValueError(f"wait_s must be a finite number of seconds >= 0, not {wait_s!r}")


def capacity_bytes(capacity_gb: float) -> int:
    """``capacity_gb`` GiB as whole bytes (``ValueError`` unless a finite, non-negative
    number of at most :data:`MAX_CAPACITY_GB`; ``TypeError`` unless a number)."""
    try:
        valid = capacity_gb >= 0 and math.isfinite(capacity_gb)
    except TypeError:
        raise TypeError(
            f"capacity_gb must be a number of GiB, not {type(capacity_gb).__name__}"
        ) from None
    except OverflowError:  # an int past the largest float: finite all the same
        valid = True
    if not valid:
        raise ValueError(f"capacity_gb must be a finite, non-negative number, not {capacity_gb!r}")
    if capacity_gb > MAX_CAPACITY_GB:
        raise ValueError(
            f"capacity_gb is in GiB: {capacity_gb!r} GiB asked, more than {MAX_CAPACITY_GB} GiB "
            f"(16 TiB, the most a cache holds); was it given in bytes?"
        )
    # Exact: a float times a power of two is (so P0's and P1's lru bounds are the same bytes).
    return int(capacity_gb * GiB)


def check_max_object_size_mb(max_object_size_mb: float) -> None:
    """``ValueError`` unless ``max_object_size_mb`` is a positive number (``TypeError``
    unless a number)."""
    try:
        positive = max_object_size_mb > 0
    except TypeError:
        raise TypeError(
            f"max_object_size_mb must be a number of MiB, not {type(max_object_size_mb).__name__}"
        ) from None
    if not positive:
        raise ValueError(f"max_object_size_mb must be positive, not {max_object_size_mb!r}")


def check_n_readers(n_readers: int) -> None:
    """``ValueError`` unless ``n_readers`` (a number of workers) is at least 1 (``TypeError``
    unless an int).  A ring's own bound (its reader slots) is the core's to check."""
    if not isinstance(n_readers, int):
        raise TypeError(
            f"n_readers must be an int (the number of workers), not {type(n_readers).__name__}"
        )
    if n_readers < 1:
        raise ValueError(f"n_readers must be at least 1 (the number of workers), not {n_readers!r}")
