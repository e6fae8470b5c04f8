"""Helpers shared by the test files (pytest puts this folder on sys.path)."""

from typing import Any

import torch


def same_item(a: Any, b: Any) -> bool:
    """Whether two items hold the same fields with bit-identical tensors of the same dtype."""
    return (
        isinstance(a, dict)
        and isinstance(b, dict)
        and a.keys() == b.keys()
        and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    )
