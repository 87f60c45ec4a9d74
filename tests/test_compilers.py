"""Compilers on fxtools' graphs: the ATen form (fxtools.to_aten), Inductor, edited graphs (float32).

Inductor's compiles are slow: the model is the test suite's tiny GPT, and the graphs
``compile_fx_inner`` and the ``"inductor"`` shorthand get are the same (Inductor's cache serves the
second). After 20 AdamW steps Inductor's own reordering of float32 sums moves parameters by up to
about 4e-5, as it does under ``torch.compile``: hence rtol 1e-3, atol 2e-4 against eager.
"""

import copy
import operator
import weakref

import pytest
import torch
import torch.nn as nn

import fxtools
from fxtools.cli import examples

INDUCTOR_TOL = dict(rtol=1e-3, atol=2e-4)
TOL64 = dict(rtol=1e-10, atol=1e-10)


def train(model, inputs, steps=20, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def assert_same_parameters(a, b, tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{name}: {m}")


def checking_compiler(graphs):
    """A compiler that checks what the ISSUE asks of the ATen form, keeps the graph, and runs it."""

    def compiler(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert len(example_inputs) == len(placeholders)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                assert isinstance(n.meta["desc"], fxtools.Descriptor), n
                assert n.meta["desc"].kind in fxtools.training.aten.KINDS
            elif n.op == "call_function":
                # getitem only picks a result of a multi-output op, as in AOTAutograd's graphs
                if n.target is operator.getitem:
                    assert isinstance(n.args[0].target, torch._ops.OpOverload)
                else:
                    assert isinstance(n.target, torch._ops.OpOverload), n.format_node()
                    assert not n.target._schema.is_mutable, n.format_node()
                assert "val" in n.meta, n
                assert n.meta.get("from_node"), n  # the readable node it comes from
            elif n.op == "output":
                assert len(n.meta["desc"]) == len(n.args[0])
            else:
                assert n.op == "get_attr", n.format_node()
        graphs.append(gm)
        return gm

    return compiler


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("rules", ["fused", "readable"])
def test_aten_graphs_have_only_aten_ops_and_descriptors(rules):
    graphs = []
    model, inputs = examples.gpt("tiny")
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs, compiler=checking_compiler(graphs), rules=rules)
    fw, bw = graphs
    sp = compiled.split
    fw_in = [n.meta["desc"] for n in fw.graph.nodes if n.op == "placeholder"]
    # same placeholders, order and names as the readable graphs
    assert [d.name for d in fw_in] == [n.name for n in sp.forward.graph.nodes if n.op == "placeholder"]
    assert [d.kind for d in fw_in] == ["parameter"] * (len(fw_in) - 2) + ["user_input"] * 2
    assert fw_in[0].target == "transformer.wte.weight" and fw_in[-2].path == "idx"
    fw_out = next(n for n in fw.graph.nodes if n.op == "output").meta["desc"]
    assert [d.kind for d in fw_out] == ["output"] + ["saved"] * len(sp.saved)
    assert [d.target for d in fw_out[1:]] == [s.name for s in sp.saved]
    bw_in = [n.meta["desc"] for n in bw.graph.nodes if n.op == "placeholder"]
    assert [d.name for d in bw_in] == [n.name for n in sp.backward.graph.nodes if n.op == "placeholder"]
    assert [d.kind for d in bw_in] == ["saved"] * len(sp.saved) + ["cotangent"]
    bw_out = next(n for n in bw.graph.nodes if n.op == "output").meta["desc"]
    assert [d.kind for d in bw_out] == ["gradient"] * len(fw_in)
    assert [d.path for d in bw_out] == [d.path for d in fw_in]
    assert bw_out[-1].kind == "gradient" and next(n for n in bw.graph.nodes if n.op == "output").args[0][-1] is None
    assert isinstance(fw_in[0].aot(), torch._functorch._aot_autograd.descriptors.ParamAOTInput)
    # each ATen node carries the stack trace (the user's line) of the readable node it comes from
    for aten_gm, readable in ((fw, sp.forward), (bw, sp.backward)):
        traces = {n.name: n.meta.get("stack_trace") for n in readable.graph.nodes}
        nodes = [n for n in aten_gm.graph.nodes if n.op == "call_function"]
        assert all(n.meta.get("stack_trace") == traces[n.meta["from_node"][0].name] for n in nodes)
        assert sum(bool(n.meta.get("stack_trace")) for n in nodes) > len(nodes) // 2
    got = train(compiled, inputs, steps=3)
    want = train(eager, inputs, steps=3)
    torch.testing.assert_close(got, want, **TOL64)
    assert_same_parameters(model, eager, TOL64)


def test_torch_compile_backend_describes_parameters():
    torch._dynamo.reset()
    graphs = []
    model, inputs = examples.mlp()
    compiled = torch.compile(model, backend=fxtools.backend(compiler=checking_compiler(graphs)))
    compiled(*inputs).backward()
    fw_in = [n.meta["desc"] for n in graphs[0].graph.nodes if n.op == "placeholder"]
    params = {d.target for d in fw_in if d.kind == "parameter"}
    assert params == {name for name, _ in model.named_parameters()}
    assert sum(d.kind == "user_input" for d in fw_in) == len(inputs)


def test_core_aten_decompositions():
    graphs = []
    model, inputs = examples.mlp()
    fxtools.compile(model, *inputs, compiler=checking_compiler(graphs), decompositions="core")
    core = torch._decomp.core_aten_decompositions()
    for gm in graphs:
        ops = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}
        assert not ops & set(core), ops & set(core)
        assert torch.ops.aten.addmm.default in ops or torch.ops.aten.mm.default in ops


@pytest.mark.usefixtures("float64")
def test_batchnorm_buffers_are_lifted_and_updated():
    graphs = []
    model, inputs = examples.small_cnn()
    model.train()
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, *inputs, compiler=checking_compiler(graphs))
    fw = graphs[0]
    kinds = [n.meta["desc"].kind for n in fw.graph.nodes if n.op == "placeholder"]
    assert kinds.count("buffer") == 6  # running mean, var and batch count of two BatchNorms
    out_kinds = next(n for n in fw.graph.nodes if n.op == "output").meta["desc"]
    assert sorted(d.target for d in out_kinds if d.kind == "mutated_buffer") == sorted(name for name, _ in model.named_buffers())
    got = train(compiled, inputs, steps=3)
    want = train(eager, inputs, steps=3)
    torch.testing.assert_close(got, want, **TOL64)
    assert_same_parameters(model, eager, TOL64)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, **TOL64, msg=lambda m: f"{name}: {m}")


