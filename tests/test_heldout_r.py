"""Held-out programs (batch r): model idioms (hooks, parametrizations, checkpointing, attention
masks, recurrent layers, spectral features, linear algebra) through grad, vjp, jvp, split, compile
and the torch.compile backend.

Each test is a program that crashed or was refused before its fix; the oracle is PyTorch in float64
(torch.autograd, torch.func):

- A generated module whose code scatters into a complex tensor (``slice_scatter`` /
  ``select_scatter``: PyTorch's backward of ``torch.fft.rfft`` pads the half spectrum so, the VJP of a
  complex slice, a write into one) failed when autograd ran it ("slice_scatter does not support
  automatic differentiation for outputs with complex dtype"): a gradient module called with a
  model's parameters, autograd over a generated gradient, ``fxtools.vjp`` / ``jvp`` of a module
  whose parameters require grad. Such scatters are now written on ``view_as_real`` views
  (``passes/complex_scatters.py``).
- Forward hooks that stash activations in a list of the model (``self.feats.append(out)``, read by
  the loss later in the same call: deep supervision, perceptual losses) left the trace's
  FakeTensors in that list: ``copy.deepcopy(model)`` and any read of the list failed afterwards.
  Module attributes holding traced values get their values from before the trace back
  (``capture/trace.py``, ``_module_state_restored``).
- ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` of several layers with ``dropout`` in training computed no
  dropout at all: PyTorch's decomposition of these ops, which fxtools traces, sets the dropout to
  0 for every layer. They are traced one layer at a time with eager's dropout between
  (``capture/replacements.py``), drawing eager's masks.
- ``torch.linalg.lstsq(A, B)`` with its default CPU driver (``gelsy``), whose output shapes are
  static, was refused as data-dependent (PyTorch's fake kernel calls every driver so); a fake kernel
  gives its shapes (``capture/fake_kernels.py``).
"""

import copy

import pytest
import torch
import torch.nn as nn

import fxtools

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
TOL = dict(rtol=1e-9, atol=1e-10)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --- complex scatters run by autograd -------------------------------------------------------


def _spectral(w, x):
    """A spectral feature loss: rfft magnitudes, a phase shift and back, a slice of the spectrum
    and a write into a complex slice."""
    z = torch.fft.rfft(x * w[0], dim=-1)
    mag = (z.abs() + 1e-3) ** 1.5
    shifted = z * torch.exp(1j * w[1] * torch.arange(z.shape[-1]))
    back = torch.fft.irfft(shifted, n=x.shape[-1], dim=-1)
    y = z.clone()
    y[:, 1:3] = z[:, 1:3] * w[2]  # a write into a complex slice
    y[:, 0] = z[:, 0] * w[0]  # and into a complex select
    return mag.sum() + (back.tanh() * x).sum() + (y[:, :4].abs() ** 2).sum()


def test_complex_scatters_run_under_autograd():
    x = torch.randn(3, 8, generator=_gen(0))
    w = torch.tensor([0.9, 0.3, -1.2])
    gm = fxtools.grad(_spectral, w, x)
    want = torch.func.grad(_spectral)(w, x)
    torch.testing.assert_close(gm(w, x), want, **TOL)
    # called with a parameter that requires grad: autograd runs the generated code
    p = nn.Parameter(w.clone())
    g = gm(p, x)
    torch.testing.assert_close(g, want, **TOL)
    # autograd over the generated gradient is eager's double backward
    v = torch.tensor([0.5, -1.0, 2.0])
    (hv,) = torch.autograd.grad(g, p, v)
    want_hv = torch.func.jvp(lambda w: torch.func.grad(_spectral)(w, x), (w,), (v,))[1]
    torch.testing.assert_close(hv, want_hv, **TOL)
    # another batch size, a strided input
    x2 = torch.randn(5, 8, 2, generator=_gen(1))[..., 0]
    gm2 = fxtools.grad(_spectral, w, x2.contiguous())
    torch.testing.assert_close(gm2(p, x2), torch.func.grad(_spectral)(w, x2), **TOL)


