"""Where a NaN came from (issue 36): ``fxtools.find_nonfinite``, ``check_finite`` on training
modules and ``fxtools nan``. Each classic cause is planted in the forward, the backward or the
inputs, and the report must name the phase, the value and the user's statement; clean programs
(intended ``-inf`` masks included) report nothing, and checked training equals unchecked."""

import copy
import inspect

import nan_causes as causes  # examples/: the programs docs/nonfinite.md shows
import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.cli.examples import gpt
from fxtools.cli.main import main


def _line(fn, text):
    """The line number in ``fn``'s file of the statement ``text`` inside ``fn``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# --------------------------------------------------------------------------------------------
# The programs, each planting one cause
# --------------------------------------------------------------------------------------------


def sqrt_of_x(x):
    r = torch.sqrt(x)
    return r.sum()


def pow_negative_exponent(x):
    r = x**-1.0
    return r.sum()


def norm_written_out(x):
    n = torch.sqrt((x * x).sum())
    return n


def norm_at_zero(x):
    n = x.norm()  # its gradient at 0 is 0 (PyTorch's convention, fxtools' rule masks its 1/0)
    return n


def asin_at_one(x):
    a = torch.asin(x)
    return a.sum()


def where_sqrt(x):
    y = torch.where(x > 0, torch.sqrt(x), 0.0)
    return y.sum()


Z = torch.zeros(3)
ONE_ZERO = torch.tensor([1.0, 0.0, 2.0])
KEEP = torch.tensor([[True, False, True], [False, False, False]])

# (program, args, phase, name, the user's statement, a word of the hint)
CASES = [
    (causes.log_at_zero, (ONE_ZERO,), "forward", "logp", "logp = torch.log(p)", "log at 0"),
    (causes.log_at_zero, (-ONE_ZERO,), "forward", "logp", "logp = torch.log(p)", "log at 0"),
    (sqrt_of_x, (-ONE_ZERO - 1,), "forward", "r", "r = torch.sqrt(x)", "sqrt of a negative"),
    (sqrt_of_x, (ONE_ZERO,), "backward", None, "r = torch.sqrt(x)", "derivative of sqrt at 0"),
    (causes.sqrt_at_zero, (ONE_ZERO,), "backward", None, "r = torch.sqrt(x * x)", "derivative of sqrt at 0"),
    (causes.pow_at_zero, (ONE_ZERO,), "backward", None, "r = x**0.5", "x ** p at x = 0"),
    (pow_negative_exponent, (ONE_ZERO,), "forward", "r", "r = x**-1.0", "pow at 0"),
    (causes.zero_over_zero, (Z, Z), "forward", "q", "q = a / b", "0/0"),
    (causes.zero_over_zero, (ONE_ZERO + 1, ONE_ZERO), "forward", "q", "q = a / b", "division by 0"),
    (causes.normalize, (Z,), "forward", "u", "u = x / x.norm()", "x / x.norm() at x = 0"),
    (norm_written_out, (Z,), "backward", None, "n = torch.sqrt((x * x).sum())", "derivative of sqrt at 0"),
    (causes.softmax_all_masked, (torch.randn(2, 3), KEEP), "forward", "p", "p = torch.softmax(scores, dim=-1)", "all -inf"),
    (causes.exp_overflow, (torch.tensor([1.0, 100.0]),), "forward", "e", "e = torch.exp(x)", "exp overflows float32"),
    (causes.acos_at_one, (torch.tensor([0.5, 1.5]),), "forward", "angle", "angle = torch.acos(x)", "outside [-1, 1]"),
    (causes.acos_at_one, (torch.tensor([0.5, 1.0]),), "backward", None, "angle = torch.acos(x)", "acos/asin at +-1"),
    (asin_at_one, (torch.tensor([-1.0, 0.2]),), "backward", None, "a = torch.asin(x)", "acos/asin at +-1"),
    (causes.where_unselected, (ONE_ZERO,), "forward", None, "torch.where(x > 0, torch.log(x), 0.0)", "torch.where"),
    (where_sqrt, (ONE_ZERO,), "backward", None, "torch.where(x > 0, torch.sqrt(x), 0.0)", "torch.where"),
]


@pytest.mark.parametrize("fn, args, phase, name, statement, hint", CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in CASES])
def test_each_classic_cause_is_named_by_phase_value_and_line(fn, args, phase, name, statement, hint):
    report = fxtools.find_nonfinite(fn, *args)
    assert report is not None
    assert report.phase == phase
    if name is not None:
        assert report.name == name
    else:  # a backward value (or a rule's step) is named after the value it is the gradient of, or its step
        assert report.name.isidentifier()
    assert statement in report.line
    assert report.filename == fn.__code__.co_filename and report.lineno == _line(fn, statement)
    text = str(report)
    assert report.statement and report.statement.startswith(f"{report.name} = ") and report.statement in text
    assert statement in text and hint in text and "NaNs" in text


@pytest.mark.parametrize("fn, args", [c[:2] for c in CASES], ids=[f"{c[0].__name__}-{c[2]}" for c in CASES])
def test_each_planted_cause_is_non_finite_in_eager_autograd(fn, args):
    """The oracle: PyTorch's own value or gradient of each planted program is not finite."""
    args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    value = fn(*args)
    grads = torch.autograd.grad(value, [a for a in args if a.requires_grad])
    assert not all(torch.isfinite(t).all() for t in (value, *grads))


