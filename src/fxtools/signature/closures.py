"""Closed-over state: what a generated module read from outside its arguments, checked on every call.

A program reads more than its arguments: a module's parameters and flags, globals, the variables
a lambda closes over. fxtools traces it once, so without care a later change to any of them would
leave the generated code computing with the old one. The rules (``docs/closures.md``):

- a **tensor** read from outside (a parameter, a buffer, a closed-over or global tensor) is read
  by reference on every call: in-place updates (optimizer steps) are seen, and a tensor rebound to
  a new object of the same shape, dtype and device (``model.fc.weight = nn.Parameter(...)``) is
  read in its place; any other new value is refused;
- a **Python value** (a number, flag, string, tuple, a plain config object's attributes, a module's
  ``training`` flag) is a constant of the code: it is guarded, and a call after it changed is
  refused;
- a **module or function** the program reached (a submodule, a helper called by name) must still
  be the same object.

A refusal is an ``InputMismatch`` naming what changed and the user's line that read it. The
capture stage records the reads (``capture/closures.py``); this module is the check that
``GuardedGraphModule.__call__`` runs after the argument guards. Copies (``copy.deepcopy``,
``torch.save``, ``fxtools.save``) are snapshots: they keep the values they hold and check nothing.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .guards import GuardedGraphModule, is_scalar
from .runtime import InputMismatch, same_value, snapshot_value, tensor_text, value_text

MISSING = object()  # what a getter returns for a name that no longer exists


def _version_reader():
    """``torch._C._dynamo.guards.dict_version`` (a dict's PEP 509 version tag: every change to
    the dict gives it a new one, never given to another dict), if it works here, else None."""
    try:
        from torch._C._dynamo.guards import dict_version
    except ImportError:  # pragma: no cover - a build without Dynamo
        return None

    class Probe:
        x = 0

    probe, table = Probe(), {}
    probe.x = 0
    before = [dict_version(table), dict_version(vars(probe))]
    table[0], probe.x = 0, 1
    after = [dict_version(table), dict_version(vars(probe))]
    return dict_version if all(a != b for a, b in zip(before, after)) else None


_dict_version = _version_reader()
_GIVE_UP = 8  # full checks in a row after which ``Closures`` stops watching dicts


def _immutable_state(value):
    """The dict holding ``value``'s state (a dict itself, or a plain object's attributes) where
    its values are immutable (None, numbers, strings, tuples of them), so that the dict's version
    and ``value``'s type decide its ``snapshot``; else None."""
    state = value if type(value) is dict else vars(value) if hasattr(value, "__dict__") else None
    if not watchable(state) or isinstance(value, (torch.Tensor, torch.nn.Module, type)) or _is_ndarray(value):
        return None
    return state if all(map(_immutable, state.values())) else None


def _immutable(value) -> bool:
    return value is None or type(value) in _ATOMS or (type(value) is tuple and all(map(_immutable, value)))


_ATOMS = (bool, int, float, complex, str)


def watchable(table) -> bool:
    """Whether ``table`` is a dict whose version tells its contents (no subclass overriding reads)."""
    return _dict_version is not None and type(table) in (dict, collections.OrderedDict)


def dict_versions(tables) -> list | None:
    """The versions of ``tables`` (dicts), or None where versions cannot be read."""
    return None if _dict_version is None else list(map(_dict_version, tables))


def is_constant(value) -> bool:
    """Whether generated code would hold ``value`` as a constant compared by value (a number,
    bool, string, dtype, None, a tuple of them), as the argument guards do."""
    return value is None or is_scalar(value)


def snapshot(value):
    """A plain object's attributes (or a dict's items) as nested tuples of built-in values, or None
    (``guards``). The object is the user's: its attributes are read by introspection (``vars``)."""
    if _is_ndarray(value):  # changed in place, it must be seen (a value the code baked in would be stale)
        return ("ndarray", str(value.dtype), value.shape, value.tobytes())
    inside = value if type(value) is dict else vars(value) if hasattr(value, "__dict__") else None  # a user's object
    if type(value) in (list, tuple):
        inside = dict(enumerate(value))
    if isinstance(value, torch.Tensor) or (
        isinstance(inside, dict) and any(isinstance(v, (torch.Tensor, torch.nn.Module)) for v in inside.values())
    ):
        return None  # holds tensors: read by reference (capture/closures.py), not compared
    if type(value) is dict:
        items = tuple((k, snapshot_value(v)) for k, v in value.items())
        plain = all(type(k) is str and (s is not None or v is None) for (k, s), v in zip(items, value.values()))
        return ("dict", items) if plain else None
    return snapshot_value(value)


