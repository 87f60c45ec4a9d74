"""``log(f)(*args)``: run ``f`` and print every op as it executes, with shapes.

Like the ``Logger`` layer of a dispatcher stack: it does not change what runs, it only reports
it. For an ordinary function (or module) the ops are ATen ops seen by a ``TorchDispatchMode``,
so every op is shown, also those inside ``nn.Module`` calls and PyTorch functions; values are
named ``t0, t1, ...`` in order of appearance (inputs first). For a GraphModule (anything fxtools
generated) each line is one node of its code, under the node's own name::

    sin: f64[13] = torch.sin(x)
    add: f64[13] = sin + x
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["log"]

_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
    torch.uint8: "u8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def _type(t: torch.Tensor) -> str:
    return f"{_DTYPES.get(t.dtype, str(t.dtype).replace('torch.', ''))}{list(t.shape)}"


class _Names:
    def __init__(self):
        self.ids: dict[int, str] = {}
        self.refs = []

    def __call__(self, t: torch.Tensor, fresh=False) -> str:
        key = id(t)
        if fresh or key not in self.ids:
            self.ids[key] = f"t{len(self.ids)}"
            self.refs.append(weakref.ref(t) if not isinstance(t, torch.nn.Parameter) else (lambda t=t: t))
        return self.ids[key]


def _short(x, names):
    if isinstance(x, torch.Tensor):
        return names(x)
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_short(i, names) for i in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    return repr(x)


class _OpLog(TorchDispatchMode):
    def __init__(self, names, write):
        super().__init__()
        self.names, self.write = names, write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        arg_text = ", ".join([_short(a, self.names) for a in args] + [f"{k}={_short(v, self.names)}" for k, v in kwargs.items()])
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        lhs = ", ".join(f"{self.names(o, fresh=True)}: {_type(o)}" for o in outs) or "_"
        self.write(f"{lhs} = {func}({arg_text})")
        return out


class _GraphLog(fx.Interpreter):
    def __init__(self, gm, write):
        super().__init__(gm)
        self.write = write
        self.code = {}
        for node in gm.graph.nodes:
            self.code[node] = node.format_node() or ""

    def run_node(self, n):
        out = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module"):
            shapes = ", ".join(_type(o) for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
            self.write(f"{n.name}: {shapes or type(out).__name__} = {_call_text(n)}")
        return out


def _call_text(n: fx.Node) -> str:
    args = ", ".join([str(a) for a in n.args] + [f"{k}={v}" for k, v in n.kwargs.items()])
    if n.op == "call_method":
        first, rest = (str(n.args[0]), ", ".join(str(a) for a in n.args[1:])) if n.args else ("?", "")
        return f"{first}.{n.target}({rest})"
    import operator

    symbols = {
        operator.add: "+",
        operator.sub: "-",
        operator.mul: "*",
        operator.truediv: "/",
        operator.matmul: "@",
        operator.pow: "**",
        operator.gt: ">",
        operator.lt: "<",
        operator.ge: ">=",
        operator.le: "<=",
        operator.eq: "==",
        operator.ne: "!=",
    }
    if n.target in symbols and len(n.args) == 2 and not n.kwargs:
        return f"{n.args[0]} {symbols[n.target]} {n.args[1]}"
    if n.target is operator.neg:
        return f"-{n.args[0]}"
    if n.target is operator.getitem:
        return f"{n.args[0]}[{n.args[1]!r}]"
    name = getattr(n.target, "__name__", str(n.target))
    module = getattr(n.target, "__module__", None)
    if module and module.startswith("torch") and not module.startswith("torch._ops"):
        name = f"{module.replace('torch._C._nn', 'torch.nn.functional').replace('torch._C._VariableFunctions', 'torch')}.{name}"
    elif module == "_operator":
        name = f"operator.{name}"
    return f"{name}({args})"


def log(f, *, file=None):
    """Wrap ``f`` so that calling it prints each op it runs (with result shapes and dtypes).

    ``fxtools.log(f)(*args)`` returns what ``f(*args)`` returns. Output goes to ``file`` (default
    ``sys.stdout``). On a GraphModule (fxtools' results) each generated line is reported under
    its name; on anything else, each ATen op.
    """

    def write(line):
        print(line, file=file if file is not None else sys.stdout)

    @functools.wraps(f)
    def logged(*args, **kwargs):
        if isinstance(f, fx.GraphModule) and not kwargs:
            return _GraphLog(f, write).run(*args)
        names = _Names()
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                names(leaf)
        with _OpLog(names, write):
            return f(*args, **kwargs)

    return logged
