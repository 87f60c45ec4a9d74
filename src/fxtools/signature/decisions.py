"""The decision a generated module is checking, while fxtools traces that module inside another.

``hvp`` traces a ``grad`` module: the inner module's guards run on symbolic sizes and fake tensors,
so repeating a decision its trace made (``x.size(0) % 2 == 0``) or a layout read
(``x.is_contiguous()``) records a new guard or read in the outer trace. That one was decided at
the inner module's line, not in fxtools' checking code: ``signature/sizes.py`` (size guards) and
``capture/layout_reads.py`` (layout reads) ask ``current()`` for it. Saved modules carry no such
record: their ``Guards.deciding`` just checks (``signature/runtime.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["Decision", "checking", "current"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """A decision being checked: the user's line that made it (``where``; empty where none did)
    and its ``kind``: "decided" (on symbolic sizes) or "read" (of a layout)."""

    where: str
    kind: str


_CHECKING: ContextVar[tuple[Decision, ...]] = ContextVar("fxtools_checking", default=())


@contextlib.contextmanager
def checking(decision: Decision) -> Iterator[None]:
    """Within: ``decision`` is the one being checked (innermost wins)."""
    token = _CHECKING.set((*_CHECKING.get(), decision))
    try:
        yield
    finally:
        _CHECKING.reset(token)


def current() -> Decision | None:
    """The decision being checked now, if any."""
    stack = _CHECKING.get()
    return stack[-1] if stack else None