def test_boxed_backward_frees_saved_values():
    refs = []

    def boxed(gm, example_inputs):
        n_saved = sum(n.meta["desc"].kind == "saved" for n in gm.graph.nodes if n.op == "placeholder")

        def run(args):
            assert isinstance(args, list)
            refs.extend(weakref.ref(a) for a in args[:n_saved])
            local = list(args)
            args.clear()
            return gm(*local)

        run._boxed_call = True
        return run

    model, inputs = examples.mlp()
    compiled = fxtools.compile(model, *inputs, bw_compiler=boxed)
    loss = compiled(*inputs)
    loss.backward()
    kinds = [s.kind for s in compiled.split.saved]
    activations = [r for r, k in zip(refs, kinds) if k == "activation"]
    assert activations and all(r() is None for r in activations)  # nothing holds them after the backward


def test_unknown_compiler_name():
    model, inputs = examples.mlp()
    with pytest.raises(ValueError, match="unknown compiler 'tvm'"):
        fxtools.compile(model, *inputs, compiler="tvm")


# --------------------------------------------------------------------------------------------
# Inductor
# --------------------------------------------------------------------------------------------


def _inductor(spelling, model, rules):
    from torch._inductor.compile_fx import compile_fx_inner

    if spelling == "compile_fx_inner":
        return fxtools.compile(model, fw_compiler=compile_fx_inner, bw_compiler=compile_fx_inner, rules=rules)
    if spelling == "inductor":
        return fxtools.compile(model, compiler="inductor", rules=rules)
    torch._dynamo.reset()
    return torch.compile(model, backend=fxtools.backend(compiler="inductor", rules=rules))


