"""Held-out adversarial programs (JVP losses, PINN operators, NaN finding): the findings of a
review, each minimised to a cheap regression test against eager PyTorch in float64.

- ``nn.GroupNorm`` of a non-contiguous tensor (``gn(x.transpose(1, 2))``, a token sequence normed
  over channels) crashed every module at its first call: the rule called ``native_group_norm``,
  whose CPU kernel refuses other layouts, on the input as it came (eager's ``group_norm`` makes
  it contiguous first); a module built on a contiguous example refused a transposed call too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxtools

D = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _group_norm_loss(x):
    w = torch.linspace(0.5, 1.5, x.shape[1], dtype=x.dtype)
    return (F.group_norm(x, 2, w, 1 - w) * torch.arange(x.shape[-1], dtype=x.dtype)).pow(2).sum()


def _transposed_group_norm_loss(x):
    return _group_norm_loss(x.transpose(1, 2))


@pytest.mark.parametrize("f, shape", [(_transposed_group_norm_loss, (3, 5, 4)), (_group_norm_loss, (3, 4, 5))])
def test_group_norm_of_a_non_contiguous_tensor(f, shape):
    g = _gen(0)
    x = torch.randn(shape, generator=g, dtype=D)
    other = torch.randn(shape[0], shape[2], shape[1], generator=g, dtype=D).transpose(1, 2)  # another layout
    grad, jvp, hvp = fxtools.grad(f, x), fxtools.jvp(f, x), fxtools.hvp(f, x)
    for a in (x, other):
        v = torch.randn(a.shape, generator=g, dtype=D)
        torch.testing.assert_close(grad(a), torch.func.grad(f)(a), **TOL)
        torch.testing.assert_close(jvp(a, v)[1], torch.func.jvp(f, (a,), (v,))[1], **TOL)
        torch.testing.assert_close(hvp(a, v), torch.func.jvp(torch.func.grad(f), (a,), (v,))[1], **TOL)
