"""Name a captured graph's values after the user's variables and modules.

Captured nodes are named by make_fx after their ops (``div``, ``softmax``, ``linear_5``). This
module renames them, in order of preference:

1. the value a statement of user code assigns, after its target (``scores = q @ k.T / 8``
   names the division ``scores``; ``logits = self.fc2(h)`` names the module's value ``logits``;
   ``q, k, v = x.split(...)`` names the parts, ``q, k, v = (t.view(s) for t in (q, k, v))`` the
   comprehension's elements);
2. a value a module call returns that no statement assigns, after the module: the shortest
   unique suffix of its path (``attn_c_proj``, ``h_3_ln_1``, ``fc1``); a value leaving nested
   modules at once takes the outermost one's name (a block's ``return x + ...`` is ``h_3``);
   a returned value after its function (or ``loss`` for a scalar returned by the differentiated
   function itself, else ``out``);
3. other values of a statement (its intermediates) after the target and their op
   (``scores_matmul``).

Statements are found from each node's stack trace: the innermost user frame's line, parsed with
``ast`` (a statement may span lines). Names are identifiers from the user's source, passed
through ``naming.identifier`` like every name; they never change what the code computes.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import operator
import os
import re
import sys
import sysconfig
import traceback

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import is_user_file
from ..graph import meta
from ..signature.naming import identifier, part_name, short_op, shortest_unique_suffixes

_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (.+)$')
_GENERIC_FUNCTIONS = frozenset({"forward", "__call__", "<lambda>", "<module>", "_call_impl", "_wrapped_call_impl"})


def root_prefix(root, name: str) -> str:
    """What a root module's child path starts with: nothing (``fc1``), or for numbered children
    (an ``nn.Sequential``'s ``0``) the root's class name (``sequential_0``), as names cannot be numbers."""
    if not name[:1].isdigit():
        return ""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(root).__name__).lower()


def reached_modules(f) -> list:
    """The modules ``f`` is, is a method of, or closes over (through a global or a cell), with
    their submodules: those whose attributes the program may change while fxtools traces it."""
    roots = []
    module = f if isinstance(f, torch.nn.Module) else getattr(f, "__fxtools_module__", None)
    if module is None and isinstance(getattr(f, "__self__", None), torch.nn.Module):
        module = f.__self__
    if module is not None:
        roots.append(module)
    code = getattr(f, "__code__", None)
    if code is not None:
        seen = [f.__globals__[n] for n in code.co_names if n in getattr(f, "__globals__", {})]
        for cell in f.__closure__ or ():
            with contextlib.suppress(ValueError):
                seen.append(cell.cell_contents)
        roots.extend(v for v in seen if isinstance(v, torch.nn.Module))
    found: dict[int, torch.nn.Module] = {}
    for root in roots:
        for m in root.modules():
            found.setdefault(id(m), m)
    return list(found.values())


def module_paths(f) -> dict[int, str]:
    """id(module) -> its dotted path, for the modules ``f`` is or closes over (``model.h.0.attn``)."""
    paths: dict[int, str] = {}

    def add(module, prefix):
        for name, m in module.named_modules(remove_duplicate=False):
            first = prefix or root_prefix(module, name)
            paths.setdefault(
                id(m), (f"{first}.{name}" if first else name) if name else ""
            )  # a root's own value keeps its statement's name

    module = f if isinstance(f, torch.nn.Module) else getattr(f, "__fxtools_module__", None)
    if module is not None:
        add(module, "")
    code = getattr(f, "__code__", None)
    if code is not None:
        cells = {}
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            with contextlib.suppress(ValueError):
                cells[name] = cell.cell_contents
        seen = {**{n: f.__globals__[n] for n in code.co_names if n in getattr(f, "__globals__", {})}, **cells}
        for name, value in seen.items():
            if isinstance(value, torch.nn.Module):
                add(value, name)
    return paths


@contextlib.contextmanager
def recording_modules(paths: dict[int, str] | None):
    """While tracing, mark each node a module call returns with the module's path (``meta.MODULE_OUT``).

    ``paths`` (from ``module_paths``) names the modules the traced function is or holds; a module
    called from another one's forward is named after the attribute holding it there (so modules
    reached only through other functions are named too). ``None``: record nothing.
    """
    if paths is None:
        yield
        return
    recorder = _ModuleRecorder(dict(paths))
    hooks = [
        torch.nn.modules.module.register_module_forward_pre_hook(recorder.pre),
        torch.nn.modules.module.register_module_forward_hook(recorder.post),
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


class _ModuleRecorder:
    """The forward hooks of ``recording_modules``: the stack of module calls being traced."""

    def __init__(self, paths: dict[int, str]):
        self.paths = paths
        self.stack: list[tuple[torch.nn.Module, int]] = []
        self.below: dict[int, dict[int, str]] = {}  # id(module) -> {id(submodule): relative path}

    def path_of(self, module) -> str:
        paths, below = self.paths, self.below
        if id(module) not in paths:
            parent = self.stack[-1][0] if self.stack else None
            if parent is not None and id(parent) not in below:
                below[id(parent)] = {id(m): k for k, m in parent.named_modules(remove_duplicate=False) if k}
            name = below[id(parent)].get(id(module)) if parent is not None else None
            if name is None:
                paths[id(module)] = ""  # called from outside any module: a root
            else:
                parent_path = paths.get(id(parent), "") or root_prefix(parent, name)
                paths[id(module)] = f"{parent_path}.{name}" if parent_path else name
        return paths[id(module)]

    def pre(self, module, args):
        if torch.compiler.is_dynamo_compiling():  # a module called in control flow's function (scan's step)
            return
        self.path_of(module)
        mode = proxy_tensor.get_proxy_mode()
        self.stack.append((module, len(mode.tracer.graph.nodes) if mode is not None else -1))

    def post(self, module, args, out):
        if torch.compiler.is_dynamo_compiling() or not self.stack or self.stack[-1][0] is not module:
            return
        _, start = self.stack.pop()
        path = self.paths.get(id(module))
        mode = proxy_tensor.get_proxy_mode()
        if not path or mode is None or start < 0:
            return
        made = len(mode.tracer.graph.nodes) - start
        for leaf in pytree.tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            try:
                node = proxy_tensor.get_proxy_slot(leaf, mode.tracer).proxy.node
            except Exception:  # noqa: BLE001 - not a traced tensor
                return
            if node.op == "call_function" and _among_last(mode.tracer.graph, node, made):
                meta.MODULE_OUT.set(node, path)  # outer modules' hooks run later: the outermost wins
            return  # the first tensor a module returns is its value


def _among_last(graph: fx.Graph, node: fx.Node, count: int) -> bool:
    """Whether ``node`` is one of the last ``count`` nodes of ``graph`` (made during a module call)."""
    cur = graph._root.prev
    for _ in range(count):
        if cur is node:
            return True
        if cur is graph._root:
            return False
        cur = cur.prev
    return False


def _frames(stack_trace) -> tuple:
    """(filename, line, function) of each frame of a node's recorded stack trace, outermost first."""
    out = []
    for line in (stack_trace or "").splitlines():
        m = _FRAME.match(line)
        if m:
            out.append((m.group(1), int(m.group(2)), m.group(3)))
    return tuple(out)


