"""Python identifiers for values, and the only literals generated code may contain.

Names: ``params['fc1.weight']`` becomes ``fc1_weight``, ``batch[0]`` becomes ``batch_0``,
``carry['a']`` becomes ``a`` unless another leaf is also called ``a``, in which case the
argument name is kept as a prefix (``carry_a``). Every name is in Python's normal form (NFKC:
Python reads ``ﬁ`` as ``fi``, so two names that differ only there would be one variable) and
is never a keyword, a builtin, ``self`` or a global the generated code uses (``torch``).

Literals: text from user data (dict keys, output constants) reaches generated code only as a
literal of a built-in type (``str``, ``int``, ``float``, ``bool``, ``complex``, ``None``),
converted by ``plain_literal`` from subclasses and numpy scalars (never through the object's
own ``repr``), or as an enum member ``Class.NAME`` whose name is an identifier. Anything else
is refused with an ``FxtoolsError``.
"""

from __future__ import annotations

import builtins
import cmath
import enum
import functools
import inspect
import keyword
import operator
import re
import reprlib
import unicodedata

from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey

from ..errors import FxtoolsError

_BUILTINS = set(dir(builtins))
# globals generated code (torch.fx's) refers to by these names, and its method's own ``self``
SHADOWS = frozenset({"self", "torch", "inf", "nan", "NoneType", "device", "fx_pytree", "pytree"})
# ... and names a module written by fxtools.save binds at its top level
RESERVED = SHADOWS | {"os", "_stored"}
PLAIN_TYPES = (str, int, float, bool, complex, type(None))


def identifier(text: str) -> str:
    """A valid, NFKC-normal Python identifier made from ``text`` (not a keyword, builtin or reserved name)."""
    return _identifier(str(text))


@functools.lru_cache(maxsize=8192)  # asked for every name of every build, mostly the same ones
def _identifier(text: str) -> str:
    name = unicodedata.normalize("NFKC", text)
    name = "".join(c if ("_" + c).isidentifier() else "_" for c in name)
    name = re.sub(r"_+", "_", name).strip("_") or "v"
    if name[0].isdigit():
        name = "_" + name
    name = unicodedata.normalize("NFKC", name)
    if not name.isidentifier():  # a character whose normal form is not an identifier character
        name = "v_" + re.sub(r"[^0-9a-zA-Z_]", "_", name)
    return name + "_" if is_taken_name(name) else name


def is_taken_name(name: str) -> bool:
    """Whether ``name`` would shadow something generated code needs (a keyword, builtin, ``torch``, ``self``)."""
    return keyword.iskeyword(name) or name in _BUILTINS or name in RESERVED


def is_plain_identifier(name) -> bool:
    """Whether ``name`` may be written into code as it is: an NFKC-normal identifier, not a keyword."""
    return (
        type(name) is str and name.isidentifier() and not keyword.iskeyword(name) and unicodedata.normalize("NFKC", name) == name
    )


def unique(names: list[str], taken=()) -> list[str]:
    """``names`` with later duplicates (and names in ``taken``) given a suffix: ``x``, ``x_1``."""
    used, out = set(taken), []
    for base in names:
        name, i = base, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        out.append(name)
    return out


def _short(value) -> str:
    try:
        return reprlib.repr(value)
    except Exception:  # noqa: BLE001 - a user object whose repr fails
        return f"<{type(value).__name__} object>"


def _candidates(value):
    """Built-in values that ``value`` (a subclass instance or a numpy scalar) may stand for."""
    for base in (bool, int, float, complex, str):
        if isinstance(value, base):
            yield {bool: bool, int: int.__int__, float: float.__float__, complex: complex.__complex__, str: str.__str__}[base](
                value
            )
            return
    if hasattr(type(value), "__index__"):
        try:
            yield operator.index(value)
        except TypeError:
            pass
    if hasattr(type(value), "__float__"):
        try:
            yield float(value)
        except (TypeError, ValueError):
            pass


