"""Guards: every generated module refuses arguments it was not made for (fxtools.signature.guards).

Each case makes a module at one example and calls it with something its code is specialised
against; the call must raise ``fxtools.InputMismatch`` whose message names the argument by its
path, what the module was made for, what it got and how to get a module that accepts it. Calls
with what it was made for still give torch.func's answer (float64).
"""

import copy
import importlib.util
import io
import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from isolated import run_isolated

import fxtools
from fxtools.cli import examples
from fxtools.signature.guards import Guards, InputMismatch, Leaf, Sym, build


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def mismatch(fn, *args, **kwargs) -> str:
    with pytest.raises(InputMismatch) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, fxtools.FxtoolsError)
    text = str(info.value)
    assert "\n" not in text  # one paragraph
    return text


class MeanMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)  # a mean: 1/batch in the code


def mean_mlp(batch):
    torch.manual_seed(0)
    model = MeanMLP().double()
    params = examples.parameters_of(model)
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, 1, dtype=torch.float64)
    return fxtools.functional(model), params, x, y


def data(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, dtype=torch.float64, generator=g), torch.randn(batch, 1, dtype=torch.float64, generator=g))


# --------------------------------------------------------------------------------------------
# The cases of issue 10
# --------------------------------------------------------------------------------------------


def test_mean_loss_grad_made_at_batch_32_refuses_other_batches():
    loss, params, x, y = mean_mlp(32)
    gm = fxtools.grad(loss, params, x, y)
    close(gm(params, x, y), torch.func.grad(loss)(params, x, y))
    for batch in (16, 64, 1):
        xb, yb = data(batch)
        text = mismatch(gm, params, xb, yb)
        assert text.startswith(f"fxtools.grad module: x.size(0) is {batch}, but the module was made for 32")
        assert f"made for shape [32, 4], got [{batch}, 4]" in text
        assert "generate the module again" in text and "dynamic_shapes=" in text


@pytest.mark.parametrize("transform", ["vjp", "value_and_grad", "jvp"])
def test_mean_loss_other_transforms_refuse_other_batches(transform):
    loss, params, x, y = mean_mlp(32)
    xb, yb = data(16)
    if transform == "vjp":
        gm = fxtools.vjp(loss, params, x, y)
        extra = (torch.tensor(1.0, dtype=torch.float64),)
    elif transform == "value_and_grad":
        gm = fxtools.value_and_grad(loss, params, x, y)
        extra = ()
    else:
        gm = fxtools.jvp(loss, params, x, y)
        extra = ({k: torch.ones_like(v) for k, v in params.items()}, torch.ones_like(xb), torch.ones_like(yb))
    text = mismatch(gm, params, xb, yb, *extra)
    assert text.startswith(f"fxtools.{transform} module: x.size(0) is 16, but the module was made for 32")


def test_sum_made_at_5_refuses_10():
    gm = fxtools.vjp(lambda x: x.sum(), torch.randn(5))
    text = mismatch(gm, torch.randn(10), torch.tensor(1.0))
    assert "x.size(0) is 10, but the module was made for 5" in text
    g = fxtools.grad(lambda x: x.sum(), torch.randn(5))
    assert "x.size(0) is 10" in mismatch(g, torch.randn(10))
    assert torch.equal(g(torch.randn(5)), torch.ones(5))


def test_scalar_argument_is_a_guarded_constant():
    def f(x, w, b, scale):
        return ((x @ w + b) * scale).pow(2).sum()

    x, w, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    gm = fxtools.grad(f, x, w, b, 0.5, argnums=(0, 1, 2))
    text = mismatch(gm, x, w, b, 3.0)
    assert text == (
        "fxtools.grad module: scale is float 3.0, but the module was made with scale = 0.5, a value "
        "its code uses as a constant. Generate the module again with scale = 3.0 (or with a 0-dim "
        "tensor there, which makes the value an input of the generated code)."
    )
    assert "(a Python float)" in mismatch(gm, x, w, b, 1)  # an int is not the float the code was made with
    assert "a tensor float64[]" in mismatch(gm, x, w, b, torch.tensor(0.5, dtype=torch.float64))
    for got, want in zip(gm(x, w, b, 0.5), torch.func.grad(f, argnums=(0, 1, 2))(x, w, b, 0.5)):
        close(got, want)


