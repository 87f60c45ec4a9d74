"""The public API: calling conventions, pytrees, naming, custom rules, checks and errors."""

import pytest
import torch
import torch.nn as nn

import fxtools
from fxtools.graph.nodes import count_compute_nodes

pytestmark = pytest.mark.usefixtures("float64")  # the oracle's precision, for every test here


def test_vjp_of_sin_plus_x_is_five_nodes_and_correct():
    x = torch.randn(13)
    gm = fxtools.vjp(lambda x: torch.sin(x) + x, x)
    assert count_compute_nodes(gm) <= 5
    assert "reshape" not in gm.code and "0 +" not in gm.code
    ct = torch.randn(13)
    out, (gx,) = gm(x, ct)
    torch.testing.assert_close(out, torch.sin(x) + x)
    torch.testing.assert_close(gx, ct * torch.cos(x) + ct)


def test_pytree_arguments_and_outputs():
    def f(d, xs, scale):
        return {"a": d["w"] * xs[0] * scale, "b": (xs[1].sin(), d["w"].sum())}

    args = ({"w": torch.randn(3)}, [torch.randn(3), torch.randn(2)], 2.0)
    gm = fxtools.check_vjp(f, *args)
    out, grads = gm(*args, fxtools.transforms.check.random_cotangent(f(*args)))
    assert set(out) == {"a", "b"}
    assert set(grads[0]) == {"w"} and len(grads[1]) == 2 and grads[2] is None


def test_integer_inputs_and_outputs_get_none():
    def f(x, idx):
        values, indices = torch.max(x[idx], dim=1)
        return values * 2, indices

    x, idx = torch.randn(4, 5), torch.tensor([0, 2, 2])
    gm = fxtools.vjp(f, x, idx)
    ct = torch.randn(3)
    (values, indices), (gx, gidx) = gm(x, idx, (ct, None))
    assert gidx is None and indices.dtype == torch.int64
    ref = torch.zeros(4, 5)
    xr = x.clone().requires_grad_()
    torch.autograd.backward(f(xr, idx)[0], ct)
    torch.testing.assert_close(gx, xr.grad)
    del ref


def test_grad_argnums_and_value_and_grad():
    def loss(w, x, b):
        return ((x @ w + b) ** 2).mean()

    w, x, b = torch.randn(4, 2), torch.randn(5, 4), torch.randn(2)
    gw = fxtools.grad(loss, w, x, b)(w, x, b)
    gw_ref = torch.func.grad(loss)(w, x, b)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-10, atol=1e-10)
    value, (gw2, gb) = fxtools.value_and_grad(loss, w, x, b, argnums=(0, 2))(w, x, b)
    ref_w, ref_b = torch.func.grad(loss, argnums=(0, 2))(w, x, b)
    torch.testing.assert_close(value, loss(w, x, b))
    torch.testing.assert_close((gw2, gb), (ref_w, ref_b), rtol=1e-10, atol=1e-10)


def test_grad_needs_scalar_output():
    with pytest.raises(ValueError, match="single floating-point tensor with one element"):
        fxtools.grad(lambda x: x * 2, torch.randn(3))


def test_output_aliasing_an_input_gets_its_cotangent():
    def f(x, w):
        return x * w, w

    x, w = torch.randn(3), torch.randn(3)
    gm = fxtools.vjp(f, x, w)
    c1, c2 = torch.randn(3), torch.randn(3)
    _, (gx, gw) = gm(x, w, (c1, c2))
    torch.testing.assert_close(gw, c1 * x + c2)
    torch.testing.assert_close(gx, c1 * w)


def test_unused_input_gets_zero_gradient():
    gm = fxtools.vjp(lambda x, y: x.exp(), torch.randn(3), torch.randn(2))
    _, (gx, gy) = gm(torch.zeros(3), torch.randn(2), torch.ones(3))
    torch.testing.assert_close(gy, torch.zeros(2))


def test_functional_module_names_parameters():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    named = nn.ModuleDict({"fc1": nn.Linear(4, 3)})
    f = fxtools.functional(named["fc1"])
    params = dict(named["fc1"].named_parameters())
    gm = fxtools.grad(lambda p, x: f(p, x).sum(), params, torch.randn(2, 4))
    assert "weight = params['weight']" in gm.code.replace("p['", "params['") or "weight" in gm.code
    g = fxtools.functional(model)
    params = dict(model.named_parameters())
    x = torch.randn(5, 4)
    gm = fxtools.grad(lambda p, x: g(p, x).pow(2).sum(), params, x)
    ref = torch.func.grad(lambda p, x: g(p, x).pow(2).sum())(params, x)
    got = gm(params, x)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-10)


def test_placeholders_named_from_parameter_paths():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc1(x).sin().sum()

    net = Net()
    f = fxtools.functional(net)
    gm = fxtools.grad(f, dict(net.named_parameters()), torch.randn(2, 4))
    assert "fc1_weight = params['fc1.weight']" in gm.code
    assert "grad_fc1_weight" in gm.code
    assert "arg0_1" not in gm.code


