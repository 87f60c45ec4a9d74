"""Hostile and unusual input: nothing from user data becomes code, names never collide, no crashes.

Generated code may hold text from user data only as identifiers and plain built-in literals
(``naming.py``); names are in Python's normal form and shadow nothing the code uses; examples
stay fake however large they are.
"""

import collections
import enum
import pathlib
import resource
import time

import numpy as np
import pytest
import torch
import torch as T
import torch.fx as fx
import torch.nn as nn
from conftest import needs_graphviz
from isolated import run_isolated

import fxtools
from fxtools.codegen.export import ExportError
from fxtools.errors import FxtoolsError

D = torch.float64


def _evil_str(marker):
    """A str subclass whose repr is code that creates ``marker`` (and evaluates to 'a')."""

    class Evil(str):
        def __repr__(self):
            return f"(__import__('pathlib').Path({str(marker)!r}).touch() or 'a')"

    return Evil


def test_a_str_subclass_never_puts_its_repr_into_the_code(tmp_path):
    """Dict keys of inputs and outputs and returned constants are written as plain str literals."""
    marker = tmp_path / "ran"
    Evil = _evil_str(marker)

    def f(d):
        return {Evil("a"): (d[Evil("a")] * 2).sum(), "tag": Evil("a")}

    x = torch.randn(3, dtype=D)
    gm = fxtools.vjp(f, {Evil("a"): x})
    assert "__import__" not in gm.code and "pathlib" not in gm.code
    out, (grads,) = gm({"a": x}, {"a": torch.tensor(1.0, dtype=D), "tag": None})
    assert not marker.exists()
    assert type(out["tag"]) is str and out["tag"] == "a" and torch.equal(grads["a"], torch.full((3,), 2.0, dtype=D))
    g = fxtools.grad(lambda d: (d[Evil("a")] ** 2).sum(), {Evil("a"): x})
    fxtools.save(g, tmp_path / "g.py")
    assert "__import__" not in (tmp_path / "g.py").read_text()
    assert not marker.exists()


def test_constants_in_any_graph_are_checked_before_code_is_written(tmp_path):
    """The last check on every generated graph (``render.check_code_data``), also run by ``save``:
    subclasses of built-in types become plain literals; other objects and names that are not
    normal-form identifiers are refused."""
    from fxtools.codegen.render import check_code_data

    marker = tmp_path / "ran"
    Evil = _evil_str(marker)
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.sum, (x,), {"dim": (Evil("a"),)}))
    check_code_data(graph)
    assert "__import__" not in graph.python_code("self").src and "dim = ('a',)" in graph.python_code("self").src

    graph = fx.Graph()
    graph.output(graph.call_function(str, (pathlib.Path("a"),)))
    with pytest.raises(FxtoolsError, match="PosixPath|WindowsPath"):
        check_code_data(graph)

    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    setattr(gm, "\ufb01", torch.ones(1))  # 'ﬁ': `self.ﬁ` would read `self.fi`
    gm.graph.output(gm.graph.get_attr("\ufb01"))
    with pytest.raises(FxtoolsError, match="attribute name"):
        check_code_data(gm)
    text = fxtools.save(gm, tmp_path / "a.py")  # save names its constants itself, in normal form
    assert "\ufb01" not in text and "    fi = torch.tensor([1.0]" in text


def test_returned_dict_subclass_with_keyword_and_unnormalised_keys():
    """``OrderedDict`` is rebuilt by a call with keyword arguments only for keys that are plain
    identifiers: ``if=`` is a syntax error and ``ﬁ=`` would become the key ``fi``."""

    def f(x):
        return collections.OrderedDict([("if", x.sin()), ("\ufb01", x.cos()), ("fi", x.exp()), ("None", x)])

    x = torch.randn(3, dtype=D)
    gm = fxtools.vjp(f, x)
    ct = {
        "if": torch.ones(3, dtype=D),
        "\ufb01": 2 * torch.ones(3, dtype=D),
        "fi": 3 * torch.ones(3, dtype=D),
        "None": 4 * torch.ones(3, dtype=D),
    }
    out, (gx,) = gm(x, ct)
    assert list(out) == ["if", "\ufb01", "fi", "None"]  # a plain dict: its keys are no keyword arguments
    torch.testing.assert_close(out["\ufb01"], x.cos())
    torch.testing.assert_close(gx, x.cos() - 2 * x.sin() + 3 * x.exp() + 4)


