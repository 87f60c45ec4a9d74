"""Folding: a value used once, and cheap to compute, is printed inside the expression that uses it.

The graph keeps one op per node (compilers, ``fxtools.split``, ``draw`` and every pass see it so);
only the printed Python nests. ``grad_c_fc = grad_gelu * ((torch.erf(c_fc * 0.7071067811865476) +
1) * 0.5 + c_fc_pdf)`` rather than five lines of ``c_fc_mul``, ``c_fc_erf``, ``c_fc_add``.

A value is folded into its user when all of these hold:

- its name says nothing but its op: an op word, or another value's name with an op word appended
  (``c_fc_mul_4``, ``grad_y_t``, ``gelu``). A value named for what it is (the user's variable
  ``scores``, a module's ``ln_1``, a gradient ``grad_scores``, a rule's role ``xhat``) keeps its
  line, so the code keeps the user's statements and the names the naming stage chose;
- it is cheap and pure: arithmetic and comparison operators, pointwise math (ops PyTorch tags
  ``pointwise``), views and reshapes, ``sum``/``mean``, ``*_like`` factories, sizes, ``x.device``;
  never a matmul, convolution, softmax or other kernel worth a name, never random or in-place;
- it has one user, which reads it once and is a call that writes nothing (not the output);
- the folded statement runs exactly the ATen calls of the flat statements it replaces, in the
  same order: Python evaluates an expression's operands left to right, so the nodes of a folded
  statement must be consecutive in the graph and in that order. Nothing else runs in between, so
  values are computed from the same inputs and the folded code is bit-for-bit the flat code;
- no ``del`` the flat code writes falls inside the statement (a value that must be freed at a
  specific point keeps its own line): memory is freed exactly as in the flat code;
- the statement stays short: at most ``MAX_DEPTH`` levels of nesting (a method chain
  ``x.view(s).transpose(1, 2)`` and a left operand of the same operator ``a - b - c`` read left
  to right and add none) and at most ``MAX_LINE`` characters.

``flat()`` turns folding off where code is generated (``with flat(): gm.recompile()``) and
``flat_code(gm)`` gives a module's flat code without changing it.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import operator
import re
from typing import cast

import torch
import torch.fx as fx

from ..graph import meta

# Deeper than three nested calls, a formula must be read inside out; longer than 100 characters,
# it no longer reads at a glance, and ``fxtools.show``'s shape comments still fit in 130.
MAX_DEPTH = 3
MAX_LINE = 100
MAX_ROLE_DEPTH = 1  # a rule's variable folds while it holds at most one folded step: ``x * pdf``

_FLAT = contextvars.ContextVar("flat_code", default=False)

_CHEAP_OPERATORS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.neg,
    operator.pos,
    operator.invert,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.xor,
    getattr,  # x.device, x.shape
}
_CHEAP_NAMES = {  # views, reshapes, sizes, casts, reductions a formula reads well with, factories
    *("view", "reshape", "expand", "expand_as", "view_as", "transpose", "t", "permute", "unsqueeze", "squeeze"),
    *("narrow", "select", "flatten", "unflatten", "movedim", "diagonal", "contiguous", "to", "type_as", "conj"),
    *("size", "numel", "sum", "mean", "tril", "triu"),
    *("zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "zeros", "ones", "full"),
}
_OP_WORDS = frozenset({name.strip("_") for name in dir(torch.ops.aten)} | {"t", "to", "size", "numel", "getitem", "getattr"})
_PRODUCTS = {operator.mul, operator.truediv, operator.floordiv, operator.mod}  # @'s precedence
_SAME_LEVEL = [(ast.Add, ast.Sub), (ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)]  # a - b - c: one level


@contextlib.contextmanager
def flat():
    """Generate code one op per line (no folding) inside the block: ``with flat(): gm.recompile()``."""
    token = _FLAT.set(True)
    try:
        yield
    finally:
        _FLAT.reset(token)


def folding() -> bool:
    """Whether code generated now is folded (outside ``flat()``)."""
    return not _FLAT.get()


def flat_code(gm: fx.GraphModule) -> str:
    """``gm``'s code with one op per line, as ``gm.code`` would read without folding; ``gm`` is unchanged."""
    with flat():
        return gm.graph.python_code(root_module="self").src


