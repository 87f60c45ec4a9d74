"""Ordinary PyTorch idioms behave as in eager PyTorch, or are refused naming the line or argument.

Oracle: eager autograd in float64. ``.data`` is ``detach()``; writes through it into values that
carry a gradient, ``p.data = ...`` and ``requires_grad_(False)`` on a non-leaf are refused (the last
as eager refuses it); ``torch.inference_mode()`` is ``no_grad``; tensors hidden in arguments that are
not pytrees are refused at generation time.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn as nn

import fxtools
from fxtools.errors import FxtoolsError

D = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _eager_grad(f, *args, argnums=0):
    args = [a.detach().clone().requires_grad_(i == argnums) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    return torch.autograd.grad(f(*args), args[argnums])[0]


def _line(f, text):
    """'file:line' of the line of ``f``'s source containing ``text``."""
    import inspect

    lines, start = inspect.getsourcelines(f)
    i = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(f)}:{start + i}"


# --- .data -------------------------------------------------------------------------------------


def data_of_intermediate(x):
    y = x * x
    return (y.data * x).sum()


def data_of_input(x):
    return (x.data * x).sum()


def data_in_output(x):
    return (x * 2).data.sum() + (x * x).sum()


@pytest.mark.parametrize("f", [data_of_intermediate, data_of_input, data_in_output])
def test_data_is_detach(f):
    x = _x(5)
    grad = fxtools.grad(f, x)(x)
    assert type(grad) is torch.Tensor  # not a FakeTensor baked in at generation time
    torch.testing.assert_close(grad, _eager_grad(f, x), rtol=0, atol=1e-12)
    x2 = _x(5, seed=1)
    torch.testing.assert_close(fxtools.grad(f, x)(x2), _eager_grad(f, x2), rtol=0, atol=1e-12)