def test_register_vjp_replaces_a_rule():
    from fxtools import registry

    aten = torch.ops.aten
    old = registry.lookup(aten.sin.default)
    try:
        fxtools.register_vjp(aten.sin, lambda x: (torch.sin(x), torch.cos(x)), lambda cos_x, ct: ct * cos_x * 2)
        gm = fxtools.vjp(torch.sin, torch.randn(3))
        x, ct = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(gm(x, ct)[1][0], 2 * ct * torch.cos(x))
        with pytest.raises(fxtools.VjpMismatch):
            fxtools.check_vjp(torch.sin, torch.randn(3))
        with pytest.raises(fxtools.VjpMismatch):
            fxtools.check_vjp_fd(torch.sin, torch.randn(3))
    finally:
        registry._RULES[aten.sin] = old


def test_check_vjp_fd_passes_on_correct_code():
    fxtools.check_vjp_fd(lambda x, y: (x.sin() * y).tanh(), torch.randn(4), torch.randn(4))


def test_data_dependent_control_flow_names_the_line():
    def f(x):
        if x.sum() > 0:  # the offending line
            return x
        return -x

    with pytest.raises(fxtools.DataDependentError, match=r"test_api.py:\d+: if x.sum\(\) > 0"):
        fxtools.vjp(f, torch.randn(3))


def test_op_without_any_derivative_names_op_line_and_fix():
    lib = torch.library.Library("fxtools_test", "FRAGMENT")
    lib.define("mystery(Tensor x) -> Tensor")
    lib.impl("mystery", lambda x: x * 2, "CompositeExplicitAutograd")
    torch.library.register_fake("fxtools_test::mystery", lambda x: torch.empty_like(x), lib=lib)

    def f(x):
        return torch.ops.fxtools_test.mystery(x).sum()  # no derivative anywhere

    with pytest.raises(fxtools.MissingRuleError) as info:
        fxtools.grad(f, torch.randn(3))
    message = str(info.value)
    assert "fxtools_test.mystery" in message
    assert "test_api.py" in message and "mystery(x).sum()" in message
    assert "register_vjp" in message


def test_show_prints_shapes():
    import io

    buf = io.StringIO()
    fxtools.show(fxtools.vjp(lambda x: torch.sin(x) + x, torch.randn(13)), file=buf)
    assert "# f64[13]" in buf.getvalue()


def test_no_grad_regions_stop_gradients():
    def f(x):
        with torch.no_grad():
            s = x.sum()
        return x * s

    x = torch.randn(3)
    gm = fxtools.vjp(f, x)
    ct = torch.randn(3)
    _, (gx,) = gm(x, ct)
    torch.testing.assert_close(gx, ct * x.sum())


def test_module_called_directly_differentiates_its_inputs():
    model = nn.Linear(3, 2)
    gm = fxtools.vjp(model, torch.randn(4, 3))
    assert "weight" in gm.code
    fxtools.check_vjp(model, torch.randn(4, 3), gm=gm)


def test_outputs_keep_their_container_types():
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    torch.utils._pytree.register_dataclass(Pair)
    try:
        x = torch.randn(3)
        for f in [lambda x: collections.OrderedDict(s=x.sin(), c=x.cos()), lambda x: Pair(x.sin(), x.cos())]:
            out, (gx,) = fxtools.vjp(f, x)(x, torch.utils._pytree.tree_map(torch.ones_like, f(x)))
            assert type(out) is type(f(x))
            torch.testing.assert_close(gx, x.cos() - x.sin())
    finally:
        torch.utils._pytree._deregister_pytree_node(Pair)


def test_output_objects_that_are_not_pytrees_are_a_clear_error():
    class Cache:
        pass

    with pytest.raises(fxtools.FxtoolsError, match=r"return value\[1\] is a .*Cache"):
        fxtools.vjp(lambda x: (x.sin(), Cache()), torch.randn(3))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_functions_are_differentiated(reentrant):
    import torch.utils.checkpoint as cp

    def f(x, w):
        return cp.checkpoint(lambda x: torch.tanh(x @ w), x, use_reentrant=reentrant).sum()

    x, w = torch.randn(2, 3), torch.randn(3, 3)
    gx, gw = fxtools.grad(f, x, w, argnums=(0, 1))(x, w)
    want = torch.func.grad(lambda x, w: torch.tanh(x @ w).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(gx, want[0])
    torch.testing.assert_close(gw, want[1])


_GLOBAL_SCALE = torch.linspace(0.5, 1.5, 4)


def test_closed_over_tensors_are_named_after_their_variables():
    w = torch.randn(3, 4)
    head = nn.Linear(4, 2)

    def f(x):
        return head(torch.tanh(x @ w) * _GLOBAL_SCALE).sum()

    x = torch.randn(5, 3)
    gm = fxtools.grad(f, x)
    for name in ("w = self.w", "GLOBAL_SCALE = self.GLOBAL_SCALE", "head_weight = self.head_weight"):
        assert name in gm.code, name
    assert "_tensor_constant" not in gm.code
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(xr), xr)
    torch.testing.assert_close(gm(x), want)