_STATEMENTS: dict[str, dict[int, ast.stmt]] = {}


def _statement(filename: str, line: int) -> ast.stmt | None:
    """The innermost statement of ``filename`` holding ``line`` (parsed once per file)."""
    if filename not in _STATEMENTS:
        index: dict[int, ast.stmt] = {}
        try:
            tree = ast.parse("".join(linecache.getlines(filename)))
        except (SyntaxError, ValueError, MemoryError):
            tree = None
        if tree is not None:
            stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
            for s in sorted(stmts, key=lambda s: -((s.end_lineno or s.lineno) - s.lineno)):
                for i in range(s.lineno, (s.end_lineno or s.lineno) + 1):
                    index[i] = s  # smaller statements, set later, win
        if len(_STATEMENTS) > 256:
            _STATEMENTS.clear()
        _STATEMENTS[filename] = index
    return _STATEMENTS[filename].get(line)


def _target_names(target) -> list | None:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute):
        return [target.attr]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [(_target_names(t) or [None])[0] if not isinstance(t, (ast.Tuple, ast.List)) else None for t in target.elts]
    return None


def _written_variable(target) -> list | None:
    """``[h]`` for what an in-place statement writes into: ``h[1:]``, ``h[0].add_``'s ``h[0]``,
    ``h.diagonal()`` (the variable at the root of subscripts, method calls and attributes)."""
    while isinstance(target, (ast.Subscript, ast.Call, ast.Attribute)):
        if isinstance(target, ast.Call):  # h.diagonal(): the method's receiver
            if not isinstance(target.func, ast.Attribute):
                return None
            target = target.func.value
        elif isinstance(target, ast.Attribute) and not isinstance(target.value, (ast.Subscript, ast.Call, ast.Attribute)):
            break  # self.buf: the attribute names it
        else:
            target = target.value
    return _target_names(target) if isinstance(target, (ast.Name, ast.Attribute)) else None


