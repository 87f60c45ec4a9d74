"""Memoized replay of rule calls (fxtools.transforms.replay): the same graphs as tracing every call, faster.

Models of repeated identical layers are differentiated with and without replay (same code),
and their gradients are compared with torch.autograd in float64. ``Memo`` is also exercised
directly under make_fx: what it must not share (other strides, other aliasing, in-place
updates of arguments) and what it must copy faithfully (multi-output ops, random ops).
"""

import contextlib
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from measure import replay_disabled
from torch.fx.experimental import proxy_tensor

import fxtools
from fxtools.cli import examples
from fxtools.graph import meta
from fxtools.transforms import replay
from fxtools.transforms import reverse as reverse_module

TOL = dict(rtol=1e-10, atol=1e-10)


class Block(nn.Module):
    """Uses ops whose rules keep their inputs (mul), alias them (``h * h``), and return several
    values (layer_norm, var_mean, max.dim)."""

    def __init__(self, n, p=0.0):
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.ln = nn.LayerNorm(n)
        self.p = p

    def forward(self, x):
        h = self.ln(torch.tanh(self.fc(x)))
        h = F.dropout(h, self.p, training=self.p > 0)
        var, mean = torch.var_mean(h, dim=-1, keepdim=True)
        top = torch.max(h, dim=-1, keepdim=True).values
        return x + h * h * torch.rsqrt(var + 1) - mean * top


class Stack(nn.Module):
    def __init__(self, n=6, layers=3, p=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(n, p) for _ in range(layers))

    def forward(self, x, t):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, t)


def stack(layers=3, p=0.0, seed=0):
    torch.manual_seed(seed)
    model = Stack(layers=layers, p=p)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g))


@pytest.fixture
def memos(monkeypatch):
    """The Memo objects reverse() creates, in order."""
    made = []

    class Recorded(replay.Memo):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(reverse_module, "Memo", Recorded)
    return made


def autograd_grads(model, inputs):
    params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
    loss = torch.func.functional_call(model, params, inputs)
    return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


@pytest.mark.parametrize("build", [stack, lambda: examples.mlp(), lambda: examples.gpt("tiny", n_layer=3)])
def test_replay_gives_the_same_code(build):
    model, inputs = build()
    loss_fn, args = examples.as_loss(model, inputs)
    with replay_disabled():
        traced = fxtools.value_and_grad(loss_fn, *args)
        traced_vjp = fxtools.vjp(loss_fn, *args)
    replayed = fxtools.value_and_grad(loss_fn, *args)
    assert replayed.code == traced.code
    assert fxtools.vjp(loss_fn, *args).code == traced_vjp.code


def test_replay_keeps_split_markers_and_stack_traces():
    model, inputs = stack()
    splits = []
    for context in (replay_disabled(), contextlib.nullcontext()):
        with context:
            splits.append(fxtools.split(model, *inputs))  # one line: the same stack traces
    traced, replayed = splits
    for a, b in [(traced.forward, replayed.forward), (traced.backward, replayed.backward)]:
        assert a.code == b.code
        for x, y in zip(a.graph.nodes, b.graph.nodes):
            assert (x.name, x.meta.get("stack_trace"), x.meta.get("custom"), meta.PART.get(x)) == (
                y.name,
                y.meta.get("stack_trace"),
                y.meta.get("custom"),
                meta.PART.get(y),
            )


def test_repeated_layers_match_autograd(float64, memos):
    model, inputs = stack(layers=4)
    loss_fn, args = examples.as_loss(model, inputs)
    loss, grads = fxtools.value_and_grad(loss_fn, *args)(*args)
    assert memos[-1].hits > 0
    want_loss, want = autograd_grads(model, inputs)
    torch.testing.assert_close(loss, want_loss, **TOL)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_dropout_masks_of_replayed_layers_are_independent(float64, memos):
    model, inputs = stack(layers=3, p=0.5)
    loss_fn, args = examples.as_loss(model, inputs)
    gm = fxtools.value_and_grad(loss_fn, *args)
    assert memos[-1].hits > 0
    assert gm.code.count(".bernoulli_(") == 3  # one mask per layer, each drawn at run time
    torch.manual_seed(123)
    loss, grads = gm(*args)
    torch.manual_seed(123)
    want_loss, want = autograd_grads(model, inputs)  # eager draws one mask per layer, in order
    torch.testing.assert_close(loss, want_loss, **TOL)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_a_three_layer_mlp_replays(memos):
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    loss_fn, args = examples.as_loss(layers, (torch.randn(5, 8),))
    fxtools.grad(lambda p, x: loss_fn(p, x).sum(), *args)
    memo = memos[-1]
    assert memo.hits > 0 and memo.misses > 0