def test_data_of_parameter():
    model = nn.Linear(3, 2).double()

    def loss(params, x):
        w = params["weight"]
        return (x @ w.t() * w.data.sum()).sum() + params["bias"].sum()

    params = {k: v.detach() for k, v in model.named_parameters()}
    x = _x(4, 3)
    grads = fxtools.grad(loss, params, x)(params, x)
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    expected = torch.autograd.grad(loss(p, x), list(p.values()))
    for g, e in zip(grads.values(), expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def write_through_data(x):
    y = x * x
    z = y * x
    y.data.mul_(0)
    return (z + y * x).sum()


def write_through_data_of_input(x):
    a = x * x
    x.data.mul_(2)
    return (a + x * x).sum()


@pytest.mark.parametrize("f, text", [(write_through_data, "y.data.mul_(0)"), (write_through_data_of_input, "x.data.mul_(2)")])
def test_write_through_data_is_refused_with_the_line(f, text):
    """Eager applies the write without autograd seeing it, except in the tensors autograd saved
    (so its gradient depends on what it saves): fxtools refuses it."""
    with pytest.raises(FxtoolsError, match=re.escape(_line(f, text)) + r".*\.data"):
        fxtools.grad(f, _x(3))


def test_write_through_data_of_constant_is_kept():
    """A write through ``.data`` into a tensor that is not differentiated (a buffer) happens, as in eager."""
    buf = torch.zeros(3, dtype=D)

    def f(x):
        buf.data.add_(1)
        return (x * buf).sum()

    x = _x(3)
    gm = fxtools.grad(f, x)
    buf.zero_()
    torch.testing.assert_close(gm(x), torch.ones(3, dtype=D))
    torch.testing.assert_close(buf, torch.ones(3, dtype=D))


def test_write_through_view_of_constant_is_kept():
    """``buf[0].add_(1)`` on a closed-over tensor reaches it (today's code drops the write)."""
    buf = torch.zeros(3, dtype=D)

    def f(x):
        buf[0].add_(1)
        return (x * buf).sum()

    x = _x(3)
    gm = fxtools.vjp(f, x)
    buf.zero_()
    out, (grad,) = gm(x, torch.tensor(1.0, dtype=D))
    expected = torch.tensor([1.0, 0.0, 0.0], dtype=D)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(out, x[0], rtol=0, atol=0)
    torch.testing.assert_close(buf, expected, rtol=0, atol=0)


def assign_data(x):
    y = x * 2
    y.data = x * 3
    return y.sum()


def test_assigning_data_is_refused_with_the_line():
    with pytest.raises(FxtoolsError, match=re.escape(_line(assign_data, "y.data = x * 3"))):
        fxtools.grad(assign_data, _x(3))


# --- grad modes --------------------------------------------------------------------------------


def inference_block(x):
    with torch.inference_mode():
        y = x * 2
    return (y + x * x).sum()


@torch.inference_mode()
def _doubled(x):
    return x * 2


def inference_decorator(x):
    return (_doubled(x) + x * x).sum()


def inference_off_inside(x):
    with torch.inference_mode():
        with torch.inference_mode(False):
            y = x * 2
    return (y + x * x).sum()


@pytest.mark.parametrize(
    "f, expected",
    [(inference_block, lambda x: 2 * x), (inference_decorator, lambda x: 2 * x), (inference_off_inside, lambda x: 2 * x + 2)],
)
def test_inference_mode_is_no_grad(f, expected):
    x = _x(4)
    torch.testing.assert_close(fxtools.grad(f, x)(x), expected(x), rtol=0, atol=1e-12)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def inference_block_eager_equivalent(x):
    with torch.no_grad():
        y = x * 2
    return (y + x * x).sum()


def test_inference_mode_matches_eager_no_grad():
    """Eager autograd refuses to save an inference tensor for the backward; where it does not need
    to, the block is a constant, as under no_grad."""
    x = _x(4)
    torch.testing.assert_close(
        fxtools.grad(inference_block, x)(x), _eager_grad(inference_block_eager_equivalent, x), rtol=0, atol=0
    )


def requires_grad_off(x):
    y = x * x
    y.requires_grad_(False)
    return (y * x).sum()


def requires_grad_attr_off(x):
    y = x.sin()
    y.requires_grad = False
    return (y * x).sum()


@pytest.mark.parametrize(
    "f, text", [(requires_grad_off, "y.requires_grad_(False)"), (requires_grad_attr_off, "y.requires_grad = False")]
)
def test_requires_grad_off_on_non_leaf_raises_as_eager(f, text):
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf variables"):
        _eager_grad(f, _x(3))
    with pytest.raises(FxtoolsError, match=re.escape(_line(f, text)) + ".*only change requires_grad flags of leaf"):
        fxtools.grad(f, _x(3))


def requires_grad_off_on_leaf(x, c):
    k = c * 2  # does not depend on x: a leaf in eager
    k.requires_grad_(False)
    with torch.no_grad():
        m = x * 3  # computed without grad: a leaf too
    m.requires_grad_(False)
    return (k * x + m * x).sum()


def test_requires_grad_off_on_leaves_is_allowed():
    x, c = _x(3), _x(3, seed=1)
    torch.testing.assert_close(
        fxtools.grad(requires_grad_off_on_leaf, x, c)(x, c), _eager_grad(requires_grad_off_on_leaf, x, c), rtol=0, atol=1e-12
    )


def requires_grad_off_other_arg(x, c):
    y = x * x
    y.requires_grad_(False)
    return (y * c).sum()


def test_requires_grad_off_on_value_of_undifferentiated_argument():
    """Differentiated with respect to ``c`` only, ``x * x`` is a leaf, as in eager when only ``c``
    requires grad."""
    x, c = _x(3), _x(3, seed=1)
    torch.testing.assert_close(
        fxtools.grad(requires_grad_off_other_arg, x, c, argnums=1)(x, c),
        _eager_grad(requires_grad_off_other_arg, x, c, argnums=1),
        rtol=0,
        atol=0,
    )


# --- arguments that are not pytrees ------------------------------------------------------------


@dataclasses.dataclass
class Holder:
    t: torch.Tensor


class Plain:
    def __init__(self, t):
        self.scale = 2.0
        self.parts = [t]


def scaled(x, h):
    return (x * h.t).sum()


def scaled_plain(x, h):
    return (x * h.parts[0] * h.scale).sum()


def scaled_set(x, s):
    return (x * next(iter(s))).sum()


def scaled_nested(x, h):
    return scaled(x, h["a"][0])


@pytest.mark.parametrize(
    "f, arg, where, how",
    [
        (scaled, Holder(_x(3)), "h.t", "register_dataclass"),
        (scaled_plain, Plain(_x(3)), "h.parts[0]", "register_pytree_node"),
        (scaled_nested, {"a": [Holder(_x(3))]}, "h['a'][0].t", "register_dataclass"),
        (scaled_set, {_x(3)}, "s{...}", "list or tuple"),
    ],
)
def test_tensor_in_non_pytree_argument_is_refused(f, arg, where, how):
    """Today's code would bake the tensor in as a constant: later calls ignore it, its gradient is None."""
    with pytest.raises(FxtoolsError, match=re.escape(where) + ".*not a pytree.*" + re.escape(how)):
        fxtools.grad(f, _x(3), arg)


def test_registered_dataclass_is_an_argument():
    @dataclasses.dataclass
    class Registered:
        t: torch.Tensor

    torch.utils._pytree.register_dataclass(Registered)
    try:
        x, h = _x(3), Registered(_x(3, seed=1))
        gm = fxtools.grad(scaled, x, h, argnums=(0, 1))
        h2 = Registered(_x(3, seed=2))
        gx, gh = gm(x, h2)
        torch.testing.assert_close(gx, h2.t)
        torch.testing.assert_close(gh.t, x)
    finally:
        torch.utils._pytree._deregister_pytree_node(Registered)


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor | None


def _batch_loss(w, b):
    r = b.x @ w - (0 if b.y is None else b.y)
    return _Batch(x=r.pow(2).mean(), y=r.abs().sum())


@pytest.mark.parametrize("how", ["split", "compile"])
def test_registered_dataclass_in_and_out_of_split_and_compile(float64, how):
    """A registered dataclass as an argument and as the result of split/compile (their graphs were
    refused: the gradients' dataclass was no code), with a None field dropped by its flattening."""
    torch.utils._pytree.register_dataclass(_Batch)
    try:
        w = torch.randn(3, 2, requires_grad=True)
        example = _Batch(torch.randn(4, 3), torch.randn(4, 2))
        if how == "split":
            sp = fxtools.split(_batch_loss, w, example)
            assert "_Batch(x=" in sp.backward.code and "_Batch(x=" in sp.forward.code
        step = fxtools.compile(_batch_loss, w, example)
        for n, y in ((4, "grad"), (7, "grad"), (6, "constant"), (5, None)):
            b = _Batch(torch.randn(n, 3, requires_grad=True), None if y is None else torch.randn(n, 2))
            if y == "grad":
                b.y.requires_grad_()
            leaves = [w, b.x] + ([b.y] if y == "grad" else [])
            if how == "split":
                out, grads = fxtools.split(_batch_loss, w, b).vjp(w, b, grad_out=_Batch(torch.tensor(1.0), torch.tensor(2.0)))
                got = [grads[0], grads[1].x] + ([grads[1].y] if y == "grad" else [])
            else:
                out = step(w, b)
                got = torch.autograd.grad(out.x + 2 * out.y, leaves)
            ref = _batch_loss(w, b)
            want = torch.autograd.grad(ref.x + 2 * ref.y, leaves)
            assert type(out) is _Batch
            torch.testing.assert_close((out.x, out.y), (ref.x, ref.y))
            torch.testing.assert_close(got, list(want))
    finally:
        torch.utils._pytree._deregister_pytree_node(_Batch)


def test_non_tensor_objects_are_still_specialised():
    class Config:
        def __init__(self):
            self.scale = 3.0

    x, config = _x(3), Config()
    torch.testing.assert_close(
        fxtools.grad(lambda x, c: (x * c.scale).sum(), x, config)(x, config), torch.full((3,), 3.0, dtype=D)
    )


# --- NaN, infinities and signed zeros: every gradient as autograd's -----------------------------

NAN, INF = float("nan"), float("inf")
SPECIAL = [NAN, INF, -INF, -0.0, 0.0]
ORDINARY = [0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 3.0, 6.0, 20.0]  # and the kinks of the activations


def assert_same_specials(got, want, inputs, rtol=1e-9, signed_zeros=True):
    """``got`` equals autograd's ``want`` at NaN (NaN == NaN), at infinities and at zeros (the sign
    bit included); other values may differ by rounding (a rule's formula need not be the kernel's)."""
    want = torch.zeros_like(got) if want is None else want
    got = torch.zeros_like(want) if got is None else got
    nan = want.isnan()
    zero_or_inf = (want == 0) | want.isinf()
    same_sign = (got.signbit() == want.signbit()) | (not signed_zeros and want == 0)
    ok = (got.isnan() == nan) & torch.where(zero_or_inf, (got == want) & same_sign, True)
    finite = ~nan & ~zero_or_inf
    ok &= torch.where(finite, torch.isclose(got, want, rtol=rtol, atol=0), True)
    bad = (~ok).nonzero()
    assert not len(bad), "differs from autograd at " + "; ".join(
        f"inputs {[float(t[tuple(i)]) for t in inputs]}: {float(got[tuple(i)])} vs {float(want[tuple(i)])}"
        for i in bad[:5].tolist()
    )


def _autograd_elementwise(f, inputs):
    """Autograd's gradients of pointwise ``f``, one element at a time: PyTorch's vectorised CPU
    loops disagree with its scalar code at NaN for some ops (hardtanh's backward is 0 at NaN on 8
    or more float64 elements, 1 on fewer, as on GPU); the scalar code is the reference."""
    grads = [[] for _ in inputs]
    for i in range(inputs[0].numel()):
        leaves = [t[i : i + 1].clone().requires_grad_() for t in inputs]
        out = f(*leaves)
        for g, w in zip(grads, torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)):
            g.append(torch.zeros(1, dtype=D) if w is None else w)
    return [torch.cat(g) for g in grads]


