"""Held-out round P: layouts a decomposition or FakeTensor gets wrong, values read before a write,
arguments sharing memory. Each was a silent wrong answer or a false refusal; the oracle is
PyTorch in float64 (``torch.func``), or the arithmetic of what the forward computed where eager's
own backward refuses (a tensor it saved was modified in place).
"""

import fuzz_programs
import pytest
import torch
from test_fuzz import close

import fxtools

pytestmark = pytest.mark.usefixtures("float64")
TOL = dict(rtol=1e-9, atol=1e-9)


def _flash_heads(x):
    """Heads laid out ``[batch, seq, heads, dim]`` in memory (a projection viewed into heads and
    transposed), through the CPU flash-attention op, whose output is laid out so too: transposed
    back, it views as rows, as ``RowwiseParallel``'s DTensor linear does with the SDPA output."""
    q = x.view(2, 5, 3, 4).transpose(1, 2)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q * 2, q.cos(), 0.0, True)[0]
    return out.transpose(1, 2).view(10, -1).sin()


def _math_heads(x):
    """``_flash_heads`` written out (causal softmax attention, ``.reshape``): the same values, with
    a forward-mode derivative in PyTorch (the flash op has none: ``torch.func.jvp`` raises)."""
    q = x.view(2, 5, 3, 4).transpose(1, 2)
    scores = (q @ (q * 2).transpose(-1, -2)) / 2.0  # head dimension 4
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(-1) @ q.cos()
    return out.transpose(1, 2).reshape(10, -1).sin()


def test_a_decomposition_gives_the_layout_of_the_op_it_replaces():
    """The op has no rule and is replaced by PyTorch's decomposition, which lays its result out
    otherwise (``[seq, batch, heads, dim]``); the code after it was traced at the op's strides (the
    ``.view(10, -1)``): it refused the program (a raw ``ValueError``), and under tensor parallel
    every ``F.scaled_dot_product_attention`` between Colwise and Rowwise projections."""
    x = torch.randn(2, 5, 12)
    out = _flash_heads(x)
    ct, t = torch.randn_like(out), torch.randn_like(x)
    got_out, (got_grad,) = fxtools.vjp(_flash_heads, x)(x, ct)
    want_out, pullback = torch.func.vjp(_flash_heads, x)
    close([got_out, got_grad], [want_out, *pullback(ct)], "vjp")
    close(list(fxtools.jvp(_flash_heads, x)(x, t)), list(torch.func.jvp(_math_heads, (x,), (t,))), "jvp")
    xs = x.clone().requires_grad_()
    fxtools.compile(_flash_heads, x)(xs).backward(ct)
    close([xs.grad], list(pullback(ct)), "compile")


def test_vmap_reshapes_a_view_fakes_allow_and_kernels_refuse():
    """Fuzz program 50 of seed 23: ``conv1d(...).view(8)`` per sample. Batched, the convolution's
    result is ``[3, 2, 1, 4]`` with strides ``(4, 12, 4, 1)``: FakeTensor views it as ``[3, 8]``
    (the size-1 dimension between the merged ones), ATen's kernel refuses, so the module built
    and then raised PyTorch's view error on every call. Now computed as ``reshape`` (one sample's
    layout allows the view), exact; the per-sample gradients too."""
    p = fuzz_programs.program(50, 23)
    batched, in_dims = p.batched_args(), p.in_dims()
    got = fxtools.vmap(p.fn, *batched, in_dims=in_dims)(*batched)
    close(got, fuzz_programs.vmap_oracle(p.fn, in_dims, *batched), "vmap")

    def loss(*a):
        return sum(o.sum() for o in p.fn(*a) if o.is_floating_point())

    dims = (None, *in_dims[1:])
    args = (p.args[0], *batched[1:])
    nums = tuple(p.float_args)
    got = fxtools.vmap(fxtools.grad(loss, *p.args, argnums=nums), *args, in_dims=dims)(*args)
    close(got, fuzz_programs.vmap_oracle(torch.func.grad(loss, argnums=nums), dims, *args), "per-sample grads")


