"""Linear-algebra rules: generated code is small and readable, and agrees with torch.autograd."""

import pytest
import torch

import fxtools
from fxtools.graph.nodes import count_compute_nodes
from fxtools.transforms.check import check_vjp

MATMULS = {"mm", "matmul", "bmm"}
RESHAPES = {"reshape", "view", "_unsafe_view", "flatten"}


def r(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def spd(n, *batch):
    a = r(*batch, n, n)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def targets(gm):
    """Names of the ops a rendered graph calls (``matmul`` for ``@``, ``einsum``, ``reshape``, ...)."""
    return [
        n.target.overloadpacket.__name__
        if isinstance(n.target, torch._ops.OpOverload)
        else getattr(n.target, "__name__", str(n.target))
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method")
    ]


def test_seed_example_transpose_matmul_is_small():
    def bar(x):
        return torch.transpose(x, 1, 0) @ x

    gm = fxtools.vjp(bar, r(5, 2))
    assert count_compute_nodes(gm) <= 6
    check_vjp(bar, r(5, 2))


def test_matmul_2d_is_three_matmuls_and_no_reshape():
    gm = check_vjp(lambda x, w: x @ w, r(5, 3), r(3, 2))
    ts = targets(gm)
    assert sum(t in MATMULS for t in ts) == 3
    assert not any(t in RESHAPES for t in ts)
    assert "grad_out @" in gm.code


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((4, 1, 5, 3), (6, 3, 2)),  # broadcast batch dims on both sides
        ((2, 5, 3), (2, 3, 4)),  # plain batched
        ((5, 3), (2, 3, 4)),  # matrix @ batch
        ((2, 5, 3), (3, 4)),  # batch @ matrix
        ((1, 5, 3), (2, 3, 4)),  # size-1 batch dim
        ((3,), (3, 4)),
        ((5, 3), (3,)),
        ((3,), (3,)),
        ((3,), (2, 3, 4)),
        ((2, 5, 3), (3,)),
    ],
)
def test_matmul_broadcasting_matches_autograd(sa, sb):
    check_vjp(torch.matmul, r(*sa), r(*sb))


def test_batch_at_matrix_weight_grad_is_one_matmul():
    gm = check_vjp(torch.matmul, r(4, 5, 3), r(3, 2))
    assert sum(t in MATMULS for t in targets(gm)) == 3
    assert "sum" not in targets(gm)


@pytest.mark.parametrize("x_shape,bias", [((4, 5, 3), True), ((5, 3), True), ((3,), True), ((5, 3), False), ((3,), False)])
def test_linear(x_shape, bias):
    args = (r(*x_shape), r(2, 3)) + ((r(2),) if bias else ())
    gm = check_vjp(torch.nn.functional.linear, *args)
    assert sum(t in MATMULS for t in targets(gm)) == (2 if len(x_shape) > 1 else 1)


def test_linear_weight_grad_is_transpose_times_input():
    gm = fxtools.vjp(torch.nn.functional.linear, r(5, 3), r(2, 3), r(2))
    assert count_compute_nodes(gm) == 5  # linear, grad_out @ w, transpose, matmul, sum


@pytest.mark.parametrize(
    "eq,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ij,jk", [(3, 4), (4, 5)]),
        ("...ij,jk", [(2, 3, 4), (4, 5)]),
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (6, 4, 5)]),
        ("ii->i", [(3, 3)]),
        ("ii", [(3, 3)]),
        ("ij->i", [(3, 4)]),
        ("i,j->ij", [(3,), (4,)]),
        ("ij,ij->", [(3, 4), (1, 4)]),
        ("ij->ji", [(3, 4)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ],
)
def test_einsum(eq, shapes):
    def f(*xs):
        return torch.einsum(eq, *xs)

    gm = check_vjp(f, *[r(*s) for s in shapes])
    assert "einsum" in targets(gm)


def test_einsum_cotangents_are_single_einsums():
    gm = fxtools.vjp(lambda a, b: torch.einsum("bij,bjk->bik", a, b), r(2, 3, 4), r(2, 4, 5))
    assert count_compute_nodes(gm) == 3
    assert "'bik,bjk->bij'" in gm.code and "'bij,bik->bjk'" in gm.code


def test_einsum_same_operand_twice():
    check_vjp(lambda a: torch.einsum("ij,jk->ik", a, a), r(3, 3))


@pytest.mark.parametrize("dims,sb", [(1, (5, 2)), (2, (4, 5, 2)), (([0, 2], [1, 0]), (5, 3, 2)), (0, (2,))])
def test_tensordot(dims, sb):
    check_vjp(lambda a, b: torch.tensordot(a, b, dims), r(3, 4, 5), r(*sb))


@pytest.mark.parametrize("sa,sb", [((2, 3), (4, 5)), ((3,), (2, 4)), ((2, 1, 3), (2, 2))])
def test_kron(sa, sb):
    check_vjp(torch.kron, r(*sa), r(*sb))


@pytest.mark.parametrize("batch", [(4,), (2, 4)])
def test_bilinear(batch):
    check_vjp(torch.nn.functional.bilinear, r(*batch, 3), r(*batch, 5), r(2, 3, 5), r(2))


