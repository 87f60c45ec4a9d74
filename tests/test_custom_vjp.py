"""Custom rules for user functions: fxtools.custom_vjp and torch.autograd.Function (float64).

The oracle is torch.autograd on the same autograd.Function (autograd honours its backward), and
for custom_vjp functions the equivalent autograd.Function.
"""

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools
from fxtools.capture.custom import CustomCall
from fxtools.capture.trace import capture

TOL = dict(rtol=1e-10, atol=1e-10)

pytestmark = pytest.mark.usefixtures("float64")


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


def autograd_grads(f, args, grad_out=None):
    """Gradients of f at args by torch.autograd (which runs the Functions' own backward)."""
    leaves = [a.detach().clone().requires_grad_(True) for a in args]
    out = f(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cts = grad_out if grad_out is not None else [torch.ones_like(o) for o in outs]
    pairs = [(o, c) for o, c in zip(outs, cts) if c is not None and o.requires_grad]
    return torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)


def custom_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, CustomCall)]


# ------------------------------------------------------------------ functions under test


class StraightThroughRound(torch.autograd.Function):
    """round() forward, identity backward: its derivative by the forward alone would be zero."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


@fxtools.custom_vjp
def clip_gradient(x, lo, hi):
    """Identity forward; the backward clips the cotangent to [lo, hi]."""
    return x


def clip_gradient_fwd(x, lo, hi):
    return x, (lo, hi)


def clip_gradient_bwd(res, g):
    lo, hi = res
    return g.clamp(lo, hi), None, None


clip_gradient.defvjp(clip_gradient_fwd, clip_gradient_bwd)


class ClipGradientFunction(torch.autograd.Function):
    """The autograd.Function equivalent of clip_gradient (the oracle)."""

    @staticmethod
    def forward(ctx, x, lo, hi):
        ctx.lo, ctx.hi = lo, hi
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g.clamp(ctx.lo, ctx.hi), None, None


@fxtools.custom_vjp
def softclip(x, scale):
    """A smooth function with a hand-written (differentiable) backward: scale * tanh(x / scale)."""
    return scale * torch.tanh(x / scale)


def softclip_fwd(x, scale):
    return scale * torch.tanh(x / scale), (x, scale)


def softclip_bwd(res, g):
    x, scale = res
    return g / torch.cosh(x / scale) ** 2, None


softclip.defvjp(softclip_fwd, softclip_bwd)


class SoftclipFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * torch.tanh(x / scale)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / torch.cosh(x / ctx.scale) ** 2, None


class TopHalf(torch.autograd.Function):
    """Two outputs: the values above the median (differentiable) and the 0/1 mask (not)."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > x.median()).to(x.dtype)
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(mask)
        return x * mask, mask

    @staticmethod
    def backward(ctx, g, g_mask):
        (mask,) = ctx.saved_tensors
        return g * mask + g_mask  # g_mask is zeros: the mask is not differentiable


class ScaledExp(torch.autograd.Function):
    """New style: forward without ctx, setup_context saves the output; a default argument."""

    @staticmethod
    def forward(x, scale=2.0):
        return torch.exp(x) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y, None


class Polynomial(torch.autograd.Function):
    """ctx attributes, needs_input_grad, and a non-tensor option choosing the formula."""

    @staticmethod
    def forward(ctx, x, w, power, mode):
        ctx.power, ctx.mode = power, mode
        ctx.save_for_backward(x, w)
        y = w * x**power
        return y if mode == "plain" else y + x

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = g * w * ctx.power * x ** (ctx.power - 1)
            if ctx.mode != "plain":
                gx = gx + g
        if ctx.needs_input_grad[1]:
            gw = (g * x**ctx.power).sum(0)  # w broadcasts over the rows of x
        return gx, gw, None, None


class OnceDifferentiableSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SumAndMax(torch.autograd.Function):
    """Without materialized gradients the backward sees None for outputs that get none."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        return x.sum(), x.amax()

    @staticmethod
    def backward(ctx, g_sum, g_max):
        (x,) = ctx.saved_tensors
        grad = torch.zeros_like(x)
        if g_sum is not None:
            grad = grad + g_sum
        if g_max is not None:
            grad = grad + g_max * (x == x.amax())
        return grad


# ------------------------------------------------------------------ first order


def test_straight_through_estimator_uses_the_custom_backward():
    f = lambda x: (StraightThroughRound.apply(3 * x) * x).sum()  # noqa: E731
    x = torch.randn(6)
    got = fxtools.grad(f, x)(x)
    (want,) = autograd_grads(f, [x])
    close(got, want)
    assert not torch.allclose(got, (3 * x).round())  # the forward alone would give round(3x) only


def test_gradient_clipping_custom_vjp_matches_autograd_function():
    f = lambda x: (clip_gradient(x, -0.1, 0.1) ** 3).sum()  # noqa: E731
    oracle = lambda x: (ClipGradientFunction.apply(x, -0.1, 0.1) ** 3).sum()  # noqa: E731
    x = torch.randn(8)
    got = fxtools.grad(f, x)(x)
    (want,) = autograd_grads(oracle, [x])
    close(got, want)
    assert got.abs().max() <= 0.1
    close(clip_gradient(x, -0.1, 0.1), x)  # eagerly it just runs the function


def test_multi_output_function_with_non_differentiable_output():
    def f(x):
        top, mask = TopHalf.apply(x)
        return top.sin(), mask

    x = torch.randn(7)
    gm = fxtools.vjp(f, x)
    ct = torch.randn(7)
    (out, mask), (gx,) = gm(x, (ct, None))
    close(out, f(x)[0])
    close(mask, f(x)[1])
    (want,) = autograd_grads(f, [x], [ct, None])
    close(gx, want)


def test_mask_used_downstream_gets_no_gradient():
    def f(x):
        top, mask = TopHalf.apply(x)
        return (top * mask * x).sum()  # a gradient may reach mask; the backward must see zeros

    x = torch.randn(7)
    close(fxtools.grad(f, x)(x), autograd_grads(f, [x])[0])


def test_new_style_setup_context_function():
    f = lambda x: ScaledExp.apply(x).sum() + ScaledExp.apply(x, 0.5).sum()  # noqa: E731
    x = torch.randn(4)
    close(fxtools.grad(f, x)(x), autograd_grads(f, [x])[0])


@pytest.mark.parametrize("mode", ["plain", "plus_x"])
def test_ctx_attributes_and_non_tensor_arguments(mode):
    f = lambda x, w: Polynomial.apply(x, w, 3, mode).tanh().sum()  # noqa: E731
    x, w = torch.randn(5, 3), torch.randn(3)
    gx, gw = fxtools.grad(f, x, w, argnums=(0, 1))(x, w)
    want = autograd_grads(f, [x, w])
    close(gx, want[0])
    close(gw, want[1])


def test_needs_input_grad_false_for_non_float_inputs():
    f = lambda x, i: Polynomial.apply(x, i, 2, "plain").sum()  # noqa: E731
    x, i = torch.randn(4, 2), torch.tensor([1, 2])
    close(fxtools.grad(f, x, i)(x, i), autograd_grads(lambda x: f(x, i), [x])[0])


def test_once_differentiable_backward():
    f = lambda x: OnceDifferentiableSquare.apply(x.sin()).sum()  # noqa: E731
    x = torch.randn(5)
    close(fxtools.grad(f, x)(x), autograd_grads(f, [x])[0])


@pytest.mark.parametrize("which", [0, 1])
def test_set_materialize_grads_false_passes_none(which):
    f = lambda x: SumAndMax.apply(x)[which] * 2  # noqa: E731
    x = torch.randn(6)
    close(fxtools.grad(f, x)(x), autograd_grads(f, [x])[0])


def test_custom_vjp_with_pytree_arguments_and_outputs():
    @fxtools.custom_vjp
    def affine(xs, scale):
        a, b = xs["a"], xs["b"]
        return {"sum": scale * (a + b), "prod": a * b}

    def affine_fwd(xs, scale):
        return affine.fun(xs, scale), (xs["a"], xs["b"], scale)

    def affine_bwd(res, ct):
        a, b, scale = res
        return {"a": scale * ct["sum"] + ct["prod"] * b, "b": scale * ct["sum"] + ct["prod"] * a}, None

    affine.defvjp(affine_fwd, affine_bwd)
    f = lambda xs: affine(xs, 1.5)["prod"].sum()  # noqa: E731 - "sum" gets no cotangent: zeros
    xs = {"a": torch.randn(3), "b": torch.randn(3)}
    g = fxtools.grad(f, xs)(xs)
    close(g["a"], xs["b"])
    close(g["b"], xs["a"])


class CustomMLP(nn.Module):
    """An MLP whose activation is a custom Function and whose output goes through custom_vjp."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y, use_oracle=False):
        h = SoftclipFunction.apply(self.fc1(x), 2.0)
        h = StraightThroughRound.apply(h * 4) / 4 + h
        logits = self.fc2(h)
        logits = ClipGradientFunction.apply(logits, -0.05, 0.05) if use_oracle else clip_gradient(logits, -0.05, 0.05)
        return F.cross_entropy(logits, y)


