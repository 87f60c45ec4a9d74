"""Taylor mode (float64, against torch.func): fxtools.laplacian, fxtools.jet, their composition with
vmap / grad / compile / split, fxtools.hessian of any output, and compiled higher-order derivatives
shaped after public PyTorch reports."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxtools

TOL = dict(rtol=1e-10, atol=1e-10)
F64 = torch.float64

pytestmark = pytest.mark.usefixtures("float64")


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def trace_of_hessian(f, x, *rest):
    """The Laplacian of every output element, from torch.func's Hessian (``O + S + S``)."""
    out = f(x, *rest)
    H = torch.func.hessian(f)(x, *rest).reshape(*out.shape, x.numel(), x.numel())
    return H.diagonal(0, -2, -1).sum(-1)


def curve_derivatives(f, x, series):
    """``d^k/dt^k f(x + sum_j series[j-1] t^j / j!)`` at 0, k = 1..len(series), by nested torch.func.jvp."""

    def along(t):
        return f(x + sum(s * t**j / math.factorial(j) for j, s in enumerate(series, 1)))

    g, out = along, []
    for _ in series:
        g = (lambda g: lambda t: torch.func.jvp(g, (t,), (torch.ones((), dtype=F64),))[1])(g)
        out.append(g(torch.zeros((), dtype=F64)))
    return out


W1, W2 = randn(4, 6, seed=1) / 2, randn(6, 3, seed=2) / 2
CONV_W = randn(3, 2, 3, 3, seed=3) / 3

# programs of one input of shape (4,) (or as given): every family of Taylor rules
PROGRAMS = {
    "mlp_tanh": (lambda x: torch.tanh(torch.tanh(x @ W1) @ W2), (4,)),
    "sigmoid_softmax": (lambda x: torch.softmax(torch.sigmoid(x @ W1) @ W2, -1), (4,)),
    "log_softmax_lse": (lambda x: F.log_softmax(x @ W1, -1) + torch.logsumexp(x.view(2, 2), 1).sum(), (4,)),
    "pointwise": (
        lambda x: torch.sin(x) * torch.exp(x) / (1 + x * x) + torch.log1p(x * x) - (torch.cos(x) + 2).sqrt().clamp_min(1.1),
        (4,),
    ),
    "towers": (
        lambda x: torch.erf(x) + torch.expm1(x) * torch.sinh(x) + torch.cosh(x).log() + (x * x + 1).rsqrt() + torch.tan(x / 4),
        (4,),
    ),
    "powers": (
        lambda x: (x * x + 0.5) ** 1.5 + 2.0**x + x.abs() ** 3 + (x * x + 1) ** (x / 3) + torch.reciprocal(x * x + 2),
        (4,),
    ),
    "norms": (lambda x: x.norm() * x + x.var() + x.std(0).exp() + torch.linalg.vector_norm(x.view(2, 2), 3, 1).sum(), (4,)),
    "layer_norm": (lambda x: F.layer_norm(x.view(2, 3), (3,)).sin().sum(0), (6,)),
    "piecewise": (lambda x: torch.maximum(x, 2 * x.flip(0)) + x.amax() * x + torch.relu(x) ** 2 + F.leaky_relu(x) * x, (4,)),
    "reductions": (lambda x: x.view(2, 2).prod(0) + x.cumsum(0)[1:3].sum() * x.mean() + x.max(0)[0], (4,)),
    "bilinear": (lambda x: (x.view(2, 2) @ x.view(2, 2).T).sum(0) + torch.outer(x, x.sin()).trace(), (4,)),
    "conv": (
        lambda x: F.conv2d(x.view(1, 2, 3, 3).tanh(), CONV_W, torch.ones(3, dtype=F64), padding=1).sum((2, 3)).squeeze(0),
        (18,),
    ),
    "shapes": (lambda x: torch.cat([x.view(2, 2).T.reshape(4), x[:2].exp()]) * torch.where(x.sum() > 0, 1.0, 2.0), (4,)),
    "inverse_trig": (
        lambda x: x.atan() + (x / 4).asin() * (x / 5).acos() + (x / 4).atanh() + x.asinh() + (x * x + 1.5).acosh() + x.exp2(),
        (4,),
    ),
    "activations": (lambda x: F.gelu(x) + F.silu(x) + F.softplus(x) + F.elu(x * x), (4,)),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_laplacian_matches_trace_of_hessian(name):
    f, shape = PROGRAMS[name]
    x = randn(*shape, seed=5)
    gm = fxtools.laplacian(f, x)
    for seed in (5, 6):  # the module serves other inputs of its shape
        x = randn(*shape, seed=seed)
        out, lap = gm(x)
        close(out, f(x))
        close(lap, trace_of_hessian(f, x))


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n not in ("layer_norm", "sigmoid_softmax", "shapes", "activations")])
def test_jet_matches_nested_jvp(name):
    f, shape = PROGRAMS[name]
    x = randn(*shape, seed=7)
    order = 4 if name in ("mlp_tanh", "towers", "inverse_trig") else 3
    gm = fxtools.jet(f, x, order=order)
    series = tuple(randn(*shape, seed=10 + k) for k in range(order))
    out, got = gm(x, series)
    close(out, f(x))
    for k, want in enumerate(curve_derivatives(f, x, series)):
        close(got[k], want)