# autograd's hardsigmoid backward multiplies by 1/6 rounded to float32, also in float64
_RTOL = {"nn.functional.hardsigmoid": 1e-7}


def _compare_with_autograd(f, inputs, rtol=1e-9):
    out = f(*inputs)
    if not isinstance(out, torch.Tensor):  # frexp: the mantissa
        f0 = f
        f, out = (lambda *xs: f0(*xs)[0]), out[0]
    if out.is_complex() or not out.is_floating_point():
        pytest.skip("complex or non-float output: not a special-value case of a real rule")
    want = _autograd_elementwise(f, inputs)
    _, got = fxtools.vjp(f, *inputs)(*inputs, torch.ones_like(out))
    for g, w in zip(got, want):
        assert_same_specials(g, w, inputs, rtol)


def _opinfos():
    from torch.testing._internal.common_methods_invocations import binary_ufuncs, op_db, unary_ufuncs

    unary = {o.name for o in unary_ufuncs}
    binary = {o.name for o in binary_ufuncs} | {"logaddexp", "logaddexp2"}
    activations = {
        "nn.functional." + n
        for n in (
            "relu",
            "relu6",
            "hardtanh",
            "threshold",
            "elu",
            "selu",
            "celu",
            "leaky_relu",
            "gelu",
            "silu",
            "mish",
            "softplus",
            "logsigmoid",
            "hardsigmoid",
            "hardswish",
            "softshrink",
            "hardshrink",
            "tanhshrink",
        )
    } | {"logit"}
    random = {"nn.functional.rrelu"}  # random: see the tests of random ops below
    out = []
    for op in op_db:
        if op.name not in unary | binary | activations or op.name in random or not op.supports_autograd:
            continue
        if torch.float64 not in op.supported_dtypes("cpu"):
            continue
        out.append((op, "binary" if op.name in binary else "unary"))
    return out


