"""VJP rules of shape and view ops, indexing, and joining/splitting tensors.

Views are undone by their inverse view, joins by splits and splits by joins; reads
(slicing, gather, indexing) are transposed into the matching write into zeros (padding,
``scatter_add``, ``index_add``, ``index_put(accumulate=True)``), emitted only when needed.

These maps are linear with real coefficients and read only their arguments' shapes, so their
transposes already are autograd's convention for complex tensors (``complex="convention"``:
nothing to conjugate); the two that multiply by argument values (``index_add``'s ``alpha``,
``scatter_reduce``'s products) are holomorphic rules.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols, statically_known_true

from ..registry import vjp_rule as _vjp_rule
from .common import is_tensor, known_equal, same_shape, unbroadcast

aten = torch.ops.aten


def vjp_rule(op, complex="convention", rule_set=None):
    return _vjp_rule(op, complex=complex, rule_set=rule_set)


def _diff(t) -> bool:
    return is_tensor(t) and (t.is_floating_point() or t.is_complex())


def _reshape(g, shape):
    """``g`` with ``shape``: nothing when it has it, else a reshape.

    Not ``view``: generated code may be called with differently strided tensors than the
    example, and ``reshape`` is a view whenever one is possible anyway.
    """
    if same_shape(g.shape, shape):
        return g
    return g.reshape(shape)


def _pad_dim(g, dim, before, after):
    """Zero-pad ``g`` along ``dim`` (the transpose of taking a contiguous slice)."""
    if _known_zero(before) and _known_zero(after):
        return g
    return torch.constant_pad_nd(g, [0, 0] * (g.dim() - 1 - dim) + [before, after])


def _known_zero(n) -> bool:
    """``n == 0`` whatever the data (a size computed from a data-dependent one is never guessed)."""
    return statically_known_true(n == 0)


def _zeros(x):
    return x.new_zeros(x.shape)


def _join(pieces, shapes, dim, like):
    """Concatenate cotangent pieces along ``dim``: zero padding around a contiguous run of present
    pieces, else one block of zeros per run of missing ones."""
    present = [k for k, g in enumerate(pieces) if g is not None]
    if present == list(range(present[0], present[-1] + 1)):
        run = [pieces[k] for k in present]
        g = run[0] if len(run) == 1 else torch.cat(run, dim)
        before = sum(s[dim] for s in shapes[: present[0]])
        return _pad_dim(g, dim, before, sum(s[dim] for s in shapes[present[-1] + 1 :]))
    parts, missing = [], []
    for g, shape in zip(pieces, shapes):
        if g is None:
            missing.append(shape)
            continue
        if missing:
            parts.append(_missing_block(like, missing, dim))
            missing = []
        parts.append(g)
    if missing:
        parts.append(_missing_block(like, missing, dim))
    return torch.cat(parts, dim)


def _missing_block(like, shapes, dim):
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    return like.new_zeros(shape)


# ---- reshapes ------------------------------------------------------------------------------


@vjp_rule(aten.view.default)
def view(ct, out, x, shape):
    return _reshape(ct, x.shape)


@vjp_rule(aten.reshape)
def reshape(ct, out, x, shape):
    return _reshape(ct, x.shape)


@vjp_rule(aten._unsafe_view)
def _unsafe_view(ct, out, x, shape):
    return _reshape(ct, x.shape)


@vjp_rule(aten.flatten.using_ints)
def flatten(ct, out, x, start_dim=0, end_dim=-1):
    return _reshape(ct, x.shape)


@vjp_rule(aten.unflatten.int)
def unflatten(ct, out, x, dim, sizes):
    return _reshape(ct, x.shape)


@vjp_rule(aten.squeeze.dim)
def squeeze_dim(ct, out, x, dim):
    return ct if ct.dim() == x.dim() else ct.unsqueeze(dim)


@vjp_rule(aten.squeeze)
def squeeze(ct, out, x, dims=None):
    return _reshape(ct, x.shape)


@vjp_rule(aten.unsqueeze)
def unsqueeze(ct, out, x, dim):
    return ct.squeeze(dim)


# ---- permutations --------------------------------------------------------------------------


@vjp_rule(aten.permute)
def permute(ct, out, x, dims):
    n = x.dim()
    inverse = [0] * n
    for i, d in enumerate(dims):
        inverse[d % n] = i
    return ct if inverse == list(range(n)) else ct.permute(inverse)


@vjp_rule(aten.transpose.int)
def transpose(ct, out, x, dim0, dim1):
    n = max(x.dim(), 1)
    return ct if dim0 % n == dim1 % n else ct.transpose(dim0, dim1)


@vjp_rule(aten.t)
def t(ct, out, x):
    return ct.t() if x.dim() == 2 else ct


@vjp_rule(aten.mT)
def mT(ct, out, x):
    return ct.mT


@vjp_rule(aten.adjoint)
def adjoint(ct, out, x):
    return ct.adjoint()


@vjp_rule(aten.movedim)
def movedim(ct, out, x, source, destination):
    return ct if source == destination else ct.movedim(destination, source)


# ---- broadcasting --------------------------------------------------------------------------


@vjp_rule(aten.expand)
def expand(ct, out, x, size, implicit=False):
    return unbroadcast(ct, x)


@vjp_rule(aten.expand_as)
def expand_as(ct, out, x, other):
    return unbroadcast(ct, x), None


@vjp_rule(aten.broadcast_to)
def broadcast_to(ct, out, x, size):
    return unbroadcast(ct, x)


# ---- joining and splitting -----------------------------------------------------------------


def _skipped_by_cat(t, out):
    return t.dim() == 1 and t.shape[0] == 0 and out.dim() != 1


@vjp_rule(aten.cat)
def cat(ct, out, tensors, dim=0):
    dim %= out.dim()
    kept = [t for t in tensors if not _skipped_by_cat(t, out)]
    pieces = iter(torch.split(ct, [t.shape[dim] for t in kept], dim) if len(kept) > 1 else [ct])
    return [None if _skipped_by_cat(t, out) else next(pieces) for t in tensors], None


@vjp_rule(aten.stack)
def stack(ct, out, tensors, dim=0):
    return list(torch.unbind(ct, dim)), None


def _split_back(ct, out, x, dim):
    dim %= x.dim()
    return _join(ct, [o.shape for o in out], dim, next(g for g in ct if g is not None))


@vjp_rule(aten.split)
def split(ct, out, x, split_size, dim=0):
    return _split_back(ct, out, x, dim)


@vjp_rule(aten.split_with_sizes)
def split_with_sizes(ct, out, x, split_sizes, dim=0):
    return _split_back(ct, out, x, dim)


@vjp_rule(aten.chunk)
def chunk(ct, out, x, chunks, dim=0):
    return _split_back(ct, out, x, dim)


@vjp_rule(aten.unbind.int)
def unbind(ct, out, x, dim=0):
    dim %= x.dim()
    pieces = [None if g is None else g.unsqueeze(dim) for g in ct]
    present = [g for g in ct if g is not None]
    if len(present) == len(ct):
        return torch.stack(present, dim)
    return _join(pieces, [(*o.shape[:dim], 1, *o.shape[dim:]) for o in out], dim, present[0])


# ---- slicing ---------------------------------------------------------------------------------


@vjp_rule(aten.narrow.default)
def narrow(ct, out, x, dim, start, length):
    dim %= x.dim()
    start = start + x.shape[dim] if start < 0 else start
    return _pad_dim(ct, dim, start, x.shape[dim] - start - length)


@vjp_rule(aten.slice.Tensor)
def slice_(ct, out, x, dim=0, start=None, end=None, step=1):
    dim %= x.dim()
    size = x.shape[dim]
    if any(isinstance(n, torch.SymInt) for n in (start, end, size)):  # symbolic bounds or size
        if step == 1 and not any(has_free_unbacked_symbols(n) for n in (start, end) if isinstance(n, torch.SymInt)):
            # sizes marked dynamic (x[n : 2 * n], x[1:] of a dynamic batch): padding holds at every
            # size, where slice_scatter's decomposition decides on the example whether the slice reaches the end
            begin = _slice_begin(start, size)
            return _pad_dim(ct, dim, begin, size - begin - ct.shape[dim])
        return torch.slice_scatter(_zeros(x), ct, dim, start, end, step)  # bounds read from a tensor
    picked = range(x.shape[dim])[slice(start, end, step)]
    if step == 1 and len(picked):
        return _pad_dim(ct, dim, picked.start, x.shape[dim] - picked.stop)
    stop = None if picked.stop >= x.shape[dim] else picked.stop  # to the end: no bound written
    return torch.slice_scatter(_zeros(x), ct, dim, picked.start, stop, step)


# The writes functionalisation makes of ``x[a:b] = v``, ``x[i] = v`` and ``x.diagonal().copy_(v)``:
# the written part of the cotangent goes to the value, the rest to the tensor written into.


@vjp_rule(aten.slice_scatter)
def slice_scatter(ct, out, x, src, dim=0, start=None, end=None, step=1):
    g_src = aten.slice.Tensor(ct, dim, start, end, step)
    return torch.slice_scatter(ct, _zeros(src), dim, start, end, step), g_src


@vjp_rule(aten.select_scatter)
def select_scatter(ct, out, x, src, dim, index):
    return torch.select_scatter(ct, _zeros(src), dim, index), ct.select(dim, index)


@vjp_rule(aten.diagonal_scatter)
def diagonal_scatter(ct, out, x, src, offset=0, dim1=0, dim2=1):
    return torch.diagonal_scatter(ct, _zeros(src), offset, dim1, dim2), ct.diagonal(offset, dim1, dim2)


def _slice_begin(start, size):
    """Where ``x[start:]`` begins along a dimension of ``size`` (Python's clamping to [0, size]),
    decided from the sizes' declared ranges, not the example."""
    if start is None:
        return 0
    begin = start + size if start < 0 else start
    begin = begin if statically_known_true(begin >= 0) else torch.sym_max(begin, 0)
    return begin if statically_known_true(begin <= size) else torch.sym_min(begin, size)


@vjp_rule(aten.select.int)
def select(ct, out, x, dim, index):
    dim %= x.dim()
    if index < 0:
        index += x.shape[dim]  # not %: with a data-dependent size, -1 then stays "size - 1"
    return _pad_dim(ct.unsqueeze(dim), dim, index, x.shape[dim] - index - 1)


# ---- indexing --------------------------------------------------------------------------------


def _one_index(indices):
    """``(dim, index)`` when ``indices`` holds a single integer index tensor (and Nones), else None."""
    tensors = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(tensors) == 1 and tensors[0][1].dtype not in (torch.bool, torch.uint8):
        return tensors[0]
    return None


@vjp_rule(aten.index.Tensor)
def index(ct, out, x, indices):
    if all(i is not None for i in indices):
        return torch.index_put(_zeros(x), indices, ct, accumulate=True), None
    one = _one_index(indices)
    if one is not None:  # x[:, i]: index_add, which needs the indices made non-negative
        d, i = one
        g = _reshape(ct, [*x.shape[:d], i.numel(), *x.shape[d + 1 :]])
        i = i.reshape(-1)
        # not %: an out-of-range index must still fail in index_add, as in eager's forward
        return _zeros(x).index_add(d, torch.where(i < 0, i + x.shape[d], i), g), None
    return aten.index_put.default(_zeros(x), indices, ct, True), None


def _outside(ct, indices, accumulate):
    """``ct`` where ``index_put`` keeps its input: all of it when it adds, else but where it writes."""
    one = _one_index(indices)
    if accumulate:
        return ct
    if one is not None and one[1].dim() == 1:
        return ct.index_fill(one[0], one[1], 0)
    return aten.index_put.default(ct, indices, ct.new_zeros(()))


@vjp_rule(aten.index_put)
def index_put(ct, out, x, indices, values, accumulate=False):
    picked = aten.index.Tensor(ct, indices)  # ct[indices]: a 0-dim index is not read as a number
    return _outside(ct, indices, accumulate), None, _sum_to(picked, values.shape)


@vjp_rule(aten.index_put, rule_set="adjoint")
def index_put_adjoint(ct, out, x, indices, values, accumulate=False):
    """The adjoint of ``index_put``: where indices repeat, only the value the forward keeps there
    (the one written last) has a gradient. PyTorch's gradient, ``index_put``'s above, gives one to
    every value written to the element. Forward mode transposes this rule (``transforms/tangents.py``):
    the JVP of ``h[i] += v`` with ``i = [0, 2, 0]`` is then the forward's own, as torch.func.jvp's."""
    if accumulate or all(i is None or i.dtype in (torch.bool, torch.uint8) for i in indices):
        return index_put(ct, out, x, indices, values, accumulate)  # no index repeats
    picked = aten.index.Tensor(ct, indices)
    order = torch.arange(picked.numel(), device=ct.device).view(picked.shape)
    written = aten.index_put.default(torch.full_like(x, -1, dtype=torch.long), indices, order)
    kept = aten.index.Tensor(written, indices) == order  # the writes that won
    return _outside(ct, indices, accumulate), None, _sum_to(torch.where(kept, picked, 0), values.shape)


def _sum_to(g, shape):
    """``unbroadcast`` for a ``g`` of data-dependent size (indexed by a mask): sizes are not compared."""
    lead = g.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, n in enumerate(shape) if known_equal(n, 1) and not known_equal(g.shape[lead + i], 1))]
    if not dims:
        return g
    g = g.sum(dims, keepdim=True)
    return g.view(shape) if lead else g