def _scaled_then_bumped(x, n):
    y = x * n
    with torch.no_grad():
        n.add_(1)  # n was read above: the gradient of y is that of the n before this line
    return y


@pytest.mark.parametrize("policy", ["recompute_cheap", "dots_saveable", fxtools.policies.budget(1.0)])
def test_a_value_read_before_a_write_is_saved_not_recomputed(policy):
    """``y = x * n`` then ``n.add_(1)``: the forward computes with a copy of ``n`` made before
    the write; the partition recomputed that copy in the backward from ``n``, by then written,
    so ``fxtools.split`` and ``fxtools.compile`` gave ``ct * (n + 1)`` as the gradient of ``x``
    (eager's backward refuses: a tensor it saved was modified; the derivative of what the forward
    computed is ``ct * n``)."""
    x, n0 = torch.randn(3, 4), torch.arange(4.0)
    ct = torch.randn(3, 4)
    _, pullback = torch.func.vjp(lambda x, n: x * n, x, n0)
    want = pullback(ct)
    sp = fxtools.split(_scaled_then_bumped, x, n0.clone(), policy=policy)
    n = n0.clone()
    out, saved = sp.forward(*sp.flatten(x, n))
    close([out, n], [x * n0, n0 + 1], "forward")
    close(list(sp.backward(*saved, ct)), list(want), "split backward")
    n = n0.clone()
    xs, ns = x.clone().requires_grad_(), n.requires_grad_(False)
    fxtools.compile(_scaled_then_bumped, x, n0.clone())(xs, ns).backward(ct)
    close([xs.grad, ns], [want[0], n0 + 1], "compile")


def _read_then_bump(x, n, m):
    y = x * m
    n.add_(1)  # when n is m, eager's y is x times m before the write
    return y


def _bump_then_read(x, n, m):
    n.add_(1)
    return x * m


def test_arguments_sharing_memory_with_a_program_that_writes(tmp_path):
    """The same tensor passed twice to a module built from separate ones, its code writing one:
    ``fxtools.vjp``'s module computed the gradient with the written value (``ct * (m + 1)``), as
    did ``fxtools.split`` and ``fxtools.compile``; now the modules refuse it naming both
    arguments (a saved module too), and ``fxtools.compile`` refuses to split such a call naming
    the line that writes. Built from the same tensor twice, ``fxtools.vjp`` is exact."""
    x, n0, ct = torch.randn(3, 4), torch.arange(4), torch.randn(3, 4)
    for make in (fxtools.vjp, fxtools.split):
        m = make(_read_then_bump, x, n0.clone(), n0.clone() + 1)
        n = n0.clone()
        with pytest.raises(fxtools.InputMismatch, match="n and m share memory, where the example's did not"):
            m(x, n, n, ct) if make is fxtools.vjp else m.forward(*m.flatten(x, n, n))
        assert torch.equal(n, n0)  # refused before the code ran
    compiled = fxtools.compile(_read_then_bump, x, n0.clone(), n0.clone() + 1)
    n = n0.clone()
    with pytest.raises(
        fxtools.FxtoolsError, match=r"test_heldout_p.py:\d+: n.add_\(1\) .*\) when called with arguments sharing memory: n and m"
    ):
        compiled(x.clone().requires_grad_(), n, n)
    path = tmp_path / "bumped.py"
    fxtools.save(fxtools.vjp(_read_then_bump, x, n0.clone(), n0.clone() + 1), path)
    spec = __import__("importlib.util").util.spec_from_file_location("bumped", path)
    saved = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(saved)
    n = n0.clone()
    with pytest.raises(ValueError, match="n and m share memory"):
        saved.forward(x, n, n, ct)
    for f, m_seen in ((_read_then_bump, n0), (_bump_then_read, n0 + 1)):
        n = n0.clone()
        module = fxtools.vjp(f, x, n, n)
        c = n0.clone()
        out, (grad_x, _, _) = module(x, c, c, ct)
        close([out, grad_x, c], [x * m_seen, ct * m_seen, n0 + 1], f.__name__)
        with pytest.raises(fxtools.InputMismatch, match="n and m do not share memory, where the example's did"):
            module(x, n0.clone(), n0.clone(), ct)