_OPINFOS = _opinfos()


def _pointwise_case(op, kind):
    """``(f, inputs)``: the op at every special and ordinary value (every pair of them for binary
    ops), its other arguments taken from its first OpInfo sample."""
    values = torch.tensor(SPECIAL + ORDINARY, dtype=D)
    sample = next(iter(op.sample_inputs("cpu", D, requires_grad=False)))
    args = list(sample.args)
    if kind == "binary":
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        a, b = torch.meshgrid(values, values, indexing="ij")
        inputs, args = (a.reshape(-1), b.reshape(-1)), args[1:]
    else:
        inputs = (values,)
    if any(isinstance(a, torch.Tensor) for a in args) or not isinstance(sample.input, torch.Tensor):
        return None
    kwargs = dict(sample.kwargs)
    return (lambda *xs: op.op(*xs, *args, **kwargs)), inputs


@pytest.mark.parametrize(
    "op, kind", _OPINFOS, ids=[f"{o.name}{'-' + o.variant_test_name if o.variant_test_name else ''}" for o, _ in _OPINFOS]
)
def test_pointwise_rules_at_special_values(op, kind):
    case = _pointwise_case(op, kind)
    if case is None:
        pytest.skip("its first OpInfo sample takes other tensor arguments")
    f, inputs = case
    _compare_with_autograd(f, inputs, _RTOL.get(op.name, 1e-9))


