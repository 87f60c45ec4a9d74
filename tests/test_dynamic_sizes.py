"""Symbolic sizes (``dynamic_shapes=``, torch.export's format): one generated module serves every
size in range. (Data-dependent sizes, ``x[mask]``, are tested in test_dynamic_shapes.py.)

Oracle: torch.func / eager autograd in float64."""

import copy

import pytest
import torch
from isolated import run_isolated
from torch.export import Dim

import fxtools
from fxtools.cli import examples
from fxtools.signature.sizes import SymbolicSizeError

TOL = dict(rtol=1e-10, atol=1e-10)
BATCHES = (2, 7, 64)


def mlp_loss(params, x, y):
    h = torch.tanh(x @ params["w1"].T + params["b1"])
    return ((h @ params["w2"].T - y) ** 2).mean()


def mlp_args(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(16, 8, generator=g, dtype=torch.float64),
        "b1": torch.randn(16, generator=g, dtype=torch.float64),
        "w2": torch.randn(4, 16, generator=g, dtype=torch.float64),
    }
    return (
        params,
        torch.randn(batch, 8, generator=g, dtype=torch.float64),
        torch.randn(batch, 4, generator=g, dtype=torch.float64),
    )


BATCH = Dim("batch", min=1, max=1024)
MARKS = {"x": {0: BATCH}, "y": {0: BATCH}}


def assert_tree_close(got, want):
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want):
        torch.testing.assert_close(a, b, **TOL)


