"""Attributes of PyTorch (or of Python's modules) replaced for the length of a block.

Capture changes how parts of PyTorch behave while it traces a program (make_fx's metadata records,
FakeTensorMode's cache, ``torch.cond`` under vmap, refusals of hooks and Python random draws); each
such change is a set of attributes replaced on entry and put back on exit, whatever happens inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ABSENT = object()


@contextlib.contextmanager
def patched(owner: Any, **replacements: Any) -> Iterator[None]:
    """Set ``owner.name = value`` for each keyword while the block runs, then restore each name as
    it was: the value ``owner`` itself held, or no attribute of its own when it had none (a class
    attribute a subclass inherited stays inherited; a patch made inside another's keeps the outer)."""
    own = vars(owner)
    saved = {name: own.get(name, _ABSENT) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, value in reversed(saved.items()):
            if value is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