def fold(nodes: list[fx.Node], statements: dict[int, str], frees: dict[int, list[str]]) -> tuple[dict[int, str], set[int]]:
    """Fold the statements of single-use cheap values into their users' statements.

    ``statements``: node index -> its one-line statement (``name = expr``); ``frees``: node index
    -> names the code frees (``del``) after it. Returns the rewritten statements and the indices
    of the nodes whose statements are gone (folded into another).
    """
    pos = {n: i for i, n in enumerate(nodes)}
    parsed: dict[int, ast.Assign | None] = {}

    def parse(i: int) -> ast.Assign | None:
        if i not in parsed:
            parsed[i] = _parse(statements[i]) if i in statements else None
        return parsed[i]

    impure = _Impure()
    trees: dict[fx.Node, _Tree] = {}
    folded: set[str] = set()
    for i, u in enumerate(nodes):
        if i not in statements:
            continue  # nothing is written into a statement fx does not write
        operands = _operands(u) if _may_hold(u, impure) else []
        candidates = [c for c in operands if _foldable(c, u, operands, parse, pos, trees, impure)]
        if not candidates:
            continue
        for c in candidates:
            if c not in trees:
                trees[c] = _Tree.leaf(c, statements[pos[c]], cast(ast.Assign, parse(pos[c])))  # _foldable parsed it
        chosen = _consecutive(u, candidates, trees, pos, frees, folded)
        stmt = parse(i) if chosen else None  # parsed only when something can fold into it
        while chosen and stmt is not None:
            tree = _Tree.build(u, statements[i], stmt, chosen, trees)
            if tree is not None and tree.depth <= MAX_DEPTH and len(tree.text) + 4 <= MAX_LINE:
                trees[u] = tree
                folded.update(c.name for c in chosen)
                break
            chosen = chosen[1:]  # drop the first-evaluated operand: the rest stay consecutive
    gone = {pos[c] for t in trees.values() for c in t.children}
    rewritten = {pos[u]: t.text for u, t in trees.items() if t.children and pos[u] not in gone}
    return rewritten, gone


class _Tree:
    """A statement with operands folded into it: its text, the ``ast.dump`` of its value (the
    expression it assigns; a leaf's, of its statement ``stmt``, made when first read), its first
    node and its nesting depth."""

    def __init__(self, text: str, value: str | None, start: fx.Node, depth: int, children: list[fx.Node], stmt=None):
        self.text, self._value, self.start, self.depth, self.children, self.stmt = text, value, start, depth, children, stmt

    @classmethod
    def leaf(cls, node: fx.Node, text: str, stmt: ast.Assign) -> _Tree:
        return cls(text, None, node, 0, [], stmt)

    @property
    def value(self) -> str:
        if self._value is None:
            self._value = _dumps(self.stmt)[1]
        return self._value

    @classmethod
    def build(cls, u: fx.Node, text: str, stmt: ast.Assign, chosen: list[fx.Node], trees: dict) -> _Tree | None:
        """``u``'s statement with each chosen operand's expression in place of its name (None if
        that cannot be written on one line with the meaning of the nested expression)."""
        target, value = _dumps(stmt)
        for c in chosen:
            name = _name_dump(c.name)
            if value.count(name) != 1:
                return None
            value = value.replace(name, trees[c].value)
        texts = {c.name: trees[c].text[len(c.name) + 3 :] for c in chosen}  # after "name = "
        written = _splice(text, stmt, texts, (target, value))
        if written is None:
            return None
        depth = max(trees[c].depth + _step(u, c, stmt) for c in chosen)
        return cls(written, value, trees[chosen[0]].start, depth, chosen)


@functools.lru_cache(maxsize=256)
def _dumps(stmt: ast.Assign) -> tuple[str, str]:
    """``ast.dump`` of an assignment's target and of its value (a statement is tried with fewer
    operands): together they say what the statement means (``_means``)."""
    return ast.dump(stmt.targets[0]), ast.dump(stmt.value)