def test_custom_functions_inside_an_mlp_match_autograd():
    torch.manual_seed(0)
    model = CustomMLP()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    params = dict(model.named_parameters())
    grads = fxtools.grad(fxtools.functional(model), params, x, y)(params, x, y)
    want = torch.autograd.grad(model(x, y, use_oracle=True), list(params.values()))
    assert set(grads) == set(params)
    for (name, g), w in zip(grads.items(), want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{name}: {m}")


def test_captured_graph_has_one_call_node_per_custom_call():
    def f(x):
        return softclip(x, 2.0).sum() + StraightThroughRound.apply(x).sum()

    gm = capture(f, (torch.randn(3),)).gm
    calls = custom_calls(gm)
    assert [c.target.kind.name for c in calls] == ["softclip", "StraightThroughRound"]
    assert all(len(c.args) == 1 for c in calls)  # the tensor; 2.0 is a constant
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not ops & {torch.ops.aten.tanh.default, torch.ops.aten.round.default}  # the bodies are not inlined


def test_generated_code_is_standalone_torch():
    model = CustomMLP()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    params = dict(model.named_parameters())
    gm = fxtools.grad(fxtools.functional(model), params, x, y)
    assert "fxtools" not in gm.code and "custom" not in gm.code, gm.code
    assert not custom_calls(gm)
    assert "torch.round" in gm.code and "torch.clamp" in gm.code  # the rules' own torch calls
    vjp = fxtools.vjp(lambda x: softclip(x, 2.0), torch.randn(3))
    assert "fxtools" not in vjp.code and "cosh" in vjp.code, vjp.code


def test_eager_calls_are_untouched_by_fxtools():
    x = torch.randn(3, requires_grad=True)
    StraightThroughRound.apply(x).sum().backward()
    close(x.grad, torch.ones(3))
    close(softclip(x, 2.0), 2.0 * torch.tanh(x / 2.0))


# ------------------------------------------------------------------ composed transforms


def jacobian_by_autograd(f, x):
    return torch.autograd.functional.jacobian(f, x)


def test_jvp_through_custom_vjp_and_function():
    def f(x):
        return softclip(x, 1.5) * StraightThroughRound.apply(x)

    def oracle(x):
        return SoftclipFunction.apply(x, 1.5) * StraightThroughRound.apply(x)

    x, t = torch.randn(5), torch.randn(5)
    out, tan = fxtools.jvp(f, x)(x, t)
    close(out, oracle(x))
    close(tan, jacobian_by_autograd(oracle, x) @ t)


def test_hvp_differentiates_the_user_backward():
    def f(x):
        return (softclip(x, 1.5) ** 2).sum() + (x * softclip(x.sin(), 0.7)).sum()

    def oracle(x):
        return (SoftclipFunction.apply(x, 1.5) ** 2).sum() + (x * SoftclipFunction.apply(x.sin(), 0.7)).sum()

    x, v = torch.randn(4), torch.randn(4)
    got = fxtools.hvp(f, x)(x, v)
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(oracle(xr), xr, create_graph=True)
    (want,) = torch.autograd.grad(g, xr, v)
    close(got, want)
    assert "fxtools" not in fxtools.hvp(f, x).code


def test_vmap_runs_the_forward_and_per_sample_grads_use_the_backward():
    def loss(w, x):
        return (StraightThroughRound.apply(x @ w) * softclip(x, 2.0).sum()).sum()

    w, xs = torch.randn(3, 2), torch.randn(4, 3)
    batched = fxtools.vmap(loss, w, xs, in_dims=(None, 0))
    close(batched(w, xs), torch.stack([loss(w, x) for x in xs]))
    per_sample = fxtools.vmap(fxtools.grad(loss, w, xs[0]), w, xs, in_dims=(None, 0))(w, xs)
    close(per_sample, torch.stack([autograd_grads(lambda w: loss(w, x), [w])[0] for x in xs]))


class SinWithNoGradBlocks(torch.autograd.Function):
    """no_grad blocks in forward and backward: autograd's double backward treats the backward's
    block as a constant and ignores the forward's (the output is differentiated by the backward)."""

    @staticmethod
    def forward(ctx, x):
        with torch.no_grad():
            y = 2 * x.sin()
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            c = x.cos()
        return 2 * g * c


def test_hvp_with_no_grad_blocks_matches_double_backward():
    f = lambda x: (SinWithNoGradBlocks.apply(x) * x).sum()  # noqa: E731
    x, v = torch.randn(4), torch.randn(4)
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(xr), xr, create_graph=True)
    (want,) = torch.autograd.grad(g, xr, v)
    close(fxtools.hvp(f, x)(x, v), want)
    close(fxtools.grad(f, x)(x), autograd_grads(f, [x])[0])


def _custom_net():
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.fc2 = nn.Linear(8, 1)

        def forward(self, x, y):
            h = SoftclipFunction.apply(self.fc1(x), 1.0)
            h = StraightThroughRound.apply(h * 2) / 2
            return ((self.fc2(h).squeeze(1) - y) ** 2).mean()

    return Net(), (torch.randn(6, 4), torch.randn(6))


