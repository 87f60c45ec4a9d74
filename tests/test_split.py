"""fxtools.split: forward and backward graphs with a stable signature (float64, against autograd)."""

import io
import re

import pytest
import torch
import torch.utils.checkpoint as cp

import fxtools
from fxtools.cli import examples
from fxtools.training import policies

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")


def placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


# seed 004's scan step: carry and x are dicts
def scan_fn(carry, x):
    weights = x["weights"]
    biases = x["biases"]
    carry_a = carry["a"]
    carry_b = carry["b"]
    new_carry_a = torch.sin((carry_a @ weights) + biases)
    new_carry_b = torch.cos((carry_b @ weights) + biases)
    y = torch.sigmoid(new_carry_a + new_carry_b)
    return {"a": new_carry_a, "b": new_carry_b}, y


def scan_example(steps=None):
    g = torch.Generator().manual_seed(0)
    lead = () if steps is None else (steps,)
    carry = {"a": torch.randn(2, 3, generator=g), "b": torch.randn(2, 3, generator=g)}
    x = {"weights": torch.randn(*lead, 3, 3, generator=g), "biases": torch.randn(*lead, 2, 3, generator=g)}
    return carry, x


def test_forward_placeholders_follow_the_flattening_of_the_arguments():
    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x)
    assert placeholders(sp.forward) == ["a", "b", "weights", "biases"]
    assert [s.path for s in sp.signature] == ["carry['a']", "carry['b']", "x['weights']", "x['biases']"]
    assert [(s.shape, s.dtype, s.bytes) for s in sp.signature] == [
        ((2, 3), torch.float64, 48),
        ((2, 3), torch.float64, 48),
        ((3, 3), torch.float64, 72),
        ((2, 3), torch.float64, 48),
    ]
    assert sp.flatten(carry, x) == [carry["a"], carry["b"], x["weights"], x["biases"]]
    # backward: saved values (named after the forward values), then one cotangent per output leaf
    names = placeholders(sp.backward)
    assert names[: len(sp.saved)] == [s.name for s in sp.saved]
    assert [c.path for c in sp.cotangents] == ["out[0]['a']", "out[0]['b']", "out[1]"]
    assert all(s.line and "test_split.py" in s.line for s in sp.saved if s.kind != "input")


@pytest.mark.parametrize("policy", ["save_all", "recompute_cheap", "dots_saveable"])
def test_split_step_matches_autograd(policy):
    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x, policy=policy)
    out, saved = sp.forward(*sp.flatten(carry, x))
    want = scan_fn(carry, x)
    torch.testing.assert_close(out, want, **TOL)
    g = torch.Generator().manual_seed(1)
    cts = [torch.randn(c.shape, generator=g) for c in sp.cotangents]
    grads = sp.backward(*saved, *cts)
    leaves = [t.clone().requires_grad_(True) for t in sp.flatten(carry, x)]
    o = scan_fn({"a": leaves[0], "b": leaves[1]}, {"weights": leaves[2], "biases": leaves[3]})
    want_grads = torch.autograd.grad(torch.utils._pytree.tree_leaves(o), leaves, cts)
    got = [grads[0]["a"], grads[0]["b"], grads[1]["weights"], grads[1]["biases"]]
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, **TOL)


class Scan(torch.autograd.Function):
    """A scan over steps of a Split: forwards in a Python loop, backwards in reverse."""

    @staticmethod
    def forward(ctx, sp, a, b, weights, biases):
        saved_steps, ys = [], []
        for i in range(weights.shape[0]):
            (carry, y), saved = sp.forward(a, b, weights[i], biases[i])
            a, b = carry["a"], carry["b"]
            saved_steps.append(list(saved))
            ys.append(y)
        ctx.sp, ctx.saved_steps = sp, saved_steps
        return a, b, torch.stack(ys)

    @staticmethod
    def backward(ctx, grad_a, grad_b, grad_ys):
        grads_w, grads_b = [], []
        for i in reversed(range(len(ctx.saved_steps))):
            args = ctx.saved_steps.pop()  # this step's saved tensors: the only reference to them
            args += [grad_a, grad_b, grad_ys[i]]
            (gc, gx) = ctx.sp.backward_boxed(args)
            assert args == []  # the boxed backward emptied the list
            grad_a, grad_b = gc["a"], gc["b"]
            grads_w.append(gx["weights"])
            grads_b.append(gx["biases"])
        return None, grad_a, grad_b, torch.stack(grads_w[::-1]), torch.stack(grads_b[::-1])