# --------------------------------------------------------------------------------------------
# Memo under make_fx


def trace(fn, *examples_):
    """``(graph, result, memo)`` of make_fx(fn)(*examples_), fn taking ``(memo, *tensors)``."""
    memo = replay.Memo()
    out = {}

    def run(*xs):
        out["value"] = fn(memo, *xs)
        return [t for t in out["value"] if isinstance(t, torch.Tensor)] if isinstance(out["value"], tuple) else out["value"]

    gm = proxy_tensor.make_fx(run, tracing_mode="fake", pre_dispatch=True)(*examples_)
    return gm.graph, memo


def ops(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_same_metadata_replays_as_new_nodes():
    def fn(memo, x, y):
        a = memo.call(torch.sin, x)
        b = memo.call(torch.sin, y)
        return a * b

    graph, memo = trace(fn, torch.randn(3, 4), torch.randn(3, 4))
    assert (memo.hits, memo.misses) == (1, 1)
    sins = [n for n in graph.nodes if n.target is torch.ops.aten.sin.default]
    assert [n.args[0].name for n in sins] == ["arg0_1", "arg1_1"]
    assert [n.name for n in sins] == ["sin", "sin_1"]
    assert sins[1].meta["val"].shape == (3, 4) and "tensor_meta" in sins[1].meta


def test_other_strides_do_not_share_a_replay():
    def fn(memo, x, y):
        return memo.call(torch.exp, x.t()), memo.call(torch.exp, y)

    graph, memo = trace(fn, torch.randn(4, 3), torch.randn(3, 4))
    assert (memo.hits, memo.misses) == (0, 2)


def test_aliasing_is_part_of_the_key():
    def fn(memo, x, y):
        return memo.call(operator.mul, x, x), memo.call(operator.mul, x, y), memo.call(operator.mul, y, y)

    graph, memo = trace(fn, torch.randn(3), torch.randn(3))
    assert (memo.hits, memo.misses) == (1, 2)
    muls = [n for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert [tuple(a.name for a in n.args) for n in muls] == [("arg0_1", "arg0_1"), ("arg0_1", "arg1_1"), ("arg1_1", "arg1_1")]


def test_nesting_and_keywords_of_the_arguments_are_part_of_the_key():
    """Keys read tuples, lists, dicts and keywords directly: the same leaves nested otherwise, or
    passed under another keyword, are other calls; the same structure again replays."""

    def first_sum(parts, scale=1.0, **named):
        head = parts[0]
        head = head if isinstance(head, torch.Tensor) else next(iter(head.values())) if isinstance(head, dict) else head[0]
        return head * scale + sum(named.values(), torch.zeros(()))

    def fn(memo, x, y, z):
        return (
            memo.call(first_sum, (x, (y, z))),
            memo.call(first_sum, ((x, y), z)),
            memo.call(first_sum, [y, [z, x]]),
            memo.call(first_sum, (x,), scale=2.0, a=y),
            memo.call(first_sum, (x,), scale=2.0, b=y),
            memo.call(first_sum, (z,), scale=2.0, b=x),
            memo.call(first_sum, ({"u": x},), v=y),
        )

    x, y, z = (torch.randn(3) for _ in range(3))
    graph, memo = trace(fn, x, y, z)
    assert (memo.hits, memo.misses) == (1, 6)
    got = fx.GraphModule(torch.nn.Module(), graph)(x, y, z)
    want = [x, x, y, 2 * x + y, 2 * x + y, 2 * z + x, x + y]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_inputs_returned_in_the_result_are_the_arguments():
    def keep(x, w):
        return x @ w, (x, w, 2)

    def fn(memo, x, w, z):
        out1, aux1 = memo.call(keep, x, w)
        out2, aux2 = memo.call(keep, z, w)
        assert aux2[0] is z and aux2[1] is w and aux2[2] == 2 and out2 is not out1
        return out1 + out2

    graph, memo = trace(fn, torch.randn(2, 3), torch.randn(3, 3), torch.randn(2, 3))
    assert memo.hits == 1


@pytest.mark.parametrize(
    "op",
    [
        lambda t: torch.var_mean(t, 1),
        lambda t: tuple(torch.max(t, 1)),
        lambda t: torch.native_layer_norm(t, [4], None, None, 1e-5),
    ],
)
def test_multi_output_ops_replay_with_their_items(op):
    def fn(memo, x, y):
        a = memo.call(op, x)
        b = memo.call(op, y)
        return (*a, *b)

    graph, memo = trace(fn, torch.randn(3, 4), torch.randn(3, 4))
    assert memo.hits == 1
    names = ops(graph)
    half = len(names) // 2
    assert names[:half] == names[half:]
    items = [n for n in graph.nodes if n.target is operator.getitem]
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in items)


def test_random_ops_replay_as_independent_draws():
    def noise(x):
        return x + torch.randn_like(x)

    def fn(memo, x, y):
        return memo.call(noise, x), memo.call(noise, y)

    graph, memo = trace(fn, torch.randn(3), torch.randn(3))
    assert memo.hits == 1
    assert ops(graph).count(torch.ops.aten.randn_like.default) == 2


def test_in_place_update_of_an_argument_is_not_replayed():
    def bump(x):
        return x.add_(1)

    def fn(memo, x, y):
        return memo.call(bump, x.clone()), memo.call(bump, y.clone())

    graph, memo = trace(fn, torch.randn(3), torch.randn(3))
    assert memo.hits == 0
    assert ops(graph).count(torch.ops.aten.add_.Tensor) == 2


def test_reading_a_value_it_was_not_given_is_not_replayed():
    def fn(memo, x, y):
        hidden = x * 2
        f = lambda t: t + hidden  # noqa: E731
        return memo.call(f, x), memo.call(f, y)

    graph, memo = trace(fn, torch.randn(3), torch.randn(3))
    assert memo.hits == 0


def test_transposed_and_contiguous_arguments_match_autograd(float64):
    def f(x, y, w):
        return ((x.t() @ w).tanh() * (y @ w).tanh()).sum()

    x, y, w = torch.randn(4, 3), torch.randn(3, 4), torch.randn(4, 4)
    with replay_disabled():
        traced = fxtools.grad(f, x, y, w, argnums=(0, 1, 2))
    gm = fxtools.grad(f, x, y, w, argnums=(0, 1, 2))
    assert gm.code == traced.code
    leaves = [t.clone().requires_grad_(True) for t in (x, y, w)]
    want = torch.autograd.grad(f(*leaves), leaves)
    for got, expected in zip(gm(x, y, w), want):
        torch.testing.assert_close(got, expected, **TOL)


# -- FakeTensors wrapped with the constructor's state (fxtools.graph.fakes)


def _meta(shape, stride, dtype=torch.float32):
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _data_ptr_refused(t) -> bool:
    try:
        t.data_ptr()
    except RuntimeError:
        return True
    return False


def test_wrapped_fake_tensors_are_the_constructors():
    """A FakeTensor made by ``Wrapper`` is, attribute for attribute, the one ``FakeTensor(mode, meta,
    device)`` makes: the same state, metadata, mode, device and dispatch, aliasing the meta tensor's
    storage, its data pointer refused; the first tensor of a mode and device is the constructor's."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fxtools.graph import fakes

    mode = FakeTensorMode()
    w = fakes.wrapper(mode, torch.device("cpu"))
    assert fakes.wrapper(mode, torch.device("cpu")) is w
    first = w.wrap(_meta((2, 3), (3, 1)))
    assert w.state  # learned from the first
    for shape, stride, dtype in (((4, 5), (1, 4), torch.float64), ((3,), (2,), torch.int64), ((), (), torch.bool)):
        meta = _meta(shape, stride, dtype)
        made, wrapped = FakeTensor(mode, meta, torch.device("cpu")), w.wrap(meta)
        assert type(wrapped) is FakeTensor and wrapped.__dict__ == made.__dict__ == first.__dict__ | {}
        assert (wrapped.shape, wrapped.stride(), wrapped.dtype, wrapped.device) == (shape, stride, dtype, torch.device("cpu"))
        assert wrapped.untyped_storage()._cdata == meta.untyped_storage()._cdata
        assert wrapped.fake_mode is mode and not wrapped.requires_grad and wrapped._version == 0
        with mode:
            assert (wrapped * 2).shape == shape and isinstance(wrapped.sum(), FakeTensor)
    assert fakes.wrapper(mode, torch.device("meta")) is not w  # one per device
    strict = FakeTensorMode()
    strict._allow_unsafe_data_ptr_access = False
    ws = fakes.wrapper(strict, torch.device("cpu"))
    assert ws is not w  # and per mode
    assert _data_ptr_refused(ws.wrap(_meta((1,), (1,)))) and _data_ptr_refused(ws.wrap(_meta((1,), (1,))))


def test_unknown_constructor_state_is_left_to_the_constructor(monkeypatch):
    """A constructor that leaves more than the mode, the device and empty slots (a later PyTorch, the
    debug traceback) is called for every tensor; so is a FakeTensor of a non-meta tensor (an error)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fxtools.graph import fakes

    mode = FakeTensorMode()
    made = []
    original = FakeTensor.__new__

    def counting(cls, *args, **kwargs):
        fake = original(cls, *args, **kwargs)
        fake.extra = len(made)
        made.append(fake)
        return fake

    monkeypatch.setattr(FakeTensor, "__new__", staticmethod(counting))
    w = fakes.Wrapper(mode, torch.device("cpu"))
    a, b = w.wrap(_meta((2,), (1,))), w.wrap(_meta((2,), (1,)))
    assert made == [a, b] and (a.extra, b.extra) == (0, 1) and w.state == {}
    monkeypatch.undo()
    w = fakes.Wrapper(mode, torch.device("cpu"))
    w.wrap(_meta((2,), (1,)))
    with pytest.raises(AssertionError):
        w.wrap(torch.empty(2))


def test_snapshots_and_replays_keep_make_fxs_records():
    """make_fx's snapshots of traced values (``snapshot_fake``, wrapped while fxtools traces) and a replayed
    rule call's values have the records make_fx gives them without fxtools' wrapping."""
    from torch._subclasses.fake_tensor import FakeTensor

    from fxtools.capture.trace import trace_flat

    def f(x, w):
        h = torch.tanh(x @ w)
        return (h.t() * 2).sum(0), h[1:]

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    ours = trace_flat(f, [x, w])
    plain = proxy_tensor.make_fx(f, pre_dispatch=True, tracing_mode="fake", _allow_non_fake_inputs=True)(x, w)
    assert [n.target for n in ours.graph.nodes] == [n.target for n in plain.graph.nodes]
    for a, b in zip(ours.graph.nodes, plain.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert type(va) is FakeTensor and set(va.__dict__) == set(vb.__dict__)
            assert (va.shape, va.stride(), va.storage_offset(), va.dtype, va._is_view()) == (
                vb.shape,
                vb.stride(),
                vb.storage_offset(),
                vb.dtype,
                vb._is_view(),
            )
            assert va.untyped_storage().nbytes() == vb.untyped_storage().nbytes()
            assert a.meta["tensor_meta"] == b.meta["tensor_meta"]


def _fake_record(t):
    return (
        type(t),
        t.__dict__,
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
        t._is_view(),
        t.is_conj(),
        t.is_neg(),
        t.untyped_storage().nbytes(),
    )


def test_cache_hits_make_the_fake_modes_tensors():
    """While fxtools traces, FakeTensorMode's outputs for cache hits are made by ``fakes.from_cache_entry``:
    for plain ops, views (sharing the input's storage, offsets kept), multi-output ops, conjugate and
    negative views and in-place ops they are, record for record, the tensors FakeTensorMode makes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxtools.capture.trace import _cache_hits_wrapped
    from fxtools.graph import fakes

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with mode:
        x, z = torch.empty(4, 6), torch.empty(3, 2, dtype=torch.complex64)
    ops = [
        lambda: x + 1,
        lambda: x.view(2, 12),
        lambda: x.t(),
        lambda: x[1:, 2:4],
        lambda: x.expand(3, 4, 6),
        lambda: x.split(4, dim=1),
        lambda: x.unbind(0),
        lambda: torch.ops.aten.as_strided.default(x, (2, 2), (1, 3), 5),
        lambda: (x > 0).sum(0),
        lambda: z.conj(),
        lambda: torch.ops.aten._neg_view.default(x),
        lambda: torch.ops.aten.native_layer_norm.default(x, [6], None, None, 1e-5),
    ]
    made = []
    original = fakes.from_cache_entry

    def counted(*args):
        out = original(*args)
        made.append(out is not None)
        return out

    for op in ops:
        with mode:
            op()  # fills the cache
            want = op()
            with _cache_hits_wrapped(), pytest.MonkeyPatch.context() as mp:
                mp.setattr(fakes, "from_cache_entry", counted)
                mp.setattr("fxtools.capture.trace.from_cache_entry", counted)
                got = op()
        want_l = want if isinstance(want, (tuple, list)) else (want,)
        got_l = got if isinstance(got, (tuple, list)) else (got,)
        assert [_fake_record(t) for t in got_l] == [_fake_record(t) for t in want_l]
        base = z if op is ops[9] else x
        for t, u in zip(got_l, want_l):
            shares = u.untyped_storage()._cdata == base.untyped_storage()._cdata
            assert (t.untyped_storage()._cdata == base.untyped_storage()._cdata) == shares
    assert sum(made) >= len(ops) - 1  # the hits were made by from_cache_entry
    with mode:
        y = torch.empty(4, 6)
        y.add_(1)
        with _cache_hits_wrapped():
            assert y.add_(1) is y  # an in-place op returns its argument: FakeTensorMode's own


def test_cache_keys_are_the_fake_modes():
    """While fxtools traces, FakeTensorMode's cache keys are made with ``fakes.cache_key_parts``: for
    contiguous, channels-last, transposed, expanded, offset, conjugate, negative, integer, 0-d and
    gradient-requiring tensors the metadata and the whole key are FakeTensorMode's own."""
    from torch._subclasses import fake_tensor
    from torch._subclasses._fake_tensor_utils import _CacheKeyState
    from torch._subclasses.fake_tensor import FakeTensorMode, extract_tensor_metadata
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxtools.capture.trace import _cache_keys_read_once

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with mode:
        x = torch.empty(2, 3, 4, 5)
        z = torch.empty(3, 2, dtype=torch.complex64)
        tensors = [
            x,
            x.contiguous(memory_format=torch.channels_last),
            x.transpose(1, 3),
            x[:, 1:, ::2],
            torch.empty(3, 1).expand(3, 4),
            z.conj(),
            torch.ops.aten._neg_view.default(x),
            torch.empty(5, dtype=torch.int64),
            torch.empty((), dtype=torch.bool),
            torch.empty(4, 1, 1, 1),
            torch.empty(2, 3, requires_grad=True),
        ]

    def key(t):
        return mode._cache_key(_CacheKeyState(mode.shape_env), torch.ops.aten.add.Tensor, (t, 2), {"alpha": 1.5}).key

    want = [(extract_tensor_metadata(t), key(t)) for t in tensors]
    with _cache_keys_read_once():
        assert fake_tensor.extract_tensor_metadata is not extract_tensor_metadata
        got = [(fake_tensor.extract_tensor_metadata(t), key(t)) for t in tensors]
        again = [(fake_tensor.extract_tensor_metadata(t), key(t)) for t in tensors]  # memory formats known
    assert got == want and again == want
    assert [[type(x) for x in k] for _, k in got] == [[type(x) for x in k] for _, k in want]
