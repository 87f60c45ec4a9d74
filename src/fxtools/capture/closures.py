"""What a program reads from outside its arguments, recorded when it is captured.

The walk starts at the function (or module, or callable object) being traced and follows what its
code loads by name (``LOAD_GLOBAL``, closure cells), the functions it calls by name (in user
files, to any depth, each once), the modules it reaches (their parameters, buffers, submodules, and the
attributes their ``forward`` names) and the attributes of plain objects it closes over. Each read
becomes a ``signature.closures.Read``: tensors (read by reference on every call of the generated
module), Python values (guarded by value), modules and functions (guarded by identity). The
walk over-approximates (a global named in a branch not taken is guarded too): a change there is
refused rather than silently ignored. See ``docs/closures.md``.
"""

from __future__ import annotations

import dis
import functools
import inspect
import linecache
import sys
import sysconfig
import types

import torch

from ..errors import FXTOOLS_DIR, is_user_file
from ..signature.closures import MISSING, Read, is_constant, reads_of, snapshot, watchable
from ..signature.naming import identifier
from ..signature.runtime import same_value

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # _parameters, _modules, the hook tables
_DEPTH = 64  # how deep the walk follows user functions called by name (each code object once)


def _get_item(table: dict, key):
    """``table[key]``, or ``MISSING`` (a plain function: torch.compile traces it, and guards on it)."""
    return table.get(key, MISSING)


def _list_item(items: list, i: int):
    """``items[i]``, or ``MISSING``."""
    return items[i] if i < len(items) else MISSING


def _line(code, lineno) -> str:
    text = linecache.getline(code.co_filename, lineno).strip() if lineno else ""
    return f"{code.co_filename}:{lineno}: {text}" if lineno else code.co_filename


def _loads(code):
    """``(opname kind, name, line)`` for each name ``code`` (and the code nested in it) loads, and
    each identifier-like string constant (kind ``"string"``): ``getattr(self, "scale")`` reads an
    attribute no ``LOAD_ATTR`` names."""
    for ins in dis.get_instructions(code):
        kind = {"LOAD_GLOBAL": "global", "LOAD_NAME": "global", "LOAD_DEREF": "cell", "LOAD_CLASSDEREF": "cell"}.get(
            ins.opname, "attr" if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") else None
        )
        if kind is not None and isinstance(ins.argval, str):
            yield kind, ins.argval, _line(code, getattr(getattr(ins, "positions", None), "lineno", None))
        elif ins.opname in ("DICT_MERGE", "DICT_UPDATE") or (ins.opname == "CALL_FUNCTION_EX" and (ins.arg or 0) & 1):
            yield "unpack", "**", _line(code, getattr(getattr(ins, "positions", None), "lineno", None))
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _loads(const)
        elif isinstance(const, str) and const.isidentifier():  # getattr(self, "scale"), vars(self)["k"]
            yield "string", const, _line(code, code.co_firstlineno)


def _module_chains(code):
    """``(global name, attributes, line)`` for each ``module.a.b`` chain ``code`` (and the code
    nested in it) loads (``torch.backends.cudnn.enabled``)."""
    ins = list(dis.get_instructions(code))
    for i, first in enumerate(ins):
        if first.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(first.argval, str):
            path = []
            for nxt in ins[i + 1 :]:
                if nxt.opname != "LOAD_ATTR" or not isinstance(nxt.argval, str):
                    break
                path.append(nxt.argval)
            if path:
                yield first.argval, tuple(path), _line(code, getattr(getattr(first, "positions", None), "lineno", None))
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _module_chains(const)


def _chain_get(module, path):
    """``module.a.b`` now, or ``MISSING``."""
    value = module
    for name in path:
        value = getattr(value, name, MISSING)
        if value is MISSING:
            break
    return value


def _attributes(obj) -> dict:
    """``vars(obj)``, or {} for an object without instance attributes. The walk reads the user's
    objects by introspection (their attribute dicts, as ``vars`` gives them): they are foreign
    objects, whose state is what the program read."""
    return vars(obj) if hasattr(obj, "__dict__") else {}


def _slot_getters(obj) -> dict:
    """Getters of the attributes ``obj`` keeps in ``__slots__`` (``@dataclass(slots=True)``),
    which ``vars`` does not show, for those set now."""
    if isinstance(obj, type):
        return {}
    found: dict = {}
    for cls in type(obj).__mro__:
        slots = vars(cls).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in found and hasattr(obj, name):
                found[name] = functools.partial(getattr, obj, name, MISSING)
    return found