def test_scan_loop_over_split_reproduces_autograd():
    carry, xs = scan_example(steps=5)
    step_x = {"weights": xs["weights"][0], "biases": xs["biases"][0]}
    sp = fxtools.split(scan_fn, carry, step_x)
    leaves = [t.clone().requires_grad_(True) for t in (carry["a"], carry["b"], xs["weights"], xs["biases"])]
    a, b, ys = Scan.apply(sp, *leaves)
    g = torch.Generator().manual_seed(2)
    ca, cb, cy = torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g), torch.randn(ys.shape, generator=g)
    got = torch.autograd.grad([a, b, ys], leaves, [ca, cb, cy])

    ref = [t.clone().requires_grad_(True) for t in (carry["a"], carry["b"], xs["weights"], xs["biases"])]
    c, out = {"a": ref[0], "b": ref[1]}, []
    for i in range(5):
        c, y = scan_fn(c, {"weights": ref[2][i], "biases": ref[3][i]})
        out.append(y)
    want = torch.autograd.grad([c["a"], c["b"], torch.stack(out)], ref, [ca, cb, cy])
    torch.testing.assert_close(ys, torch.stack(out), **TOL)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, **TOL)


def saved_ops(sp) -> dict:
    """Name -> op (``matmul``, ``sin``) of each saved value computed by the forward (not an input)."""
    ops = {n.name: getattr(n.target, "__name__", str(n.target)) for n in sp.forward.graph.nodes}
    return {s.name: ops.get(s.name, "") for s in sp.saved if s.kind != "input"}


def test_aliased_output_cotangent_is_added_inside_the_backward():
    def f(x, w):
        return x * w, w

    x, w = torch.randn(4), torch.randn(4)
    sp = fxtools.split(f, x, w)
    (y, w_out), saved = sp.forward(x, w)
    assert w_out is w
    g0, g1 = torch.randn(4), torch.randn(4)
    gx, gw = sp.backward(*saved, g0, g1)
    torch.testing.assert_close(gx, g0 * w, **TOL)
    torch.testing.assert_close(gw, g0 * x + g1, **TOL)
    assert re.search(r"= grad_w \+ |\+ grad_w\b", sp.backward.code), sp.backward.code


def test_outputs_aliasing_each_other_and_inputs_passed_twice():
    def f(x, y):
        s = torch.sin(x * y)
        return s, s, s.view(-1)

    x = torch.randn(2, 3)
    sp = fxtools.split(f, x, x)
    assert placeholders(sp.forward) == ["x", "y"]
    out, saved = sp.forward(x, x)
    cts = [torch.randn(2, 3), torch.randn(2, 3), torch.randn(6)]
    gx, gy = sp.backward(*saved, *cts)
    xr = x.clone().requires_grad_(True)
    o = f(xr, xr)
    (want,) = torch.autograd.grad(o, [xr], cts)
    torch.testing.assert_close(gx + gy, want, **TOL)  # each argument gets its own partial
    torch.testing.assert_close(gx, gy, **TOL)


def test_module_split_names_parameters():
    model, inputs = examples.mlp()
    sp = fxtools.split(model, *inputs)
    names = placeholders(sp.forward)
    assert names == ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "x", "targets"]
    assert [s.path for s in sp.signature][:2] == ["params['fc1.weight']", "params['fc1.bias']"]
    params = dict(model.named_parameters())
    loss, saved = sp.forward(*sp.flatten(params, *inputs))
    (grads, gx, gt) = sp.backward(*saved, torch.ones(()))
    want = torch.autograd.grad(model(*inputs), list(params.values()))
    assert gt is None  # integer targets get no gradient
    for g, w in zip(grads.values(), want):
        torch.testing.assert_close(g, w, **TOL)


def gpt_grads(policy):
    model, inputs = examples.gpt("tiny")
    sp = fxtools.split(model, *inputs, policy=policy)
    params = dict(model.named_parameters())
    loss, saved = sp.forward(*sp.flatten(params, *inputs))
    grads = sp.backward_boxed([*saved, torch.ones(())])[0]
    want = torch.autograd.grad(model(*inputs), list(params.values()))
    for (name, g), w in zip(grads.items(), want):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{name}: {m}")
    return sp


def test_policies_on_gpt_match_autograd_and_order_memory():
    save_all = gpt_grads("save_all")
    cheap = gpt_grads("recompute_cheap")
    dots = gpt_grads("dots_saveable")
    assert cheap.saved_bytes < save_all.saved_bytes
    assert dots.saved_bytes <= save_all.saved_bytes
    # dots_saveable keeps only matrix products (and inputs, and what may not be recomputed)
    ops = saved_ops(dots)
    for s in dots.saved:
        assert (
            s.kind == "input"
            or any(k in ops.get(s.name, "") for k in ("linear", "matmul", "scaled_dot", "embedding", "mm"))
            or s.storage != s.name
        ), s