def test_floats_compare_bitwise_and_nan_equals_nan():
    g = build("fxtools.grad", ["a", "b", "c"], [float("nan"), -0.0, True])
    g.check((float("nan"), -0.0, True))
    assert "b is float 0.0, but the module was made with b = -0.0" in mismatch(g.check, (float("nan"), 0.0, True))
    assert "c is int 1, but the module was made with c = True (a Python bool)" in mismatch(g.check, (math.nan, -0.0, 1))
    assert "a is float 1.0" in mismatch(g.check, (1.0, -0.0, True))


def test_wrong_cotangent_shape_and_dtype():
    def f(x):
        return torch.sin(x), x.sum()

    gm = fxtools.vjp(f, torch.randn(5, dtype=torch.float64))
    x = torch.randn(5, dtype=torch.float64)
    text = mismatch(gm, x, (torch.randn(3, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)))
    assert text.startswith("fxtools.vjp module: grad_out[0].size(0) is 3, but the module was made for 5")
    assert "it is the cotangent of out[0], so it must have that value's shape and dtype (float64[5])" in text
    assert "not broadcast, as in torch.autograd" in text
    text = mismatch(gm, x, (torch.randn(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)))
    assert "grad_out[1] has 1 dimension (shape [5]), but the module was made for shape []" in text
    text = mismatch(gm, x, (torch.randn(5), torch.tensor(1.0, dtype=torch.float64)))
    assert "grad_out[0] has dtype float32, but the module was made for float64; it is the cotangent of out[0]" in text
    want = torch.autograd.grad(f(x.requires_grad_())[0], x, torch.ones(5, dtype=torch.float64))[0]
    out, (gx,) = gm(x.detach(), (torch.ones(5, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)))
    close(gx, want)


def test_non_float_output_takes_no_cotangent():
    gm = fxtools.vjp(lambda x: torch.max(x, 0), torch.randn(4, 3))
    x = torch.randn(4, 3)
    _, (want,) = gm(x, (torch.ones(3), None))
    _, (got,) = gm(x, (torch.ones(3), torch.ones(3, dtype=torch.int64)))  # ignored, as torch.func.vjp does
    assert torch.equal(got, want)
    assert "grad_out[1] must be None" in mismatch(gm, x, (torch.ones(3), 1.0))
    ceil = fxtools.vjp(torch.ceil, x)  # a float output without gradient: its cotangent is ignored too
    assert torch.equal(ceil(x, torch.ones(4, 3))[1][0], torch.zeros(4, 3))


# --------------------------------------------------------------------------------------------
# Structure, dtype, device, layout, calling conventions
# --------------------------------------------------------------------------------------------


def test_structure_count_dtype_device():
    loss, params, x, y = mean_mlp(8)
    gm = fxtools.grad(loss, params, x, y)
    partial = {k: v for k, v in params.items() if k != "fc2.bias"}
    text = mismatch(gm, partial, x, y)
    assert text.startswith(
        "fxtools.grad module: params must be a dict with keys ['fc1.weight', 'fc1.bias', "
        "'fc2.weight', 'fc2.bias'] (the structure the module was made for), got a dict "
        "without ['fc2.bias']"
    )
    assert "with the extra keys ['extra']" in mismatch(gm, {**params, "extra": x}, x, y)
    assert "it takes 3 arguments (params, x, y), got 2" in mismatch(gm, params, x)
    assert "params['fc1.weight'] has dtype float32, but the module was made for float64" in mismatch(
        gm, {**params, "fc1.weight": params["fc1.weight"].float()}, x, y
    )
    assert "x is on meta, but the module was made for cpu tensors" in mismatch(gm, params, x.to("meta"), y)
    assert "y is None, but the module was made for a tensor float64[8, 1] on cpu" in mismatch(gm, params, x, None)
    reordered = dict(reversed(list(params.items())))  # the code indexes by key: any order is exact
    close(gm(reordered, x, y)["fc1.weight"], torch.func.grad(loss)(params, x, y)["fc1.weight"])


