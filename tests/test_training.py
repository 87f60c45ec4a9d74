"""Training through fxtools' split graphs: fxtools.compile and the torch.compile backend (float64)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import fxtools
from fxtools.cli import examples

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")


def train(model, inputs, steps=20, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_same_parameters(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("policy", ["recompute_cheap", "save_all"])
def test_compile_gpt_adamw_matches_eager(policy):
    model, inputs = examples.gpt("tiny")
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs, policy=policy)
    assert isinstance(compiled, nn.Module)
    assert compiled.module is model
    got = train(compiled, inputs)  # the optimizer holds the original module's parameters
    want = train(eager, inputs)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    assert_same_parameters(model, eager)


def test_optimizer_on_original_parameters_sees_gradients():
    model, inputs = examples.gpt("tiny")
    compiled = fxtools.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built on the module itself
    compiled(*inputs).backward()
    assert all(p.grad is not None for p in model.parameters())
    eager = copy.deepcopy(model)
    eager.zero_grad()
    eager(*inputs).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    opt.step()


def test_torch_compile_backend_gpt_adamw_matches_eager():
    torch._dynamo.reset()
    model, inputs = examples.gpt("tiny")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=fxtools.backend())
    got = train(compiled, inputs)
    want = train(eager, inputs)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    assert_same_parameters(model, eager)


def test_torch_compile_takes_the_backend_itself_as_its_defaults():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    compiled = torch.compile(model, backend=fxtools.backend)  # not called: as backend="inductor" is a name
    for rows in (4, 7):
        x = torch.randn(rows, 5, dtype=torch.float64, requires_grad=True)
        (got,) = torch.autograd.grad(compiled(x).pow(2).sum(), x)
        (want,) = torch.autograd.grad(model(x).pow(2).sum(), x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch._dynamo.reset()


def test_compilers_receive_the_graph_modules():
    seen = {}

    def fw_compiler(gm, example_inputs):
        seen["fw"] = (gm, list(example_inputs))
        return gm

    def bw_compiler(gm):
        seen["bw"] = gm

        def run(*args):
            seen["bw_calls"] = seen.get("bw_calls", 0) + 1
            return gm(*args)

        return run

    model, inputs = examples.mlp()
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler)
    assert isinstance(seen["fw"][0], torch.fx.GraphModule) and isinstance(seen["bw"], torch.fx.GraphModule)
    assert [n.name for n in seen["fw"][0].graph.nodes if n.op == "placeholder"] == [
        "fc1_weight",
        "fc1_bias",
        "fc2_weight",
        "fc2_bias",
        "x",
        "targets",
    ]
    assert len(seen["fw"][1]) == 6
    train(compiled, inputs, steps=3)
    train(eager, inputs, steps=3)
    assert seen["bw_calls"] == 3
    assert_same_parameters(model, eager)


def test_compile_function_grads_land_in_leaves():
    def f(x, w):
        return x * w, w  # an output aliasing an input

    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    cf = fxtools.compile(f, x.detach(), w.detach())
    y, w_out = cf(x, w)
    (y.sum() + 2 * w_out.sum()).backward()
    torch.testing.assert_close(x.grad, w.detach(), **TOL)
    torch.testing.assert_close(w.grad, x.detach() + 2, **TOL)


def test_batchnorm_buffers_and_grads_match_eager():
    model, inputs = examples.small_cnn()
    model.train()
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs)
    got = train(compiled, inputs, steps=3)
    want = train(eager, inputs, steps=3)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    assert_same_parameters(model, eager)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, **TOL, msg=lambda m: f"{name}: {m}")


def test_new_shapes_make_a_new_split_and_no_grad_runs_forward_only():
    model, inputs = examples.mlp()
    compiled = fxtools.compile(model, *inputs)
    x, y = inputs
    compiled(x[:3], y[:3]).backward()
    assert len(compiled._runners) == 2
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), model(x, y), **TOL)


class CheckpointedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def block(self, h):
        return torch.tanh(self.fc2(torch.relu(self.fc1(h))))

    def forward(self, x):
        h = cp.checkpoint(self.block, x, use_reentrant=False)
        return self.fc3(h).square().mean()


def test_torch_compile_backend_with_checkpoint_and_compilers():
    torch._dynamo.reset()
    graphs = []

    def compiler(gm):
        graphs.append(gm)
        return gm

    torch.manual_seed(0)
    model = CheckpointedMLP()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 6)
    compiled = torch.compile(model, backend=fxtools.backend(fw_compiler=compiler, bw_compiler=compiler))
    got = train(compiled, (x,), steps=5)
    want = train(eager, (x,), steps=5)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    assert_same_parameters(model, eager)
    assert len(graphs) == 2
    fw, bw = graphs
    # placeholders are named after Dynamo's inputs; the checkpointed block is recomputed in the backward
    inputs = [n.name for n in fw.graph.nodes if n.op == "placeholder"]
    assert inputs == ["x", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "fc3_weight", "fc3_bias"]
    saved = [n.name for n in bw.graph.nodes if n.op == "placeholder"]
    assert not {"linear", "relu", "linear_1"} & set(saved)
    # compilers get the ATen form of the graphs (fxtools.to_aten)
    assert torch.ops.aten.relu.default in {n.target for n in bw.graph.nodes}


def test_inputs_without_requires_grad_get_no_gradient_code():
    model, inputs = examples.small_cnn()
    x, y = inputs
    compiled = fxtools.compile(model, x, y)
    loss = compiled(x, y)
    loss.backward()
    sp = compiled.split
    grads_of_x = [n for n in sp.backward.graph.nodes if n.name == "grad_x"]
    assert not grads_of_x  # x does not require grad: its gradient is not computed
    xr = x.clone().requires_grad_(True)
    compiled(xr, y).backward()
    assert xr.grad is not None and len(compiled._runners) == 2
    eager = copy.deepcopy(model)
    xe = x.clone().requires_grad_(True)
    eager(xe, y).backward()
    torch.testing.assert_close(xr.grad, xe.grad, **TOL)


def test_compile_outputs_aliasing_each_other_and_an_input_passed_twice():
    def f(x, y):
        s = torch.sin(x * y)
        return s, s, s.view(-1), x

    x = torch.randn(2, 3, requires_grad=True)
    a, b, c, d = fxtools.compile(f)(x, x)
    (a.sum() + 2 * b.sum() + 3 * c.sum() + 4 * d.sum()).backward()
    xr = x.detach().clone().requires_grad_(True)
    a, b, c, d = f(xr, xr)
    (a.sum() + 2 * b.sum() + 3 * c.sum() + 4 * d.sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)


class _KeywordNet(nn.Module):
    """Called as Hugging Face models are: tensors and flags by keyword, a structured output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, input_values, labels=None, return_dict=True):
        logits = self.fc(input_values)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits} if return_dict else (loss, logits)


