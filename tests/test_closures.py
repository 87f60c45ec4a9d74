"""Closed-over state (docs/closures.md): what a program reads from outside its arguments is read
again at every call (tensors) or guarded (Python values, modules, functions), never stale.

Oracles: torch.func in float64 on the state as it is at the call. The fuzzer axis at the end
closes random programs (tests/fuzz_programs.py) over one of their inputs and a Python float,
then changes them: every answer is exact or an InputMismatch.
"""

import copy
import importlib
import pickle

import fuzz_programs
import pytest
import torch
from torch.utils import _pytree as pytree

import fxtools

pytestmark = pytest.mark.usefixtures("float64")

TOL = dict(rtol=1e-10, atol=1e-10)


def close(a, b):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x.detach(), y.detach(), **TOL)


SCALE = 2.0
W = torch.randn(3, dtype=torch.float64)


def reads_globals(x):
    return (x * W * SCALE).sin().sum()


def test_global_float_changed_is_refused_naming_it_and_the_line():
    global SCALE
    x = torch.randn(4, 3)
    gm = fxtools.grad(reads_globals, x)
    close(gm(x), torch.func.grad(reads_globals)(x))
    old = SCALE
    SCALE = 3.0
    try:
        with pytest.raises(
            fxtools.InputMismatch, match=r"the global SCALE \(read at .*test_closures.py:\d+: return \(x \* W \* SCALE\)"
        ):
            gm(x)
    finally:
        SCALE = old
    close(gm(x), torch.func.grad(reads_globals)(x))  # back as it was: accepted again


def test_global_tensor_rebound_is_read_and_another_shape_refused():
    global W
    x = torch.randn(4, 3)
    gm = fxtools.grad(reads_globals, x)
    old = W
    try:
        W = torch.randn(3)
        close(gm(x), torch.func.grad(reads_globals)(x))
        W.mul_(-2)  # in place: seen too
        close(gm(x), torch.func.grad(reads_globals)(x))
        W = torch.randn(1)  # would broadcast silently: refused
        with pytest.raises(fxtools.InputMismatch, match=r"the global W .* float64\[1\].*float64\[3\]"):
            gm(x)
    finally:
        W = old


def test_replaced_parameter_of_a_closed_over_module_is_read():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def f(x):
        return model(x).sum()

    x = torch.randn(5, 3)
    gm = fxtools.grad(f, x)
    close(gm(x), torch.func.grad(f)(x))
    model[0].weight = torch.nn.Parameter(torch.randn(4, 3))
    close(gm(x), torch.func.grad(f)(x))
    with torch.no_grad():  # an optimizer step
        for p in model.parameters():
            p.sub_(0.1 * torch.ones_like(p))
    close(gm(x), torch.func.grad(f)(x))
    model[0].weight.data = torch.randn(2, 3)  # the same Parameter, another shape
    with pytest.raises(fxtools.InputMismatch, match=r"model\.0\.weight"):
        gm(x)


def test_module_flags_submodules_and_attributes_are_guarded():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)
            self.drop = torch.nn.Dropout(0.5)
            self.scale = 0.5

        def forward(self, x):
            return self.drop(self.fc(x)) * self.scale

    net = Net().eval()
    x = torch.randn(2, 3)
    gm = fxtools.grad(lambda x: net(x).sum(), x)
    net.scale = 0.25
    with pytest.raises(fxtools.InputMismatch, match=r"net\.scale .* 0\.25"):
        gm(x)
    net.scale = 0.5
    net.train()
    with pytest.raises(fxtools.InputMismatch, match=r"net\.training is now True"):
        gm(x)
    net.eval()
    net.fc = torch.nn.Linear(3, 3)
    with pytest.raises(fxtools.InputMismatch, match=r"net\.fc was replaced"):
        gm(x)


