"""Hand-made cases for hand-written rules that no OpInfo sample reaches.

Some ATen ops only appear in captured programs through a particular spelling (``torch.clip``,
``x.type_as(y)``, ``2 ** x``) or only inside other ops' decompositions (``_softmax``,
``nll_loss_forward``); here each such rule gets functions that call it.
"""

import torch
import torch.nn.functional as F

aten = torch.ops.aten
f64 = torch.float64


def _t(*shape, positive=False, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    x = torch.randn(*shape, dtype=f64, generator=g)
    return x.abs() + 0.5 if positive else x


def _spd(n):
    a = _t(n, n, seed=7)
    return a @ a.mT + n * torch.eye(n, dtype=f64)


_logp = torch.log_softmax(_t(4, 5), 1)
_target = torch.tensor([0, 3, 1, 4])
_logp2d = torch.log_softmax(_t(2, 3, 4, 4), 1)
_target2d = torch.randint(0, 3, (2, 4, 4), generator=torch.Generator().manual_seed(0))

_offs = torch.tensor([3, 3, 8], dtype=torch.int32)
_rows_with_duplicate = torch.cat([_t(4, 3), _t(4, 3)[:1]])  # a zero distance: PyTorch's subgradient 0


def _c(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape))
    return torch.randn(*shape, dtype=torch.complex128, generator=g)