class _TwoNorms(nn.Module):
    """Two BatchNorms whose names Python reads as one identifier (``ﬁ`` is ``fi`` in NFKC)."""

    def __init__(self):
        super().__init__()
        self.add_module("\ufb01", nn.BatchNorm1d(3))
        self.fi = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return (getattr(self, "\ufb01")(x) * 2 + self.fi(self.lin(x)) ** 2).sum()


def test_names_that_normalise_alike_stay_apart(float64):
    """Buffers ``ﬁ.running_mean`` and ``fi.running_mean`` are different tensors: gradients and
    the statistics updated in training mode equal eager PyTorch's."""
    torch.manual_seed(0)
    model, eager = _TwoNorms(), _TwoNorms()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(5, 3)
    gm = fxtools.grad(fxtools.functional(model), {k: p.detach() for k, p in model.named_parameters()}, x)
    grads = gm({k: p.detach() for k, p in model.named_parameters()}, x)
    eager(x).backward()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10)
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buf, rtol=1e-12, atol=0, msg=name)


@pytest.mark.parametrize("name", ["self", "grad_out", "torch", "sum", "inf", "device"])
def test_argument_names_never_collide_or_shadow(name):
    """An argument may be called anything: the generated code renames it if it would clash with
    ``self``, the cotangent ``grad_out``, the ``torch`` module, builtins or fx's globals."""
    ns = {}
    exec(f"def f(x, {name}):\n    return (x * {name}).sin().sum() + (x + {name}).exp().sum()\n", ns)
    x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    gm = fxtools.vjp(ns["f"], x, y)
    out, grads = gm(x, y, torch.tensor(1.0, dtype=D))
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    want = torch.autograd.grad(ns["f"](xr, yr), (xr, yr))
    torch.testing.assert_close(out, ns["f"](x, y))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _closing_over_torch():
    torch = T.arange(3.0, dtype=D)  # noqa: F841 - a tensor called torch, closed over by f
    w = T.full((3,), 2.0, dtype=D)

    def f(x):
        return (x * torch * w).sin().sum()

    return f


def test_a_closed_over_tensor_named_torch_in_a_saved_module(tmp_path):
    """A closed-over tensor called ``torch`` becomes a constant that shadows nothing, in ``gm``
    and in the standalone module (whose other constants are made with ``torch.full``)."""
    f = _closing_over_torch()
    x = torch.randn(3, dtype=D)
    gm = fxtools.grad(f, x)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(xr), xr)
    torch.testing.assert_close(gm(x), want)
    fxtools.save(gm, tmp_path / "g.py")
    torch.save((x, want), tmp_path / "io.pt")
    out = run_isolated(
        """
import torch, g
x, want = torch.load("io.pt")
torch.testing.assert_close(g.forward(x), want)
print("same")
""",
        tmp_path,
    )
    assert "same" in out


KEYS = ["1x", "a-b", "", "None", "if", "torch", "self", "grad_out", "x", 3, -0.0, 2.5, True, None, (1, "a")]


def test_any_plain_key_works(tmp_path):
    """Keys that are no identifiers, keywords, names of globals, numbers, None, tuples: inputs are
    indexed with them, outputs keep them, and the saved module does the same."""
    x = {k: torch.randn(2, dtype=D) * (i + 1) for i, k in enumerate(KEYS)}

    def f(d):
        return {k: (v * v).sum() for k, v in d.items()}

    gm = fxtools.vjp(f, x)
    ct = {k: torch.tensor(float(i), dtype=D) for i, k in enumerate(KEYS)}
    out, (grads,) = gm(x, ct)
    assert list(out) == KEYS and list(grads) == KEYS
    for i, k in enumerate(KEYS):
        torch.testing.assert_close(grads[k], 2 * i * x[k])
    fxtools.save(gm, tmp_path / "g.py")
    torch.save((x, ct, grads), tmp_path / "io.pt")
    assert "same" in run_isolated(
        """
import torch, g
x, ct, want = torch.load("io.pt")
out, (grads,) = g.forward(x, ct)
assert list(grads) == list(want)
for k in want:
    torch.testing.assert_close(grads[k], want[k])
print("same")
""",
        tmp_path,
    )


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    LOW = 1