def plain_literal(value, where: str, *, key: bool = False):
    """``value`` as a plain built-in literal that equals it and hashes like it (so that it indexes
    the same dict entry), or an enum member whose name is an identifier; tuples are converted
    element by element. With ``key``, the value must also equal itself (``d[nan]`` finds nothing).
    Anything else raises an FxtoolsError naming ``where``."""
    found = _plain(value)
    if found is not _NOT_PLAIN and (not key or _self_equal(found)):
        return found
    raise FxtoolsError(
        f"{where} is {_short(value)} (a {type(value).__module__}.{type(value).__qualname__}), which fxtools "
        "cannot write into generated code: dict keys and constants must be str, int, float, bool, None "
        "(or equal to one, such as a numpy integer), tuples of them, or enum members"
        + (", and a key must equal itself to index a dict (nan does not)" if key else "")
        + ". Use such values instead (for a key, e.g. str(key))."
    )


_NOT_PLAIN = object()


def literal(v) -> str:
    """Python source for a plain value (what ``plain_literal`` returns), exact on reload:
    infinities and NaN as ``float('inf')`` / ``float('nan')``, complex numbers by their parts,
    tuples element by element."""
    if isinstance(v, float):
        if cmath.isnan(v):
            return "float('nan')"
        if cmath.isinf(v):
            return "float('inf')" if v > 0 else "-float('inf')"
        return repr(v)
    if isinstance(v, complex):
        return f"complex({literal(v.real)}, {literal(v.imag)})"
    if type(v) is tuple:
        return "(" + ", ".join(map(literal, v)) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def _self_equal(value) -> bool:
    if isinstance(value, tuple):
        return all(_self_equal(v) for v in value)
    return isinstance(value, enum.Enum) or value == value


def _plain(value):
    if type(value) is complex and not cmath.isfinite(value):
        return _NOT_PLAIN  # repr gives (nan+infj), which is no Python expression
    if type(value) in PLAIN_TYPES:
        return value
    if type(value) is tuple:
        items = tuple(_plain(v) for v in value)
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, enum.Enum):
        ok = is_plain_identifier(value.name) and getattr(type(value), value.name, None) is value
        return value if ok else _NOT_PLAIN  # torch.fx writes Class.NAME, referring to the class itself
    for c in _candidates(value):
        try:
            same = type(c) in PLAIN_TYPES and bool(c == value) and bool(value == c) and hash(c) == hash(value)
        except Exception:  # noqa: BLE001 - a user type whose comparison or hash fails
            same = False
        if same:
            return c
    return _NOT_PLAIN


def repr_safe(value) -> bool:
    """Whether torch.fx may print ``value`` with ``repr`` (it does so inside dicts and namedtuples):
    nodes, exact built-in literals, dtypes, devices, layouts, memory formats and containers of them."""
    import torch
    import torch.fx as fx

    if isinstance(value, fx.Node) or type(value) in PLAIN_TYPES:
        return True
    if type(value) in (torch.dtype, torch.device, torch.layout, torch.memory_format):
        return True
    if type(value) in (tuple, list) or isinstance(value, (fx.immutable_collections.immutable_list,)):
        return all(repr_safe(v) for v in value)
    if type(value) is dict or isinstance(value, fx.immutable_collections.immutable_dict):
        return all(repr_safe(k) and repr_safe(v) for k, v in value.items())
    return False