def test_callable_object_and_closure_cells():
    class Loss:
        def __init__(self, w):
            self.w = w
            self.p = 2.0

        def __call__(self, x):
            return ((x - self.w) ** self.p).sum()

    x = torch.randn(4)
    loss = Loss(torch.randn(4))
    gm = fxtools.grad(loss, x)
    loss.w = torch.randn(4)
    close(gm(x), torch.func.grad(loss)(x))
    loss.p = 3.0
    with pytest.raises(fxtools.InputMismatch, match=r"Loss\.p"):
        gm(x)

    def make():
        k = torch.randn(4)
        c = 1.5

        def f(x):
            return (x * k).exp().sum() * c

        def set_k(new, new_c=1.5):
            nonlocal k, c
            k, c = new, new_c

        return f, set_k

    f, set_k = make()
    gm = fxtools.vjp(f, x)
    set_k(torch.randn(4))
    one = torch.tensor(1.0)
    close(gm(x, one), (f(x), torch.func.vjp(f, x)[1](one)))
    set_k(torch.randn(4), 2.5)
    with pytest.raises(fxtools.InputMismatch, match=r"the closure variable c"):
        gm(x, one)


@pytest.mark.parametrize("transform", ["jvp", "hvp", "vmap", "jacrev", "hessian"])
def test_composed_transforms_read_the_current_tensor(transform):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())

    def f(x):
        return model(x).pow(2).sum()

    x = torch.randn(3)
    oracle = {
        "jvp": (lambda: fxtools.jvp(f, x), lambda gm: gm(x, x), lambda: torch.func.jvp(f, (x,), (x,))),
        "hvp": (lambda: fxtools.hvp(f, x), lambda gm: gm(x, x), lambda: torch.func.jvp(torch.func.grad(f), (x,), (x,))[1]),
        "vmap": (
            lambda: fxtools.vmap(f, x.expand(2, 3)),
            lambda gm: gm(x.expand(2, 3)),
            lambda: torch.func.vmap(f)(x.expand(2, 3)),
        ),
        "jacrev": (lambda: fxtools.jacrev(model, x), lambda gm: gm(x), lambda: torch.func.jacrev(model)(x)),
        "hessian": (lambda: fxtools.hessian(f, x), lambda gm: gm(x), lambda: torch.func.hessian(f)(x)),
    }[transform]
    build, call, want = oracle
    gm = build()
    model[0].weight = torch.nn.Parameter(torch.randn(3, 3))
    close(call(gm), want())
    model.train(False)
    with pytest.raises(fxtools.InputMismatch, match="training"):
        call(gm)


def test_copies_and_saved_modules_are_snapshots(tmp_path):
    model = torch.nn.Linear(3, 1)
    x = torch.randn(2, 3)
    gm = fxtools.grad(lambda x: model(x).sum(), x)
    before = gm(x)
    text = fxtools.save(gm, tmp_path / "g.py")
    assert "A snapshot" in text
    copied, loaded = copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))
    model.weight = torch.nn.Parameter(torch.randn(1, 3))
    close(gm(x), torch.func.grad(lambda x: model(x).sum())(x))
    close(copied(x), before)
    close(loaded(x), before)


def test_state_the_program_changes_itself_is_not_guarded():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x.sin().sum()

    c = Counter()
    x = torch.randn(3)
    gm = fxtools.grad(c, x)
    c(x)
    close(gm(x), x.cos())


# ---- the fuzzer's closure axis ----


