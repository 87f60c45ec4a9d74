"""Issue 32: programs eager PyTorch runs, checked against torch.func / autograd in float64.

Grad-mode contexts around the build and inside the function, inference mode, views under vmap
of jvp with the batch dimension anywhere, buffers updated in place several times, names that
collide with fxtools' own, keyword arguments, and the clear refusals of what cannot work."""

import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import fxtools
from fxtools.errors import FxtoolsError

D = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _close(got, want):
    got, want = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# --- grad-mode contexts around the build, the call and inside the function ----------------------


def own_no_grad(x):
    with torch.no_grad():
        shift = x**2
    return (x**2 - shift).sin().sum()


def enable_inside_no_grad(x):
    with torch.no_grad():
        with torch.enable_grad():
            y = x.sin()
        z = x.cos()
    return (y * z).sum()


def set_grad_enabled_inside(x):
    with torch.set_grad_enabled(False):
        s = x.exp()
    with torch.inference_mode():
        t = x.tanh()
    return (x * s + t).sum()


OUTER = {
    "none": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "set_grad_enabled(False)": partial(torch.set_grad_enabled, False),
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("outer", list(OUTER))
@pytest.mark.parametrize("f", [own_no_grad, enable_inside_no_grad, set_grad_enabled_inside], ids=lambda f: f.__name__)
def test_grad_mode_around_build_and_call(f, outer):
    """torch.func.grad ignores the modes around it and honours the function's own blocks; so do
    fxtools' modules, built and called under any of them (the silent gradient of 0 of issue 32)."""
    x = _x(5)
    want = torch.func.grad(f)(x)
    with OUTER[outer]():
        gm = fxtools.grad(f, x)
    _close(gm(x), want)
    with OUTER[outer]():
        _close(gm(x), want)


@pytest.mark.parametrize("outer", ["no_grad", "inference_mode"])
def test_grad_mode_around_every_transform(outer):
    x, v = _x(4), _x(4, seed=1)
    with OUTER[outer]():
        built = {
            "vjp": fxtools.vjp(own_no_grad, x),
            "jvp": fxtools.jvp(own_no_grad, x),
            "hvp": fxtools.hvp(own_no_grad, x),
            "jacrev": fxtools.jacrev(own_no_grad, x),
            "jacfwd": fxtools.jacfwd(own_no_grad, x),
            "hessian": fxtools.hessian(own_no_grad, x),
            "value_and_grad": fxtools.value_and_grad(own_no_grad, x),
        }
    one = torch.ones((), dtype=D)
    _close(built["vjp"](x, one)[1], torch.func.vjp(own_no_grad, x)[1](one))
    _close(built["jvp"](x, v), torch.func.jvp(own_no_grad, (x,), (v,)))
    _close(built["hvp"](x, v), torch.func.jvp(torch.func.grad(own_no_grad), (x,), (v,))[1])
    _close(built["jacrev"](x), torch.func.jacrev(own_no_grad)(x))
    _close(built["jacfwd"](x), torch.func.jacfwd(own_no_grad)(x))
    _close(built["hessian"](x), torch.func.hessian(own_no_grad)(x))
    _close(built["value_and_grad"](x), torch.func.grad_and_value(own_no_grad)(x)[::-1])


def test_inputs_made_under_inference_mode():
    with torch.inference_mode():
        x = _x(3, 2)
    gm = fxtools.grad(lambda x: (x.sin() * x).sum(), x)
    _close(gm(x), (x.cos() * x + x.sin()).clone())
    bm = fxtools.vmap(lambda r: r.sin() * 2, x)
    with torch.inference_mode():
        _close(bm(x), x.sin() * 2)


def test_module_made_under_inference_mode_is_refused_clearly():
    with torch.inference_mode():
        lin = nn.Linear(3, 2).to(D)
    x = _x(4, 3)
    with pytest.raises(FxtoolsError, match=r"lin\.weight was made under torch\.inference_mode\(\).*outside inference mode"):
        fxtools.grad(lambda x: lin(x).sum(), x)


# --- views under vmap of jvp, batch dimension anywhere -------------------------------------------


def row_then_base_copy(a, b):
    a = a.clone()
    row = a[0]
    a.copy_(b)  # the row, taken before, sees b's first row
    return row, a


def row_copy(a, b):
    a = a.clone()
    row = a[0]
    row.copy_(b)  # written through the view: the base sees it
    return row, a


def _push(fn):
    def pushed(a, b, bt):
        return torch.func.jvp(partial(fn, a), (b,), (bt,))

    return pushed


@pytest.mark.parametrize(
    "fn, in_dims, shapes",
    [
        (row_then_base_copy, (1, 2, 2), [(3, 2, 4), (3, 4, 2), (3, 4, 2)]),
        (row_then_base_copy, (2, 0, 1), [(3, 4, 2), (2, 3, 4), (3, 2, 4)]),
        (row_then_base_copy, (0, 0, 0), [(2, 3, 4), (2, 3, 4), (2, 3, 4)]),
        (row_copy, (1, 1, 1), [(3, 2, 4), (4, 2), (4, 2)]),
        (row_copy, (2, 1, 0), [(3, 4, 2), (4, 2), (2, 4)]),
    ],
)
def test_vmap_of_jvp_through_views(fn, in_dims, shapes):
    """The tangent of a view taken before an in-place copy (into the base or through the view)
    is right whichever dimension is batched (it was silently wrong when the batch was not first)."""
    args = [_x(*s, seed=i) for i, s in enumerate(shapes)]
    want = torch.func.vmap(_push(fn), in_dims=in_dims)(*args)
    gm = fxtools.vmap(_push(fn), *args, in_dims=in_dims)
    _close(gm(*args), want)


# --- buffers updated in place more than once ------------------------------------------------------


class Stats(nn.Module):
    """A step counter, an EMA and hand-written running statistics, as users write them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        self.count += 1
        self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        with torch.no_grad():
            self.running_mean.mul_(0.8)
            self.running_mean.add_(0.2 * x.mean(0))
            self.running_var.mul_(0.8).add_(0.2 * x.var(0))
        self.count.add_(1)
        return (self.lin(x).tanh() * self.ema).sum()


@pytest.mark.parametrize("outer", ["none", "no_grad"])
def test_buffers_updated_in_place_several_times(outer):
    torch.manual_seed(0)
    model, twin = Stats().to(D), Stats().to(D)
    twin.load_state_dict(model.state_dict())
    x = _x(5, 3)
    loss = fxtools.functional(model)
    params = dict(model.named_parameters())
    with OUTER[outer]():
        gm = fxtools.grad(loss, params, x)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    assert all(torch.equal(buffers[k], v) for k, v in twin.named_buffers())  # building changes nothing
    for _ in range(2):
        got = gm(params, x)
        twin.zero_grad()
        twin(x).backward()  # torch.func refuses mutations of captured buffers: eager autograd is the oracle
        _close(got, {k: p.grad for k, p in twin.named_parameters()})
        _close(dict(model.named_buffers()), dict(twin.named_buffers()))
    assert model.count.item() == 4


# --- forward mode and grad-mode switches: as torch.func ------------------------------------------


def no_grad_block(x):
    with torch.no_grad():
        y = x.sin()  # forward AD ignores no_grad: y carries a tangent; reverse mode stops here
    return y * x


def forward_ad_off(x):
    import torch.autograd.forward_ad as fwAD

    with fwAD._set_fwd_grad_enabled(False):
        y = x.sin()  # reverse mode ignores this switch; forward AD stops here
    return y * x


def inference_block(x):
    with torch.inference_mode():
        y = x.sin()  # stops both
    return y + x


@pytest.mark.parametrize("f", [no_grad_block, forward_ad_off, inference_block], ids=lambda f: f.__name__)
def test_forward_and_reverse_modes_follow_pytorchs_switches(f):
    x, v = _x(4), _x(4, seed=1)
    _close(fxtools.jvp(f, x)(x, v), torch.func.jvp(f, (x,), (v,)))
    _close(fxtools.linearize(f, x)[1](v), torch.func.jvp(f, (x,), (v,))[1])
    _close(fxtools.jacfwd(f, x)(x), torch.func.jacfwd(f)(x))
    _close(fxtools.jacrev(f, x)(x), torch.func.jacrev(f)(x))
    _close(fxtools.grad(lambda x: f(x).sum(), x)(x), torch.func.grad(lambda x: f(x).sum())(x))


# --- generated names never take the user's --------------------------------------------------------


def test_user_names_from_fxtools_vocabulary_keep_their_names():
    """A user's argument named as fxtools names its own inputs (tangent_x, grad_out, series, x_1)
    keeps its name in the signature; the generated input gets a suffix."""
    x, v = _x(3), _x(3, seed=1)

    def f(x, tangent_x):
        return x.sin() * tangent_x

    out, tan = torch.func.jvp(f, (x, v), (v, x))
    jv = fxtools.jvp(f, x, v)
    assert "def forward(self, x, tangent_x, tangent_x_1, tangent_tangent_x):" in jv.code
    _close(jv(x, v, v, x), (out, tan))
    _close(jv(x=x, tangent_x=v, tangent_x_1=v, tangent_tangent_x=x), (out, tan))
    _close(fxtools.linearize(f, x, v)[1](v, x), tan)
    _close(fxtools.jacfwd(f, x, v)(x, v), torch.func.jacfwd(f)(x, v))

    def g(x, grad_out):
        return x.sin() * grad_out

    vj = fxtools.vjp(g, x, v)
    _close(vj(x, v, x), (g(x, v), torch.func.vjp(g, x, v)[1](x)))
    _close(vj(x=x, grad_out=v, grad_out_1=x), (g(x, v), torch.func.vjp(g, x, v)[1](x)))

    def h(x, series, x_1, grad_x):
        return (x.sin() * series * x_1 * grad_x).sum()

    args = (x, v, v + 1, v - 1)
    _close(fxtools.grad(h, *args)(*args), torch.func.grad(h)(*args))
    _close(fxtools.hvp(h, *args)(*args, v), torch.func.jvp(torch.func.grad(h), args, (v, 0 * v, 0 * v, 0 * v))[1])
    _close(fxtools.jet(h, *args, order=1)(*args, (v,))[1][0], torch.func.jvp(h, args, (v, 0 * v, 0 * v, 0 * v))[1])


# --- how transforms are called ---------------------------------------------------------------------


def scaled(x, scale=1.0, w=None):
    return (x * scale).sin() * (1.0 if w is None else w)


def scaled_sum(x, scale=1.0, w=None):
    return scaled(x, scale, w).sum()


# each transform: how its module is called (after the function's arguments) and the torch.func oracle,
# on the function with its keywords bound (torch.func's vjp, jvp, jacrev, jacfwd take none at call time)
KEYWORD_CASES = {
    "grad": (scaled_sum, lambda x, v: (), lambda g, x, v: torch.func.grad(g)(x)),
    "vjp": (scaled, lambda x, v: (v,), lambda g, x, v: (g(x), torch.func.vjp(g, x)[1](v))),
    "jvp": (scaled, lambda x, v: (v,), lambda g, x, v: torch.func.jvp(g, (x,), (v,))),
    "hvp": (scaled_sum, lambda x, v: (v,), lambda g, x, v: torch.func.jvp(torch.func.grad(g), (x,), (v,))[1]),
    "jacrev": (scaled, lambda x, v: (), lambda g, x, v: torch.func.jacrev(g)(x)),
    "jacfwd": (scaled, lambda x, v: (), lambda g, x, v: torch.func.jacfwd(g)(x)),
    "hessian": (scaled_sum, lambda x, v: (), lambda g, x, v: torch.func.hessian(g)(x)),
    "laplacian": (scaled_sum, lambda x, v: (), lambda g, x, v: (g(x), torch.func.hessian(g)(x).trace())),
    "vmap": (scaled, lambda x, v: (), lambda g, x, v: torch.func.vmap(g)(x)),
}


@pytest.mark.parametrize("name", list(KEYWORD_CASES))
def test_keyword_arguments_of_f_in_every_transform(name):
    """Keyword arguments are passed on to f, as torch.func.grad passes them: inputs of the module
    after f's positional ones, neither differentiated nor batched, given by keyword when it is
    called; a number among them is a constant of the code, guarded, a tensor is read each call."""
    f, extra, oracle = KEYWORD_CASES[name]
    x, v, w = _x(3), _x(3, seed=1), _x(3, seed=2)
    gm = getattr(fxtools, name)(f, x, scale=2.0, w=w)
    for w_now in (w, w * 3):
        want = oracle(partial(f, scale=2.0, w=w_now), x, v)
        _close(gm(x, *extra(x, v), scale=2.0, w=w_now), want)
        _close(gm(x, 2.0, w_now, *extra(x, v)), want)  # positionally, in the order of gm.code
    with pytest.raises(fxtools.InputMismatch, match="scale is float 3.0, but the module was made with scale = 2.0"):
        gm(x, *extra(x, v), scale=3.0, w=w)
    with pytest.raises(
        fxtools.InputMismatch, match=r"made with the function's keyword arguments scale=\.\.\., w=\.\.\. and got no w"
    ):
        gm(x, *extra(x, v), scale=2.0)


def test_keyword_arguments_refused_where_the_module_cannot_take_them():
    with pytest.raises(FxtoolsError, match=r"fxtools\.split passes no keyword.*functools\.partial\(f, scale=\.\.\.\)"):
        fxtools.split(scaled_sum, _x(3), scale=2.0)
    with pytest.raises(
        FxtoolsError, match="'scal', which is neither one of its options .* nor a parameter of the function scaled"
    ):
        fxtools.vjp(scaled, _x(3), scal=2.0)


@pytest.mark.parametrize("argnums", [1.0, "0", (), (0, 1.5)])
def test_argnums_of_the_wrong_type_are_named(argnums):
    with pytest.raises(fxtools.FxtoolsError, match="argnums must be an int or a non-empty tuple of ints"):
        fxtools.grad(lambda x: x.sum(), _x(3), argnums=argnums)


@pytest.mark.parametrize("name", ["jacrev", "jacfwd"])
def test_jacobians_with_aux(name):
    x = _x(3)

    def f(x):
        return x.sin() * x, {"c": x.cos()}

    _close(getattr(fxtools, name)(f, x, has_aux=True)(x), getattr(torch.func, name)(f, has_aux=True)(x))
    with pytest.raises(ValueError, match=r"output\[1\] \(3\) is not a tensor.*has_aux=True"):
        getattr(fxtools, name)(lambda x: (x.sin(), 3), x)


# --- programs eager runs -----------------------------------------------------------------------------


def zero_dim_mask_assignment(x):
    y = x.sin() * 1
    y[x.sum() > 0] = 0  # all of y or nothing, decided by the value
    y[torch.zeros((), dtype=x.dtype) > 0] = 5.0
    return (y * x).sum()


def test_assignment_through_a_0_dim_boolean_mask():
    for x in (_x(4), -_x(4).abs(), _x(4).abs()):
        gm = fxtools.grad(zero_dim_mask_assignment, x)
        for z in (x, -x):
            _close(gm(z), torch.func.grad(zero_dim_mask_assignment)(z))


class NumpySin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(__import__("numpy").sin(x.numpy()))

    @staticmethod
    def backward(ctx, g):
        return g


def test_numpy_while_tracing_names_the_line():
    with pytest.raises(FxtoolsError, match=r"\.numpy\(\) \(at .*test_refusals_third\.py:\d+: .*x\.numpy\(\)"):
        fxtools.grad(lambda x: NumpySin.apply(x).sum(), _x(3))


# --- closed-over NumPy arrays and dtype errors -------------------------------------------------------

_ARRAY = __import__("numpy").array([1.0, 2.0, 3.0])
_SHARED = __import__("numpy").array([1.0, 2.0, 3.0])


def test_numpy_array_changed_in_place_is_seen():
    """A value the code baked in from a closed-over array is guarded by value (it was silently stale);
    an array the code reads through torch.from_numpy shares its memory, and a change is read, as in eager."""
    x = _x(3)
    by_value = fxtools.grad(lambda x: (x * float(_ARRAY.sum())).sum(), x)
    by_reference = fxtools.grad(lambda x: (x * torch.from_numpy(_SHARED)).sum(), x)
    _close(by_value(x), torch.full((3,), 6.0, dtype=D))
    _ARRAY[0] = _SHARED[0] = 10.0
    try:
        with pytest.raises(fxtools.InputMismatch, match="_ARRAY .*NumPy array whose contents changed"):
            by_value(x)
        _close(by_reference(x), torch.from_numpy(_SHARED).clone())
    finally:
        _ARRAY[0] = _SHARED[0] = 1.0


@pytest.mark.parametrize("name", ["grad", "laplacian", "vmap", "jvp"])
def test_dtype_error_fails_at_build_naming_the_line(name):
    def mixed(x):
        return (x @ torch.ones(3, dtype=torch.float32)).sum()

    with pytest.raises(FxtoolsError, match=r"different dtypes \(float64, float32\) at .*test_refusals_third\.py:\d+"):
        getattr(fxtools, name)(mixed, _x(3, 3))


# --- size 1 on a dynamic size ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grad", "vjp", "vmap"])
def test_size_one_on_a_dynamic_batch_is_served(name):
    from torch.export import Dim

    def f(x, w):
        return ((x * w).sin() * 2).mean(0).sum() if name != "vmap" else (x * w).sin()

    x, w = _x(4, 3), _x(1, 3, seed=1)
    shapes = ({0: Dim("batch")}, None)
    gm = getattr(fxtools, name)(f, x, w, dynamic_shapes=shapes, **({"in_dims": (0, None)} if name == "vmap" else {}))
    one = torch.ones((), dtype=D)
    for n in (1, 5, 1):
        z = _x(n, 3, seed=n)
        if name == "grad":
            _close(gm(z, w), torch.func.grad(f)(z, w))
        elif name == "vjp":
            _close(gm(z, w, one), (f(z, w), torch.func.vjp(f, z, w)[1](one)))
        else:
            _close(gm(z, w), torch.func.vmap(f, in_dims=(0, None))(z, w))
    assert len(gm._size_one_modules) == 1  # built once, on the first call of size 1


def test_cond_with_branches_of_different_shapes_is_refused_naming_the_line():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x[:2] * 2, lambda x: x.sin(), (x,))

    with pytest.raises(
        FxtoolsError, match=r"torch\.cond at .*test_refusals_third\.py:\d+.*different shapes \(\[\[2\]\] and \[\[3\]\]\)"
    ):
        fxtools.vjp(f, _x(3))


def test_jvp_of_a_function_with_an_argument_named_grad_out():
    """fxtools' own names (here the cotangent's) are not read as roles in the user's graph."""

    def f(x, grad_out):
        return x.sin() * grad_out.cos()

    x, g, t, u = _x(3), _x(3, seed=1), _x(3, seed=2), _x(3, seed=3)
    _close(fxtools.jvp(f, x, g)(x, g, t, u), torch.func.jvp(f, (x, g), (t, u)))