def _own_file(obj) -> bool:
    """A module (or a class) of the user's own files, not torch's, the standard library's or an
    installed package's: its attributes are the program's configuration (``config.lr``)."""
    module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(getattr(obj, "__module__", ""), None)
    path = getattr(module, "__file__", None) or ""
    return bool(path) and is_user_file(path) and "-packages/" not in path and not path.startswith(_STDLIB)


_STDLIB = sysconfig.get_paths()["stdlib"]


def _class_attributes(obj) -> dict:
    """The attributes ``obj.name`` finds on its user-defined classes (``class Net: scale = 2.0``)
    and not in its own ``__dict__``: getters reading them through the object, as the code does."""
    own = _attributes(obj)
    found: dict = {}
    for cls in type(obj).__mro__ if not isinstance(obj, type) else ():
        if _own_file(cls):
            for name, value in vars(cls).items():
                if name not in own and name not in found and not hasattr(type(value), "__get__"):  # no methods, properties
                    found[name] = functools.partial(getattr, obj, name, MISSING)
    return found


def _default(fn, i):
    """The ``i``-th default of ``fn``'s positional parameters, as a call would take it now."""
    defaults = fn.__defaults__ or ()
    return defaults[i] if i < len(defaults) else MISSING


def _kwdefault(fn, name):
    """The default of ``fn``'s keyword-only parameter ``name``, as a call would take it now."""
    return (fn.__kwdefaults__ or {}).get(name, MISSING)


def _partial_arg(p, i):
    return p.args[i] if i < len(p.args) else MISSING


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hook_ids(module):
    """The ids of the hooks registered on ``module`` (``None``: every module's, ``register_module_*``):
    the trace ran them, so adding or removing one must be refused. Ids are never reused. A
    ``forward`` set on the instance (``m.forward = fn``), which a call runs instead of its class's,
    ends the tuple: setting or removing one afterwards is refused the same way (fxtools' own, set
    while it runs a distributed step, is not the program's)."""
    if module is None:  # fxtools' own (capture/names.py records module calls while tracing) left out
        tables = vars(torch.nn.modules.module)
        hooks = [(k, h) for name in _HOOKS for k, h in tables["_global" + name].items()]
        return tuple(k for k, h in hooks if not getattr(h, "__module__", "").startswith("fxtools."))
    own = vars(module)
    ids = tuple(k for name in _HOOKS for k in own[name])
    forward = own.get("forward")
    if forward is None or _set_by_fxtools(forward):
        return ids
    return (*ids, forward)


def _set_by_fxtools(fn) -> bool:
    """Whether ``fn``, found on a module instance, is fxtools' own (the forwards
    training/distributed.py sets while it runs a step), not the program's."""
    return getattr(fn, "__module__", None) is not None and fn.__module__.startswith("fxtools.")


def _method_of(obj, name):
    """What ``obj.name`` finds for a method: a function set on the instance, else the first class
    of its MRO defining ``name`` (``MISSING`` if none). Compared by identity: a method replaced
    on the class or the instance after the trace is refused."""
    own = _attributes(obj)
    if name in own and not _set_by_fxtools(own[name]):
        return own[name]
    for cls in type(obj).__mro__:
        found = vars(cls).get(name, MISSING)
        if found is not MISSING:
            return found
    return MISSING


_NOT_CALLED = frozenset(("__init__", "__new__", "__repr__", "__str__", "__init_subclass__", "__post_init__", "extra_repr"))


def _user_methods(obj):
    """``(name, function)`` for the methods of ``obj``'s classes written in the user's files
    (``forward`` and the helpers it calls through ``self``, properties' getters), the first class
    of the MRO defining each name."""
    found: dict = {}
    for cls in type(obj).__mro__:
        if not _own_file(cls):
            continue
        for name, value in vars(cls).items():
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if name not in found and name not in _NOT_CALLED and inspect.isfunction(fn):
                found[name] = fn
    return found.items()