class _Spectrogram(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([0.8]))
        self.proj = nn.Linear(9, 2)

    def forward(self, x):
        spec = torch.stft(x * self.gain, n_fft=16, hop_length=4, window=torch.hann_window(16), return_complex=True)
        return self.proj((spec.abs() + 1e-3).log().transpose(1, 2)).sum()


def test_vjp_jvp_of_a_module_with_parameters_through_rfft_and_stft():
    """``fxtools.vjp`` / ``jvp`` of a module: its parameters require grad while fxtools traces."""
    model = _Spectrogram()
    x = torch.randn(2, 64, generator=_gen(2))
    out, (gx,) = fxtools.vjp(model, x)(x, torch.ones(()))
    xr = x.clone().requires_grad_()
    want = model(xr)
    (want_gx,) = torch.autograd.grad(want, xr)
    torch.testing.assert_close(out, want.detach(), **TOL)
    torch.testing.assert_close(gx, want_gx, **TOL)
    t = torch.randn(2, 64, generator=_gen(3))
    _, tangent = fxtools.jvp(model, x)(x, t)
    params = {k: v.detach() for k, v in model.named_parameters()}
    _, want_t = torch.func.jvp(lambda x: torch.func.functional_call(model, params, (x,)), (x,), (t,))
    torch.testing.assert_close(tangent, want_t, **TOL)
    # trained through fxtools.compile: the parameters' gradients are eager's
    compiled = fxtools.compile(model, x)
    for batch in (x, torch.randn(3, 64, generator=_gen(4))):
        model.zero_grad()
        loss = compiled(batch)
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(batch).backward()
        torch.testing.assert_close(loss.detach(), model(batch).detach(), **TOL)
        for a, b in zip(got, (p.grad for p in model.parameters())):
            torch.testing.assert_close(a, b, **TOL)


# --- torch.linalg.lstsq with its default driver ------------------------------------------------


def _fit(A, b):
    sol = torch.linalg.lstsq(A, b).solution
    return (sol.sin() * torch.linspace(0.5, 1.5, sol.shape[-1])).sum()


@pytest.mark.parametrize("shape", [(6, 3), (3, 5)], ids=["tall", "wide"])
def test_lstsq_default_driver_is_traced(shape):
    A = torch.randn(*shape, generator=_gen(5))
    b = torch.randn(shape[0], 2, generator=_gen(6))
    torch.testing.assert_close(fxtools.grad(_fit, A, b)(A, b), torch.func.grad(_fit)(A, b), **TOL)
    torch.testing.assert_close(fxtools.hessian(_fit, A, b)(A, b), torch.func.hessian(_fit)(A, b), **TOL)
    # per-sample gradients over a batch of systems
    As = torch.randn(4, *shape, generator=_gen(7))
    bs = torch.randn(4, shape[0], 2, generator=_gen(8))
    per = fxtools.vmap(fxtools.grad(_fit, A, b), As, bs)(As, bs)
    torch.testing.assert_close(per, torch.func.vmap(torch.func.grad(_fit))(As, bs), **TOL)
    # batched systems and a vector right-hand side, through a module's training step
    layer = nn.Linear(shape[1], shape[0])

    def loss(A, b):
        return _fit(A + layer.weight * 0.1, b)

    step = fxtools.compile(loss, As, bs[..., 0])
    got = step(As, bs[..., 0])
    got.backward()
    g = layer.weight.grad.clone()
    layer.weight.grad = None
    want = loss(As, bs[..., 0])
    want.backward()
    torch.testing.assert_close(got.detach(), want.detach(), **TOL)
    torch.testing.assert_close(g, layer.weight.grad, **TOL)


def test_lstsq_drivers_returning_rank_dependent_residuals_name_the_line():
    A = torch.randn(6, 3, generator=_gen(9))
    b = torch.randn(6, 2, generator=_gen(10))

    def f(A):
        return torch.linalg.lstsq(A, b, driver="gelsd").solution.sum()

    with pytest.raises(fxtools.DataDependentError, match=r"test_heldout_r\.py:\d+.*driver='gels'"):
        fxtools.grad(f, A)
    # a wide A has no residuals: traced
    Aw, bw = A.t().contiguous(), b[:3]

    def g(A):
        return torch.linalg.lstsq(A, bw, driver="gelsd").solution.sin().sum()

    torch.testing.assert_close(fxtools.grad(g, Aw)(Aw), torch.func.grad(g)(Aw), **TOL)


