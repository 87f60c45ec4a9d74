"""The runtime of fxtools.compile and the torch.compile backend: saved values through PyTorch's
saved-tensor hooks (and freed after their last use), offload to CPU memory, and double backward
(create_graph=True) against eager autograd in float64."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools
from fxtools.cli import examples
from fxtools.training import saved as saved_mod
from fxtools.training.backend import _Runner
from fxtools.training.budget import allocated_peak

TOL = dict(rtol=1e-9, atol=1e-10)

pytestmark = pytest.mark.usefixtures("float64")


def identity_compiler(gm, example_inputs):
    """A compiler that returns the ATen graph itself (a stand-in for any compiler)."""
    return gm


def compiled(model, how):
    if how == "compile":
        return fxtools.compile(model)
    if how == "fw_compiler":
        return fxtools.compile(model, fw_compiler=identity_compiler)
    if how == "compiler":
        return fxtools.compile(model, compiler=identity_compiler)
    if how == "backend":
        return torch.compile(model, backend=fxtools.backend(), fullgraph=True)
    raise AssertionError(how)


class SavedSpy:
    """The saved values of every forward fxtools runs while active (``_Runner.run_forward``)."""

    def __enter__(self):
        self.original, self.saved = _Runner.run_forward, []
        spy = self

        def run_forward(runner, leaves):
            outs, saved = spy.original(runner, leaves)
            spy.saved.extend((tuple(s.shape), s.dtype, s.untyped_storage().data_ptr()) for s in saved)
            return outs, saved

        _Runner.run_forward = run_forward
        return self

    def __exit__(self, *exc):
        _Runner.run_forward = self.original


def packed_by_hooks(step):
    """Run ``step`` under a saved-tensor hook; what its pack function saw."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return seen


# --------------------------------------------------------------------------------------------
# saved-tensor hooks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["compile", "backend"])
def test_hooks_see_every_saved_value(how):
    """Every value the forward saves reaches the pack hook (as in eager), and the gradients under
    ``save_on_cpu`` are exact."""
    model, (x, targets) = examples.gpt("tiny", attention="explicit", n_layer=1, dtype=torch.float64)
    eager = copy.deepcopy(model)
    c = compiled(model, how)
    c(x, targets).backward()  # compile outside the hooks
    model.zero_grad()
    with SavedSpy() as spy:
        seen = packed_by_hooks(lambda: c(x, targets).backward())
    activations = [s for s in spy.saved if s[0] and s[1].is_floating_point]
    assert len(spy.saved) > 10 and len(activations) > 5
    assert seen == spy.saved  # each one, in order, the tensors themselves
    model.zero_grad()
    with torch.autograd.graph.save_on_cpu():
        c(x, targets).backward()
    eager(x, targets).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_backward_reads_what_unpack_returns():
    """A hook that stores a transformed copy (here x * 2, exact) gives exact gradients; an unpack
    that returns other values changes them: the backward uses what the hooks return."""
    model, (x, targets) = examples.mlp("gelu", dtype=torch.float64)
    c = fxtools.compile(model, x, targets)
    want = torch.autograd.grad(model(x, targets), list(model.parameters()))

    def grads(pack, unpack):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = c(x, targets)
        return torch.autograd.grad(loss, list(model.parameters()))

    def scaled(t, by):
        return t * by if t.is_floating_point() else t

    for g, w in zip(grads(lambda t: scaled(t, 2), lambda t: scaled(t, 0.5)), want):
        torch.testing.assert_close(g, w, **TOL)
    wrong = grads(lambda t: t, lambda t: scaled(t, 1.5))
    assert any(not torch.allclose(g, w) for g, w in zip(wrong, want))


def test_saved_values_freed_after_their_last_use():
    """The backward holds each saved activation only until its last use. Its last step allocates
    the embedding's gradient (4 MiB); by then the eight tanh outputs saved for the layers above
    (256 KiB each) are gone, unless the graph is retained (which keeps them all to the end)."""
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())]
    model, idx = nn.Sequential(nn.Embedding(8192, 64), *layers), torch.randint(0, 8192, (512,))
    c = fxtools.compile(model, idx)
    activation = 512 * 64 * 8

    def peak(retain):  # of the forward and the backward (the profiler sees frees of what it saw made)
        model.zero_grad(set_to_none=True)
        return allocated_peak(lambda: c(idx).square().sum().backward(retain_graph=retain))

    peak(False)  # warm up
    freed, kept = peak(False), peak(True)
    assert freed + 6 * activation < kept, (freed, kept)


