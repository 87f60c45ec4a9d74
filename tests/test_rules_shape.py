"""Shape, view and indexing rules: generated backward code is minimal, and cases OpInfo misses are right."""

import operator

import pytest
import torch
import torch.nn.functional as F

import fxtools
from fxtools.transforms.check import check_vjp

aten = torch.ops.aten


def x64(*shape):
    return torch.randn(shape, dtype=torch.float64)


def _name(node):
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def backward_calls(f, *args):
    """Checks ``vjp(f)`` against autograd; returns the names of the calls that use the cotangent."""
    gm = check_vjp(f, *args)
    tainted = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("grad")}
    names = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
            if n.target is not operator.getitem:
                names.append(_name(n))
    return names


# ---- readability ---------------------------------------------------------------------------


def test_view_then_t_emits_only_the_inverse_transpose_and_reshape():
    ops = backward_calls(lambda x: x.view(2, 6).t(), x64(3, 4))
    assert sorted(ops) == ["reshape", "transpose"]


def test_noop_views_emit_nothing():
    x = x64(3, 4)
    assert backward_calls(lambda x: x.reshape(3, 4) * 2, x) == ["mul"]
    assert backward_calls(lambda x: x.transpose(1, 1) * 2, x) == ["mul"]
    assert backward_calls(lambda x: x.permute(0, 1) * 2, x) == ["mul"]
    assert backward_calls(lambda x: x.squeeze(0) * 2, x) == ["mul"]
    assert backward_calls(lambda x: x.flip([]) * 2, x) == ["mul"]


def test_view_backward_is_one_reshape_that_accepts_any_strides():
    ops = backward_calls(lambda x: x.view(12), x64(3, 4))
    assert ops == ["reshape"]
    gm = fxtools.vjp(lambda x: x.view(12), x64(3, 4))
    strided = torch.randn(24, dtype=torch.float64)[::2]  # callers may pass non-contiguous cotangents
    _, (gx,) = gm(x64(3, 4), strided)
    torch.testing.assert_close(gx, strided.reshape(3, 4))


def test_permute_squeeze_unsqueeze_chain_is_inverted_step_by_step():
    ops = backward_calls(lambda x: x.unsqueeze(0).permute(2, 0, 1).squeeze(1), x64(3, 4))
    assert ops == ["unsqueeze", "permute", "squeeze"]


def test_cat_backward_splits_without_zeros():
    ops = backward_calls(lambda x, y: torch.cat([x, y], 1), x64(3, 4), x64(3, 2))
    assert ops == ["split"]


def test_stack_backward_unbinds():
    assert backward_calls(lambda x, y: torch.stack([x, y], 1), x64(3, 4), x64(3, 4)) == ["unbind"]


def test_split_backward_pads_around_the_used_pieces():
    x = x64(3, 5)
    assert backward_calls(lambda x: x.split([1, 1, 3], 1)[1] * 2, x) == ["mul", "constant_pad_nd"]
    assert backward_calls(lambda x: [p * 2 for p in x.split(2, 1)], x) == ["mul", "mul", "mul", "cat"]
    assert backward_calls(lambda x: [p * 2 for p in x.chunk(3, 1)[1:]], x) == ["mul", "mul", "cat", "constant_pad_nd"]


def test_split_backward_zeros_only_the_unused_pieces_between_used_ones():
    f, x = (lambda x: [p * 2 for p in x.split(1, 0)[::2]]), x64(4, 5)
    assert backward_calls(f, x).count("cat") == 1
    assert check_vjp(f, x).code.count("new_zeros(") == 1  # the zeros are made from the input x


def test_unbind_backward_stacks():
    x = x64(3, 4)
    assert backward_calls(lambda x: [t * 2 for t in x.unbind(0)], x)[-1] == "stack"
    assert backward_calls(lambda x: x.unbind(1)[2] * 2, x) == ["mul", "unsqueeze", "constant_pad_nd"]
    ops = backward_calls(lambda x: (lambda t: (t[0], t[3]))(x.unbind(1)), x)
    assert ops.count("new_zeros") == 1 and ops[-1] == "cat"


def test_slicing_backward_pads_instead_of_writing_into_zeros():
    x = x64(4, 5)
    for f in (lambda x: x[1:3], lambda x: x[:, 2], lambda x: x.narrow(1, 1, 3), lambda x: x[:, -2]):
        ops = backward_calls(f, x)
        assert "new_zeros" not in ops and "zeros" not in ops and "constant_pad_nd" in ops


def test_full_slice_emits_nothing():
    assert backward_calls(lambda x: aten.slice.Tensor(x, 0, 0, 100) * 2, x64(3, 4)) == ["mul"]


def test_index_with_one_index_tensor_uses_index_add():
    idx = torch.tensor([0, 2, 2])
    ops = backward_calls(lambda x: x[:, idx], x64(3, 4))
    assert "index_add" in ops and "index_put" not in ops


