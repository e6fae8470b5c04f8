"""One base for everything that is closed by leaving its ``with`` block."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["ClosesOnExit"]


class ClosesOnExit:
    """``with obj:`` calls ``obj.close()`` on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
