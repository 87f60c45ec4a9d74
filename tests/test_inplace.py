"""In-place ops in user code: rewritten to functional code (checked against autograd in float64),
kept in place when they update inputs or buffers (visible to the caller, as in eager), or
rejected with an error naming the op and the user's line -- never a wrong gradient."""

import functools

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.capture.functionalize import functionalize, is_mutating
from fxtools.capture.trace import capture
from fxtools.errors import FxtoolsError
from fxtools.transforms.check import check_vjp, check_vjp_fd

D = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _mutations(f, *args):
    cap = capture(f, args)
    functionalize(cap.gm)
    return [n for n in cap.gm.graph.nodes if is_mutating(n)]


# --- in-place ops on intermediates -------------------------------------------------------------


def inplace_chain(x):
    y = x * 2
    y.add_(1)
    y.mul_(x)
    y += x.cos()
    y /= 3
    return y.sin()


def inplace_on_select_view(x):
    z = x * 2
    z[0].mul_(3)
    return z


def inplace_on_slice_view(x):
    z = x * 1.5 + x**2
    z[:, 1:3].mul_(x[:, :2])
    z[1:, ::2].sub_(1)
    return z


def inplace_on_transpose_view(x):
    z = x * x
    t = z.t()
    w = z[1]  # a view taken before the mutation must see it
    t[0].mul_(5)
    return z * w.sum(), t


def views_see_later_mutation(x):
    z = x * 2
    w = z[1]
    t = z.transpose(0, 1)
    r = z.view(-1)
    z.add_(x**2)
    r[3:5].mul_(4)
    return w, t, r.sum()


def setitem(x, v):
    out = torch.zeros(3, 4, dtype=x.dtype)
    out[:, 1] = v
    out[:, 2:] = x[:, 2:] ** 2
    out[0] = 7.0
    return out * x


def setitem_index_put(x, v):
    y = x.clone()
    y[x > 0.5] = 0.0
    y[torch.tensor([0, 2])] = v
    y[:, torch.tensor([1])] *= 3
    return y


def inplace_shape_ops(x):
    y = x.unsqueeze(0) * 1
    y.squeeze_(0)
    y.t_()
    y.unsqueeze_(1)
    y.mul_(2)
    return y


def inplace_activations(x):
    y = x * 3
    torch.relu_(y)
    z = x - 0.2
    F.relu(z, inplace=True)
    w = x.clone()
    w.clamp_(min=-0.5, max=0.5)
    u = x * 1
    F.leaky_relu(u, 0.1, inplace=True)
    return y, z, w, u


def copy_casts_and_broadcasts(x, v):
    buf = torch.empty(3, 4, dtype=torch.float32)
    buf.copy_(x)  # float64 -> float32
    b2 = torch.ones(3, 4, dtype=D)
    b2.copy_(v[:, None] if v.dim() == 1 else v)  # broadcast (3, 1) -> (3, 4)
    b3 = x * 1
    b3.fill_(2.0)
    b3[0].zero_()
    return buf.double() * b2 + b3


def masked_and_scatter(x):
    y = x * 1
    y.masked_fill_(x < 0, 0.5)
    y.index_add_(0, torch.tensor([0, 0, 2]), x)
    y.scatter_(1, torch.tensor([[0], [1], [2]]), x[:, :1] * 2)
    return y


def out_is_inplace_result(x):
    y = x.clone()
    y += x
    y *= 2
    return y, y[0]


CASES = [
    (inplace_chain, lambda: (_x(3, 4),)),
    (inplace_on_select_view, lambda: (_x(3, 4),)),
    (inplace_on_slice_view, lambda: (_x(3, 4),)),
    (inplace_on_transpose_view, lambda: (_x(3, 4),)),
    (views_see_later_mutation, lambda: (_x(3, 4),)),
    (setitem, lambda: (_x(3, 4), _x(3, seed=1))),
    (setitem_index_put, lambda: (_x(3, 4), _x(4, seed=1))),
    (inplace_shape_ops, lambda: (_x(3, 4),)),
    (inplace_activations, lambda: (_x(3, 4),)),
    (copy_casts_and_broadcasts, lambda: (_x(3, 4), _x(3, seed=1))),
    (masked_and_scatter, lambda: (_x(3, 4),)),
    (out_is_inplace_result, lambda: (_x(3, 4),)),
]


def multi_output_op_value(x):
    v, _ = x.max(1)
    v.mul_(2)
    return v


