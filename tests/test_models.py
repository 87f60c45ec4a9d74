"""Whole models (float64): fxtools' parameter gradients equal torch.autograd's, and the seed
examples stay as small as hand-written code."""

import copy

import pytest
import torch

import fxtools
from fxtools.cli import examples
from fxtools.graph.nodes import count_compute_nodes

TOL = dict(rtol=1e-10, atol=1e-10)


pytestmark = pytest.mark.usefixtures("float64")


def autograd_loss_and_grads(model, inputs):
    """Eager reference: the loss and d loss / d params of ``model(*inputs)`` by torch.autograd."""
    params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
    loss = torch.func.functional_call(model, params, inputs)
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss.detach(), dict(zip(params, grads))


def check_model(model, inputs):
    """fxtools.grad and value_and_grad of the functional loss against autograd; returns the eager copy.

    The eager reference runs on a deep copy of ``model`` made before fxtools sees it, so buffers
    (BatchNorm's running statistics) of the two can be compared after one call each.
    """
    reference = copy.deepcopy(model)
    loss_fn, args = examples.as_loss(model, inputs)
    params = args[0]
    assert all(p.dtype == torch.float64 for p in params.values())

    gm = fxtools.value_and_grad(loss_fn, *args)
    loss, grads = gm(*args)
    want_loss, want_grads = autograd_loss_and_grads(reference, inputs)

    torch.testing.assert_close(loss, want_loss, **TOL)
    assert set(grads) == set(want_grads) == set(params)
    for name in params:
        torch.testing.assert_close(grads[name], want_grads[name], **TOL, msg=lambda m: f"{name}: {m}")
    return reference, gm, args


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_mlp_gradients_match_autograd(activation):
    model, inputs = examples.mlp(activation=activation)
    check_model(model, inputs)


def test_grad_returns_the_gradient_dict():
    model, inputs = examples.mlp()
    loss_fn, args = examples.as_loss(model, inputs)
    grads = fxtools.grad(loss_fn, *args)(*args)
    _, want = autograd_loss_and_grads(model, inputs)
    assert isinstance(grads, dict) and list(grads) == list(want)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], **TOL)


def test_small_cnn_gradients_and_batchnorm_statistics_match_eager():
    model, inputs = examples.small_cnn()
    assert model.training
    before = {name: b.clone() for name, b in model.named_buffers()}
    reference, gm, args = check_model(model, inputs)
    # Building the derivative traced the model; tracing must not have touched its buffers.
    # Since then gm ran once and the reference ran one eager forward.
    buffers, want = dict(model.named_buffers()), dict(reference.named_buffers())
    assert {n.rsplit(".", 1)[-1] for n in buffers} == {"running_mean", "running_var", "num_batches_tracked"}
    for name in buffers:
        assert not torch.equal(buffers[name], before[name]), f"{name} was not updated"
        torch.testing.assert_close(buffers[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")
    assert int(buffers["bn1.num_batches_tracked"]) == 1


def test_tracing_does_not_update_batchnorm_statistics():
    model, inputs = examples.small_cnn()
    before = {name: b.clone() for name, b in model.named_buffers()}
    loss_fn, args = examples.as_loss(model, inputs)
    fxtools.grad(loss_fn, *args)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), f"building the gradient changed {name}"


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_gpt_gradients_match_autograd(attention):
    model, inputs = examples.gpt("tiny", attention=attention)
    assert model.transformer.wte.weight is model.lm_head.weight
    reference, _, args = check_model(model, inputs)
    assert "lm_head.weight" not in args[0]  # tied to transformer.wte.weight: one gradient, summed


def test_gpt_attention_variants_agree():
    losses = []
    for attention in ["explicit", "sdpa"]:
        model, inputs = examples.gpt("tiny", attention=attention)
        losses.append(model(*inputs))
    torch.testing.assert_close(losses[0], losses[1], **TOL)


def test_gpt_configs():
    tiny = examples.gpt_config("tiny")
    assert tiny.block_size >= 8 and tiny.dropout == 0.0
    big = examples.gpt_config("gpt2")
    assert (big.n_layer, big.n_embd, big.n_head, big.vocab_size, big.block_size) == (12, 768, 12, 50257, 1024)
    assert examples.gpt_config("gpt2", attention="explicit", bias=False).attention == "explicit"
    with pytest.raises(ValueError):
        examples.gpt_config("huge")


# ---------------------------------------------------------------------------------------------
# Seed examples: the generated code is as small as a hand-written VJP.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, limit", [("sin_plus_x", 5), ("foo", 11), ("bar", 6)])
def test_seed_examples_are_small_and_correct(name, limit):
    fn, args = examples.example(name)
    assert all(a.dtype == torch.float64 for a in args)
    gm = fxtools.vjp(fn, *args)
    n = count_compute_nodes(gm)
    assert n <= limit, f"{name}: {n} compute nodes (at most {limit} expected)\n{gm.code}"
    from fxtools.transforms.check import check_vjp

    check_vjp(fn, *args, gm=gm, rtol=1e-10, atol=1e-10)


def test_sin_plus_x_code_has_no_reshape_or_zero_add():
    fn, args = examples.sin_plus_x()
    code = fxtools.vjp(fn, *args).code
    assert "reshape" not in code, code
    assert "0 +" not in code, code


def test_examples_registry():
    assert {"sin_plus_x", "foo", "bar", "mlp", "cnn", "gpt"} <= set(examples.EXAMPLES)
    for name, build in examples.EXAMPLES.items():
        assert build.__doc__ and build.__doc__.strip(), f"{name} has no docstring"
    fn, args = examples.example("mlp")
    assert isinstance(args[0], dict) and torch.is_tensor(fn(*args))
    with pytest.raises(ValueError):
        examples.example("nope")
