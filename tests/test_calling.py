"""torch.func and JAX habits meet an error that shows the fxtools call that works; the small
conveniences around generated modules (their repr, check_vjp's defaults, Split.report, the CLI's
help, target and pipes)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools
from fxtools.cli.main import main
from fxtools.transforms.calling import CallError


def _f(x):
    return torch.sin(x).sum()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def _mlp():
    torch.manual_seed(0)
    model = MLP()
    return model, torch.randn(5, 4), torch.randint(0, 3, (5,))


TRANSFORMS = ["vjp", "grad", "value_and_grad", "jvp", "hvp", "hessian", "jacrev", "jacfwd", "linearize", "vmap", "split"]


@pytest.mark.parametrize("name", TRANSFORMS)
def test_every_entry_point_answers_swapped_arguments(name):
    with pytest.raises(
        CallError, match=rf"fxtools\.{name}'s first argument is the function.*look swapped.*fxtools\.{name}\(f, x\)"
    ):
        getattr(fxtools, name)(torch.randn(3), _f)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_every_entry_point_asks_for_example_inputs(name):
    with pytest.raises(CallError, match=rf"fxtools\.{name}\(f\) needs example inputs.*gm = fxtools\.{name}\(f, x\)"):
        getattr(fxtools, name)(_f)


@pytest.mark.parametrize("name", TRANSFORMS)
def test_examples_the_function_cannot_take_are_refused_naming_it(name):
    """Python's bare TypeError from inside the trace ("<lambda>() takes 1 positional argument but
    2 were given") becomes a CallError naming the function, its signature and the examples."""

    def two(x, y):
        return (x * y).sum()

    with pytest.raises(CallError, match=rf"fxtools\.{name}: .*two\(x, y\) cannot take the 1 example argument\(s\) given"):
        getattr(fxtools, name)(two, torch.randn(3))
    with pytest.raises(CallError, match=r"cannot take the 3 example argument\(s\) given \(too many positional"):
        getattr(fxtools, name)(two, torch.randn(3), torch.randn(3), torch.randn(3))


def test_torch_func_jvp_habit_is_answered_with_the_fxtools_call():
    x = torch.randn(3)
    with pytest.raises(CallError, match=r"gm = fxtools\.jvp\(f, \*primals\), then gm\(\*primals, \*tangents\) \(torch\.func"):
        fxtools.jvp(lambda x: x.sin(), (x,), (torch.ones_like(x),))
    with pytest.raises(CallError, match=r"MLP\.forward\(x, y\) cannot take"):
        fxtools.vjp(MLP(), torch.randn(5, 4))
    gm = fxtools.jvp(lambda *xs: sum(v.sin() for v in xs), x, x)  # *args takes any number
    torch.testing.assert_close(gm(x, x, x, x)[1], 2 * x.cos() * x)


def test_the_missing_inputs_message_says_how_the_module_is_called():
    with pytest.raises(CallError, match=r"out, grads = gm\(x, grad_out\)"):
        fxtools.vjp(_f)
    with pytest.raises(CallError, match=r"then grads = gm\(x\)"):
        fxtools.grad(_f)


def test_a_function_of_no_arguments_needs_none():
    w = torch.randn(3)
    out, grads = fxtools.vjp(lambda: w.sin())(torch.ones(3))
    torch.testing.assert_close(out, w.sin())
    assert grads == ()


def test_keywords_named_as_in_torch_func_or_jax_get_fxtools_names():
    x = torch.randn(3)
    with pytest.raises(CallError, match=r"unexpected keyword argument 'argnum'; fxtools calls it 'argnums'"):
        fxtools.grad(_f, x, argnum=0)
    with pytest.raises(CallError, match=r"'in_axes'; fxtools calls it 'in_dims'"):
        fxtools.vmap(torch.sin, x, in_axes=0)
    with pytest.raises(CallError, match=r"'out_axes'; fxtools calls it 'out_dims'"):
        fxtools.vmap(torch.sin, x, out_axes=0)
    with pytest.raises(CallError, match="'bogus', which is neither one of its options .* nor a parameter of the function _f"):
        fxtools.grad(_f, x, bogus=0)


def test_unpacking_a_vjp_module_says_how_to_call_it():
    x = torch.randn(3)
    with pytest.raises(TypeError, match=r"returns one module, not a pair.*out, grads = gm\(x, grad_loss\)"):
        out, fn = fxtools.vjp(_f, x)
    gm = fxtools.vjp(_f, x)
    with pytest.raises(fxtools.InputMismatch, match=r"takes 2 arguments \(x, grad_loss\), got 1.*gm\(x, grad_loss\)"):
        gm(torch.tensor(1.0))  # torch.func's vjp_fn(ct)


def test_a_generated_module_repr_says_what_it_is():
    gm = fxtools.grad(lambda x: x.sin().sum(), torch.randn(3))
    assert repr(gm) == "<fxtools.grad module: grads = gm(x); gm.code is its code, gm.guards what it accepts>"
    assert "<lambda>" not in repr(fxtools.vjp(lambda x: x.cos(), torch.randn(2)))


def test_parameters_without_names_are_refused_with_the_dict_to_pass():
    model, x, y = _mlp()
    loss = fxtools.functional(model)
    with pytest.raises(CallError, match=r"generator \(such as model.parameters\(\)\).*dict\(model.named_parameters\(\)\)"):
        fxtools.grad(loss, model.parameters(), x, y)
    with pytest.raises(TypeError, match=r"takes params as a dict.*got a list: pass dict\(model.named_parameters\(\)\)"):
        fxtools.grad(loss, list(model.parameters()), x, y)