@pytest.mark.parametrize("op", ["mm", "bmm", "mv", "dot", "vdot", "outer", "ger", "inner"])
def test_products(op):
    shapes = {
        "mm": [(3, 4), (4, 2)],
        "bmm": [(2, 3, 4), (2, 4, 5)],
        "mv": [(3, 4), (4,)],
        "dot": [(4,), (4,)],
        "vdot": [(4,), (4,)],
        "outer": [(3,), (4,)],
        "ger": [(3,), (4,)],
        "inner": [(2, 4), (3, 4)],
    }[op]
    check_vjp(getattr(torch, op), *[r(*s) for s in shapes])


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
def test_add_products(beta, alpha):
    kw = dict(beta=beta, alpha=alpha)
    check_vjp(lambda x, a, b: torch.addmm(x, a, b, **kw), r(3), r(2, 4), r(4, 3))
    check_vjp(lambda x, a, v: torch.addmv(x, a, v, **kw), r(2), r(2, 4), r(4))
    check_vjp(lambda x, u, v: torch.addr(x, u, v, **kw), r(1, 3), r(2), r(3))
    check_vjp(lambda x, a, b: torch.baddbmm(x, a, b, **kw), r(3, 5), r(2, 3, 4), r(2, 4, 5))
    check_vjp(lambda x, a, b: torch.addbmm(x, a, b, **kw), r(3, 5), r(2, 3, 4), r(2, 4, 5))


def test_cross_broadcasts():
    check_vjp(lambda a, b: torch.linalg.cross(a, b), r(4, 3), r(1, 3))
    check_vjp(lambda a, b: torch.cross(a, b, dim=0), r(3, 4), r(3, 4))


@pytest.mark.parametrize(
    "f",
    [
        torch.linalg.det,
        torch.det,
        torch.logdet,
        torch.linalg.inv,
        torch.inverse,
        lambda a: torch.linalg.slogdet(a).logabsdet,
        lambda a: torch.slogdet(a)[1],
        lambda a: torch.linalg.inv_ex(a).inverse,
    ],
)
def test_matrix_functions(f):
    check_vjp(f, spd(3))
    check_vjp(f, spd(3, 2))


@pytest.mark.parametrize(
    "sa,sb,left",
    [
        ((3, 3), (3, 2), True),
        ((3, 3), (3,), True),
        ((2, 3, 3), (3,), True),
        ((2, 3, 3), (2, 3), True),
        ((2, 3, 3), (3, 4), True),
        ((3, 3), (2, 3), False),
        ((2, 3, 3), (1, 4, 3), False),
    ],
)
def test_solve(sa, sb, left):
    a = r(*sa) + 3 * torch.eye(3, dtype=torch.float64)
    check_vjp(lambda a, b: torch.linalg.solve(a, b, left=left), a, r(*sb))
    check_vjp(lambda a, b: torch.linalg.solve_ex(a, b, left=left).result, a, r(*sb))


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unit", [True, False])
def test_solve_triangular(upper, left, unit):
    a = r(3, 3) + 3 * torch.eye(3, dtype=torch.float64)
    a = a.triu() if upper else a.tril()
    check_vjp(
        lambda a, b: torch.linalg.solve_triangular(a, b, upper=upper, left=left, unitriangular=unit),
        a,
        r(3, 2) if left else r(2, 3),
    )


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_triangular_solve(upper, transpose):
    a = r(3, 3) + 3 * torch.eye(3, dtype=torch.float64)
    a = a.triu() if upper else a.tril()
    check_vjp(lambda b, a: torch.triangular_solve(b, a, upper=upper, transpose=transpose), r(3, 2), a)


@pytest.mark.parametrize("upper", [True, False])
def test_cholesky(upper):
    check_vjp(lambda a: torch.linalg.cholesky(a, upper=upper), spd(4))
    check_vjp(lambda a: torch.linalg.cholesky_ex(a, upper=upper).L, spd(4, 2))
    check_vjp(lambda a: torch.cholesky(a, upper=upper), spd(4))


@pytest.mark.parametrize("which", ["both", "values", "vectors"])
def test_eigh(which):
    def f(a):
        lam, v = torch.linalg.eigh(a)
        return {"both": (lam, v), "values": lam, "vectors": v}[which]

    check_vjp(f, spd(4))
    check_vjp(f, spd(4, 2))


def _f32(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


# Groups of 3, 0 and 5 rows/columns (offs are group ends). The CPU kernel has no float64.
_OFFS = torch.tensor([3, 3, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    "a,b,offs",
    [
        (_f32(8, 8), _f32(3, 8, 4), _OFFS),  # 2D x 3D: offs splits a's rows
        (_f32(8, 8), _f32(3, 4, 8).mT, torch.tensor([0, 5, 8], dtype=torch.int32)),  # the MoE layout, b = wᵀ
        (_f32(4, 8), _f32(8, 4), _OFFS),  # 2D x 2D: offs splits K -> 3D
        (_f32(8, 4).mT, _f32(8, 4), _OFFS),  # column-major a
        (_f32(3, 4, 8), _f32(8, 8), _OFFS),  # 3D x 2D: offs splits b's columns
        (_f32(3, 4, 8), _f32(3, 8, 4), None),  # 3D x 3D: batched
    ],
    ids=["2d3d", "2d3d_transposed_b", "2d2d", "2d2d_col_major_a", "3d2d", "3d3d"],
)
def test_grouped_mm(a, b, offs):
    """Both gradients are grouped products with the same offs, for every operand layout."""
    gm = check_vjp(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), a, b, offs, rtol=1e-5, atol=1e-5)
    assert targets(gm).count("_grouped_mm") == 3
