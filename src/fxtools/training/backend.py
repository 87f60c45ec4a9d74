"""Training with fxtools' graphs: ``fxtools.compile`` and the ``torch.compile`` backend.

``compile(model_or_fn, *example_args, fw_compiler=None, bw_compiler=None, policy=...)`` returns
a callable (an ``nn.Module`` wrapping the original one, for a module) whose forward runs
``Split.forward`` inside a ``torch.autograd.Function`` and whose backward runs
``Split.backward``. ``loss.backward()`` and optimizers work unchanged: gradients land in the
``.grad`` of the original tensors, so an optimizer built on ``model.parameters()`` keeps working.

``torch.compile(model, backend=fxtools.backend(...))`` does the same for the graphs TorchDynamo
captures: each is differentiated by fxtools as a function of its inputs (parameters usually arrive
as inputs; any the graph holds itself are treated as inputs too).

Compilers plug in as in AOTAutograd (``fw_compiler``, ``bw_compiler``, or ``compiler`` for both;
``"inductor"`` stands for ``torch._inductor.compile_fx.compile_fx_inner``). Each gets the ATen form
of its graph (``fxtools.to_aten``: functional ATen ops only, flat outputs, a descriptor on every
placeholder and output) and FakeTensor example inputs under a ``TracingContext``, and returns a
callable: ``compiler(gm)`` or ``compiler(gm, example_inputs)``. The ATen forward is called as
``fw(*tensor_leaves, *buffers) -> (*outputs, *saved, *updated buffers)``, the backward as
``bw(*saved, *cotangents) -> grads``; a result with ``_boxed_call`` (Inductor's) is called with one
list it empties, so saved tensors are freed after their last use. Without a backward compiler the
readable backward runs boxed (``Split.backward_boxed``), freeing each saved activation after its
last use. Saved values go through ``ctx.save_for_backward`` (PyTorch's saved-tensor hooks see
them), a policy may offload them to CPU memory, and a backward with ``create_graph=True`` runs the
captured program again with autograd recording, so it can be differentiated (``training/saved.py``).

An argument the program writes in place with a differentiable value (``y[:, 1:].mul_(w[1:])``; in
a Dynamo graph, a tensor the program made and wrote after a graph break) is computed out of place
by the split, whose forward returns its new value; the runner writes it into the argument after
the autograd.Function with autograd recording (``training/written.py``), as AOTAutograd does.

Graphs are specialised to the arguments as every generated module is (``fxtools.signature.guards``: structure,
shapes, dtypes, device types, strides where the code relies on them, Python values), to
``model.training`` and to which inputs require gradients. A call runs the first cached split
whose guards accept it (the same checks ``Split.guards`` makes); otherwise a new split is made
and cached.

Rules: training graphs are run far more often than they are read, so both use the ``"fused"``
rule set by default (``rules="fused"``): backwards call PyTorch's fused backward kernels
(``native_layer_norm_backward``, ``convolution_backward``, flash attention's backward, ...) as
autograd does, which makes them faster and about half the size. ``rules="readable"`` gives the
graphs ``fxtools.grad`` prints, with every backward written out; ``rules=None`` uses the set of
the enclosing ``fxtools.rule_set`` block.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.utils import _pytree as pytree

from ..capture.nested import functorch_regions
from ..errors import FxtoolsError
from ..functional import functional
from ..graph.nodes import ancestors, fake_mode_of, is_float
from ..signature import closures
from ..signature.guards import InputMismatch, without_autocast
from ..signature.naming import identifier
from ..signature.runtime import autocast_state
from . import policies
from .aten import to_aten
from .closed_over import ClosedOver, Lifted, register_dict
from .distributed import SubclassLeaves, Wrappers, local_view, with_subclass_leaves
from .fastpath import Memo, Parameters
from .finite import Checker, locate
from .partition import Split, split
from .saved import Replay, SavedValues, graph_kept, release, rng_state
from .written import carriers

__all__ = ["compile", "backend", "CompiledModule"]


def _resolve_compiler(compiler):
    """A compiler function; ``"inductor"`` is ``torch._inductor.compile_fx.compile_fx_inner``."""
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner
    if isinstance(compiler, str):
        raise ValueError(f'unknown compiler {compiler!r}: pass "inductor" or a function (gm, example_inputs) -> callable')
    return compiler


def _is_inductor(compiler) -> bool:
    return compiler is not None and (getattr(compiler, "__module__", None) or "").startswith("torch._inductor")


def _apply_compiler(compiler, gm, example_inputs):
    if compiler is None:
        return gm
    try:
        params = [
            p
            for p in inspect.signature(compiler).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    two = len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    return compiler(gm, example_inputs) if two else compiler(gm)


def _compile(compiler, gm: fx.GraphModule, examples, sp: Split, donated=None):
    """``compiler(gm, example_inputs)`` as AOTAutograd calls it: the example inputs are FakeTensors
    of a fake mode with a ShapeEnv, which a ``TracingContext`` holds (Inductor's FX graph cache
    needs it). With symbolic sizes, the split's own fake values and mode.

    Returns the compiled graph and the strides of its outputs where the compiler reports them
    (Inductor does: it may lay out saved activations as it likes, e.g. channels-last after a
    convolution, and the backward must be compiled for the layout it will get), else None.

    ``donated`` (a backward's): the inputs whose memory the graph may reuse after their last use
    (``AtenSplit.donated``); Inductor reads them from the ``TracingContext`` as AOTAutograd
    leaves them there, and compiles the graph as a backward (``is_backward``)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if sp.captured.symbolic is None:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        examples = [mode.from_tensor(x, static_shapes=True) for x in examples]
    else:
        examples = [p.meta["val"] for p in gm.graph.nodes if p.op == "placeholder"]
        mode = fake_mode_of(examples, create=True)
    context = TracingContext(mode)
    with tracing(context), TracingContext.report_output_strides() as strides, _fixed_layouts(compiler):
        _joint_graph_passes(compiler, gm, mode)
        if donated is not None:
            context.fw_metadata = _Donated(list(donated))
            with _freed_at_last_use():
                compiled = compiler(gm, examples, is_backward=True)
        else:
            compiled = _apply_compiler(compiler, gm, examples)
    return compiled, (list(strides) if strides else None)


class _Donated:
    """What Inductor reads of AOTAutograd's ``ViewAndMutationMeta`` while compiling a backward
    (``torch._inductor.utils.get_donated_idxs``): its donated inputs."""

    def __init__(self, bw_donated_idxs: list[int]):
        self.bw_donated_idxs = bw_donated_idxs
        self.static_input_indices: list[int] = []


def _joint_graph_passes(compiler, gm: fx.GraphModule, mode) -> None:
    """Inductor's joint-graph passes on ``gm`` (in place), as ``torch.compile`` runs them on the
    joint graph before partitioning it (``compile_fx_inner`` does not): pattern rewrites such as a
    one-hot ``scatter`` into a zero tensor becoming a fused ``where(iota == index)``, uniform
    constants folded, no-op views and conversions removed. Without them Inductor materialises
    what it would have fused (the cross-entropy gradient's one-hot: two more logits-sized buffers
    at the start of the backward). ``mode``: the fake mode of the ``TracingContext``."""
    if not _is_inductor(compiler):
        return
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    with mode:  # the replacements are traced on fake values, as under AOTAutograd
        joint_graph_passes(gm)


def _freed_at_last_use():
    """Inductor's buffer reuse off, for a backward: with it, a buffer past its last use stays
    allocated until a later buffer of the same size takes it over, where Inductor's estimate of
    the peak (which does not see the memory an extern kernel such as attention's backward
    allocates inside) says that costs nothing. On the small GPT of ``bench_memory.py`` at budget
    0.5, two MLP-sized buffers waited through an attention's backward for their reuse: 6.31 MB
    measured, against 5.70 MB freed at their last use, as fxtools' predicted peak assumes."""
    from torch._inductor import config

    return config.patch(allow_buffer_reuse=False)


def _fixed_layouts(compiler):
    """Inductor's layout optimisation off: with it, Inductor lays out a convolution's saved
    output channels-last, and the backward, though compiled for the strides the forward reports,
    computes a wrong weight gradient for a strided 1x1 convolution feeding a BatchNorm (a ResNet
    shortcut). Saved values keep the readable graphs' layouts."""
    if not _is_inductor(compiler):
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(layout_optimization=False)


def _example(val, stride=None):
    """A real tensor like ``val`` (a traced value): its size, dtype and device, its strides or
    ``stride``, zeros."""
    stride = val.stride() if stride is None else stride
    return torch.empty_strided(val.shape, stride, dtype=val.dtype, device=val.device).zero_()


def _compile_backward(compiler, aten, sp: Split, saved_strides, donated=None):
    """The compiled ATen backward, called as ``bw(*saved, *cotangents)`` (it is handed the tensors
    it holds itself, ``aten.backward_buffers``), and the strides it was made for (None where
    symbolic). ``saved_strides``: the layouts the compiled forward gives the saved values."""
    vals = [p.meta["val"] for p in aten.backward.graph.nodes if p.op == "placeholder"]
    if sp.captured.symbolic is None:
        strides = [_int_stride(s) for s in (saved_strides or [])][: len(sp.saved)]
        strides += [None] * (len(vals) - len(strides))
        examples = [_example(v, s) for v, s in zip(vals, strides)]
    else:
        examples = vals
    compiled, _ = _compile(compiler, aten.backward, examples, sp, donated)
    return _with_buffers(compiled, aten.backward_buffers), [_static_stride(x) for x in examples]


def _int_stride(stride):
    """A reported stride as a tuple of ints, or None where it is missing or symbolic."""
    try:
        return None if stride is None else tuple(int(k) for k in stride)
    except (TypeError, ValueError, RuntimeError):
        return None


def _with_buffers(fn, buffers: list):
    """``fn``, which takes ``buffers`` after its other arguments, called without them (boxed if
    ``fn`` is)."""
    if not buffers:
        return fn
    if getattr(fn, "_boxed_call", False):

        def boxed(args):
            args.extend(buffers)
            return fn(args)

        boxed._boxed_call = True
        return boxed
    return lambda *args: fn(*args, *buffers)


def _call(fn, args: list):
    """Call a compiled graph: boxed (``fn(args)``, the callee empties the list) when it says so,
    as AOTAutograd calls compilers' results, else ``fn(*args)``."""
    if getattr(fn, "_boxed_call", False):
        return fn(args)
    return fn(*args)


class _Runner:
    """A split with its compiled graphs, and how to call them from an autograd.Function.

    Without compilers it runs the readable graphs (the backward boxed, freeing each saved value
    after its last use). A compiler gets the ATen form (``training/aten.py``) of its graph and
    example inputs, as AOTAutograd's compilers do; the results are called boxed if they say so
    (``_boxed_call``, as Inductor's are).
    """

    def __init__(
        self, sp: Split, leaves, fw_compiler, bw_compiler, decompositions=None, check_finite=False, name="fxtools.compile"
    ):
        self.split = sp
        self.checker = Checker(sp) if check_finite else None  # check_finite: training/finite.py
        fw_compiler, bw_compiler = _resolve_compiler(fw_compiler), _resolve_compiler(bw_compiler)
        self.aten, self.donated = None, None
        if fw_compiler is not None or bw_compiler is not None:
            if decompositions is None and (_is_inductor(fw_compiler) or _is_inductor(bw_compiler)):
                decompositions = "inductor"
            self.aten = to_aten(sp, decompositions)
        # the graphs' own guards are skipped (``.forward``): _Runners chose this split by sp.guards
        if fw_compiler is None:
            self.fw, self.fw_aten, out_strides = sp.forward.forward, False, None
        else:
            examples = [x.detach() for x in leaves] + list(self.aten.buffers)
            (self.fw, out_strides), self.fw_aten = _compile(fw_compiler, self.aten.forward, examples, sp), True
        if bw_compiler is None:
            self.bw, self.bw_aten = sp.backward_boxed.forward, False
        else:
            saved_strides = out_strides[self.aten.n_outputs :] if out_strides else None
            self.donated = self.aten.donated() if _is_inductor(bw_compiler) else None
            backward = _compile_backward(bw_compiler, self.aten, sp, saved_strides, self.donated)
            (self.bw, strides), self.bw_aten = backward, True
            self.ct_strides = strides[len(sp.saved) : len(sp.saved) + len(sp.cotangents)]
        cap = sp.captured
        self.out_leaves = cap.out_leaves
        self.out_is_tensor = [isinstance(o, torch.Tensor) for o in cap.out_leaves]
        tensor_positions = [i for i, t in enumerate(self.out_is_tensor) if t]
        self.ct_positions = [tensor_positions.index(i) for i in sp.ct_index]
        self.saved = SavedValues(sp.saved)
        self.unreached = unreached_leaves(cap.gm)
        needs_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
        self.constant_outputs = constant_outputs(cap.gm, needs_grad if any(needs_grad) else None)
        self.replay = Replay(sp, compiled_forward=self.aten.forward if self.fw_aten else None)
        self.subclasses: SubclassLeaves | None = None  # DTensor arguments and outputs (distributed.py)
        self.layouts = None if self.aten is None else _compiled_layouts(self.aten.forward, leaves)
        # the strides of examples with no symbolic stride, computed once (checked every call)
        self._fixed_strides = None if self.layouts is None else [_fixed_stride(w) for w in self.layouts]
        self.returned_inputs = returned_inputs(cap.gm, self.out_is_tensor)
        self.reads_offsets: bool | None = None  # whether its guards read a storage offset (training/fastpath.py)
        self.write_back = sp.write_back  # arguments the program writes with a differentiable value (training/written.py)
        self.name = name  # in messages (``Options.name``)

    def takes_layout(self, leaves) -> bool:
        """Whether the compiled graphs were made for the strides of ``leaves`` (compilers such as
        Inductor specialise to their example inputs' strides, as ``torch.compile`` guards on them:
        a transposed, expanded or channels-last input gets graphs of its own). Readable graphs
        take any layout their guards accept."""
        if self.layouts is None:
            return True
        return all(
            not isinstance(x, torch.Tensor)
            or (fixed if fixed is not None else _expected_stride(want, x)) in (None, tuple(x.stride()))
            for want, fixed, x in zip(self.layouts, self._fixed_strides, leaves)
        )

    def run_forward(self, leaves):
        if not self.fw_aten:
            out, saved = self.fw(*leaves)
            return pytree.tree_leaves(out), list(saved)
        a = self.aten
        flat = list(_call(self.fw, [*leaves, *a.buffers]))
        n, m = a.n_outputs, a.n_outputs + a.n_saved
        with torch.no_grad():
            for i, new in zip(a.mutated, flat[m:]):
                a.buffers[i].copy_(new)
        it = iter(flat[:n])
        return [next(it) if t else o for t, o in zip(self.out_is_tensor, self.out_leaves)], flat[n:m]

    def run_backward(self, saved: list, cts: list):
        if not self.bw_aten:
            args = saved + cts
            saved.clear()
            return self.split.flat_grads(self.bw(args))
        cts = [_restrided(c, s) for c, s in zip(cts, self.ct_strides)]
        _own(saved, self.donated or ())
        args = saved + cts
        saved.clear()
        return list(_call(self.bw, args))

    def __call__(self, leaves):
        """Run on the tensor leaves of arguments the split's guards accepted (inside an autocast
        region with autocast off: the graphs made for it hold its casts)."""
        with without_autocast(autocast_state()):
            if self.write_back is not None:  # the new values returned after the outputs, then written
                return self.write_back.call(self._call, leaves, self.name)
            return self._call(leaves)

    def _call(self, leaves):
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
            outs = _SplitFunction.apply(self, *leaves)
        else:
            rng = rng_state(leaves) if self.checker else None
            with torch.no_grad():
                local = leaves if self.subclasses is None else self.subclasses.locals(leaves)
                outs, _ = self.run_forward(local)
                if self.checker:
                    self.checker.forward(local, outs, rng)
                if self.subclasses is not None:
                    outs = self.subclasses.outputs(outs)
        if self.returned_inputs and self.subclasses is None:
            outs = list(outs)
            for k, j in self.returned_inputs.items():
                outs[k] = leaves[j]
        it = iter(outs)
        full = [next(it) if t else o for t, o in zip(self.out_is_tensor, self.out_leaves)]
        return pytree.tree_unflatten(full, self.split.out_spec)


def returned_inputs(gm: fx.GraphModule, out_is_tensor: list[bool]) -> dict[int, int]:
    """Tensor output position -> tensor input position, for the outputs that are an input itself
    (``return x``, ``x.to(x.dtype)``, ``y.contiguous()`` on a contiguous ``y``). The caller gets
    that input object back, as eager and ``torch.compile`` give it (an autograd.Function would
    hand back a new view of it, and a compiled graph may copy it): its identity, ``.grad`` and
    in-place updates are the input's. Its gradient flows to the input directly."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    outs = pytree.tree_leaves(gm.graph.output_node().args[0])
    if len(outs) != len(out_is_tensor):
        return {}
    tensor_outs = [o for o, t in zip(outs, out_is_tensor) if t]
    return {k: placeholders[o] for k, o in enumerate(tensor_outs) if isinstance(o, fx.Node) and o in placeholders}


def _own(saved: list, donated) -> None:
    """Make each of ``saved[donated]`` memory the compiled backward may overwrite: one that
    something else still refers to (the graph kept for another backward, a saved-tensor hook's
    reference, a view) is replaced by a copy."""
    keep = graph_kept()
    for i in donated:
        t = saved[i]
        # references: the list, ``t``, getrefcount's argument; the storage: ``t`` and its Python object
        if keep or sys.getrefcount(t) > 3 or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2:
            saved[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
        del t


def _compiled_layouts(forward: fx.GraphModule, leaves) -> list:
    """The traced value of each tensor leaf the ATen graphs were made from: its strides (with
    symbolic sizes, expressions of the sizes) are those the graphs' views and the compiled code
    assume."""
    return [p.meta.get("val") for p in forward.graph.nodes if p.op == "placeholder"][: len(leaves)]


def _fixed_stride(want):
    """``want``'s strides if none is symbolic (the same at every size), else None."""
    if not isinstance(want, torch.Tensor) or any(isinstance(s, torch.SymInt) for s in want.stride()):
        return None
    return tuple(int(s) for s in want.stride())


def _expected_stride(want, x: torch.Tensor):
    """The strides ``want`` (a leaf's example) has at ``x``'s sizes, or None where they cannot be
    told (not a tensor, a stride no size determines)."""
    if not isinstance(want, torch.Tensor):
        return None
    subs = {s.node.expr: n for s, n in zip(want.shape, x.shape) if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol}
    try:
        return tuple(int(s.node.expr.xreplace(subs)) if isinstance(s, torch.SymInt) else int(s) for s in want.stride())
    except (TypeError, ValueError, RuntimeError):
        return None


def _static_stride(val):
    """``val``'s strides as numbers; ``"contiguous"`` for symbolic contiguous strides; None for
    other symbolic ones (the compiled graph takes the layout it was made for). ``int`` of a
    symbolic stride would specialise its sizes to the example's (a guard on the shared ShapeEnv)."""
    from torch._prims_common import make_contiguous_strides_for

    stride = val.stride()
    if not any(isinstance(s, torch.SymInt) and not s.node.expr.is_number for s in stride):
        return tuple(int(s) for s in stride)
    contiguous = make_contiguous_strides_for(val.shape)
    return "contiguous" if all(_expr(a) == _expr(b) for a, b in zip(stride, contiguous)) else None


def _expr(s):
    return s.node.expr if isinstance(s, torch.SymInt) else s


def _restrided(t, stride):
    """``t`` with the strides the compiled backward was made for (autograd may hand a cotangent
    in another layout, e.g. expanded from a scalar)."""
    if stride == "contiguous":
        return t.contiguous()
    if stride is None or t.stride() == stride:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


@dataclass(frozen=True)
class Options:
    """How ``fxtools.compile`` (and ``backend``) split and compile: its keyword arguments, which
    travel together from the call to every split it makes (see ``compile``)."""

    fw_compiler: Any = None
    bw_compiler: Any = None
    policy: Any = "recompute_cheap"
    rules: Any = "fused"
    dynamic_shapes: Any = None
    dynamic: bool = False
    decompositions: Any = None
    split: Any = None  # one given split (``Split.edit``) run instead of making splits
    check_finite: bool = False
    name: str = "fxtools.compile"  # in messages: fxtools.compile, or fxtools.backend

    def running(self) -> tuple:
        """What a ``_Runner`` takes of them: ``(fw_compiler, bw_compiler, decompositions, check_finite, name)``."""
        return self.fw_compiler, self.bw_compiler, self.decompositions, self.check_finite, self.name

    def split_policy(self):
        """The policy the splits take: a memory budget compiled by Inductor plans for its fusion
        (``policies.budget(..., fused=True)``: no value recomputed twice where Inductor would
        compute the second in the first's kernel)."""
        p = self.policy
        if isinstance(p, policies.Budget) and not p.fused and _is_inductor(_resolve_compiler(self.bw_compiler)):
            return policies.Budget(p.limit, p.peak, fused=True)
        return p


_MEMOS = 4  # calls whose choice of runner a ``_Runners`` keeps (training/fastpath.py)


class _Runners:
    """The split graphs of ``fn``. A call runs the first whose guards (``Split.guards``, as every
    generated module checks them: structure, sizes, dtypes, devices, layouts where the code needs
    them, Python values) accept its arguments, made in the same training mode and for the same
    pattern of ``requires_grad``; if none does, a new split is made and kept.

    With symbolic sizes (``dynamic_shapes``, or ``dynamic=True``: ``Dim.AUTO`` for every size > 1
    of every tensor argument but the parameters) a split serves every call whose sizes it
    accepts (its guards check the symbols' ranges); others get a new split.
    """

    def __init__(self, fn, options: Options, skip_first=False, capturing=contextlib.nullcontext):
        self.fn, self.options, self.fixed, self.skip_first = fn, options, options.split, skip_first
        self.capturing = capturing  # the context in which ``fn`` is traced
        self.entries: list = []  # (training, requires_grad mask, runner)
        self.memos: list[Memo] = []  # the choices of the last calls (training/fastpath.py), cleared with entries
        self.lifted: Lifted | None = None  # closed-over tensors requiring grad, passed as inputs (closed_over.py)

    def _marks(self, args):
        """dynamic_shapes by position for ``args`` (None: static)."""
        if self.options.dynamic_shapes is not None:
            marks = self.options.dynamic_shapes
            if isinstance(marks, dict):
                return marks
            marks = tuple(marks)
            return (None, *marks) if self.skip_first else marks
        if not self.options.dynamic:
            return None
        from torch.export import Dim

        def mark(x):
            if not isinstance(x, torch.Tensor):
                return None
            return {d: Dim.AUTO for d, n in enumerate(x.shape) if n > 1} or None

        return tuple(
            None
            if (i == 0 and self.skip_first) or isinstance(a, ClosedOver)
            else pytree.tree_map(mark, a, is_leaf=lambda x: isinstance(x, torch.Tensor))
            for i, a in enumerate(args)
        )

    def __call__(self, args, training, remember=False):
        """``(runner, tensor leaves)`` for ``args``; DTensor leaves stay DTensors (the runner's
        autograd function takes them, its graphs their local tensors: ``training/distributed.py``).

        A call inside ``torch.autocast`` (around the compiled model) gets graphs made for that
        autocast state (``autocast_state``), whose casts are ops of the code.

        A call of the structure, Python values, tensor metadata and autocast state of one of the
        last few calls made with ``remember`` gets that call's runner without the full check
        (``training/fastpath.py``); the closed-over state is checked on every call."""
        amp = autocast_state()
        if amp:
            training = (training, amp)
        compiling = torch.compiler.is_compiling()  # traced by torch.compile: the full check, traceable
        for memo in self.memos if not compiling else ():
            leaves = memo.leaves(args, training)
            if leaves is not None:
                closures.check(memo.runner.split.forward)  # closed-over state (signature/closures.py)
                return memo.runner, leaves
        view = local_view(args)
        if view is None:
            runner, leaves = self._lookup(self._with_lifted(args), training, amp=amp)
        else:
            runner, leaves = self._lookup(view.args(args), (training, view.key), view, amp=amp)
            leaves = with_subclass_leaves(leaves, args)
        closures.check(runner.split.forward)  # closed-over state (signature/closures.py)
        if remember and view is None and self.lifted is None and not compiling:
            self._remember(args, training, runner, leaves)
        return runner, leaves

    def _remember(self, args, training, runner, leaves) -> None:
        """Memoise this call's runner (``training/fastpath.py``), the last ``_MEMOS`` calls' kept."""
        if runner.reads_offsets is None:
            runner.reads_offsets = any(r.kind == "storage_offset" for leaf in runner.split.guards.leaves() for r in leaf.reads)
        memo = Memo.make(args, training, runner, leaves, runner.reads_offsets)
        if memo is not None:
            self.memos = [memo, *self.memos[: _MEMOS - 1]]

    def _lookup(self, args, training, view=None, amp=()):
        if self.fixed is not None:  # one given split (an edited one): its guards decide, nothing new is made
            leaves = self.fixed.guards.check(args)
            if not self.entries:
                self.entries.append((training, None, _Runner(self.fixed, leaves, *self.options.running())))
            if not self.entries[0][2].takes_layout(leaves):
                raise InputMismatch(
                    "the given split's compiled graphs were made for other strides of its inputs "
                    "(a compiler specialises to them): make the split with an example of this layout"
                )
            return self.entries[0][2], leaves
        with without_autocast(amp):  # graphs made for this autocast state: their casts are ops of the code
            return self._made(args, training, view, amp)

    def _made(self, args, training, view, amp):
        mask = _requires_grad(args)
        mask = None if mask is None else tuple(mask)
        for t, m, runner in self.entries:
            if t == training and m == mask:
                try:
                    leaves = runner.split.guards.check(args)
                except InputMismatch:
                    continue
                if runner.takes_layout(leaves):
                    return runner, leaves
        fn = self.fn if view is None else view.function(self.fn)
        if amp:  # traced as a region inside the function, below autograd: the casts are in the code
            fn = _in_autocast(fn, amp)
        with self.capturing():
            sp = split(
                fn,
                *args,
                policy=self.options.split_policy(),
                grad_leaves=mask,
                rules=self.options.rules,
                dynamic_shapes=self._marks(args),
            )
        sp.from_module = self.skip_first  # a module's: its parameters come first, by name
        if torch.is_grad_enabled() and view is not None:
            _refuse_closed_over_leaves(sp)
        elif torch.is_grad_enabled() and self.lifted is None:
            self.lifted = Lifted.find(sp.forward)
            if self.lifted is not None:  # traced again, taking them as inputs (their .grad filled as in eager)
                self.fn = self.lifted.function(self.fn)
                self.entries.clear()
                self.memos = []
                return self._made(self._with_lifted(args), training, None, amp)
        leaves = sp.flatten(*args)
        runner = _Runner(sp, leaves, *self.options.running())
        if view is not None:
            runner.subclasses = SubclassLeaves(view, self.capturing)
        self.entries.append((training, mask, runner))
        self.memos = []
        return runner, leaves

    def _with_lifted(self, args):
        """``args`` and the lifted tensors as they are now, before a trailing ``KeywordArguments``."""
        if self.lifted is None:
            return args
        if args and isinstance(args[-1], KeywordArguments):
            return (*args[:-1], self.lifted.values(), args[-1])
        return (*args, self.lifted.values())

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def latest(self) -> Split:
        return self.entries[-1][2].split


def _refuse_closed_over_leaves(sp: Split) -> None:
    """Refuse a program that reads a tensor requiring grad from outside its arguments: eager
    autograd would fill its ``.grad``, but the split differentiates the arguments (a module's
    parameters among them) only, so the gradient would be silently missing."""
    for read in closures.reads_of(sp.forward):
        t = read.expected
        if isinstance(t, torch.Tensor) and t.requires_grad and is_float(t):
            where = f" at {read.where}" if read.where else ""
            raise FxtoolsError(
                f"fxtools.compile: the program reads {read.what}, a tensor that requires grad, from outside its "
                f"arguments{where}. Eager autograd would give it a gradient; fxtools.compile differentiates the "
                "arguments and a compiled module's own parameters only. Pass the tensor as an argument, or compile "
                "the nn.Module that owns it (fxtools.compile(model, ...))."
            )


def unreached_leaves(gm: fx.GraphModule) -> list[bool]:
    """Per placeholder of the captured graph ``gm``: whether no chain of floating-point values
    computed with grad mode on (``detach`` ends one) leads from it to an output. Eager autograd
    leaves such a leaf's ``.grad`` None (a module's unused head, a bias only the discarded primal
    of a JVP reads), and optimizers skip a parameter whose ``.grad`` is None (no weight decay, no
    momentum): the backward must give None there, not the zeros the split computes."""
    carries = carriers(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    reached = ancestors(output.all_input_nodes, carries.__contains__)
    return [n not in reached for n in gm.graph.nodes if n.op == "placeholder"]


def constant_outputs(gm: fx.GraphModule, differentiable: list[bool] | None = None) -> list[bool]:
    """Per tensor output of the captured graph ``gm``: whether autograd connects it to no input (a
    ``.detach()``-ed metric, a value computed under ``no_grad``). Eager gives such an output no
    ``grad_fn``; the compiled step must not either, or keeping it (a running sum of metrics, a buffer
    assigned from it) would keep the step's graph alive, and a later backward through it would fail."""
    carries = carriers(gm, differentiable)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [o for o in pytree.tree_leaves(output.args) if isinstance(o, fx.Node)]
    return [o not in carries for o in outs if isinstance(o.meta.get("val"), torch.Tensor)]


def _drop_unreached(grads, unreached: list[bool]) -> list:
    if len(grads) != len(unreached):
        return list(grads)
    return [None if u else g for g, u in zip(grads, unreached)]


class _SplitFunction(torch.autograd.Function):
    """A split's forward and backward as one autograd node (``training/saved.py``: what it saves,
    offloads, and how its backward is differentiated when ``create_graph=True``)."""

    @staticmethod
    def forward(ctx, runner: _Runner, *leaves):
        ctx.runner = runner
        if runner.subclasses is not None:
            ctx.fxtools_inputs = leaves  # the DTensors, for a differentiable backward
            leaves = runner.subclasses.locals(leaves)
        ctx.fxtools_record = record = runner.replay.record(leaves)
        outs, saved = runner.run_forward(leaves)
        runner.replay.finish(record)
        if runner.checker:
            runner.checker.forward(leaves, outs, record.rng)
        runner.saved.pack(ctx, saved)
        if runner.subclasses is not None:
            outs = runner.subclasses.outputs(outs)
        tensors = [o for o in outs if isinstance(o, torch.Tensor)]
        constant = runner.constant_outputs if len(runner.constant_outputs) == len(tensors) else [False] * len(tensors)
        non_diff = [o for o, c in zip(tensors, constant) if c or not is_float(o)]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grad_outs):
        runner = ctx.runner
        subclasses = runner.subclasses
        if torch.is_grad_enabled() and subclasses is not None:  # create_graph=True through DTensors: eager's
            runner.replay.check_unchanged(ctx.fxtools_record)
            grads = subclasses.differentiable_backward(runner.split.captured, ctx.fxtools_inputs, grad_outs)
            release(ctx)
            return (None, *grads)
        if subclasses is not None:
            grad_outs = subclasses.cotangents(grad_outs)
        cts = [grad_outs[i] for i in runner.ct_positions]
        del grad_outs
        if torch.is_grad_enabled():  # create_graph=True: a backward autograd can differentiate
            grads = runner.replay.vjp(ctx.fxtools_record, cts)
            release(ctx)
            return (None, *_drop_unreached(grads, runner.unreached))
        record = ctx.fxtools_record  # unpack lets go of it
        saved = runner.saved.unpack(ctx)
        grads = runner.run_backward(saved, cts)
        if runner.checker:  # on failure the whole step runs again, readable and checked node by node
            runner.checker.backward(grads, lambda: locate(runner.split, record.leaves, cts, rng=record.rng))
        grads = _drop_unreached(grads, runner.unreached)
        return (None, *(grads if subclasses is None else subclasses.gradients(grads)))


def _requires_grad(args):
    """Which tensor leaves need a gradient, or None for all of them.

    None also when no floating-point leaf requires grad (example arguments made with
    ``.detach()``): the graphs then serve any later pattern of ``requires_grad`` until one with
    some but not all leaves needing gradients comes along.
    """
    tensors = [x for x in pytree.tree_leaves(tuple(args)) if isinstance(x, torch.Tensor)]
    mask = [x.requires_grad or not is_float(x) for x in tensors]
    if all(mask) or not any(x.requires_grad for x in tensors):
        return None
    return mask


class CompiledModule(torch.nn.Module):
    """``model`` whose forward and backward run fxtools' split graphs; ``.module`` is the original.

    A DistributedDataParallel ``model``, or one holding FSDP2 (``fully_shard``) modules, is
    captured without its wrappers, which run around the graphs (``training/distributed.py``).
    """

    def __init__(self, model: torch.nn.Module, options: Options | None = None):
        super().__init__()
        self.module = model
        self._wrappers = Wrappers(model)
        self._parameter_dict = Parameters(self._wrappers.inner)  # dict(named_parameters()), made again when it may differ
        self._runners = _Runners(
            _accepting_keywords(functional(self._wrappers.inner)),
            Options() if options is None else options,
            skip_first=True,
            capturing=self._wrappers.capturing,
        )

    def _args(self, inputs, kwargs):
        params = self._parameter_dict()
        return (params, *inputs, KeywordArguments(kwargs)) if kwargs else (params, *inputs)

    def _runner_and_leaves(self, inputs: tuple, kwargs: dict, remember=False):
        return self._runners(self._args(inputs, kwargs), self._wrappers.inner.training, remember)

    def runner(self, *inputs, **kwargs) -> _Runner:
        return self._wrappers.prepare(lambda *a, **k: self._runner_and_leaves(a, k)[0], inputs, kwargs)

    @property
    def split(self) -> Split:
        """The split of the most recent compilation."""
        return self._runners.latest

    def _run(self, *inputs, **kwargs):
        runner, leaves = self._runner_and_leaves(inputs, kwargs, remember=True)
        return runner(leaves)

    def forward(self, *inputs, **kwargs):
        return self._wrappers.call(self._run, inputs, kwargs)


class CompiledFunction:
    """``fn`` whose calls run fxtools' split graphs inside an autograd.Function."""

    def __init__(self, fn, options: Options | None = None):
        self.fn = fn
        self._runners = _Runners(_accepting_keywords(fn), Options() if options is None else options)

    def runner(self, *args, **kwargs) -> _Runner:
        return self._runners((*args, KeywordArguments(kwargs)) if kwargs else args, None)[0]

    @property
    def split(self) -> Split:
        """The split of the most recent compilation."""
        return self._runners.latest

    def __call__(self, *args, **kwargs):
        runner, leaves = self._runners((*args, KeywordArguments(kwargs)) if kwargs else args, None, remember=True)
        return runner(leaves)


def _in_autocast(fn, state):
    """``fn`` run inside ``torch.autocast`` regions of ``state`` (as the caller's region ran it)."""

    def call(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for device, dtype in state:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            return fn(*args, **kwargs)

    call.__signature__ = inspect.signature(fn)
    call.__name__ = getattr(fn, "__name__", "fn")
    for attr in ("__fxtools_module__", "__fxtools_input_kinds__"):
        if hasattr(fn, attr):
            setattr(call, attr, getattr(fn, attr))
    return call


class KeywordArguments(dict):
    """A call's keyword arguments, passed to the split function as its last argument (a pytree
    dict: each tensor is an input named after its keyword)."""


register_dict(KeywordArguments)


def _accepting_keywords(fn):
    """``fn``, called with a trailing ``KeywordArguments`` as keyword arguments."""

    def call(*args):
        if args and isinstance(args[-1], KeywordArguments):
            return fn(*args[:-1], **args[-1])
        return fn(*args)

    call.__signature__ = _signature_with_keywords(fn)
    call.__name__ = getattr(fn, "__name__", "fn")
    for attr in ("__fxtools_module__", "__fxtools_input_kinds__"):  # for names and descriptors
        if hasattr(fn, attr):
            setattr(call, attr, getattr(fn, attr))
    return call


def _signature_with_keywords(fn):
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = [inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)]
    return inspect.Signature(params)


def compile(
    model_or_fn,
    *example_args,
    example_kwargs=None,
    fw_compiler=None,
    bw_compiler=None,
    policy="recompute_cheap",
    rules="fused",
    dynamic_shapes=None,
    dynamic=False,
    compiler=None,
    decompositions=None,
    split=None,
    check_finite=False,
):
    """A module or function whose forward and backward run fxtools' split graphs.

    It is called as the original, keyword arguments included (``compiled(**batch)`` for a Hugging
    Face model). With ``example_args`` / ``example_kwargs`` the graphs are made now; otherwise at
    the first call. See the module docstring for compilers, re-specialisation and ``rules``
    (default ``"fused"``).

    ``dynamic_shapes`` (torch.export's format, for the call's positional arguments; a module's
    parameters are never dynamic) keeps those sizes symbolic, so one pair of graphs serves every
    size in range. ``dynamic=True`` marks every size > 1 of every tensor argument ``Dim.AUTO``,
    as ``torch.compile``'s automatic dynamic shapes do: a size the program specialises (a
    feature size matching a weight) silently stays static; the batch and sequence sizes of
    token ids and targets stay symbolic.

    Compilers (``fw_compiler``, ``bw_compiler``; ``compiler`` for both; ``"inductor"`` for
    ``torch._inductor.compile_fx.compile_fx_inner``) get the ATen form of the graphs
    (``fxtools.to_aten``), traced with ``decompositions`` (``None``: Inductor's table for Inductor's
    compilers, none otherwise; ``"core"`` for Core ATen; or a table).

    ``split``: run this split (``Split.edit`` makes one from edited graphs) instead of making
    splits; calls its guards refuse raise ``InputMismatch``.

    ``check_finite=True``: a step (forward or backward) that computes a NaN or an unintended
    infinity raises ``fxtools.NonFiniteError`` naming the first (``training/finite.py``; see
    docs/nonfinite.md for what it checks and costs).
    """
    fw_compiler = compiler if fw_compiler is None else fw_compiler
    bw_compiler = compiler if bw_compiler is None else bw_compiler
    options = Options(fw_compiler, bw_compiler, policy, rules, dynamic_shapes, dynamic, decompositions, split, check_finite)
    if split is not None and split.from_module != isinstance(model_or_fn, torch.nn.Module):
        made = "a module" if split.from_module else "a function"
        raise ValueError(f"the split was made from {made}; pass the {made[2:]} it was made from")
    if isinstance(model_or_fn, torch.nn.Module):
        compiled = CompiledModule(model_or_fn, options)
    else:
        compiled = CompiledFunction(model_or_fn, options)
    if example_args or example_kwargs:
        compiled.runner(*example_args, **(example_kwargs or {}))
    return compiled


# --------------------------------------------------------------------------------------------
# torch.compile backend
# --------------------------------------------------------------------------------------------


def _run_checkpoint_body(body, *args):
    """Stands for Dynamo's ``tag_activation_checkpoint``: a region ``split`` recomputes."""
    import torch.utils.checkpoint as cp

    return cp.checkpoint(body, *args, use_reentrant=False)


def _inline_higher_order(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace Dynamo's checkpoint / wrap higher-order ops by calls fxtools can trace."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    wrap = getattr(torch.ops.higher_order, "wrap", None)
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if hop is not None and node.target is hop:
            node.target = _run_checkpoint_body
            node.kwargs = {}
            changed = True
        elif wrap is not None and node.target is wrap:
            node.target = _call_body
            node.kwargs = {}
            changed = True
    if changed:
        gm.recompile()
    return gm


def _call_body(body, *args):
    return body(*args)


def _input_name(target: str) -> str:
    """A readable name for a Dynamo placeholder: ``L_self_modules_fc1_parameters_weight_`` -> ``fc1_weight``."""
    name = target
    if name.startswith(("L_", "G_")):
        name = name[2:]
    name = name.rstrip("_")
    for prefix in ("self_modules_", "self_parameters_", "self_buffers_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, "_")
    return name or "arg"


def _qualified_name(target: str) -> str | None:
    """``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight`` (Dynamo's name for ``self.fc1.weight``)."""
    name = target[2:] if target.startswith(("L_", "G_")) else target
    if not name.startswith("self_"):
        return None
    name = name[len("self_") :].rstrip("_")
    for part in ("modules_", "parameters_", "buffers_"):
        if name.startswith(part):
            name = name[len(part) :]
    for part in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(part, ".")
    return name


def _as_function(gm: fx.GraphModule, example_inputs=()):
    """``gm`` as a function whose parameters carry its placeholders' readable names.

    ``fn.__fxtools_input_kinds__`` says for each which are the module's parameters (Dynamo passes
    them as inputs), with their qualified names, for the ATen form's descriptors."""
    targets = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    names, used = [], set()
    for t in targets:
        base = name = identifier(_input_name(str(t)))
        i = 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        names.append(name)

    def fn(*args):  # node by node, each traced op given the user's line Dynamo recorded on its node
        with fx_traceback.preserve_node_meta():
            return fx.Interpreter(gm).run(*args)

    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    fn.__name__ = fn.__qualname__ = "dynamo_graph"
    fn.__fxtools_input_kinds__ = [
        ("parameter", _qualified_name(str(t)) or n) if isinstance(x, torch.nn.Parameter) else ("user_input", None)
        for t, n, x in zip(targets, names, example_inputs)
    ]
    return fn


def _wrapped_floats(gm: fx.GraphModule) -> list[int]:
    """Positions of the inputs holding a Python float Dynamo passes as a 0-dim tensor (``dynamic=True``
    leaves module floats unspecialised: ``eps``, ``momentum``) and reads only through ``.item()``.
    Their ``.item()`` is replaced by the input itself, given as the number: traced as an unbacked
    float, batch norm's ``if eps <= 0`` could not be decided. As a number it is a constant of the
    code, guarded as every other (another value gets graphs of its own)."""
    positions = []
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        users = list(node.users)
        if (
            getattr(grapharg, "pass_arg_as_tensor", False)
            and users
            and all(u.op == "call_method" and u.target == "item" for u in users)
        ):
            for user in users:
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
            positions.append(i)
    if positions:
        gm.recompile()
    return positions


def _hint(x):
    """A Dynamo example input, its symbolic numbers as the numbers they hold now. Dynamo passes a
    size or stride it made symbolic (after a call with another layout or size) as an input of
    the graph; fxtools takes it as a Python value, guarded as every other: a call with another
    value gets graphs of its own."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and x.node.hint is not None:
        return x.node.hint
    return x


def backend(
    fw_compiler=None,
    bw_compiler=None,
    policy="recompute_cheap",
    rules="fused",
    compiler=None,
    decompositions=None,
    check_finite=False,
):
    """A ``torch.compile`` backend differentiating Dynamo's graphs with fxtools.

    ``torch.compile(model, backend=fxtools.backend())``; the compilers (``compiler="inductor"``
    for both), decompositions, policy and rules are those of ``fxtools.compile``. Each Dynamo graph
    is split as a function of its inputs (and of the parameters it holds, if any), and runs
    through an autograd.Function. ``check_finite``: as on ``fxtools.compile``.
    ``torch.compile(model, backend=fxtools.backend)`` (not called) is the backend with its defaults,
    as torch.compile takes a backend: Dynamo then calls this with its graph and example inputs.
    """
    if isinstance(fw_compiler, fx.GraphModule):
        return backend()(fw_compiler, bw_compiler)
    fw_compiler = compiler if fw_compiler is None else fw_compiler
    bw_compiler = compiler if bw_compiler is None else bw_compiler

    options = Options(
        fw_compiler, bw_compiler, policy, rules, decompositions=decompositions, check_finite=check_finite, name="fxtools.backend"
    )

    def fxtools_backend(gm: fx.GraphModule, example_inputs):
        gm = functorch_regions(_inline_higher_order(gm))
        floats = _wrapped_floats(gm)
        example_inputs = [_hint(x.item() if i in floats else x) for i, x in enumerate(example_inputs)]
        if any(True for _ in gm.parameters()):
            compiled: CompiledModule | CompiledFunction = CompiledModule(gm, options)
        else:  # parameters arrive as inputs: differentiate the graph as a function of them
            compiled = CompiledFunction(_as_function(gm, example_inputs), options)
        with torch._guards.tracing(None):  # trace with fxtools' own fake mode, not Dynamo's
            compiled.runner(*example_inputs)

        def run(*args):
            if floats:
                args = tuple(x.item() if i in floats else x for i, x in enumerate(args))
            return compiled(*args)

        run.fxtools_compiled = compiled
        return run

    return fxtools_backend
