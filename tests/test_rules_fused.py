"""The "fused" rule set: every rule agrees with torch.autograd (float64) on the OpInfo samples of
its op, and whole models train with it exactly as in eager mode.

Rules are checked with the fused set active on the same samples as the readable rules
(``tests/opinfo_harness.py``, ``tests/rule_cases.py``), plus the hand-made cases below for ops
no sample reaches; at least one case of each rule must really call a fused backward kernel.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from opinfo_harness import cases_for_rule, check_self_consistent, is_random, sample_function
from rule_cases import EXTRA_CASES

import fxtools
from fxtools import registry
from fxtools.cli import examples
from fxtools.errors import DataDependentError
from fxtools.graph.nodes import count_compute_nodes

aten = torch.ops.aten
f64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)

FUSED = sorted(registry.registered_ops("fused"), key=str)


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=f64, generator=torch.Generator().manual_seed(seed + len(shape)))


_TARGET_2D = torch.randint(0, 3, (2, 4, 4), generator=torch.Generator().manual_seed(0))

FUSED_CASES = {
    aten.native_layer_norm: [
        (lambda x, w, b: aten.native_layer_norm(x, [3], w, b, 1e-5)[0], (_t(2, 4, 3), _t(3), _t(3))),
        (lambda x: aten.native_layer_norm(x, [4, 3], None, None, 1e-5)[0], (_t(2, 4, 3),)),
    ],
    aten._safe_softmax: [(lambda x: aten._safe_softmax(x, -1), (_t(3, 4),))],
    aten.embedding: [  # without padding or frequency scaling, the readable rows scattered into zeros
        (lambda w: F.embedding(torch.tensor([[0, 2], [2, 3]]), w, padding_idx=2), (_t(5, 3),)),
        (lambda w: F.embedding(torch.tensor([0, 2, 2, 1]), w, scale_grad_by_freq=True), (_t(5, 3),)),
    ],
    aten.threshold: [(lambda x: F.threshold(x, 0.2, -1.0), (_t(3, 4),))],
    aten.max_pool2d_with_indices: [(lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True)[0], (_t(2, 3, 7, 6),))],
    aten.max_pool3d_with_indices: [(lambda x: F.max_pool3d(x, 2, return_indices=True)[0], (_t(1, 2, 4, 4, 5),))],
    aten.max_pool3d: [(lambda x: F.max_pool3d(x, 2, 1, ceil_mode=True), (_t(1, 2, 4, 3, 5),))],
    aten.nll_loss_nd: [
        (lambda x: F.nll_loss(x, torch.tensor([0, 3, 1])), (torch.log_softmax(_t(3, 5), 1),)),
        (lambda x: F.nll_loss(x, torch.tensor([[0, 2], [1, 1]]), reduction="sum"), (torch.log_softmax(_t(2, 3, 2), 1),)),
    ],
    aten.cross_entropy_loss: [
        (lambda x, w: F.cross_entropy(x, torch.tensor([0, 3, -100]), w), (_t(3, 5), _t(5).abs())),
        (lambda x: F.cross_entropy(x, _TARGET_2D, reduction="sum"), (_t(2, 3, 4, 4),)),
    ],
    aten.scaled_dot_product_attention: [
        (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            (_t(2, 3, 5, 4), _t(2, 3, 5, 4), _t(2, 3, 5, 4)),
        ),
        (
            lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3),
            (_t(1, 4, 2, 8), _t(1, 6, 2, 8), _t(1, 6, 2, 8)),
        ),
    ],
    aten.batch_norm: [
        (
            lambda x, w, b: F.batch_norm(x, torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64), w, b, False),
            (_t(4, 3, 2), _t(3), _t(3)),
        )
    ],
}


def _cases(op):
    yield from (sample_function(opinfo, sample) for opinfo, _, sample in cases_for_rule(op))
    yield from EXTRA_CASES.get(op, [])
    yield from FUSED_CASES.get(op, [])


def _calls_a_fused_kernel(f, args):
    gm = fxtools.vjp(f, *args)
    return any("backward" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("op", FUSED, ids=str)
def test_fused_rule_matches_autograd(op):
    checked, fused_kernel = 0, False
    with fxtools.rule_set("fused"):
        for f, args in _cases(op):
            try:
                if is_random(f, args):
                    check_self_consistent(f, args)
                else:
                    fxtools.check_vjp(f, *args, rtol=1e-6, atol=1e-8)
                fused_kernel = fused_kernel or _calls_a_fused_kernel(f, args)
            except DataDependentError:
                continue
            checked += 1
    assert checked, f"nothing checks the fused rule of {op}"
    assert fused_kernel, f"no case of {op} reaches a fused backward kernel"


# ---------------------------------------------------------------------------------------------
# rule sets


def test_readable_is_the_default_and_rule_set_switches_and_restores():
    f, args = (lambda x, w, b: F.layer_norm(x, [4], w, b).sum()), (_t(3, 4), _t(4), _t(4))
    assert registry.active_rule_set() == "readable"
    readable = fxtools.grad(f, *args, argnums=(0, 1, 2))
    with fxtools.rule_set("fused"):
        assert registry.active_rule_set() == "fused"
        fused = fxtools.grad(f, *args, argnums=(0, 1, 2))
        with fxtools.rule_set("readable"):
            assert "native_layer_norm_backward" not in fxtools.grad(f, *args).code
    assert registry.active_rule_set() == "readable"
    assert "native_layer_norm_backward" in fused.code and "native_layer_norm_backward" not in readable.code
    assert count_compute_nodes(fused) < count_compute_nodes(readable)
    for a, b in zip(fused(*args), readable(*args)):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match="unknown rule set"):
        with fxtools.rule_set("fast"):
            pass


def test_a_table_of_rules_and_user_rules_beat_the_set():
    def double_fwd(x):
        return torch.sin(x), x

    def double_bwd(x, ct):
        return 2 * ct

    x = _t(5)
    with fxtools.rule_set({torch.ops.aten.sin: (double_fwd, double_bwd)}):
        assert registry.active_rule_set() == "custom"
        _, (g,) = fxtools.vjp(torch.sin, x)(x, torch.ones(5, dtype=f64))
    torch.testing.assert_close(g, torch.full_like(x, 2.0))

    old = registry._RULES[aten.gelu]
    try:
        fxtools.register_vjp(aten.gelu, lambda x: (F.gelu(x), x), lambda x, ct: 3 * ct)
        with fxtools.rule_set("fused"):
            _, (g,) = fxtools.vjp(F.gelu, x)(x, torch.ones(5, dtype=f64))
        torch.testing.assert_close(g, torch.full_like(x, 3.0))
    finally:
        registry._RULES[aten.gelu] = old


def test_unused_results_of_backward_kernels_are_not_computed():
    """The first convolution's input gradient is never asked for: its output_mask says so."""
    model, inputs = examples.small_cnn(dtype=f64)
    loss_fn, args = examples.as_loss(model, inputs)
    with fxtools.rule_set("fused"):
        gm = fxtools.grad(loss_fn, *args)
    masks = [n.args[-1] for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    assert [False, True, False] in masks  # conv1 has no bias, and x needs no gradient


# ---------------------------------------------------------------------------------------------
# models


def _autograd_grads(model, inputs):
    params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
    loss = torch.func.functional_call(model, params, inputs)
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


MODELS = {
    "mlp_relu": lambda: examples.mlp(dtype=f64),
    "mlp_gelu": lambda: examples.mlp(activation="gelu", dtype=f64),
    "small_cnn_train": lambda: examples.small_cnn(dtype=f64),
    "small_cnn_eval": lambda: examples.small_cnn(dtype=f64),
    "gpt_sdpa": lambda: examples.gpt("tiny", dtype=f64),
    "gpt_explicit": lambda: examples.gpt("tiny", attention="explicit", dtype=f64),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_gradients_match_autograd_with_fused_rules(name):
    model, inputs = MODELS[name]()
    if name.endswith("eval"):
        model.eval()
    reference = copy.deepcopy(model)
    loss_fn, args = examples.as_loss(model, inputs)
    with fxtools.rule_set("fused"):
        gm = fxtools.value_and_grad(loss_fn, *args)
    ref_fn, ref_args = examples.as_loss(copy.deepcopy(reference), inputs)
    readable = fxtools.value_and_grad(ref_fn, *ref_args)
    loss, grads = gm(*args)
    want_loss, want = _autograd_grads(reference, inputs)
    torch.testing.assert_close(loss, want_loss, **TOL)
    assert set(grads) == set(want)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], **TOL, msg=lambda m: f"{k}: {m}")
    assert count_compute_nodes(gm) < count_compute_nodes(readable)
    for buf, ref in zip(model.buffers(), reference.buffers()):  # BatchNorm statistics: one update each
        torch.testing.assert_close(buf, ref, **TOL)


