"""Held-out programs (batch h): module hooks, autocast regions, compiled and hostile corners.

Each test is a program that gave a silent wrong answer, a crash or a false refusal before its
fix; the oracle is eager PyTorch on the same computation (float64 where the program allows).
"""

import pytest
import torch
import torch.nn as nn

import fxtools

D = torch.float64

# --- hooks added to or removed from a closed-over module after the module was made: the trace ran
# the old hooks, so the code silently kept (or missed) them ---


def _hooked():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


@pytest.mark.parametrize("change", ["remove", "add", "add_global"])
def test_a_hook_changed_after_the_module_was_made_is_refused(change):
    m = _hooked()
    handle = m[1].register_forward_hook(lambda mod, args, out: out * 2)
    x = torch.randn(5, 3, dtype=D)

    def f(x):
        return m(x).sin().sum()

    gm = fxtools.grad(f, x)
    torch.testing.assert_close(gm(x), torch.func.grad(f)(x))
    if change == "remove":
        handle.remove()
    elif change == "add":
        handle = m[0].register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    else:
        handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: out)
    try:
        with pytest.raises(fxtools.InputMismatch, match="hooks registered on"):
            gm(x)
    finally:
        handle.remove()


def test_compile_refuses_a_forward_hook_added_after_it_was_made():
    m = _hooked()
    x = torch.randn(5, 3, dtype=D)
    compiled = fxtools.compile(m, x)
    torch.testing.assert_close(compiled(x), m(x))
    m[1].register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(fxtools.InputMismatch, match=r"hooks registered on Sequential\.1"):
        compiled(x)


# --- full backward hooks: fxtools.compile silently left them out of the gradients, fxtools.grad
# crashed inside PyTorch ("Error while setting up backward hooks"); refused, naming the module ---


@pytest.mark.parametrize("pre", [False, True])
def test_a_module_with_a_backward_hook_is_refused(pre):
    m = _hooked()
    if pre:
        m[2].register_full_backward_pre_hook(lambda mod, grad_out: (grad_out[0] * 5,))
    else:
        m[0].register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * 2,))
    x = torch.randn(5, 3, dtype=D, requires_grad=True)
    with pytest.raises(fxtools.FxtoolsError, match="calls Linear, which has backward hooks"):
        fxtools.compile(m, x)
    with pytest.raises(fxtools.FxtoolsError, match="test_heldout_h.py.*which has backward hooks"):
        fxtools.grad(lambda x: m(x).sum(), x.detach())


# --- torch.autocast inside the program: the rules saw ``bf16 = f32 @ f32`` (autocast casts at
# dispatch) and the gradient's code multiplied bf16 by float32 (a crash) ---


def _autocast_program(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        with torch.autocast("cpu", enabled=False):
            q = y.float().sin()
    return (y.float() * x.sum(-1, keepdim=True)).sum() + q.pow(2).mean()


def test_an_autocast_region_is_differentiated_as_eager():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    want = torch.func.grad(_autocast_program, argnums=(0, 1))(x, w)
    gm = fxtools.grad(_autocast_program, x, w, argnums=(0, 1))
    assert "bfloat16" in gm.code
    for got in (
        gm(x, w),
        torch.autograd.grad(fxtools.compile(_autocast_program, x, w)(*[t.requires_grad_() for t in (x, w)]), (x, w)),
    ):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b)


# --- requires_grad_(False) on a leaf inside the program (freezing a weight for one use): eager's
# later uses carry no gradient until requires_grad_(True); fxtools differentiated them ---


def _toggling(x):
    a = x.sin().sum()
    x.requires_grad_(False)
    b = (x * x).sum()
    x.requires_grad_(True)
    return a + b + x.sum()


def test_a_leaf_set_requires_grad_false_carries_no_gradient_until_set_back():
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, generator=g, dtype=D), torch.randn(3, generator=g, dtype=D)
    eager = x.clone().requires_grad_()
    _toggling(eager).backward()
    torch.testing.assert_close(fxtools.grad(_toggling, x)(x), eager.grad)
    compiled = x.clone().requires_grad_()
    fxtools.compile(_toggling, x.clone().requires_grad_())(compiled).backward()
    torch.testing.assert_close(compiled.grad, eager.grad)
    with torch.autograd.forward_ad.dual_level():  # forward mode ignores requires_grad, as no_grad
        dual = torch.autograd.forward_ad.make_dual(x.clone(), t)
        want = torch.autograd.forward_ad.unpack_dual(_toggling(dual)).tangent
    torch.testing.assert_close(fxtools.jvp(_toggling, x)(x, t)[1], want)


