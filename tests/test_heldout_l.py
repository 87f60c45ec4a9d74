"""Held-out programs (batch l): closed-over state and decisions the guards missed.

Each test is a program that gave a silent wrong answer, a crash inside the generated code, or an
unclear refusal before its fix: a module's ``forward`` calling a helper method that reads an
attribute (the helper's reads were not walked), methods replaced on the class or set on the
instance after the build, ``p.data`` given another dtype, a closed-over tensor whose layout the
program read (``W.is_contiguous()``, ``W.stride(0)``, ``W.storage_offset()``) rebound to another
layout, and a ``Dim.AUTO`` size the program made static (``math.sqrt(x.shape[0])``), refused
without naming the line. The oracle is torch.func in float64; a change after the build must give
torch.func's answer for the new state or be refused with ``InputMismatch``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import fxtools

D = torch.float64


def _served_or_refused(gm, f, x, match=None):
    """``gm(x)`` is torch.func's gradient of ``f`` at ``x`` now, or an ``InputMismatch``."""
    try:
        got = gm(x)
    except fxtools.InputMismatch as exc:
        if match is not None:
            assert match in str(exc), str(exc)
        return "refused"
    torch.testing.assert_close(got, torch.func.grad(f)(x), rtol=1e-9, atol=1e-10)
    return "served"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.alpha = 2.0

    def forward(self, x):
        return self.body(x).sum()

    def body(self, x):  # a helper of forward: what it reads is what the program read
        return torch.tanh(self.lin(x)) * self.alpha


COUNTER = 0


class _Logged(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=D))

    def forward(self, x):
        return (x * self.w).sum()

    def log_step(self):  # never called by the program: what it reads is not guarded
        return COUNTER


class _Config:
    def __init__(self):
        self.k = 2.0

    def scale(self, x):
        return (x * self.k).sum()


def test_helper_methods_and_replaced_methods():
    torch.manual_seed(0)
    x = torch.randn(2, 3, dtype=D)
    net = _Net()

    def f(x):
        return net(x)

    gm = fxtools.grad(f, x)
    assert _served_or_refused(gm, f, x) == "served"
    net.alpha = 3.0  # read in body(): was silently ignored
    assert _served_or_refused(gm, f, x, "net.alpha") == "refused"
    net.alpha = 2.0
    net.body = lambda x: net.lin(x) * 5.0  # a method set on the instance
    assert _served_or_refused(gm, f, x, "method net.body") == "refused"
    del net.body
    assert _served_or_refused(gm, f, x) == "served"
    old = _Net.forward
    try:
        _Net.forward = lambda self, x: self.body(x).sum() * 7.0  # replaced on the class
        assert _served_or_refused(gm, f, x, "method net.forward") == "refused"
    finally:
        _Net.forward = old
    assert _served_or_refused(gm, f, x) == "served"

    global COUNTER
    logged = _Logged()
    gm = fxtools.grad(lambda x: logged(x), x)
    COUNTER += 1
    torch.testing.assert_close(gm(x), logged.w.detach().expand(2, 3))

    cfg = _Config()

    def g(x):
        return cfg.scale(x)

    gm = fxtools.grad(g, x)
    old_scale = _Config.scale
    try:
        _Config.scale = lambda self, x: (x * self.k * 5).sum()
        assert _served_or_refused(gm, g, x, "method cfg.scale") == "refused"
    finally:
        _Config.scale = old_scale
    assert _served_or_refused(gm, g, x) == "served"

    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()

    def h(x):
        return m(x).sum()

    gm = fxtools.grad(h, x)
    m[0].forward = lambda inp: inp * 2  # an instance forward on a torch module
    assert _served_or_refused(gm, h, x, "forward set on it") == "refused"
    del m[0].forward
    assert _served_or_refused(gm, h, x) == "served"


def test_parameter_data_of_another_dtype_is_refused():
    x = torch.randn(2, 3, dtype=D)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()

    def f(x):
        return m(x).sum()

    gm = fxtools.grad(f, x)
    m[0].weight.data = torch.randn(3, 3, dtype=D).t()  # another layout, same kind: read as it is
    assert _served_or_refused(gm, f, x) == "served"
    m[0].weight.data = torch.randn(3, 3, dtype=torch.float32)  # crashed inside the generated code
    assert _served_or_refused(gm, f, x, "float32[3, 3]") == "refused"


def _rebinding(program, before, after):
    """Build ``program`` (which reads the global ``W``) with ``W = before``, then call it with ``W = after``."""
    global W
    x = torch.randn(3, 3, dtype=D)
    W = before
    try:
        gm = fxtools.grad(program, x)
        W = after
        return _served_or_refused(gm, program, x, "layout")
    finally:
        W = None


W: torch.Tensor | None = None


def _branch(x):
    if W.is_contiguous():
        return (x @ W).sum()
    return (x * W).sum()


def _stride(x):
    return (x * W).sum() * W.stride(0)


def _offset(x):
    return (x * W).sum() * W.storage_offset()


def _derived(x):
    return (x * W).sum() * W.t().is_contiguous()


_FACT = {
    _branch: lambda t: t.is_contiguous(),
    _stride: lambda t: t.stride(0),
    _offset: lambda t: t.storage_offset(),
    _derived: lambda t: t.t().is_contiguous(),
}


