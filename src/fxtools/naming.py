"""Python identifiers for values, taken from the user's argument names and pytree paths.

``params['fc1.weight']`` becomes ``fc1_weight``, ``batch[0]`` becomes ``batch_0``,
``carry['a']`` becomes ``a`` unless another leaf is also called ``a``, in which case the
argument name is kept as a prefix (``carry_a``).
"""
from __future__ import annotations

import inspect
import keyword
import re

import builtins

from torch.utils._pytree import MappingKey, GetAttrKey, SequenceKey


_BUILTINS = set(dir(builtins))


def identifier(text: str) -> str:
    name = re.sub(r"\W+", "_", str(text)).strip("_") or "v"
    if name[0].isdigit():
        name = "_" + name
    return name + "_" if keyword.iskeyword(name) or name in _BUILTINS else name


def arg_names(f, n: int) -> list[str]:
    """Names of the first n positional parameters of f (falling back to arg0, arg1, ...)."""
    try:
        params = [
            p for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind != params[i].VAR_POSITIONAL:
            names.append(params[i].name)
        elif params and params[-1].kind == params[-1].VAR_POSITIONAL:
            names.append(f"{params[-1].name}_{i - len(params) + 1}")
        else:
            names.append(f"arg{i}")
    return [identifier(n) for n in names]


def _part(key) -> str:
    if isinstance(key, MappingKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    return str(key)


def leaf_names(paths, top_names: list[str]) -> list[str]:
    """One unique identifier per leaf of ``args``, given each leaf's key path."""
    short, long = [], []
    for path in paths:
        top = top_names[path[0].idx] if path else "arg"
        rest = [_part(k) for k in path[1:]]
        last_dict = max((i for i, k in enumerate(path[1:]) if isinstance(k, (MappingKey, GetAttrKey))), default=None)
        key_name = "_".join(rest[last_dict:]) if last_dict is not None else ""
        short.append(identifier(key_name if key_name[:1].isalpha() else "_".join([top, *rest])))
        long.append(identifier("_".join([top, *rest])))
    counts = {}
    for s in short:
        counts[s] = counts.get(s, 0) + 1
    names, used = [], set()
    for s, l in zip(short, long):
        name = s if counts[s] == 1 else l
        base, i = name, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        names.append(name)
    return names