@pytest.mark.parametrize("rules", ["fused", "readable"])
@pytest.mark.parametrize("spelling", ["compile_fx_inner", "inductor", "torch.compile"])
def test_inductor_trains_gpt_like_eager(spelling, rules):
    model, inputs = examples.gpt("tiny")
    eager = copy.deepcopy(model)
    compiled = _inductor(spelling, model, rules)
    got = train(compiled, inputs)
    want = train(eager, inputs)
    torch.testing.assert_close(got, want, **INDUCTOR_TOL)
    assert_same_parameters(model, eager, INDUCTOR_TOL)
    if spelling != "torch.compile":
        runner = compiled._runners.entries[0][2]
        assert getattr(runner.bw, "_boxed_call", False)  # Inductor's backward frees saved values as it goes


# --------------------------------------------------------------------------------------------
# Edited graphs
# --------------------------------------------------------------------------------------------


class TanhMLP(nn.Module):
    def __init__(self, act=nn.Tanh):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), act(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).square().mean()


def _sigmoid_instead_of_tanh(sp):
    """The forward with sigmoid for tanh; the backward with sigmoid's derivative s - s*s for 1 - t*t."""
    fw, bw = copy.deepcopy(sp.forward), copy.deepcopy(sp.backward)
    (tanh,) = [n for n in fw.graph.nodes if n.target is torch.tanh]
    tanh.target = torch.sigmoid
    fw.recompile()
    (rsub,) = [n for n in bw.graph.nodes if n.op == "call_function" and n.target is operator.sub and n.args[0] == 1]
    square = rsub.args[1]
    rsub.args = (square.args[0], square)
    bw.recompile()
    return fw, bw


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("compiler", [None, "checking"])
def test_edited_graphs_round_trip(compiler):
    torch.manual_seed(0)
    model, x = TanhMLP(), torch.randn(6, 4)
    sp = fxtools.split(model, x)
    fw, bw = _sigmoid_instead_of_tanh(sp)
    edited = sp.edit(forward=fw, backward=bw)
    graphs = []
    compiled = fxtools.compile(model, split=edited, compiler=checking_compiler(graphs) if compiler else None)
    want = TanhMLP(nn.Sigmoid)
    want.load_state_dict(model.state_dict())
    loss = compiled(x)
    loss.backward()
    want_loss = want(x)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss, **TOL64)
    for p, q in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL64)
    if compiler:
        assert torch.ops.aten.sigmoid.default in {n.target for n in graphs[0].graph.nodes}
    with pytest.raises(fxtools.InputMismatch):
        compiled(torch.randn(6, 5))  # the edited split's guards: no new split is made


def test_edit_leaves_buffers_alone():
    model, inputs = examples.small_cnn()
    model.train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    sp = fxtools.split(model, *inputs)
    edited = sp.edit(forward=copy.deepcopy(sp.forward))  # checked in fake mode: no real update
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert [s.name for s in edited.saved] == [s.name for s in sp.saved]


@pytest.mark.usefixtures("float64")
def test_edited_forward_may_save_other_values():
    """Save the pre-activation instead of tanh's output; the backward recomputes tanh from it."""
    torch.manual_seed(0)
    model, x = TanhMLP(), torch.randn(6, 4)
    sp = fxtools.split(model, x)
    fw, bw = copy.deepcopy(sp.forward), copy.deepcopy(sp.backward)
    output = next(n for n in fw.graph.nodes if n.op == "output")
    out, saved = output.args[0]
    (tanh,) = [n for n in fw.graph.nodes if n.target is torch.tanh]
    output.args = ((out, tuple(tanh.args[0] if s is tanh else s for s in saved)),)
    fw.recompile()
    (ph,) = [n for n in bw.graph.nodes if n.op == "placeholder" and n.name == tanh.name]
    with bw.graph.inserting_after(ph):
        recomputed = bw.graph.call_function(torch.tanh, (ph,))
    ph.replace_all_uses_with(recomputed, delete_user_cb=lambda u: u is not recomputed)
    bw.recompile()
    edited = sp.edit(forward=fw, backward=bw)
    assert [s.kind for s in edited.saved] == [s.kind for s in sp.saved]
    compiled = fxtools.compile(model, split=edited)
    compiled(x).backward()
    want = copy.deepcopy(model)
    for p in want.parameters():
        p.grad = None
    want(x).backward()
    for p, q in zip(model.parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL64)