@pytest.mark.parametrize("program", [_branch, _stride, _offset, _derived])
def test_layout_of_a_closed_over_tensor_is_guarded(program):
    """A rebound ``W`` is served exactly (checked against torch.func) where what the program read is
    the same, and refused where it differs (it was silently computed with the old layout's answer)."""
    torch.manual_seed(1)
    base = torch.randn(40, dtype=D)
    first = base[2:11].view(3, 3)
    others = [base[20:29].view(3, 3), torch.randn(3, 3, dtype=D).t(), torch.randn(3, 6, dtype=D)[:, :3]]
    others += [base[5:14].view(3, 3), torch.randn(3, 3, dtype=D)]
    for other in others:
        got = _rebinding(program, first, other)
        if _FACT[program](other) != _FACT[program](first):
            assert got == "refused", (program.__name__, other.stride(), other.storage_offset())


def test_layout_of_a_rebound_parameter_is_guarded():
    x = torch.randn(3, 3, dtype=D)
    lin = nn.Linear(3, 3).double()

    def f(x):
        return (x * lin.weight.stride(1)).sum() + lin(x).sum()

    gm = fxtools.grad(f, x)
    lin.weight = nn.Parameter(torch.randn(3, 3, dtype=D))
    assert _served_or_refused(gm, f, x) == "served"
    lin.weight = nn.Parameter(torch.randn(3, 3, dtype=D).t())  # silently used stride 1
    assert _served_or_refused(gm, f, x, "lin.weight") == "refused"


def test_auto_size_made_static_names_the_line():
    def f(x):
        return (x * math.sqrt(x.shape[0])).sum()  # a Python number: Dim.AUTO stays static

    gm = fxtools.grad(f, torch.randn(4, dtype=D), dynamic_shapes={"x": {0: Dim.AUTO}})
    x = torch.randn(4, dtype=D)
    torch.testing.assert_close(gm(x), torch.func.grad(f)(x))
    with pytest.raises(
        fxtools.InputMismatch, match=r"marked dynamic, but the program needs it to be 4 \(decided at .*math\.sqrt"
    ):
        gm(torch.randn(5, dtype=D))


ACT = torch.tanh
STATE: dict = {}


def test_builtin_global_nested_tensor_and_keyword_default():
    """Three reads that were not guarded: a global bound to a builtin (``act = torch.tanh``), a
    tensor inside a list inside a closed-over dict (snapshotted as an empty object: a rebound one
    was silently ignored), and a keyword-only parameter's default."""
    global ACT
    x = torch.randn(2, 3, dtype=D)

    def f(x):
        return ACT(x).sum()

    gm = fxtools.grad(f, x)
    try:
        ACT = torch.sin
        assert _served_or_refused(gm, f, x, "the global ACT") == "refused"
    finally:
        ACT = torch.tanh
    assert _served_or_refused(gm, f, x) == "served"

    STATE["ws"] = [torch.ones(3, dtype=D)]

    def g(x):
        return (x * STATE["ws"][0]).sum()

    gm = fxtools.grad(g, x)
    STATE["ws"][0] = torch.full((3,), 2.0, dtype=D)  # rebound: read in its place
    assert _served_or_refused(gm, g, x) == "served"
    STATE["ws"].append(torch.ones(3, dtype=D))
    assert _served_or_refused(gm, g, x, "length") == "refused"

    def h(x, *, k=2.0):
        return (x * k).sum()

    gm = fxtools.grad(h, x)
    h.__kwdefaults__["k"] = 5.0
    assert _served_or_refused(gm, h, x, "the default of k") == "refused"


HOOK_SCALE = 2.0


class _OutScale:
    def __init__(self):
        self.k = 2.0

    def __call__(self, module, inputs, output):
        return output * self.k


def test_what_forward_hooks_read_is_guarded():
    """A forward (pre-)hook runs in the trace: the global it reads, or its object's attribute,
    changed afterwards was silently ignored."""
    global HOOK_SCALE
    x = torch.randn(2, 3, dtype=D)
    m = nn.Linear(3, 1).double()
    m.register_forward_pre_hook(lambda mod, args: (args[0] * HOOK_SCALE,))
    scale = _OutScale()
    m.register_forward_hook(scale)

    def f(x):
        return m(x).sum()

    gm = fxtools.grad(f, x)
    assert _served_or_refused(gm, f, x) == "served"
    try:
        HOOK_SCALE = 5.0
        assert _served_or_refused(gm, f, x, "HOOK_SCALE") == "refused"
    finally:
        HOOK_SCALE = 2.0
    scale.k = 4.0
    assert _served_or_refused(gm, f, x, "k") == "refused"
    scale.k = 2.0
    assert _served_or_refused(gm, f, x) == "served"

    # a hook registered on every module (register_module_forward_hook): what it reads too
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: out * HOOK_SCALE if mod is m else out)
    try:
        gm = fxtools.grad(f, x)
        assert _served_or_refused(gm, f, x) == "served"
        HOOK_SCALE = 3.0
        assert _served_or_refused(gm, f, x, "HOOK_SCALE") == "refused"
    finally:
        handle.remove()
        HOOK_SCALE = 2.0
