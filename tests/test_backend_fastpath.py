"""The per-call fast path of ``fxtools.compile`` (``training/fastpath.py``, ``Closures.check``'s
watch): each cache is attacked by changing what it assumes after it was filled (two calls
first), and the next call must give eager autograd's float64 answer, or refuse clearly where
the full check refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxtools
from fxtools.signature.runtime import Guards
from fxtools.training import fastpath

DT = torch.float64


class Config:
    def __init__(self):
        self.scale = 1.5
        self.name = "net"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(4, 2)
        self.cfg = Config()

    def forward(self, x, shift=0.0):
        return (self.fc2(self.act(self.bn(self.fc1(x)))) * self.cfg.scale + shift).square().sum()


def _state(model):
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


def _step(model, x, **kwargs):
    for p in model.parameters():
        p.grad = None
    loss = model(x, **kwargs)
    if loss.requires_grad:
        loss.backward()
    return loss.detach()


def _same(compiled, model, twin, x, **kwargs):
    """One step of ``compiled`` (over ``model``) and of the eager ``twin``: equal loss, parameter
    gradients (None where eager's are), buffers and input gradient."""
    y = x.detach().clone().requires_grad_(x.requires_grad)
    got, want = _step(compiled, x, **kwargs), _step(twin, y, **kwargs)
    torch.testing.assert_close(got, want)
    (grads, buffers), (grads_eager, buffers_eager) = _state(model), _state(twin)
    assert grads.keys() == grads_eager.keys()
    for name, g in grads_eager.items():
        assert (grads[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(grads[name], g, msg=name)
    torch.testing.assert_close(buffers, buffers_eager)
    if x.requires_grad:
        torch.testing.assert_close(x.grad, y.grad)
        x.grad = None


def _pair():
    torch.manual_seed(0)
    model = Net().to(DT)
    twin = copy.deepcopy(model)
    return model, twin, fxtools.compile(model)


def _both(model, twin, change):
    change(model)
    change(twin)


def _warm(compiled, model, twin, x, **kwargs):
    """Two calls: the second one's choice is memoised and the watches are filled."""
    _same(compiled, model, twin, x, **kwargs)
    _same(compiled, model, twin, x, **kwargs)


def test_the_second_call_skips_the_full_argument_check(monkeypatch):
    model, twin, compiled = _pair()
    x = torch.randn(5, 3, dtype=DT)
    _warm(compiled, model, twin, x)
    calls = []
    original = Guards.check
    monkeypatch.setattr(Guards, "check", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    _same(compiled, model, twin, x)
    assert not calls and len(compiled._runners.memos) == 1
    with torch.no_grad():
        model.fc1.weight.data = model.fc1.weight.data.t().contiguous().t()  # other strides: the full check again
    twin.fc1.weight.data = model.fc1.weight.data.clone()
    _same(compiled, model, twin, x)
    assert calls


def test_parameter_rebinding_metadata_and_requires_grad_changes_after_memo():
    model, twin, compiled = _pair()
    x = torch.randn(5, 3, dtype=DT)
    _warm(compiled, model, twin, x)
    g = torch.Generator().manual_seed(1)
    new = {k: torch.randn(v.shape, dtype=DT, generator=g) for k, v in model.state_dict().items() if "weight" in k}

    # p.data = other values; a new Parameter bound to the module; set_ to another layout; resize_
    _both(model, twin, lambda m: setattr(m.fc1.weight, "data", new["fc1.weight"].clone()))
    _same(compiled, model, twin, x)
    _both(model, twin, lambda m: setattr(m.fc2, "weight", nn.Parameter(new["fc2.weight"].clone())))
    _same(compiled, model, twin, x)
    assert model.fc2.weight.grad is not None
    with torch.no_grad():
        _both(model, twin, lambda m: m.fc2.weight.set_(new["fc2.weight"].t().contiguous().t() * 2))
    _same(compiled, model, twin, x)
    _warm(compiled, model, twin, x)
    with torch.no_grad():  # another shape for fc1 and what reads it: the graphs re-specialise
        for m in (model, twin):
            m.fc1.weight.requires_grad_(False).resize_(6, 3).copy_(torch.arange(18, dtype=DT).reshape(6, 3) / 10)
            m.fc1.weight.requires_grad_(True)
            m.fc1.bias.data = torch.linspace(-1, 1, 6, dtype=DT)
            m.bn = nn.BatchNorm1d(6).to(DT)
            m.fc2.weight.data = torch.ones(2, 6, dtype=DT) / 3
    _warm(compiled, model, twin, x)

    # requires_grad flipped, both ways
    _both(model, twin, lambda m: m.fc1.weight.requires_grad_(False))
    _same(compiled, model, twin, x)
    assert model.fc1.weight.grad is None
    _both(model, twin, lambda m: m.fc1.weight.requires_grad_(True))
    _same(compiled, model, twin, x)

    # tied, an added parameter and a removed bias: the parameter dict made again
    def rewire(m):
        m.fc2.weight = m.fc2.weight  # the same object again: no change
        m.fc2.register_parameter("unused", nn.Parameter(torch.ones(2, dtype=DT)))
        m.fc2.bias = None

    _both(model, twin, rewire)
    _warm(compiled, model, twin, x)


def test_training_mode_hooks_and_closed_over_values_after_memo():
    model, twin, compiled = _pair()
    x = torch.randn(5, 3, dtype=DT)
    _warm(compiled, model, twin, x)
    _both(model, twin, lambda m: m.eval())
    _warm(compiled, model, twin, x)
    _both(model, twin, lambda m: m.train())
    _same(compiled, model, twin, x)

    # one submodule's mode, a module's flag, a plain config object's attribute and class: refused
    for change, undo, what in [
        (lambda m: m.bn.eval(), lambda m: m.bn.train(), "training"),
        (lambda m: setattr(m.bn, "eps", 1e-3), lambda m: setattr(m.bn, "eps", 1e-5), "eps"),
        (lambda m: setattr(m.cfg, "scale", 2.0), lambda m: setattr(m.cfg, "scale", 1.5), "cfg"),
        (lambda m: setattr(m.cfg, "extra", [1]), lambda m: delattr(m.cfg, "extra"), "cfg"),
    ]:
        _both(model, twin, change)
        with pytest.raises(fxtools.InputMismatch, match=what):
            _same(compiled, model, twin, x)
        _both(model, twin, undo)
        _warm(compiled, model, twin, x)

    class Renamed(Config):
        pass

    model.cfg.__class__ = Renamed  # the same attributes, another class: its snapshot differs
    with pytest.raises(fxtools.InputMismatch, match="cfg"):
        _same(compiled, model, twin, x)
    model.cfg.__class__ = Config
    _warm(compiled, model, twin, x)

    # hooks: one added is refused (the trace did not run it); removed, the graphs serve again
    handle = model.fc1.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(fxtools.InputMismatch, match="hooks"):
        compiled(x)
    handle.remove()
    _warm(compiled, model, twin, x)
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        with pytest.raises(fxtools.InputMismatch, match="hooks"):
            compiled(x)
    finally:
        handle.remove()
    _same(compiled, model, twin, x)


def test_reordered_hooks_are_seen_after_memo():
    """Two hooks whose order matters, reordered in place (``move_to_end`` keeps the dict's version)."""
    model, twin, _ = _pair()
    for m in (model, twin):
        m.fc1.register_forward_hook(lambda mod, args, out: out * 2)
        m.fc1.register_forward_hook(lambda mod, args, out: out + 1)
    compiled = fxtools.compile(model)
    x = torch.randn(5, 3, dtype=DT)
    _warm(compiled, model, twin, x)
    for m in (model, twin):
        m.fc1._forward_hooks.move_to_end(next(iter(m.fc1._forward_hooks)))
    try:
        _same(compiled, model, twin, x)
    except fxtools.InputMismatch as exc:
        assert "hooks" in str(exc)


def test_inputs_changed_after_memo():
    model, twin, compiled = _pair()
    x = torch.randn(5, 3, dtype=DT)
    _warm(compiled, model, twin, x, shift=0.5)
    _same(compiled, model, twin, x, shift=-0.0)  # another Python value
    _warm(compiled, model, twin, torch.randn(7, 3, dtype=DT))  # another shape
    _same(compiled, model, twin, torch.randn(3, 7, dtype=DT).t())  # another layout
    base = torch.randn(40, dtype=DT)
    _same(compiled, model, twin, base[1:22].view(7, 3))  # a storage offset
    with torch.no_grad():
        base[1:22] = torch.randn(21, dtype=DT)  # written in place through another view
    _same(compiled, model, twin, base[1:22].view(7, 3))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), twin(x))
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), twin(x))

    def g(x):  # decides on its argument's storage offset, which PyTorch's tensor guards do not check
        return (x * 2 if x.storage_offset() == 0 else x * 3).sum()

    compiled_g, base = fxtools.compile(g), torch.randn(10, dtype=DT)
    for offset in (0, 0, 1, 1, 0):
        y = base[offset : offset + 6].view(2, 3).detach().requires_grad_()
        got = torch.autograd.grad(compiled_g(y), y)
        torch.testing.assert_close(got, torch.autograd.grad(g(y), y))