def test_compile_takes_keyword_arguments():
    torch.manual_seed(0)
    model = _KeywordNet().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    compiled = fxtools.compile(model, example_kwargs={"input_values": x, "labels": y})
    assert [s.name for s in compiled.split.signature][-2:] == ["input_values", "labels"]
    for _ in range(2):
        out = compiled(input_values=x, labels=y)
        out["loss"].backward()
        want = reference(input_values=x, labels=y)
        want["loss"].backward()
        torch.testing.assert_close(out["logits"], want["logits"], rtol=0, atol=1e-14)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)
    loss, logits = compiled(input_values=x, labels=y, return_dict=False)  # another flag: another split
    assert len(compiled._runners) == 2
    torch.testing.assert_close(loss, want["loss"], rtol=0, atol=1e-14)


class _PartlyUsed(nn.Module):
    """An unused head, a bias read only by a JVP's discarded primal, a value read only detached."""

    def __init__(self):
        super().__init__()
        self.a, self.head, self.c = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(3, 3)

    def forward(self, x):
        _, d = torch.func.jvp(self.a, (x,), (x,))
        return d.pow(2).sum() + (x * self.c(x).detach()).sum() + torch.zeros_like(self.head.bias).sum()


def test_compile_leaves_grad_none_where_eager_does():
    """Eager leaves ``.grad`` None for a parameter no gradient path reaches, and optimizers skip it
    (no weight decay, no momentum); zeros there made AdamW and SGD with momentum drift from eager."""
    torch.manual_seed(0)
    eager = _PartlyUsed().double()
    model = copy.deepcopy(eager)
    compiled = fxtools.compile(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    for net, run in ((eager, eager), (model, compiled)):
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5)
        for x in xs:
            opt.zero_grad()
            run(x).backward()
            opt.step()
    assert [p.grad is None for p in model.parameters()] == [p.grad is None for p in eager.parameters()]
    assert model.head.weight.grad is None and model.a.bias.grad is None and model.c.weight.grad is None
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