def test_backward_report_names_the_gradient_and_the_forward_statement():
    report = fxtools.find_nonfinite(where_sqrt, ONE_ZERO)
    assert report.phase == "backward" and report.name.startswith("grad_")
    assert report.op == "aten.div" and "/" in report.statement
    assert "the derivative of your line" in str(report)


def _root(t):
    return torch.sqrt(t)


def sqrt_twice(x, w):
    a = _root(x * x + 1)
    b = _root(x @ w)
    return a.sum() + b.sum()


@pytest.mark.parametrize("w, phase", [(-torch.ones(3, 2), "forward"), (torch.zeros(3, 2), "backward")])
def test_a_helper_called_twice_is_named_with_the_call_that_failed(w, phase):
    """sqrt of a negative (a NaN in the forward) or at 0 (an infinite gradient) inside a helper
    called twice: the report names the helper's line and, outer to it, the second call."""
    x = torch.rand(4, 3, dtype=torch.float64) + 0.5
    report = fxtools.find_nonfinite(sqrt_twice, x, w.double())
    assert report.phase == phase
    helper, call = _line(_root, "torch.sqrt(t)"), _line(sqrt_twice, "b = _root(x @ w)")
    assert [(f, n) for f, n, _ in report.stack] == [(__file__, call), (__file__, helper)]
    assert (report.filename, report.lineno) == (__file__, helper)
    assert f"called from:  {__file__}:{call}: b = _root(x @ w)" in str(report)


@pytest.mark.parametrize(
    "args, path",
    [
        ((torch.tensor([1.0, float("nan")]),), "x"),
        ((torch.tensor([1.0, float("-inf")]),), "x"),
    ],
)
def test_an_input_holding_nan_or_inf_is_reported_as_input(args, path):
    report = fxtools.find_nonfinite(lambda x: (x * 2).sum(), *args)
    assert report.phase == "input" and report.name == path and report.line is None


def test_an_input_is_named_by_its_path():
    def f(params, x):
        return (x @ params["w"]).sum()

    w = torch.randn(3, 2)
    w[1, 1] = float("inf")
    report = fxtools.find_nonfinite(f, {"w": w}, torch.randn(4, 3))
    assert report.phase == "input" and report.name == "params['w']"
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    report = fxtools.find_nonfinite(model, torch.randn(4, 3))
    assert report.phase == "input" and report.name == "params['weight']"


def test_argnums_picks_the_gradients_checked():
    def f(x, y):
        return (x * torch.sqrt(y)).sum()

    x, y = torch.randn(3), torch.tensor([0.0, 1.0, 4.0])
    assert fxtools.find_nonfinite(f, x, y, argnums=0) is None  # d/dx = sqrt(y) is finite
    report = fxtools.find_nonfinite(f, x, y, argnums=1)
    assert report.phase == "backward" and "torch.sqrt(y)" in report.line
    assert fxtools.find_nonfinite(f, x, y).phase == "backward"


# --------------------------------------------------------------------------------------------
# Clean programs report nothing, intended infinities included
# --------------------------------------------------------------------------------------------


def masked_logsumexp(s, keep):
    s = torch.where(keep, s, float("-inf"))
    m = torch.amax(s, dim=-1, keepdim=True)
    return (torch.logsumexp(s, dim=-1) + m.squeeze(-1)).sum()


def causal_scores(q, k):
    t = q.shape[0]
    mask = torch.full((t, t), float("-inf")).triu(1)
    att = torch.softmax(q @ k.T + mask, dim=-1)
    return torch.log_softmax(att, dim=-1).sum()