def test_grad_reads_the_batch_size_from_its_input():
    gm = fxtools.grad(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    assert "batch = x.size(0)" in gm.code and "batch * 4" in gm.code  # the mean's count, from the input
    assert "32" not in gm.code and "0.0078125" not in gm.code  # no 1/(32*4) constant
    assert ".numel()" not in gm.code and ".expand(" not in gm.code
    for n in BATCHES:
        args = mlp_args(n, seed=n)
        assert_tree_close(gm(*args), torch.func.grad(mlp_loss)(*args))


def test_value_and_grad_and_vjp_at_every_batch():
    vg = fxtools.value_and_grad(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    vjp = fxtools.vjp(mlp_loss, *mlp_args(32), dynamic_shapes=(None, {0: BATCH}, {0: BATCH}))  # by position
    for n in BATCHES:
        args = mlp_args(n, seed=n)
        want_value, want_grads = torch.func.grad_and_value(mlp_loss, argnums=(0, 1, 2))(*args)[::-1]
        value, grads = vg(*args)
        assert_tree_close((value, grads), (want_value, want_grads[0]))
        ct = torch.tensor(0.75, dtype=torch.float64)
        out, vjp_grads = vjp(*args, ct)
        _, pullback = torch.func.vjp(mlp_loss, *args)
        assert_tree_close((out, vjp_grads), (want_value, pullback(ct)))


def test_jvp_at_every_batch():
    gm = fxtools.jvp(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    for n in BATCHES:
        args = mlp_args(n, seed=n)
        tangents = torch.utils._pytree.tree_map(torch.randn_like, args)
        assert_tree_close(gm(*args, *tangents), torch.func.jvp(mlp_loss, args, tangents))


def test_split_forward_and_backward_at_every_batch():
    sp = fxtools.split(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    for n in BATCHES:
        args = mlp_args(n, seed=n)
        out, saved = sp.forward(*sp.flatten(*args))
        ct = torch.tensor(1.5, dtype=torch.float64)
        grads = sp.backward(*saved, ct)
        value, pullback = torch.func.vjp(mlp_loss, *args)
        assert_tree_close((out, grads), (value, pullback(ct)))


def test_saved_module_serves_every_batch_in_a_fresh_interpreter(tmp_path):
    gm = fxtools.grad(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    fxtools.save(gm, tmp_path / "mlp_grad.py")
    cases = [mlp_args(n, seed=n) for n in BATCHES]
    torch.save([(args, torch.func.grad(mlp_loss)(*args)) for args in cases], tmp_path / "io.pt")
    assert (
        run_isolated(
            """
import torch, mlp_grad
for args, want in torch.load("io.pt"):
    got = mlp_grad.forward(*args)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-10)
print("ok")
""",
            tmp_path,
        ).strip()
        == "ok"
    )


def test_gpt_grad_with_batch_and_sequence_dynamic():
    model, (idx, targets) = examples.gpt(dtype=torch.float64, batch=2, seq_len=8)
    f, (params, idx, targets) = examples.as_loss(model, (idx, targets))
    batch, seq = Dim("batch", min=2, max=64), Dim("seq", min=2, max=model.config.block_size)
    marks = {"idx": {0: batch, 1: seq}, "targets": {0: batch, 1: seq}}
    gm = fxtools.grad(f, params, idx, targets, dynamic_shapes=marks)
    assert "seq = idx.size(1)" in gm.code
    g = torch.Generator().manual_seed(3)
    for b, t in [(2, 5), (3, 16), (4, 2)]:
        i, tg = (torch.randint(0, model.config.vocab_size, (b, t), generator=g) for _ in range(2))
        assert_tree_close(gm(params, i, tg), torch.func.grad(f)(params, i, tg))


def test_compile_dynamic_trains_over_varying_lengths_with_one_graph_pair():
    model, _ = examples.gpt(dtype=torch.float64)
    eager = copy.deepcopy(model)
    compiled = fxtools.compile(model, dynamic=True)
    opt, opt_eager = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    g = torch.Generator().manual_seed(1)
    lengths = (8, 5, 12, 3, 16)
    for step in range(20):
        idx, targets = (torch.randint(0, model.config.vocab_size, (2, lengths[step % 5]), generator=g) for _ in range(2))
        for m, o in ((compiled, opt), (eager, opt_eager)):
            loss = m(idx, targets)
            loss.backward()
            o.step()
            o.zero_grad()
        assert len(compiled._runners) == 1  # one split: one forward graph, one backward graph
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **TOL)


def test_a_specialised_marked_size_is_an_error_naming_it():
    def f(x):
        return x.sum() * x.shape[0] if x.shape[0] == 32 else x.sum()

    with pytest.raises(
        fxtools.SymbolicSizeError, match=r"batch == 32 \(at .*test_dynamic_sizes.py:\d+: return x.sum\(\) \* x.shape\[0\] if"
    ):
        fxtools.grad(f, torch.randn(32, 3, dtype=torch.float64), dynamic_shapes={"x": {0: BATCH}})


def test_a_narrowed_range_is_an_error_with_torchs_suggested_fix():
    def f(x):
        return x.sum() * 2 if x.shape[0] > 20 else x.sum()

    with pytest.raises(SymbolicSizeError, match=r"(?s)batch > 20 .*Dim\('batch', min=21, max=1024\)"):
        fxtools.grad(f, torch.randn(32, 3, dtype=torch.float64), dynamic_shapes={"x": {0: BATCH}})


def test_auto_size_that_is_specialised_becomes_static():
    w = torch.randn(8, 3, dtype=torch.float64)

    def f(x):
        return (x * w).sum()  # x.shape[0] must be 8

    gm = fxtools.grad(f, torch.randn(8, 3, dtype=torch.float64), dynamic_shapes={"x": {0: Dim.AUTO}})
    assert "size(" not in gm.code


def test_dynamic_sizes_beside_data_dependent_ones():
    def f(x, w):
        h = x @ w
        return h[h > 0].sum() / x.shape[0]

    w = torch.randn(3, 4, dtype=torch.float64)
    gm = fxtools.grad(f, torch.randn(10, 3, dtype=torch.float64), w, argnums=(0, 1), dynamic_shapes={"x": {0: Dim("batch")}})
    for n in (2, 9, 33):
        x = torch.randn(n, 3, dtype=torch.float64)
        assert_tree_close(gm(x, w), torch.func.grad(f, argnums=(0, 1))(x, w))


def test_malformed_dynamic_shapes_are_refused_clearly():
    args = mlp_args(4)
    with pytest.raises(SymbolicSizeError, match="not arguments"):
        fxtools.grad(mlp_loss, *args, dynamic_shapes={"z": {0: BATCH}})
    with pytest.raises(SymbolicSizeError, match="3 arguments"):
        fxtools.grad(mlp_loss, *args, dynamic_shapes=({0: BATCH},))


def test_guards_check_the_declared_range_and_equal_sizes():
    gm = fxtools.grad(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    assert "x: float64[batch, 8]" in str(gm.guards) and "batch: any size in [2, 1024]" in str(gm.guards)
    params, x, y = mlp_args(2000)
    with pytest.raises(fxtools.signature.guards.InputMismatch, match=r"x.size\(0\) is 2000, outside the range \[2, 1024\]"):
        gm(params, x, y)
    params, x, _ = mlp_args(7)
    with pytest.raises(fxtools.signature.guards.InputMismatch, match=r"y.size\(0\) is 5, but x.size\(0\) is 7"):
        gm(params, x, mlp_args(5)[2])
    with pytest.raises(fxtools.signature.guards.InputMismatch, match=r"x.size\(1\) is 9"):  # static sizes stay checked
        gm(params, torch.randn(7, 9, dtype=torch.float64), mlp_args(7)[2])


def test_vjp_cotangent_shaped_by_a_dynamic_size_is_symbolic_too():
    def f(x, w):
        return torch.tanh(x @ w)

    w = torch.randn(3, 5, dtype=torch.float64)
    gm = fxtools.vjp(f, torch.randn(6, 3, dtype=torch.float64), w, dynamic_shapes={"x": {0: BATCH}})
    assert "grad_out: float64[batch, 5]" in str(gm.guards)
    for n in (2, 9):
        x, ct = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 5, dtype=torch.float64)
        out, pullback = torch.func.vjp(f, x, w)
        assert_tree_close(gm(x, w, ct), (out, pullback(ct)))


def test_example_size_one_for_a_marked_size_is_refused_clearly():
    params, x, y = mlp_args(1)
    with pytest.raises(SymbolicSizeError, match=r"x.size\(0\) is 1 in the example.*at least 2"):
        fxtools.grad(mlp_loss, params, x, y, dynamic_shapes=MARKS)


def test_hvp_at_every_batch():
    gm = fxtools.hvp(mlp_loss, *mlp_args(32), dynamic_shapes=MARKS)
    for n in BATCHES:
        params, x, y = mlp_args(n, seed=n)
        v = torch.utils._pytree.tree_map(torch.randn_like, params)
        want = torch.func.jvp(lambda p: torch.func.grad(mlp_loss)(p, x, y), (params,), (v,))[1]
        assert_tree_close(gm(params, x, y, v), want)


def test_vmap_over_a_dynamic_batch():
    def per_example_grad(w, x):
        return torch.func.grad(lambda w, x: torch.tanh(x @ w).sum())(w, x)

    w = torch.randn(3, 4, dtype=torch.float64)
    gm = fxtools.vmap(
        per_example_grad, w, torch.randn(10, 3, dtype=torch.float64), in_dims=(None, 0), dynamic_shapes={"x": {0: Dim("batch")}}
    )
    assert "batch = x.size(0)" in gm.code
    for n in (2, 9, 40):
        x = torch.randn(n, 3, dtype=torch.float64)
        assert_tree_close(gm(w, x), torch.func.vmap(per_example_grad, in_dims=(None, 0))(w, x))


def test_sizes_written_with_floor_division_and_views_of_symbolic_bases():
    """Found by tests/test_fuzz_sizes.py: a reshape(-1, 12) of a symbolic size needs a floor
    division in the backward's sizes; a fixed-size view of a symbolic base has a symbolic storage
    (rule replay must not key on it)."""

    def f(x, w):
        return (x.flatten().reshape(-1, 12) * 2).sum() + (w.view(8) * w.view(8)).sum()

    x, w = torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    auto = ({0: Dim.AUTO, 1: Dim.AUTO, 2: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO})
    gm = fxtools.vjp(f, x, w, dynamic_shapes=auto)
    assert "//" in gm.code
    for shape in [(2, 4, 3), (3, 4, 2), (5, 6, 2)]:
        x = torch.randn(shape, dtype=torch.float64)
        ct = torch.tensor(1.5, dtype=torch.float64)
        out, grads = gm(x, w, ct)
        want = torch.func.vjp(f, x, w)[1](ct)
        torch.testing.assert_close(out, f(x, w))
        for g, r in zip(grads, want):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_size_one_is_served_by_a_module_built_for_it():
    """torch traces a dynamic size as >= 2 and settles `size == 1` without a guard; the symbolic
    code could take the wrong branch at 1, so a call of size 1 runs a module built for it (on the
    first such call), which takes the branch eager takes (issue 32)."""

    def f(x):
        return (x * 3).sum() if x.shape[0] == 1 else (x * x).sum()

    gm = fxtools.grad(f, torch.randn(4, 3, dtype=torch.float64), dynamic_shapes={"x": {0: BATCH}})
    assert torch.equal(gm(torch.ones(1, 3, dtype=torch.float64)), torch.full((1, 3), 3.0, dtype=torch.float64))
    assert torch.equal(gm(torch.ones(2, 3, dtype=torch.float64)), torch.full((2, 3), 2.0, dtype=torch.float64))
    one = fxtools.grad(f, torch.randn(1, 3, dtype=torch.float64))
    assert torch.equal(one(torch.ones(1, 3, dtype=torch.float64)), torch.full((1, 3), 3.0, dtype=torch.float64))


def test_slice_ending_at_a_symbolic_size_is_exact_at_odd_sizes():
    """``x[n : 2 * n]`` with ``n = x.shape[0] // 2``, made at an even size: the slice's transpose
    was ``slice_scatter``, whose decomposition decided on the example that the slice reaches the
    end; jvp and hvp were silently wrong at odd sizes. Now exact at both."""

    def f(x):
        n = x.shape[0] // 2
        return (x[:n] * x[n : 2 * n]).sum(0) + x[-1]

    marks = {"x": {0: Dim.AUTO}}
    jvp = fxtools.jvp(f, torch.randn(4, 3, dtype=torch.float64), dynamic_shapes=marks)
    for n in (4, 7):
        x, t = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
        torch.testing.assert_close(jvp(x, t), torch.func.jvp(f, (x,), (t,)))
