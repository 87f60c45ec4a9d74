"""Guards written into a standalone module (``fxtools.save``): the runtime's source and the data.

A saved module carries the checking code of ``signature/runtime.py`` (its block between the
``runtime (begin)`` and ``runtime (end)`` markers, verbatim) and, per guarded function, Python
source that rebuilds its ``Guards`` with those classes.
"""

from __future__ import annotations

import inspect

import torch

from ..signature import runtime
from ..signature.naming import literal
from ..signature.runtime import Cond, Guards, Leaf, Read, Sym

__all__ = ["runtime_source", "render"]


def runtime_source() -> str:
    """The checking code, as written into standalone modules (after an InputMismatch class)."""
    text = inspect.getsource(runtime)
    start = text.index("# ---- runtime (begin)")
    start = text.index("\n", start) + 1
    end = text.index("# ---- runtime (end) ----")
    return (
        "class InputMismatch(ValueError):\n"
        '    """Arguments the module was not made for."""\n\n\n' + text[start:end].strip() + "\n"
    )


def _literal(v) -> str:
    if v is None or type(v) in (bool, int, float, complex, str):  # exactly: a subclass's repr is user code
        return literal(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(map(_literal, v)) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.device):
        return f"torch.device({str(v)!r})"
    if isinstance(v, Sym):
        return f"Sym({v.name!r}, {v.min!r}, {v.max!r})"
    if isinstance(v, Cond):
        return f"Cond({v.text!r}, {v.test!r}, {_literal(tuple(v.names))}, {v.where!r})"
    if isinstance(v, Read):
        return f"Read({v.kind!r}, {_literal(v.want)}, {v.where!r})"
    if isinstance(v, (torch.memory_format, torch.layout)):
        return str(v)
    raise TypeError(type(v))


def render(guards: Guards, indent: str = "") -> str:
    """Python source that rebuilds ``guards`` with the runtime classes (for fxtools.save)."""

    def spec(s, ind):
        if type(s) is Leaf:
            kind, value = s.kind, s.value
            if kind == "object":
                try:
                    value_text = _literal(value)
                except TypeError:
                    kind, value_text = "type", repr(type(value).__name__)
            else:
                value_text = _literal(value)
            fields = [repr(s.path), repr(kind)]
            extra = [
                ("sizes", _literal(tuple(s.sizes)) if s.sizes else None),
                ("dtype", str(s.dtype) if s.dtype is not None else None),
                ("device", repr(s.device) if s.device is not None else None),
                ("layout", repr(s.layout) if s.layout is not None else None),
                ("value", value_text if value is not None else None),
                ("role", repr(s.role) if s.role else None),
                ("reads", _literal(tuple(s.reads)) if s.reads else None),
                ("layout_by", repr(s.layout_by) if s.layout_by else None),
            ]
            fields += [f"{k}={v}" for k, v in extra if v is not None]
            return f"{ind}Leaf({', '.join(fields)})"
        inner = ",\n".join(spec(c, ind + "    ") for c in s.children)
        head = f"{ind}Node({s.path!r}, {s.kind!r}, {s.type_name!r}, {_literal(tuple(s.keys))}, ("
        return f"{head}\n{inner},\n{ind}))" if s.children else head + "))"

    args = ",\n".join(spec(a, indent + "    ") for a in guards.args)
    conds = "".join(f"\n{indent}    {_literal(c)}," for c in guards.conditions)
    conditions = f", conditions=({conds}\n{indent})" if conds else ""
    autocast = f", autocast={_literal(guards.autocast)}" if guards.autocast else ""
    shared = f", shared={_literal(guards.shared)}, written={_literal(guards.written)}" if guards.shared is not None else ""
    return f"Guards({guards.made_by!r}, {_literal(tuple(guards.names))}, (\n{args},\n{indent}){conditions}{autocast}{shared})"
