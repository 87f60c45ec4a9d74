"""Python decisions on symbolic sizes, and layout reads, are guarded: exact or InputMismatch.

Each program branches (or computes) on something the example decides: a size modulo 2, two sizes
compared, ``numel()``, a size ``!=`` a constant, ``torch.split``'s number of chunks, a derived
``Dim`` (``2*b``), ``x.is_contiguous()``, ``x.stride(0)``. Each module, from every transform
that takes ``dynamic_shapes``, is called at sizes (or layouts) on both sides of the decision:
every answer must equal ``torch.func`` in float64, or be refused with ``InputMismatch`` naming
the user's line; the other side must be refused, and the example's side at new sizes be exact.
"""

import importlib.util
import math

import pytest
import torch
from torch.export import Dim

import fxtools

pytestmark = pytest.mark.usefixtures("float64")


def mod2(x):
    return (x * x).sum() if x.shape[0] % 2 == 0 else (3 * x).sum()


def numel_test(x):
    return (x * x).sum() if x.numel() > 12 else (3 * x.sin()).sum()


def not_seven(x):
    return (x * x).sum() if x.shape[0] != 7 else (3 * x).sum()


def chunks(x):
    return sum((i + 1) * (p * p).sum() for i, p in enumerate(torch.split(x, 3)))


def floor_of_ratio(x):
    return (x * x).sum() if math.floor(x.shape[0] / 3) == 1 else (3 * x).sum()


def two_sizes(x, y):
    return (x * x).sum() + y.sum() if y.shape[0] < x.shape[0] else (3 * x).sum() + (y * y).sum()


# program, example shapes, [(shapes, whether the example's side of the decision)]
SIZE_CASES = [
    (mod2, [(4, 3)], [([(6, 3)], True), ([(5, 3)], False), ([(3, 3)], False)]),
    (numel_test, [(4, 3)], [([(3, 3)], True), ([(5, 3)], False)]),
    (not_seven, [(4, 3)], [([(9, 3)], True), ([(7, 3)], False)]),
    (chunks, [(6, 3)], [([(5, 3)], True), ([(7, 3)], False), ([(3, 3)], False)]),
    (two_sizes, [(4, 3), (3,)], [([(6, 3), (2,)], True), ([(3, 3), (5,)], False)]),
    (floor_of_ratio, [(4, 3)], [([(5, 3)], True), ([(6, 3)], False), ([(2, 3)], False)]),
]


def _args(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen) for s in shapes)


def _auto(args):
    return tuple({0: Dim.AUTO} for _ in args)


def _close(got, want):
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


def _grad(f, args):
    gm = fxtools.grad(f, *args, argnums=tuple(range(len(args))), dynamic_shapes=_auto(args))
    return gm, lambda a: gm(*a), lambda a: torch.func.grad(f, argnums=tuple(range(len(a))))(*a)


def _vjp(f, args):
    gm = fxtools.vjp(f, *args, dynamic_shapes=_auto(args))
    ct = torch.tensor(1.5)
    return gm, lambda a: gm(*a, ct), lambda a: (f(*a), torch.func.vjp(f, *a)[1](ct))


def _jvp(f, args):
    gm = fxtools.jvp(f, *args, dynamic_shapes=_auto(args))
    return gm, lambda a: gm(*a, *(t.cos() for t in a)), lambda a: torch.func.jvp(f, a, tuple(t.cos() for t in a))


def _hvp(f, args):
    gm = fxtools.hvp(f, *args, dynamic_shapes=_auto(args))

    def ref(a):
        return torch.func.jvp(lambda x: torch.func.grad(f)(x, *a[1:]), (a[0],), (a[0].cos(),))[1]

    return gm, lambda a: gm(*a, a[0].cos()), ref


def _split(f, args):
    sp = fxtools.split(f, *args, dynamic_shapes=_auto(args))
    ct = torch.tensor(1.5)

    def run(a):
        out, saved = sp.forward(*sp.flatten(*a))
        return out, sp.backward(*saved, ct)

    return sp.forward, run, lambda a: (f(*a), torch.func.vjp(f, *a)[1](ct))