# one slice per case: autograd's prod chooses its formula by whether the *whole* input holds a zero
_VECTORS = (
    [[s, 1.0, 2.0] for s in SPECIAL]
    + [[0.0, s, 3.0] for s in SPECIAL]
    + [[s, -0.0, -1.0] for s in SPECIAL]
    + [[0.0, INF, 1.0], [INF, -INF, 2.0], [NAN, NAN, 1.0], [1.0, 1.0, -2.0]]
)
_REDUCTIONS = {
    "max": torch.max,
    "min": torch.min,
    "median": torch.median,
    "nanmedian": torch.nanmedian,
    "amax": lambda x: torch.amax(x, 0),
    "amin": lambda x: torch.amin(x, 0),
    "prod": torch.prod,
    "prod_dim": lambda x: torch.prod(x, 0),
    "cumprod": lambda x: torch.cumprod(x, 0),
    "logsumexp": lambda x: torch.logsumexp(x, 0),
    "sum": torch.sum,
    "mean": torch.mean,
    "softmax": lambda x: torch.softmax(x, 0),
    "log_softmax": lambda x: torch.log_softmax(x, 0),
    "max_dim": lambda x: torch.max(x, 0).values,
    "norm": torch.linalg.vector_norm,
}
# with two zeros autograd's full product returns zeros_like (+0.0), its product over a dim signed
# zeros (exclusive products): the sign of these zeros is not well defined
_PROD_TWO_ZEROS = {"prod": [8, 9, 13, 14], "prod_dim": [8, 9, 13, 14]}


@pytest.mark.parametrize("name", list(_REDUCTIONS))
def test_reduction_rules_at_special_values(name):
    f = _REDUCTIONS[name]
    gm = fxtools.vjp(f, torch.tensor(_VECTORS[0], dtype=D))
    for i, v in enumerate(_VECTORS):
        x = torch.tensor(v, dtype=D)
        xe = x.clone().requires_grad_()
        out = f(xe)
        ct = torch.ones_like(out)
        # cumprod: autograd's two formulas differ at a zero beside an inf or NaN; fxtools has the
        # one of create_graph=True (its double backward's, without division)
        (want,) = torch.autograd.grad(out, xe, ct, create_graph=name == "cumprod")
        _, (got,) = gm(x, ct)
        assert_same_specials(got, want.detach(), [x], signed_zeros=i not in _PROD_TWO_ZEROS.get(name, ()))


@pytest.mark.parametrize(
    "f, x, expected",
    [
        (torch.relu, NAN, 1.0),
        (lambda x: torch.threshold(x, 0.5, 0.0), NAN, 1.0),
        (torch.nn.functional.relu6, NAN, 1.0),
        (torch.nn.functional.hardtanh, NAN, 1.0),
        (torch.nn.functional.elu, NAN, 1.0),
        (torch.selu, NAN, 1.0507009873554805),
        (torch.celu, NAN, 1.0),
        (torch.special.logit, -0.0, INF),
        (lambda x: torch.logaddexp(x, torch.zeros_like(x)), INF, 1.0),
    ],
)
def test_issue_examples_at_special_values(f, x, expected):
    """The values the issue lists (checked against autograd too, by the sweeps above)."""
    x = torch.tensor([x], dtype=D)
    _, (grad,) = fxtools.vjp(f, x)(x, torch.ones(1, dtype=D))
    assert grad.item() == expected
    xe = x.clone().requires_grad_()
    assert torch.autograd.grad(f(xe).sum(), xe)[0].item() == expected


def test_issue_examples_of_reductions():
    for f in (torch.max, torch.min, torch.median):
        x = torch.tensor([NAN, 1.0, 2.0], dtype=D)
        _, (grad,) = fxtools.vjp(f, x)(x, torch.tensor(1.0, dtype=D))
        assert grad.tolist() == [1.0, 0.0, 0.0]
    x = torch.tensor([0.0, INF], dtype=D)
    _, (grad,) = fxtools.vjp(torch.prod, x)(x, torch.tensor(1.0, dtype=D))
    assert grad.tolist() == [INF, 0.0]


# --- random ops: the same seed gives eager's numbers, and leaves the generator where eager does ----

_gen = torch.Generator().manual_seed(5)


def _r(*shape):
    return torch.randn(*shape, dtype=D, generator=_gen)


torch.manual_seed(0)
_MHA = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True).double()
_MHA_KV = nn.MultiheadAttention(4, 2, dropout=0.5, kdim=3, vdim=5).double()
_PADDING = torch.tensor([[False, False, True, False, False], [False, True, False, False, False]])