@pytest.mark.parametrize(
    "key",
    [np.int64(1), np.float64(1.5), np.float32(0.5), Color.RED, Level.LOW],
    ids=["numpy int", "numpy float", "numpy float32", "enum", "int enum"],
)
def test_keys_equal_to_a_literal_or_enum_members_work(key):
    """A numpy number is written as the int or float it equals (it indexes the same entry); an
    enum member as ``Class.NAME``. Gradients equal autograd's."""
    x = torch.randn(3, dtype=D)

    def f(d):
        return {key: d[key].sin()}

    gm = fxtools.vjp(f, {key: x})
    out, (grads,) = gm({key: x}, {key: torch.ones(3, dtype=D)})
    torch.testing.assert_close(out[key], x.sin())
    torch.testing.assert_close(grads[key], x.cos())


@pytest.mark.parametrize(
    "key", [pathlib.Path("a"), float("nan"), np.float64("nan"), object()], ids=["path", "nan", "numpy nan", "object"]
)
def test_keys_code_cannot_hold_are_refused_clearly(key):
    """A key no literal can stand for (a Path), or that cannot index a dict (nan), is an error
    naming the argument and the key, never a crash in torch.fx or a module that cannot run."""
    with pytest.raises(FxtoolsError, match=r"the dict key of d\[.*cannot write into generated code"):
        fxtools.grad(lambda d: sum(v.sum() for v in d.values()), {key: torch.randn(3)})


def test_an_enum_key_from_a_user_module_is_not_saved_silently(tmp_path):
    """A standalone module imports only torch and the standard library: an enum key of the user's
    own class is refused by ``save`` with a clear error."""
    gm = fxtools.grad(lambda d: d[Color.RED].sum(), {Color.RED: torch.randn(3)})
    with pytest.raises(ExportError, match="Color"):
        fxtools.save(gm, tmp_path / "g.py")


class _RealTensorsMade(torch.overrides.TorchFunctionMode):
    """Records every real (not fake, not meta) tensor of at least ``numel`` elements a torch call returns."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and not isinstance(t, torch._subclasses.FakeTensor)
                and t.device.type != "meta"
                and t.numel() >= self.numel
            ):
                self.seen.append((getattr(func, "__name__", func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "split"])
def test_a_huge_example_on_the_meta_device_allocates_nothing(transform):
    """Examples stay fake: a 100000 x 100000 float32 example (40 GB if real) is traced quickly,
    and no real tensor of its size is ever made."""
    x = torch.empty(100000, 100000, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with _RealTensorsMade(10**9) as made:
        if transform == "grad":
            gm = fxtools.grad(lambda x: x.tanh().sum(), x)
        elif transform == "split":
            gm = fxtools.split(lambda x: x.tanh().sum(), x).backward
        else:
            gm = getattr(fxtools, transform)(lambda x: x.tanh() * 2, x)
    assert made.seen == []
    assert time.perf_counter() - start < 60
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1_000_000  # kB: under 1 GB more
    assert "tanh" in gm.code


class _Shouting(enum.Enum):
    """An enum whose repr is code: torch.fx prints items of dicts and namedtuples with repr."""

    A = 1

    def __repr__(self):
        return "__import__('os').getpid()"


_Pair = collections.namedtuple("_Pair", "value tag")


def test_enum_keys_of_returned_dicts():
    """A returned dict with an enum key is built by a call that fx prints item by item
    (``Class.NAME``), never with the member's own repr."""

    def f(x):
        return {_Shouting.A: x.sin(), "pair": _Pair(x.cos(), "t")}

    x = torch.randn(3, dtype=D)
    gm = fxtools.vjp(f, x)
    assert "getpid" not in gm.code and "_Shouting.A" in gm.code
    out, (gx,) = gm(x, {_Shouting.A: torch.ones(3, dtype=D), "pair": _Pair(torch.ones(3, dtype=D), None)})
    assert out["pair"].tag == "t" and isinstance(out["pair"], _Pair)
    torch.testing.assert_close(out[_Shouting.A], x.sin())
    torch.testing.assert_close(gx, x.cos() - x.sin())


@needs_graphviz
def test_draw_title_with_quotes_and_a_trailing_backslash(tmp_path):
    """Text in a picture is escaped: a title ending in a backslash used to end Graphviz's string early."""
    import shutil

    pytest.importorskip("pydot")
    if shutil.which("dot") is None:
        pytest.skip("Graphviz is not installed")
    gm = fxtools.grad(lambda x: x.sin().sum(), torch.randn(3))
    fxtools.draw(gm, tmp_path / "a.svg", title='C:\\models\\ "<b>"\\')
    svg = (tmp_path / "a.svg").read_text()
    assert "C:\\models\\ &quot;&lt;b&gt;&quot;\\" in svg
