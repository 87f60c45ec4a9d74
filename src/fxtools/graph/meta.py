"""Everything fxtools keeps on torch.fx nodes and GraphModules, each under one name.

torch.fx gives every node a ``meta`` dict (``val``, ``stack_trace`` come from tracing); fxtools'
stages pass facts to later stages through it. Each fact is a ``Key`` here, read and written
through typed accessors, so a reader finds who sets and who reads a fact by its name::

    meta.RULE.set(node, rule)      # capture/custom.py: the node's own VJP rule
    meta.RULE.get(node)            # transforms/reverse.py: Rule | None
    meta.RULE.on(node)             # is it set?
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch.fx as fx

T = TypeVar("T")


class Key(Generic[T]):
    """One fact in ``node.meta`` (or ``gm.meta``), with what it holds and who writes it."""

    def __init__(self, name: str, doc: str):
        self.name = name
        self.__doc__ = doc

    def get(self, holder: fx.Node | fx.GraphModule, default: Any = None) -> T | Any:
        return holder.meta.get(self.name, default)

    def set(self, holder: fx.Node | fx.GraphModule, value: T) -> None:
        holder.meta[self.name] = value

    def on(self, holder: fx.Node | fx.GraphModule) -> bool:
        return self.name in holder.meta

    def pop(self, holder: fx.Node | fx.GraphModule) -> T | None:
        return holder.meta.pop(self.name, None)

    def copy(self, source: fx.Node, target: fx.Node) -> None:
        """Give ``target`` the fact ``source`` has, if any."""
        if self.name in source.meta:
            target.meta[self.name] = source.meta[self.name]

    def __repr__(self) -> str:
        return f"meta.Key({self.name!r})"


# What a node's derivative is
RULE: Key[Any] = Key(
    "fxtools_rule",
    "The node's own VJP rule (a registry.Rule): custom Functions, control flow, kept mutations, "
    "derived formulas. Set in capture/ and transforms/control_flow.py; read by transforms/reverse.py.",
)
CUSTOM: Key[str] = Key("fxtools_custom", "The kind of custom-backward call the node is (capture/custom.py).")
CHECKPOINT: Key[Any] = Key(
    "fxtools_checkpoint",
    "The torch.utils.checkpoint region a node was traced in; kept inside node.meta['custom'] "
    "(capture/checkpoint.py), where torch.fx copies it; read by training/policies.py.",
)
FORWARD_GRAD: Key[bool] = Key(
    "fxtools_forward_grad",
    "On a _set_grad_enabled node: forward-mode AD's state after it (inference mode, "
    "fwAD._set_fwd_grad_enabled); absent: unchanged (no_grad does not stop forward AD). Set in "
    "capture/trace.py; read by capture/trace.forward_grad_modes.",
)

# Where a node belongs
PART: Key[str] = Key(
    "fxtools_part", '"forward" / "backward" (vjp, grad), "recompute" (split\'s backward): fxtools.draw colours by it.'
)
PHASE: Key[str] = Key("fxtools_phase", '"forward" / "backward": which pass of a joint graph computes the node (split).')
GRAD_OF_CONTROL_FLOW: Key[bool] = Key(
    "fxtools_grad_of_control_flow", "A control-flow node computing a backward (transforms/control_flow.py)."
)

DECOMPOSED: Key[bool] = Key(
    "fxtools_decomposed",
    "A step of PyTorch's decomposition of another op (capture/decompose.py): autograd differentiates that op by "
    "its own formula, so conventions of the step's op where PyTorch's value differs (a where's unselected branch, "
    "rules/taylor.py) do not apply.",
)


RESHAPED_VIEW: Key[str] = Key(
    "fxtools_reshaped_view",
    "A node of a ``.view`` that one sample allows but the batched layout does not, computed as ``reshape`` "
    "(a copy) under vmap; holds the user's line. Set in transforms/batching.py; read by graph/nodes.py "
    "(``refuse_writes_through_reshaped_views``) and codegen/render.py (printed as ``reshape``).",
)

# What a value is called and what it holds
INTERMEDIATE: Key[bool] = Key(
    "fxtools_intermediate",
    "A rule's step, named after the rule's variable (ln_f_xhat) or after the value it computes from and its op "
    "(scores_mm): a better name may replace it.",
)
RULE_LINES: Key[tuple] = Key(
    "fxtools_rule_lines",
    "(file, line) of the rule code that made a node, innermost frame first (capture/names.py, while "
    "transforms/reverse.py traces rules): the rule's local variable there names the node (xhat).",
)
MODULE_OUT: Key[str] = Key(
    "fxtools_module_out", "Path of the outermost module call returning the node's value (capture/names.py)."
)
CALL_RESULT: Key[tuple] = Key(
    "fxtools_call_result",
    "(stack trace of a call, k): the node is the call's k-th result leaf, wherever it was computed "
    "(capture/dual.py stamps a jvp's u and dudt; capture/names.py names them u, dudt = jvp(...)).",
)
WRITES: Key[str] = Key(
    "fxtools_writes",
    "On an in-place op of user code: the user's variable it writes (`h += v`, `h[0] = v`, `h.add_(1)`), "
    "set by capture/names.py; capture/functionalize.py names the variable's new value after it (h_1).",
)
ROLE: Key[str] = Key(
    "fxtools_role",
    "The rule's variable a value is named after (xhat, cdf): codegen/fold.py prints a small one inside its one user.",
)
VIEW_COPY: Key[bool] = Key(
    "fxtools_view_copy",
    "The node computes as a copy (aten.index / index_select) what eager returns as a view of its first "
    "argument (x[t] with a 0-dim integer tensor t, torch.narrow with a tensor start): set by "
    "capture/replacements.py; capture/functionalize.py keeps the copy and its base in step across in-place "
    "writes (True), or refuses such writes (False: the copy could not be written back).",
)
READ_AFTER_WRITE: Key[tuple] = Key(
    "fxtools_read_after_write",
    "On an in-place op kept on an input or buffer: the later nodes reading the memory it writes (the "
    "trace's later reads of `buf` after `buf[0] = v` read the placeholder, not the write). Set by "
    "capture/functionalize.py; transforms/reverse.py counts the write as reaching the outputs those "
    "reads reach, so that its rule refuses a gradient it would otherwise silently drop.",
)
NOTE: Key[str] = Key("fxtools_note", "What a value holds, for Split.report (a scan's value at every step).")

# On a GraphModule
OUT_EXAMPLE: Key[Any] = Key(
    "fxtools_out_example", "gm.meta: the program's output with FakeTensors (shapes and dtypes), for composed transforms."
)
AUX_SPEC: Key[Any] = Key(
    "fxtools_aux_spec",
    "gm.meta: the pytree structure of a has_aux function's auxiliary data (its own containers: an "
    "Interpreter over the module returns fx's immutable ones), for composed transforms.",
)
BUILT_BY: Key[Any] = Key(
    "fxtools_built_by",
    "gm.meta: a transforms.pipeline.Built(front, back) saying which transform's shared front prepared the "
    "program and which one's shared back finished the module (tests/test_pipeline.py checks every transform).",
)

# What a rewritten node keeps of the node it replaces: the user's line and the part it belongs to.
KEPT_ON_REWRITE = ("stack_trace", PART.name)
