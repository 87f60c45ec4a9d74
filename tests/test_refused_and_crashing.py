"""Programs that crashed unclearly or were refused though reasonable, each now exact against
torch.func / torch.autograd in float64 (or a clear error): keyword arguments, module arguments,
dicts in another key order, torch.cond under vmap, writes through ``.real``, BatchNorm's
cumulative average, names of a saved module's arguments, scans traced one after another, and the
CLI on a file that exits at import."""

import copy
import importlib.util

import pytest
import torch
from torch._higher_order_ops.scan import scan

import fxtools
from fxtools.cli.main import main

pytestmark = pytest.mark.usefixtures("float64")

TOL = dict(rtol=1e-10, atol=1e-12)


def test_keyword_arguments_pass_through_undifferentiated():
    def f(x, w=None, scale=1.0):
        return (x * scale * w).sin().sum()

    x, w = torch.randn(4, 3), torch.randn(3)
    gm = fxtools.grad(f, x, scale=2.0, w=w)
    torch.testing.assert_close(gm(x, scale=2.0, w=w), torch.func.grad(f)(x, scale=2.0, w=w), **TOL)
    w2 = torch.randn(3)  # a tensor keyword is an input of the code
    torch.testing.assert_close(gm(x, w=w2, scale=2.0), torch.func.grad(f)(x, w=w2, scale=2.0), **TOL)
    with pytest.raises(fxtools.InputMismatch, match="scale"):
        gm(x, scale=3.0, w=w)
    (value, g) = fxtools.value_and_grad(f, x, w=w, scale=0.5)(x, w=w, scale=0.5)
    torch.testing.assert_close(value, f(x, w=w, scale=0.5), **TOL)


def test_module_argument_is_read_as_state():
    lin = torch.nn.Linear(3, 2)

    def f(m, x):
        return m(x).tanh().sum()

    x = torch.randn(4, 3)
    gm = fxtools.grad(f, lin, x, argnums=1)
    torch.testing.assert_close(gm(lin, x), torch.func.grad(f, argnums=1)(lin, x), **TOL)
    lin.weight = torch.nn.Parameter(torch.randn(2, 3))
    torch.testing.assert_close(gm(lin, x), torch.func.grad(f, argnums=1)(lin, x), **TOL)
    with pytest.raises(fxtools.InputMismatch, match="m is a Linear other than"):
        gm(torch.nn.Linear(3, 2), x)
    with pytest.raises(ValueError, match=r"fxtools.functional\(m\)"):
        fxtools.grad(f, lin, x, argnums=0)


def test_dict_arguments_in_another_key_order_follow_the_call():
    def f(d):
        return {k: v.sin() * 2 for k, v in d.items()}

    x = torch.randn(3)
    d = {"a": x, "b": x * 2}
    gm = fxtools.grad(lambda d: (d["a"] * 2 + d["b"].sin()).sum(), d)
    d2 = {"b": torch.randn(3), "a": torch.randn(3)}
    want = torch.func.grad(lambda d: (d["a"] * 2 + d["b"].sin()).sum())(d2)
    got = gm(d2)
    assert list(got) == list(want) == ["b", "a"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)
    v = fxtools.vjp(f, d)
    ct = {"b": torch.randn(3), "a": torch.randn(3)}  # torch.func wants the output's order
    out, (grads,) = v(d2, ct)
    want_out, pull = torch.func.vjp(f, d2)
    (want_g,) = pull(ct)
    assert list(out) == list(want_out) and list(grads) == list(want_g) == ["b", "a"]
    for k in want_g:
        torch.testing.assert_close(grads[k], want_g[k], **TOL)


def _branchy(x):
    return torch.cond(x.sum() > 0, lambda x: x.sin() * x.sum(0), lambda x: x.cos() + x.sum(1, keepdim=True), (x,))


def _branchy_eager(x):
    return x.sin() * x.sum(0) if x.sum() > 0 else x.cos() + x.sum(1, keepdim=True)


def test_cond_under_vmap_jacrev_and_hessian():
    x = torch.randn(4, 3, 2)
    x[::2] *= -1  # both branches among the samples
    torch.testing.assert_close(fxtools.vmap(_branchy, x)(x), torch.func.vmap(_branchy)(x), **TOL)
    x0 = x[0]

    def loss(x):
        return _branchy(x).pow(2).sum()

    def loss_eager(x):
        return _branchy_eager(x).pow(2).sum()

    jac, hess = fxtools.jacrev(_branchy, x0), fxtools.hessian(loss, x0)
    for y in (x0, -x0):
        torch.testing.assert_close(jac(y), torch.func.jacrev(_branchy_eager)(y), **TOL)
        torch.testing.assert_close(hess(y), torch.func.hessian(loss_eager)(y), **TOL)