def _is_ndarray(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


@dataclasses.dataclass(eq=False)
class Read:
    """One object the program read from outside its arguments.

    ``get()`` reads the current object; ``kind`` is "tensor" (read by reference), "value" (compared
    with ``expected``, a snapshot) or "same" (must be ``expected`` itself); ``what`` names it in
    messages (``the global scale``, ``model.fc.weight``), ``where`` is the user's line reading it;
    ``name`` is the identifier a tensor gets in the code.
    """

    what: str
    get: Callable[[], Any] = dataclasses.field(repr=False)
    kind: str
    expected: object
    where: str | None = None
    name: str | None = None
    mutable: bool = False  # a plain object compared by its attributes, even when it is the same object
    # the dicts whose contents alone decide what ``get()`` gives now (a tuple), or None: the check of
    # a read whose dicts kept their versions since it last passed is not repeated (``Closures.check``)
    tables: Callable[[], tuple | None] | None = dataclasses.field(default=None, repr=False)


class Closures:
    """The reads of one generated module: ``check(gm)`` before each call (see module docstring).

    A call repeats only what may have changed: the values and objects read from dicts (a module's
    attributes, submodules and hooks, a function's globals; ``Read.tables``) are checked again only
    when one of those dicts changed since they last passed (its version, which every change to a
    dict changes: ``dict_version``); the others, the plain objects compared by their attributes and
    the tensors are checked on every call."""

    def __init__(self, made_by: str, tensors, others):
        self.made_by = made_by
        self.tensors = tuple(tensors)  # (Read, attribute path in the module)
        self.others = tuple(others)
        self.seen = [read.expected for read, _ in self.tensors]
        # flat tuples for the loop of every call (a few hundred nanoseconds a read)
        self._fixed = tuple((r.get, r.expected, r) for r in self.others if not r.mutable)
        self._mutable = tuple(r for r in self.others if r.mutable)
        self._tensor_gets = tuple((r.get, r.expected.shape, r.expected.dtype, r.expected.device) for r, _ in self.tensors)
        self._watch: tuple | None = None  # (dicts, their versions, the fixed reads they do not decide) after a pass
        self._misses = 0  # full checks in a row whose dicts had changed since the last pass

    def check(self, gm: fx.GraphModule) -> None:
        """Refuse a changed value or object; make the module read tensors rebound since the last call."""
        if torch.compiler.is_compiling():  # traced by torch.compile (the checks compiled, guarded by Dynamo)
            self._check_fixed(self._fixed)
            self._check_mutable(self._mutable)
            self._check_tensors(gm)
            return
        watch = self._watch
        if watch is not None:
            dicts, versions, typed, fixed, mutable = watch
            if list(map(_dict_version, dicts)) == versions and all(type(o) is t for o, t in typed):
                self._misses = 0  # every read the dicts decide gives what it gave when it passed
                self._check_fixed(fixed)
                self._check_mutable(mutable)
                self._check_tensors(gm)
                return
            self._watch = None
            self._misses += 1
        watch = self._watching()  # the versions before the checks: a change during them is seen next time
        self._check_fixed(self._fixed)
        self._check_mutable(self._mutable)
        self._check_tensors(gm)
        self._watch = watch

    def _watching(self) -> tuple | None:
        """What decides the reads now: ``(dicts, their versions, (object, type) pairs, the fixed reads
        and the plain objects they do not decide)``; or None: no ``dict_version``, or the dicts
        changed before each of the last calls (a wrapper setting attributes at each call), where
        watching them would cost more than it saves.

        A fixed read (a value, an object's identity) is decided by its ``tables``; a plain object
        compared by its attributes by its ``tables``, its own attributes and its type, where
        those attributes are immutable values (numbers, strings, tuples of them)."""
        if _dict_version is None or self._misses > _GIVE_UP:
            return None
        dicts: dict[int, Any] = {}
        typed, fixed, mutable = [], [], []
        for item in self._fixed:
            found = item[2].tables() if item[2].tables is not None else None
            if found is None:
                fixed.append(item)
            else:
                dicts.update((id(t), t) for t in found)
        for read in self._mutable:
            found = read.tables() if read.tables is not None else None
            now = read.get()
            state = _immutable_state(now)
            if found is None or state is None:
                mutable.append(read)
            else:
                dicts.update((id(t), t) for t in (*found, state))
                typed.append((now, type(now)))
        tables = list(dicts.values())
        return tables, list(map(_dict_version, tables)), tuple(typed), tuple(fixed), tuple(mutable)

    def _check_fixed(self, fixed) -> None:
        for get, expected, read in fixed:
            if get() is not expected:
                now = get()
                if read.kind == "same" or now is MISSING or not same_value(now, expected):
                    self._changed(read, now)

    def _check_mutable(self, mutable) -> None:
        for read in mutable:
            now = read.get()
            if now is MISSING or not same_value(snapshot(now), read.expected):
                self._changed(read, now)

    def _check_tensors(self, gm) -> None:
        seen = self.seen
        for i, (get, shape, dtype, device) in enumerate(self._tensor_gets):
            now = get()
            if now is not seen[i]:
                self._rebind(gm, i, now)
            elif now.shape != shape or now.dtype != dtype or now.device != device:  # ``p.data = ...`` of another kind
                self._refuse_tensor(self.tensors[i][0], now)

    def _rebind(self, gm, i, now) -> None:
        read, attr = self.tensors[i]
        want = read.expected
        if not (
            isinstance(now, torch.Tensor) and now.shape == want.shape and now.dtype == want.dtype and now.device == want.device
        ):
            self._refuse_tensor(read, now)
        owner_path, _, name = attr.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        for table in (owner._parameters, owner._buffers):
            if name in table:
                table[name] = now
                break
        else:
            vars(owner)[name] = now  # a plain attribute, as it was (setattr would register a Parameter)
        self.seen[i] = now

    def _refuse_tensor(self, read, now) -> None:
        got = "gone" if now is MISSING else value_text(now)
        want = read.expected
        self._fail(
            read,
            f"is now {got}, but the module was made with a tensor {tensor_text(want.shape, want.dtype, want.device.type)}, "
            "which its code is specialised to (a tensor of that shape, dtype and device would be read in its place)",
        )

    def _changed(self, read, now) -> None:
        if now is MISSING:
            self._fail(read, "no longer exists")
        if read.kind == "same":
            self._fail(read, f"was replaced by another object ({value_text(now)}) after the module was made from the old one")
        if _is_ndarray(now):
            self._fail(
                read,
                "is a NumPy array whose contents changed (in place, or replaced) after the module was made from "
                "its old values, which its code uses as constants",
            )
        shown = repr(now) if not read.mutable else f"a {type(now).__name__} whose contents changed"
        self._fail(read, f"is now {shown}, but the module was made with {read.expected!r}, a value its code uses as a constant")

    def _fail(self, read, problem) -> None:
        where = f" (read at {read.where})" if read.where else ""
        raise InputMismatch(
            f"{self.made_by} module: {read.what}{where} {problem}. The generated code reads tensors from outside its "
            "arguments at each call, but Python values, modules and functions are fixed when it is made: generate the "
            "module again after changing them, or pass the value as an argument."
        )

    def __len__(self):
        return len(self.tensors) + len(self.others)


def attach(gm: fx.GraphModule, reads, made_by: str) -> None:
    """Give ``gm`` (a GuardedGraphModule) the checks of ``reads`` (capture/closures.py): the
    tensor reads it holds as attributes (by identity), and every other read."""
    reads = list({id(r): r for r in reads}.values())  # composed transforms inherit reads more than once
    by_id = {id(r.expected): r for r in reads if r.kind == "tensor"}
    tensors, taken = [], set()
    for path, value in _tensor_attributes(gm):
        read = by_id.get(id(value))
        if read is not None and read.expected is value and path not in taken:
            tensors.append((read, path))
            taken.add(path)
    others = [r for r in reads if r.kind != "tensor"]
    if tensors or others:
        assert isinstance(gm, GuardedGraphModule)  # the module that runs the checks
        gm.closures = Closures(made_by, tensors, others)


def attach_held(gm: fx.GraphModule, reads, made_by: str, holders=()) -> None:
    """Give ``gm`` the checks of ``reads`` for code whose closed-over tensors are also held
    elsewhere (``holders``: a split's backward; the graphs a compiler made from them): every value
    read is guarded, and a tensor the graphs hold as a constant must stay the same object (a
    rebound one is refused rather than read in its place, since the other holders would keep the
    old one; in-place updates stay visible). Tensors the graphs take as inputs are not checked."""
    reads = list({id(r): r for r in reads}.values())
    held_ids = {id(v) for g in (gm, *holders) for _, v in _tensor_attributes(g)}
    held = [
        dataclasses.replace(r, kind="same") if r.kind == "tensor" else r
        for r in reads
        if r.kind != "tensor" or id(r.expected) in held_ids
    ]
    if held:
        assert isinstance(gm, GuardedGraphModule)  # the module that runs the checks
        gm.closures = Closures(made_by, (), held)


def check(gm) -> None:
    """Run ``gm``'s closed-over state checks, if it has any (``attach`` / ``attach_held``)."""
    closures = getattr(gm, "closures", None)
    if isinstance(closures, Closures):
        closures.check(gm)


def _tensor_attributes(gm: fx.GraphModule):
    """(attribute path, tensor) for every tensor a get_attr node of ``gm`` or its subgraphs reads."""
    for prefix, module in gm.named_modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "get_attr":
                value: Any = module
                for part in node.target.split("."):
                    value = getattr(value, part, None)
                if isinstance(value, torch.Tensor):
                    yield (f"{prefix}.{node.target}" if prefix else node.target), value


def reads_of(gm) -> list:
    """The reads a generated module checks (empty for other modules): composed transforms inherit them."""
    closures = getattr(gm, "closures", None)
    if not isinstance(closures, Closures):
        return []
    return [*(read for read, _ in closures.tensors), *closures.others]