def test_deepcopy_of_a_module_inside_vmap():
    lin = nn.Linear(3, 3).to(D)

    def fresh_copy(x):
        return copy.deepcopy(lin)(x).tanh()

    x = _x(2, 3)
    _close(fxtools.vmap(fresh_copy, x)(x), torch.func.vmap(fresh_copy)(x))


def test_vmap_of_a_generated_module_without_examples_says_how():
    """``fxtools.vmap(gm)(xs)``, the torch.func habit, on a generated module (whose ``__call__``
    takes ``*args``) gets fxtools' call, not torch.func's "got no inputs"."""
    x, xs = _x(3), _x(5, 3, seed=1)
    gm = fxtools.grad(lambda x: x.sin().sum(), x)
    with pytest.raises(fxtools.FxtoolsError, match=r"fxtools\.vmap\(f\) needs example inputs.*gm = fxtools\.vmap\(f, x\)"):
        fxtools.vmap(gm)
    _close(fxtools.vmap(gm, xs)(xs), xs.cos())


# --- held-out findings (fourth pass) -----------------------------------------------------------------


def detach_inside(x):
    return ((x.sin().detach() * x) ** 2).sum()


def sin_under_no_grad(x):
    with torch.no_grad():
        m = x.sin()
    return (x * m).pow(2).sum()


