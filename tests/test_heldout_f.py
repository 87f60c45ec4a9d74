"""Held-out programs (batch f): decisions, dtypes, compiled and hostile corners.

Each test is a program that gave a silent wrong answer (or a false refusal) before its fix;
the oracle is eager PyTorch on the same computation (float64 where the program allows).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import fxtools

# --- rms_norm in half precision: eager computes in float32 (and float32's eps), returns x's dtype ---


def _rms(x, w):
    return F.rms_norm(x, x.shape[-1:], w)


@pytest.mark.parametrize(
    "xdtype, wdtype, scale",
    [
        (torch.float16, torch.float16, 0.01),  # eps: float16's (1e-3) swamped mean(x^2) ~ 1e-4
        (torch.bfloat16, None, 0.01),
        (torch.float16, torch.float16, 300.0),  # x**2 overflowed float16
        (torch.float16, torch.float32, 1.0),  # the result was float32, eager's is x's dtype
        (torch.float32, torch.float64, 1.0),
    ],
)
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_computes_as_eager_in_every_dtype(xdtype, wdtype, scale):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 8, generator=g) * scale).to(xdtype)
    w = None if wdtype is None else (torch.rand(8, generator=g) + 0.5).to(wdtype)
    ct = torch.randn(3, 8, generator=g).to(xdtype)
    argnums = (0,) if w is None else (0, 1)
    inputs = (x,) if w is None else (x, w)
    out, pullback = torch.func.vjp(lambda *a: _rms(*a, None) if w is None else _rms(*a), *inputs)
    want = pullback(ct)
    got_out, got = fxtools.vjp(_rms, x, w, argnums=argnums)(x, w, ct)
    assert got_out.dtype == out.dtype
    torch.testing.assert_close(got_out, out)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


# --- attention in half precision: the backward recomputed q @ k^T in float16 (inf, NaN gradients);
# eager's kernels (and its math path on CPU) compute in float32 ---


def test_attention_backward_in_half_precision_as_eager():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) * s for s in (300, 300, 1))
    mask = torch.randn(5, 5, generator=g, dtype=torch.float64)
    ct = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    half = [t.half() for t in (q, k, v, mask, ct)]

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out, pullback = torch.func.vjp(f, *half[:4])
    exact = torch.func.vjp(f, *(t.double() for t in half[:4]))[1](half[4].double())
    got_out, got = fxtools.vjp(f, *half[:4], argnums=(0, 1, 2, 3))(*half)
    torch.testing.assert_close(got_out, out)
    for a, b, c in zip(got, pullback(half[4]), exact):
        assert a.dtype == b.dtype == torch.float16 and a.isfinite().all()
        # no worse than eager's rounding (the two round differently)
        assert (a.double() - c).abs().max() <= 2 * (b.double() - c).abs().max() + 1e-3


# --- a decision whose printed condition divides by a size: size 0 crashed the guards
# (ZeroDivisionError) instead of being refused, or served by new graphs under compile ---


def _chunks(x):
    return sum((c.sin() * i).sum() for i, c in enumerate(x.chunk(3, 0)))


def test_a_chunk_decision_at_size_zero_is_refused_or_rebuilt():
    gm = fxtools.grad(_chunks, torch.randn(4, 3), dynamic_shapes={"x": {0: torch.export.Dim.AUTO}})
    with pytest.raises(fxtools.InputMismatch):
        gm(torch.randn(0, 3))
    compiled = fxtools.compile(_chunks, dynamic=True)
    compiled(torch.randn(4, 3))
    x = torch.randn(0, 3, requires_grad=True)
    out = compiled(x)
    out.backward()
    assert out.item() == 0 and x.grad.shape == (0, 3)


# --- compilers with dynamic=True: size arithmetic in the ATen graphs (``s0 - 1``, ``s0 * s1``)
# was refused as "not an ATen op" (a false refusal: Inductor takes it) ---


def _through(gm, example_inputs):
    return gm


@pytest.mark.parametrize(
    "f",
    [
        lambda x: torch.zeros(5, dtype=x.dtype).index_put((torch.tensor([0, 0, 2, 2]),), x[:4, 0], accumulate=True).pow(3),
        lambda x: (x.view(-1), x.view(-1)[1:].sin()),
    ],
    ids=["index_put_duplicates", "aliased_views"],
)
def test_a_compiler_with_dynamic_sizes_takes_size_arithmetic(f):
    compiled = fxtools.compile(f, compiler=_through, dynamic=True)
    for n in (4, 6):
        x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        got, want = fxtools_sum(compiled(x)), fxtools_sum(f(xe))
        (gx,) = torch.autograd.grad(got, x, create_graph=True)
        (ge,) = torch.autograd.grad(want, xe, create_graph=True)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, ge)
        torch.testing.assert_close(torch.autograd.grad(gx.pow(2).sum(), x)[0], torch.autograd.grad(ge.pow(2).sum(), xe)[0])


def fxtools_sum(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)


# --- functools.partial: its bound arguments and its function's globals were not read at all
# (a stale constant, a stale rebound parameter: silently wrong) ---

SCALE = 2.0


def _partial_loss(x, s, model):
    return (model(x).sum() * s[0] * SCALE).sum()


def test_a_partial_is_read_like_a_closure():
    global SCALE
    model = torch.nn.Linear(3, 1).double()
    s = [2.0]
    loss = functools.partial(_partial_loss, s=s, model=model)
    x = torch.randn(4, 3, dtype=torch.float64)
    gm = fxtools.grad(loss, x)
    model.weight = torch.nn.Parameter(torch.randn(1, 3, dtype=torch.float64))  # rebound: read in its place
    torch.testing.assert_close(gm(x), torch.func.grad(loss)(x))
    for change, undo in (
        (lambda: s.__setitem__(0, 3.0), lambda: s.__setitem__(0, 2.0)),
        (lambda: globals().__setitem__("SCALE", 5.0), lambda: globals().__setitem__("SCALE", 2.0)),
        (lambda: loss.keywords.__setitem__("s", [2.0, 1.0]), lambda: loss.keywords.__setitem__("s", s)),
    ):
        change()
        with pytest.raises(fxtools.InputMismatch):
            gm(x)
        undo()
    torch.testing.assert_close(gm(x), torch.func.grad(loss)(x))


# --- a flag of an installed module the program reads (``torch.backends.cudnn.enabled``): a
# constant of the code, not guarded (silently the old branch after the flag changed) ---


def _by_flag(x):
    if torch.backends.cudnn.enabled:
        return (x * x).sum()
    return (3 * x).sum()


def test_a_torch_flag_the_program_reads_is_guarded():
    x = torch.randn(3, dtype=torch.float64)
    gm = fxtools.grad(_by_flag, x)
    with torch.backends.cudnn.flags(enabled=False):
        with pytest.raises(fxtools.InputMismatch, match="torch.backends.cudnn.enabled"):
            gm(x)
    torch.testing.assert_close(gm(x), 2 * x)


# --- compile(dynamic=True) of a function closing over a model: its parameters (lifted to inputs)
# crashed torch.export's dynamic_shapes check (SymbolicSizeError "Node type mismatch") ---


def test_compile_dynamic_of_a_closure_over_a_model():
    lin = torch.nn.Linear(3, 2).double()
    compiled = fxtools.compile(lambda x: lin(x).tanh(), dynamic=True)
    for n in (4, 6):
        x = torch.randn(n, 3, dtype=torch.float64)
        compiled(x).sum().backward()
        got = lin.weight.grad.clone()
        lin.weight.grad = None
        lin(x).tanh().sum().backward()
        torch.testing.assert_close(got, lin.weight.grad)
        lin.weight.grad = None