def _targets(frame, top_codes) -> list | None:
    """Names the statement of ``frame`` assigns (a list, one per tuple element), ``[None]`` if none."""
    filename, line, function = frame
    if function == "<lambda>":
        return ["<return>"]
    if function.startswith("<"):  # comprehensions, generator expressions
        return None
    stmt = _statement(filename, line)
    if isinstance(stmt, ast.Assign):
        return _target_names(stmt.targets[-1]) or _written_variable(stmt.targets[-1])
    if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) and getattr(stmt, "value", None) is not None:
        return _target_names(stmt.target) or _written_variable(stmt.target)
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        method = stmt.value.func
        if isinstance(method, ast.Attribute) and method.attr.endswith("_") and not method.attr.startswith("_"):
            return _written_variable(method.value)  # h.add_(1), h[0].mul_(2), h.diagonal().zero_()
    if isinstance(stmt, ast.Return):
        return ["<return>"]
    return None


def _name_elements(key: tuple, run: list, top_codes, names: dict) -> bool:
    """``q, k, v = (t.view(s).transpose(1, 2) for t in (q, k, v))``: a comprehension's run of nodes
    (one per iteration, the same ops each time) named element by element after the tuple's targets:
    ``q``, ``k``, ``v``, their steps ``q_view``, ... Returns whether it named the run."""
    if len(key) < 2 or not key[-1][2].startswith("<") or key[-1][2] == "<lambda>" or key[-1][0] != key[-2][0]:
        return False
    targets = _targets(key[-2], top_codes)
    n = len(targets or ())
    if n < 2 or not all(t and t != "<return>" for t in targets or ()) or len(run) % n:
        return False
    size = len(run) // n
    chunks = [run[i * size : (i + 1) * size] for i in range(n)]
    if any([m.target for m in c] != [m.target for m in chunks[0]] for c in chunks):
        return False  # not one iteration per element
    for target, chunk in zip(targets or (), chunks):
        *steps, value = chunk
        names.setdefault(value, target)
        for m in steps:
            if m not in names and m.target is not operator.getitem:
                names[m] = f"{target}_{short_op(m)}"
                meta.INTERMEDIATE.set(m, True)
    return True