def test_compile_training_step_with_functions_matches_eager():
    model, inputs = _custom_net()
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs)
    for m in (compiled, eager):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            m(*inputs).backward()
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        close(p, q)


def test_split_with_a_function_matches_autograd():
    model, inputs = _custom_net()
    params = dict(model.named_parameters())
    sp = fxtools.split(fxtools.functional(model), params, *inputs)
    out, saved = sp.forward(*sp.flatten(params, *inputs))
    (grads, _, _) = sp.backward(*saved, torch.ones(()))
    want = torch.autograd.grad(model(*inputs), list(params.values()))
    for g, w in zip(grads.values(), want):
        close(g, w)
    assert "fxtools" not in sp.forward.code + sp.backward.code


def test_torch_compile_backend_with_a_function_matches_eager():
    model, inputs = _custom_net()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxtools.backend())
    compiled(*inputs).backward()
    eager(*inputs).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        close(p.grad, q.grad)


# ------------------------------------------------------------------ clear errors


class Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class WithVmapRule(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 2 * g

    @staticmethod
    def vmap(info, in_dims, x):
        return x * 2, in_dims[0]


class WithJvp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return 2 * g

    @staticmethod
    def jvp(ctx, t):
        return 2 * t


def line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_in_place_function_is_a_clear_error():
    def f(x):
        return Doubler.apply(x * 1).sum()

    with pytest.raises(fxtools.CustomFunctionError, match=rf"Doubler .*test_custom_vjp.py:{line_of(f, 'apply')}.*mark_dirty"):
        fxtools.grad(f, torch.randn(3))


def test_function_vmap_rule_under_fxtools_vmap_is_a_clear_error():
    def f(x):
        return WithVmapRule.apply(x)

    with pytest.raises(fxtools.CustomFunctionError, match=rf"WithVmapRule .*test_custom_vjp.py:{line_of(f, 'apply')}.*vmap"):
        fxtools.vmap(f, torch.randn(4, 3))
    close(fxtools.grad(lambda x: f(x).sum(), torch.randn(3))(torch.ones(3)), torch.full((3,), 2.0))


def test_function_jvp_rule_under_fxtools_jvp_is_a_clear_error():
    def f(x):
        return WithJvp.apply(x)

    with pytest.raises(fxtools.CustomFunctionError, match=rf"WithJvp .*test_custom_vjp.py:{line_of(f, 'apply')}.*jvp"):
        fxtools.jvp(f, torch.randn(3))


def test_closed_over_traced_tensor_is_a_clear_error():
    @fxtools.custom_vjp
    def scale_by(x):
        return x * w_holder[0]

    scale_by.defvjp(lambda x: (scale_by.fun(x), None), lambda res, g: (g,))
    w_holder = []

    def f(x, w):
        w_holder[:] = [w]
        return scale_by(x).sum()

    with pytest.raises(
        fxtools.CustomFunctionError, match=rf"scale_by .*test_custom_vjp.py:{line_of(f, 'scale_by(x)')}.*argument"
    ):
        fxtools.grad(f, torch.randn(3), torch.randn(3), argnums=(0, 1))


def test_wrong_number_of_gradients_is_a_clear_error():
    @fxtools.custom_vjp
    def twice(x, y):
        return 2 * x + y

    twice.defvjp(lambda x, y: (twice.fun(x, y), None), lambda res, g: 2 * g)  # one gradient for two inputs

    def f(x):
        return twice(x, x).sum()

    with pytest.raises(
        fxtools.CustomFunctionError, match=rf"twice .*test_custom_vjp.py:{line_of(f, 'twice(x, x)')}.*1 gradients for 2"
    ):
        fxtools.grad(f, torch.randn(3))


def test_gradient_of_the_wrong_shape_is_a_clear_error_and_broadcast_ones_are_summed():
    @fxtools.custom_vjp
    def scale(x, w):
        return x * w

    scale.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g: (g * res[1], g * res[0]))  # g * x: x's shape
    x, w = torch.randn(4, 3), torch.randn(3)
    gw = fxtools.grad(lambda x, w: scale(x, w).sum(), x, w, argnums=1)(x, w)
    close(gw, x.sum(0))  # summed to w's shape, as autograd does

    scale.defvjp(lambda x, w: (x * w, (x, w)), lambda res, g: (g * res[1], g[:, :2]))
    with pytest.raises(fxtools.CustomFunctionError, match=r"scale .*shape \[4, 2\] for an input of shape \[3\]"):
        fxtools.grad(lambda x, w: scale(x, w).sum(), x, w, argnums=1)