def max_under_no_grad(x):
    with torch.no_grad():
        m = x.max()  # couples the elements: the gradient's Jacobian is not symmetric
    return ((x - m).exp() * m).sum()


@pytest.mark.parametrize("f", [detach_inside, sin_under_no_grad, max_under_no_grad], ids=lambda f: f.__name__)
def test_second_derivatives_through_detach_and_no_grad(f):
    """A detached value, or one computed under ``no_grad``, is a constant at every order, as in
    PyTorch's reverse mode (fxtools.hvp differentiated the gradient's code, where the detach and
    the no_grad block were gone: silently wrong). Oracle: torch.func's reverse over reverse and
    torch.autograd.functional's hvp and hessian. torch.func.jvp(grad(f)) differs under no_grad
    (forward AD ignores no_grad), as fxtools.hvp documents."""
    x, v = _x(3, 4), _x(3, 4, seed=1)
    gm = fxtools.hvp(f, x)
    _close(gm(x, v), torch.func.vjp(torch.func.grad(f), x)[1](v)[0])
    _close(gm(x, v), torch.autograd.functional.hvp(f, x, v)[1])
    _close(fxtools.hessian(f, x)(x), torch.autograd.functional.hessian(f, x))
    g = fxtools.grad(f, x)  # autograd over the generated gradient: eager's double backward
    xg = x.clone().requires_grad_()
    _close(torch.autograd.grad(g(xg), xg, v)[0], torch.func.vjp(torch.func.grad(f), x)[1](v)[0])