# --- forward hooks stashing activations ----------------------------------------------------------


class _DeepSupervision(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 2))
        self.feats = []
        self.seen = {}
        for i in (0, 2):
            self.body[i].register_forward_hook(lambda m, inp, out, i=i: self.feats.append(out))
        self.body[4].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
        self.body[2].register_forward_hook(lambda m, args, kwargs, out: out + args[0].mean(), with_kwargs=True)

    def forward(self, x):
        self.feats.clear()
        out = self.body(x)
        self.seen["last"] = out  # a dict entry, the same
        return (out**2).sum() + sum((f**2).mean() for f in self.feats)


def _eager_grads(model, x):
    model.zero_grad()
    loss = model(x)
    loss.backward()
    model.feats.clear()  # eager's stash holds non-leaf tensors, which deepcopy refuses
    model.seen.clear()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_forward_hooks_stashing_activations_leave_no_traced_values():
    torch.manual_seed(0)
    model = _DeepSupervision()
    x = torch.randn(3, 4, generator=_gen(11))
    want_loss, want = _eager_grads(model, x)
    params = dict(model.named_parameters())
    g = fxtools.grad(fxtools.functional(model), params, x)
    assert model.feats == [] and model.seen == {}
    for a, b in zip(g(params, x).values(), want):
        torch.testing.assert_close(a, b, **TOL)
    out, (gx,) = fxtools.vjp(model, x)(x, torch.ones(()))
    torch.testing.assert_close(out, want_loss, **TOL)
    compiled = fxtools.compile(model, x)
    assert model.feats == [] and model.seen == {}
    copy.deepcopy(model)  # failed on the FakeTensors
    for batch in (x, torch.randn(5, 4, generator=_gen(12))):
        want_loss, want = _eager_grads(model, batch)
        model.zero_grad()
        loss = compiled(batch)
        loss.backward()
        torch.testing.assert_close(loss.detach(), want_loss, **TOL)
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, w, **TOL)


# --- recurrent layers with dropout between layers ---------------------------------------------


@pytest.mark.parametrize(
    "layer",
    [
        lambda: nn.LSTM(4, 5, num_layers=2, dropout=0.4, batch_first=True, proj_size=3),
        lambda: nn.GRU(4, 5, num_layers=2, dropout=0.4, bidirectional=True),
    ],
    ids=["lstm_batch_first_proj", "gru_bidirectional"],
)
def test_recurrent_dropout_between_layers_draws_eagers_masks(layer):
    torch.manual_seed(0)
    rnn = layer()

    def loss(x):
        out, h = rnn(x)
        h = h[0] + h[1].sum() if isinstance(h, tuple) else h
        return (out**2).sum() + h.sin().sum()

    x = torch.randn(2, 3, 4, generator=_gen(13))
    torch.manual_seed(5)
    xr = x.clone().requires_grad_()
    want = loss(xr)
    (want_gx,) = torch.autograd.grad(want, xr)
    gm = fxtools.vjp(loss, x)
    torch.manual_seed(5)
    out, (gx,) = gm(x, torch.ones(()))
    torch.testing.assert_close(out, want.detach(), **TOL)
    torch.testing.assert_close(gx, want_gx, **TOL)
    # a training step through fxtools.compile, seeded as eager's
    step = fxtools.compile(loss, x)
    for seed, batch in ((7, x), (8, torch.randn(2, 3, 4, generator=_gen(14)))):
        rnn.zero_grad()
        torch.manual_seed(seed)
        got = step(batch)
        got.backward()
        grads = [p.grad.clone() for p in rnn.parameters()]
        rnn.zero_grad()
        torch.manual_seed(seed)
        want = loss(batch)
        want.backward()
        torch.testing.assert_close(got.detach(), want.detach(), **TOL)
        for g, p in zip(grads, rnn.parameters()):
            torch.testing.assert_close(g, p.grad, **TOL)
