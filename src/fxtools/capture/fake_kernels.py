"""FakeTensor kernels fxtools uses while it traces, for ops whose PyTorch meta kernel is stricter
than their CPU kernel.

fxtools traces on FakeTensors, so an op whose meta (shape) kernel refuses arguments the real
kernel accepts cannot be captured at all. ``aten._grouped_mm`` (``F.grouped_mm``, the expert
layers of every Mixture-of-Experts model in ``transformers``) is one: its meta kernel mirrors the
CUDA kernel and demands bfloat16, while the CPU kernel also takes float32 and float16.

The normalisations' fake kernels disagree with their CPU kernels instead: for a half-precision
input with float32 parameters (a bfloat16 residual under CPU autocast, a LayerNorm kept in
float32) the CPU kernels return float32 statistics (mean, rstd), PyTorch's fake kernels the
input's dtype; and CPU batch norm lays its output out densely (``suggest_memory_format``) where
the fake kernel keeps a permuted input's strides. A trace then held the wrong dtype for the
statistics (a JVP's tangent reads them: its backward added float32 cotangents into bfloat16
ones, and crashed in a matmul) or refused a ``.view`` of the output that eager runs. fxtools'
kernels run PyTorch's own and correct the dtypes and the layout (``_norm_kernel``).

``tracing_kernels()`` installs a kernel per such op into FakeTensorMode's table of op
implementations (consulted before the meta kernel) for the duration of an fxtools trace, and
removes it afterwards, together with the fake-dispatch cache entries it produced, so code
outside fxtools sees PyTorch's own behaviour. The kernels only handle CPU tensors (elsewhere the
meta kernel applies) and check what the CPU kernel checks, so a call that would fail at run time
fails while tracing, with the user's line.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch

aten = torch.ops.aten

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_strides(name, mat):
    """The CPU kernel reads each matrix as row- or column-major with 16-byte aligned rows/columns."""
    rows, cols = mat.shape[-2:]
    s_rows, s_cols = mat.stride()[-2:]
    align = 16 // mat.element_size()
    if s_cols == 1 and s_rows >= max(1, cols):
        ok = s_rows % align == 0
    elif s_rows == 1 and s_cols >= max(1, rows):
        ok = s_cols % align == 0
    else:
        raise RuntimeError(f"_grouped_mm: invalid strides {list(mat.stride())} for {name} of sizes {list(mat.shape)}")
    torch._check(ok, lambda: f"_grouped_mm: {name} strides should be multiple of 16 bytes, got {list(mat.stride())}")


def _grouped_mm(fake_mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Output of ``torch._grouped_mm`` on CPU: PyTorch's meta shapes, the CPU kernel's checks.

    2D x 3D: ``offs`` splits the rows of ``mat_a`` -> (M, N). 3D x 2D: it splits the columns of
    ``mat_b`` -> (M, N). 2D x 2D: it splits the contraction dimension -> (groups, M, N).
    3D x 3D: a batched product, no ``offs``.
    """
    if mat_a.device.type != "cpu":
        return NotImplemented
    _state["used"] = True
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(
            mat.dtype in _GROUPED_MM_DTYPES, lambda: f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}"
        )
        torch._check(mat.dim() in (2, 3), lambda: f"_grouped_mm: {name} must be 2D or 3D, got {mat.dim()}D")
    torch._check(
        mat_a.dtype == mat_b.dtype,
        lambda: f"_grouped_mm: mat_a and mat_b must have the same dtype, got {mat_a.dtype} and {mat_b.dtype}",
    )
    torch._check(out_dtype is None or out_dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    torch._check(bias is None, lambda: "_grouped_mm: bias is not supported")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check(
        (offs is not None) == (a2 or b2),
        lambda: "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d",
    )
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    if not (a2 and b2):
        torch._check(mat_a.shape[-1] == mat_b.shape[-2], lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    if a2 and b2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a2:
        torch._check(offs.shape[0] == mat_b.shape[0], lambda: "matrix batch sizes have to match")
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2:
        torch._check(offs.shape[0] == mat_a.shape[0], lambda: "matrix batch sizes have to match")
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        torch._check(mat_a.shape[0] == mat_b.shape[0], lambda: "batched dimension has to match")
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    with fake_mode:
        return torch.empty(size, dtype=mat_a.dtype, device=mat_a.device)


def _ctc_loss(fake_mode, func, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``aten._ctc_loss`` (``F.ctc_loss``) with the lengths as lists: ``(neg_log_likelihood[N],
    log_alpha[N, T, 2 * max(target_lengths) + 1])``, sizes the lists fix. PyTorch tags the op as
    having data-dependent output shapes (its ``.Tensor`` overload reads the lengths from tensors,
    which stays refused); the checks are the CPU kernel's."""
    if log_probs.device.type != "cpu":
        return NotImplemented
    _state["used"] = True
    torch._check(log_probs.dim() == 3, lambda: "ctc_loss: log_probs must be 3-D (T, N, C)")
    T, batch, classes = log_probs.shape
    torch._check(0 <= blank < classes, lambda: "blank must be in label range")
    torch._check(len(input_lengths) == batch, lambda: "input_lengths must be of size batch_size")
    torch._check(len(target_lengths) == batch, lambda: "target_lengths must be of size batch_size")
    for b, n in enumerate(input_lengths):
        torch._check(0 <= n <= T, lambda: f"Expected input_lengths to have value at most {T}, but got value {n}")
    if targets.dim() == 2:
        for n in target_lengths:
            torch._check(n <= targets.shape[1], lambda: f"Expected tensor to have size at least {n} at dimension 1")
    width = 2 * max(target_lengths, default=0) + 1
    with fake_mode:
        return (
            torch.empty([batch], dtype=log_probs.dtype, device=log_probs.device),
            torch.empty([batch, T, width], dtype=log_probs.dtype, device=log_probs.device),
        )


def _ctc_loss_tensor(fake_mode, func, log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``aten._ctc_loss.Tensor``, the lengths as tensors: ``log_alpha``'s last size,
    ``2 * max(target_lengths) + 1``, is read from their values, so it is a new unbacked size (only
    ``_ctc_loss_backward`` reads that tensor, which the CPU kernel sizes itself)."""
    shape_env = fake_mode.shape_env
    if log_probs.device.type != "cpu" or shape_env is None:
        return NotImplemented
    _state["used"] = True
    torch._check(log_probs.dim() == 3, lambda: "ctc_loss: log_probs must be 3-D (T, N, C)")
    T, batch, classes = log_probs.shape
    torch._check(0 <= blank < classes, lambda: "blank must be in label range")
    for name, lengths in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        torch._check(lengths.numel() == batch, lambda: f"{name} must be of size batch_size")
    with shape_env.ignore_fresh_unbacked_symbols():  # a size nothing reads (see above)
        width = shape_env.create_unbacked_symint()
        torch._check(width >= 1)
    with fake_mode:
        return (
            torch.empty([batch], dtype=log_probs.dtype, device=log_probs.device),
            torch.empty([batch, T, width], dtype=log_probs.dtype, device=log_probs.device),
        )


def _ctc_loss_backward(fake_mode, func, grad, log_probs, *args, **kwargs):
    """``aten._ctc_loss_backward.Tensor``: the gradient of ``log_probs``, shaped like it."""
    if log_probs.device.type != "cpu":
        return NotImplemented
    _state["used"] = True
    with fake_mode:
        return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


def _pack_padded_sequence(fake_mode, func, inputs, lengths, batch_first):
    """``aten._pack_padded_sequence`` (``nn.utils.rnn.pack_padded_sequence``): ``(data[total, *],
    batch_sizes[steps])``, ``total`` (the lengths' sum) and ``steps`` (their largest) unbacked, and
    ``batch_sizes`` int64 as the CPU kernel makes it. PyTorch's fake kernel gives ``data`` the
    shape of one step and ``batch_sizes`` the input's dtype, and an RNN reading them failed
    inside PyTorch ("zeros(): argument 'size' ... got FakeTensor") instead of where the values
    are read."""
    shape_env = fake_mode.shape_env
    if inputs.device.type != "cpu" or shape_env is None:
        return NotImplemented
    _state["used"] = True
    torch._check(lengths.dim() == 1, lambda: "'lengths' argument should be a 1D CPU int64 tensor")
    torch._check(lengths.dtype == torch.int64, lambda: "'lengths' argument should be a 1D CPU int64 tensor")
    torch._check(inputs.dim() >= 2, lambda: "pack_padded_sequence: input must have at least 2 dimensions")
    total, steps = shape_env.create_unbacked_symint(), shape_env.create_unbacked_symint()
    torch._check(total >= 0)
    torch._check(steps >= 0)
    with fake_mode:
        return (
            torch.empty([total, *inputs.shape[2:]], dtype=inputs.dtype, device=inputs.device),
            torch.empty([steps], dtype=torch.int64),
        )


def _linalg_lstsq(fake_mode, func, A, B, rcond=None, *, driver=None):
    """``aten.linalg_lstsq`` (``torch.linalg.lstsq``) on CPU with the drivers whose output shapes do
    not depend on the computed rank: ``gelsy`` (the default) always returns empty residuals and
    singular values, ``gelsd`` / ``gelss`` a rank and the singular values, and residuals only when
    ``A`` has more rows than columns (and full rank: data-dependent, left to PyTorch's refusal).
    PyTorch's fake kernel treats every driver as data-dependent, so the default call was refused.
    Shapes and strides as the CPU kernel makes them (the solution narrowed from a column-major
    ``max(m, n)``-row buffer)."""
    driver = "gelsy" if driver is None else driver
    if A.device.type != "cpu" or driver not in ("gelsy", "gelsd", "gelss") or A.dim() < 2:
        return NotImplemented
    m, n = A.shape[-2:]
    if driver != "gelsy" and not (isinstance(m, int) and isinstance(n, int) and m <= n):
        return NotImplemented  # residuals exist only if A has full rank
    vector = (B.dim() == 1 and A.dim() == 2) or (B.dim() == A.dim() - 1 and tuple(B.shape) == tuple(A.shape[:-1]))
    if not vector and B.dim() != A.dim():
        return NotImplemented
    _state["used"] = True
    rows = max(m, n) if isinstance(m, int) and isinstance(n, int) else torch.sym_max(m, n)
    real = A.abs().dtype if A.is_complex() else A.dtype
    with fake_mode:
        if vector:
            batch = list(A.shape[:-2])
            solution = torch.empty_strided([*batch, rows], _contiguous_strides([*batch, rows]), dtype=A.dtype)
            solution = solution[..., :n]
        else:
            batch = list(torch.broadcast_shapes(A.shape[:-2], B.shape[:-2]))
            k = B.shape[-1]
            full = torch.empty([*batch, k, rows], dtype=A.dtype).transpose(-2, -1)
            solution = full[..., :n, :]
        residuals = torch.empty([0], dtype=real)
        rank = torch.empty(list(A.shape[:-2]), dtype=torch.int64)
        if driver == "gelsy":
            singular_values = torch.empty([0], dtype=real)
        else:
            singular_values = torch.empty([*A.shape[:-2], min(m, n)], dtype=real)
    return solution, residuals, rank, singular_values


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return list(reversed(strides))


# --------------------------------------------------------------------------------------------
# normalisations: the CPU kernels' dtypes and layouts

# set while a norm kernel asks the meta kernel (an op with no fake kernel of PyTorch's)
_INSIDE_NORM: contextvars.ContextVar[bool] = contextvars.ContextVar("fxtools_inside_norm", default=False)


def _mixed(x, *params) -> bool:
    """The CPU kernels' ``is_mixed_type``: the first parameter given has another dtype than ``x``
    (a half-precision input with float32 affine parameters or running statistics). Their
    statistics are then float32 (``param_scalar_type``); PyTorch's fake kernels give ``x``'s dtype."""
    first = next((p for p in params if p is not None), None)
    return first is not None and first.dtype != x.dtype and x.dtype in (torch.bfloat16, torch.float16)


def _pytorch_fake(fake_mode, func, args, kwargs):
    """What FakeTensorMode computes for ``func`` without fxtools' kernel: PyTorch's own fake kernel
    (``native_layer_norm``'s), its decomposition (the batch norms': see ``_install``), or the meta kernel."""
    previous = _saved.get(func)
    if previous is not None:
        return previous(fake_mode, func, *args, **kwargs)
    if func in _DECOMPOSED:
        from torch._decomp import decomposition_table

        with fake_mode:
            return decomposition_table[func](*args, **kwargs)
    token = _INSIDE_NORM.set(True)
    try:
        with fake_mode:
            return func(*args, **kwargs)
    finally:
        _INSIDE_NORM.reset(token)


def _norm_kernel(param_indices, stat_outputs, dense_output, running_outputs=()):
    """A fake kernel for a normalisation op: PyTorch's own, and on CPU, the CPU kernel's dtype for
    the statistics (outputs ``stat_outputs``) when the dtypes are mixed (``_mixed`` of the
    arguments ``param_indices``) and, with ``dense_output``, the output laid out as the CPU
    kernel lays it out (``empty_like(x, x.suggest_memory_format())``: a permuted input gives a
    contiguous output, where PyTorch's fake kernel keeps the permutation); ``running_outputs``
    (the new running statistics of ``_native_batch_norm_legit_functional``) have the dtype of
    the running statistics given (arguments 3 and 4), not always float32."""

    def kernel(fake_mode, func, *args, **kwargs):
        if _INSIDE_NORM.get():
            return NotImplemented
        schema = func._schema.arguments
        values = [args[i] if i < len(args) else kwargs.get(schema[i].name, schema[i].default_value) for i in range(len(schema))]
        x = values[0]
        outs = _pytorch_fake(fake_mode, func, args, kwargs)
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            return outs
        mixed = _mixed(x, *(values[i] for i in param_indices))
        fmt = torch._prims_common.suggest_memory_format(x)
        relayout = dense_output and not outs[0].is_contiguous(memory_format=fmt)
        retype = [i for i, j in zip(running_outputs, (3, 4)) if values[j] is not None and outs[i].dtype != values[j].dtype]
        if not (mixed or relayout or retype):
            return outs
        _state["used"] = True
        outs = list(outs)
        with fake_mode:
            for i, j in zip(running_outputs, (3, 4)):
                if i in retype:
                    outs[i] = torch.empty_like(outs[i], dtype=values[j].dtype)
            if relayout:
                outs[0] = torch.empty_like(outs[0], memory_format=fmt)
            if mixed:
                for i in stat_outputs:
                    outs[i] = torch.empty_like(outs[i], dtype=torch.float32)
        return tuple(outs)

    return kernel


_BATCH_NORMS = {
    # op: (parameter arguments, statistics outputs)
    aten.native_batch_norm.default: ((1, 2, 3, 4), (1, 2)),
    aten._native_batch_norm_legit.default: ((1, 2, 3, 4), (1, 2)),
    aten._native_batch_norm_legit.no_stats: ((1, 2), (1, 2)),
    aten._native_batch_norm_legit_no_training.default: ((1, 2, 3, 4), (1, 2)),
}


KERNELS = {
    aten.linalg_lstsq.default: _linalg_lstsq,
    aten._pack_padded_sequence.default: _pack_padded_sequence,
    aten._grouped_mm.default: _grouped_mm,
    aten._ctc_loss.default: _ctc_loss,
    aten._ctc_loss.Tensor: _ctc_loss_tensor,
    aten._ctc_loss_backward.Tensor: _ctc_loss_backward,
    aten.native_layer_norm.default: _norm_kernel((2, 3), (1, 2), dense_output=False),
    aten.native_group_norm.default: _norm_kernel((1, 2), (1, 2), dense_output=False),
    **{op: _norm_kernel(params, stats, dense_output=True) for op, (params, stats) in _BATCH_NORMS.items()},
    aten._native_batch_norm_legit_functional.default: _norm_kernel(
        (1, 2, 3, 4), (1, 2), dense_output=True, running_outputs=(3, 4)
    ),
}

_lock = threading.Lock()
_state = {"depth": 0, "used": False}  # nested uses share one install; "used": a kernel ran (may be cached)
_saved: dict = {}
_saved_meta: dict = {}
# FakeTensorMode runs these ops' decompositions (``torch._decomp``) before it looks for a kernel of
# ``op_implementations_dict``, unless they have a Python meta kernel (``meta_table``): while the
# kernels are installed they are entered there, and ``_pytorch_fake`` runs the decomposition
_DECOMPOSED = (*_BATCH_NORMS, aten._native_batch_norm_legit_functional.default)


def _install():
    from torch._decomp import decomposition_table, meta_table
    from torch._subclasses.fake_impls import op_implementations_dict

    for op, kernel in KERNELS.items():
        _saved[op] = op_implementations_dict.get(op)
        op_implementations_dict[op] = kernel
    for op in _DECOMPOSED:
        _saved_meta[op] = meta_table.get(op)
        meta_table[op] = decomposition_table[op]


def _uninstall():
    from torch._decomp import meta_table
    from torch._subclasses.fake_impls import op_implementations_dict
    from torch._subclasses.fake_tensor import FakeTensorMode

    for table, saved in ((op_implementations_dict, _saved), (meta_table, _saved_meta)):
        for op, previous in list(saved.items()):
            if previous is None:
                table.pop(op, None)
            else:
                table[op] = previous
        saved.clear()
    if _state["used"]:
        cache = FakeTensorMode.cache  # keyed by (op, argument metadata): forget what our kernels computed
        for key in [k for k in cache if k.key and k.key[0] in KERNELS]:
            del cache[key]
        _state["used"] = False


@contextlib.contextmanager
def tracing_kernels():
    """Use fxtools' fake kernels (``KERNELS``) while the block runs."""
    with _lock:
        if _state["depth"] == 0:
            _install()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                _uninstall()