def test_keyword_arguments_are_checked():
    loss, params, x, y = mean_mlp(8)
    gm = fxtools.grad(loss, params, x, y)
    xb, yb = data(4)
    assert "x.size(0) is 4" in mismatch(gm, params, x=xb, y=yb)
    close(gm(params, y=y, x=x)["fc2.bias"], gm(params, x, y)["fc2.bias"])


def test_layout_is_guarded_where_the_code_views():
    def f(x):
        return x.view(-1).sin().sum()  # a .view of x in the code: x must be contiguous

    gm = fxtools.grad(f, torch.randn(3, 4, dtype=torch.float64))
    assert "x.view([-1])" in gm.code
    xt = torch.randn(4, 3, dtype=torch.float64).t()
    text = mismatch(gm, xt)
    assert text.startswith("fxtools.grad module: x has strides (1, 3), a layout the code's .view cannot view")
    assert "Pass x.contiguous()" in text  # eager's x.view(-1) raises on xt too
    close(gm(xt.contiguous()), torch.func.grad(f)(xt.contiguous()))

    g2 = fxtools.grad(lambda x: x.sin().sum(), torch.randn(3, 4, dtype=torch.float64))  # no view: any layout
    assert ".view" not in g2.code
    close(g2(xt), torch.func.grad(lambda x: x.sin().sum())(xt))


TRANSFORMS_OF_ARRAYS = {
    "grad": (lambda f, x: fxtools.grad(lambda x: f(x).sum(), x), lambda f: torch.func.grad(lambda x: f(x).sum())),
    "hessian": (lambda f, x: fxtools.hessian(lambda x: f(x).sum(), x), lambda f: torch.func.hessian(lambda x: f(x).sum())),
    "jacrev": (fxtools.jacrev, torch.func.jacrev),
    "jacfwd": (fxtools.jacfwd, torch.func.jacfwd),
    "vmap": (fxtools.vmap, torch.func.vmap),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS_OF_ARRAYS))
def test_views_take_every_layout_eager_views_take(transform):
    """A .view in the code (the user's, or a Jacobian's own reshape of its output) runs on any
    layout on which it succeeds, as eager's: rows of a larger tensor split along their last
    dimension, a transposed input whose Jacobian rows are flattened. A reshape traced as a view
    on the contiguous example runs on other layouts by a module built for them; a .view eager
    cannot apply is refused naming the argument (float64, against torch.func)."""
    make, oracle = TRANSFORMS_OF_ARRAYS[transform]
    programs = {
        "split": lambda x: torch.sin(x.view(*x.shape, 1)).sum(-1) * x,
        "matrix": lambda x: torch.tanh(x.unsqueeze(-1) * x.unsqueeze(-2)),
        "flat": lambda x: torch.sin(x.view(-1)) * 2,
        "reshape": lambda x: torch.sin(x.reshape(-1)) * 2,  # a view on the example; copies where it must
    }
    x = torch.randn(4, 3, dtype=torch.float64)
    layouts = {
        "rows": torch.randn(8, 3, dtype=torch.float64)[::2],
        "transposed": torch.randn(3, 4, dtype=torch.float64).t(),
    }
    for name, f in programs.items():
        gm = make(f, x)
        for where, xx in layouts.items():
            try:
                want = oracle(f)(xx)
            except RuntimeError:  # eager's .view cannot view this layout: refused, naming x
                assert "x has strides" in mismatch(gm, xx), (name, where)
                continue
            close(gm(xx), want)