def _svd_invariant(a):
    """Singular values and ``U @ Vh``: independent of the complex singular vectors' phases."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ vh, s, (u * s.unsqueeze(-2)) @ vh


EXTRA_CASES = {
    # the complex-only SVD rule (real SVDs keep PyTorch's formula)
    aten._linalg_svd: [(_svd_invariant, (_c(*shape),)) for shape in ((4, 3), (3, 4), (3, 3), (2, 3, 3))]
    + [(lambda a: torch.linalg.svd(a, full_matrices=False)[1] * 2, (_c(4, 3),))],
    aten.view_as_real: [
        (lambda z: torch.view_as_real(z * z).sin(), (_c(3, 2),)),
        (lambda z: torch.view_as_real(z)[..., 1].expand(4, 3), (_c(3),)),
    ],
    aten._pdist_forward: [
        (lambda x, p=p: aten._pdist_forward(x, p), (x,))
        for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))
        for x in (_t(5, 3), _rows_with_duplicate)
    ],
    aten.pdist: [
        (lambda x, p=p: F.pdist(x, p), (x,))
        for p in (0.0, 0.5, 1.0, 2.0, 3.0, float("inf"))
        for x in (_t(5, 3), _rows_with_duplicate)
    ],
    aten._cdist_forward.default: [
        (lambda a, b, p=p: torch.cdist(a, b, p, compute_mode="donot_use_mm_for_euclid_dist"), (x1, x2))
        for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))
        for x1, x2 in ((_t(4, 3), _t(5, 3, seed=1)), (_t(2, 4, 3), _t(1, 5, 3, seed=1)))
    ]
    + [(lambda a, b, p=p: torch.cdist(a, b, p), (_rows_with_duplicate, _rows_with_duplicate)) for p in (1.0, 2.0, 3.0)],
    aten._adaptive_avg_pool2d: [(lambda x: aten._adaptive_avg_pool2d(x, [2, 3]), (_t(2, 3, 5, 7),))],
    aten._adaptive_avg_pool3d: [(lambda x: aten._adaptive_avg_pool3d(x, [2, 2, 3]), (_t(1, 2, 4, 5, 7),))],
    aten._linalg_solve_ex: [(lambda a, b: aten._linalg_solve_ex(a, b)[0], (_spd(3), _t(3, 2)))],
    aten._log_softmax: [(lambda x: aten._log_softmax(x, 1, False), (_t(3, 4),))],
    aten._softmax: [(lambda x: aten._softmax(x, -1, False), (_t(3, 4),))],
    aten._native_batch_norm_legit.no_stats: [
        (lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)[0], (_t(4, 3, 2), _t(3), _t(3)))
    ],
    aten._native_batch_norm_legit_no_training: [
        (
            lambda x, w, b: aten._native_batch_norm_legit_no_training(
                x, w, b, torch.zeros(3, dtype=f64), torch.ones(3, dtype=f64), 0.1, 1e-5
            )[0],
            (_t(4, 3, 2), _t(3), _t(3)),
        )
    ],
    aten._to_copy: [(lambda x: aten._to_copy(x, dtype=torch.float32) * 2, (_t(3),))],
    aten._unsafe_view: [(lambda x: aten._unsafe_view(x * 2, [6, 2]), (_t(3, 4),))],
    aten._upsample_nearest_exact2d: [(lambda x: F.interpolate(x, size=(5, 7), mode="nearest-exact"), (_t(1, 2, 3, 4),))],
    aten._upsample_nearest_exact3d: [(lambda x: F.interpolate(x, size=(3, 5, 7), mode="nearest-exact"), (_t(1, 2, 2, 3, 4),))],
    aten.upsample_nearest2d: [
        (lambda x: F.interpolate(x, size=(5, 7), mode="nearest"), (_t(1, 2, 3, 4),)),
        (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (_t(2, 1, 3, 3),)),
    ],
    aten.upsample_nearest3d: [(lambda x: F.interpolate(x, size=(3, 5, 7), mode="nearest"), (_t(1, 2, 2, 3, 4),))],
    aten.adjoint: [(lambda x: torch.adjoint(x) * 2, (_t(2, 3, 4),))],
    aten.alias: [(lambda x: aten.alias(x) * x, (_t(3),))],
    aten.clip: [(lambda x: torch.clip(x, -0.5, 0.5), (_t(10),))],
    aten.contiguous: [(lambda x: x.t().contiguous().view(-1) * 2, (_t(3, 4),))],
    aten.convolution: [
        (
            lambda x, w, b: aten.convolution(x, w, b, [2, 1], [1, 0], [1, 2], False, [0, 0], 1),
            (_t(2, 4, 7, 8), _t(6, 4, 3, 2), _t(6)),
        ),
        (lambda x, w: aten.convolution(x, w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 2), (_t(2, 4, 5, 5), _t(4, 3, 3, 3))),
    ],
    aten.det: [(lambda x: aten.det(x), (_spd(3),))],
    aten.slogdet: [(lambda x: aten.slogdet(x)[1], (_spd(4),))],
    aten.float_power.Tensor_Scalar: [(lambda x: torch.float_power(x, 2.5), (_t(5, positive=True),))],
    aten.pow.Scalar: [(lambda x: 2**x, (_t(5),)), (lambda x: torch.pow(1.5, x), (_t(2, 3),))],
    aten.native_dropout: [(lambda x: aten.native_dropout(x, 0.3, True)[0], (_t(50),))],
    aten.nll_loss: [(lambda x: aten.nll_loss(x, _target), (_logp,))],
    aten.nll_loss_forward: [(lambda x: aten.nll_loss_forward(x, _target, None, 1, -100)[0], (_logp,))],
    aten.nll_loss2d: [(lambda x: aten.nll_loss2d(x, _target2d), (_logp2d,))],
    aten.nll_loss2d_forward: [(lambda x: aten.nll_loss2d_forward(x, _target2d, None, 2, -100)[0], (_logp2d,))],
    aten.repeat_interleave.self_Tensor: [
        (lambda x: torch.repeat_interleave(x, torch.tensor([1, 0, 3]), dim=0, output_size=4), (_t(3, 2),))
    ],
    aten.scatter.value: [(lambda x: torch.scatter(x, 1, torch.tensor([[0, 2], [1, 1]]), 0.5), (_t(2, 3),))],
    aten.type_as: [(lambda x, y: x.type_as(y) * y, (_t(3), _t(3).float()))],
    aten.where.ScalarOther: [(lambda x: torch.where(x > 0, x, 0.0), (_t(6),))],
    aten.where.ScalarSelf: [(lambda x: torch.where(x > 0, 1.0, x * 2), (_t(6),))],
    # The CPU kernel has no float64; the same float32 kernels compute both sides. Groups of 3, 0, 5.
    aten._grouped_mm: [
        (lambda a, b: torch._grouped_mm(a, b, offs=_offs), (_t(8, 8).float(), _t(3, 8, 4).float())),
        (lambda a, b: torch._grouped_mm(a, b, offs=_offs), (_t(4, 8).float(), _t(8, 4).float())),
    ],
}