def test_clean_programs_with_intended_infinities_report_nothing():
    keep = torch.tensor([[True, False, True], [False, True, False]])
    assert fxtools.find_nonfinite(masked_logsumexp, torch.randn(2, 3), keep) is None
    assert fxtools.find_nonfinite(causal_scores, torch.randn(4, 3), torch.randn(4, 3)) is None
    assert fxtools.find_nonfinite(norm_at_zero, Z) is None  # a rule's masked 1/0 is not the user's
    model, (idx, targets) = gpt("tiny", attention="explicit")  # masked_fill(~mask, -inf) in every block
    assert fxtools.find_nonfinite(model, idx, targets) is None


def masked_nanmean(x, keep):
    y = x.masked_fill(~keep, float("nan"))  # padding written as NaN on purpose
    return y.nanmean(dim=-1).sum()


def masked_nanmean_then_sqrt(x, keep):
    y = x.masked_fill(~keep, float("nan"))
    m = y.nanmean(dim=-1)
    r = torch.sqrt(m * m)
    return r.sum()


def test_a_nan_written_on_purpose_and_dropped_is_no_cause():
    """A NaN that reaches no result and no gradient was reported as the first non-finite value,
    ahead of the real cause of a NaN gradient later in the same step."""
    x, keep = torch.tensor([[1.0, -1.0, 2.0], [3.0, 0.5, -2.0]]), torch.tensor([[True, True, False], [True, False, True]])
    xg = x.clone().requires_grad_()
    assert torch.isfinite(torch.autograd.grad(masked_nanmean(xg, keep), xg)[0]).all()
    assert fxtools.find_nonfinite(masked_nanmean, x, keep) is None
    report = fxtools.find_nonfinite(masked_nanmean_then_sqrt, x, keep)  # m = 0 in the first row
    assert not torch.isfinite(torch.autograd.grad(masked_nanmean_then_sqrt(xg, keep), xg)[0]).all()
    assert report.phase == "backward" and report.line == "r = torch.sqrt(m * m)"


def test_find_nonfinite_leaves_the_module_and_the_generators_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Dropout(0.5))
    x = torch.randn(5, 4)
    before = copy.deepcopy(model.state_dict())
    state = torch.get_rng_state()
    assert fxtools.find_nonfinite(model, x) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(state, torch.get_rng_state())


# --------------------------------------------------------------------------------------------
# check_finite on training modules
# --------------------------------------------------------------------------------------------


class SqrtNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        r = torch.sqrt(h * h)
        return F.log_softmax(r, dim=-1).mean()