def _means(text: str, want: tuple[str, str]) -> bool:
    """Whether ``text`` is one assignment to one target whose target and value dump as ``want``."""
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return False
    stmt = body[0] if len(body) == 1 else None
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and stmt.type_comment is None
        and (ast.dump(stmt.targets[0]), ast.dump(stmt.value)) == want
    )


@functools.lru_cache(maxsize=4096)
def _atomic(expr: str) -> bool:
    """An expression that reads as one operand anywhere (a call, a name, ``x.a``, ``x[i]``)."""
    try:
        value = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(value, (ast.Call, ast.Name, ast.Attribute, ast.Subscript))


@functools.lru_cache(maxsize=4096)
def _name_dump(name: str) -> str:
    return ast.dump(ast.Name(id=name, ctx=ast.Load()))


def _splice(text: str, stmt: ast.stmt, values: dict[str, str], want: tuple[str, str]) -> str | None:
    """``text`` (``stmt``'s source) with each name in ``values`` replaced by its expression's text,
    parenthesised only where the meaning needs it: the result's target and value dump as ``want``
    (else None). The rest of the line keeps fx's spelling."""
    raw = text.encode()  # ast's column offsets count UTF-8 bytes
    spots = [
        (n.col_offset, n.end_col_offset, n.id)
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in values
    ]
    spots.sort(reverse=True)

    def written(parens: list[bool]) -> str:
        out = raw
        for (start, end, name), p in zip(spots, parens):
            piece = values[name].encode()
            out = out[:start] + (b"(" + piece + b")" if p else piece) + out[end:]
        return out.decode()

    checked: dict[str, bool] = {}  # the last candidate tried is often the result: parsed once

    def means_it(candidate: str) -> bool:
        if candidate not in checked:
            checked[candidate] = _means(candidate, want)
        return checked[candidate]

    parens = [not _atomic(values[name]) for _, _, name in spots]
    for k in [k for k, p in enumerate(parens) if p]:
        parens[k] = False
        parens[k] = not means_it(written(parens))
    result = written(parens)
    return result if means_it(result) else None


def _parse(text: str) -> ast.Assign | None:
    """The one assignment ``text`` holds, or None (two statements, an annotation, no assignment)."""
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return None
    if len(body) != 1 or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1:
        return None
    return body[0]


def _operands(u: fx.Node) -> list[fx.Node]:
    """The nodes ``u`` reads, in the order Python evaluates them in ``u``'s statement (repeats kept)."""
    found: list[fx.Node] = []
    fx.node.map_arg((u.args, u.kwargs), found.append)
    return found


def _foldable(c: fx.Node, u: fx.Node, operands: list, parse, pos: dict, trees: dict, impure: _Impure) -> bool:
    """``c`` may be printed inside ``u`` (whose ``operands`` it is one of): cheap, pure, one value
    read once, by ``u`` only, and named for nothing but its op, or a rule's variable
    (``meta.ROLE``) small enough to read inside its user (``x * pdf``, not ``cdf``'s whole formula)."""
    if len(c.users) != 1 or u not in c.users or operands.count(c) != 1:
        return False
    small_role = meta.ROLE.on(c) and (c not in trees or trees[c].depth <= MAX_ROLE_DEPTH)
    if not (_named_by_op(c) or small_role) or not _cheap(c, impure):
        return False
    if u.target is operator.matmul and c.target in _PRODUCTS:
        return False  # ``a / s @ k`` is ``(a / s) @ k``, which few readers see at a glance
    stmt = parse(pos[c])
    target = stmt.targets[0] if stmt is not None else None
    return isinstance(target, ast.Name) and target.id == c.name and not isinstance(c.meta.get("val"), (tuple, list))