def second_derivative_from_hessian(f, x, series):
    """``d^2/dt^2 f(x + t s1 + t^2/2 s2)`` = s1' H s1 + J s2 (for ops whose nested jvp PyTorch gets wrong)."""
    out = f(x)
    H = torch.func.hessian(f)(x).reshape(*out.shape, x.numel(), x.numel())
    s1 = series[0].reshape(-1)
    return H @ s1 @ s1 + torch.func.jvp(f, (x,), (series[1],))[1]


def test_jet_of_layer_norm():
    """PyTorch's nested forward mode is wrong at second order for layer_norm (its forward-AD formula is
    not differentiated correctly again): the oracle is torch.func.hessian (reverse over forward)."""
    f, shape = PROGRAMS["layer_norm"]
    x = randn(*shape, seed=7)
    series = (randn(*shape, seed=8), randn(*shape, seed=9))
    out, got = fxtools.jet(f, x, order=2)(x, series)
    close(got[0], torch.func.jvp(f, (x,), (series[0],))[1])
    close(got[1], second_derivative_from_hessian(f, x, series))


@pytest.mark.parametrize("order", [1, 2, 3])
def test_jet_orders_along_a_line(order):
    f = PROGRAMS["mlp_tanh"][0]
    x, v = randn(4, seed=1), randn(4, seed=2)
    gm = fxtools.jet(f, x, order=order)
    out, got = gm(x, (v,) + tuple(torch.zeros(4, dtype=F64) for _ in range(order - 1)))
    assert len(got) == order
    for k, want in enumerate(curve_derivatives(f, x, (v,) + (torch.zeros(4, dtype=F64),) * (order - 1))):
        close(got[k], want)


def test_laplacian_code_names_terms_after_values():
    def f(x):
        h = torch.tanh(x @ W1)
        return torch.tanh(h @ W2)

    code = fxtools.laplacian(f, randn(4)).code
    for name in ("h_grad", "h_lap", "h = torch.tanh"):
        assert name in code, code
    assert "torch.eye" not in code  # the first layer's terms are W1's rows: no product with the identity


def test_laplacian_pytree_output_and_integer_output():
    def f(x):
        return {"u": (x * x).sum(), "v": torch.sin(x)}, x.argmax()

    x = randn(4)
    out, lap = fxtools.laplacian(f, x)(x)
    close(lap[0]["u"], torch.tensor(8.0, dtype=F64))
    close(lap[0]["v"], -torch.sin(x))
    assert lap[1] is None and out[1] == x.argmax()


def test_laplacian_of_a_constant_output_is_zero():
    x = randn(4)
    out, lap = fxtools.laplacian(lambda x, w: (x.sum() * 0 + w).exp(), x, randn(3))(x, randn(3))
    close(lap, torch.zeros(3, dtype=F64))