def test_guards_describe_what_the_module_accepts():
    loss, params, x, y = mean_mlp(32)
    gm = fxtools.grad(loss, params, x, y)
    assert str(gm.guards).splitlines() == [
        "fxtools.grad module accepting (params, x, y):",
        "  params['fc1.weight']: float64[8, 4] on cpu",
        "  params['fc1.bias']: float64[8] on cpu",
        "  params['fc2.weight']: float64[1, 8] on cpu",
        "  params['fc2.bias']: float64[1] on cpu",
        "  x: float64[32, 4] on cpu",
        "  y: float64[32, 1] on cpu",
    ]
    assert "guards" not in gm.code and "check" not in gm.code  # the code is the derivative alone


def test_guards_survive_deepcopy_and_pickling():
    loss, params, x, y = mean_mlp(32)
    gm = fxtools.grad(loss, params, x, y)
    xb, yb = data(16)
    for copied in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert "x.size(0) is 16" in mismatch(copied, params, xb, yb)
        close(copied(params, x, y)["fc1.bias"], gm(params, x, y)["fc1.bias"])
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert "x.size(0) is 16" in mismatch(loaded, params, xb, yb)


def test_symbolic_sizes_interface():
    """The data the dynamic sizes build on: a Sym accepts its range, equal wherever it recurs."""
    batch = Sym("batch", 2, 64)
    g = Guards(
        "fxtools.grad",
        ("x", "y"),
        (Leaf("x", "tensor", (batch, 4), torch.float32, "cpu"), Leaf("y", "tensor", (batch,), torch.int64, "cpu")),
    )
    for n in (2, 7, 64):
        assert len(g.check((torch.randn(n, 4), torch.zeros(n, dtype=torch.int64)))) == 2
    text = mismatch(g.check, (torch.randn(1, 4), torch.zeros(1, dtype=torch.int64)))
    assert text.startswith("fxtools.grad module: x.size(0) is 1, outside the range [2, 64] of the dynamic size batch")
    text = mismatch(g.check, (torch.randn(8, 4), torch.zeros(9, dtype=torch.int64)))
    assert "y.size(0) is 9, but x.size(0) is 8; both are the dynamic size batch" in text
    assert "x.size(1) is 5, but the module was made for 4" in mismatch(
        g.check, (torch.randn(8, 5), torch.zeros(8, dtype=torch.int64))
    )
    assert "  batch: any size in [2, 64]" in str(g)


# --------------------------------------------------------------------------------------------
# The other transforms
# --------------------------------------------------------------------------------------------


def test_jvp_tangents():
    def f(x, w):
        return torch.tanh(x @ w)

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    gm = fxtools.jvp(f, x, w)
    tx, tw = torch.randn_like(x), torch.randn_like(w)
    close(gm(x, w, tx, tw)[1], torch.func.jvp(f, (x, w), (tx, tw))[1])
    text = mismatch(gm, x, w, tx, torch.randn(4, 3, dtype=torch.float64))
    assert "tangent_w.size(1) is 3, but the module was made for 2" in text
    assert "it is the tangent of w, so it must have that value's shape and dtype (float64[4, 2])" in text


def test_hvp_and_hessian():
    def f(x):
        return (torch.sin(x) * x).mean()

    x = torch.randn(6, dtype=torch.float64)
    h = fxtools.hvp(f, x)
    v = torch.randn(6, dtype=torch.float64)
    close(h(x, v), torch.func.jvp(torch.func.grad(f), (x,), (v,))[1])
    assert "v.size(0) is 3, but the module was made for 6" in mismatch(h, x, torch.randn(3, dtype=torch.float64))
    assert "the vector v of the Hessian-vector product" in mismatch(h, x, torch.randn(3, dtype=torch.float64))
    assert mismatch(h, torch.randn(3, dtype=torch.float64), v).startswith("fxtools.hvp module: x.size(0) is 3")
    H = fxtools.hessian(f, x)
    close(H(x), torch.func.hessian(f)(x))
    assert mismatch(H, torch.randn(7, dtype=torch.float64)).startswith("fxtools.hessian module: x.size(0) is 7")