def test_gpt_fused_graph_calls_the_kernels_autograd_calls():
    model, inputs = examples.gpt("tiny", dtype=f64)
    loss_fn, args = examples.as_loss(model, inputs)
    with fxtools.rule_set("fused"):
        code = fxtools.grad(loss_fn, *args).code
    for kernel in (
        "native_layer_norm_backward",
        "gelu_backward",
        ".index_add_(0, ",  # the embedding's rows, scattered into the tied head's gradient (issue 33)
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "nll_loss_backward",
        "_log_softmax_backward_data",
    ):
        assert kernel in code, kernel


@pytest.mark.parametrize("build", ["gpt", "small_cnn"])
def test_compile_uses_fused_rules_and_trains_like_eager(build):
    model, inputs = examples.gpt("tiny", dtype=f64) if build == "gpt" else examples.small_cnn(dtype=f64)
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model)
    opt, opt_eager = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    for _ in range(3):
        losses = []
        for o, run in ((opt, compiled), (opt_eager, eager)):
            o.zero_grad()
            losses.append(run(*inputs))
            losses[-1].backward()
            o.step()
        torch.testing.assert_close(losses[0], losses[1], **TOL)
    for (k, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{k}: {m}")
    for buf, ref in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(buf, ref, **TOL)
    kernel = "native_layer_norm_backward" if build == "gpt" else "native_batch_norm_backward"
    assert kernel in compiled.split.backward.code
    readable = fxtools.compile(copy.deepcopy(eager), rules="readable")
    readable(*inputs)
    assert kernel not in readable.split.backward.code


# ---------------------------------------------------------------------------------------------
# second derivatives


def _vhp_through(f, args):
    """fxtools.vjp of the fused-rule gradient graph (it differentiates the kernels), against autograd."""
    with fxtools.rule_set("fused"):
        g = fxtools.grad(f, *args, argnums=tuple(range(len(args))))
    assert any("backward" in str(n.target) for n in g.graph.nodes)
    v = tuple(_t(*a.shape, seed=3) for a in args)
    _, got = fxtools.vjp(g, *args)(*args, v)
    want = torch.autograd.functional.vhp(f, args, v)[1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


SECOND_ORDER = {
    "layer_norm": (lambda x, w, b: (F.layer_norm(x, [4], w, b) ** 2).sum(), (_t(3, 4), _t(4), _t(4))),
    "batch_norm": (lambda x, w, b: (F.batch_norm(x, None, None, w, b, True) ** 2).sum(), (_t(4, 3, 2), _t(3), _t(3))),
    "conv_max_pool": (lambda x, w: (F.max_pool2d(F.conv2d(x, w, padding=1), 2) ** 2).sum(), (_t(2, 3, 4, 4), _t(4, 3, 3, 3))),
    "gelu_softmax": (lambda x: (F.softmax(F.gelu(x), -1) ** 2).sum(), (_t(3, 4),)),
    "cross_entropy": (lambda x: F.cross_entropy(torch.tanh(x), torch.tensor([0, 2, 1])), (_t(3, 4),)),
    "embedding_silu": (lambda w: (F.silu(F.embedding(torch.tensor([0, 2, 2]), w)) ** 2).sum(), (_t(4, 3),)),
}


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_fused_kernels_are_differentiable_by_fxtools(name):
    _vhp_through(*SECOND_ORDER[name])


def test_hvp_uses_readable_rules_inside_a_fused_block():
    """CPU flash attention's backward has no derivative: hvp differentiates the readable rules."""
    model, inputs = examples.gpt("tiny", dtype=f64)
    loss_fn, args = examples.as_loss(model, inputs)
    params = args[0]
    v = {k: _t(*p.shape, seed=5) for k, p in params.items()}
    with fxtools.rule_set("fused"):
        hv = fxtools.hvp(loss_fn, *args)(*args, v)
    p = {k: t.detach().requires_grad_(True) for k, t in params.items()}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # eager's flash attention has no double backward either
        grads = torch.autograd.grad(loss_fn(p, *args[1:]), list(p.values()), create_graph=True)
    want = torch.autograd.grad(sum((g * v[k]).sum() for g, k in zip(grads, p)), list(p.values()))
    for k, w in zip(p, want):
        torch.testing.assert_close(hv[k], w, rtol=1e-8, atol=1e-10)