def _writes(node: fx.Node) -> bool:
    """Whether ``node`` is an in-place op (``add_``, ``copy_``): it writes, its value is not new."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _return_name(frame, node, top_codes) -> str:
    filename, _, function = frame
    if (filename, function) in top_codes or function == "<lambda>":
        val = node.meta.get("val")
        scalar = isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
        return "loss" if scalar else "out"
    return "out" if function in _GENERIC_FUNCTIONS else function


def _top_codes(f) -> set:
    """(filename, function name) of the differentiated function itself."""
    out = set()
    for fn in (f, getattr(f, "forward", None), getattr(getattr(f, "__fxtools_module__", None), "forward", None)):
        fn = getattr(fn, "__func__", fn)
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        code = getattr(fn, "__code__", None)
        if code is not None:
            out.add((code.co_filename, code.co_name))
    return out


def outer_frames() -> tuple:
    """The user frames calling fxtools now: not part of the traced program (stripped from its stack traces)."""
    return tuple((f.filename, f.lineno, f.name) for f in traceback.extract_stack() if is_user_file(f.filename))


def name_values(gm: fx.GraphModule, f, outer: tuple = ()) -> None:
    """Rename ``gm``'s op nodes after the user's modules and variables (see the module docstring).

    ``outer``: the frames that called fxtools (``outer_frames()``); a line there (``gm = fxtools.vmap(...)``)
    names nothing the program computes."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    names: dict[fx.Node, str] = {}
    module_nodes = {n: meta.MODULE_OUT.get(n) for n in nodes if meta.MODULE_OUT.on(n)}
    short = shortest_unique_suffixes(sorted(set(module_nodes.values())))
    for n, path in module_nodes.items():
        names[n] = short[path]
    top = _top_codes(f)
    call_results: dict[tuple, dict[int, fx.Node]] = {}
    for n in nodes:
        if meta.CALL_RESULT.on(n):
            trace, k = meta.CALL_RESULT.get(n)
            at = _frames(trace)
            call_results.setdefault(at[len(outer) :] if outer and at[: len(outer)] == outer else at, {})[k] = n
    runs: list[tuple[tuple, list[fx.Node]]] = []
    open_runs: list[tuple[tuple, list[fx.Node]]] = []
    for n in nodes:
        key = _frames(n.meta.get("stack_trace"))
        if outer and key[: len(outer)] == outer:
            key = key[len(outer) :]
        if not key:
            continue
        while open_runs and not (key[: len(open_runs[-1][0])] == open_runs[-1][0]):
            open_runs.pop()
        if open_runs and open_runs[-1][0] == key:
            open_runs[-1][1].append(n)
        else:
            new_run: tuple[tuple, list[fx.Node]] = (key, [n])
            open_runs.append(new_run)
            runs.append(new_run)
    for key, run in runs:
        if _name_elements(key, run, top, names):
            continue
        targets = _targets(key[-1], top)
        if not targets or (targets[0] is None and len(targets) == 1):
            continue
        base = None
        if len(targets) == 1:
            value: fx.Node = run[-1]
            whole = value.args[0] if value.target is operator.getitem else None
            if isinstance(whole, fx.Node) and whole in run:
                value = whole  # a multi-output op assigned whole (``out = torch.max(x, 1)``)
            base = _return_name(key[-1], value, top) if targets[0] == "<return>" else targets[0]
            writes = [m for m in run if _writes(m)] if targets[0] != "<return>" else []
            for m in writes:  # named where functionalize computes the new value (h_1)
                meta.WRITES.set(m, base)
            if targets[0] != "<return>" and value in module_nodes:
                names[value] = base  # the user's variable beats the module's path (``logits``, not ``fc2``)
            if not writes:
                names.setdefault(value, base)
        else:
            multi = [m for m in run if isinstance(m.meta.get("val"), (tuple, list)) and len(m.meta["val"]) == len(targets)]
            results = call_results.get(key, {})
            if sorted(results) == list(range(len(targets))):  # u, dudt = torch.func.jvp(...)
                for k, m in results.items():
                    if targets[k] and (m not in names or m in module_nodes):
                        names[m] = targets[k]
            elif multi:
                m = multi[-1]
                for u in m.users:
                    if u.target is operator.getitem and isinstance(u.args[1], int) and targets[u.args[1]]:
                        names.setdefault(u, targets[u.args[1]])
            base = next((t for t in targets if t), None)
        if base is None:
            continue
        for n in run:
            if n not in names and n.target is not operator.getitem and not meta.WRITES.on(n):
                names[n] = f"{base}_{short_op(n)}"
                meta.INTERMEDIATE.set(n, True)
    for n in nodes:
        whole = n.args[0] if n.target is operator.getitem else None
        if isinstance(whole, fx.Node) and n not in names and whole in names and isinstance(n.args[1], int):
            names[n] = f"{names[whole]}_{part_name(whole.target, n.args[1])}"
    for n, name in names.items():
        n._rename(identifier(name))


# ---------------------------------------------------------------------------------------------
# a rule's steps, named after the rule's own variables

_FXTOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_RULES = os.path.join(_FXTOOLS, "rules") + os.sep
_ENGINE = os.path.join(_FXTOOLS, "transforms") + os.sep
_LIBRARIES = (_FXTOOLS, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep, "<")


def _is_rule_code(filename: str) -> bool:
    """fxtools' rules, or a user's (code outside fxtools, torch and Python's standard library)."""
    return filename.startswith(_RULES) or not filename.startswith(_LIBRARIES)


def _rule_lines(frame) -> tuple:
    """(file, line) of each frame of rule code calling now, innermost first, up to the engine calling the rule."""
    lines = []
    while frame is not None and not frame.f_code.co_filename.startswith(_ENGINE):
        if _is_rule_code(frame.f_code.co_filename):
            lines.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(lines)