def _closed_over(p, k):
    """Program ``p`` with its float input ``k`` closed over (a cell) and its outputs scaled by a
    closed-over Python float; ``set_state(w, scale)`` rebinds both."""
    fn, w, scale = p.fn, p.args[k], 1.5

    def g(*rest):
        args = [*rest[:k], w, *rest[k:]]
        return [t * scale for t in pytree.tree_leaves(fn(*args)) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def set_state(new_w, new_scale=1.5):
        nonlocal w, scale
        w, scale = new_w, new_scale

    return g, set_state


N_CLOSURE = 24


@pytest.mark.parametrize("group", range(2))
def test_fuzz_closure_axis(group):
    """Random programs closed over one of their float inputs and a float: after rebinding the
    tensor (another sample, and in place) the vjp is exact; after changing the float or the
    tensor's shape it refuses. Never a stale answer."""
    failures = []
    for i in range(group * N_CLOSURE // 2, (group + 1) * N_CLOSURE // 2):
        p = fuzz_programs.program(i, 7)
        if not p.float_args:
            continue
        k = p.float_args[i % len(p.float_args)]
        g, set_state = _closed_over(p, k)
        rest = [a for j, a in enumerate(p.args) if j != k]
        try:
            out = g(*rest)
            ct = [torch.randn_like(t) for t in out]
            gm = fxtools.vjp(g, *rest)
            for step in ("rebound", "in place"):
                new = p.inputs[k].vals[1 if step == "rebound" else 2].clone()
                set_state(new)
                if step == "in place":
                    new.mul_(-1.0)  # through the same object
                floats = [j for j, a in enumerate(rest) if a.is_floating_point()]

                def of_floats(*xs):
                    args = list(rest)
                    for j, x in zip(floats, xs):
                        args[j] = x
                    return g(*args)

                want_out, pull = torch.func.vjp(of_floats, *(rest[j] for j in floats))
                got_out, got_grads = gm(*rest, ct)
                close(got_out, want_out)
                close([got_grads[j] for j in floats], pull(ct))
            changes = [("scale", (new, 2.5))]
            if any(r.what == "the closure variable w" for r, _ in gm.closures.tensors):  # not if w is dead code
                changes.append(("w", (torch.randn(*new.shape, 2), 1.5)))
            for name, state in changes:
                set_state(*state)
                try:
                    gm(*rest, ct)
                    failures.append(f"program {i}: {name} changed, and the stale module answered\n{p}")
                except fxtools.InputMismatch as exc:
                    assert f"closure variable {name}" in str(exc), str(exc)
        except Exception as exc:  # noqa: BLE001 - collected, reported with the program
            failures.append(f"program {i} (seed 7), input {k} closed over: {type(exc).__name__}: {exc}\n{p}")
    assert not failures, "\n\n".join(failures)


CFG = {"scale": 2.0, "act": "tanh"}
PARAMS = {"w": torch.randn(3, dtype=torch.float64)}


def reads_dicts(x):
    return (x * PARAMS["w"] * CFG["scale"]).tanh().sum()


def test_global_dicts_of_tensors_and_of_values():
    x = torch.randn(4, 3)
    gm = fxtools.grad(reads_dicts, x)
    old_w = PARAMS["w"]
    try:
        PARAMS["w"] = torch.randn(3)
        close(gm(x), torch.func.grad(reads_dicts)(x))
        CFG["scale"] = 3.0
        with pytest.raises(fxtools.InputMismatch, match="the global CFG .* whose contents changed"):
            gm(x)
    finally:
        PARAMS["w"], CFG["scale"] = old_w, 2.0


def test_split_and_compile_refuse_changed_closed_over_state():
    """A split's forward and fxtools.compile's graphs hold closed-over tensors and constants too:
    a changed global or a rebound tensor is refused there (in-place updates are seen)."""
    state = {"scale": 2.0}
    w = torch.randn(3, dtype=torch.float64)
    holder = {"w": w}

    def f(x):
        return (torch.sin(x * holder["w"]) * SCALES["s"]).sum() + state["scale"]

    SCALES["s"] = 1.5
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    sp = fxtools.split(f, x.detach())
    compiled = fxtools.compile(f, x.detach())
    out = compiled(x)
    out.backward()
    torch.testing.assert_close(x.grad, torch.func.grad(f)(x.detach()))
    with torch.no_grad():
        w.mul_(3.0)  # in place: seen by both
    x.grad = None
    compiled(x).backward()
    torch.testing.assert_close(x.grad, torch.func.grad(f)(x.detach()))
    holder["w"] = torch.randn(3, dtype=torch.float64)  # rebound: refused
    with pytest.raises(fxtools.InputMismatch, match="replaced by another object"):
        compiled(x)
    with pytest.raises(fxtools.InputMismatch, match="replaced by another object"):
        sp.forward(*sp.flatten(x.detach()))
    holder["w"] = w
    SCALES["s"] = 4.0  # a Python value the code holds as a constant: refused
    with pytest.raises(fxtools.InputMismatch, match="SCALES|s"):
        compiled(x)
    SCALES["s"] = 1.5
    compiled(x)


SCALES: dict = {}


def _level3(x):
    return x * DEEP["k"]


def _level2(x):
    return _level3(x).sin()


def _level1(x):
    return _level2(x) + 1


def test_a_value_read_three_calls_deep_is_guarded():
    DEEP["k"] = 2.0
    gm = fxtools.grad(lambda x: _level1(x).sum(), torch.randn(3, dtype=torch.float64))
    DEEP["k"] = 5.0
    with pytest.raises(fxtools.InputMismatch, match="DEEP"):
        gm(torch.randn(3, dtype=torch.float64))


DEEP: dict = {}


def test_torch_compile_of_a_generated_module_keeps_its_closure_checks():
    """torch.compile traces the checks (fullgraph): a changed global is refused, not compiled away."""
    COMPILED["k"] = 2.0

    def f(x):
        return (torch.sin(x) * COMPILED["k"]).sum()

    x = torch.randn(3, dtype=torch.float64)
    gm = fxtools.grad(f, x)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.func.grad(f)(x))
    COMPILED["k"] = 3.0
    with pytest.raises(Exception, match="COMPILED"):
        compiled(x)
    COMPILED["k"] = 2.0
    torch.testing.assert_close(compiled(x), torch.func.grad(f)(x))


COMPILED: dict = {}


class Scaled:
    factor = 2.0  # a class attribute, read through self

    def __call__(self, x):
        return (x.sin() * self.factor).sum()


def test_values_read_through_modules_classes_defaults_and_dicts_are_guarded(tmp_path, monkeypatch):
    """A user module's attribute (``config.factor``), a class attribute read through ``self``, a
    parameter's default and a function in a dict, each changed after the module was made: refused
    naming it (all four were silently stale)."""
    (tmp_path / "adv_config.py").write_text("factor = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = importlib.import_module("adv_config")
    ops = {"act": torch.sin}

    def from_config(x):
        return (x.sin() * config.factor).sum()

    def with_default(x, scale=[2.0]):  # noqa: B006 - the mutable default is the point
        return (x.sin() * scale[0]).sum()

    def from_dict(x):
        return ops["act"](x).sum()

    x = torch.randn(4, 3)
    cases = [
        (from_config, lambda: setattr(config, "factor", 3.0), r"config\.factor is now 3\.0"),
        (Scaled(), lambda: setattr(Scaled, "factor", 3.0), r"factor is now 3\.0"),
        (with_default, lambda: with_default.__defaults__[0].__setitem__(0, 3.0), "the default of scale"),
        (from_dict, lambda: ops.__setitem__("act", torch.cos), r"ops\['act'\] was replaced"),
    ]
    try:
        for f, change, named in cases:
            gm = fxtools.grad(f, x)
            close(gm(x), torch.func.grad(f)(x))
            change()
            with pytest.raises(fxtools.InputMismatch, match=named):
                gm(x)
    finally:
        Scaled.factor = 2.0


def test_values_of_a_closed_over_tensor_read_into_python_are_guarded():
    """``self.temp.item()``, ``float(t)``, ``int(n)`` of a closed-over tensor become constants of
    the code: the same values are served exactly, changed ones (in place) are refused naming the
    tensor (they were silently stale: tensors are otherwise read by reference)."""

    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("temp", torch.tensor(2.0))

        def forward(self, x):
            return (x[: int(n)].sin() / self.temp.item() * float(t)).sum()

    t, n = torch.tensor(3.0), torch.tensor(2)
    model, x = Tempered(), torch.randn(4, 3)
    gm = fxtools.grad(model.forward, x)
    close(gm(x), torch.func.grad(model.forward)(x))
    for tensor, named in [
        (model.temp, r"the values of Tempered\.temp"),
        (t, "the values of the closure variable t"),
        (n, "closure variable n"),
    ]:
        old = tensor.clone()
        tensor.add_(1)
        with pytest.raises(fxtools.InputMismatch, match=named):
            gm(x)
        tensor.copy_(old)
    close(gm(x), torch.func.grad(model.forward)(x))


def _exact_or_refused(gm, f, x):
    """``gm(x)`` equals torch.func's gradient of ``f`` as the state is now, or is refused: which one."""
    try:
        got = gm(x)
    except fxtools.InputMismatch:
        return "refused"
    close(got, torch.func.grad(f)(x))
    return "exact"


def test_python_values_beside_tensors_in_a_closed_over_dict_or_list_are_guarded():
    """A dict or list the program reads tensors from also holds the Python values it reads
    (``state["scale"]``): a value changed was silently ignored (4.3 off), now refused, whether the
    key is written in the code, held in a variable, read by ``.get`` or by ``f(**state)``; a key
    the program never names may change freely (a step counter)."""
    x = torch.randn(3)
    state = {"w": torch.randn(3), "scale": 2.0, "step": 0}
    key = "scale"
    items = [torch.randn(3), 1.5]

    def g(x, w, scale, step):
        return (x * w * scale).sin().sum()

    programs = {
        "named": lambda x: (x * state["w"] * state["scale"]).sin().sum(),
        "variable key": lambda x: (x * state["w"] * state[key]).sin().sum(),
        "get": lambda x: (x * state["w"] * state.get("scale", 1.0)).sin().sum(),
        "unpacked": lambda x: g(x, **state),
        "list": lambda x: (x * items[0] * items[1]).sin().sum(),
    }
    for name, f in programs.items():
        gm = fxtools.grad(f, x)
        state["step"] += 1  # not named by the program (except when unpacked: every key is read)
        assert _exact_or_refused(gm, f, x) == ("refused" if name == "unpacked" else "exact"), name
        state["step"] = 0
        state["scale"], items[1] = 3.0, 2.5
        assert _exact_or_refused(gm, f, x) == "refused", name
        state["w"], state["scale"], items[1] = torch.randn(3), 2.0, 1.5
        assert _exact_or_refused(gm, f, x) == "exact", name  # a tensor is read again at each call


class HoldsState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.cfg = {"t": torch.randn(3), "s": 2.0}
        self.cache = [torch.randn(3), 1.5]

    def forward(self, x):
        return (self.lin(x) * self.cfg["t"] * self.cfg["s"] * self.cache[0] * self.cache[1]).sin().sum()


def test_a_modules_dicts_and_lists_of_tensors_are_read_at_each_call():
    """Tensors a module holds in a dict or list attribute (not parameters or buffers) were read
    from the object they were at build time: one replaced (``self.cfg["t"] = ...``) was ignored
    (4.0 off). Now read again at each call, and the Python values beside them guarded;
    ``fxtools.compile`` builds again instead."""
    x = torch.randn(3)
    m = HoldsState()
    gm = fxtools.grad(m.forward, x)
    step = fxtools.compile(m)
    m.cfg["t"], m.cache[0] = torch.randn(3), torch.randn(3)
    assert _exact_or_refused(gm, m.forward, x) == "exact"
    m.cfg["s"] = 3.0
    assert _exact_or_refused(gm, m.forward, x) == "refused"
    xr = x.clone().requires_grad_()
    step(xr).backward()
    close(xr.grad, torch.func.grad(m.forward)(x))


def test_a_modules_list_of_tensors_its_code_never_names_may_change():
    """A list attribute of tensors that ``forward`` never reads (a training loop's record kept on
    the module) is not followed: replacing its tensors refuses no call, under compile either."""
    m = HoldsState()
    m.history = [torch.randn(3)]
    x = torch.randn(3)
    gm, step = fxtools.grad(m.forward, x), fxtools.compile(m)
    for _ in range(2):
        m.history[0] = torch.randn(3)
        assert _exact_or_refused(gm, m.forward, x) == "exact"
        xr = x.clone().requires_grad_()
        step(xr).backward()
        close(xr.grad, torch.func.grad(m.forward)(x))