def test_vmap_and_per_sample_grads():
    loss, params, x, y = mean_mlp(8)

    def per_example(params, x, y):
        return loss(params, x.unsqueeze(0), y.unsqueeze(0))

    g = fxtools.grad(per_example, params, x[0], y[0])
    ps = fxtools.vmap(g, params, x, y, in_dims=(None, 0, 0))
    close(
        ps(params, x, y)["fc1.weight"],
        torch.func.vmap(torch.func.grad(per_example), in_dims=(None, 0, 0))(params, x, y)["fc1.weight"],
    )
    xb, yb = data(5)
    assert mismatch(ps, params, xb, yb).startswith("fxtools.vmap module: x.size(0) is 5, but the module was made for 8")
    # batching a module made for other per-example shapes refuses at once
    x3, y3 = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    text = mismatch(fxtools.vmap, g, params, x3, y3, in_dims=(None, 0, 0))
    assert text.startswith("fxtools.grad module: x.size(0) is 3, but the module was made for 4")


# --------------------------------------------------------------------------------------------
# split, save, compile
# --------------------------------------------------------------------------------------------


def test_split_forward_backward_and_boxed():
    loss, params, x, y = mean_mlp(32)
    sp = fxtools.split(loss, params, x, y)
    xb, yb = data(16)
    leaves = sp.flatten(params, x, y)
    assert "x.size(0) is 16, but the module was made for 32" in mismatch(sp.flatten, params, xb, yb)
    text = mismatch(sp.forward, *leaves[:-2], xb, yb)
    assert text.startswith("fxtools.split forward module: x.size(0) is 16, but the module was made for 32")
    wrong = dict(params, **{"fc1.weight": torch.randn(8, 5, dtype=torch.float64)})
    assert "params['fc1.weight'].size(1) is 5" in mismatch(sp.forward, *sp.flatten(params, x, y)[:0], *wrong.values(), x, y)
    out, saved = sp.forward(*leaves)
    ct = torch.ones((), dtype=torch.float64)
    text = mismatch(sp.backward, *saved, torch.ones(2, dtype=torch.float64))
    assert text.startswith("fxtools.split backward module: ")
    assert "the cotangent of out" in text
    args = [*saved, torch.ones(2, dtype=torch.float64)]
    assert "the cotangent of out" in mismatch(sp.backward_boxed, args)
    assert len(args) == len(saved) + 1  # refused before the list is emptied
    grads = sp.backward_boxed([*saved, ct])
    want = torch.func.grad(loss)(params, x, y)
    for k in want:
        close(grads[0][k], want[k])


def test_split_of_a_module_refuses_scalar_change_through_flatten():
    def f(x, scale):
        return (x * scale).sum()

    sp = fxtools.split(f, torch.randn(4), 2.0)
    assert "scale is float 3.0, but the module was made with scale = 2.0" in mismatch(sp.vjp, torch.randn(4), 3.0)
    assert torch.equal(sp.vjp(torch.ones(4), 2.0)[1][0], torch.full((4,), 2.0))


def test_saved_module_checks_in_a_fresh_interpreter(tmp_path):
    loss, params, x, y = mean_mlp(32)
    gm = fxtools.grad(loss, params, x, y)
    text = fxtools.save(gm, tmp_path / "meanmlp.py")
    assert "    forward_accepts.check((params, x, y))\n" in text
    assert text.index("def forward(") < text.index("class Guards")  # the derivative first
    xb, yb = data(16)
    torch.save((params, x, y, xb, yb, gm(params, x, y)), tmp_path / "io.pt")
    out = run_isolated(
        """
import torch, meanmlp
params, x, y, xb, yb, want = torch.load("io.pt")
got = meanmlp.forward(params, x, y)
assert all(torch.equal(got[k], want[k]) for k in want)
try:
    meanmlp.forward(params, xb, yb)
except ValueError as e:
    assert type(e).__name__ == "InputMismatch"
    print(e)
else:
    raise AssertionError("no error")
try:
    meanmlp.forward({k: v for k, v in params.items() if k != "fc2.bias"}, x, y)
except ValueError as e:
    print(e)
""",
        tmp_path,
    )
    first, second = out.strip().splitlines()
    assert first.startswith(
        "fxtools.grad module: x.size(0) is 16, but the module was made for 32 (x: made for shape [32, 4], got [16, 4])"
    )
    assert second.startswith(
        "fxtools.grad module: params must be a dict with keys ['fc1.weight', 'fc1.bias', "
        "'fc2.weight', 'fc2.bias'] (the structure the module was made for), got a dict "
        "without ['fc2.bias']"
    )