def arg_names(f, n: int) -> list[str]:
    """Names of the first n positional parameters of f (falling back to arg0, arg1, ...)."""
    try:
        params = [
            p
            for p in inspect.signature(f).parameters.values()
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
    return unique([identifier(n) for n in names])


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


def op_base(node) -> str:
    """The name of a node's op without overload or counter: ``matmul`` for ``aten.matmul.default``."""
    target = node.target
    name = getattr(getattr(target, "overloadpacket", target), "__name__", None) or re.sub(r"_\d+$", "", node.name)
    return name.strip("_") or "v"


def shortest_unique_suffixes(paths: list[str]) -> dict[str, str]:
    """Each dotted module path's shortest suffix no other path ends with, as an identifier:
    ``h.3.attn.c_proj`` -> ``attn_c_proj`` beside ``h.3.mlp.c_proj``; a suffix starting with a
    list index takes its list's name too (``h_3``, never ``3``)."""
    parts = {p: tuple(p.split(".")) for p in paths}
    ends: dict[tuple, int] = {}  # suffix -> how many paths end with it
    for ps in parts.values():
        for k in range(1, len(ps) + 1):
            ends[ps[-k:]] = ends.get(ps[-k:], 0) + 1
    out = {}
    for p, ps in parts.items():
        for k in range(1, len(ps) + 1):
            if k < len(ps) and ps[-k][:1].isdigit():
                continue
            if ends[ps[-k:]] == 1:  # no other path ends so
                break
        out[p] = identifier("_".join(ps[-k:]))
    return out


_SHORT_OPS = {"transpose": "t", "mT": "t", "numpy_T": "t", "to_copy": "to", "sym_size": "size", "sym_numel": "numel"}


def short_op(node) -> str:
    """A short name for a node's op, for the intermediate values named after it (``v_t``); a
    collective's adds the mesh dimension it runs over (``all_reduce_tp``)."""
    base = op_base(node)
    return _SHORT_OPS.get(base, base) + mesh_dim_suffix(node)


# process group name -> the names of the DeviceMesh dimensions it serves, from the DTensors
# capture has seen (a 1-D mesh over every rank uses the default group, described by no dimension)
_MESH_DIMS: dict[str, set[str]] = {}


def record_mesh_dims(mesh) -> None:
    """Remember which process group serves each named dimension of DeviceMesh ``mesh``."""
    for d, dim in enumerate(mesh.mesh_dim_names or ()):
        _MESH_DIMS.setdefault(mesh.get_group(d).group_name, set()).add(dim)


def mesh_dim_suffix(node) -> str:
    """``_tp`` for a functional collective (``_c10d_functional``) over the process group of the
    DeviceMesh dimension named "tp" (recorded, or the ``mesh_<dim>`` description
    ``init_device_mesh`` gives its groups), else nothing."""
    target = node.target
    if getattr(target, "namespace", None) != "_c10d_functional":
        return ""
    names = [a.name for a in target._schema.arguments]
    if "group_name" not in names:
        return ""
    i = names.index("group_name")
    group = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
    dims = _MESH_DIMS.get(group, set())
    if not dims:
        try:
            from torch.distributed import distributed_c10d

            desc = distributed_c10d._resolve_process_group(group).group_desc
        except Exception:  # noqa: BLE001 - no such group in this process: no suffix
            return ""
        if desc.startswith("mesh_") and desc != "mesh_default":
            dims = {desc.removeprefix("mesh_")}
    return f"_{identifier(next(iter(dims)))}" if len(dims) == 1 else ""


_PARTS = {  # what the outputs of multi-output ops are, where the schema does not name them
    "native_layer_norm": ("out", "mean", "rstd"),
    "native_batch_norm": ("out", "mean", "invstd"),
    "_native_batch_norm_legit": ("out", "mean", "invstd"),
    "_native_batch_norm_legit_functional": ("out", "mean", "invstd", "running_mean", "running_var"),
    "_native_batch_norm_legit_no_training": ("out", "mean", "invstd"),
    "native_group_norm": ("out", "mean", "rstd"),
    "max_pool2d_with_indices": ("out", "indices"),
    "max_pool3d_with_indices": ("out", "indices"),
    "var_mean": ("var", "mean"),
    "std_mean": ("std", "mean"),
    "native_dropout": ("out", "mask"),
}


def part_name(target, i: int) -> str:
    """The name of output ``i`` of a multi-output op: ``rstd`` for ``native_layer_norm``'s third."""
    schema = getattr(target, "_schema", None)
    if schema is not None and i < len(schema.returns) and schema.returns[i].name:
        return schema.returns[i].name
    parts = _PARTS.get(getattr(getattr(target, "overloadpacket", target), "__name__", ""), ())
    return parts[i] if i < len(parts) else str(i)