@pytest.mark.parametrize("name", ["grad", "value_and_grad", "hvp", "hessian"])
def test_a_module_given_to_a_loss_transform_points_to_functional(name):
    model, x, y = _mlp()
    with pytest.raises(CallError, match=r"ambiguous.*fxtools\.functional\(model\).*model\.forward"):
        getattr(fxtools, name)(model, x, y)


def test_the_two_meanings_of_a_module_gradient():
    """Both calls the message offers work: the parameters' gradient equals the CLI's meaning
    (autograd on the parameters), the inputs' equals autograd on the inputs."""
    model, x, y = _mlp()
    params = dict(model.named_parameters())
    got = fxtools.grad(fxtools.functional(model), params, x, y)(params, x, y)
    want = torch.autograd.grad(model(x, y), list(params.values()))
    for k, w in zip(params, want):
        torch.testing.assert_close(got[k], w)
    xr = x.clone().requires_grad_()
    (want_x,) = torch.autograd.grad(model(xr, y), xr)
    torch.testing.assert_close(fxtools.grad(model.forward, x, y)(x, y), want_x)


def test_check_vjp_tolerances_follow_the_dtype_and_leaves_are_named_by_path():
    model, x, y = _mlp()
    params = dict(model.named_parameters())
    loss = fxtools.functional(model)
    fxtools.check_vjp(loss, params, x, y)  # float32: a correct module passes at float32's tolerances
    wrong = fxtools.vjp(lambda p, x, y: loss(p, x, y) * 1.01, params, x, y)
    with pytest.raises(fxtools.VjpMismatch, match=r"(?s)output mismatch:\n  out: "):
        fxtools.check_vjp(loss, params, x, y, gm=wrong)
    f64 = {k: v.double() for k, v in params.items()}
    w1 = "fc1.weight"  # the same value, another gradient for fc1.weight alone
    bad = fxtools.vjp(lambda p, x, y: loss(p, x, y) + (p[w1] - p[w1].detach()).sum(), f64, x.double(), y)
    with pytest.raises(fxtools.VjpMismatch, match=r"gradient of p\['fc1.weight'\]: max abs error") as info:
        fxtools.check_vjp(lambda p, x, y: fxtools.functional(model.double())(p, x, y), f64, x.double(), y, gm=bad)
    assert "fc2" not in str(info.value).split("gradient mismatch")[-1]


def test_split_report_is_shown_once_at_a_prompt(capsys):
    model, x, y = _mlp()
    sp = fxtools.split(model, x, y)
    text = sp.report()
    assert capsys.readouterr().out == ""  # returned, not printed: a prompt shows it once
    assert repr(text) == str(text) and text.startswith("fxtools.split (policy")
    assert "\n  " in repr(text)  # the text itself, lines and all, not a quoted string


def test_cli_help_example_can_be_copied(capsys):
    with pytest.raises(SystemExit):
        main(["grad", "--help"])
    out = capsys.readouterr().out
    assert "--arg y=i64[4]%3 " in out and "%%" not in out


def test_cli_target_in_two_words_suggests_the_colon(capsys):
    assert main(["grad", "model.py", "Net", "--arg", "x=f32[4,8]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "write model.py:Net" in err


def test_cli_output_into_a_closed_pipe_ends_quietly(tmp_path):
    big = tmp_path / "g.py"
    big.write_text("".join(f"x{i} = {i}\n" for i in range(200_000)))  # far beyond a pipe's buffer
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fxtools", "show", str(big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline() == b"x0 = 0\n"
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(timeout=600)
    assert err == "", err


def test_functional_still_takes_dicts_of_parameters_and_buffers():
    """As torch.func.functional_call: a tuple of mappings (parameters, buffers) is not refused."""
    model = nn.BatchNorm1d(3).eval()
    x = torch.randn(4, 3)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    got = fxtools.functional(model)((params, buffers), x)
    torch.testing.assert_close(got, model(x))


def test_a_build_leaves_the_garbage_collector_as_it_found_it():
    """Builds pause Python's cyclic collector (transforms/calling.cyclic_gc_paused) and give it back
    as it was: on after a nested build (hvp builds a grad inside) and after a refused call, off if
    the caller had turned it off; the module built still computes the Hessian-vector product."""
    import gc

    was = gc.isenabled()
    x, v = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    try:
        gc.enable()
        gm = fxtools.hvp(_f, x)
        assert gc.isenabled()
        with pytest.raises(ValueError):
            fxtools.grad(lambda x: x, x)  # not a scalar: refused while building
        assert gc.isenabled()
        gc.disable()
        fxtools.grad(_f, x)
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    torch.testing.assert_close(gm(x, v), torch.func.jvp(torch.func.grad(_f), (x,), (v,))[1])


def test_a_decorator_that_supplies_an_argument_is_not_refused():
    """``functools.wraps`` names the inner signature (x, scale); the wrapper takes x alone."""
    import functools

    def with_scale(f):
        @functools.wraps(f)
        def wrapper(x):
            return f(x, 2.0)

        return wrapper

    @with_scale
    def f(x, scale):
        return (x * scale).sin().sum()

    x = torch.randn(3)
    torch.testing.assert_close(fxtools.grad(f, x)(x), 2.0 * (2.0 * x).cos())
