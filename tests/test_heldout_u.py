"""Held-out round U (2026-11-29): programs a PyTorch user writes that fxtools got wrong, each against
PyTorch in float64 (torch.func / autograd) or eager's own behaviour."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

import fxtools

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# find_nonfinite
# --------------------------------------------------------------------------------------------


def test_a_nan_the_program_writes_from_a_literal_is_a_value_of_the_step_not_a_held_tensor():
    def dropped(x):
        y = x.clone()
        y[y < 0] = float("nan")  # marks missing entries, which nansum skips
        return torch.nansum(y)

    def kept(x):
        y = x.clone()
        y[y < 0] = float("nan")
        return y.sum()

    x = torch.tensor([1.0, -1.0, 2.0])
    xe = x.clone().requires_grad_()
    dropped(xe).backward()
    assert torch.isfinite(xe.grad).all()  # eager: finite value and gradient
    assert fxtools.find_nonfinite(dropped, x) is None
    report = fxtools.find_nonfinite(kept, x)
    assert report is not None and report.phase == "forward"
    assert report.line == 'y[y < 0] = float("nan")'
    assert any("literal NaN" in h for h in report.hints)

    held = torch.tensor([float("nan"), 1.0, 1.0])  # a closed-over tensor holding a NaN: an input of the step

    def reads_held(x):
        return (x + held).sum()

    assert fxtools.find_nonfinite(reads_held, x).phase == "input"


class _Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


class _TwiceSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = _Sqrt()

    def forward(self, x):
        a = self.m(x + 1)
        b = self.m(x)
        return (a + b).sum()


def _helper_log(h):
    return torch.log(h)


def test_nonfinite_in_the_second_call_of_a_module_names_its_op_and_hint_and_each_frame_once():
    report = fxtools.find_nonfinite(_TwiceSqrt(), torch.tensor([0.0, 1.0]))
    assert report.phase == "backward" and report.line == "return torch.sqrt(x)"
    assert report.stack[0][2] == "b = self.m(x)"  # the second call
    assert any("derivative of sqrt at 0" in h for h in report.hints)  # its forward op was unnamed (replayed rule)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return (torch.log(self.fc(x)) + torch.log(self.fc(x - 10))).sum()

    torch.manual_seed(0)
    model = Twice()
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(3))
        model.fc.bias.zero_()
    report = fxtools.find_nonfinite(model, torch.rand(2, 3) + 1)
    assert report.op == "aten.log"

    def comprehension(x):
        hs = [_helper_log(x + i) for i in range(-1, 2)]
        return sum(h.sum() for h in hs)

    report = fxtools.find_nonfinite(comprehension, torch.rand(3) * 0.5 + 0.2)
    assert report.line == "return torch.log(h)"
    assert [frame[2] for frame in report.stack] == ["hs = [_helper_log(x + i) for i in range(-1, 2)]", "return torch.log(h)"]


# --------------------------------------------------------------------------------------------
# Closed-over state that changed: guarded, never silently stale
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _SlotsConfig:
    scale: float
    weight: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenSlots:
    a: float


class _Plain:
    shift = 0.5  # a class attribute, read through an instance


def _scaled(x, k):
    return (x * k).sin().sum()


def test_closed_over_slots_partials_and_class_attributes_are_guarded():
    x = torch.randn(3, dtype=F64)
    cfg = _SlotsConfig(2.0, torch.ones(3, dtype=F64))

    def f(x):
        return (x * cfg.weight * cfg.scale).sin().sum()

    gm = fxtools.grad(f, x)
    cfg.weight = torch.randn(3, dtype=F64)  # rebound: read in its place, as every closed-over tensor
    assert torch.allclose(gm(x), torch.func.grad(f)(x), rtol=1e-12, atol=0)
    cfg.scale = 3.0
    try:
        gm(x)
        raise AssertionError("a changed slot value was not refused")
    except fxtools.InputMismatch as err:
        assert "cfg.scale" in str(err)

    class Holder(nn.Module):  # a frozen slots config as a module's attribute, replaced: compared by value
        def __init__(self):
            super().__init__()
            self.cfg = _FrozenSlots(2.0)

        def forward(self, x):
            return (x * self.cfg.a).tanh().sum()

    holder = Holder()
    step = fxtools.compile(holder)
    step(x.clone().requires_grad_()).backward()
    holder.cfg = _FrozenSlots(3.0)
    try:
        step(x.clone().requires_grad_())
        raise AssertionError("a replaced slots config was not refused")
    except fxtools.InputMismatch as err:
        assert "Holder.cfg" in str(err)

    part = functools.partial(_scaled, k=2.0)
    gm = fxtools.grad(lambda x: part(x), x)
    part.keywords["k"] = 3.0
    try:
        gm(x)
        raise AssertionError("a changed partial keyword was not refused")
    except fxtools.InputMismatch as err:
        assert "k= of partial(_scaled)" in str(err)

    obj = _Plain()

    def g(x):
        return (x + obj.shift).exp().sum()

    gm = fxtools.grad(g, x)
    _Plain.shift = 1.5
    try:
        gm(x)
        raise AssertionError("a changed class attribute was not refused")
    except fxtools.InputMismatch as err:
        assert "obj.shift" in str(err)
    finally:
        _Plain.shift = 0.5


class _ReadsByName(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.k = 2.0, 1.0

    def forward(self, x):
        return (torch.sin(x * getattr(self, "scale")) * vars(self)["k"]).sum()


def test_attributes_read_by_a_string_are_guarded():
    x = torch.randn(3, dtype=F64)
    for name in ("scale", "k"):
        model = _ReadsByName()
        gm = fxtools.grad(model.forward, x)
        assert torch.allclose(gm(x), torch.func.grad(model.forward)(x), rtol=1e-12, atol=0)
        setattr(model, name, 3.0)
        try:
            gm(x)
            raise AssertionError(f"a changed attribute read as getattr(self, {name!r}) was not refused")
        except fxtools.InputMismatch as err:
            assert f"_ReadsByName.{name}" in str(err)


# --------------------------------------------------------------------------------------------
# fxtools.compile with Inductor
# --------------------------------------------------------------------------------------------


class _RandScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            target = torch.nn.functional.rms_norm(h, (5,))  # ATen's kernel adds eps in place
        r = torch.rand_like(h)
        return ((h - target) * r).pow(2).mean(), r


def test_compile_with_inductor_of_rand_like_and_rms_norm_under_no_grad():
    torch.manual_seed(0)
    model = _RandScaled().double()
    x = torch.randn(4, 6, dtype=F64)
    compiled = fxtools.compile(model, fw_compiler="inductor")  # the forward holds both
    for _ in range(2):
        model.zero_grad()
        loss, r = compiled(x)  # crashed: Inductor's random passes; "the ATen forward still mutates a value"
        loss.backward()
        assert bool(((r >= 0) & (r < 1)).all())
        w = model.fc.weight.detach().clone().requires_grad_()
        b = model.fc.bias.detach().clone().requires_grad_()
        h = torch.nn.functional.linear(x, w, b)
        target = torch.nn.functional.rms_norm(h.detach(), (5,))
        want_loss = ((h - target) * r).pow(2).mean()  # the numbers the step drew
        want = torch.autograd.grad(want_loss, (w, b))
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(model.fc.weight.grad, want[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(model.fc.bias.grad, want[1], rtol=1e-12, atol=1e-14)