def _saved(f, args, tmp_path=None):
    gm, _, ref = _grad(f, args)
    path = str(tmp_path / f"{f.__name__}_grad.py")
    fxtools.save(gm, path)
    spec = importlib.util.spec_from_file_location(f"saved_{f.__name__}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return None, lambda a: module.forward(*a), ref


TRANSFORMS = {"grad": _grad, "vjp": _vjp, "jvp": _jvp, "hvp": _hvp, "split": _split}


def _outcome(run, ref, args) -> str:
    """ "exact" or "refused" (InputMismatch naming the user's line); a wrong answer fails."""
    try:
        got = run(args)
    except ValueError as exc:  # fxtools.InputMismatch, or the one a saved module defines
        assert type(exc).__name__ == "InputMismatch", exc
        assert "test_guards_decisions.py:" in str(exc) or "layout" in str(exc), exc
        return "refused"
    _close(got, ref(args))
    return "exact"


def _check(make, f, example, calls, **kw):
    args = _args(example)
    _, run, ref = make(f, args, **kw)
    assert _outcome(run, ref, args) == "exact"
    for k, (shapes, same_side) in enumerate(calls):
        outcome = _outcome(run, ref, _args(shapes, seed=k + 1))
        assert outcome == ("exact" if same_side else "refused"), (f.__name__, shapes, outcome)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", SIZE_CASES, ids=lambda c: c[0].__name__)
def test_size_decisions_guarded(case, transform):
    f, example, calls = case
    if transform == "hvp" and f is chunks:
        calls = calls[:2]  # (the second pass meets the same decisions; keep the test quick)
    _check(TRANSFORMS[transform], f, example, calls)


@pytest.mark.parametrize("case", SIZE_CASES, ids=lambda c: c[0].__name__)
def test_saved_module_guards_decisions(case, tmp_path):
    f, example, calls = case
    _check(_saved, f, example, calls, tmp_path=tmp_path)


def test_refusal_names_condition_and_line():
    gm = fxtools.grad(mod2, torch.randn(4, 3), dynamic_shapes={"x": {0: Dim.AUTO}})
    assert "x.size(0) % 2) == 0" in str(gm.guards)
    with pytest.raises(
        fxtools.InputMismatch, match=r"x.size\(0\) is 5.*% 2\) == 0.*test_guards_decisions.py:\d+: return \(x \* x\)"
    ):
        gm(torch.randn(5, 3))


def test_narrowed_range_names_the_decision():
    def f(x):
        return (x * x).sum() if x.shape[0] > 3 else x.sum()

    gm = fxtools.grad(f, torch.randn(5, 3), dynamic_shapes={"x": {0: Dim.AUTO}})
    assert "any size in [4, inf]" in str(gm.guards)
    with pytest.raises(fxtools.InputMismatch, match=r"x.size\(0\) > 3 .*test_guards_decisions.py"):
        gm(torch.randn(3, 3))


def test_vmap_size_decision_guarded():
    def f(x):  # per sample: x has n elements
        return x * 2 if x.shape[0] % 2 == 0 else x.sin()

    gm = fxtools.vmap(f, torch.randn(3, 4), dynamic_shapes={"x": {1: Dim.AUTO}})
    x = torch.randn(3, 6)
    _close(gm(x), torch.func.vmap(f)(x))
    with pytest.raises(fxtools.InputMismatch, match="% 2"):
        gm(torch.randn(3, 5))


def test_derived_dim_honoured():
    b = Dim("b")

    def f(x, y):
        return (x[: y.shape[0]] * y).sum() + (x * x).sum()

    x, y = torch.randn(8, 3), torch.randn(4, 3)
    gm = fxtools.grad(f, x, y, argnums=(0, 1), dynamic_shapes={"x": {0: 2 * b}, "y": {0: b}})
    for n in (3, 6):
        a = (torch.randn(2 * n, 3), torch.randn(n, 3))
        _close(gm(*a), torch.func.grad(f, argnums=(0, 1))(*a))
    with pytest.raises(fxtools.InputMismatch, match="2\\*b"):
        gm(torch.randn(9, 3), torch.randn(4, 3))

    def g(x):  # the root b appears only through 2*b: solved from x.size(0)
        return (x.reshape(2, -1, 3) ** 2).sum()

    gm = fxtools.grad(g, x, dynamic_shapes={"x": {0: 2 * b}})
    a = torch.randn(10, 3)
    _close(gm(a), torch.func.grad(g)(a))
    with pytest.raises(fxtools.InputMismatch, match="% 2"):
        gm(torch.randn(9, 3))


# ---- layout ----


def branch_on_contiguity(x):
    return (x * x).sum() if x.is_contiguous() else (3 * x).sum()


def stride_arithmetic(x):
    return (x * x.stride(0)).sum()


def reads_through_a_view(x):
    return (x * x).sum() if x.t().is_contiguous() else x.sum()


def no_layout_read(x):
    return (x.sin() * x).sum()


LAYOUTS = {
    "contiguous": lambda shape: torch.randn(shape),
    "transposed": lambda shape: torch.randn(shape[::-1]).t(),
    "sliced": lambda shape: torch.randn(shape[0], 2 * shape[1])[:, ::2],
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "auto"])
@pytest.mark.parametrize(
    "f", [branch_on_contiguity, stride_arithmetic, reads_through_a_view, no_layout_read], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("example", ["contiguous", "transposed"])
def test_layout_reads_guarded(f, example, dynamic):
    x = LAYOUTS[example]((4, 3))
    marks = {"x": {0: Dim.AUTO, 1: Dim.AUTO}} if dynamic else None
    gm = fxtools.grad(f, x, dynamic_shapes=marks)
    outcomes = {}
    for name, make in LAYOUTS.items():
        for shape in [(4, 3)] + ([(6, 5)] if dynamic else []):
            a = make(shape)
            outcomes[name, shape] = _outcome(gm, torch.func.grad(f), a)
    assert outcomes[example, (4, 3)] == "exact"
    if f is no_layout_read:  # never over-guarded: any layout
        assert set(outcomes.values()) == {"exact"}, outcomes
    else:
        other = "transposed" if example == "contiguous" else "contiguous"
        assert outcomes[other, (4, 3)] == "refused", outcomes


def test_saved_module_checks_layout_reads(tmp_path):
    gm = fxtools.grad(branch_on_contiguity, torch.randn(4, 3))
    path = str(tmp_path / "contiguity_grad.py")
    fxtools.save(gm, path)
    spec = importlib.util.spec_from_file_location("saved_contiguity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.randn(4, 3)
    _close(module.forward(x), torch.func.grad(branch_on_contiguity)(x))
    with pytest.raises(ValueError, match=r"is_contiguous\(\) to be True .*test_guards_decisions.py:\d+"):
        module.forward(torch.randn(3, 4).t())


def test_memory_format_and_storage_offset_reads():
    def channels_last(x):
        return (x * x).sum() if x.is_contiguous(memory_format=torch.channels_last) else x.sin().sum()

    def offset(x):
        return (x * x.storage_offset()).sum()

    x = torch.randn(2, 3, 4, 5)
    gm = fxtools.grad(channels_last, x, dynamic_shapes={"x": {0: Dim.AUTO, 2: Dim.AUTO}})
    assert _outcome(gm, torch.func.grad(channels_last), torch.randn(3, 3, 6, 5)) == "exact"
    assert _outcome(gm, torch.func.grad(channels_last), x.to(memory_format=torch.channels_last)) == "refused"
    shifted = torch.randn(30)[2:26].view(2, 3, 4)
    gm = fxtools.grad(offset, shifted)
    assert _outcome(gm, torch.func.grad(offset), torch.randn(40)[2:26].view(2, 3, 4)) == "exact"
    assert _outcome(gm, torch.func.grad(offset), torch.randn(24).view(2, 3, 4)) == "refused"
    with pytest.raises(fxtools.FxtoolsError, match="storage offset"):  # a symbolic offset: refused when built
        fxtools.grad(offset, shifted, dynamic_shapes={"x": {0: Dim.AUTO}})


def test_vmap_layout_read_guarded():
    def f(x):  # per sample: the sample's contiguity, decided by the batch's layout
        return x * x if x.is_contiguous() else x.sin()

    gm = fxtools.vmap(f, torch.randn(5, 4, 3))
    for x, want in [(torch.randn(6, 4, 3)[:5], "exact"), (torch.randn(5, 3, 4).transpose(1, 2), "refused")]:
        assert _outcome(gm, torch.func.vmap(f), x) == want


def test_code_reading_no_layout_serves_every_layout():
    """An ``eye`` made on ``x.device`` (laplacian's basis) ties the code to no layout of ``x``: a
    transposed or expanded argument is served exactly (both were refused: the guard walked from the
    eye's ``.view`` through ``x.device`` to ``x``)."""

    def loss(x):
        return (x.sin() * x).square().sum()

    x = torch.randn(2, 3)
    lap = fxtools.laplacian(loss, x)
    for a in [torch.randn(3, 2).t(), torch.randn(1, 3).expand(2, 3)]:
        # torch.func's forward mode cannot write tangents into an expanded primal: the same values, contiguous
        assert (
            _outcome(lambda a: lap(a)[1], lambda a: torch.func.hessian(loss)(a.contiguous()).reshape(6, 6).trace(), a) == "exact"
        )


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_as_strided_reads_the_arguments_storage_offset(offset):
    """as_strided with an explicit storage_offset addresses the storage, not the view: a module made
    at one offset is exact there and refuses another offset (it once gave the first offset's gradient)."""

    def f(x):
        return torch.as_strided(x, (2, 2), (1, 2), storage_offset=2).sin().sum()

    base = torch.randn(20, dtype=torch.float64)
    gm = fxtools.grad(f, base[1:13])
    x = base[offset : offset + 12]
    if offset == 1:
        torch.testing.assert_close(gm(x), torch.func.grad(f)(x))
    else:
        with pytest.raises(
            fxtools.InputMismatch, match=f"storage_offset\\(\\) {offset}, but the module was made for storage_offset\\(\\) 1"
        ):
            gm(x)