def test_retain_graph_allows_a_second_backward():
    model, (x, targets) = examples.mlp("gelu", dtype=torch.float64)
    c = fxtools.compile(model, x, targets)
    loss = c(x, targets)
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for p, g in zip(model.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g, **TOL)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


# --------------------------------------------------------------------------------------------
# offload
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(6, 5),
        lambda: torch.randn(5, 6).t(),
        lambda: torch.randn(6, 8)[:, ::2],
        lambda: torch.randn(6, 1).expand(6, 5),
        lambda: torch.randn(3).view(1, 3, 1).expand(4, 3, 5),
        lambda: torch.tensor(2.5),
    ],
    ids=["contiguous", "transposed", "strided", "expanded", "expanded3", "scalar"],
)
def test_offload_round_trip_keeps_values_and_layout(make):
    t = make()
    host, place = saved_mod.to_host(t)
    assert host.device.type == "cpu" and host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert host.numel() <= max(1, t.untyped_storage().nbytes() // t.element_size())  # broadcast dims once
    back = saved_mod.to_device(host, place)
    assert back.device == t.device and back.shape == t.shape and back.stride() == t.stride()
    assert torch.equal(back, t)


def test_offload_every_saved_value_is_exact(monkeypatch):
    """A split whose saved values are all marked offload: each goes through the CPU copy and back,
    the hooks see the copies, and the gradients equal eager's."""
    model, (x, targets) = examples.gpt("tiny", attention="explicit", n_layer=1, dtype=torch.float64)
    eager = copy.deepcopy(model)
    sp = fxtools.split(model, x, targets, rules="fused")
    for info in sp.saved:
        info.offload = True
    calls = {"to_host": 0, "to_device": 0}
    for name in calls:
        original = getattr(saved_mod, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(saved_mod, name, counted)
    c = fxtools.compile(model, split=sp)
    seen = packed_by_hooks(lambda: c(x, targets).backward())
    assert calls == {"to_host": len(sp.saved), "to_device": len(sp.saved)}
    assert len(seen) == len(sp.saved) and all(s[0] == tuple(i.shape) for s, i in zip(seen, sp.saved))
    eager(x, targets).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------------------------
# double backward
# --------------------------------------------------------------------------------------------


def gradient_penalty(model, inputs, wrt):
    """``(penalty, its gradient)``: the squared norm of the gradient of the output's mean, as in
    WGAN-GP, and its gradient (a double backward) with respect to ``wrt``."""
    g = torch.autograd.grad(model(*inputs).mean(), wrt, create_graph=True, allow_unused=True, materialize_grads=True)
    penalty = sum((t**2).sum() for t in g)
    return penalty, torch.autograd.grad(penalty, wrt, allow_unused=True, materialize_grads=True)


def assert_penalty_matches_eager(model, c, inputs):
    x = inputs[0].detach().requires_grad_(inputs[0].is_floating_point())
    inputs = (x, *inputs[1:])
    eager = copy.deepcopy(model)
    wrt = [*model.parameters(), *([x] if x.requires_grad else [])]
    wrt_eager = [*eager.parameters(), *([x] if x.requires_grad else [])]
    got_p, got_g = gradient_penalty(c, inputs, wrt)
    want_p, want_g = gradient_penalty(eager, inputs, wrt_eager)
    torch.testing.assert_close(got_p, want_p, **TOL)
    assert any(g.abs().max() > 1e-3 for g in want_g)
    names = [n for n, _ in model.named_parameters()] + ["x"]
    for name, g, w in zip(names, got_g, want_g):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"grad of the penalty, {name}: {m}")
    for (name, b), e in zip(model.named_buffers(), eager.buffers()):  # updated once per forward
        torch.testing.assert_close(b, e, **TOL, msg=lambda m: f"buffer {name}: {m}")


@pytest.mark.parametrize("how", ["compile", "fw_compiler", "compiler", "backend"])
def test_gradient_penalty_mlp(how):
    model, inputs = examples.mlp("gelu", dtype=torch.float64)
    assert_penalty_matches_eager(model, compiled(model, how), inputs)


def test_gradient_penalty_conv_batchnorm():
    """BatchNorm in training: the replayed forward must not update the running statistics again."""
    model, inputs = examples.small_cnn(dtype=torch.float64)
    assert_penalty_matches_eager(model, compiled(model, "compile"), inputs)


@pytest.mark.parametrize("how", ["compiler", "backend"])
def test_gradient_penalty_gpt_block(how):
    config = examples.gpt_config("tiny", attention="explicit")
    torch.manual_seed(0)
    block = examples.Block(config).double()
    x = torch.randn(2, 8, config.n_embd)
    assert_penalty_matches_eager(block, compiled(block, how), (x,))


def test_third_order_through_hessian_vector_products():
    """create_graph twice: the gradient of <v, H w> (a third derivative) equals eager's."""
    model, (x, targets) = examples.mlp("gelu", n_hidden=8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    c = fxtools.compile(model, fw_compiler=identity_compiler)

    def third(m):
        params = list(m.parameters())
        v = [torch.ones_like(p) / (1 + i) for i, p in enumerate(params)]
        g = torch.autograd.grad(m(x, targets), params, create_graph=True)
        hv = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, v)), params, create_graph=True)
        return torch.autograd.grad(sum((h * h).sum() for h in hv), params)

    for got, want in zip(third(c), third(eager)):
        torch.testing.assert_close(got, want, **TOL)


