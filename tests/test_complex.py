"""Complex numbers: every VJP is autograd's (the conjugate Wirtinger derivative), or refused.

For ``out = f(z)`` and cotangent ``ct`` autograd returns ``ct * f'(z).conj()`` for a holomorphic
``f``; for a real loss ``L`` of ``z = x + iy`` in general, ``dL/dx + i dL/dy``. The OpInfo sweep
in complex128 is in test_opinfo_sweep.py; these tests pin the mechanism and its edges.
"""

import warnings

import pytest
import torch

import fxtools
from fxtools.errors import MissingRuleError
from fxtools.transforms.check import VjpMismatch, check_vjp, check_vjp_fd

aten = torch.ops.aten
C = torch.complex128


def _z(*shape, seed=0):
    return torch.randn(*shape, dtype=C, generator=torch.Generator().manual_seed(seed))


def test_mul_gradient_is_the_conjugate_and_reads_so():
    z, w = _z(3), _z(3, seed=1)
    gm = check_vjp(lambda z, w: z * w, z, w)
    assert "w.conj()" in gm.code and "z.conj()" in gm.code
    ct = _z(3, seed=2)
    _, (gz, gw) = gm(z, w, ct)
    torch.testing.assert_close(gz, ct * w.conj())
    torch.testing.assert_close(gw, ct * z.conj())


def test_real_code_has_no_conj():
    """Conjugation is decided from the dtype at trace time: real code reads exactly as before."""
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    gm = fxtools.vjp(lambda x, w: torch.sin(x @ w).exp() * x.sum(), x, w)
    assert "conj" not in gm.code
    assert "grad_x = " in gm.code


@pytest.mark.parametrize(
    "f",
    [
        lambda z: torch.sin(z) * torch.exp(z) / (z + 2),
        lambda z: torch.tanh(z).pow(3) + torch.sigmoid(z) - torch.log(z) + z.sqrt() + z.rsqrt(),
        lambda z: torch.linalg.inv(z @ z.mT + 3 * torch.eye(3, dtype=C)) @ z,
        lambda z: torch.linalg.det(z) * z.sum(0).prod(),
        lambda z: torch.einsum("ij,jk->ik", z, z.conj()) + 2j * z,
        lambda z: torch.cumprod(z, 0) * torch.logsumexp(z, 1, keepdim=True),
    ],
    ids=["pointwise", "holomorphic-powers", "inverse", "det-prod", "einsum-conj", "cumprod-logsumexp"],
)
def test_holomorphic_compositions_match_autograd(f):
    z = _z(3, 3) + 0.5
    check_vjp(f, z)
    check_vjp_fd(f, z)


@pytest.mark.parametrize(
    "f",
    [
        lambda z: torch.real(z) * 2 + torch.imag(z).sin(),
        lambda z: z.abs() + z.angle(),
        lambda z: torch.view_as_real(z * z).sum(-1),
        lambda z: torch.sgn(z).real + z.var() + torch.linalg.vector_norm(z, 3),
        lambda z: z.conj().imag * z.conj_physical().real,
    ],
    ids=["real-imag", "abs-angle", "view_as_real", "sgn-var-norm", "conj"],
)
def test_complex_to_real(f):
    z = _z(4, 3)
    check_vjp(f, z)
    check_vjp_fd(f, z)


@pytest.mark.parametrize(
    "f",
    [
        lambda x, y: torch.view_as_complex(torch.stack([x, y], -1)).exp(),
        lambda x, y: torch.polar(x.abs() + 0.1, y),
        lambda x, y: torch.complex(x, y).sin(),
        lambda x, y: (x * 1j).exp() * y,
        lambda x, y: x.to(C) * y,
    ],
    ids=["view_as_complex", "polar", "complex", "real-times-1j", "to-complex"],
)
def test_real_to_complex_keeps_the_real_part(f):
    """A complex cotangent flowing into a real input: autograd keeps its real part (no cast warning)."""
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards the imaginary part"
        gm = check_vjp(f, x, y)
        _, grads = gm(x, y, _z(5))
    assert all(g.dtype == torch.float64 for g in grads)
    check_vjp_fd(f, x, y)


def test_mixed_real_and_complex_arguments():
    x, z = torch.randn(2, 3, dtype=torch.float64), _z(3, 4)
    check_vjp(lambda x, z: torch.tanh(x.to(C) @ z) * x.sum() + x[:, :1] * z[:2], x, z)
    check_vjp(lambda x, z: torch.addmm(z[:2, :2], x.to(C), z[:, :2], alpha=0.5 + 2j, beta=1 - 1j), x, z)


