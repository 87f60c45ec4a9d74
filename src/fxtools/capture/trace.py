"""Capture a Python function as a flat graph of pre-dispatch ATen ops.

Pre-dispatch tracing (``make_fx(..., pre_dispatch=True)``) keeps each user call as one node
(``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``), records a
FakeTensor with shape and dtype on every node (``node.meta['val']``), and specialises Python
control flow on shapes and Python values to the example inputs.

Arguments and outputs may be any pytree. The captured graph takes one placeholder per *tensor*
leaf of the arguments, named from the leaf's argument name and pytree path; other leaves
(ints, floats, bools) are specialised. A leaf that holds tensors without being a pytree (a plain
object, an unregistered dataclass, a set) is refused: its tensors would be baked in as constants.
``torch.inference_mode()`` blocks are traced as ``no_grad`` ones. Tensors the function closes over (a module's parameters
and buffers) become attributes of the graph module that are the very same tensor objects, so
in-place updates of buffers (BatchNorm's running statistics) happen exactly as in eager mode.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import PythonKeyTracer, make_fx
from torch.utils import _pytree as pytree

from ..errors import (
    PROGRAM_ENTRIES,
    DataDependentError,
    FxtoolsError,
    current_user_line,
    is_data_dependent,
    is_program_file,
    is_user_file,
    user_frame,
)
from ..graph import meta
from ..graph.data_dependent import CountsFromExamples
from ..graph.fakes import cache_key_parts, detached, from_cache_entry
from ..graph.nodes import is_float, is_view_refusal, reads_tracked_tensor, view_strides
from ..signature.naming import arg_names, leaf_names
from ..signature.runtime import autocast_state
from ..signature.sizes import TracedSizes
from .checkpoint import checkpoint_regions
from .closures import locate, outside_reads, tensor_names, unchanged_by_tracing, with_layout_reads, with_value_reads
from .conversions import module_conversions
from .layout_reads import LayoutReads, constants_layout_read, constants_read_as_values
from .layout_reads import facts as layout_facts
from .names import module_paths, name_values, outer_frames, reached_modules, recording_modules
from .patching import patched
from .replacements import Replacing
from .subclasses import DTensorInside, dtensor_functions, is_mesh, refuse_subclass_arguments


@dataclass
class Captured:
    """A traced function: the function, its graph and how its pytree inputs and outputs flatten.

    Built by ``capture`` (every field but ``front``); ``transforms/pipeline.front`` sets ``front``
    (the transform it prepared the graph for), and ``pipeline.back`` reads every field."""

    f: Callable  # the function traced (the user's, or the wrapper a transform traces in its place)
    arg_names: list[str]  # one identifier per positional argument (of ``f``'s signature)
    gm: fx.GraphModule
    in_spec: pytree.TreeSpec  # of the tuple of positional arguments
    out_spec: pytree.TreeSpec  # of the return value
    leaves: list[Any]  # example argument leaves, in flattening order
    names: list[str]  # one identifier per leaf
    tensor_leaf: list[bool]  # which leaves are tensors (and so graph placeholders)
    arg_of_leaf: list[int]  # index of the positional argument each leaf belongs to
    out_leaves: list[Any] = field(default_factory=list)  # example output leaves (FakeTensors or constants)
    symbolic: Any = None  # sizes.Symbolic when sizes were marked dynamic (dynamic_shapes=)
    layout_reads: dict = field(default_factory=dict)  # leaf path -> layout facts read (capture/layout_reads.py)
    reads: list = field(default_factory=list)  # what f read from outside its arguments (capture/closures.py)
    front: str | None = None  # the transform whose front (transforms/pipeline.py) prepared gm, if any

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def traced_sizes(self) -> TracedSizes:
        """What guards take from this trace (``signature.sizes.guard_symbolic``)."""
        values = {}
        if self.symbolic is not None:
            vals = iter(p.meta["val"] for p in self.placeholders)
            values = {id(leaf): next(vals) for leaf, t in zip(self.leaves, self.tensor_leaf) if t}
        return TracedSizes(self.symbolic, self.layout_reads, values)


def _name_constants(gm: fx.GraphModule, names: dict[int, str]) -> None:
    """Give closed-over tensors (``_tensor_constant3``) the names of the module attributes they are."""
    taken = {n.name for n in gm.graph.nodes}
    renamed = {}  # several get_attr nodes may read one constant (tracing a GraphModule)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        if node.target in renamed:
            node.target = renamed[node.target]
            continue
        tensor = getattr(gm, node.target)
        name = names.get(id(tensor))
        if name is None or not node.target.startswith(("_tensor_constant", "_param_constant")):
            continue
        new = name
        i = 1
        while hasattr(gm, new) or (new in taken and new != node.name):
            new, i = f"{name}_{i}", i + 1
        setattr(gm, new, tensor)
        delattr(gm, node.target)
        renamed[node.target] = new
        node.target = new
        node._rename(new)
        taken.add(node.name)


@contextlib.contextmanager
def _all_user_frames():
    """make_fx keeps only frames below a ``forward`` method in stack traces; keep every user frame.

    The stacks are read by ``_UserStack``, standing in for ``CapturedTraceback`` in
    ``torch.fx.proxy`` while tracing."""

    def keep_user_frames(self, summary):
        if isinstance(summary, _UserSummary):
            return summary  # made of the user's frames alone
        return traceback.StackSummary.from_list([f for f in summary if is_user_file(f.filename)])

    with (
        patched(PythonKeyTracer, _filter_traceback_frames=keep_user_frames),
        patched(torch.fx.proxy, CapturedTraceback=_UserStack),
        patched(_UserStack, cache={}),
    ):
        yield


class _UserSummary(traceback.StackSummary):
    """The user's frames of one stack, with their text (``format()``) made once per trace for all
    the nodes made at the same place (a model's repeated blocks make the same stacks many times)."""

    text: list[str]

    def format(self) -> list[str]:
        return list(self.text)


class _UserStack:
    """The user's frames of the stack where a node is made, as ``CapturedTraceback.extract().summary()``
    lists them after ``keep_user_frames``, from the program's entry in: read from the interpreter's frames directly, since
    symbolizing every frame (torch's and fxtools' included) to drop all but the user's took a
    tenth of a capture's time. ``cache``: the summaries made so far in this trace, by their frames."""

    __slots__ = ("frame",)
    cache: dict | None = None

    def __init__(self, frame):
        self.frame = frame

    @classmethod
    def extract(cls, **_):
        return cls(sys._getframe(1))

    def summary(self) -> traceback.StackSummary:
        key = []
        f = self.frame
        while f is not None and id(f.f_code) not in PROGRAM_ENTRIES:  # not the script's call of fxtools
            code = f.f_code
            if is_user_file(code.co_filename):
                key.append((code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        key.reverse()
        cache = _UserStack.cache if _UserStack.cache is not None else {}
        made = cache.get(tuple(key))
        if made is None:
            made = _UserSummary(traceback.FrameSummary(*frame) for frame in key)
            made.text = traceback.StackSummary.format(made)
            cache[tuple(key)] = made
        copy = _UserSummary(made)
        copy.text = made.text
        return copy


@contextlib.contextmanager
def _no_real_mutation():
    """Keep tracing from mutating closed-over real tensors.

    FakeTensorMode runs an op for real when none of its tensor arguments is fake and the op
    accepts Python numbers as tensors, so ``module.num_batches_tracked.add_(1)`` would bump the
    real buffer each time fxtools traces (the graph records the op, so it also happens at run
    time). For mutating ops we make it take the ordinary fake path instead.
    """
    from torch._subclasses import fake_tensor

    original = fake_tensor.should_allow_numbers_as_tensors

    def allow_numbers(func):
        if isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
            return False
        return original(func)

    with patched(fake_tensor, should_allow_numbers_as_tensors=allow_numbers):
        yield


@contextlib.contextmanager
def _tensor_metadata_memo():
    """make_fx records ``node.meta["tensor_meta"]`` for every value it traces: its shape, dtype,
    strides and which memory format it is contiguous in (three contiguity checks in Python on
    the FakeTensor's sizes). For a plain strided tensor of static sizes, that record depends on
    nothing else, and a model's repeated layers make the same metadata over and over: made once
    per distinct metadata in a trace, the same immutable record is given to each node. Likewise
    whether an op's input values are kept (``should_save``), asked for every node made.
    """
    original = proxy_tensor._extract_tensor_metadata
    made: dict = {}

    def extract(result, include_contiguity=True):
        if include_contiguity and type(result) is FakeTensor and result.layout is torch.strided and not result.is_quantized:
            shape, stride = result.shape, result.stride()
            if all(type(s) is int for s in shape) and all(type(s) is int for s in stride):
                key = (tuple(shape), stride, result.dtype, result.requires_grad)
                known = made.get(key)
                if known is None:
                    known = made[key] = original(result)
                return known
        return original(result, include_contiguity)

    saves = proxy_tensor._should_save_eager_input_vals
    saved: dict = {}

    def should_save(target, args_kwargs=None):
        """Whether make_fx keeps an op's input values (``eager_input_vals``): for an ATen op (an
        ``OpOverload``), read from its tags alone, so asked once per op in a trace."""
        if type(target) is not torch._ops.OpOverload:
            return saves(target, args_kwargs)
        known = saved.get(target)
        if known is None:
            known = saved[target] = saves(target, args_kwargs)
        return known

    with patched(proxy_tensor, _extract_tensor_metadata=extract, _should_save_eager_input_vals=should_save):
        yield


@contextlib.contextmanager
def _snapshots_wrapped():
    """make_fx keeps a snapshot of every value it traces (``node.meta["val"]``, ``snapshot_fake``:
    ``fast_detach``, a detach in the fake mode's kernel invocation wrapped in a new FakeTensor); the
    same snapshot is made here with ``FakeTensor``'s constructor run once per mode and device
    (``graph/fakes.py``), 5-6 us rather than 30-35 a value. Values of FakeTensor subclasses, and
    snapshots that keep a real tensor, are make_fx's own."""
    original = proxy_tensor.snapshot_fake

    def snapshot(val, include_real=False):
        if type(val) is FakeTensor and (not include_real or val.real_tensor is None):
            return detached(val)
        return original(val, include_real)

    with patched(proxy_tensor, snapshot_fake=snapshot):
        yield


@contextlib.contextmanager
def _cache_hits_wrapped():
    """FakeTensorMode's outputs for cache hits (most of a trace's ops) made by ``graph/fakes.py``'s
    ``from_cache_entry``, where it can: the same FakeTensors, at a third of the cost. Anything else is
    FakeTensorMode's own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = FakeTensorMode._get_output_tensor_from_cache_entry

    def output(self, state, entry, key, func, args):
        made = from_cache_entry(self, entry, func, args)
        return made if made is not None else original(self, state, entry, key, func, args)

    with patched(FakeTensorMode, _get_output_tensor_from_cache_entry=output):
        yield


@contextlib.contextmanager
def _cache_keys_read_once():
    """The metadata of each tensor argument that FakeTensorMode reads for its cache key (every fake
    dispatch), read by ``graph/fakes.py``'s ``cache_key_parts``: the same keys, the memory format asked
    once per sizes and strides in a trace and the fields flattened without ``dataclasses.fields``."""
    from torch._subclasses import fake_tensor

    extract, flatten = fake_tensor.extract_tensor_metadata, fake_tensor.TensorMetadata._flatten_into
    fast_extract, fast_flatten = cache_key_parts(extract, flatten, fake_tensor.FakeTensorMode._prep_args_for_hash)
    with (
        patched(fake_tensor, extract_tensor_metadata=fast_extract),
        patched(fake_tensor.TensorMetadata, _flatten_into=fast_flatten),
    ):
        yield


@contextlib.contextmanager
def _inputs_tracked_below_function_modes():
    """make_fx records its inputs (``track_tensor_tree`` of the placeholders: each one's proxy slot,
    its ``meta["val"]`` snapshot and ``tensor_meta``) while ``PreDispatchTorchFunctionMode`` is
    already on the torch-function stack, so each metadata read there (``shape``, ``stride()``,
    ``layout``, the snapshot's ``detach``; about fifteen per input) is a Python call of that mode,
    about 6-13 us, where an op's outputs are recorded with the mode off. The mode passes those
    calls through unchanged (it acts only on grad-mode, autocast and functorch calls, none of which
    recording makes), so the inputs are recorded with it set aside as the outputs are: the same
    records, without some 4,500 mode calls in a GPT-2-sized ``fxtools.split`` (its capture and its
    reverse template take about 150 inputs each). Any other mode stays, and ``track_tensor_tree``
    is called as make_fx calls it.
    """
    from torch.overrides import _len_torch_function_stack

    original = proxy_tensor.track_tensor_tree
    set_aside = proxy_tensor._temp_remove_pre_dispatch_torch_function_mode

    def track_tensor_tree(inner_res, proxy_res, *, constant, tracer):
        if _len_torch_function_stack() == 0:  # an op's outputs: make_fx has the modes off already
            return original(inner_res, proxy_res, constant=constant, tracer=tracer)
        with set_aside():
            return original(inner_res, proxy_res, constant=constant, tracer=tracer)

    with patched(proxy_tensor, track_tensor_tree=track_tensor_tree):
        yield


def trace_flat(fn, example_leaves, *, record_stack_traces=True, pre_dispatch=True) -> fx.GraphModule:
    """make_fx at pre-dispatch level, with fake tensors, closed-over real tensors allowed.

    ``pre_dispatch=False`` traces below torch.func transforms (``fxtools.vmap`` needs it).
    The graph module generates its code when first run or read (``_LazyGraphModule``): the
    pipeline's intermediate graphs are transformed many times and never run. make_fx's
    torch-function metadata mode is left out: it only records ``node.meta["torch_fn"]``, which
    nothing here reads, at the cost of one more Python frame for every torch call the trace makes
    (a few percent of a capture and of a transform's re-trace); its one other job, ``aten.size``
    on symbolic sizes as ``aten.sym_size``, ``LayoutReads`` does while capturing.
    """
    from ..graph.data_dependent import capture_decompositions
    from .fake_kernels import tracing_kernels

    tracer = make_fx(
        fn,
        decomposition_table=capture_decompositions(),
        pre_dispatch=pre_dispatch,
        tracing_mode="fake",
        _allow_non_fake_inputs=True,
        record_stack_traces=record_stack_traces,
        _disable_torch_fn_metadata_mode=True,
    )
    with (
        _all_user_frames() if record_stack_traces else contextlib.nullcontext(),
        _no_real_mutation(),
        _tensor_metadata_memo(),
        _inputs_tracked_below_function_modes(),
        _snapshots_wrapped(),
        _cache_hits_wrapped(),
        _cache_keys_read_once(),
        tracing_kernels(),
        _use_lazy_graph_module(True),
    ):
        return tracer(*example_leaves)


def realize_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace FakeTensor attributes (constants made while tracing in fake mode) by their real values.

    Fake mode keeps the real value of small constants it creates (``fake.constant``); generated
    code must hold real tensors, so a constant without a known value is an error (a tensor made
    from the input's values outside autograd's view, such as ``nn.Parameter(x * 2)`` under vmap).
    """
    from ..errors import user_line_of

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch._subclasses.FakeTensor):
                if value.constant is None:
                    where = next((w for w in map(user_line_of, node.users) if w), None) or "an unknown line"
                    raise FxtoolsError(
                        f"a tensor of shape {list(value.shape)} used at {where} was made while tracing from values "
                        "fxtools does not know (outside autograd's view of the inputs, e.g. nn.Parameter(x) or "
                        "x.data of an input): generated code cannot hold it. Compute it from the inputs with "
                        "ordinary ops, or pass it as an argument"
                    )
                setattr(gm, node.target, value.constant)
    return gm


def data_dependent_error(exc: BaseException, node=None) -> DataDependentError:
    """A DataDependentError for ``exc``, naming the user's line (of ``node`` when given)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from ..errors import user_line_of

    where = (user_line_of(node) if node is not None else None) or user_frame(exc.__traceback__)
    if isinstance(exc, DynamicOutputShapeException) and exc.args:
        return DataDependentError(
            f"the output shape of {exc.args[0]} depends on the values of its inputs (at "
            f"{where or 'an unknown line of user code'}), and PyTorch gives it no symbolic shape "
            "that fxtools could trace. Compute it another way, or see the op's options for one with "
            "static shapes (e.g. torch.linalg.lstsq(..., driver='gels'))."
        )
    what = f"the derivative of {node.target}" if node is not None else "Python control flow or a Python value"
    return DataDependentError(
        f"{what} depends on the value of a tensor (at {where or 'an unknown line of user code'}).\n"
        "fxtools traces one path through the program for the example's shapes; it cannot branch "
        "on tensor data. Use torch.where / masking instead of `if`, or pass the value as a Python number."
    )


def _check_output_leaves(out) -> None:
    """Every leaf of the return value must be a tensor or a constant a graph can return.

    Other objects (a model's key/value cache, say) may hold traced tensors that are not pytree
    leaves; without this check make_fx fails with an obscure ``NotImplementedError``.
    """
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if leaf is None or isinstance(leaf, (*fx.node.base_types, slice, range, type(...))):
            continue
        where = f"the return value{pytree.keystr(path)}" if path else "the return value"
        raise FxtoolsError(
            f"{where} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which fxtools cannot return "
            "from a graph: return tensors, Python numbers, or lists, tuples, dicts (any pytree) of "
            "them (a model that returns a cache usually has a flag to turn it off, e.g. use_cache=False)"
        )


@contextlib.contextmanager
def _custom_autograd_functions(pre_dispatch=True):
    """Trace ``torch.utils.checkpoint`` as its function; custom rules as one call each.

    Checkpointing only trades memory for recomputation (the gradient of a checkpointed call is
    the gradient of its function), so both variants just call the function; the reentrant one
    would otherwise run it under ``no_grad`` and its inputs would get no gradient. A
    ``torch.autograd.Function`` or ``fxtools.custom_vjp`` call becomes one node carrying its own
    backward as its rule (``capture/custom.py``); under ``fxtools.vmap`` (``pre_dispatch=False``) it just
    runs. Nested ``torch.func`` transforms are traced below functorch and replayed as plain ops
    (``capture/nested.py``); ``flex_attention`` is traced as its dense math (``capture/flex_attention.py``).
    """
    from .custom import capturing
    from .flex_attention import dense_flex_attention
    from .nested import nested_transforms

    with (
        checkpoint_regions(),
        capturing(record=pre_dispatch),
        nested_transforms() if pre_dispatch else contextlib.nullcontext(),
        dense_flex_attention() if pre_dispatch else contextlib.nullcontext(),
        contextlib.nullcontext() if pre_dispatch else _cond_as_select(),
    ):
        yield


def _select_cond(pred, true_fn, false_fn, operands=()):
    """``torch.cond`` under ``torch.func.vmap``, as its batching rule computes it for a batched
    predicate: both branches, the result chosen by ``torch.where`` per sample."""
    if isinstance(pred, (bool, int, float)):
        return true_fn(*operands) if pred else false_fn(*operands)
    return pytree.tree_map(lambda a, b: torch.where(pred, a, b), true_fn(*operands), false_fn(*operands))


@contextlib.contextmanager
def _cond_as_select():
    """Trace ``torch.cond`` below functorch (``fxtools.vmap``) as ``_select_cond``: PyTorch's
    ``torch.cond`` compiles its branches with Dynamo, which refuses functorch's batched tensors."""
    with patched(torch, cond=_select_cond):
        yield


@contextlib.contextmanager
def _static_control_flow():
    """Trace control flow's functions (``scan``'s step, ``cond``'s branches) the same way each time.

    PyTorch traces them with Dynamo, which remembers the sizes each of its frames saw: after a
    scan with one carry, a scan with another recompiles the same frame "automatically dynamic",
    lifting sizes into extra integer arguments of the function. fxtools traces with static
    sizes (``dynamic_shapes=`` says which are symbolic), so that memory is turned off while it
    captures: no trace depends on the ones before it."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo import convert_frame

    reasons = convert_frame.get_and_maybe_log_recompilation_reasons

    def reasons_without_guards(cache_entries, frame, *args, **kwargs):
        mode = torch._guards.detect_fake_mode(list(frame.f_locals.values()))
        env = getattr(mode, "shape_env", None)
        with env.suppress_guards() if env is not None else contextlib.nullcontext():
            return reasons(cache_entries, frame, *args, **kwargs)

    with (
        patched(convert_frame, get_and_maybe_log_recompilation_reasons=reasons_without_guards),
        dynamo_config.patch(automatic_dynamic_shapes=False),
    ):
        yield


_PY_RANDOM = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
    "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "triangular",
    "paretovariate", "weibullvariate", "vonmisesvariate", "getrandbits", "randbytes", "binomialvariate",
)  # fmt: skip


@contextlib.contextmanager
def _python_random_refused():
    """A draw from Python's ``random`` module by the program while it is traced would be a constant
    of the code (each call of the module the same number, where eager draws anew): refused, naming
    the line. Draws by torch or fxtools themselves (a file name) go through."""
    import random

    def refusing(name, original):
        def draw(*args, **kwargs):
            frame = sys._getframe(1)
            if is_program_file(frame.f_code.co_filename):
                raise FxtoolsError(
                    f"random.{name}() at {current_user_line()}: a draw from Python's random module while fxtools "
                    "traces becomes a constant of the generated code (every call would reuse it, where eager "
                    "draws anew). Draw with torch (torch.rand, torch.randint, torch.randperm: the code draws "
                    "them as eager does), or pass the number as an argument (a 0-dim tensor)."
                )
            return original(*args, **kwargs)

        return draw

    with patched(random, **{n: refusing(n, getattr(random, n)) for n in _PY_RANDOM if hasattr(random, n)}):
        yield


@contextlib.contextmanager
def _backward_hooks_refused():
    """A module's backward hooks (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
    their global forms) would run in eager's backward, on gradients the generated code computes
    without autograd: refused when a hooked module is called, naming it and the line, rather than
    left out of the gradient (``torch.func`` refuses them too)."""

    def refusing(module, *args, **kwargs):
        raise FxtoolsError(
            f"{current_user_line()}: calls {type(module).__name__}, which has backward hooks "
            "(register_full_backward_hook / register_full_backward_pre_hook, or a global one): fxtools computes "
            "gradients in generated code, where they would not run. Apply the hook's change to the gradient in "
            "the program (a torch.autograd.Function around the module, which fxtools honours), or remove the hook."
        )

    with patched(torch.nn.Module, _get_backward_hooks=refusing, _get_backward_pre_hooks=refusing):
        yield


@contextlib.contextmanager
def _tensor_hooks_refused():
    """A tensor's backward hook (``h.register_hook(fn)``, ``register_post_accumulate_grad_hook``)
    would change or observe the gradient in eager's backward, and ``h.retain_grad()`` would fill
    ``h.grad`` there; fxtools computes gradients in generated code, where neither happens. Refused
    naming the line (torch.func refuses them too), rather than failing inside PyTorch on a traced
    tensor that does not require grad. Calls from PyTorch's own code are left to it."""
    cls = torch.Tensor
    names = ("register_hook", "register_post_accumulate_grad_hook", "retain_grad")
    saved = {name: getattr(cls, name) for name in names}

    def refusing(name):
        def call(tensor, *args, **kwargs):
            if not is_program_file(sys._getframe(1).f_code.co_filename):  # PyTorch's own (FSDP's hooks)
                return saved[name](tensor, *args, **kwargs)
            raise FxtoolsError(
                f"{current_user_line()}: Tensor.{name}() inside a program fxtools traces: the gradients are "
                "computed in generated code, where a tensor's backward hook does not run and no .grad is kept. "
                "Apply the hook's change to the gradient in the program (a torch.autograd.Function or "
                "fxtools.custom_vjp, which fxtools honours), or return the tensor and call it outside."
            )

        return call

    with patched(cls, **{name: refusing(name) for name in names}):
        yield


@contextlib.contextmanager
def _tensor_attributes_written():
    """A tensor the program assigns to a module attribute while it is traced (``self.avg = 0.9 *
    self.avg + 0.1 * m``, ``self.last_metric = m``) would be a traced (fake) value left in the
    module, and the generated code would never assign it. A registered buffer of the same shape,
    dtype and device is written in place instead (``copy_``: the generated code updates it at each
    call, as fxtools writes batch norm's running statistics); any other tensor attribute is refused,
    naming the line."""
    original = torch.nn.Module.__setattr__

    def assign(module, name, value):
        frame = sys._getframe(1)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            return original(module, name, value)
        if not is_program_file(frame.f_code.co_filename):
            return original(module, name, value)
        old = module.__dict__.get("_buffers", {}).get(name)
        same = isinstance(old, torch.Tensor) and (old.shape, old.dtype, old.device) == (value.shape, value.dtype, value.device)
        if same and old is not value:
            old.copy_(value)
            return None
        if same:
            return None
        kind = "buffer" if name in module.__dict__.get("_buffers", {}) else "attribute"
        raise FxtoolsError(
            f"{current_user_line()}: assigns a tensor to {type(module).__name__}.{name}, a module {kind} "
            f"{'of another shape, dtype or device' if kind == 'buffer' else 'that is not a registered buffer'}: "
            "the generated code does not replay Python side effects, so the attribute would never be updated. "
            f"Register it as a buffer in __init__ (self.register_buffer({name!r}, torch.zeros(shape))), whose "
            "assignment of a value of its shape and dtype fxtools writes in place, or return the value."
        )

    with patched(torch.nn.Module, __setattr__=assign):
        yield


_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


def _holds_traced_value(value, depth=0) -> bool:
    """Whether ``value`` (a tensor, or a list, tuple, dict or set a few levels deep) holds a value
    made while fxtools traced (a FakeTensor)."""
    if isinstance(value, torch.Tensor):
        return torch._subclasses.fake_tensor.is_fake(value)
    if depth > 3:
        return False
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_traced_value(v, depth + 1) for v in value)
    return False


@contextlib.contextmanager
def _module_state_restored(f):
    """Module attributes that hold a traced value when the trace ends (a list a forward hook appends
    its module's output to, ``self.feats.append(out)``, read by the program later in the same call)
    are given back the value they had before the trace: the trace's values are FakeTensors, which
    would break the model afterwards (``copy.deepcopy(model)``, reading the list), and the generated
    code does not replay Python side effects (``docs/closures.md``). A list or dict is restored in
    place (its identity kept), another value rebound; an attribute the trace added is removed."""
    modules = reached_modules(f)
    before = []
    for m in modules:
        d = m.__dict__
        for name, value in d.items():
            if name in _MODULE_INTERNALS:
                continue
            content = list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else None
            before.append((m, name, value, content))
    try:
        yield
    finally:
        known = {(id(m), name): (value, content) for m, name, value, content in before}
        for m in modules:
            d = m.__dict__
            for name in [n for n in d if n not in _MODULE_INTERNALS]:
                value = d[name]
                if not _holds_traced_value(value):
                    continue
                if (id(m), name) not in known:
                    del d[name]
                    continue
                old, content = known[id(m), name]
                if old is value and isinstance(value, list) and content is not None:
                    value[:] = content
                elif old is value and isinstance(value, dict) and content is not None:
                    value.clear()
                    value.update(content)
                else:
                    d[name] = old


@contextlib.contextmanager
def _compiling():
    """Make ``torch.compiler.is_compiling()`` and ``is_exporting()`` true while the user's code is
    traced, as torch.export's (non-strict) tracing does.

    Libraries check them to keep tracing free of side effects and of constructs only a compiler
    handles: Hugging Face models then skip their ``lru_cache``s of tensors (which would otherwise
    keep a FakeTensor made during tracing and hand it to the next eager call of the model), and
    take their export paths (a sequential scan rather than torch's ``associative_scan``).
    """
    with patched(torch.compiler, _is_compiling_flag=True, _is_exporting_flag=True):
        yield


def _mark_forward_grad(state: bool) -> None:
    """Mark the ``_set_grad_enabled`` node just traced with forward AD's ``state`` (``meta.FORWARD_GRAD``)."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return
    last = next(reversed(mode.tracer.graph.nodes), None)
    if last is not None and last.target is torch._C._set_grad_enabled:
        meta.FORWARD_GRAD.set(last, state)


@contextlib.contextmanager
def _inference_mode_as_no_grad():
    """Trace ``torch.inference_mode(mode)`` blocks as ``torch.set_grad_enabled(not mode)``, and
    ``fwAD._set_fwd_grad_enabled`` as a grad-mode switch marked for forward mode alone.

    Inference mode is no_grad that also skips autograd's bookkeeping; entering it dispatches no
    op, so a trace would not see it and would differentiate the block. Grad mode changes are
    recorded (``_set_grad_enabled`` nodes), so the block carries no gradient, as in eager. Forward
    AD ignores ``no_grad`` but not inference mode nor its own switch: those nodes carry forward
    AD's state (``meta.FORWARD_GRAD``; ``forward_grad_modes`` applies it).
    """
    cls = torch.autograd.grad_mode.inference_mode
    old_fwd = torch._C._set_fwd_grad_enabled
    forward = [True]  # forward AD's state while tracing (the trace itself runs without it)

    def switch(grad: bool, fwd: bool) -> None:
        forward.append(fwd)
        torch._C._set_grad_enabled(grad)
        _mark_forward_grad(fwd)

    def enter(self):
        self._fxtools_prev = torch.is_grad_enabled(), forward[-1]
        switch(not self.mode, forward[-1] and not self.mode)

    def exit(self, *exc):
        switch(*self._fxtools_prev)

    def set_fwd(mode) -> None:
        old_fwd(mode)
        if bool(mode) != forward[-1]:
            switch(torch.is_grad_enabled(), bool(mode))

    with patched(cls, __enter__=enter, __exit__=exit), patched(torch._C, _set_fwd_grad_enabled=set_fwd):
        yield


def forward_grad_modes(gm: fx.GraphModule) -> None:
    """Make ``gm``'s grad-mode switches those of forward-mode AD, for transforms that compute
    ``torch.func.jvp``'s tangents (``jvp``, ``jacfwd``, ``linearize``): tangents flow through
    ``no_grad`` blocks and stop in inference mode and where ``fwAD._set_fwd_grad_enabled(False)``
    turned forward AD off, as in PyTorch. The blocks read parameters detached first
    (``detach_parameters_in_no_grad``): what they write stays as untracked as in eager."""
    detach_parameters_in_no_grad(gm)
    state = True
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            state = meta.FORWARD_GRAD.get(node, state)
            node.args = (state,)


def detach_parameters_in_no_grad(gm: fx.GraphModule, drop_switches: bool = False) -> None:
    """Make ``gm``'s ``torch.no_grad()`` blocks read detached the values computed from tensors
    requiring grad the program closes over (a module's parameters) alone, where they enter.

    For transforms whose graph, or whose generated code, runs such a block with grad mode on
    (forward mode lets tangents through ``no_grad``; ``vmap``'s code has no ``no_grad`` block): what
    the block computes and writes in place (an average of the weights, a vector
    ``F.normalize(..., out=)`` updates, a weight clipped) is then as untracked as in eager, when
    fxtools traces it and when the code runs. No tangent reaches a closed-over tensor, so the
    tangents are unchanged; values depending on an input are left alone (their tangents flow).
    ``drop_switches`` (``vmap``, whose batched graph holds no switches, and has no tangents): the
    values computed from the inputs enter detached too, and the switches are removed."""
    off = False
    detached: dict[fx.Node, fx.Node] = {}
    from_input: set[fx.Node] = set()  # depends on an input
    from_parameter: set[fx.Node] = set()  # depends on a closed-over tensor requiring grad
    inside: set[fx.Node] = set()  # computed inside a no_grad block
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            off = not node.args[0]
            if drop_switches:
                gm.graph.erase_node(node)
            continue
        if node.op == "placeholder":
            from_input.add(node)
        elif reads_tracked_tensor(node, gm):
            from_parameter.add(node)
        if node.op != "call_function":
            continue
        if off:
            inside.add(node)
            for a in node.all_input_nodes:
                if drop_switches:
                    tracked = a in from_input or a in from_parameter
                else:
                    tracked = a in from_parameter and a not in from_input
                value = getattr(gm, str(a.target), None) if a.op == "get_attr" else a.meta.get("val")
                if tracked and a not in inside and is_float(value):
                    if a not in detached:
                        with gm.graph.inserting_after(a):
                            detached[a] = gm.graph.call_function(torch.ops.aten.detach.default, (a,))
                        detached[a].meta.update(a.meta)
                        detached[a]._rename(f"{a.name}_detach")
                    node.replace_input_with(a, detached[a])
        inputs = node.all_input_nodes
        if any(a in from_input for a in inputs):
            from_input.add(node)
        if any(a in from_parameter for a in inputs):
            from_parameter.add(node)
    if detached or drop_switches:
        gm.recompile()


def _hidden_tensor(obj, depth=0, seen=None) -> str | None:
    """The path (``.t``, ``[0]``, ``{...}``) to a tensor held inside ``obj``, a pytree leaf that is
    not a tensor (a plain object, an unregistered dataclass, a set), or None if it holds none."""
    if isinstance(obj, torch.Tensor):
        return ""
    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, complex, bool)) or is_mesh(obj):
        return None
    seen.add(id(obj))
    if isinstance(obj, (set, frozenset)):
        items = [("{...}", x) for x in obj]
    elif isinstance(obj, (list, tuple)):
        items = [(f"[{i}]", x) for i, x in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(f"[{k!r}]", x) for k, x in obj.items()]
    else:
        attrs = getattr(obj, "__dict__", None)
        attrs = dict(attrs) if isinstance(attrs, dict) else {}
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
        items = [(f".{k}", x) for k, x in attrs.items()]
    for key, x in items:
        rest = _hidden_tensor(x, depth + 1, seen)
        if rest is not None:
            return key + rest
    return None


def _refuse_hidden_tensors(paths_leaves, top_names: list[str]) -> None:
    """A tensor inside an argument leaf that is not a pytree would become a constant of the
    graph (later calls would not read it, and it would get no gradient): refuse it."""
    for path, leaf in paths_leaves:
        if isinstance(leaf, (torch.Tensor, torch.nn.Module)):  # a module argument: read as closed-over state
            continue
        inside = _hidden_tensor(leaf)
        if inside is None:
            continue
        where = (top_names[path[0].idx] if path else "an argument") + pytree.keystr(path[1:])
        kind = type(leaf)
        if isinstance(leaf, (set, frozenset)):
            how = "pass a list or tuple instead (a set has no order, so it is not a pytree)"
        elif isinstance(leaf, torch.nn.Module):
            how = (
                "close over the module instead of passing it, or differentiate "
                "fxtools.functional(module), which takes its parameters as a dict"
            )
        else:
            how = (
                f"register {kind.__qualname__} as a pytree (torch.utils._pytree.register_dataclass for a "
                "dataclass, torch.utils._pytree.register_pytree_node otherwise), or pass its tensors as "
                "arguments directly"
            )
        raise FxtoolsError(
            f"argument {where} is a {kind.__module__}.{kind.__qualname__} holding a tensor ({where}{inside}), "
            "and it is not a pytree: fxtools would bake that tensor into the code as a constant (later "
            f"calls would ignore it, and it would get no gradient). To fix it, {how}."
        )


def capture(f, args: tuple, *, record_stack_traces=True, pre_dispatch=True, dynamic_shapes=None) -> Captured:
    """Trace ``f(*args)`` into a flat pre-dispatch ATen graph (see module docstring).

    ``dynamic_shapes`` (torch.export's format) keeps the marked sizes symbolic (``signature/sizes.py``).
    """
    paths_leaves, in_spec = pytree.tree_flatten_with_path(tuple(args))
    paths = [p for p, _ in paths_leaves]
    leaves = [leaf for _, leaf in paths_leaves]
    top_names = arg_names(f.forward if isinstance(f, torch.nn.Module) else f, len(args))
    _refuse_hidden_tensors(paths_leaves, top_names)
    names = leaf_names(paths, top_names)
    refuse_subclass_arguments(names, leaves)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    layout = LayoutReads()  # strides and contiguity the program reads (capture/layout_reads.py)
    replacing = Replacing()  # functions that read tensor values (capture/replacements.py)
    flat_f, out_info = _flat_function(f, leaves, is_tensor, in_spec, (replacing, layout))
    tensors = [x.detach() for x, t in zip(leaves, is_tensor) if t]
    outer = outer_frames()
    reads = outside_reads(f, {n: x for n, x in zip(names, leaves) if isinstance(x, torch.nn.Module)})
    _refuse_inference_tensors(reads)
    symbolic = None
    if dynamic_shapes is not None:
        from ..signature.sizes import fake_arguments

        fake_args, symbolic = fake_arguments(f, tuple(args), dynamic_shapes)
        tensors = [x for x in pytree.tree_leaves(fake_args) if isinstance(x, torch.Tensor)]
    gm = _trace_program(f, flat_f, tensors, record_stack_traces, pre_dispatch)
    reads = _tidy(gm, f, [n for n, t in zip(names, is_tensor) if t], reads, outer)
    reads = with_value_reads(reads, constants_read_as_values(layout.values, gm))
    reads = with_layout_reads(reads, constants_layout_read(layout.any_reads, gm))
    arg_of_leaf = [p[0].idx if p else 0 for p in paths]
    cap = Captured(
        f,
        top_names,
        gm,
        in_spec,
        out_info["spec"],
        leaves,
        names,
        is_tensor,
        arg_of_leaf,
        out_info["leaves"],
        symbolic,
        reads=reads,
    )
    tensor_paths = [top_names[p[0].idx] + pytree.keystr(p[1:]) for p, t in zip(paths, is_tensor) if t]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = layout_facts(layout.reads, placeholders, [x for x, t in zip(leaves, is_tensor) if t])
    cap.layout_reads = {tensor_paths[i]: tuple(fs) for i, fs in found.items()}
    return cap


def _refuse_inference_tensors(reads: list) -> None:
    """A closed-over tensor made under ``torch.inference_mode()`` (a module built there) cannot be
    traced: PyTorch refuses inference tensors outside inference mode, and a transform needs it
    off. Say which tensor, and how to make it an ordinary one."""
    for read in reads:
        if read.kind == "tensor" and isinstance(read.expected, torch.Tensor) and read.expected.is_inference():
            where = f" (read at {read.where})" if read.where else ""
            raise FxtoolsError(
                f"{read.what}{where} was made under torch.inference_mode(): it is an inference tensor, which "
                "PyTorch cannot trace or differentiate outside inference mode. Make it (the module) outside "
                "inference mode, e.g. under torch.no_grad() instead, or replace it by a clone made outside "
                "inference mode (with torch.inference_mode(False): t = t.clone())."
            )


def _flat_function(f, leaves: list, is_tensor: list[bool], in_spec, modes: tuple[Replacing, LayoutReads]):
    """``f`` as a function of its arguments' tensor leaves returning its output's leaves (what
    make_fx traces), and the dict that receives the output's ``spec`` and ``leaves`` when it runs.
    ``modes`` are active while it runs: the replacements of functions that read tensor values and
    the record of the layouts it reads."""
    replacing, layout = modes
    out_info: dict[str, Any] = {}

    def flat_f(*tensors):
        it = iter(tensors)
        full = [next(it) if t else leaf for t, leaf in zip(is_tensor, leaves)]
        reals = [leaf for leaf, t in zip(leaves, is_tensor) if t]
        with replacing, CountsFromExamples(tensors, reals), layout:
            out = f(*pytree.tree_unflatten(full, in_spec))
        _check_output_leaves(out)
        out_leaves, out_info["spec"] = pytree.tree_flatten(out)
        out_info["leaves"] = out_leaves
        return out_leaves

    PROGRAM_ENTRIES.add(id(flat_f.__code__))  # decisions below it are the program's (errors.decision_line)
    return flat_f, out_info


def _autocast_inside(gm: fx.GraphModule) -> bool:
    """Whether the program enters ``torch.autocast``: above autograd the region's ops keep their
    inputs' dtypes (autocast casts them at dispatch), so rules would differentiate ``bf16 = f32 @ f32``;
    traced below autograd, the casts are ops of the graph, differentiated as any ``.to``."""
    enter = torch.amp.autocast_mode._enter_autocast
    return any(node.target is enter for node in gm.graph.nodes)


def _trace_program(f, flat_f, tensors: list, record_stack_traces: bool, pre_dispatch: bool, below=False) -> fx.GraphModule:
    """make_fx of ``flat_f`` with the user's program traced as fxtools needs it (custom functions,
    compiler flags, static control flow, inference mode, module calls recorded); a data-dependent
    failure names the user's line. A program using DTensors is traced below autograd, where
    DTensor's dispatch runs, as in AOTAutograd (``capture/subclasses.py``); so is a program in or
    holding an autocast region. Either way its ``no_grad`` blocks are noted (``_grad_mode_noted``)."""
    below = below or not pre_dispatch or getattr(f, "__fxtools_below_autograd__", False)
    below = below or bool(autocast_state())  # built inside a region: its casts become ops of the code
    try:
        with (
            _custom_autograd_functions(pre_dispatch),
            _compiling(),
            dtensor_functions(pre_dispatch=not below),
            _static_control_flow(),
            _python_random_refused(),
            _tensor_attributes_written(),
            _module_state_restored(f),
            _backward_hooks_refused(),
            _tensor_hooks_refused(),
            module_conversions(),
            _inference_mode_as_no_grad(),
            recording_modules(module_paths(f) if record_stack_traces else None),
            _grad_mode_noted() if below else contextlib.nullcontext(),
        ):
            gm = trace_flat(flat_f, tensors, record_stack_traces=record_stack_traces, pre_dispatch=not below)
        if below:
            _grad_mode_switches(gm)
        if not below and _autocast_inside(gm):
            return _trace_program(f, flat_f, tensors, record_stack_traces, pre_dispatch, below=True)
        return gm
    except DTensorInside:  # the program makes DTensors: trace it again below autograd
        return _trace_program(f, flat_f, tensors, record_stack_traces, pre_dispatch, below=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the user's line
        if is_data_dependent(exc):
            raise data_dependent_error(exc) from exc
        if is_view_refusal(exc):
            raise view_refused(user_frame(exc.__traceback__), str(exc)) from exc
        if _reads_a_written_constant(exc):
            where = user_frame(exc.__traceback__) or "an unknown line of user code"
            raise DataDependentError(
                f"the program reads the value of a tensor as a Python number (.item(), float(), at {where}) "
                "after changing that tensor in place (a buffer or closed-over tensor it updates): the "
                "value at run time is the program's own result, which fxtools does not know while it "
                "traces. Keep it a tensor (x / self.count rather than x / self.count.item()), or pass "
                "the number in as an argument."
            ) from exc
        raise


_NO_GRAD_BELOW = "fxtools_no_grad_below_autograd"  # on a node recorded while grad mode was off


@contextlib.contextmanager
def _grad_mode_noted():
    """Mark the nodes traced while the program's grad mode is off, for a trace below autograd (an
    autocast region, DTensors): there no grad-mode switch is recorded (pre-dispatch tracing records
    ``_set_grad_enabled``), so a ``torch.no_grad()`` block of the program would otherwise be
    differentiated (``_grad_mode_switches`` writes the marks as switches). The program's mode is
    what Python sets (``no_grad``, ``set_grad_enabled``, ``inference_mode``): the forward of an
    ``autograd.Function`` run below autograd (DTensor's ``from_local`` / ``to_local``) runs with
    grad mode off in C++, and its ops are the program's differentiable ops all the same."""
    create_node = PythonKeyTracer.create_node
    set_grad_enabled = torch._C._set_grad_enabled
    enabled = [torch.is_grad_enabled()]

    def set_grad_enabled_noted(mode) -> None:
        enabled[0] = bool(mode)
        set_grad_enabled(mode)

    def create_node_noting_grad_mode(self, *args, **kwargs):
        node = create_node(self, *args, **kwargs)
        if not enabled[0]:
            node.meta[_NO_GRAD_BELOW] = True
        return node

    with (
        patched(PythonKeyTracer, create_node=create_node_noting_grad_mode),
        patched(torch._C, _set_grad_enabled=set_grad_enabled_noted),
    ):
        yield


def _grad_mode_switches(gm: fx.GraphModule) -> None:
    """``_set_grad_enabled`` nodes around each run of ops traced under ``no_grad`` (``_grad_mode_noted``),
    as a pre-dispatch trace records them: the walkers read grad mode from these nodes."""
    graph, enabled = gm.graph, True
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is not torch._C._set_grad_enabled:
            want = not node.meta.pop(_NO_GRAD_BELOW, False)
        elif node.op == "output":
            want = True
        else:
            continue
        if want != enabled:
            with graph.inserting_before(node):
                graph.call_function(torch._C._set_grad_enabled, (want,))
            enabled = want
    gm.recompile()


def _reads_a_written_constant(exc: BaseException) -> bool:
    """make_fx's refusal to read the value of a real tensor it traces: a closed-over tensor (a
    buffer) the program wrote in place, then read with ``.item()``."""
    return isinstance(exc, RuntimeError) and "get value out of a tracing tensor" in str(exc)


def _tidy(gm: fx.GraphModule, f, tensor_names_: list[str], reads: list, outer) -> list:
    """Refuse collectives; name placeholders after their leaves, constants after the
    attributes they are and values after the user's variables; locate the outside reads (returned,
    less those tracing itself changed)."""
    check_no_collectives(gm)
    check_matmul_dtypes(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, tensor_names_):
        node._rename(name)
    reads = _arrays_read_by_value(gm, unchanged_by_tracing(reads))
    _name_constants(gm, tensor_names(reads))
    locate(gm, reads)
    name_values(gm, f, outer)
    gm.recompile()
    return reads


def _arrays_read_by_value(gm: fx.GraphModule, reads: list) -> list:
    """``reads`` less the NumPy arrays the code reads by reference: ``torch.from_numpy(arr)`` is a
    tensor constant sharing the array's memory, so a later in-place change is what the code reads,
    as in eager. Other arrays (``float(arr.sum())``) are guarded by value."""
    import numpy as np

    shared = []
    for node in gm.graph.nodes:
        t = getattr(gm, str(node.target), None) if node.op == "get_attr" else None
        if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor) and t.device.type == "cpu":
            with contextlib.suppress(TypeError, RuntimeError):  # dtypes NumPy lacks (bfloat16): no array made them
                shared.append(t.detach().numpy())

    def by_reference(read) -> bool:
        now = read.get()
        return isinstance(now, np.ndarray) and any(np.shares_memory(now, t) for t in shared)

    return [r for r in reads if not (r.kind == "value" and by_reference(r))]


def check_supported(gm: fx.GraphModule) -> None:
    """Reject graph constructs fxtools cannot differentiate yet, naming the user's line.

    A higher-order op (control flow) is supported once a transform gave it a rule
    (``meta.RULE``, as ``transforms/control_flow.py`` does).
    """
    from ..errors import user_line_of

    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) and not meta.RULE.on(node):
            where = user_line_of(node) or "unknown line"
            raise FxtoolsError(f"{node.target.name()} (from {where}) is not supported by fxtools yet")


_SAME_DTYPE_OPS = {
    "matmul", "mm", "mv", "bmm", "dot", "vdot", "addmm", "addmv", "addbmm", "baddbmm", "linear", "bilinear",
    "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
}  # fmt: skip


def check_matmul_dtypes(gm: fx.GraphModule) -> None:
    """Refuse, naming the user's line, a matrix product or convolution of tensors of different
    dtypes outside autocast: eager PyTorch refuses it when it runs, but FakeTensors compute its
    shape without checking, so the module would build and fail only when called."""
    from ..errors import user_line_of

    autocast = 0
    for node in gm.graph.nodes:
        if node.target is torch.amp.autocast_mode._enter_autocast:
            autocast += 1
        elif node.target is torch.amp.autocast_mode._exit_autocast:
            autocast -= 1
        packet = getattr(node.target, "overloadpacket", None)
        if autocast or node.op != "call_function" or getattr(packet, "__name__", None) not in _SAME_DTYPE_OPS:
            continue
        dtypes = [v.dtype for a in node.all_input_nodes if isinstance(v := a.meta.get("val"), torch.Tensor)]
        if len(set(dtypes)) > 1:
            shown = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise FxtoolsError(
                f"{packet.__name__} of tensors of different dtypes ({shown}) at {user_line_of(node) or 'an unknown line'}: "
                "PyTorch refuses it when it runs (expected both to have the same dtype). Convert one of them "
                "(.to(other.dtype)), or run it under torch.autocast."
            )


def check_no_collectives(gm: fx.GraphModule) -> None:
    """Refuse the in-place collectives of ``torch.distributed`` (``c10d`` ops): autograd does not
    define their effect on gradients, and data parallelism belongs around fxtools' graphs."""
    from ..errors import user_line_of

    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "c10d":
            where = user_line_of(node) or "unknown line"
            raise FxtoolsError(
                f"an in-place collective of torch.distributed ({node.target.name()}, at {where}) is in the program "
                "fxtools differentiates; its effect on the gradients is not defined. For data parallelism, wrap the "
                "compiled module with DistributedDataParallel or fully_shard (they run around fxtools' graphs); "
                "inside a program, use the functional collectives (torch.distributed._functional_collectives), "
                "whose results are values."
            )


def view_refused(where: str | None, message: str) -> FxtoolsError:
    """The error of a ``.view`` at ``where`` whose input's layout cannot give the new shape."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return FxtoolsError(
        f"the .view at {where or 'an unknown line'} cannot view its input's layout, as eager PyTorch refuses it when it runs "
        f"({first}). Use .reshape (a copy where the layout needs one), or .contiguous() before the .view"
    )


def check_views(gm: fx.GraphModule) -> None:
    """Refuse, naming the user's line, a ``view`` node of ``gm`` whose input's strides (its
    FakeTensor's, the real kernel's) cannot give its shape: eager's kernel raises there, and a
    rewrite of the traced graph (functionalisation, decompositions) must not make it compute.
    Sizes or strides that are symbolic are left to the trace, which checked them as it ran."""
    from ..errors import user_line_of

    view = torch.ops.aten.view.default
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not view or not isinstance(node.args[0], fx.Node):
            continue
        x = node.args[0].meta.get("val")
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("size")
        if not isinstance(x, torch.Tensor) or not isinstance(shape, (list, tuple)):
            continue
        sizes = [*x.shape, *x.stride(), *shape]
        if not all(type(v) is int for v in sizes):
            continue
        if view_strides(x.shape, x.stride(), shape) is None:
            raise view_refused(
                user_line_of(node),
                f"view size is not compatible with input tensor's size and stride: shape {list(x.shape)}, strides "
                f"{list(x.stride())}, viewed as {list(shape)}",
            )