def test_double_backward_keeps_detach_and_no_grad():
    """Values the program detaches (``.detach()``, ``torch.no_grad()``) are constants to every
    order, as in eager autograd (the split graphs themselves no longer mark them)."""

    def f(x, w):
        with torch.no_grad():
            s = (x * w).sum()
        d = x.detach() * 2
        return ((x * s).sin() * d * w).sum()

    x, w = torch.randn(5), torch.randn(5)
    c = fxtools.compile(f, x, w)
    results = []
    for fn in (f, c):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        g = torch.autograd.grad(fn(xr, wr), (xr, wr), create_graph=True)
        results.append([*g, *torch.autograd.grad(sum((t * t).sum() for t in g), (xr, wr))])
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, **TOL)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(F.dropout(torch.tanh(self.fc1(x)), 0.3, training=self.training))


def test_double_backward_replays_dropout_draws():
    """The replayed forward draws the forward's masks (the generator state is restored), and the
    generator is left as the forward left it."""
    torch.manual_seed(0)
    model, x = DropoutNet().double(), torch.randn(5, 6)
    c = fxtools.compile(model, x)
    eager = copy.deepcopy(model)
    params, params_e = list(model.parameters()), list(eager.parameters())
    torch.manual_seed(1)
    got = gradient_penalty(c, (x,), params)
    after = torch.get_rng_state()
    torch.manual_seed(1)
    want = gradient_penalty(eager, (x,), params_e)
    assert torch.equal(after, torch.get_rng_state())
    torch.testing.assert_close(got, want, **TOL)


def test_double_backward_refuses_what_it_cannot_replay():
    """A compiled forward that draws random numbers, a function with its own backward, an input
    modified in place since the forward: a clear error, never a number."""
    torch.manual_seed(0)
    model, x = DropoutNet().double(), torch.randn(5, 6)
    c = fxtools.compile(model, x, fw_compiler=identity_compiler)
    with pytest.raises(fxtools.FxtoolsError, match="draws random numbers"):
        gradient_penalty(c, (x,), list(model.parameters()))
    model.eval()
    gradient_penalty(c, (x,), list(model.parameters()))  # no dropout: fine

    class StraightThrough(torch.autograd.Function):  # its backward is not its forward's derivative
        @staticmethod
        def forward(ctx, t):
            return t.round()

        @staticmethod
        def backward(ctx, g):
            return g

    ste = fxtools.compile(lambda t: (StraightThrough.apply(3 * t) * t.sin()).sum(), x)
    xs = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(ste(xs), xs)  # first order: fine
    torch.testing.assert_close(g, 3 * xs.sin() + (3 * xs).round() * xs.cos())
    with pytest.raises(fxtools.FxtoolsError, match="function with its own backward"):
        torch.autograd.grad(ste(xs), xs, create_graph=True)

    xg = x.clone().requires_grad_()
    y = fxtools.compile(model.train(), xg)(xg).sum()
    with torch.no_grad():
        xg.mul_(2)
    with pytest.raises(fxtools.FxtoolsError, match="x modified in place"):
        torch.autograd.grad(y, xg, create_graph=True)


def test_offload_chosen_by_a_policy_is_exact():
    """A policy returning "offload" marks the saved values; fxtools.compile moves them and back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    compiled = fxtools.compile(model, x, policy=lambda node: "offload")
    assert any(s.offload for s in compiled.split.saved)
    compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