@vjp_rule(aten.index_select)
def index_select(ct, out, x, dim, index):
    return _zeros(x).index_add(dim, index.reshape(-1), ct) if x.dim() else ct.reshape(()), None, None


@vjp_rule(aten.index_add, complex="holomorphic")
def index_add(ct, out, x, dim, index, source, alpha=1):
    g = ct.index_select(dim, index) if ct.dim() else ct
    g = _reshape(g if alpha == 1 else g * alpha, source.shape)
    return ct, None, None, g


@vjp_rule(aten.index_copy)
def index_copy(ct, out, x, dim, index, source):
    g = ct.index_select(dim, index) if ct.dim() else ct
    return ct.index_fill(dim, index, 0), None, None, _reshape(g, source.shape)


@vjp_rule(aten.index_fill)
def index_fill(ct, out, x, dim, index, value):
    g = ct.index_fill(dim, index, 0)
    return g, None, None, (ct - g).sum() if _diff(value) else None


@vjp_rule(aten.gather)
def gather(ct, out, x, dim, index, sparse_grad=False):
    return _zeros(x).scatter_add(dim, index, ct), None, None


@vjp_rule(aten.scatter.src)
def scatter_src(ct, out, x, dim, index, src):
    return ct.scatter(dim, index, 0), None, None, ct.gather(dim, index)