def test_function_of_a_dict_changed_in_place_after_memo():
    def f(params, x, mode="tanh"):
        h = x @ params["w"] + params["b"]
        return (h.tanh() if mode == "tanh" else h.sin()).square().sum()

    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4, dtype=DT, requires_grad=True), "b": torch.randn(4, dtype=DT, requires_grad=True)}
    x = torch.randn(5, 3, dtype=DT)
    compiled = fxtools.compile(f)

    def check(*args, **kwargs):
        got = torch.autograd.grad(compiled(params, *args, **kwargs), list(params.values()))
        want = torch.autograd.grad(f(params, *args, **kwargs), list(params.values()))
        torch.testing.assert_close(got, want)

    check(x)
    check(x)
    params["w"] = torch.randn(3, 6, dtype=DT, requires_grad=True)  # another shape, same key
    params["b"] = torch.randn(6, dtype=DT, requires_grad=True)
    check(x)
    check(x)
    params = {"b": params["b"], "w": params["w"]}  # the keys in another order
    check(x)
    check(x, mode="sin")
    check(x, mode="sin")


def test_parameter_dict_cache_follows_the_module_tree():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    cache = fastpath.Parameters(model)

    def agrees():
        got, want = cache(), dict(model.named_parameters())
        assert list(got) == list(want) and all(got[k] is want[k] for k in want)

    agrees()
    agrees()
    model[1][0].weight = nn.Parameter(torch.zeros(2, 2))  # deep parameter rebound
    agrees()
    model[1].append(nn.Linear(2, 2))  # a submodule added below the root
    agrees()
    model[1][1] = model[0]  # shared: listed once
    agrees()
    model[1][0]._parameters["bias"] = None  # written into the table directly
    agrees()
    model[1]._modules = {"0": nn.Linear(2, 3)}  # the table itself replaced
    agrees()

    class Listed(nn.Sequential):
        def named_modules(self, *args, **kwargs):  # a class walking its modules otherwise
            yield from super().named_modules(*args, **kwargs)
            yield "extra", nn.Linear(1, 1)

    model[1].__class__ = Listed
    got = cache()
    assert got.keys() == dict(model.named_parameters()).keys()


def test_the_memo_is_used_when_first_made_under_another_default_dtype(float64):
    """The probe of PyTorch's tensor guards runs once per process, maybe under a test's (or a
    user's) default dtype: it must still find them (it once compared float64 with float64)."""
    fastpath._tensor_guards_type.cache_clear()
    try:
        assert fastpath._tensor_guards_type() is not None
    finally:
        fastpath._tensor_guards_type.cache_clear()