class recording_rule_lines(TorchFunctionMode):
    """While a rule runs under ``make_fx``: mark each node a torch call makes with the lines of rule
    code making it (``meta.RULE_LINES``), so that ``rule_roles`` can name it after the rule's variable.

    One frame walk per torch call the rule makes (not per traced op): cheap beside tracing, unlike
    recording full stack traces."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        mode = proxy_tensor.get_innermost_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        last = graph._root.prev if graph is not None else None
        out = func(*args, **(kwargs or {}))
        if graph is not None and graph._root.prev is not last:
            lines = _rule_lines(sys._getframe(1))
            node = last.next
            while lines and node is not graph._root:
                if not meta.RULE_LINES.on(node):
                    meta.RULE_LINES.set(node, lines)
                node = node.next
        return out


def _rule_target(lines: tuple) -> tuple | None:
    """``(frames, name)``: the rule frames from the first statement assigning one variable outward
    (outermost first), and that variable; a ``return`` defers to the statement calling the
    function. ``None``: no variable names the node."""
    for i, (filename, line) in enumerate(lines):
        stmt = _statement(filename, line)
        if isinstance(stmt, ast.Return):
            continue
        target = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            target = stmt.target
        if isinstance(target, ast.Name) and len(target.id.strip("_")) > 1:  # ``g``, ``t``: no role
            return lines[i:][::-1], target.id.strip("_")
        return None
    return None


def rule_roles(nodes, owner_of) -> dict:
    """``node -> (role, value)`` for the nodes rules made: the rule's variable its statement assigns
    (``xhat``) and the statement's value (its last node; the others are steps inside it, made by
    the statement itself or by the functions it calls). ``owner_of(node)``: the rule call a node
    belongs to (a statement never spans two calls)."""
    runs: list[tuple[tuple, str, list]] = []
    open_runs: list[tuple[tuple, str, list]] = []
    for n in nodes:
        found = _rule_target(meta.RULE_LINES.get(n, ()))
        if found is None:
            continue
        key = (owner_of(n), *found[0])
        while open_runs and key[: len(open_runs[-1][0])] != open_runs[-1][0]:
            open_runs.pop()  # a statement ends where a node outside its calls starts
        if open_runs and open_runs[-1][0] == key:
            open_runs[-1][2].append(n)
        else:
            open_runs.append((key, found[1], [n]))
            runs.append(open_runs[-1])
    return {m: (role, run[-1]) for _, role, run in runs for m in run}


def role_name(value: str, role: str) -> str:
    """A rule's variable named after the value whose rule it is: ``ln_f_xhat``; a gradient the
    rule computes under a ``grad_`` name keeps ``grad_`` first (``grad_y_probs``)."""
    return f"grad_{value}_{role[5:]}" if role.startswith("grad_") else f"{value}_{role}"


def name_rule_steps(graph: fx.Graph, named: set, owners: dict) -> None:
    """Name the nodes rules made, other than the values and cotangents (``named``): after the rule's
    variable (``role_name``; a step inside its statement adds its op: ``ln_f_xhat_sub``), else after
    the named value they compute from and their op (``grad_scores_t``). ``owners[node]``: the value
    whose rule (``ln_f``) or whose rule's backward (``grad_ln_f``) made the node. Steps of a
    statement whose value is a result of the rule (a cotangent) are named after what they compute
    from; a step that is no gradient never takes a ``grad_`` name from its owner alone."""
    roles = rule_roles(graph.nodes, owners.get)
    root: dict[fx.Node, str] = {}  # the named value each intermediate derives from
    for node in graph.nodes:
        if node.op != "call_function" or node in named or node not in owners:
            root[node] = node.name
            continue
        value = owners[node].removeprefix("grad_")
        base = next((root[a] for a in node.all_input_nodes if a in root), value)
        root[node] = base
        role, whole = roles.get(node, (None, None))
        if node.target is operator.getitem and isinstance(node.args[1], int):
            multi = node.args[0]  # one output of a multi-output op: named after its main one
            first = next((u for u in multi.users if u in named and u.target is operator.getitem), None)
            base = first.name if first is not None else base
            node._rename(f"{base}_{part_name(multi.target, node.args[1])}")
        elif role is not None and whole is node:
            node._rename(identifier(role_name(value, role)))
            meta.ROLE.set(node, role)
            root[node] = node.name  # steps computing from it are named after it (``y_probs_t``)
        elif role is not None and whole not in named:
            node._rename(identifier(f"{role_name(value, role)}_{short_op(node)}"))
        else:
            node._rename(f"{base}_{short_op(node)}")
        meta.INTERMEDIATE.set(node, True)