def view_of_view(x):
    z = x * 1
    z[1:][:, 0].mul_(x[1:, 1])
    return z


def diagonal_views(x):
    z = x * 1
    z.diagonal().add_(x[0])
    d = z.diagonal(1)
    z.diagonal(1).mul_(2)
    return z, d


def as_strided_view(x):
    z = x * 1
    z.as_strided((2, 2), (4, 1), 1).mul_(3)
    return z


def buffer_built_under_no_grad(x):
    mask = torch.ones(4, dtype=x.dtype)
    with torch.no_grad():
        mask[0] = 0
    return x * mask


def integer_intermediates_and_accumulate(x):
    idx = torch.arange(4)
    idx.add_(1)
    idx.remainder_(4)
    z = x * 1
    z.index_put_((idx,), x, accumulate=True)
    return z


def earlier_unfold_view_regenerated(x):
    z = x * 2
    u = z.unfold(0, 2, 2)
    z.add_(1)
    return u


def reshaped_and_permuted_views(x):
    z = x * 2
    z.view(2, 8)[1].mul_(x[0, :].repeat(2))
    p = z.permute(1, 0)
    p[0].sub_(3)
    z.unsqueeze(0)[0, 2].div_(2)
    return z, p


def two_views_of_the_same_row(x):
    y = x * 1
    a = y[0]
    b = y[0]
    a.mul_(2)
    b.add_(1)
    return a, b, y


def copy_into_float32_view(x):
    z = (x * 2).float()
    z[0] = x[1]
    return z.double()


CASES += [
    (f, lambda: (_x(4, 4),))
    for f in (
        multi_output_op_value,
        view_of_view,
        diagonal_views,
        as_strided_view,
        buffer_built_under_no_grad,
        integer_intermediates_and_accumulate,
        earlier_unfold_view_regenerated,
        reshaped_and_permuted_views,
        two_views_of_the_same_row,
        copy_into_float32_view,
    )
]


@pytest.mark.parametrize("f,make_args", [pytest.param(f, make, id=f.__name__) for f, make in CASES])
def test_inplace_on_intermediates_matches_autograd(f, make_args):
    args = make_args()
    assert not _mutations(f, *args), "in-place ops on intermediates must be rewritten"
    check_vjp(f, *args)


def multi_output_views(x):
    # eager autograd forbids these (views from split/unbind modified in place): check the values
    # against eager and the gradient against finite differences
    z = x * 1
    a, b = z.split([1, 3], 1)
    u = z.unbind(1)[2]
    a.mul_(2)
    u.add_(x[:, 0])
    c = z.chunk(2, 0)[1]
    c.pow_(2)
    return z, b


def test_multi_output_views():
    x = _x(3, 4)
    gm = fxtools.vjp(multi_output_views, x)
    out, _ = gm(x, (torch.ones(3, 4, dtype=D), torch.ones(3, 3, dtype=D)))
    want = multi_output_views(x)
    torch.testing.assert_close(out, want)
    check_vjp_fd(multi_output_views, x)


def test_generated_code_has_no_inplace_ops():
    gm = fxtools.vjp(setitem, _x(3, 4), _x(3, seed=1))
    assert not [n for n in gm.graph.nodes if is_mutating(n)]
    assert ".copy_(" not in gm.code and "mul_(" not in gm.code


def slice_select_diagonal_writes(x, w):
    h = x * 2
    h[:, 1:] = h[:, 1:] + w[1:]
    h[1:3, ::2] *= 3
    h[0] += w
    h.diagonal().mul_(2)
    h[-1] = w
    return (h * h.sin()).sum()


def test_slice_select_and_diagonal_writes_are_written_as_scatters_at_every_size():
    """``h[a:b] = v`` / ``h[i] = v`` / ``h.diagonal().mul_(k)`` stay ``slice_scatter`` /
    ``select_scatter`` / ``diagonal_scatter`` with their own rules: no ``where`` of a masked
    index from PyTorch's decomposition, whose test of the example's size also refused a dynamic
    row count (``n != 3``)."""
    from torch.export import Dim

    w = _x(3, seed=1)
    g = fxtools.grad(
        slice_select_diagonal_writes, _x(4, 3), w, argnums=(0, 1), dynamic_shapes={"x": {0: Dim("n", min=3)}, "w": None}
    )
    for rule in ("torch.slice_scatter(", "torch.select_scatter(", "torch.diagonal_scatter("):
        assert rule in g.code
    assert "_unsafe_masked_index" not in g.code and "9223372036854775807" not in g.code
    for rows in (3, 4, 7):
        x = _x(rows, 3, seed=rows)
        want = torch.func.grad(slice_select_diagonal_writes, argnums=(0, 1))(x, w)
        for got, ref in zip(g(x, w), want):
            torch.testing.assert_close(got, ref)