def test_repeat_backward_is_one_reshape_and_one_sum():
    assert backward_calls(lambda x: x.repeat(2, 1, 3), x64(3, 4)) == ["reshape", "sum"]


def test_constant_pad_backward_narrows():
    assert backward_calls(lambda x: F.pad(x, (1, 2)), x64(3, 4)) == ["narrow"]


def test_expand_backward_sums():
    assert "sum" in backward_calls(lambda x: x.expand(2, 3, 4), x64(3, 1))


# ---- cases OpInfo does not reach --------------------------------------------------------------

CASES = {
    "unsafe_view": (lambda x: aten._unsafe_view(x, [2, 6]), (x64(3, 4),)),
    "adjoint": (lambda x: x.adjoint(), (x64(2, 3, 4),)),
    "mH": (lambda x: x.mH, (x64(3, 4),)),
    "mT": (lambda x: x.mT, (x64(2, 3, 4),)),
    "t_1d": (lambda x: x.t() * 2, (x64(4),)),
    "flatten": (lambda x: x.flatten(1), (x64(2, 3, 4),)),
    "unflatten": (lambda x: x.unflatten(-1, (2, 2)), (x64(3, 4),)),
    "squeeze_dims": (lambda x: x.squeeze((0, 2)), (x64(1, 3, 1, 4),)),
    "squeeze_all": (lambda x: x.squeeze(), (x64(1, 3, 1, 4),)),
    "unsqueeze_neg": (lambda x: x.unsqueeze(-1), (x64(3, 4),)),
    "movedim_list": (lambda x: x.movedim((0, 1), (2, 0)), (x64(2, 3, 4),)),
    "expand_as": (lambda x, y: x.expand_as(y), (x64(3, 1), x64(2, 3, 4))),
    "broadcast_to": (lambda x: torch.broadcast_to(x, (2, 3, 4)), (x64(1, 4),)),
    "cat_legacy_empty": (lambda x, y: torch.cat([x, y, x], -1), (x64(3, 4), torch.empty(0, dtype=torch.float64))),
    "cat_one": (lambda x: torch.cat([x]), (x64(3, 4),)),
    "hstack_1d": (lambda x, y: torch.hstack([x, y]), (x64(3), x64(2))),
    "hstack_2d": (lambda x, y: torch.hstack([x, y]), (x64(3, 1), x64(3, 2))),
    "vstack_1d": (lambda x, y: torch.vstack([x, y]), (x64(3), x64(2, 3))),
    "split_partial": (lambda x: (x.split(2, 1)[0], x.split(2, 1)[2]), (x64(3, 5),)),
    "split_with_sizes_last": (lambda x: x.split([1, 4], -1)[1], (x64(3, 5),)),
    "unbind_partial": (lambda x: x.unbind(-1)[0], (x64(3, 2),)),
    "narrow_negative": (lambda x: x.narrow(1, -3, 2), (x64(3, 5),)),
    "slice_step": (lambda x: x[:, 1::2], (x64(3, 6),)),
    "slice_empty": (lambda x: x[:, 3:3] + 1, (x64(3, 6),)),
    "select_negative": (lambda x: x.select(0, -1), (x64(3, 5),)),
    "index_none_and_two": (lambda x: x[:, torch.tensor([0, 0]), torch.tensor([1, 3])], (x64(2, 3, 4),)),
    "index_two_separated": (lambda x: x[torch.tensor([0, 1]), :, torch.tensor([1, 1])], (x64(2, 3, 4),)),
    "index_2d_index": (lambda x: x[:, torch.tensor([[0, 0], [2, 1]])], (x64(2, 3, 4),)),
    "index_scalar_tensor": (lambda x: x[:, torch.tensor(1)], (x64(2, 3, 4),)),
    "index_put_none": (lambda x, v: aten.index_put(x, [None, torch.tensor([0, 2])], v), (x64(3, 4), x64(3, 2))),
    "index_put_accumulate": (lambda x, v: x.index_put((torch.tensor([0, 0]),), v, accumulate=True), (x64(3, 4), x64(4))),
    "index_select_0d": (lambda x: x.index_select(1, torch.tensor(2)), (x64(3, 4),)),
    "index_add_alpha": (lambda x, s: x.index_add(0, torch.tensor([0, 2, 0]), s, alpha=2.5), (x64(3, 4), x64(3, 4))),
    "index_copy": (lambda x, s: x.index_copy(1, torch.tensor([3, 0]), s), (x64(3, 4), x64(3, 2))),
    "take_along_dim_negative": (lambda x: torch.take_along_dim(x, torch.tensor([[-1], [0], [-4]]), 1), (x64(3, 4),)),
    "take_along_dim_flat": (lambda x: torch.take_along_dim(x, torch.tensor([5, 5, 0])), (x64(3, 4),)),
    "scatter_value": (lambda x: x.scatter(1, torch.tensor([[0], [3], [1]]), 2.0), (x64(3, 4),)),
    "scatter_src": (lambda x, s: x.scatter(1, torch.tensor([[0, 1], [3, 2], [1, 0]]), s), (x64(3, 4), x64(3, 2))),
    "masked_fill_tensor": (lambda x, v: x.masked_fill(x > 0, v), (x64(3, 4), x64())),
    "masked_fill_broadcast_mask": (lambda x: x.masked_fill(torch.tensor([True, False, True, False]), 1.0), (x64(3, 4),)),
    "diagonal_offset": (lambda x: x.diagonal(1, -1, 0), (x64(3, 2, 4),)),
    "diag_square_offset": (lambda x: torch.diag(x, -1), (x64(4, 4),)),
    "diag_rect": (lambda x: torch.diag(x, 1), (x64(3, 5),)),
    "diag_vector": (lambda x: torch.diag(x, 2), (x64(3),)),
    "diag_embed": (lambda x: torch.diag_embed(x, 1, 0, 2), (x64(2, 3),)),
    "roll_flat": (lambda x: x.roll(5), (x64(3, 4),)),
    "roll_dims": (lambda x: x.roll((1, -2), (0, 1)), (x64(3, 4),)),
    "rot90_k2": (lambda x: x.rot90(2, (1, 2)), (x64(2, 3, 4),)),
    "rot90_k4": (lambda x: x.rot90(4) * 2, (x64(3, 4),)),
    "repeat_leading": (lambda x: x.repeat(2, 1, 1, 3), (x64(3, 4),)),
    "repeat_ones": (lambda x: x.repeat(1, 1) * 2, (x64(3, 4),)),
    "tile": (lambda x: x.tile((2,)), (x64(3, 4),)),
    "repeat_interleave_flat": (lambda x: x.repeat_interleave(2), (x64(3, 4),)),
    "repeat_interleave_dim": (lambda x: x.repeat_interleave(3, dim=-1), (x64(3, 4),)),
    "repeat_interleave_tensor": (lambda x: x.repeat_interleave(torch.tensor([1, 0, 3]), dim=0, output_size=4), (x64(3, 4),)),
    "pad_negative": (lambda x: F.pad(x, (-1, 2, 1, -1)), (x64(3, 4),)),
    "pad_circular_negative": (lambda x: F.pad(x, (-1, 2), mode="circular"), (x64(2, 3, 4),)),
    "pad_reflect_2d": (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), (x64(2, 3, 4),)),
    "pad_replicate_3d": (lambda x: F.pad(x, (1, 0, 2, 1, 0, 1), mode="replicate"), (x64(1, 2, 3, 4),)),
    "unfold_disjoint": (lambda x: x.unfold(1, 2, 2), (x64(3, 5),)),
    "unfold_overlap": (lambda x: x.unfold(-1, 3, 1), (x64(3, 5),)),
    "unfold_gappy": (lambda x: x.unfold(0, 2, 3), (x64(7),)),
    "scatter_reduce_mean_no_self": (
        lambda x, s: x.scatter_reduce(0, torch.tensor([0, 0, 2]), s, "mean", include_self=False),
        (x64(4), x64(3)),
    ),
    "scatter_reduce_amax": (lambda x, s: x.scatter_reduce(0, torch.tensor([0, 0, 2]), s, "amax"), (x64(4), x64(3))),
    "scatter_reduce_prod_zeros": (
        lambda x, s: x.scatter_reduce(0, torch.tensor([0, 0, 2, 2]), s, "prod"),
        (torch.tensor([0.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.tensor([1.5, 0.0, 2.0, -1.0], dtype=torch.float64)),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_autograd(name):
    f, args = CASES[name]
    check_vjp(f, *args)


def test_index_put_mask_values_broadcast():
    x, v = x64(5, 3), x64(3)
    mask = torch.tensor([True, False, True, True, False])
    check_vjp(lambda x, v: x.index_put((mask,), v), x, v)


@pytest.mark.parametrize("where", ["first", "second"])
def test_negative_indices(where):
    i = torch.tensor([-1, 0, -1, 2])
    if where == "first":
        check_vjp(lambda x, v: (x[i], x.index_put((i,), v)), x64(3, 4), x64(4, 4))
    else:
        check_vjp(lambda x, v: (x[:, i], aten.index_put(x, [None, i], v)), x64(3, 4), x64(3, 4))


def test_index_fill_with_repeated_indices_counts_each_filled_element_once():
    check_vjp(lambda x, v: x.index_fill(1, torch.tensor([3, 0, 3]), v), x64(3, 4), x64())