def test_weighted_operator_with_sigma():
    f = PROGRAMS["mlp_tanh"][0]
    x, sigma = randn(4, seed=1), randn(4, 3, seed=2)
    gm = fxtools.laplacian(f, x, sigma=sigma)
    for seed in (3, 4):  # any sigma of that shape at call time
        sigma = randn(4, 3, seed=seed)
        _, got = gm(x, sigma)
        H = torch.func.hessian(f)(x)
        close(got, torch.einsum("oij,ij->o", H, sigma @ sigma.T))
    with pytest.raises(ValueError, match=r"shape \(4, R\)"):
        fxtools.laplacian(f, x, sigma=randn(3, 2))


@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
def test_hutchinson_estimate_is_seeded_and_unbiased(distribution):
    f = PROGRAMS["pointwise"][0]
    x = randn(4, seed=1)
    gm = fxtools.laplacian(f, x, samples=3, distribution=distribution)
    torch.manual_seed(123)
    _, est = gm(x)
    torch.manual_seed(123)  # the same draws, made as the generated code makes them
    if distribution == "normal":
        v = torch.randn(3, 4, dtype=F64)
    else:
        v = (2 * torch.randint(0, 2, (3, 4)) - 1).to(F64)
    H = torch.func.hessian(f)(x)
    close(est, torch.einsum("si,oij,sj->o", v, H, v) / 3)
    torch.manual_seed(0)
    many = fxtools.laplacian(f, x, samples=4000, distribution=distribution)(x)[1]
    exact = trace_of_hessian(f, x)
    assert (many - exact).abs().max() < 0.15 * exact.abs().max() + 0.05  # unbiased: 4000 draws


def test_bad_arguments_are_refused():
    x = randn(4)
    with pytest.raises(ValueError, match="argnums must be an int"):
        fxtools.laplacian(lambda x: x.sin(), x, argnums=(0,))
    with pytest.raises(ValueError, match="floating-point tensor"):
        fxtools.jet(lambda n, x: x * n, 3, x, order=2)
    with pytest.raises(ValueError, match="order"):
        fxtools.jet(lambda x: x.sin(), x, order=-1)  # order 0 is the value alone
    with pytest.raises(ValueError, match="samples"):
        fxtools.laplacian(lambda x: x.sin(), x, samples=0)


def test_an_op_without_a_taylor_rule_is_refused_by_name_and_line():
    with pytest.raises(fxtools.MissingRuleError, match=r"digamma.*test_taylor\.py"):
        fxtools.laplacian(lambda x: torch.digamma(x.exp()), randn(4))
    with pytest.raises(fxtools.FxtoolsError, match=r"prod.*test_taylor\.py"):
        fxtools.jet(lambda x: x.repeat(5).prod(), randn(4), order=2)