def test_an_in_place_op_reading_part_of_the_memory_it_writes_is_refused():
    """``y[..., 1:].mul_(y[..., :-1])``: eager's result depends on its kernel's order (it refuses the
    contiguous case, runs the strided one), so fxtools refuses it, naming the line; the same view
    (``y.mul_(y)``) and disjoint or interleaved views of one storage are exact as eager."""

    def shifted(x):
        y = x.exp()
        y[..., 1:].mul_(y[..., :-1].detach())
        return y

    def interleaved(x):
        y = (x * 2).reshape(-1)
        y[::2].add_(y[1::2])
        return y * y.clone().mul_(y)

    x = _x(3, 4)
    for transform in (fxtools.vjp, fxtools.jvp, fxtools.vmap):
        with pytest.raises(FxtoolsError, match=r"y\[\.\.\., 1:\]\.mul_.*same memory.*clone"):
            transform(shifted, x)
    xg = x.clone().requires_grad_()
    want = torch.autograd.grad(interleaved(xg), xg, torch.ones(12, dtype=x.dtype))[0]
    _close(fxtools.grad(lambda x: interleaved(x).sum(), x)(x), want)
    _close(fxtools.vmap(interleaved, _x(5, 3, 4))(_x(5, 3, 4)), torch.stack([interleaved(r) for r in _x(5, 3, 4)]))


def test_a_parameter_made_from_a_batched_input_is_refused_clearly():
    def f(x):
        w = nn.Parameter(x * 2)  # a new leaf: its value is outside autograd's view of x
        return (w**2).sum() * x

    with pytest.raises(FxtoolsError, match=r"made while tracing from values fxtools does not know.*nn\.Parameter\(x\)"):
        fxtools.vmap(f, _x(5, 3))