def test_user_policy_function():
    seen = []

    def policy(node):
        seen.append(node)
        return "save" if node.target is torch.ops.aten.matmul.default else "recompute"

    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x, policy=policy)
    assert seen and all(isinstance(n, torch.fx.Node) for n in seen)
    assert sorted(saved_ops(sp).values()) == ["matmul", "matmul"]
    out, saved = sp.forward(*sp.flatten(carry, x))
    assert len(saved) == len(sp.saved)
    with pytest.raises(ValueError, match="policy"):
        fxtools.split(scan_fn, carry, x, policy="nonsense")
    with pytest.raises(ValueError, match="'save' or 'recompute'"):
        fxtools.split(scan_fn, carry, x, policy=lambda node: True)


def test_save_only_helper():
    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x, policy=policies.save_only(torch.ops.aten.sin))
    ops = list(saved_ops(sp).values())
    assert ops and all(op == "sin" for op in ops)


def _region(a, w):
    a = torch.sin(a)
    a = a @ w
    a = torch.cos(a)
    return a


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("policy", ["save_all", "recompute_cheap"])
def test_checkpoint_regions_are_recomputed(reentrant, policy):
    def f(a, w):
        h = cp.checkpoint(_region, a, w, use_reentrant=reentrant)
        return torch.sigmoid(h @ w)

    def plain(a, w):
        return torch.sigmoid(_region(a, w) @ w)

    a, w = torch.randn(4, 4), torch.randn(4, 4)
    sp = fxtools.split(f, a, w, policy=policy)
    ref = fxtools.split(plain, a, w, policy=policy)
    inside = {"sin", "matmul"}
    assert not inside & set(saved_ops(sp).values())
    assert inside & set(saved_ops(ref).values())
    assert "torch.sin(a)" in sp.backward.code  # recomputed in the backward
    out, grads = sp.vjp(a, w)
    ar, wr = a.clone().requires_grad_(True), w.clone().requires_grad_(True)
    f(ar, wr).sum().backward()
    torch.testing.assert_close(grads[0], ar.grad, **TOL)
    torch.testing.assert_close(grads[1], wr.grad, **TOL)


def test_checkpointed_gpt_blocks_save_less():
    model, inputs = examples.gpt("tiny")
    blocks = model.transformer.h
    for block in blocks:
        block._orig_forward = block.forward
        block.forward = (lambda b: lambda x: cp.checkpoint(b._orig_forward, x, use_reentrant=False))(block)
    plain_model, _ = examples.gpt("tiny")
    sp = fxtools.split(model, *inputs, policy="save_all")
    ref = fxtools.split(plain_model, *inputs, policy="save_all")
    assert sp.saved_bytes < ref.saved_bytes
    params = dict(model.named_parameters())
    _, grads = sp.vjp(params, *inputs)
    want = torch.autograd.grad(plain_model(*inputs), list(plain_model.parameters()))
    for g, w in zip(grads[0].values(), want):
        torch.testing.assert_close(g, w, **TOL)


def test_report_lists_saved_values_and_bytes():
    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x, policy="save_all")
    buf = io.StringIO()
    text = sp.report(file=buf)
    assert buf.getvalue().strip() == text
    assert f"{sp.saved_bytes:,} bytes" in text
    assert sp.saved_bytes == sum(s.bytes for s in sp.saved if s.kind != "input")
    for s in sp.saved:
        assert s.name in text
    assert "test_split.py" in text
    assert "Split(" in repr(sp)


def test_boxed_backward_frees_saved_values():
    import weakref

    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x, policy="save_all")
    out, saved = sp.forward(*sp.flatten(carry, x))
    cts = [torch.ones(c.shape) for c in sp.cotangents]
    positional = sp.backward(*saved, *cts)
    refs = [weakref.ref(s) for s, info in zip(saved, sp.saved) if info.kind == "activation" and s is not out[1]]
    assert refs
    args = [*saved, *cts]
    del saved
    boxed = sp.backward_boxed(args)
    assert args == []
    assert all(r() is None for r in refs)  # nothing but the list held them
    torch.testing.assert_close(boxed, positional, **TOL)
    assert "args.clear()" in sp.backward_boxed.code