@vjp_rule(aten.scatter.src, rule_set="adjoint")
def scatter_src_adjoint(ct, out, x, dim, index, src):
    """The adjoint of ``scatter``: where ``index`` repeats an element, only the write that won has
    a gradient (see ``index_put_adjoint``)."""
    order = torch.arange(index.numel(), device=index.device).view(index.shape)
    kept = torch.full_like(x, -1, dtype=torch.long).scatter(dim, index, order).gather(dim, index) == order
    return ct.scatter(dim, index, 0), None, None, torch.where(kept, ct.gather(dim, index), 0)


@vjp_rule(aten.scatter.value)
def scatter_value(ct, out, x, dim, index, value):
    return ct.scatter(dim, index, 0), None, None, None


@vjp_rule(aten.scatter_add)
def scatter_add(ct, out, x, dim, index, src):
    return ct, None, None, ct.gather(dim, index)


@vjp_rule(aten.scatter_reduce.two, complex="holomorphic")
def scatter_reduce(ct, out, x, dim, index, src, reduce, include_self=True):
    if reduce == "sum":
        g = ct if include_self else ct.scatter(dim, index, 0)
        return g, None, None, ct.gather(dim, index)
    if reduce == "mean":
        count = (torch.ones_like(x) if include_self else _zeros(x)).scatter_add(dim, index, torch.ones_like(src))
        g = ct / count.clamp(min=1)
        return (g if include_self else g.scatter(dim, index, 0)), None, None, g.gather(dim, index)
    if reduce in ("amax", "amin"):
        self_hit = x == out
        if not include_self:
            self_hit = self_hit.scatter(dim, index, False)
        src_hit = src == out.gather(dim, index)
        g = ct / self_hit.to(ct.dtype).scatter_add(dim, index, src_hit.to(ct.dtype))
        return g * self_hit, None, None, g.gather(dim, index) * src_hit
    if reduce == "prod":
        return _scatter_prod(ct, out, x, dim, index, src, include_self)
    raise NotImplementedError(f"no VJP for scatter_reduce with reduce={reduce!r}")


