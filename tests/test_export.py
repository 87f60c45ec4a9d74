"""fxtools.save: standalone modules that need only torch, run in an interpreter without fxtools."""

import ast
import importlib.util
import math

import pytest
import torch
import torch.nn as nn
from isolated import run_isolated

import fxtools
from fxtools.cli import examples
from fxtools.codegen.export import GUARDS_MARKER, ExportError


def load(path):
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imports_of(text):
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def test_vjp_module_needs_only_torch_and_matches(tmp_path):
    def f(x):
        return torch.sin(x) + x

    x = torch.randn(13, dtype=torch.float64)
    gm = fxtools.vjp(f, x)
    text = fxtools.save(gm, tmp_path / "sinx.py")
    # only the docstring, and the guards' messages ("fxtools.vjp module: ..."), may name it
    assert "fxtools" not in text.split('"""', 2)[2].split(GUARDS_MARKER)[0]
    assert imports_of(text) <= {"torch", "os", "dataclasses"}  # dataclasses: the guards' data
    assert "def forward(x, grad_out):" in text
    assert "x: f64[13]" in text and "grad_out: f64[13]" in text  # the docstring's signature
    ct = torch.randn(13, dtype=torch.float64)
    out, (gx,) = load(tmp_path / "sinx.py").forward(x, ct)
    want_out, (want_gx,) = gm(x, ct)
    assert torch.equal(out, want_out) and torch.equal(gx, want_gx)


def test_pytree_arguments_constants_and_globals_in_a_fresh_interpreter(tmp_path):
    """Dict/list arguments, nested results, inf, a closed-over tensor and an in-place buffer."""
    table = torch.randn(100, 3, dtype=torch.float64)  # a closed-over constant: stored beside the module
    small = torch.tensor([1.0, 2.0, float("inf")], dtype=torch.float64)  # embedded as a literal

    def f(d, xs):
        y = d["w"] * xs[0] + table[:3].sum(0)
        z = torch.clamp(y, max=float("inf")) + torch.where(small.isinf(), 0.0, small)
        return {"y": y.exp(), "z": (z.sum(), xs[1].cos())}

    args = (
        {"w": torch.randn(3, dtype=torch.float64)},
        [torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)],
    )
    gm = fxtools.vjp(f, *args)
    text = fxtools.save(gm, tmp_path / "tree.py", embed_limit=8)
    assert (tmp_path / "tree.pt").exists()
    assert "forward(d, xs, grad_out)" in text and "d['w']: f64[3]" in text
    ct = fxtools.transforms.check.random_cotangent(f(*args))
    torch.save((args, ct, gm(*args, ct)), tmp_path / "io.pt")
    run_isolated(
        """
import torch, tree
args, ct, want = torch.load("io.pt")
got = tree.forward(*args, ct)
flat_got, flat_want = [], []
def flatten(v, acc):
    if isinstance(v, dict):
        for k in sorted(v): flatten(v[k], acc)
    elif isinstance(v, (list, tuple)):
        for x in v: flatten(x, acc)
    else:
        acc.append(v)
flatten(got, flat_got); flatten(want, flat_want)
assert len(flat_got) == len(flat_want)
for a, b in zip(flat_got, flat_want):
    assert (a is None and b is None) or torch.equal(a, b), (a, b)
print("ok")
""",
        tmp_path,
    )


def test_model_with_batchnorm_buffers_updates_them_like_the_graph_module(tmp_path):
    model, inputs = examples.small_cnn(dtype=torch.float64)
    loss_fn, args = examples.as_loss(model, inputs)
    gm = fxtools.value_and_grad(loss_fn, *args)
    text = fxtools.save(gm, tmp_path / "cnn.py")
    assert "Constants" in text and "bn1_running_mean" in text
    mod = load(tmp_path / "cnn.py")
    for _ in range(2):  # the second call sees the running statistics the first one updated
        (loss, grads), (want_loss, want_grads) = mod.forward(*args), gm(*args)
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(grads[k], want_grads[k]) for k in want_grads)
    torch.testing.assert_close(mod.constants.bn2_running_var, model.bn2.running_var, rtol=0, atol=0)


def test_docstring_documents_metadata(tmp_path):
    gm = fxtools.vjp(lambda x: x.sin(), torch.randn(3))
    gm.meta["fxtools_split"] = {"saved": ["sin", "cos"], "forward_outputs": 1}
    text = fxtools.save(gm, tmp_path / "meta.py")
    doc = ast.get_docstring(ast.parse(text))
    assert "Metadata:" in doc and "fxtools_split" in doc and "'saved': ['sin', 'cos']" in doc


