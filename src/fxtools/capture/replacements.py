"""Torch functions that fxtools captures through a replacement of its own.

A few PyTorch functions read the *values* of their tensor arguments on the host before
computing: ``F.gaussian_nll_loss`` raises if ``torch.any(var < 0)``, ``torch.cov`` checks its
weights in C++, ``torch.narrow`` reads a tensor ``start`` with ``.item()``, and so does indexing
with a 0-dim integer tensor (``x[t]`` is ``x.select(0, t.item())``). fxtools traces with
FakeTensors, which have no values, so such a call could not be captured at all.

While fxtools captures, a ``TorchFunctionMode`` sends each function of ``REPLACEMENTS`` to a
replacement that computes the same value from the same arguments without reading tensor values.
A check on values becomes a runtime assertion in the captured graph
(``torch._assert_async(ok, message)``), so the generated code still refuses invalid values, with
PyTorch's message (as a ``RuntimeError``). Checks of shapes, dtypes and Python arguments still
run while tracing. A replacement returns ``NotImplemented`` to leave a call to PyTorch. One entry
per function; each replacement's docstring says where it differs from the original.

``_BatchNorm.forward`` is replaced too, for one case: ``momentum=None`` in training, whose
cumulative average PyTorch computes from a buffer's value on the host.

``ATTRIBUTES`` does the same for tensor attributes autograd owns, which dispatch no op and so
would escape the trace: ``.data`` (read as ``detach()``, assignment refused) and
``requires_grad_(False)`` (eager's error on a non-leaf).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import FXTOOLS_DIR, FxtoolsError, current_user_line, is_user_file
from ..graph import meta
from .autograd_grad import grad_in_trace
from .nested import capturing_program
from .patching import patched


def _check(ok, message):
    """Assert ``ok`` (a bool tensor) when the generated code runs, not while tracing."""
    torch._assert_async(ok, message)


def _integral(t):
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def cov(input, *, correction=1, fweights=None, aweights=None):
    """``torch.cov`` (PyTorch's C++ definition, step by step). The checks that weights are
    non-negative and do not sum to zero are runtime assertions; a non-positive number of degrees
    of freedom warns while tracing when it is known then (no weights), and otherwise silently
    gives the same inf/nan result as PyTorch."""
    if input.dim() > 2:
        raise RuntimeError(
            f"cov(): expected input to have two or fewer dimensions but got an input with {input.dim()} dimensions"
        )
    if input.dtype == torch.bool:
        raise RuntimeError("cov(): bool dtype is not supported for input")
    x = input if input.dim() == 2 else input.view(1, -1)
    n = x.shape[1]
    w = None
    for name, weights, ok in (("fweights", fweights, _integral), ("aweights", aweights, torch.is_floating_point)):
        if weights is None:
            continue
        if weights.dim() > 1 or not ok(weights) or weights.numel() != n:
            raise RuntimeError(
                f"cov(): expected {name} to have one or fewer dimensions, "
                f"{'an integral' if name == 'fweights' else 'a floating point'} dtype and "
                f"{n} elements (one per observation), got shape {list(weights.shape)} "
                f"and dtype {weights.dtype}"
            )
        if n:
            _check(weights.min() >= 0, f"cov(): {name} cannot be negative")
        w = weights if w is None else w * weights
    if w is None:
        w_sum = n
        avg = x.sum(1) / n
    else:
        w_sum = w.sum()
        _check(w_sum != 0, "cov(): weights sum to zero, can't be normalized")
        avg = (x * w).sum(1) / w_sum
    if w is None:
        norm = n - correction
        if norm <= 0:
            warnings.warn(
                "cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of observations.",
                stacklevel=2,
            )
            norm = 0
    else:
        if correction == 0:
            norm = w_sum
        elif aweights is None:
            norm = w_sum - correction
        elif fweights is None and n == 1 and correction == 1:
            norm = 0
        else:
            norm = w_sum - correction * (w * aweights).sum() / w_sum
        if isinstance(norm, torch.Tensor):
            norm = torch.where(norm <= 0, 0, norm)
    if n == 1 and (fweights is None) != (aweights is None):
        xc = torch.zeros_like(x if not _integral(x) else x.float())  # PyTorch's single-observation case
    else:
        xc = x - avg.unsqueeze(1)
    c = torch.mm(xc, (xc if w is None else xc * w).t().conj())
    return torch.true_divide(c, norm).squeeze()


def corrcoef(input):
    """``torch.corrcoef``: PyTorch's definition over fxtools' ``cov``."""
    if input.dim() > 2:
        raise RuntimeError(
            f"corrcoef(): expected input to have two or fewer dimensions but got an input with {input.dim()} dimensions"
        )
    c = cov(input)
    if c.dim() == 0:
        return c / c
    d = c.diagonal()
    std = torch.sqrt(d.real if d.is_complex() else d)
    c = c / std.view(-1, 1)
    c = c / std.view(1, -1)
    if c.is_complex():
        return torch.complex(c.real.clip(-1, 1), c.imag.clip(-1, 1))
    return c.clip(-1, 1)


def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """``F.gaussian_nll_loss`` (PyTorch's Python definition) with the check that ``var`` has no
    negative entry as a runtime assertion, and its clamp of ``var`` to ``eps`` (in place under
    ``no_grad``: the gradient passes through unchanged) written out of place."""
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    else:
        _check(torch.logical_not(torch.any(var < 0)), "var has negative entry/entries")
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = torch.unsqueeze(var, -1)
        elif not (input.ndim == var.ndim and sum(y for x, y in zip(input.size(), var.size()) if x != y) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    # PyTorch clamps a clone in place under no_grad: clamped values with the identity gradient
    var = torch.where(var < eps, eps + (var - var.detach()), var)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


def narrow(input, dim, start, length):
    """``torch.narrow`` with a 0-dim tensor ``start``, as an ``index_select`` of
    ``arange(length) + start``: the start is never read while tracing. Out-of-range starts still
    raise (in ``index_select``). Unlike ``narrow`` the result is a copy, not a view: it is marked
    (``mark_view_copy``) so that in-place writes into it reach ``input`` and writes into ``input``
    reach it, as in eager (``capture/functionalize.py``)."""
    if not isinstance(start, torch.Tensor):
        return NotImplemented
    if start.dim() != 0 or not _integral(start):
        raise RuntimeError("start must be an 0-dim integral Tensor.")
    dim %= input.dim()
    size = input.shape[dim]
    start = torch.where(start < 0, start + size, start)
    index = torch.arange(length, device=input.device) + (start if start.device == input.device else start.to(input.device))
    out = input.index_select(dim, index)
    mark_view_copy(out, input)
    return out


def _unwrapped(t):
    """The tensor the trace records for ``t``: below any torch.func wrappers (vmap's batched tensors)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def mark_view_copy(out, base) -> None:
    """Mark the node computing ``out``, a copy standing for a view of ``base`` (``meta.VIEW_COPY``):
    True when it is one ``aten.index`` / ``index_select`` of ``base``, which functionalize can
    redo and write back; False otherwise (under ``vmap``, where the batching rule adds steps), so
    that writes through it or into its base are refused instead."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return
    try:
        node = proxy_tensor.get_proxy_slot(_unwrapped(out), mode.tracer).proxy.node
    except Exception:  # noqa: BLE001 - not a traced value: nothing to keep in step
        return
    try:
        base_node = proxy_tensor.get_proxy_slot(_unwrapped(base), mode.tracer).proxy.node
    except Exception:  # noqa: BLE001 - a constant base
        base_node = None
    gathers = (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)
    exact = node.target in gathers and base_node is not None and node.args[0] is base_node
    meta.VIEW_COPY.set(node, exact)


def _int_index(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and _integral(t) and t.dtype != torch.uint8


def _traced_index(t) -> bool:
    """Whether ``t`` is a 0-dim integer tensor whose value the trace does not know: eager indexes
    with it as with a Python int (``x[t]`` is ``x.select(0, t.item())``), which a trace cannot read.
    (One vmap batches, a torch.func wrapper, eager indexes with as with any tensor: a copy.)"""
    return _int_index(t) and isinstance(t, FakeTensor) and t.constant is None


def _selects(tensor, index):
    """``(indices, rest)`` for ``tensor[index]`` when ``index`` holds 0-dim integer tensors the trace
    cannot read (else None): ``indices``, the ``aten.index`` argument selecting each at the dimension
    of ``tensor`` it indexes, and ``rest``, the index without them, to apply to the result. Eager
    selects at each integer in turn, so ``tensor[index] == aten.index(tensor, indices)[rest]``."""
    entries = index if isinstance(index, tuple) else (index,)
    if not any(_traced_index(e) for e in entries) or sum(e is Ellipsis for e in entries) > 1:
        return None
    if any(_int_index(e) and torch._C._functorch.is_functorch_wrapped_tensor(e) for e in entries):
        return None  # vmap's indexing (a batched index, as eager)

    def used(e) -> int:  # dimensions of ``tensor`` an entry indexes
        if e is None or e is Ellipsis or isinstance(e, bool):
            return 0
        if isinstance(e, torch.Tensor) and e.dtype in (torch.bool, torch.uint8):
            return e.dim()
        return 1

    dim, indices, rest = 0, [], []
    for e in entries:
        if _traced_index(e):
            indices += [None] * (dim - len(indices)) + [e if e.dtype in (torch.int64, torch.int32) else e.long()]
        else:
            rest.append(e)
        dim += tensor.dim() - sum(used(o) for o in entries) if e is Ellipsis else used(e)
    if dim > tensor.dim():
        return None  # too many indices: PyTorch's error
    while rest and (rest[-1] is Ellipsis or (isinstance(rest[-1], slice) and rest[-1] == slice(None))):
        rest.pop()  # x[:, t] is aten.index(x, [None, t]) alone
    return indices, tuple(rest)


def getitem(tensor, index):
    """``x[t]``, ``x[:, t]``, ``x[t, 1:]`` with ``t`` a 0-dim integer tensor the trace cannot read:
    ``aten.index`` at the dimensions such tensors select (exact for every value of ``t``; a
    negative one counts from the end, an out-of-range one raises ``IndexError`` as in eager),
    then the rest of the index. Eager's result is a view of ``x``; this one is a copy, marked
    (``mark_view_copy``) so that writes into either reach the other."""
    found = _selects(tensor, index)
    if found is None:
        return NotImplemented
    indices, rest = found
    out = torch.ops.aten.index.Tensor(tensor, indices)
    mark_view_copy(out, tensor)
    return out[rest] if rest else out


def select(input, dim, index):
    """``torch.select(x, dim, t)`` with a 0-dim integer tensor ``t``: ``x[..., t]`` at ``dim`` (``getitem``)."""
    if not _traced_index(index):
        return NotImplemented
    if not -input.dim() <= dim < input.dim():
        return NotImplemented
    return getitem(input, (slice(None),) * (dim % input.dim()) + (index,))


def lstsq(A, B, rcond=None, *, driver=None):
    """``torch.linalg.lstsq`` with ``driver="gels"``, by the algorithm LAPACK's gels uses: a QR
    factorisation of ``A`` (of ``A^H`` when it has fewer rows than columns, for the minimum-norm
    solution) and a triangular solve; the residuals are summed from ``A @ solution - B``. gels
    assumes ``A`` has full rank, and so does this. Its output
    shapes are static; PyTorch's fake kernel still treats them as data-dependent because the other
    drivers' are (``rank`` and ``residuals`` depend on the computed rank), so those drivers are left
    to PyTorch and refused."""
    if driver != "gels" or A.dim() < 2 or B.dim() < 2:
        return NotImplemented
    m, n = A.shape[-2:]
    if m >= n:
        q, r = torch.linalg.qr(A)
        solution = torch.linalg.solve_triangular(r, q.mH @ B, upper=True)
        if m > n:
            residuals = (A @ solution - B).abs().pow(2).sum(-2)
        else:
            residuals = B.new_empty(0, dtype=B.abs().dtype)
    else:
        q, r = torch.linalg.qr(A.mH)
        y = torch.linalg.solve_triangular(r.mH, B, upper=False)
        solution = q @ y
        residuals = B.new_empty(0, dtype=B.abs().dtype)
    rank = torch.empty(0, dtype=torch.int64, device=A.device)
    singular_values = A.new_empty(0, dtype=A.abs().dtype)
    return torch.return_types.linalg_lstsq((solution, residuals, rank, singular_values))


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """``F.ctc_loss`` with ``reduction="mean"`` and the lengths as lists: ATen's mean builds a
    tensor of the target lengths inside the op, which a trace on FakeTensors cannot; the same mean
    (each loss over its clamped target length, then the batch mean) is computed outside it."""
    if reduction != "mean" or isinstance(target_lengths, torch.Tensor):
        return NotImplemented
    res = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, "none", zero_infinity)
    lengths = torch.tensor(list(target_lengths), dtype=res.dtype, device=res.device).clamp_min(1)
    return (res / lengths).mean()


def setitem(tensor, index, value):
    """``y[mask] = v`` with a 0-dimensional boolean ``mask``: all of ``y`` or nothing, which eager
    decides from the mask's value (a data-dependent shape); here ``y.copy_(torch.where(mask, v, y))``.

    ``y[t] = v``, ``y[:, t] = v`` with ``t`` a 0-dim integer tensor the trace cannot read (eager
    writes into ``y.select(dim, t.item())``): ``y.index_put_`` at the dimensions such tensors select,
    exact for every value of ``t``; with more of an index after them (``y[t, 1:] = v``) the rest is
    assigned into a copy of ``y[t]`` first, which is then put back."""
    found = _selects(tensor, index)
    if found is not None:
        indices, rest = found
        if rest:
            part = torch.ops.aten.index.Tensor(tensor, indices)
            part[rest] = value
            value = part
        elif not isinstance(value, torch.Tensor):
            value = tensor.new_full((), value)
        else:
            if _shares_memory(value, tensor):
                value = value.clone()  # eager copies from the old values
            if value.dtype != tensor.dtype or value.device != tensor.device:
                value = value.to(dtype=tensor.dtype, device=tensor.device)
            lead = value.dim() - (tensor.dim() - len([i for i in indices if i is not None]))
            while lead > 0 and value.shape[0] == 1:  # eager drops leading 1s of the value's shape
                value, lead = value.squeeze(0), lead - 1
        torch.ops.aten.index_put_.default(tensor, indices, value)
        return None
    mask = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 0 and mask.dtype == torch.bool):
        return NotImplemented
    if isinstance(value, torch.Tensor) and value.dim() > tensor.dim():
        value = value.reshape(value.shape[value.dim() - tensor.dim() :])  # y[mask] has a leading dim of 1
    new = torch.where(mask, value, tensor)
    tensor.copy_(new.to(tensor.dtype) if new.dtype != tensor.dtype else new)
    return None


def _shares_memory(a, b) -> bool:
    try:
        return StorageWeakRef(_unwrapped(a).untyped_storage()) == StorageWeakRef(_unwrapped(b).untyped_storage())
    except Exception:  # noqa: BLE001 - no storage (a batched or sparse value): copy to be safe
        return True


def numpy(tensor, *args, **kwargs):
    """``.numpy()`` while fxtools traces: refused, naming the user's line (a trace has shapes, not
    values, and NumPy's work would not be in the generated code). A real tensor the program
    closes over has values: its ``.numpy()`` is a constant, as in eager."""
    try:
        return torch.Tensor.numpy(tensor, *args, **kwargs)
    except RuntimeError:
        pass
    raise FxtoolsError(
        f".numpy() (at {current_user_line()}) reads a tensor's values into NumPy. fxtools traces the "
        "program with shapes alone, and NumPy's operations would not be in the generated code, so it "
        "cannot capture this step: write it with torch operations (torch.sin, not np.sin), or keep it "
        "outside the function fxtools transforms and pass its result in as an argument."
    )


# frames between a user's call of an autograd function and its replacement
_PASSED = ("torch/autograd/", "torch/overrides.py", "torch/_tensor.py", "torch/fx/experimental/proxy_tensor.py")


def _called_by_user() -> bool:
    """Whether the autograd call being replaced is the user's own (not torch.func's machinery)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        fxtools_mode = name.startswith(FXTOOLS_DIR) and frame.f_code.co_name in ("__torch_function__", "refuse")
        if not (fxtools_mode or any(p in name for p in _PASSED)):
            return is_user_file(name)
        frame = frame.f_back
    return False


def _autograd_call(name: str):
    """``torch.autograd.grad`` of traced values while fxtools captures the program: taken from the
    trace (``capture/autograd_grad.py``). ``.backward()`` / ``torch.autograd.backward`` (which
    accumulate into ``.grad``), and ``torch.autograd.grad`` inside a nested ``torch.func``
    transform: refused, naming the user's line. The trace records no autograd graph of its values,
    so autograd's gradient would be a constant of the code (a fake tensor), not a function of the
    inputs."""

    def refuse(*args, **kwargs):
        traced = any(
            isinstance(t, FakeTensor) or torch._C._functorch.is_functorch_wrapped_tensor(t)
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        )
        if traced and name == "torch.autograd.grad" and capturing_program():  # also a library's call
            return grad_in_trace(*args, **kwargs)
        if not traced or not _called_by_user():
            return NotImplemented
        raise FxtoolsError(
            f"{name} (at {current_user_line()}) differentiates with autograd inside the program fxtools "
            "traces; the trace records no autograd graph, so the gradient would be a constant of the code. "
            "Write it with torch.func.grad, torch.func.vjp or torch.func.jacrev (or fxtools.laplacian, "
            "fxtools.jvp for derivatives with respect to inputs), which fxtools differentiates as written."
        )

    return refuse


def _size(*args, **kwargs):
    """``torch.ops.aten.size.default(x)`` called by the program on a tensor with symbolic sizes:
    the sizes as graph values (``aten.sym_size``), as make_fx's torch-function metadata mode
    would give them (``trace.trace_flat`` traces without that mode)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        if any(isinstance(s, torch.SymInt) for s in args[0].size()):
            return torch.ops.aten.sym_size.default(*args)
    return NotImplemented


def _rnn_between_layers_dropout(op, lstm: bool):
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (what ``nn.LSTM`` and the others call)
    of several layers with ``dropout`` in training: one call per layer, with ``torch.dropout`` of
    each layer's (time-major) output but the last, as PyTorch's C++ implementation runs them, so
    the masks are eager's draws. The decomposition PyTorch traces these ops through drops the
    dropout (``_rnn_helper`` sets it to 0 for every layer), which trained the model without it."""

    def replacement(*args, **kwargs):
        packed = not isinstance(args[1] if lstm else args[2], (list, tuple))
        if kwargs or packed or len(args) != 9:
            return NotImplemented
        input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
        if not (train and dropout and num_layers > 1):
            return NotImplemented
        dirs = 2 if bidirectional else 1
        per = len(params) // (num_layers * dirs)
        x = input.transpose(0, 1) if batch_first else input
        states = list(hx) if lstm else [hx]
        finals: list[list] = [[] for _ in states]
        for layer in range(num_layers):
            here = [s[layer * dirs : (layer + 1) * dirs] for s in states]
            weights = params[layer * dirs * per : (layer + 1) * dirs * per]
            out = op(x, tuple(here) if lstm else here[0], weights, has_biases, 1, 0.0, train, bidirectional, False)
            x = out[0]
            for kept, final in zip(finals, out[1:]):
                kept.append(final)
            if layer < num_layers - 1:
                x = torch.dropout(x, dropout, True)
        x = x.transpose(0, 1) if batch_first else x
        return (x, *(torch.cat(kept, 0) for kept in finals))

    return replacement


REPLACEMENTS: dict[Any, Callable[..., Any]] = {
    torch.lstm: _rnn_between_layers_dropout(torch.lstm, lstm=True),
    torch.gru: _rnn_between_layers_dropout(torch.gru, lstm=False),
    torch.rnn_tanh: _rnn_between_layers_dropout(torch.rnn_tanh, lstm=False),
    torch.rnn_relu: _rnn_between_layers_dropout(torch.rnn_relu, lstm=False),
    torch.autograd.grad: _autograd_call("torch.autograd.grad"),
    torch.autograd.backward: _autograd_call("torch.autograd.backward"),
    torch.Tensor.backward: _autograd_call(".backward()"),
    torch.Tensor.numpy: numpy,
    torch.Tensor.__setitem__: setitem,
    torch.Tensor.__getitem__: getitem,
    torch.select: select,
    torch.Tensor.select: select,
    F.ctc_loss: ctc_loss,
    torch.linalg.lstsq: lstsq,
    torch.cov: cov,
    torch.Tensor.cov: cov,
    torch.corrcoef: corrcoef,
    torch.Tensor.corrcoef: corrcoef,
    F.gaussian_nll_loss: gaussian_nll_loss,
    torch.narrow: narrow,
    torch.Tensor.narrow: narrow,
    torch.ops.aten.size.default: _size,
}


def _cumulative_batch_norm(self, input):
    """``_BatchNorm.forward`` with ``momentum=None`` in training: the cumulative moving average.

    PyTorch computes its factor on the host (``1.0 / float(self.num_batches_tracked)``), which a
    trace cannot read, and would bake into the code as a constant. Here the factor is a tensor
    computed from the buffer, and the running statistics are updated as PyTorch's kernel does
    (``running = (1 - factor) * running + factor * batch``, the variance unbiased), so every call
    of the generated code updates them exactly as eager mode would."""
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
    with torch.no_grad():
        dims = [0, *range(2, input.dim())]
        factor = (1.0 / self.num_batches_tracked.to(torch.float64)).to(self.running_mean.dtype)
        mean = input.mean(dims).to(self.running_mean.dtype)
        var = input.var(dims, correction=1).to(self.running_var.dtype)
        self.running_mean.copy_(factor * mean + (1 - factor) * self.running_mean)
        self.running_var.copy_(factor * var + (1 - factor) * self.running_var)
    return out


_ORIGINAL_BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm.forward


def _batch_norm_forward(self, input):
    cumulative = self.momentum is None and self.training and self.track_running_stats
    if cumulative and self.num_batches_tracked is not None and self.running_mean is not None:
        return _cumulative_batch_norm(self, input)
    return _ORIGINAL_BATCH_NORM(self, input)


def _data(tensor):
    """``tensor.data``: ``tensor.detach()``, which is what it means to autograd. PyTorch makes
    ``.data`` without dispatching any op, so a trace would see a new, unrelated tensor (a
    FakeTensor constant in the graph). Writes through it are writes through a ``detach()``:
    refused on values that carry a gradient (``capture/functionalize.py``)."""
    return tensor.detach()


def _set_data(tensor, value):
    """``tensor.data = value`` swaps a tensor's values behind autograd's back: refused."""
    raise FxtoolsError(
        f"assigning to .data (at {current_user_line()}) replaces a tensor's values without autograd "
        "seeing it, and fxtools cannot trace that. Compute a new tensor and use it instead "
        "(`p = value`), or pass the new value as an argument."
    )


def _requires_grad_(tensor, requires_grad=True):
    """``tensor.requires_grad_(False)``: eager PyTorch raises when ``tensor`` is not a leaf, which
    in a trace is known only once the differentiated inputs are: the tensor is marked with a rule
    that raises eager's error if its value depends on one (``mark_not_requires_grad``)."""
    if not requires_grad:
        mark_not_requires_grad(tensor, current_user_line())
    else:
        _restore_leaf(tensor)
    return NotImplemented  # and PyTorch sets the flag of the traced tensor, as before


def _set_requires_grad(tensor, requires_grad):
    """``tensor.requires_grad = flag``: as ``requires_grad_(flag)``."""
    return _requires_grad_(tensor, requires_grad)


def _leaves_off(tracer) -> dict:
    """id of a traced leaf set ``requires_grad_(False)`` -> its own proxy slot (for this trace)."""
    return tracer.__dict__.setdefault("fxtools_leaves_off", {})


def _restore_leaf(tensor) -> None:
    """``requires_grad_(True)`` of a leaf set ``requires_grad_(False)`` earlier in the program: its
    uses from here on are differentiated again, as in eager."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    slot = None if mode is None else _leaves_off(mode.tracer).pop(id(tensor), None)
    if slot is not None:
        proxy_tensor.set_proxy_slot(tensor, mode.tracer, slot)


def mark_not_requires_grad(tensor, where: str) -> None:
    """From now on the traced program reads ``tensor`` through an ``alias`` node whose VJP rule
    raises eager PyTorch's error: reverse mode calls it only when the value carries a gradient
    (is a non-leaf in eager terms)."""
    from torch.fx.experimental import proxy_tensor

    from ..registry import Rule

    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return
    try:
        slot = proxy_tensor.get_proxy_slot(tensor, mode.tracer)
    except Exception:  # noqa: BLE001 - not a traced tensor (a constant): a leaf
        return
    if slot.proxy.node.op in ("placeholder", "get_attr"):  # a leaf: eager allows it; its later uses
        with torch.no_grad():  # no gradient until requires_grad_(True); forward mode ignores both, as in eager
            detached = torch.ops.aten.alias.default(tensor)
        _leaves_off(mode.tracer).setdefault(id(tensor), slot)
        proxy_tensor.set_proxy_slot(tensor, mode.tracer, proxy_tensor.get_proxy_slot(detached, mode.tracer))
        return
    marker = torch.ops.aten.alias.default(tensor)
    marker_slot = proxy_tensor.get_proxy_slot(marker, mode.tracer)

    def fwd(x):
        raise FxtoolsError(
            f"requires_grad_(False) (at {where}) on a value computed from a differentiated input: eager "
            "PyTorch raises 'you can only change requires_grad flags of leaf variables'. If you want "
            "to use a computed variable in a subgraph that doesn't require differentiation use "
            "var_no_grad = var.detach()."
        )

    def bwd(aux, ct):  # pragma: no cover - fwd always raises
        raise AssertionError("unreachable")

    meta.RULE.set(marker_slot.proxy.node, Rule(fwd, bwd, "fxtools-requires-grad"))
    proxy_tensor.set_proxy_slot(tensor, mode.tracer, marker_slot)


ATTRIBUTES: dict[Any, Callable[..., Any]] = {
    torch.Tensor.data.__get__: _data,
    torch.Tensor.data.__set__: _set_data,
    torch.Tensor.requires_grad_: _requires_grad_,
    torch.Tensor.requires_grad.__set__: _set_requires_grad,
}


# --- the generator's state ------------------------------------------------------------------
# ``torch.manual_seed`` and ``torch.get_rng_state`` / ``set_rng_state`` (also through
# ``torch.random.fork_rng`` and PyTorch's ``freeze_rng_state``) touch no tensor, so a trace would
# drop them and the generated code would draw other numbers than eager does. While capturing they
# are sent to stand-ins that, under a trace, add a node calling themselves (so every later trace of
# the graph records them again) and leave the real generator alone; run, they call PyTorch's
# function. They print as ``torch.manual_seed`` etc., and are declared side-effectful, so no pass
# removes or merges them.

_RNG_STATES: dict[int, fx.Proxy] = {}  # id(state tensor handed to the program) -> its get_rng_state node


def _tracer():
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def _called_by_func_transforms() -> bool:
    """Whether a stand-in's caller is torch.func's own machinery (``vmap``'s chunks with
    ``randomness="same"`` reset the generator), whose draws fxtools' transforms reproduce
    themselves (``transforms/batching.py``): those calls are not the program's."""
    import sys

    return sys._getframe(2).f_globals.get("__name__", "").startswith("torch._functorch")


def _rng_function(real):
    """The stand-in for ``torch.random.<name>`` (see above), printed as ``torch.<name>``."""
    name = real.__name__

    def stand_in(*args):
        tracer = _tracer()
        if tracer is None or _called_by_func_transforms():
            return real(*args)
        return _RNG_TRACED[name](tracer, stand_in, *args)

    stand_in.__module__, stand_in.__name__, stand_in.__qualname__ = "torch", name, name
    stand_in.__doc__ = f"torch.{name}, recorded when traced (capture/replacements.py)."
    return fx.node.has_side_effect(stand_in)


def _traced_manual_seed(tracer, target, seed):
    """``torch.manual_seed(seed)``: the seed must be a Python int (it is part of the code)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FxtoolsError(
            f"torch.manual_seed at {current_user_line()} is given a {type(seed).__name__}: fxtools records the seed "
            "in the generated code, so it must be a Python int."
        )
    tracer.create_proxy("call_function", target, (seed,), {})
    return torch.random.default_generator


def _traced_get_rng_state(tracer, target):
    """``torch.get_rng_state()``: the program gets today's state, to hand back to ``set_rng_state``
    (any other use of it would bake today's state into the code)."""
    import weakref

    state = torch.random.default_generator.get_state()
    proxy = tracer.create_proxy("call_function", target, (), {})
    proxy.node.meta["val"] = state
    _RNG_STATES[id(state)] = proxy
    weakref.finalize(state, _RNG_STATES.pop, id(state), None)
    return state


def _traced_set_rng_state(tracer, target, new_state):
    """``torch.set_rng_state(state)``, for a state read by ``get_rng_state`` in the same program."""
    proxy = _RNG_STATES.get(id(new_state))
    if proxy is None or proxy.tracer is not tracer:
        raise FxtoolsError(
            f"torch.set_rng_state at {current_user_line()} sets a state the program did not read with "
            "torch.get_rng_state: fxtools would have to bake the generator's state into the code. Read it "
            "in the function (torch.get_rng_state()), or seed with torch.manual_seed(int)."
        )
    tracer.create_proxy("call_function", target, (proxy,), {})


_RNG_TRACED: dict[str, Callable[..., Any]] = {
    "manual_seed": _traced_manual_seed,
    "get_rng_state": _traced_get_rng_state,
    "set_rng_state": _traced_set_rng_state,
}
RNG_FUNCTIONS = {name: _rng_function(getattr(torch.random, name)) for name in _RNG_TRACED}


class _ProgramGenerator(torch.Generator):
    """``torch.Generator`` while capturing: a generator the program makes itself. The generated
    code would hold the one made while tracing, whose state advances from call to call, where eager
    makes (and seeds) a new one on every call: a draw from it is refused (``refuse_program_generator``)."""


def refuse_program_generator(func, args, kwargs) -> None:
    """Refuse a random op drawing from a generator the program made (``_ProgramGenerator``)."""
    if any(isinstance(a, _ProgramGenerator) for a in (*args, *kwargs.values())):
        name = getattr(func, "__name__", str(func))
        raise FxtoolsError(
            f"{name} at {current_user_line()} draws from a torch.Generator made inside the function: the "
            "generated code would keep the one generator made while tracing, whose numbers change from "
            "call to call, where eager makes and seeds a new one on every call. Make the generator "
            "outside the function (a closed-over generator is used by reference, as in eager), or seed "
            "torch's generator with torch.manual_seed(int) inside it."
        )


@contextlib.contextmanager
def recording_rng_state():
    """Send ``torch.manual_seed``, ``torch.get_rng_state`` and ``torch.set_rng_state`` (also as
    ``torch.random.*``) to their stand-ins. The traced program draws only FakeTensors, so the real
    generator must leave the block as it entered: if it changed, the program reached it some way
    the stand-ins did not see (``torch.default_generator.manual_seed``, a ``manual_seed`` imported
    before), which the generated code would not repeat; that is refused."""
    before = torch.random.default_generator.get_state()
    with patched(torch, Generator=_ProgramGenerator, **RNG_FUNCTIONS), patched(torch.random, **RNG_FUNCTIONS):
        yield
    if not torch.equal(torch.random.default_generator.get_state(), before):
        torch.random.default_generator.set_state(before)
        raise FxtoolsError(
            "the program changed the state of torch's random generator in a way fxtools cannot record "
            "(torch.default_generator.manual_seed, or a manual_seed / set_rng_state bound to a name before "
            "fxtools ran): the generated code would draw other numbers than eager. Call torch.manual_seed, "
            "torch.get_rng_state and torch.set_rng_state through the torch module."
        )


_COMPRESSED_SPARSE = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def refuse_compressed_sparse(func, args, kwargs) -> None:
    """Refuse a call on a compressed sparse tensor (CSR, CSC, BSR, BSC), naming the function and
    the user's line: fxtools' transforms work on strided tensors (and reach COO ones only through
    ``to_dense``), so such a call would fail later with PyTorch's "do not have strides"."""
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and _layout(t) in _COMPRESSED_SPARSE:
                name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
                raise FxtoolsError(
                    f"{name} (at {current_user_line()}) is given a {t.layout} tensor: fxtools differentiates "
                    "strided tensors, not compressed sparse ones. Pass dense tensors (t.to_dense()) to the function "
                    "fxtools differentiates, or differentiate this call with torch.autograd."
                )


# tensor types whose ``layout`` is torch's own getter (no ``__torch_function__`` of their own)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _layout(t: torch.Tensor) -> torch.layout:
    """``t.layout``, read without a trip through the torch-function modes below ``Replacing``
    (make_fx's pre-dispatch mode passes it through: a Python call per argument of every call
    the program makes) when ``t``'s type reads it as torch does; through them otherwise."""
    if type(t) in _PLAIN_TENSORS:
        with torch._C.DisableTorchFunction():
            return t.layout
    return t.layout


def _traced_slot(t: torch.Tensor):
    """The trace's current record (proxy slot) of ``t``, with its tracer, or None."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None:
        return None
    slot = proxy_tensor.get_proxy_slot(t, mode.tracer, None)
    return None if slot is None else (mode.tracer, slot)


def _keep_identity(t: torch.Tensor, before) -> None:
    """A call that returned its input itself (``x.to(x.dtype)``, ``x.double()`` on a double
    tensor, ``x.cpu()`` on the CPU, ``resolve_conj`` on a real tensor) without writing into it:
    eager hands back the same tensor, but the trace recorded an aliasing node (``aten.to``) and
    made it ``t``'s record, so every later use of ``t`` read that node. Under ``no_grad`` the node
    is non-differentiable, and the gradient through all of ``t``'s later uses was silently zero;
    ``t`` keeps its record from before the call instead (the node is left unused)."""
    from torch.fx.experimental import proxy_tensor

    tracer, slot = before
    now = proxy_tensor.get_proxy_slot(t, tracer, None)
    if now is None or now is slot:
        return
    target = now.proxy.node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return
    tracer.tensor_tracker[t] = slot


class Replacing(TorchFunctionMode):
    """Calls the replacement of each function in ``REPLACEMENTS`` and of each attribute access in
    ``ATTRIBUTES`` (active while capturing), and records the generator-state calls
    (``recording_rng_state``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refuse_compressed_sparse(func, args, kwargs)
        refuse_program_generator(func, args, kwargs)
        replacement = REPLACEMENTS.get(func) or ATTRIBUTES.get(func)
        if replacement is not None:
            out = replacement(*args, **kwargs)
            if out is not NotImplemented:
                return out
        first = args[0] if args and isinstance(args[0], torch.Tensor) and not torch.compiler.is_dynamo_compiling() else None
        slot = _traced_slot(first) if first is not None else None
        out = func(*args, **kwargs)
        if out is first and slot is not None:
            _keep_identity(first, slot)
        return out

    def __enter__(self):
        self._batch_norm = torch.nn.modules.batchnorm._BatchNorm.forward  # restored as found (nested captures)
        torch.nn.modules.batchnorm._BatchNorm.forward = _batch_norm_forward  # type: ignore[method-assign]  # patched while tracing
        self._rng = recording_rng_state()
        self._rng.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.modules.batchnorm._BatchNorm.forward = self._batch_norm  # type: ignore[method-assign]  # restored
        try:
            return super().__exit__(*exc)
        finally:
            self._rng.__exit__(*exc)