def _scatter_prod(ct, out, x, dim, index, src, include_self):
    # the product of the other factors, recomputed without the factor itself where it is zero
    base = x if include_self else x.scatter(dim, index, 1.0)
    nonzero_src = torch.where(src == 0, torch.ones_like(src), src)
    nonzero_base = torch.where(base == 0, torch.ones_like(base), base)
    zeros = (base == 0).to(ct.dtype).scatter_add(dim, index, (src == 0).to(ct.dtype))
    prod_nonzero = nonzero_base.scatter_reduce(dim, index, nonzero_src, "prod")
    g_x = torch.where(zeros == 0, ct * out / nonzero_base, torch.where((zeros == 1) & (base == 0), ct * prod_nonzero, 0))
    zeros_at, prod_at, out_at, ct_at = (t.gather(dim, index) for t in (zeros, prod_nonzero, out, ct))
    g_src = torch.where(
        zeros_at == 0, ct_at * out_at / nonzero_src, torch.where((zeros_at == 1) & (src == 0), ct_at * prod_at, 0)
    )
    if not include_self:
        g_x = g_x.scatter(dim, index, 0)
    return g_x, None, None, g_src


@vjp_rule(aten.masked_fill.Scalar)
def masked_fill_scalar(ct, out, x, mask, value):
    return unbroadcast(ct.masked_fill(mask, 0), x), None, None