def _cell_get(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return MISSING


class _Walk:
    """The reads of one program (see module docstring): ``self.reads``, in checking order."""

    def __init__(self):
        self.reads: list[Read] = []
        self.attr_names: set[str] = {"training"}
        self.objects: list = []  # (object, its path in messages, a getter-maker for its attributes)
        self.seen: set[int] = set()
        self.codes: set[int] = set()
        self.global_hooks = False  # whether the hooks registered on every module are read
        self.method_owners: list = []  # (object, label, {name: function}): its methods in the user's files
        self.compared: list = []  # (object, label): plain objects compared by snapshot, whose class attributes are read too
        self.held: list = []  # a module's dicts and lists of tensors: (name, value, getter, label, identifier)

    def root(self, f) -> None:
        if id(f) in self.seen:
            return
        if isinstance(f, torch.nn.Module):
            self.obj(f, "", type(f).__name__ + ".")
            return
        if isinstance(f, functools.partial):
            self.partial(f)
            return
        module = getattr(f, "__fxtools_module__", None)
        if isinstance(module, torch.nn.Module):
            self.obj(module, "", type(module).__name__ + ".")
        if inspect.ismethod(f):
            self.obj(f.__self__, "", type(f.__self__).__name__ + ".")
        if inspect.isfunction(f) or inspect.ismethod(f):
            self.seen.add(id(f))
            self.function(f, 0)
        elif callable(f) and not isinstance(f, (type, types.BuiltinFunctionType)) and hasattr(f, "__dict__"):
            self.obj(f, "", type(f).__name__ + ".")

    def partial(self, p: functools.partial) -> None:
        """A ``functools.partial``: its bound arguments are read as closure variables are (its
        ``keywords`` dict can be changed), and its function as a root."""
        self.seen.add(id(p))
        name = getattr(p.func, "__name__", "partial")
        for i, value in enumerate(p.args):
            self.value(value, functools.partial(_partial_arg, p, i), f"argument {i} of partial({name})", None, f"arg{i}", 0)
        for key, value in list(p.keywords.items()):
            get = functools.partial(_get_item, p.keywords, key)
            self.value(value, get, f"{key}= of partial({name})", None, key, 0)
        self.root(p.func)

    def function(self, fn, depth) -> None:
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps: torch.func.vmap(f), a decorator
        if wrapped is not None and wrapped is not fn:
            self.root(wrapped) if depth == 0 else self.function(wrapped, depth)
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in self.codes or depth > _DEPTH:
            return
        self.codes.add(id(code))
        globals_ = getattr(fn, "__globals__", {})
        cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
        if code.co_filename.startswith(FXTOOLS_DIR) and not is_user_file(code.co_filename):
            self._wrapper_cells(cells, depth)
            return
        user = is_user_file(code.co_filename) or code.co_filename.startswith("<")  # exec'd code, the REPL
        if user:
            self._defaults(fn, code, depth)
        if user:
            self._flags(code, globals_)
        for kind, name, where in _loads(code):
            if kind == "attr" or (kind == "string" and user):  # a string may name an attribute the code reads
                self.attr_names.add(name)
            elif kind == "unpack" and user:  # f(**state): every key of a dict may be read
                self.attr_names.add(name)
            elif not user:
                continue
            elif kind == "global" and name in globals_:
                get = functools.partial(_get_item, globals_, name)
                self.value(globals_[name], get, f"the global {name}", where, name, depth)
            elif kind == "cell" and name in cells:
                value = _cell_get(cells[name])
                if value is not MISSING:
                    get = functools.partial(_cell_get, cells[name])
                    self.value(value, get, f"the closure variable {name}", where, name, depth)

    def _flags(self, code, globals_) -> None:
        """Plain values the code reads through an installed module (``torch.backends.cudnn.enabled``,
        a library's flag): guarded by value, as the user's own configuration is."""
        for name, path, where in _module_chains(code):
            module = globals_.get(name)
            if isinstance(module, types.ModuleType) and not _own_file(module):
                get = functools.partial(_chain_get, module, path)
                value = get()
                if type(value) in (bool, int, float, str):
                    self.reads.append(Read(".".join((name, *path)), get, "value", value, where))

    def _defaults(self, fn, code, depth) -> None:
        """Default values of ``fn``'s parameters (``def loss(x, cfg=CONFIG)``): read like globals,
        whether or not a call passes the parameter (over-approximated, as the walk is)."""
        defaults = getattr(fn, "__defaults__", None) or ()
        names = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
        for i, (name, value) in enumerate(zip(names, defaults)):
            get = functools.partial(_default, fn, i)
            self.value(value, get, f"the default of {name}", _line(code, code.co_firstlineno), name, depth)
        for name, value in list((getattr(fn, "__kwdefaults__", None) or {}).items()):  # def f(x, *, k=2.0)
            get = functools.partial(_kwdefault, fn, name)
            self.value(value, get, f"the default of {name}", _line(code, code.co_firstlineno), name, depth)

    def _wrapper_cells(self, cells, depth) -> None:
        """fxtools' own wrappers (a transform of a generated module): follow what they call, whose
        reads are the program's; their other variables are fxtools' and never change."""
        for cell in cells.values():
            value = _cell_get(cell)
            if isinstance(value, torch.nn.Module):
                self.obj(value, "", type(value).__name__ + ".")
            elif callable(value) and not isinstance(value, type):
                self.root(value) if inspect.isfunction(value) is False else self.function(value, depth)

    def value(self, value, get, what, where, name, depth) -> None:
        """One object read by name: a tensor, a value, or a module / object / function to follow."""
        if isinstance(value, torch.Tensor):
            self.reads.append(Read(what, get, "tensor", value, where, identifier(name)))
        elif isinstance(value, (types.ModuleType, type)) or inspect.isbuiltin(value):
            if not isinstance(value, types.ModuleType):  # act = torch.tanh, Block = nn.Linear: the same one
                self.reads.append(Read(what, get, "same", value, where))
            if isinstance(value, (types.ModuleType, type)) and _own_file(value) and id(value) not in self.seen:
                self.obj(value, name + ".", name + ".")  # config.lr, Net.scale: named attributes guarded
            return
        elif is_constant(value):
            self.reads.append(Read(what, get, "value", value, where))
            if isinstance(value, str) and value.isidentifier():  # k = "scale"; state[k]
                self.attr_names.add(value)
        elif inspect.isfunction(value):
            self.reads.append(Read(what, get, "same", value, where))
            self.function(value, depth + 1)
        elif isinstance(value, functools.partial):  # its bound arguments, and its function
            self.reads.append(Read(what, get, "same", value, where))
            if id(value) not in self.seen:
                self.partial(value)
        elif isinstance(value, torch.nn.Module) or snapshot(value) is None:
            if id(value) not in self.seen:
                self.reads.append(Read(what, get, "same", value, where))
            self.obj(value, name + ".", name + ".")
        else:
            self.reads.append(Read(what, get, "value", snapshot(value), where, mutable=True))
            if hasattr(value, "__dict__") and id(value) not in self.seen:  # a config object: its methods too
                self.seen.add(id(value))
                self._methods(value, name + ".")
                self.compared.append((value, name + "."))  # the snapshot holds its own attributes, not its class's

    def _methods(self, obj, label) -> None:
        """Note ``obj``'s methods in the user's files: ``called_methods`` walks those the walked code
        names (``self.body(x)``) and guards them by identity."""
        self.method_owners.append((obj, label, dict(_user_methods(obj))))

    def called_methods(self) -> None:
        """Walk the noted methods whose names walked code loads (``forward``, ``__call__`` and the
        helpers they call through ``self``, to a fixpoint), each guarded by identity: one replaced
        on the class or set on the instance is refused. Methods no walked code names are left out
        (a ``training_step`` reading a global the program never reads)."""
        done: set = set()
        changed = True
        while changed:
            changed = False
            for obj, label, methods in self.method_owners:
                for name, fn in methods.items():
                    key = (id(obj), name)
                    if key in done or (name not in self.attr_names and name not in ("forward", "__call__")):
                        continue
                    done.add(key)
                    changed = True
                    get = functools.partial(_method_of, obj, name)
                    self.reads.append(Read(f"the method {label}{name}", get, "same", get()))
                    self.function(fn, 1)

    def obj(self, obj, prefix, label) -> None:
        """A module or plain object the program reached: its tensors, submodules, and (later) the
        Python values among its attributes that the code names. ``prefix`` starts the identifiers
        of its tensors in the code (``model.``), ``label`` their names in messages."""
        if id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        inherited = reads_of(obj)
        if inherited:  # a generated module: what it reads is what its own program read
            self.reads.extend(inherited)
            return
        self.objects.append((obj, label))
        cls = type(obj)
        for attr in ("forward", "__call__"):
            fn = inspect.getattr_static(cls, attr, None)
            if inspect.isfunction(fn) and not (attr == "__call__" and isinstance(obj, torch.nn.Module)):
                self.function(fn, 1)
        if not isinstance(obj, type):  # the methods of the user's classes: forward's helpers (self.body(x))
            self._methods(obj, label)
        if isinstance(obj, torch.nn.Module):
            self._module(obj, prefix, label)
        elif type(obj).__module__.startswith("fxtools."):  # fxtools' wrapper of a generated module
            for value in list(_attributes(obj).values()):
                if isinstance(value, torch.nn.Module):
                    self.obj(value, "", type(value).__name__ + ".")
        elif type(obj) is dict:  # a dict of tensors (``params['w']``)
            for key, value in list(obj.items()):
                holder = type(value) in (list, tuple, dict) and snapshot(value) is None  # of tensors or modules
                if isinstance(key, str) and (isinstance(value, (torch.Tensor, torch.nn.Module)) or holder):
                    get = functools.partial(_get_item, obj, key)
                    self.value(value, get, f"{label[:-1]}[{key!r}]", None, f"{prefix}{key}", _DEPTH)
                elif callable(value) and not isinstance(value, type):  # OPS = {"act": torch.sin}: the same one
                    get = functools.partial(_get_item, obj, key)
                    self.reads.append(Read(f"{label[:-1]}[{key!r}]", get, "same", value))
        elif type(obj) in (list, tuple):  # layers = [nn.Linear(...), ...]: its items, and a list's length
            if type(obj) is list:
                self.reads.append(Read(f"the length of {label[:-1]}", functools.partial(len, obj), "value", len(obj)))
            for i, value in enumerate(obj):
                if isinstance(value, (torch.Tensor, torch.nn.Module, list, tuple)):
                    get = functools.partial(_list_item, obj, i)
                    self.value(value, get, f"{label[:-1]}[{i}]", None, f"{prefix}{i}", _DEPTH)
        else:
            slots = {name: get() for name, get in _slot_getters(obj).items()}
            for name, value in [*_attributes(obj).items(), *slots.items()]:
                holder = type(value) in (list, tuple, dict) and snapshot(value) is None  # of tensors or modules
                if isinstance(value, (torch.Tensor, torch.nn.Module)) or holder:
                    get = functools.partial(getattr, obj, name, MISSING)
                    self.value(value, get, label + name, None, prefix + name, _DEPTH)

    def _plain_items(self, obj, label) -> None:
        """The Python values held by a dict or list the program reads tensors from."""
        items = obj.items() if type(obj) is dict else enumerate(obj)
        whole = self.attr_names & {"**", "items", "values"}  # f(**d), d.items(): every item
        for key, value in list(items):
            if type(obj) is dict and isinstance(key, str) and key not in self.attr_names and not whole:
                continue
            get = functools.partial(_get_item if type(obj) is dict else _list_item, obj, key)
            read = _plain_read(f"{label[:-1]}[{key!r}]", get, value)
            if read is not None:
                self.reads.append(read)

    def _module(self, module, prefix, label) -> None:
        owners = [(module, label[:-1] or "the module")]
        if not self.global_hooks:
            self.global_hooks = True
            owners.append((None, "every module (register_module_forward_hook, ...)"))
            every = vars(torch.nn.modules.module)
            for table in ("_global_forward_pre_hooks", "_global_forward_hooks"):
                for hook in list(every[table].values()):
                    if not getattr(hook, "__module__", "").startswith("fxtools."):
                        self.root(hook)
        for hook in [*vars(module)["_forward_pre_hooks"].values(), *vars(module)["_forward_hooks"].values()]:
            self.root(hook)  # the trace ran it: what it reads (a global scale, its object's attributes) too
        for owner, whose in owners:
            get = functools.partial(_hook_ids, owner)
            what = f"the ids of the hooks registered on {whose}" + ("" if owner is None else " (and a forward set on it)")
            self.reads.append(Read(what, get, "value", get()))
        tables = (module._parameters, module._buffers, vars(module))
        for table in tables:  # read from the table itself: nn.Module.__getattr__ is slow
            for name, t in list(table.items()):
                if isinstance(t, torch.Tensor):
                    get = functools.partial(_get_item, table, name)
                    self.reads.append(Read(label + name, get, "tensor", t, None, identifier(prefix + name)))
        attributes = vars(module)
        own = {id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None}
        for name, value in list(attributes.items()):  # self.cfg = {"w": tensor, "scale": 2.0}, self.cache = [tensor]
            if name in _MODULE_INTERNALS or type(value) not in (list, tuple, dict) or snapshot(value) is not None:
                continue
            held = [t for t in (value.values() if type(value) is dict else value) if isinstance(t, torch.Tensor)]
            if held and all(id(t) in own or isinstance(t, torch.nn.Parameter) for t in held):
                continue  # parameters again (an RNN's _flat_weights, another module's): read as parameters
            get = functools.partial(_get_item, attributes, name)
            self.held.append((name, value, get, label + name, prefix + name))  # followed if the code names it
        for name, sub in module._modules.items():
            if sub is not None:
                get = functools.partial(_get_item, module._modules, name)
                if id(sub) not in self.seen:
                    self.reads.append(Read(label + name, get, "same", sub))
                self.obj(sub, f"{prefix}{name}.", f"{label}{name}.")

    def values_of_objects(self) -> None:
        """The Python values among the reached objects' attributes that some walked code names,
        and among the items of the dicts and lists of tensors it reached (``state["scale"]``
        beside ``state["w"]``: a dict's items under the keys walked code names, any key that is
        not a string, and every item of a list)."""
        for name, value, get, label, prefix in self.held:
            if name in self.attr_names:
                self.value(value, get, label, None, prefix, _DEPTH)
        walked = [(obj, label, True) for obj, label in self.objects]
        for obj, label, _ in walked:
            if type(obj) in (dict, list):
                self._plain_items(obj, label)
        for obj, label, own in walked + [(obj, label, False) for obj, label in self.compared]:
            if type(obj) in (dict, list):
                continue
            getters = {}
            if own:  # a compared object's own attributes are in its snapshot already
                attributes = _attributes(obj)
                getters = {name: functools.partial(_get_item, attributes, name) for name in attributes}
                getters.update({name: get for name, get in _slot_getters(obj).items() if name not in getters})
            getters.update(_class_attributes(obj))
            for name, get in getters.items():
                value = get() if name in self.attr_names else None
                if value is None or isinstance(value, torch.Tensor):
                    continue
                if is_constant(value):
                    self.reads.append(Read(label + name, get, "value", value))
                elif not callable(value) and snapshot(value) is not None:
                    self.reads.append(Read(label + name, get, "value", snapshot(value), mutable=True))


def _plain_read(what: str, get, value) -> Read | None:
    """A read of a Python value compared by value (a constant, or a snapshot of a plain
    container), or None for what is read otherwise (tensors, modules, functions)."""
    if isinstance(value, (torch.Tensor, torch.nn.Module)) or callable(value):
        return None
    if is_constant(value):
        return Read(what, get, "value", value)
    shot = snapshot(value)
    return Read(what, get, "value", shot, mutable=True) if shot is not None else None


def outside_reads(f, module_args=None) -> list[Read]:
    """Every read of ``f`` from outside its arguments (see module docstring), in checking order:
    an object's identity before what is read through it. ``module_args`` (name -> module): the
    ``nn.Module`` arguments, whose identity the argument guards check and whose tensors are
    read as closed-over ones."""
    walk = _Walk()
    for name, module in (module_args or {}).items():
        walk.obj(module, name + ".", name + ".")
    walk.root(f)
    walk.called_methods()
    walk.values_of_objects()
    for read in walk.reads:
        if read.tables is None:
            read.tables = _tables_of(read.get)
    return walk.reads


def _tables_of(get):
    """The function giving the dicts whose contents alone decide what ``get`` reads now
    (``Read.tables``), or None: a dict's item (an attribute, a submodule, a global) and the ids of
    a module's hooks; not what reads through objects (a method found on a class, a function's
    defaults, a cell, a module's flag)."""
    if isinstance(get, functools.partial) and get.func is _get_item and watchable(get.args[0]):
        return functools.partial(_one_table, get.args[0])
    if isinstance(get, functools.partial) and get.func is _hook_ids:
        return functools.partial(_hook_tables, get.args[0])
    return None


def _one_table(table) -> tuple:
    return (table,)


def _hook_tables(module) -> tuple | None:
    """The dicts ``_hook_ids(module)`` reads (the module's attributes, its hook tables), or None
    where they do not decide it: a ``forward`` set on the instance (its ``__module__`` decides
    whether it is fxtools'), a table of more than one hook (``move_to_end`` reorders one without
    changing its version), any global hook (whose ``__module__`` decides whether it is fxtools')."""
    own = vars(torch.nn.modules.module) if module is None else _attributes(module)
    tables = [own.get(("_global" if module is None else "") + name) for name in _HOOKS]
    most = 0 if module is None else 1
    if (module is not None and "forward" in own) or not all(watchable(t) and len(t or ()) <= most for t in tables):
        return None
    return (own, *tables)


def unchanged_by_tracing(reads: list[Read]) -> list[Read]:
    """The reads whose values tracing left alone: a value the program itself changes (a counter it
    bumps) is its own state, which generated code does not replay, and is not guarded."""
    keep = []
    for read in reads:
        now = read.get()
        if read.kind == "tensor" or now is read.expected or (read.kind == "value" and _same_value(read, now)):
            keep.append(read)
    return keep


def _same_value(read, now) -> bool:
    return now is not MISSING and same_value(snapshot(now) if read.mutable else now, read.expected)


def _values_of(get):
    """The values of the tensor ``get()`` reads, as Python numbers (a tuple for more than one)."""
    t = get()
    if not isinstance(t, torch.Tensor):
        return MISSING
    return t.item() if t.numel() == 1 else tuple(t.detach().flatten().tolist())


def with_value_reads(reads: list[Read], read_as_values: dict) -> list[Read]:
    """``reads`` and, for each closed-over tensor whose values the program read into Python
    (``id -> line``: ``float(t)``, ``t.item()``), a guard on those values: the code holds them as
    constants, so a change (``t.fill_(3.0)``) is refused instead of silently ignored."""
    extra = []
    for read in reads:
        where = read_as_values.get(id(read.expected)) if read.kind == "tensor" else None
        if where is not None:
            get = functools.partial(_values_of, read.get)
            extra.append(Read(f"the values of {read.what}", get, "value", get(), where))
    return reads + extra


def _layout_of(get, facts):
    """The layout facts (``capture/layout_reads.constants_layout_read``) of the tensor ``get()`` reads."""
    t = get()
    if not isinstance(t, torch.Tensor):
        return MISSING
    out: list = []
    for fact in facts:
        if fact[0] == "is_contiguous":
            out.append(("is_contiguous", t.is_contiguous(memory_format=fact[1])))
        elif fact[0] == "strides":
            out.append(("strides", tuple(t.stride())))
        else:
            out.append(("storage offset", t.storage_offset()))
    return tuple(out)


def with_layout_reads(reads: list[Read], layout_read: dict) -> list[Read]:
    """``reads`` and, for each closed-over tensor whose layout the program read (``id -> (line,
    facts)``: ``W.is_contiguous()``, ``W.stride(0)``, ``W.t().is_contiguous()``), a guard on those
    facts: the code followed what they gave, so a tensor rebound (or given new ``.data``) of
    another layout is refused instead of silently computed with the old one's decisions."""
    extra = []
    for read in reads:
        found = layout_read.get(id(read.expected)) if read.kind == "tensor" else None
        if found is not None:
            where, facts = found
            get = functools.partial(_layout_of, read.get, facts)
            extra.append(Read(f"the layout of {read.what}", get, "value", get(), where))
    return reads + extra


def tensor_names(reads: list[Read]) -> dict[int, str]:
    """id(tensor) -> the identifier the code gives it (``model_fc_weight``, ``w``)."""
    names: dict[int, str] = {}
    for read in reads:
        if read.kind == "tensor" and read.name:
            names.setdefault(id(read.expected), read.name)
    return names


def locate(gm, reads: list[Read]) -> None:
    """Give tensor reads without a line (a module's parameters) the user's line of the first op
    of ``gm`` that uses them."""
    from ..errors import user_line_of

    by_id = {id(r.expected): r for r in reads if r.kind == "tensor" and r.where is None}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            read = by_id.get(id(getattr(gm, node.target, None)))
            if read is not None:
                read.where = user_line_of(next(iter(node.users)))


def setter(read: Read):
    """A function putting a value where ``read.get`` reads it (the global, the closure cell, the
    module's parameter table, the object's attribute), or None if the walk read it otherwise:
    ``fxtools.compile`` passes closed-over tensors that require grad in their place while tracing."""
    get = read.get
    if not isinstance(get, functools.partial):
        return None
    if get.func is _get_item:
        table, key = get.args
        return functools.partial(table.__setitem__, key)
    if get.func is _cell_get:
        (cell,) = get.args
        return functools.partial(setattr, cell, "cell_contents")
    if get.func is getattr and hasattr(get.args[0], "__dict__"):
        return functools.partial(vars(get.args[0]).__setitem__, get.args[1])
    return None