def test_fd_check_sees_the_imaginary_part():
    """check_vjp_fd perturbs real and imaginary parts: the non-conjugated (wrong) VJP of mul fails
    it. It passed before, when the check dropped the imaginary part."""

    def wrong_mul(ct, out, x, y):
        return ct * y, ct * x

    rule = fxtools.registry.vjp_rule(aten.mul, rule_set="wrong_mul", complex="convention")
    rule(wrong_mul)
    z, w = _z(3), _z(3, seed=1)
    with fxtools.rule_set("wrong_mul"):
        gm = fxtools.vjp(lambda z, w: z * w, z, w)
    with pytest.raises(VjpMismatch):
        check_vjp_fd(lambda z, w: z * w, z, w, gm=gm)
    with pytest.raises(VjpMismatch):
        check_vjp(lambda z, w: z * w, z, w, gm=gm)
    check_vjp_fd(lambda z, w: z * w, z, w)


def test_real_only_rule_falls_back_to_pytorch_for_complex():
    """A rule written for real tensors (Cholesky) is not used for complex ones: PyTorch's formula is."""
    a = _z(3, 3)
    spd = lambda a: a @ a.mH + 3 * torch.eye(3, dtype=C)  # noqa: E731
    check_vjp(lambda a: torch.linalg.cholesky(spd(a)), a)
    real = torch.randn(3, 3, dtype=torch.float64)
    code = fxtools.vjp(lambda a: torch.linalg.cholesky(a @ a.mT + 3 * torch.eye(3, dtype=torch.float64)), real).code
    assert "solve_triangular" in code  # the readable rule still differentiates real matrices


def test_svd_phase_dependent_loss_is_refused_at_run_time():
    """Complex singular vectors are defined up to a phase: a loss that ignores it is differentiated
    (autograd's formula), one that depends on it is refused when the module runs, as autograd does."""
    a = _z(4, 3)
    check_vjp(lambda a: torch.linalg.svd(a, full_matrices=False)[0].abs().sum(), a)
    gm = fxtools.vjp(lambda a: torch.linalg.svd(a, full_matrices=False)[0].real.sum(), a)
    with pytest.raises(RuntimeError, match="phases"):
        gm(a, torch.tensor(1.0, dtype=torch.float64))
    real = torch.randn(4, 3, dtype=torch.float64)
    assert "_assert_async" not in fxtools.vjp(lambda a: torch.linalg.svd(a)[1].sum(), real).code


def test_unsupported_complex_call_is_refused_with_the_line():
    """An op whose only rule is real-only and that PyTorch cannot differentiate: a clear error
    naming the op and the user's line at generation time, never a result."""
    lib = torch.library.Library("fxtools_complex_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.fxtools_complex_test.twice.default
    fxtools.register_vjp(op, lambda x: (op(x), None), lambda aux, ct: ct * 2, complex="real")
    try:

        def f(z):
            return op(z).sum()  # the refused line

        with pytest.raises(MissingRuleError, match=r"(?s)twice.*complex.*test_complex.py"):
            fxtools.vjp(f, _z(3))
        x, ct = torch.randn(3, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64)
        _, (g,) = fxtools.vjp(f, x)(x, ct)  # real calls use the rule
        torch.testing.assert_close(g, torch.full_like(x, 3.0))
    finally:
        fxtools.registry._RULES.pop(op, None)


def test_cli_grad_of_complex_argument(tmp_path, monkeypatch, capsys):
    from fxtools.cli.main import main

    (tmp_path / "cmodel.py").write_text(
        "import torch\n\ndef loss(z, w):\n    return (torch.sin(z) * w.conj() + z.exp()).abs().sum()\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["grad", "cmodel.py:loss", "--arg", "z=c128[3]", "--arg", "w=c128[3]", "--argnums", "0,1", "--check"]) == 0
    out = capsys.readouterr().out
    assert "check against torch.autograd: ok" in out and ".conj()" in out


def test_check_vjp_gives_no_cotangent_to_undifferentiated_outputs():
    """The generated module takes None for outputs it does not differentiate (a zero tensor's
    ``fill_``, ``floor``): check_vjp and check_vjp_fd pass None there, real or complex."""
    for x in (torch.randn(3, dtype=torch.float64), _z(3)):
        f = lambda x: (torch.zeros_like(x).fill_(2.0), x.sin() * 2)  # noqa: E731
        check_vjp(f, x)
        check_vjp_fd(f, x)
    check_vjp(lambda x: (x.floor(), x.exp()), torch.randn(3, dtype=torch.float64))