@vjp_rule(aten.masked_fill.Tensor)
def masked_fill_tensor(ct, out, x, mask, value):
    g_value = torch.where(mask, ct, 0).sum() if _diff(value) else None
    return unbroadcast(ct.masked_fill(mask, 0), x), None, unbroadcast(g_value, value)


# ---- diagonals and triangles ------------------------------------------------------------------


@vjp_rule(aten.diagonal)
def diagonal(ct, out, x, offset=0, dim1=0, dim2=1):
    return torch.diagonal_scatter(_zeros(x), ct, offset, dim1, dim2)


@vjp_rule(aten.diag)
def diag(ct, out, x, diagonal=0):
    if x.dim() == 1:
        return ct.diagonal(diagonal)
    if x.shape[0] == x.shape[1]:
        return torch.diag(ct, diagonal)
    return torch.diagonal_scatter(_zeros(x), ct, diagonal)


@vjp_rule(aten.diag_embed)
def diag_embed(ct, out, x, offset=0, dim1=-2, dim2=-1):
    return ct.diagonal(offset, dim1, dim2)


@vjp_rule(aten.tril)
def tril(ct, out, x, diagonal=0):
    return ct.tril(diagonal)


@vjp_rule(aten.triu)
def triu(ct, out, x, diagonal=0):
    return ct.triu(diagonal)


# ---- reorderings and repetitions -------------------------------------------------------------


@vjp_rule(aten.flip)
def flip(ct, out, x, dims):
    return ct.flip(dims) if len(dims) else ct


@vjp_rule(aten.roll)
def roll(ct, out, x, shifts, dims=()):
    return ct.roll([-s for s in shifts], dims)


@vjp_rule(aten.rot90)
def rot90(ct, out, x, k=1, dims=(0, 1)):
    return ct.rot90(-k, dims) if k % 4 else ct


@vjp_rule(aten.repeat)
def repeat(ct, out, x, repeats):
    lead = len(repeats) - x.dim()
    shape, dims = list(repeats[:lead]), list(range(lead))
    for r, n in zip(repeats[lead:], x.shape):
        if r != 1:
            dims.append(len(shape))
            shape.append(r)
        shape.append(n)
    return _reshape(_reshape(ct, shape).sum(dims), x.shape) if dims else ct


@vjp_rule(aten.repeat_interleave.self_int)
def repeat_interleave(ct, out, x, repeats, dim=None, output_size=None):
    if repeats == 1:
        return _reshape(ct, x.shape)
    if dim is None:
        return _reshape(ct.view(x.numel(), repeats).sum(1), x.shape)
    dim %= x.dim()
    return ct.unflatten(dim, (x.shape[dim], repeats)).sum(dim + 1)