def _graphs_reachable(root) -> list:
    """The fx graphs reachable from ``root`` through its objects (functions through their
    closures and defaults; modules, classes and module namespaces not followed)."""
    import gc
    import sys
    import types

    import torch.fx as fx

    namespaces = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen, stack, found = {id(root)}, [root], []
    while stack:
        o = stack.pop()
        if isinstance(o, fx.Graph):
            found.append(o)
        if isinstance(o, types.FunctionType):
            refs = [*(o.__closure__ or ()), o.__defaults__, o.__kwdefaults__]
        elif isinstance(o, (types.ModuleType, type)) or id(o) in namespaces:
            continue
        else:
            refs = gc.get_referents(o)
        for r in refs:
            if id(r) not in seen:
                seen.add(id(r))
                stack.append(r)
    return found


def test_split_keeps_only_its_own_graphs():
    """A split holds five graphs: its forward, backward and backward_boxed, the captured program
    (``training/saved.py`` replays it) and the joint graph (``report``, ``predicted_peak``,
    ``frontier``); none of the build's intermediate graphs (the template before simplify, the
    traces a rule or a replay made) stays alive through it."""
    model, inputs = examples.gpt("tiny", "explicit")
    sp = fxtools.split(model, *inputs)
    own = {
        id(sp.forward.graph): "forward",
        id(sp.backward.graph): "backward",
        id(sp.backward_boxed.graph): "backward_boxed",
        id(sp.captured.gm.graph): "captured",
        id(sp._partition.nodes[0].graph): "joint",
    }
    found = sorted(own.get(id(g), f"another graph of {len(g.nodes)} nodes") for g in _graphs_reachable(sp))
    assert found == sorted(own.values())


@pytest.mark.parametrize("policy", ["save_all", "recompute_cheap", "dots_saveable"])
def test_random_ops_are_never_recomputed(policy):
    model, inputs = examples.gpt("tiny", dropout=0.2)
    model.train()
    sp = fxtools.split(model, *inputs, policy=policy)
    targets = [str(n.target) for n in sp.backward.graph.nodes if n.op in ("call_function", "call_method")]
    assert not [t for t in targets if any(r in t for r in ("dropout", "bernoulli", "rand"))]
    assert any("dropout" in str(n.target) or "bernoulli" in str(n.target) for n in sp.forward.graph.nodes)
    loss_fn, args = examples.as_loss(model, inputs)
    gm = fxtools.vjp(loss_fn, *args)
    torch.manual_seed(3)
    (loss, saved) = sp.forward(*sp.flatten(*args))
    grads = sp.backward(*saved, torch.ones(()))[0]
    torch.manual_seed(3)
    want_loss, (want, *_) = gm(*args, torch.ones(()))
    torch.testing.assert_close(loss, want_loss, **TOL)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], **TOL)


def test_show_prints_split_graphs(capsys):
    carry, x = scan_example()
    sp = fxtools.split(scan_fn, carry, x)
    fxtools.show(sp.forward)
    fxtools.show(sp.backward)
    text = capsys.readouterr().out
    assert "def forward(self, a, b, weights, biases)" in text and "f64[2, 3]" in text


def test_node_copy_is_fx_node_copy():
    """split's forward and backward copy nodes without fx's argument walk: the same nodes as
    ``Graph.node_copy`` (names, arguments and their container types, inputs' users in order, meta)."""
    import torch.fx as fx

    from fxtools.graph.nodes import node_copy

    def f(x, w):
        y = torch.nn.functional.linear(x, w).view(2, -1)
        return torch.cat([y, x.sum(dim=1, keepdim=True) * y], dim=1).clamp(min=0.5)

    g = fx.symbolic_trace(f).graph
    for n in g.nodes:
        n.meta["val"] = n.name
    theirs, ours = fx.Graph(), fx.Graph()
    env_theirs: dict = {}
    env_ours: dict = {}
    for n in g.nodes:
        env_theirs[n] = theirs.node_copy(n, env_theirs.__getitem__)
        env_ours[n] = node_copy(ours, n, env_ours)
    for a, b in zip(theirs.nodes, ours.nodes, strict=True):
        assert (a.name, a.op, a.target, a.meta, a.type) == (b.name, b.op, b.target, b.meta, b.type)
        assert repr((a.args, a.kwargs)) == repr((b.args, b.kwargs))
        assert [type(x) for x in (a.args, a.kwargs, *a.args)] == [type(x) for x in (b.args, b.kwargs, *b.args)]
        assert [u.name for u in a.users] == [u.name for u in b.users]
        assert [i.name for i in a.all_input_nodes] == [i.name for i in b.all_input_nodes]
    assert theirs.python_code("self").src == ours.python_code("self").src