RANDOM_CASES = {
    "normal": (lambda m, s: torch.normal(m, s) * m, (_r(1, 2, 3), _r(5, 2, 3).abs())),
    "normal_mean": (lambda m: torch.normal(m, 2.0) * m, (_r(4, 3),)),
    "normal_std": (lambda s: torch.normal(1.0, s) * s, (_r(4, 3).abs(),)),
    "normal_": (lambda x: x * torch.empty_like(x).normal_(), (_r(5),)),
    "randn_like": (lambda x: x * torch.randn_like(x), (_r(5),)),
    "bernoulli": (lambda p: torch.bernoulli(p) * p, (torch.rand(2, 3, 4, dtype=D, generator=_gen),)),
    "rrelu": (lambda x: torch.nn.functional.rrelu(x, 0.1, 0.3, training=True), (_r(20),)),
    "rrelu_inplace": (lambda x: torch.nn.functional.rrelu(x * 1, training=True, inplace=True), (_r(4, 5),)),
    "rrelu_module": (lambda x: nn.RReLU().train()(x), (_r(4, 5),)),
    "feature_alpha_dropout": (lambda x: torch.nn.functional.feature_alpha_dropout(x, 0.4, True), (_r(3, 4, 2, 2),)),
    "feature_alpha_dropout_5d": (lambda x: torch.nn.functional.feature_alpha_dropout(x, 0.4, True), (_r(2, 3, 2, 2, 2),)),
    "alpha_dropout": (lambda x: torch.nn.functional.alpha_dropout(x, 0.3, True), (_r(5, 4),)),
    "fractional_max_pool3d": (
        lambda x: torch.nn.functional.fractional_max_pool3d(x, (2, 3, 2), output_size=(2, 3, 2)),
        (_r(2, 3, 6, 7, 5),),
    ),
    "fractional_max_pool3d_ratio": (
        lambda x: torch.nn.functional.fractional_max_pool3d(x, 2, output_ratio=(0.5, 0.6, 0.5)),
        (_r(3, 6, 7, 5),),
    ),
    "multi_head_attention": (lambda q: _MHA(q, q, q)[0], (_r(2, 5, 4),)),
    "multi_head_attention_sdpa": (lambda q: _MHA(q, q, q, key_padding_mask=_PADDING, need_weights=False)[0], (_r(2, 5, 4),)),
    "multi_head_attention_kv": (lambda q, k, v: _MHA_KV(q, k, v)[0], (_r(5, 2, 4), _r(6, 2, 3), _r(6, 2, 5))),
}


@pytest.mark.parametrize("name", list(RANDOM_CASES))
def test_random_op_reproduces_eager_under_the_same_seed(name):
    """Output and gradients equal eager's under the same seed, and the global generator ends in the
    same state (no extra draws: today ``normal``'s derived backward re-draws, and ``rrelu`` draws a
    slope for every element where eager's kernel draws one per non-positive element)."""
    f, args = RANDOM_CASES[name]
    gm = fxtools.vjp(f, *args)
    torch.manual_seed(7)
    xs = [a.clone().requires_grad_() for a in args]
    want = f(*xs)
    ct = torch.randn(want.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(want, xs, ct, allow_unused=True)
    state = torch.get_rng_state()
    torch.manual_seed(7)
    out, grads = gm(*args, ct)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("policy", ["recompute_cheap", "save_all"])
def test_rrelu_split_reuses_the_drawn_slopes(policy):
    """The backward of a split graph reads the slopes the forward drew, whatever it recomputes."""
    x = _r(20)
    f = lambda x: (torch.nn.functional.rrelu(x, 0.1, 0.3, training=True) * x).sum()  # noqa: E731
    s = fxtools.split(f, x, policy=policy)
    torch.manual_seed(3)
    out, saved = s.forward(x)
    (grad,) = s.backward(*saved, torch.tensor(1.0, dtype=D))
    torch.manual_seed(3)
    xe = x.clone().requires_grad_()
    want = f(xe)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(want, xe)[0], rtol=1e-12, atol=1e-12)


def test_python_random_draw_is_refused_naming_the_line():
    """``random.uniform`` while tracing would be a constant of the code (every call the same number,
    where eager draws anew: it was silently so); refused naming the line. Draws outside the
    program's trace are untouched."""
    import random

    def jitter(x):
        return (x.sin() * random.uniform(0.5, 1.5)).sum()

    with pytest.raises(FxtoolsError, match=r"random\.uniform\(\) at .*test_idioms\.py:\d+: .*random\.uniform"):
        fxtools.grad(jitter, torch.randn(3))
    assert 0.5 <= random.uniform(0.5, 1.5) <= 1.5  # restored