def test_saved_split_checks_both_functions(tmp_path):
    def f(x, w):
        return torch.tanh(x @ w).sum()

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    sp = fxtools.split(f, x, w)
    fxtools.save(sp, tmp_path / "sp.py")
    spec = importlib.util.spec_from_file_location("sp_saved", tmp_path / "sp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, saved = mod.forward(x, w)
    grads = mod.backward(*saved, torch.tensor(1.0, dtype=torch.float64))
    close(grads[1], torch.func.grad(f, argnums=1)(x, w))
    with pytest.raises(ValueError, match=r"fxtools.split forward module: x.size\(0\) is 5"):
        mod.forward(torch.randn(5, 4, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="the cotangent of out"):
        mod.backward(*saved, torch.ones(3, dtype=torch.float64))


def test_compile_picks_its_graphs_by_the_guards():
    def f(x, w, scale):
        return (torch.tanh(x @ w) * scale).mean()

    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    compiled = fxtools.compile(f)

    def step(x, scale):
        w.grad = None
        compiled(x, w, scale).backward()
        got = w.grad.clone()
        w.grad = None
        f(x, w, scale).backward()
        close(got, w.grad)

    x8, x5 = torch.randn(8, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    step(x8, 0.5)
    step(x5, 0.5)
    step(x8, 0.5)
    assert len(compiled._runners) == 2  # the batch-8 split served the third call
    step(x8, 3.0)  # a Python value the code is specialised to: a new split, not the 0.5 one
    assert len(compiled._runners) == 3
    sp = compiled._runners.entries[0][2].split
    assert "x.size(0) is 5" in mismatch(sp.guards.check, (x5, w, 0.5))


def test_plain_objects_are_guarded_by_their_attributes(tmp_path):
    """A config object the code reads (``c.scale``) is a constant: an equal new instance is
    accepted, a changed attribute is refused, in the module and in its saved form."""

    class Config:
        def __init__(self, scale):
            self.scale = scale

    x = torch.randn(3, dtype=torch.float64)
    gm = fxtools.grad(lambda x, c: (x * c.scale).sum(), x, Config(3.0))
    torch.testing.assert_close(gm(x, Config(3.0)), torch.full((3,), 3.0, dtype=torch.float64))
    assert "c is a Config whose attributes differ" in mismatch(gm, x, Config(5.0))
    assert "c is a Config whose attributes differ" in mismatch(gm, x, Config(3))  # an int, not the float 3.0
    fxtools.save(gm, tmp_path / "g.py")
    import importlib.util

    spec = importlib.util.spec_from_file_location("g_cfg", tmp_path / "g.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.testing.assert_close(mod.forward(x, Config(3.0)), torch.full((3,), 3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="attributes differ"):
        mod.forward(x, Config(5.0))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_a_module_writing_its_arguments_is_not_run_again_on_another_layout(transform):
    """A call stopped by a failed .view after the code wrote a buffer in place is refused, not
    run again by a module built for the layout (which would write the buffer twice)."""
    make, oracle = TRANSFORMS_OF_ARRAYS[transform]

    def f(x, buf):
        buf.add_(1.0)
        return torch.sin(x.reshape(-1)) * buf.sum()

    gm = make(f, torch.randn(4, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    xt, buf = torch.randn(3, 4, dtype=torch.float64).t(), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(InputMismatch, match="x has strides"):
        gm(xt, buf)
    assert buf.tolist() == [1.0, 1.0]  # written once, by the call that was stopped
    assert oracle(f)(xt, torch.zeros(2, dtype=torch.float64)).shape == (12, 4, 3)