def updates_in_place(x, w, c):
    h = x * 1.0
    h.diagonal().mul_(w)
    h[:, 1:] += w[1:]
    h[0] *= 3
    return (h * c).sum()


def test_gradient_of_an_update_in_place_is_one_scatter_named_after_the_variable():
    """The gradient of ``h[i] op= v`` has two parts, outside the place (the incoming gradient) and
    inside it (through ``op``): written as one ``scatter(grad, inside)``, or nothing at all where
    the part inside is the incoming gradient itself (``+=``), not a scatter of zeros plus a scatter
    into zeros. The value written is named after the variable (``h_mul``). Exact in float64 (a
    gradient of ``-0.0`` may come out ``+0.0`` or stay: eager's own backward adds zeros there)."""
    from torch.export import Dim

    n = Dim("n", min=3)  # h[:, 1:] of size 1 would broadcast w[1:]: a decision on the size
    x, w = _x(3, 3), _x(3, seed=1)
    g = fxtools.grad(
        updates_in_place, x, w, torch.ones(3, 3, dtype=D), argnums=(0, 1), dynamic_shapes=({0: n, 1: n}, {0: n}, {0: n, 1: n})
    )
    code = g.code
    assert "new_zeros" not in code and "zeros_like" not in code, code
    assert "mul_tensor" not in code and "add_tensor" not in code, code
    assert "grad_h_mul" in code or "h_mul" in code, code
    for size in (3, 4, 6):
        x, w, c = _x(size, size, seed=size), _x(size, seed=1), _x(size, size, seed=2)
        want = torch.func.grad(updates_in_place, argnums=(0, 1))(x, w, c)
        for a, b in zip(g(x, w, c), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def writes_everywhere(x, w):
    h = x.sin() * 1.0
    h.diagonal().mul_(w)
    h[:, 1:] += w[1:]
    h[0] *= 3
    h[1:, ::2] = h[:-1, ::2] * 0.5
    h[..., -1].zero_()
    return (h * h.cos()).sum()


def test_updates_in_place_through_every_transform():
    """Writes into slices (with a step, through two views), selects and diagonals, each reading what
    it overwrites or a neighbour: grad, hessian, jvp, split, compile and vmap of grad agree with
    torch.func in float64, and no value is named after an op of the functional rewrite."""
    x, w = _x(4, 4), _x(4, seed=1)
    want = torch.func.grad(writes_everywhere, argnums=(0, 1))(x, w)
    close = functools.partial(torch.testing.assert_close, rtol=1e-10, atol=1e-12)
    close(fxtools.grad(writes_everywhere, x, w, argnums=(0, 1))(x, w), want)
    close(fxtools.hessian(writes_everywhere, x, w)(x, w), torch.func.hessian(writes_everywhere)(x, w))
    v = (_x(4, 4, seed=2), _x(4, seed=3))
    close(fxtools.jvp(writes_everywhere, x, w)(x, w, *v), torch.func.jvp(writes_everywhere, (x, w), v))
    sp = fxtools.split(writes_everywhere, x, w)
    _, saved = sp.forward(*sp.flatten(x, w))
    close(tuple(sp.backward(*saved, torch.ones((), dtype=D))), want)
    for op_name in ("slice_scatter_default", "select_scatter_default", "mul_tensor", "add_tensor"):
        assert op_name not in sp.backward.code, sp.backward.code
    leaves = x.clone().requires_grad_(), w.clone().requires_grad_()
    fxtools.compile(writes_everywhere)(*leaves).backward()
    close((leaves[0].grad, leaves[1].grad), want)
    xs = _x(3, 4, 4, seed=4)
    per_sample = fxtools.vmap(fxtools.grad(writes_everywhere, x, w), xs, w, in_dims=(0, None))(xs, w)
    close(per_sample, torch.func.vmap(torch.func.grad(writes_everywhere), in_dims=(0, None))(xs, w))


def test_write_of_a_batched_value_under_vmap_with_a_dynamic_batch():
    """``v[:, 1:] = u.mean()`` under vmap with a dynamic batch size: the write's broadcast of the
    per-sample mean has the symbolic batch size, written as a node (was refused: "a constant ...
    is 5 (a torch.SymInt)")."""
    from torch.export import Dim

    def f(s):
        v = torch.square(s).sin()
        v[:, 1:] = s.mean()
        return v * s

    x = _x(5, 2, 3)
    gm = fxtools.vmap(f, x, dynamic_shapes=({0: Dim("batch")},))
    for n in (1, 3, 5):
        torch.testing.assert_close(gm(x[:n]), torch.func.vmap(f)(x[:n]))


# --- mutation of inputs and buffers: stays in place, visible to the caller --------------------


def bump_counter(x, counter):
    counter.add_(1)
    return x * 2


def test_mutation_of_integer_input_is_visible_once_per_call():
    x, counter = _x(3), torch.zeros((), dtype=torch.int64)
    gm = fxtools.vjp(bump_counter, x, counter)
    assert counter.item() == 0  # building the VJP does not run the user's mutation
    out, (gx, gc) = gm(x, counter, torch.ones(3, dtype=D))
    assert counter.item() == 1
    torch.testing.assert_close(gx, torch.full((3,), 2.0, dtype=D))
    assert gc is None
    gm(x, counter, torch.ones(3, dtype=D))
    assert counter.item() == 2


def ema_update(x, buf):
    buf.mul_(0.5).add_(x.detach())
    return (x * buf).sum()


def test_mutation_of_non_differentiated_float_input():
    x, buf = _x(3), _x(3, seed=1)
    expect_buf = buf * 0.5 + x
    gm = fxtools.grad(ema_update, x, buf.clone(), argnums=0)
    b = buf.clone()
    gx = gm(x, b)
    torch.testing.assert_close(b, expect_buf)  # caller sees the update, applied once
    torch.testing.assert_close(gx, expect_buf)  # d/dx sum(x * buf_new) = buf_new (buf_new detached)


def read_then_update(x, buf):
    y = (x * buf).sum()  # the backward needs buf as it was here
    buf.add_(10)
    return y


def test_backward_sees_values_from_before_a_later_input_mutation():
    x, buf = _x(3), _x(3, seed=1)
    b = buf.clone()
    gx = fxtools.grad(read_then_update, x, b, argnums=0)(x, b)
    torch.testing.assert_close(gx, buf)
    torch.testing.assert_close(b, buf + 10)


def test_batchnorm_train_updates_running_stats_once_per_call():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).double()
    ref = torch.nn.BatchNorm1d(4).double()
    ref.load_state_dict(bn.state_dict())
    x, ct = _x(5, 4), _x(5, 4, seed=1)
    gm = fxtools.vjp(bn, x)
    assert bn.num_batches_tracked.item() == 0
    torch.testing.assert_close(bn.running_mean, torch.zeros(4, dtype=D))
    for _ in range(2):
        out, (gx,) = gm(x, ct)
        xr = x.clone().requires_grad_(True)
        want = ref(xr)
        want.backward(ct)
        torch.testing.assert_close(out, want.detach())
        torch.testing.assert_close(gx, xr.grad)
        assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item()
        torch.testing.assert_close(bn.running_mean, ref.running_mean)
        torch.testing.assert_close(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == 2


# --- clear errors instead of wrong gradients ---------------------------------------------------


def mutate_differentiated_input(x):
    x.mul_(2)
    return x.sin()


def mutate_under_no_grad(x):
    z = x * 2
    with torch.no_grad():
        z.add_(1)
    return z * 3


def mutate_through_detach(x):
    z = x * 2
    z.detach().zero_()
    return z * 3


def write_input_from_differentiated_value(x, buf):
    buf.copy_(x * 2)
    return buf.sum()


@pytest.mark.parametrize(
    "f,args,op",
    [
        (mutate_differentiated_input, lambda: (_x(3),), "mul_"),
        (mutate_under_no_grad, lambda: (_x(3),), "add_"),
        (mutate_through_detach, lambda: (_x(3),), "zero_"),
        (write_input_from_differentiated_value, lambda: (_x(3), _x(3)), "copy_"),
    ],
    ids=["differentiated_input", "no_grad", "detach", "input_from_differentiated"],
)
def test_unsupported_inplace_raises_naming_op_and_line(f, args, op):
    with pytest.raises(FxtoolsError) as info:
        fxtools.vjp(f, *args())
    msg = str(info.value)
    assert op in msg
    assert "test_inplace.py" in msg


def test_input_written_from_differentiated_value_ok_when_not_differentiated():
    # the same function is fine when neither x nor buf is differentiated through the write
    x, buf = _x(3), _x(3, seed=1)
    gm = fxtools.grad(lambda x, b: (x * 1).sum() + b.sum(), x, buf, argnums=0)
    torch.testing.assert_close(gm(x, buf), torch.ones(3, dtype=D))


def out_variant_on_intermediate(x):
    buf = torch.empty(3, dtype=x.dtype)
    torch.add(x, 1, out=buf)
    return buf * 2


def no_functional_form(x):
    y = x[:, None] * x[None, :]
    y.fill_diagonal_(0.0)
    return y


@pytest.mark.parametrize(
    "f,op",
    [(out_variant_on_intermediate, "add.out"), (no_functional_form, "fill_diagonal_")],
    ids=["out_variant", "fill_diagonal_"],
)
def test_inplace_without_rewrite_raises(f, op):
    with pytest.raises(FxtoolsError) as info:
        fxtools.vjp(f, _x(3))
    assert op in str(info.value) and "test_inplace.py" in str(info.value)


def test_mutation_inside_a_decomposition_is_not_left_in_the_graph():
    # torch.stft's decomposition (applied by decompose.expand after functionalize) uses
    # squeeze_/transpose_; see the report: expand must functionalize what it inlines
    gm = fxtools.vjp(lambda x: torch.stft(x, 10, return_complex=False), _x(100))
    assert not [n for n in gm.graph.nodes if is_mutating(n)]


def read_int_buffer_around_mutation(x, c):
    s1 = c.sum()
    c[0].add_(1)
    s2 = c.sum()
    return (x * (s2 - s1)).sum()


def test_reads_around_kept_mutation_are_not_merged():
    x, c = _x(3), torch.zeros(3, dtype=torch.int64)
    gx = fxtools.grad(read_int_buffer_around_mutation, x, c.clone(), argnums=0)(x, c.clone())
    torch.testing.assert_close(gx, torch.ones(3, dtype=D))


def write_repeated_rows(x, w, idx):
    h = x * 3
    h[idx] += w * x[1]  # idx repeats a row: the value written there twice is kept once
    return h.sin()


@pytest.mark.parametrize("idx", [[0, 2, 0], [1, 1, 1, 3], [2, 0]], ids=str)
def test_forward_mode_and_hessian_of_a_write_to_repeated_indices(idx):
    """``h[idx] += v`` with ``idx`` repeating an index: PyTorch's gradient gives each repeated value
    the gradient of the one element it was written to (its convention, which ``grad`` follows), so
    transposing that VJP counted the element's tangent twice: jvp, jacfwd and hessian were silently
    wrong. Forward mode and the second pass of ``hessian`` use the adjoint (the "adjoint" rule set):
    the JVP against torch.func.jvp and central finite differences (the mathematics), the Hessian
    against torch.func.hessian (jacfwd of jacrev: the derivative of PyTorch's gradient)."""
    x, w, i = _x(4, 3), _x(3, seed=1), torch.tensor(idx)
    tx, tw = _x(4, 3, seed=2), _x(3, seed=3)
    out, tangent = fxtools.jvp(write_repeated_rows, x, w, i, argnums=(0, 1))(x, w, i, tx, tw)
    _, want = torch.func.jvp(lambda a, b: write_repeated_rows(a, b, i), (x, w), (tx, tw))
    torch.testing.assert_close(tangent, want)
    eps = 1e-6
    fd = (write_repeated_rows(x + eps * tx, w + eps * tw, i) - write_repeated_rows(x - eps * tx, w - eps * tw, i)) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, write_repeated_rows(x, w, i))

    def loss(a, b, k):
        return write_repeated_rows(a, b, k).pow(2).sum()

    g = fxtools.grad(loss, x, w, i, argnums=(0, 1))(x, w, i)
    torch.testing.assert_close(g, torch.func.grad(loss, argnums=(0, 1))(x, w, i))  # PyTorch's convention
    h = fxtools.hessian(loss, x, w, i, argnums=(0, 1))(x, w, i)
    torch.testing.assert_close(h, torch.func.hessian(loss, argnums=(0, 1))(x, w, i))