@vjp_rule(aten.repeat_interleave.self_Tensor)
def repeat_interleave_tensor(ct, out, x, repeats, dim=None, output_size=None):
    flat = dim is None
    dim = 0 if flat else dim % x.dim()
    n = x.numel() if flat else x.shape[dim]
    segments = torch.arange(n, device=x.device).repeat_interleave(repeats, output_size=ct.shape[dim])
    g = (x.new_zeros(n) if flat else _zeros(x)).index_add(dim, segments, ct)
    return _reshape(g, x.shape), None


# ---- padding ---------------------------------------------------------------------------------


def _crop(ct, pad):
    """The transpose of constant padding by ``pad`` (last dim first, as in ``F.pad``)."""
    if any(p < 0 for p in pad):
        return torch.constant_pad_nd(ct, [-p for p in pad])
    for i in range(len(pad) // 2):
        before, after = pad[2 * i], pad[2 * i + 1]
        if before or after:
            d = ct.dim() - 1 - i
            ct = ct.narrow(d, before, ct.shape[d] - before - after)
    return ct


def _circular_back(ct, pad):
    for i in range(len(pad) // 2):
        before, after = pad[2 * i], pad[2 * i + 1]
        d = ct.dim() - 1 - i
        n = ct.shape[d] - before - after
        g = ct.narrow(d, before, n)
        if before:
            g = g + _pad_dim(ct.narrow(d, 0, before), d, n - before, 0)
        if after:
            g = g + _pad_dim(ct.narrow(d, before + n, after), d, 0, n - after)
        ct = g
    return ct


@vjp_rule(aten.constant_pad_nd)
def constant_pad_nd(ct, out, x, pad, value=0):
    return _crop(ct, pad)


_PAD_BACKWARD = {
    "reflect": (aten.reflection_pad1d_backward, aten.reflection_pad2d_backward, aten.reflection_pad3d_backward),
    "replicate": (aten.replication_pad1d_backward, aten.replication_pad2d_backward, aten.replication_pad3d_backward),
}


@vjp_rule(aten.pad)
def pad(ct, out, x, pad, mode="constant", value=None):
    if mode == "constant":
        return _crop(ct, pad)
    if mode != "circular":
        return _PAD_BACKWARD[mode][len(pad) // 2 - 1](ct, x, pad)
    if any(p < 0 for p in pad):  # the same as cropping first, then padding by the positive amounts
        crop = [min(p, 0) for p in pad]
        return _crop(_circular_back(ct, [max(p, 0) for p in pad]), crop)
    return _circular_back(ct, pad)


@vjp_rule(aten.unfold)
def unfold(ct, out, x, dimension, size, step):
    if x.dim() == 0:
        return ct.reshape(())
    dimension %= x.dim()
    if step == size:
        g = ct.movedim(-1, dimension + 1).flatten(dimension, dimension + 1)
        return _pad_dim(g, dimension, 0, x.shape[dimension] - g.shape[dimension])
    return aten.unfold_backward(ct, x.shape, dimension, size, step)


# ---- complex tensors as pairs of real ones ----------------------------------------------------


@vjp_rule(aten.view_as_real)
def view_as_real(ct, out, x):
    """The real and imaginary parts' cotangents, as one complex cotangent (autograd's convention)."""
    return torch.view_as_complex(ct.contiguous())


@vjp_rule(aten.view_as_complex)
def view_as_complex(ct, out, x):
    return torch.view_as_real(ct.resolve_conj())


@vjp_rule(aten.hstack)
def hstack(ct, out, tensors):
    dim = 0 if tensors[0].dim() <= 1 else 1
    sizes = [t.shape[dim] if t.dim() > dim else 1 for t in tensors]
    pieces = torch.split(ct, sizes, dim) if len(tensors) > 1 else [ct]
    return ([_reshape(g, t.shape) for g, t in zip(pieces, tensors)],)


@vjp_rule(aten.vstack)
def vstack(ct, out, tensors):
    sizes = [t.shape[0] if t.dim() > 1 else 1 for t in tensors]
    pieces = torch.split(ct, sizes, 0) if len(tensors) > 1 else [ct]
    return ([_reshape(g, t.shape) for g, t in zip(pieces, tensors)],)