def test_gpt_with_explicit_attention_round_trips(tmp_path):
    """A causal mask buffer (bool, too big to embed), -inf fills and embedding lookups."""
    model, inputs = examples.gpt("tiny", attention="explicit", dtype=torch.float64)
    loss_fn, args = examples.as_loss(model, inputs)
    gm = fxtools.grad(loss_fn, *args)
    fxtools.save(gm, tmp_path / "gpt.py")
    got, want = load(tmp_path / "gpt.py").forward(*args), gm(*args)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_non_torch_callables_are_refused(tmp_path):
    gm = fxtools.vjp(lambda x: x.cos(), torch.randn(3))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")

    def helper(v):
        return v

    with gm.graph.inserting_after(node):
        extra = gm.graph.call_function(helper, (node,))
    node.replace_all_uses_with(extra, delete_user_cb=lambda u: u is not extra)
    gm.recompile()
    with pytest.raises(ExportError, match="helper"):
        fxtools.save(gm, tmp_path / "bad.py")
    with pytest.raises(ValueError, match=".py"):
        fxtools.save(gm, tmp_path / "bad.txt")


def test_literals_are_exact():
    from fxtools.codegen.export import _tensor_literal

    for t in (
        torch.tensor([0.1, -math.inf, math.nan, 1e-300], dtype=torch.float64),
        torch.randn(5, dtype=torch.float32),
        torch.randn(3, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.tensor(7),
        torch.randn(2, dtype=torch.complex64),
        torch.ones(2, 3),
        torch.full((4,), -math.inf),
        torch.zeros(0, 2),
    ):
        back = eval(_tensor_literal(t), {"torch": torch})
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(torch.nan_to_num(back), torch.nan_to_num(t)) and torch.equal(back.isnan(), t.isnan())


def test_split_is_written_as_forward_and_backward(tmp_path):
    model, inputs = examples.small_cnn(dtype=torch.float64)
    params = dict(model.named_parameters())
    s = fxtools.split(model, *inputs)
    text = fxtools.save(s, tmp_path / "split.py")
    doc = ast.get_docstring(ast.parse(text))
    assert "backward(*saved, *cotangents)" in doc and "saved values" in doc
    mod = load(tmp_path / "split.py")
    leaves = s.flatten(params, *inputs)
    (out, saved), (want_out, want_saved) = mod.forward(*leaves), s.forward(*leaves)
    assert torch.equal(out, want_out)
    ct = torch.ones((), dtype=torch.float64)
    got = mod.backward(*saved, *s.flatten_cotangent(ct))
    want = s.backward(*want_saved, *s.flatten_cotangent(ct))
    for g, w in zip(s.flat_grads(got), s.flat_grads(want)):
        assert (g is None and w is None) or torch.equal(g, w)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8))
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.bn(self.body(x))).relu()


def test_submodules_are_inlined_and_run_without_fxtools(tmp_path):
    """call_module nodes (layers of a symbolic_trace graph, GraphModules from split_module) become ops."""
    from torch.fx.passes.shape_prop import ShapeProp
    from torch.fx.passes.split_module import split_module

    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    traced = torch.fx.symbolic_trace(model)
    parts = split_module(traced, model, lambda node: 0 if node.name.startswith("body") else 1)
    assert any(n.op == "call_module" for n in parts.graph.nodes)
    assert isinstance(parts.submod_0, torch.fx.GraphModule)
    ShapeProp(parts).propagate(x.clone())  # BatchNorm's forward checks input.dim(): traced with shapes
    with pytest.raises(ExportError, match=r"'bn' \(BatchNorm1d\).*ShapeProp"):
        fxtools.save(torch.fx.symbolic_trace(model), tmp_path / "no_shapes.py")  # no shapes: a clear error
    model.bn.reset_running_stats()
    text = fxtools.save(parts, tmp_path / "parts.py")
    code = text.split("\ndef forward")[1]
    assert "torch.nn.functional.batch_norm(" in code and "torch.nn.functional.layer_norm(" in code
    assert "bn_running_mean = constants." in code and "body_0_weight = constants." in code
    assert model.bn.num_batches_tracked.item() == 0  # writing the module ran nothing
    want = model(x)  # updates the running statistics, as the written module must
    torch.save((x, want, model.bn.running_mean), tmp_path / "io.pt")
    run_isolated(
        """
import torch, parts
x, want, running_mean = torch.load("io.pt")
torch.testing.assert_close(parts.forward(x), want, rtol=1e-12, atol=1e-12)
mean = [v for k, v in vars(parts.constants).items() if k.endswith("bn_running_mean")]
torch.testing.assert_close(mean[0], running_mean, rtol=1e-12, atol=1e-12)
print("ok")
""",
        tmp_path,
    )