def test_control_flow_and_custom_functions_are_refused():
    """A custom_vjp gives first derivatives only, and cond's branches have no Taylor rule yet."""

    @fxtools.custom_vjp
    def g(x):
        return x.sin()

    g.defvjp(lambda x: (x.sin(), x), lambda x, ct: ct * x.cos())
    with pytest.raises(fxtools.MissingRuleError, match=r"custom call of g.*test_taylor\.py"):
        fxtools.laplacian(lambda x: g(x) * 2, randn(3))

    def branchy(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    with pytest.raises(fxtools.MissingRuleError, match=r"cond.*test_taylor\.py"):
        fxtools.jet(branchy, randn(3), order=2)


# ------------------------------------------------------------------------------------------
# OpInfo: jet at orders 1-3 on the op families, against nested jvp
# ------------------------------------------------------------------------------------------

OPINFO_OPS = [
    "exp", "log", "tanh", "erf", "nn.functional.gelu",
    "mul", "div", "pow", "maximum",
    "matmul", "nn.functional.linear", "nn.functional.conv2d",
    "nn.functional.layer_norm", "softmax", "logsumexp",
    "amax", "var", "prod", "linalg.vector_norm",
]  # fmt: skip

# PyTorch's own nested forward mode is wrong at second order for layer_norm (its forward-AD formula
# is not differentiated again correctly); its oracle is the trace of torch.func.hessian instead
NESTED_JVP_WRONG = {"nn.functional.layer_norm"}


def _opinfo_cases():
    from torch.testing._internal.common_methods_invocations import op_db

    by_name = {}
    for op in op_db:  # the plain variant, else the first (div's is "no_rounding_mode")
        if op.variant_test_name == "" or op.name not in by_name:
            by_name[op.name] = op
    for name in OPINFO_OPS:
        yield pytest.param(by_name[name], id=name)


def _small_samples(op, limit=1):
    picked = []
    for s in op.sample_inputs("cpu", F64, requires_grad=False):
        x = s.input
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.numel() > 40:
            continue
        picked.append(s)
        if len(picked) == limit:
            break
    return picked


@pytest.mark.parametrize("op", list(_opinfo_cases()))
def test_opinfo_jet_orders_1_to_3(op):
    for sample in _small_samples(op):
        x = sample.input.detach()
        if op.name in ("log", "log1p", "log2", "sqrt", "rsqrt", "pow") or op.name == "prod":
            x = x.abs() + 0.5  # in the domain, away from the kinks of abs
        if op.name in ("abs", "nn.functional.relu", "maximum", "minimum", "clamp", "amax"):
            x = x + 1e-3 * torch.arange(x.numel(), dtype=F64).reshape(x.shape)  # no ties

        def f(x, s=sample):
            return op.op(x, *s.args, **s.kwargs)

        for order in (3,):  # the terms of orders 1, 2 and 3
            series = tuple(randn(*x.shape, seed=20 + k) for k in range(order))
            out, got = fxtools.jet(f, x, order=order)(x, series)
            close(out, f(x))
            if op.name in NESTED_JVP_WRONG:
                if order == 3:
                    close(got[1], second_derivative_from_hessian(f, x, series))
                continue
            for k, want in enumerate(curve_derivatives(f, x, series)):
                close(got[k], want)


# ------------------------------------------------------------------------------------------
# Fuzzer: seeded random programs, against torch.func
# ------------------------------------------------------------------------------------------

UNARY = [torch.tanh, torch.sin, torch.sigmoid, lambda x: x * x, lambda x: torch.exp(-x * x), F.softplus, lambda x: x.cumsum(-1)]
BINARY = [torch.add, torch.mul, lambda a, b: a / (1 + b * b), torch.sub, lambda a, b: torch.maximum(a, b + 0.37)]


def random_program(seed):
    rng = random.Random(seed)
    n = rng.choice([3, 5, 6])
    weights = [randn(n, n, seed=100 + seed * 7 + i) / n**0.5 for i in range(3)]
    steps = [(rng.randrange(4), rng.choice(UNARY), rng.choice(BINARY), rng.randrange(3)) for _ in range(rng.randint(2, 5))]

    def f(x):
        vals = [x]
        for kind, un, bi, w in steps:
            a = vals[rng_index(len(vals), kind)]
            b = vals[-1]
            if kind == 0:
                vals.append(un(a))
            elif kind == 1:
                vals.append(bi(a, b))
            elif kind == 2:
                vals.append(a @ weights[w])
            else:
                vals.append(torch.softmax(a, -1) * b.sum())
        return vals[-1]

    return f, n


def rng_index(n, kind):
    return (kind * 7 + 3) % n


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_laplacian_and_jet(seed):
    f, n = random_program(seed)
    x = randn(n, seed=seed)
    out, lap = fxtools.laplacian(f, x)(x)
    close(lap, trace_of_hessian(f, x))
    series = (randn(n, seed=seed + 50), randn(n, seed=seed + 51))
    out, got = fxtools.jet(f, x, order=2)(x, series)
    for k, want in enumerate(curve_derivatives(f, x, series)):
        close(got[k], want)


# ------------------------------------------------------------------------------------------
# Composition: vmap over a batch, grad of a PINN loss, compile, split
# ------------------------------------------------------------------------------------------


def mlp(params, x):
    h = torch.tanh(x @ params["w0"] + params["b0"])
    h = torch.tanh(h @ params["w1"] + params["b1"])
    return (h @ params["w2"]).squeeze(-1)


def mlp_params(d=3, width=8):
    return {
        "w0": randn(d, width, seed=1) / d**0.5,
        "b0": randn(width, seed=2) / 10,
        "w1": randn(width, width, seed=3) / width**0.5,
        "b1": randn(width, seed=4) / 10,
        "w2": randn(width, 1, seed=5) / width**0.5,
    }


def pinn_loss_reference(params, xs):
    lap = torch.func.vmap(lambda x: torch.func.hessian(mlp, argnums=1)(params, x).trace())(xs)
    u = mlp(params, xs)
    return ((lap + xs.sum(-1)) ** 2).mean() + (u**2).mean()


def pinn_loss_fxtools(params, xs):
    batched = fxtools.vmap(fxtools.laplacian(mlp, params, xs[0], argnums=1), params, xs, in_dims=(None, 0))

    def loss(params, xs):
        u, lap = batched(params, xs)
        return ((lap + xs.sum(-1)) ** 2).mean() + (u**2).mean()

    return loss


def test_vmap_of_laplacian_and_grad_of_pinn_loss():
    params, xs = mlp_params(), randn(5, 3, seed=9)
    loss = pinn_loss_fxtools(params, xs)
    close(loss(params, xs), pinn_loss_reference(params, xs))
    g = fxtools.grad(loss, params, xs)
    want = torch.func.grad(pinn_loss_reference)(params, xs)
    for k in params:
        close(g(params, xs)[k], want[k])


@pytest.mark.parametrize("compiler", [None, pytest.param("inductor", marks=pytest.mark.slow)])  # Inductor: ~100 s on 2 cores
def test_compile_pinn_loss(compiler):
    params, xs = mlp_params(), randn(5, 3, seed=9)
    loss = pinn_loss_fxtools(params, xs)
    compiled = fxtools.compile(loss, params, xs, compiler=compiler)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    value = compiled(leaves, xs)
    value.backward()
    close(value.detach(), pinn_loss_reference(params, xs))
    want = torch.func.grad(pinn_loss_reference)(params, xs)
    for k in params:
        close(leaves[k].grad, want[k])


def test_split_pinn_loss():
    params, xs = mlp_params(), randn(5, 3, seed=9)
    sp = fxtools.split(pinn_loss_fxtools(params, xs), params, xs)
    out, saved = sp.forward(*sp.flatten(params, xs))
    close(out, pinn_loss_reference(params, xs))
    grads = sp.backward(*saved, torch.ones((), dtype=F64))
    want = torch.func.grad(pinn_loss_reference)(params, xs)
    for k in params:
        close(grads[0][k], want[k])


def test_pinn_benchmark_step_is_exact():
    """``benchmarks/bench_pinn.py``'s step (three hidden layers, a boundary term, a summed output):
    fxtools' loss and gradient are torch.func's, as the benchmark checks before timing."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_pinn

    params = bench_pinn.make_params(3, 6, 3)
    inside, edge = randn(4, 3, seed=11), randn(4, 3, seed=12)
    methods = {"torch.func": bench_pinn.torch_func_step(), "fxtools": bench_pinn.fxtools_step(params, inside, edge)}
    bench_pinn.check(methods, (params, inside, edge))


# ------------------------------------------------------------------------------------------
# fxtools.hessian of any output, and compiled higher-order derivatives (public PyTorch reports)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "f",
    [lambda x: torch.sin(x) * x.sum(), lambda x: (x**3).sum(0, keepdim=True), lambda x: {"a": x.exp().outer(x), "b": x.sum()}],
    ids=["vector", "shape_1", "pytree"],
)
def test_hessian_of_non_scalar_outputs(f):
    x = randn(3)
    got, want = fxtools.hessian(f, x)(x), torch.func.hessian(f)(x)
    torch.utils._pytree.tree_map(close, got, want)


def _compiled(gm):
    """torch.compile through AOTAutograd (the layer where the reports failed); Inductor itself is
    exercised by ``test_compile_pinn_loss`` (it takes tens of seconds per graph on a small machine)."""
    torch._dynamo.reset()
    return torch.compile(gm, backend="aot_eager", fullgraph=True)


def test_compiled_hessian_of_a_function_using_trace():
    """torch.compile of torch.func.hessian of a function calling torch.trace returned wrong values."""

    def f(x):
        return torch.trace(x.view(2, 2).sin() @ x.view(2, 2)) * x.sum()

    x = randn(4)
    H = fxtools.hessian(f, x)
    want = torch.func.hessian(f)(x)
    close(H(x), want)
    close(_compiled(H)(x), want)


def test_compiled_vmap_of_hessian():
    def f(x):
        return (x.tanh() ** 3).sum()

    xs = randn(3, 4)
    gm = fxtools.vmap(fxtools.hessian(f, xs[0]), xs)
    want = torch.func.vmap(torch.func.hessian(f))(xs)
    close(gm(xs), want)
    close(_compiled(gm)(xs), want)


def test_compiled_hessian_of_hessian():
    def f(x):
        return (x.sin() * x.roll(1)).sum()

    x = randn(3)
    inner = fxtools.hessian(f, x)
    gm = fxtools.hessian(inner, x)  # a matrix-valued function: torch.func.hessian's structure
    want = torch.func.hessian(torch.func.hessian(f))(x)
    close(gm(x), want)
    close(_compiled(gm)(x), want)


def test_compiled_gradient_penalty():
    """Double backward (a loss on an input gradient) under torch.compile errored."""
    w, x = randn(4, 3, seed=1), randn(5, 4, seed=2)

    def critic(w, x):
        return torch.tanh(x @ w).sum()

    def loss(w, x, input_grad):
        return critic(w, x) + ((input_grad(w, x).norm(dim=1) - 1) ** 2).mean()

    grad_x = fxtools.grad(critic, w, x, argnums=1)
    g = fxtools.grad(lambda w, x: loss(w, x, grad_x), w, x)
    want = torch.func.grad(lambda w, x: loss(w, x, torch.func.grad(critic, argnums=1)))(w, x)
    close(g(w, x), want)
    close(_compiled(g)(w, x), want)


def test_compiled_maml_inner_step():
    """The MAML outer gradient differentiates through an inner gradient step."""
    w, xs, ys, xq, yq = randn(3, 1, seed=1), randn(6, 3, seed=2), randn(6, 1, seed=3), randn(4, 3, seed=4), randn(4, 1, seed=5)

    def task_loss(w, x, y):
        return ((torch.tanh(x @ w) - y) ** 2).mean()

    def outer(w, xs, ys, xq, yq, inner_grad):
        return task_loss(w - 0.1 * inner_grad(w, xs, ys), xq, yq)

    inner = fxtools.grad(task_loss, w, xs, ys)
    g = fxtools.grad(lambda *a: outer(*a, inner), w, xs, ys, xq, yq)
    want = torch.func.grad(lambda *a: outer(*a, torch.func.grad(task_loss)))(w, xs, ys, xq, yq)
    close(g(w, xs, ys, xq, yq), want)
    close(_compiled(g)(w, xs, ys, xq, yq), want)


def test_pinn_example_trains():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "pinn_poisson.py"
    spec = importlib.util.spec_from_file_location("pinn_poisson", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, last = module.train(steps=10, batch=8, width=8, seed=0)
    assert last < first


def test_laplacian_scales_the_next_weight_when_directions_outnumber_the_width():
    """With more directions (12) than the next layer's width (3), ``(tanh' * W0) @ W1`` is computed as
    ``W0 @ (tanh'[:, None] * W1)`` (3 x 3 numbers scaled, not 12 x 3), in every layer; exact, batched too."""
    torch.manual_seed(0)
    w0, w1, w2, w3 = (torch.randn(*s, dtype=F64) for s in ((12, 3), (3, 3), (3, 3), (3,)))

    def u(x):
        h = torch.tanh(x @ w0)
        h = torch.sin(h @ w1)
        return torch.tanh(h @ w2) @ w3

    xs = torch.randn(2, 12, dtype=F64)
    lap = fxtools.laplacian(u, xs[0])
    assert "w0 @ h_grad_factor" in lap.code and "h_1_grad_factor" in lap.code, lap.code
    out, got = fxtools.vmap(lap, xs)(xs)
    close(got, torch.func.vmap(lambda x: torch.func.hessian(u)(x).trace())(xs))
    close(out, torch.func.vmap(u)(xs))