def test_edits_that_break_the_signature_are_refused():
    model, x = TanhMLP(), torch.randn(6, 4)
    sp = fxtools.split(model, x)
    bw = copy.deepcopy(sp.backward)
    last = [n for n in bw.graph.nodes if n.op == "placeholder"][-1]
    with bw.graph.inserting_after(last):
        bw.graph.placeholder("extra")
    bw.recompile()
    with pytest.raises(fxtools.FxtoolsError, match=r"takes \(\*saved, \*cotangents\)|must take \(\*saved, \*cotangents\)"):
        sp.edit(backward=bw)
    fw = copy.deepcopy(sp.forward)
    (mean,) = [n for n in fw.graph.nodes if n.target is torch.mean]
    with fw.graph.inserting_after(mean):
        doubled = fw.graph.call_function(torch.stack, ([mean, mean],))
    mean.replace_all_uses_with(doubled, delete_user_cb=lambda u: u.op == "output")
    fw.recompile()
    with pytest.raises(
        fxtools.FxtoolsError, match=r"the edited forward's out is torch.float32\[2\]; the split's is torch.float32\[\]"
    ):
        sp.edit(forward=fw)
    with pytest.raises(ValueError, match="made from a module"):
        fxtools.compile(lambda x: x, split=sp)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("x_shape", [(5,), (3, 5)])
def test_vector_matrix_product_under_inductor_decompositions(x_shape):
    """Inductor's table lowers ``x @ w`` for a vector ``x`` to ``mm(x.unsqueeze(0), w).squeeze_(0)``:
    the in-place view of an intermediate becomes its view form, not a refusal."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 4))

        def forward(self, x):
            return torch.tanh(x @ self.w).sum()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(x_shape)
    graphs = []
    compiled = fxtools.compile(model, x, compiler=checking_compiler(graphs), decompositions="inductor")
    compiled(x).backward()
    expected = torch.autograd.grad(torch.tanh(x @ model.w).sum(), model.w)[0]
    torch.testing.assert_close(model.w.grad, expected, rtol=1e-12, atol=1e-12)
    assert graphs


def test_inductor_reuses_saved_memory_only_when_nothing_else_holds_it():
    """Inductor's backward may write over the saved values it owns (AOTAutograd's donated
    buffers, ``AtenSplit.donated``): the log-probabilities become the loss's gradient in place.
    A value something else still holds is passed as a copy: a retained graph's second backward
    and a saved-tensor hook's reference see the values the forward saved (float64, exact)."""
    model, inputs = examples.mlp("gelu", batch=32, n_out=64, dtype=torch.float64)
    compiled = fxtools.compile(model, *inputs, compiler="inductor")
    runner = compiled._runners.entries[0][2]
    assert runner.donated and runner.donated == runner.aten.donated()
    want = torch.autograd.grad(model(*inputs), list(model.parameters()))
    kept: list = []

    def pack(t):
        kept.append((t, t.clone()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(*inputs)
    loss.backward(retain_graph=True)
    loss.backward()
    assert kept and all(torch.equal(t, copy_) for t, copy_ in kept)
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, 2 * w, **TOL64)
    model.zero_grad()
    compiled(*inputs).backward()
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, **TOL64)


# --------------------------------------------------------------------------------------------
# Input layouts: compiled graphs are specialised to their examples' strides
# --------------------------------------------------------------------------------------------