def test_cond_whose_branches_reduce_different_dims():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x.sum(0), lambda x: x.sum(1), (x,)).pow(2).sum()

    def eager(x):
        return (x.sum(0) if x.sum() > 0 else x.sum(1)).pow(2).sum()

    x = torch.randn(3, 3)
    gm, hv = fxtools.grad(f, x), fxtools.hvp(f, x)
    for y in (x, -x):
        torch.testing.assert_close(gm(y), torch.func.grad(eager)(y), **TOL)
        torch.testing.assert_close(hv(y, x), torch.func.jvp(torch.func.grad(eager), (y,), (x,))[1], **TOL)


@pytest.mark.parametrize("part", ["real", "imag", "view_as_real", "real_slice"])
def test_inplace_write_through_a_complex_part_of_an_intermediate(part):
    def f(x):
        y = (x * 1j).exp() * x
        if part == "real":
            y.real.add_(x.sin())
        elif part == "imag":
            y.imag.mul_(x)
        elif part == "view_as_real":
            torch.view_as_real(y)[..., 1].add_(x)
        else:
            y.real[1:].mul_(3)
        return (y * y.conj()).real.sum() + y.imag.sum()

    x = torch.randn(4, 3)
    gm = fxtools.grad(f, x)
    for y in (x, torch.randn(4, 3)):
        torch.testing.assert_close(gm(y), torch.func.grad(f)(y), **TOL)


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5)])
def test_batch_norm_cumulative_average_in_training(shape):
    bn = torch.nn.BatchNorm1d(3, momentum=None)
    eager = copy.deepcopy(bn)
    gm = fxtools.grad(lambda x: bn(x).pow(3).sum(), torch.randn(*shape))
    assert int(bn.num_batches_tracked) == 0  # building runs nothing
    for _ in range(3):
        x = torch.randn(*shape)
        xe = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(eager(xe).pow(3).sum(), xe)
        torch.testing.assert_close(gm(x), want, **TOL)
        torch.testing.assert_close(bn.running_mean, eager.running_mean, **TOL)
        torch.testing.assert_close(bn.running_var, eager.running_var, **TOL)
        assert int(bn.num_batches_tracked) == int(eager.num_batches_tracked)


@pytest.mark.parametrize("name", ["InputMismatch", "Sym", "Node", "Leaf", "Guards", "Tensor", "forward_accepts", "constants"])
def test_saved_module_arguments_named_like_its_own_globals(name, tmp_path):
    namespace = {"torch": torch}
    exec(f"def f({name}, y):\n    return ({name} * y).sin().sum()\n", namespace)
    x = torch.randn(4, 3)
    gm = fxtools.grad(namespace["f"], x, x, argnums=(0, 1))
    path = tmp_path / f"saved_{name}.py"
    fxtools.save(gm, path)
    spec = importlib.util.spec_from_file_location(f"saved_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for got, want in zip(module.forward(x, x), torch.func.grad(namespace["f"], argnums=(0, 1))(x, x)):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="size"):
        module.forward(x[:2], x)


def test_scans_with_different_carries_one_after_another():
    def tuple_carry(x):
        def step(c, xs):
            a, b = c
            return (a + xs, b * xs), a.sin()

        (a, b), ys = scan(step, (x[0], x[0]), x)
        return ys.sum() + a.sum() + b.sum()

    def one_carry(x):
        def step(c, xs):
            return c * xs, c.cos()

        c, ys = scan(step, x[0], x)
        return ys.sum() + c.sum()

    x = torch.randn(4, 3)
    for f in (tuple_carry, one_carry):
        xe = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(f(xe), xe)
        torch.testing.assert_close(fxtools.grad(f, x)(x), want, **TOL)


def test_cli_on_a_file_that_exits_at_import(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "script.py").write_text("import sys\n\ndef f(x):\n    return x.sin().sum()\n\nsys.exit(3)\n")
    assert main(["grad", "script.py:f", "--arg", "x=f32[3]"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[fxtools]")]
    assert len(err) == 1 and "sys.exit(3)" in err[0] and "script.py:6" in err[0], err