def _batches():
    """Five batches: the third holds a NaN (an input), the fifth is all zeros with a zero bias
    (sqrt at 0 in the backward only)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 4, generator=g) for _ in range(5)]
    xs[2][1, 2] = float("nan")
    xs[4] = torch.zeros(6, 4)
    return xs


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_check_finite_raises_at_the_right_step_and_matches_unchecked(compiler):
    torch.manual_seed(0)
    base = SqrtNet()
    with torch.no_grad():
        base.fc.bias.zero_()
    plain_model, checked_model = copy.deepcopy(base), copy.deepcopy(base)
    plain = fxtools.compile(plain_model, compiler=compiler)
    checked = fxtools.compile(checked_model, compiler=compiler, check_finite=True)
    raised = []
    for step, x in enumerate(_batches()):
        for m in (plain_model, checked_model):
            m.zero_grad()
        want = plain(x)
        want.backward()
        try:
            got = checked(x)
            got.backward()
        except fxtools.NonFiniteError as exc:
            raised.append((step, exc.report))
            continue
        assert torch.equal(got, want)
        for p, q in zip(checked_model.parameters(), plain_model.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert [s for s, _ in raised] == [2, 4]
    (_, first), (_, second) = raised
    assert first.phase == "input" and first.name == "x"
    assert second.phase == "backward" and second.line == "r = torch.sqrt(h * h)"
    assert isinstance(first, fxtools.training.finite.NonFiniteReport)


def test_check_finite_on_a_split_and_through_torch_compile():
    def f(x, w):
        h = x @ w
        y = torch.sqrt(h)
        return torch.where(h > 0, y, 0.0).sum()

    x, w = torch.rand(3, 4) + 0.1, torch.rand(4, 2) + 0.1
    sp, plain = fxtools.split(f, x, w, check_finite=True), fxtools.split(f, x, w)
    out, grads = sp.vjp(x, w)
    want_out, want_grads = plain.vjp(x, w)
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    with pytest.raises(fxtools.NonFiniteError) as info:
        sp.vjp(x, w * 0)  # h = 0: sqrt's derivative at 0, in the backward
    assert info.value.report.phase == "backward" and info.value.report.line == "y = torch.sqrt(h)"
    with pytest.raises(fxtools.NonFiniteError) as info:
        sp.vjp(-x, w)  # sqrt of a negative number: NaN in the forward (saved for the backward)
    assert (info.value.report.phase, info.value.report.name) == ("forward", "y")
    assert isinstance(info.value, fxtools.FxtoolsError)

    compiled = torch.compile(f, backend=fxtools.backend(check_finite=True))
    compiled(x.requires_grad_(), w).backward()
    with pytest.raises(fxtools.NonFiniteError) as info:
        # sqrt's NaN is neither returned nor saved (h is): the NaN gradient is seen, and the step's
        # rerun names the first non-finite value, in the forward, by the line Dynamo recorded
        compiled(-x.detach().requires_grad_(), w).backward()
    report = info.value.report
    assert (report.phase, report.name, report.line) == ("forward", "y", "y = torch.sqrt(h)")


def test_check_finite_accepts_intended_infinities():
    model, (idx, targets) = gpt("tiny", attention="explicit")
    compiled = fxtools.compile(model, check_finite=True)
    for _ in range(2):
        compiled(idx, targets).backward()


# --------------------------------------------------------------------------------------------
# fxtools nan
# --------------------------------------------------------------------------------------------


def test_the_nan_command(tmp_path, capsys, monkeypatch):
    (tmp_path / "prog.py").write_text(
        "import torch\n\ndef loss(x, eps):\n    r = torch.sqrt(x * x * eps + eps)\n    return r.sum()\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["nan", "prog.py:loss", "--arg", "x=f32[4]", "--arg", "eps=0.0"]) == 1
    out = capsys.readouterr().out
    assert "in the backward" in out and "r = torch.sqrt(x * x * eps + eps)" in out and "derivative of sqrt at 0" in out
    assert main(["nan", "prog.py:loss", "--arg", "x=f32[4]", "--arg", "eps=1.0"]) == 0
    assert "every value of the forward and the backward is finite" in capsys.readouterr().out
    assert main(["nan", "prog.py:loss", "--arg", "x=f32[4]", "--arg", "eps=1.0", "--argnums", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxtools nan: error: --argnums 7") and err.count("\n") == 1


def test_the_cheap_check():
    from fxtools.training.finite import all_finite

    finite = [torch.randn(3), torch.randn(2, dtype=torch.float64), torch.randn(4).bfloat16(), torch.arange(3)]
    assert all_finite(finite)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(5)
        t[3] = bad
        assert not all_finite([*finite, t])
        assert all_finite([*finite, t], [False] * 4 + [True]) == (bad == bad)  # NaN-only: an infinity passes
    # finite values whose sum overflows fail the cheap check (an exact check then clears them)
    assert not all_finite([torch.full((4,), 3e38)])
    assert all_finite([torch.full((4,), 60000.0).half()])  # half precision is summed in float32


@pytest.mark.parametrize("index", range(8))
def test_random_programs_report_nothing_and_name_a_planted_input(index):
    """Differential: the fuzzer's random programs (finite by construction, eager agrees) report
    nothing; the same program with a NaN planted in a float input reports that input, by name."""
    import fuzz_programs

    p = fuzz_programs.program(index, seed=36)
    assert fxtools.find_nonfinite(p.fn, *p.args) is None, str(p)
    args = list(p.args)
    where = p.float_args[index % len(p.float_args)]
    bad = args[where].clone()
    bad.view(-1)[bad.numel() // 2] = float("nan")
    args[where] = bad
    report = fxtools.find_nonfinite(p.fn, *args)
    assert report is not None and report.phase == "input", str(p)
    assert report.name == p.inputs[where].name, str(p)


def test_check_finite_without_a_backward():
    """Under no_grad (evaluation) the forward alone is checked, and its rerun leaves the generators alone."""
    model = SqrtNet().eval()
    compiled = fxtools.compile(model, check_finite=True)
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        x[0, 0] = float("inf")
        state = torch.get_rng_state()
        with pytest.raises(fxtools.NonFiniteError) as info:
            compiled(x)
        assert torch.equal(state, torch.get_rng_state())
    assert (info.value.report.phase, info.value.report.name) == ("input", "x")