def stride_asserting_compiler(gm, example_inputs):
    """Runs ``gm`` after checking each input's size and strides against its example's, with the
    check Inductor's compiled code makes (``assert_size_stride``), without Inductor's compile time."""
    layouts = [(tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else None for x in example_inputs]

    def run(*args):
        for x, layout in zip(args, layouts):
            if layout is not None:
                torch._C._dynamo.guards.assert_size_stride(x, *layout)
        return gm(*args)

    return run


class LinearSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return (torch.tanh(self.fc(x)) * x.mean(-1, keepdim=True)).sum()


def _layouts():
    """The same shape in every layout eager takes: (name, tensor, whether graphs exist for it)."""
    x = torch.randn(2, 3, 3, 3, dtype=torch.float64)
    return [
        ("contiguous", x, False),
        ("channels_last", x.to(memory_format=torch.channels_last), False),
        ("transposed", torch.randn(2, 3, 3, 3, dtype=torch.float64).transpose(1, 3), False),
        ("expanded", torch.randn(1, 3, 3, 3, dtype=torch.float64).expand(2, 3, 3, 3), False),
        ("storage offset", torch.randn(55, dtype=torch.float64)[1:].view(2, 3, 3, 3), True),
        ("transposed again", torch.randn(2, 3, 3, 3, dtype=torch.float64).transpose(1, 3), True),
    ]


def _assert_layouts_like_eager(model, compiled, runners=None):
    for name, x, seen in _layouts():
        before = None if runners is None else len(runners)
        x = x.detach().requires_grad_() if x.is_leaf else x
        got = torch.autograd.grad(compiled(x), [x, *model.parameters()], allow_unused=True)
        want = torch.autograd.grad(model(x), [x, *model.parameters()], allow_unused=True)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL64, msg=lambda m: f"{name}: {m}")
        if runners is not None:
            assert (len(runners) == before) == seen, name  # new graphs exactly for a new layout


def test_compiled_graphs_specialise_to_input_layouts():
    """A compiler's graphs are made for their example's strides (Inductor asserts them): a call
    in another layout (channels-last, transposed, expanded, a slice) gets graphs of its own, as
    ``torch.compile`` recompiles on a stride guard; a storage offset keeps them (float64, vs eager)."""
    torch.manual_seed(0)
    model = LinearSum().double()
    compiled = fxtools.compile(model, compiler=stride_asserting_compiler)
    _assert_layouts_like_eager(model, compiled, compiled._runners)


def test_backend_takes_dynamo_symbolic_strides():
    """After a call with a transposed input, Dynamo makes the stride symbolic and passes it to
    the backend as an input of the graph: fxtools takes its value (float64, vs eager)."""
    torch.manual_seed(0)
    model = LinearSum().double()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fxtools.backend(compiler=stride_asserting_compiler))
    _assert_layouts_like_eager(model, compiled)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_inductor_gelu_decompositions_equal_pytorchs(approximate):
    """Inductor's table writes tanh GELU with a sigmoid gate (one exp): the same function and
    derivative as PyTorch's kernels (float64, from -30 to 30 and the infinities), other GELUs unchanged."""
    from fxtools.training.aten import decomposition_table

    aten = torch.ops.aten
    table = decomposition_table("inductor")
    x = torch.cat([torch.linspace(-30, 30, 2001, dtype=torch.float64), torch.tensor([0.0, -1e-300, 1e-300, 1e200])])
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    value = table[aten.gelu.default](x, approximate=approximate)
    grad = table[aten.gelu_backward.default](g, x, approximate=approximate)
    # atol: for x below about -6, PyTorch's ``0.5 x (1 + tanh(..))`` cancels (an absolute error of
    # ~1e-16 on values as small as that); the gate has no cancellation there. At 1e200, where x^3
    # overflows, both slopes are NaN
    torch.testing.assert_close(value, aten.gelu(x, approximate=approximate), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, aten.gelu_backward(g, x, approximate=approximate), rtol=1e-12, atol=1e-14, equal_nan=True)
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    torch.testing.assert_close(table[aten.gelu.default](inf, approximate=approximate), inf)