def _consecutive(u: fx.Node, candidates: list[fx.Node], trees: dict, pos: dict, frees: dict, folded: set) -> list[fx.Node]:
    """Of ``candidates`` (in evaluation order), those whose statements end right before the next
    folded one's (the last: right before ``u``) and after which the code frees nothing it still
    keeps (but the ``folded`` values', gone with their names): folded, the statement runs the same
    ops in the same order, freeing memory as before."""
    expected = pos[u] - 1
    chosen: list[fx.Node] = []
    for c in reversed(candidates):
        if pos[c] != expected or c in chosen:
            continue
        if any(name not in folded for name in frees.get(pos[c], ())):
            break
        chosen.insert(0, c)
        expected = pos[trees[c].start] - 1
    return chosen


def _step(u: fx.Node, c: fx.Node, stmt: ast.stmt) -> int:
    """Nesting ``c`` inside ``u`` adds: 0 for a method's receiver (``x.view(s).t()`` reads left to
    right) and for the left operand of the same operator level (``a - b - c``), else 1."""
    if u.op == "call_method" and u.args and u.args[0] is c:
        return 0
    value = stmt.value if isinstance(stmt, ast.Assign) else None
    if isinstance(value, ast.BinOp) and isinstance(value.left, ast.Name) and value.left.id == c.name:
        inner = c.target if c.op == "call_function" else None
        op_of = {operator.add: ast.Add, operator.sub: ast.Sub, operator.mul: ast.Mult, operator.truediv: ast.Div}
        if inner in op_of:
            return 0 if any(isinstance(value.op, g) and op_of[inner] in g for g in _SAME_LEVEL) else 1
    return 1


def _named_by_op(node: fx.Node) -> bool:
    """Whether ``node``'s name, counters (``_2``) aside, is an op word or ends in ``_`` and one."""
    return _name_is_op(node.name)


@functools.lru_cache(maxsize=8192)
def _name_is_op(name: str) -> bool:
    words = re.sub(r"(_\d+)+$", "", name).split("_")
    return any("_".join(words[k:]) in _OP_WORDS for k in range(len(words)))


def _may_hold(u: fx.Node, impure: _Impure) -> bool:
    """Operands may be folded into ``u``: a call that writes none of its arguments."""
    if u.op not in ("call_function", "call_method", "call_module"):
        return False
    if u.op == "call_method" and u.target.endswith("_"):
        return False
    if isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable:
        return False
    return u.op != "call_function" or not impure(u)


class _Impure:
    """``node.is_impure()``, asked once per function called in one code generation: but for a
    higher-order op's (``auto_functionalized``: its first argument says), the answer depends on
    the function alone, and a graph calls the same few functions hundreds of times."""

    def __init__(self):
        self.targets: dict = {}

    def __call__(self, node: fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or isinstance(target, torch._ops.HigherOrderOperator):
            return node.is_impure()
        found = self.targets.get(target)
        if found is None:
            found = self.targets[target] = node.is_impure()
        return found


def _cheap(c: fx.Node, impure: _Impure) -> bool:
    """A pure op cheap enough to need no name of its own (see the module docstring)."""
    if c.op not in ("call_function", "call_method") or "out" in c.kwargs or impure(c):
        return False
    if c.op == "call_function" and c.target in _CHEAP_OPERATORS:
        return c.target is not getattr or len(c.args) == 2
    if c.op == "call_function" and c.target is operator.getitem:
        return isinstance(c.args[0], fx.Node) and isinstance(c.args[0].meta.get("val"), torch.Tensor)
    if isinstance(c.target, torch._ops.OpOverload):
        return _cheap_op(c.target.overloadpacket.__name__)
    return _cheap_op(c.target if isinstance(c.target, str) else getattr(c.target, "__name__", ""))


@functools.cache
def _cheap_op(name: str) -> bool:
    """Whether the ATen ops named ``name`` are cheap: views, sizes, ``sum``/``mean``, factories
    (``_CHEAP_NAMES``) or pointwise, and never random or in place."""
    packet = getattr(torch.ops.aten, name, None) if name and not name.endswith("_") else None
    if packet is None:
        return False
    overloads = [getattr(packet, o) for o in packet.overloads()]
    if any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads):
        return False
    return name in _CHEAP_NAMES or any(torch.Tag.pointwise in o.tags and not o._schema.is_mutable for o in overloads)