def test_compile_of_a_model_freezing_its_weight_for_one_call():
    torch.manual_seed(0)
    models = [nn.Linear(3, 3).double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(2, 3, dtype=D)

    def program(m):
        def f(x):
            m.weight.requires_grad_(False)
            y = m(x)
            m.weight.requires_grad_(True)
            return (y * m(x)).sum()

        return f

    fxtools.compile(program(models[0]), x)(x).backward()
    program(models[1])(x).backward()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# --- torch.compile(dynamic=True) passes a module's floats (batch norm's eps, momentum) as 0-dim
# tensors read by .item(): the backend traced an unbacked float and refused batch norm's
# `if eps <= 0` as data-dependent control flow ---


def test_backend_dynamic_takes_batch_norm_in_training_and_its_float_attributes():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3)).double()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxtools.backend(), dynamic=True)
    for batch, length, momentum in [(4, 5, 0.1), (3, 2, 0.5)]:
        model[0].momentum = eager[0].momentum = momentum
        x = torch.randn(batch, 3, length, dtype=D)
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        for p, q in zip(model.buffers(), eager.buffers()):
            torch.testing.assert_close(p, q)


# --- a closed-over list (or an object's list) of modules or tensors: the walk did not look inside,
# so an appended layer, a replaced module or a rebound tensor was silently ignored ---


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(3, 3).double() for _ in range(2)]


def test_a_closed_over_list_of_layers_is_guarded():
    layers = _layers()

    def f(x):
        for layer in layers:
            x = layer(x).tanh()
        return x.sum()

    x = torch.randn(2, 3, dtype=D)
    gm = fxtools.grad(f, x)
    layers[1].weight = nn.Parameter(torch.randn(3, 3, dtype=D))  # read in its place, as a module's parameter
    torch.testing.assert_close(gm(x), torch.func.grad(f)(x))
    layers.append(nn.Linear(3, 3).double())
    with pytest.raises(fxtools.InputMismatch, match="the length of layers"):
        gm(x)


def test_a_list_of_tensors_is_read_by_reference_and_an_objects_list_guarded():
    ws = [torch.randn(3, dtype=D)]

    def f(x):
        return (x * ws[0]).sum()

    x = torch.randn(3, dtype=D)
    gm = fxtools.grad(f, x)
    ws[0] = torch.randn(3, dtype=D)
    torch.testing.assert_close(gm(x), ws[0])

    class Config:
        pass

    cfg = Config()
    cfg.layers = _layers()
    g = fxtools.grad(lambda x: sum(layer(x).sum() for layer in cfg.layers), x)
    cfg.layers[0] = nn.Linear(3, 3).double()
    with pytest.raises(fxtools.InputMismatch, match=r"cfg\.layers\[0\]"):
        g(x)


# --- fxtools.compile(..., example_kwargs=..., dynamic=True): the keyword arguments' dynamic_shapes
# were given to torch.export in a form it does not match (a crash at the first call) ---


def _keyword_loss(x, *, k=None, scale=1.0):
    return (x * k).tanh().sum() * scale


def test_compile_dynamic_with_keyword_tensors_at_other_batch_sizes():
    g = torch.Generator().manual_seed(0)
    x, k = torch.randn(4, 3, generator=g, dtype=D), torch.randn(4, 3, generator=g, dtype=D)
    compiled = fxtools.compile(_keyword_loss, x, example_kwargs={"k": k, "scale": 2.0}, dynamic=True)
    for batch in (4, 5):
        x, k = torch.randn(batch, 3, generator=g, dtype=D), torch.randn(batch, 3, generator=g, dtype=D)
        got_x = x.clone().requires_grad_()
        got = compiled(got_x, k=k, scale=2.0)
        (grad,) = torch.autograd.grad(got, got_x)
        torch.testing.assert_close(got, _keyword_loss(x, k=k, scale=2.0))
        torch.testing.assert_close(grad, torch.func.grad(_keyword_loss)(x, k=k, scale=2.0))
