"""VJP rules of linear algebra: the matmul family, einsum, tensordot, and matrix functions.

The cotangent of a product is a product with the other factor transposed; batch dimensions a
factor was broadcast over are summed (``unbroadcast``). Einsum-shaped ops differentiate into
einsums with the cotangent in the operand's place.

Complex tensors: products, solves, inverses and determinants are holomorphic, so their rules are
the real formulas and ``vjp_rule`` conjugates the arguments (``ct @ b.mT`` becomes autograd's
``ct @ b.conj().mT``). ``vdot`` and the Hermitian eigen- and singular-value rules compute autograd's
convention themselves (``_H``, the conjugate transpose), as does the complex SVD's. The Cholesky
and ``slogdet`` rules are written for real matrices: complex ones are differentiated by PyTorch's
own formulas.
"""

from __future__ import annotations

import string

import torch

from ..registry import vjp_rule
from .common import unbroadcast

aten = torch.ops.aten


def _H(x):
    """The conjugate transpose of the last two dims (the transpose of a real matrix)."""
    return x.mH if x.is_complex() else x.mT


def _T(x):
    """The transpose of the last two dims."""
    return x.mT


def _conj(x):
    return x.conj() if x.is_complex() else x


def _scale(ct, s):
    return ct if s == 1 else ct * s


def _outer(u, v):
    """u[..., i] * v[..., j] as a matrix (a plain outer product for vectors)."""
    if u.dim() == 1 and v.dim() == 1:
        return torch.outer(u, v)
    return u.unsqueeze(-1) * (v if v.dim() == 1 else v.unsqueeze(-2))


def _flat(x):
    """x with its leading dimensions flattened into one, for a single weight-gradient matmul."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


@vjp_rule(aten.mm)
def mm(ct, out, a, b):
    return ct @ _T(b), _T(a) @ ct


@vjp_rule(aten.bmm)
def bmm(ct, out, a, b):
    return ct @ _T(b), _T(a) @ ct


@vjp_rule(aten.matmul)
def matmul(ct, out, a, b):
    if a.dim() == 1 and b.dim() == 1:
        return ct * b, ct * a
    if b.dim() == 1:
        gb = _T(a) @ ct if a.dim() == 2 else _T(_flat(a)) @ ct.reshape(-1)
        return _outer(ct, b), gb
    if a.dim() == 1:
        ga = b @ ct if b.dim() == 2 else unbroadcast((b @ ct.unsqueeze(-1)).squeeze(-1), a)
        return ga, _outer(a, ct)
    if b.dim() == 2:
        return ct @ _T(b), _T(_flat(a)) @ _flat(ct)
    return unbroadcast(ct @ _T(b), a), unbroadcast(_T(a) @ ct, b)


@vjp_rule(aten.dot)
def dot(ct, out, a, b):
    return ct * b, ct * a


@vjp_rule(aten.vdot, complex="convention")
def vdot(ct, out, a, b):
    return _conj(ct) * b, ct * a


@vjp_rule(aten.mv)
def mv(ct, out, a, v):
    return _outer(ct, v), _T(a) @ ct


@vjp_rule(aten.outer)
def outer(ct, out, a, b):
    return ct @ b, a @ ct


@vjp_rule(aten.addmm)
def addmm(ct, out, x, a, b, *, beta=1, alpha=1):
    g = _scale(ct, alpha)
    return unbroadcast(_scale(ct, beta), x) if beta != 0 else None, g @ _T(b), _T(a) @ g


@vjp_rule(aten.addmv)
def addmv(ct, out, x, a, v, *, beta=1, alpha=1):
    g = _scale(ct, alpha)
    return unbroadcast(_scale(ct, beta), x) if beta != 0 else None, _outer(g, v), _T(a) @ g


@vjp_rule(aten.addr)
def addr(ct, out, x, u, v, *, beta=1, alpha=1):
    g = _scale(ct, alpha)
    return unbroadcast(_scale(ct, beta), x) if beta != 0 else None, g @ v, u @ g


vjp_rule(aten.baddbmm)(addmm)  # the same formula, batched by the matmuls


@vjp_rule(aten.addbmm)
def addbmm(ct, out, x, a, b, *, beta=1, alpha=1):
    g = _scale(ct, alpha)
    return unbroadcast(_scale(ct, beta), x) if beta != 0 else None, g @ _T(b), _T(a) @ g


@vjp_rule(aten._grouped_mm)
def _grouped_mm(ct, out, a, b, offs=None, bias=None, out_dtype=None):
    """Per group ``out_g = a_g @ b_g``, so ``a_g`` gets ``ct_g @ b_gᵀ`` and ``b_g`` gets ``a_gᵀ @ ct_g``.

    Transposing swaps which operand ``offs`` slices (rows of a 2D ``a`` become columns of ``aᵀ``),
    so for every 2D/3D combination both are grouped products with the same ``offs``: a 2D ``a``
    and a 3D ``b`` give ``b``'s gradient as the 2D x 2D form, per-group ``a_gᵀ @ ct_g`` stacked.
    The kernel reads row- or column-major matrices, so a broadcast cotangent is made contiguous.
    """
    ct = ct.contiguous()
    return torch._grouped_mm(ct, b.mT, offs), torch._grouped_mm(a.mT, ct, offs)


@vjp_rule(aten.linear)
def linear(ct, out, x, weight, bias=None):
    if weight.dim() == 1:
        gx, gw = matmul(ct, out, x, weight)
    else:
        gx = ct @ weight
        if x.dim() == 1:
            gw = _outer(ct, x)
        else:
            dy_rows = _flat(ct)
            dy_cols = dy_rows.mT
            x_rows = _flat(x)
            gw = dy_cols @ x_rows
    return gx, gw, unbroadcast(ct, bias)


# ----------------------------------------------------------------------------------- einsum


def _explicit(equation, shapes):
    """Operand and output subscripts of an einsum, with ``...`` spelled out in fresh letters."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    used = set(equation) - set(".,->")
    fresh = [c for c in string.ascii_letters if c not in used]
    n_ell = max((len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell = "".join(fresh[:n_ell])
    subs = [t.replace("...", ell[n_ell - (len(s) - len(t.replace("...", ""))) :]) for t, s in zip(terms, shapes)]
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(subs)
        out = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    return subs, out


def einsum_cotangents(subs, out, operands, ct):
    """Each operand's cotangent as an einsum of the cotangent (in the operand's place) and the others."""
    grads = []
    for i, x in enumerate(operands):
        if not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())):
            grads.append(None)
            continue
        terms = [out if j == i else s for j, s in enumerate(subs)]
        args = [ct if j == i else y for j, y in enumerate(operands)]
        avail = set("".join(terms))
        target = ""
        for pos, c in enumerate(subs[i]):
            if c in target:  # a repeated subscript (a diagonal): spread with an identity matrix
                new = next(ch for ch in string.ascii_letters if ch not in avail and ch not in target)
                terms.append(c + new)
                args.append(torch.eye(x.shape[pos], dtype=x.dtype, device=x.device))
                avail |= {c, new}
                target += new
            else:
                target += c
        kept = "".join(c for c in target if c in avail)
        g = ct if terms == [kept] else torch.einsum(",".join(terms) + "->" + kept, *args)
        size = dict(zip(target, x.shape))
        dims = [p for p, (c, m) in enumerate(zip(kept, g.shape)) if size[c] == 1 and m != 1]
        if dims:  # dims of size 1 that the other operands broadcast
            g = g.sum(dims, keepdim=True)
        if kept != target:  # subscripts only this operand has: broadcast along them
            for pos, c in enumerate(target):
                if c not in avail:
                    g = g.unsqueeze(pos)
            g = g.expand(x.shape)
        grads.append(g if g.shape == x.shape else g.expand(x.shape))
    return grads


@vjp_rule(aten.einsum)
def einsum(ct, out, equation, operands, path=None):
    subs, out_subs = _explicit(equation, [x.shape for x in operands])
    return None, einsum_cotangents(subs, out_subs, operands, ct), None


@vjp_rule(aten.tensordot)
def tensordot(ct, out, a, b, dims_a, dims_b):
    letters = iter(string.ascii_letters)
    sa = [next(letters) for _ in range(a.dim())]
    sb = [next(letters) for _ in range(b.dim())]
    for da, db in zip(dims_a, dims_b):
        sb[db] = sa[da]
    contracted = {sa[d] for d in dims_a}
    o = "".join(c for c in sa if c not in contracted) + "".join(c for c in sb if c not in contracted)
    return (*einsum_cotangents(["".join(sa), "".join(sb)], o, [a, b], ct), None, None)


@vjp_rule(aten.kron)
def kron(ct, out, a, b):
    n = max(a.dim(), b.dim())
    sa, sb = [1] * (n - a.dim()) + list(a.shape), [1] * (n - b.dim()) + list(b.shape)
    la, lb = string.ascii_lowercase[:n], string.ascii_uppercase[:n]
    g = ct.reshape([s for pair in zip(sa, sb) for s in pair])
    gs = "".join(x + y for x, y in zip(la, lb))
    ga = torch.einsum(f"{gs},{lb}->{la}", g, b.reshape(sb) if b.dim() < n else b)
    gb = torch.einsum(f"{gs},{la}->{lb}", g, a.reshape(sa) if a.dim() < n else a)
    return ga.reshape(a.shape) if a.dim() < n else ga, gb.reshape(b.shape) if b.dim() < n else gb


@vjp_rule(aten.bilinear)
def bilinear(ct, out, x1, x2, weight, bias=None):
    gx1 = torch.einsum("...o,oij,...j->...i", ct, weight, x2)
    gx2 = torch.einsum("...o,oij,...i->...j", ct, weight, x1)
    gw = torch.einsum("no,ni,nj->oij", _flat(ct), _flat(x1), _flat(x2))
    return gx1, gx2, gw, unbroadcast(ct, bias)


@vjp_rule(aten.linalg_cross)
def linalg_cross(ct, out, a, b, dim=-1):
    return unbroadcast(torch.linalg.cross(b, ct, dim=dim), a), unbroadcast(torch.linalg.cross(ct, a, dim=dim), b)


# --------------------------------------------------------------------------- matrix functions


def _batch_scalar(s):
    return s.unsqueeze(-1).unsqueeze(-1)


@vjp_rule(aten.linalg_det)
def linalg_det(ct, out, a):
    return _batch_scalar(ct * out) * _T(torch.linalg.inv(a))


@vjp_rule(aten.logdet)
def logdet(ct, out, a):
    return _batch_scalar(ct) * _T(torch.linalg.inv(a))


@vjp_rule(aten.linalg_slogdet, complex="real")
def linalg_slogdet(ct, out, a):
    return None if ct[1] is None else _batch_scalar(ct[1]) * _T(torch.linalg.inv(a))


@vjp_rule(aten.linalg_inv)
def linalg_inv(ct, out, a):
    return -_T(out) @ ct @ _T(out)


@vjp_rule(aten.linalg_inv_ex)
def linalg_inv_ex(ct, out, a, *, check_errors=False):
    return -_T(out[0]) @ ct[0] @ _T(out[0])


@vjp_rule(aten.linalg_solve)
def linalg_solve(ct, out, a, b, *, left=True):
    vector = b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])
    gb = torch.linalg.solve(_T(a), ct, left=left)
    if vector:
        ga = -_outer(gb, out)
    else:
        ga = -(gb @ _T(out) if left else _T(out) @ gb)
    return unbroadcast(ga, a), unbroadcast(gb, b)


@vjp_rule(aten.linalg_solve_ex)
def linalg_solve_ex(ct, out, a, b, *, left=True, check_errors=False):
    return linalg_solve(ct[0], out[0], a, b, left=left)


@vjp_rule(aten.linalg_solve_triangular)
def linalg_solve_triangular(ct, out, a, b, *, upper, left=True, unitriangular=False):
    gb = torch.linalg.solve_triangular(_T(a), ct, upper=not upper, left=left, unitriangular=unitriangular)
    ga = -(gb @ _T(out) if left else _T(out) @ gb)
    ga = ga.triu(int(unitriangular)) if upper else ga.tril(-int(unitriangular))
    return unbroadcast(ga, a), unbroadcast(gb, b)


@vjp_rule(aten.triangular_solve)
def triangular_solve(ct, out, b, a, upper=True, transpose=False, unitriangular=False):
    gx, gm = ct
    x = out[0]
    ga = None
    if gx is not None:
        gb = torch.linalg.solve_triangular(a if transpose else _T(a), gx, upper=upper == transpose, unitriangular=unitriangular)
        ga = -(x @ _T(gb) if transpose else gb @ _T(x))
        ga = ga.triu(int(unitriangular)) if upper else ga.tril(-int(unitriangular))
    else:
        gb = None
    if gm is not None:
        ga = gm if ga is None else ga + gm
    return unbroadcast(gb, b), unbroadcast(ga, a)


def _cholesky_cotangent(gl, l, upper):
    if upper:
        l, gl = _T(l), _T(gl)
    phi = (_T(l) @ gl).tril()
    phi = phi - 0.5 * torch.diag_embed(phi.diagonal(dim1=-2, dim2=-1))
    lower_inv_h = torch.linalg.solve_triangular(_T(l), phi, upper=True)
    g = torch.linalg.solve_triangular(l, lower_inv_h, upper=False, left=False)
    return 0.5 * (g + _T(g))


@vjp_rule(aten.linalg_cholesky_ex, complex="real")
def linalg_cholesky_ex(ct, out, a, *, upper=False, check_errors=False):
    return _cholesky_cotangent(ct[0], out[0], upper)


@vjp_rule(aten.linalg_cholesky, complex="real")
def linalg_cholesky(ct, out, a, *, upper=False):
    return _cholesky_cotangent(ct, out, upper)


@vjp_rule(aten.cholesky, complex="real")
def cholesky(ct, out, a, upper=False):
    return _cholesky_cotangent(ct, out, upper)


@vjp_rule(aten.linalg_eigh, complex="convention")
def linalg_eigh(ct, out, a, UPLO="L"):
    gl, gv = ct
    lam, v = out
    inner = None if gl is None else torch.diag_embed(gl.to(a.dtype))
    if gv is not None:
        gap = lam.unsqueeze(-2) - lam.unsqueeze(-1)
        gap = gap + torch.eye(lam.shape[-1], dtype=lam.dtype, device=lam.device)
        vhgv = _H(v) @ gv
        off = 0.5 * (vhgv - _H(vhgv)) / gap
        inner = off if inner is None else inner + off
    return v @ inner @ _H(v)


@vjp_rule(aten.linalg_eigvalsh, complex="convention")
def linalg_eigvalsh(ct, out, a, UPLO="L"):
    _, v = torch.linalg.eigh(a, UPLO=UPLO)
    return v @ torch.diag_embed(ct.to(a.dtype)) @ _H(v)


@vjp_rule(aten.linalg_svdvals, complex="convention")
def linalg_svdvals(ct, out, a, *, driver=None):
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ torch.diag_embed(ct.to(a.dtype)) @ vh


@vjp_rule(aten.slogdet, complex="real")
def slogdet(ct, out, a):
    return linalg_slogdet(ct, out, a)


@vjp_rule(aten._linalg_solve_ex)
def _linalg_solve_ex(ct, out, a, b, *, left=True, check_errors=False):
    return linalg_solve(ct[0], out[0], a, b, left=left)


@vjp_rule(aten.det)
def det(ct, out, a):
    return linalg_det(ct, out, a)


_SVD_PHASE_MESSAGE = (
    "svd: the loss depends on the phases of the complex singular vectors, so its "
    "derivative is not defined (autograd raises here too)"
)


@vjp_rule(aten._linalg_svd, complex="complex")
def _linalg_svd(ct, out, a, full_matrices=False, compute_uv=True, *, driver=None):
    """Complex SVD: autograd's formula, with its check that the loss ignores the singular vectors'
    phases made an assertion of the generated code (it depends on the data). Real matrices keep
    PyTorch's own formula."""
    gu, gs, gvh = ct
    u, s, vh = out
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    if gu is None and gvh is None:
        return u[..., :k] @ (gs.unsqueeze(-1) * vh[..., :k, :]) if m >= n else (u[..., :, :k] * gs.unsqueeze(-2)) @ vh[..., :k, :]
    if full_matrices and m != n:
        raise NotImplementedError(
            "the derivative of a non-square full_matrices=True SVD's singular vectors "
            "is not defined (autograd refuses it too); use full_matrices=False"
        )

    def skew(x):
        return x - _H(x)

    uhgu = None if gu is None else skew(_H(u) @ gu)
    vhgv = None if gvh is None else skew(vh @ _H(gvh))
    # autograd's check, kept at run time: a loss that depends on the phases has no derivative
    im_u = 0 if uhgu is None else uhgu.diagonal(dim1=-2, dim2=-1).imag
    im_v = 0 if vhgv is None else vhgv.diagonal(dim1=-2, dim2=-1).imag
    torch._assert_async(((im_u + im_v).abs() <= 1e-2 + 1e-2 * (im_v.abs() if vhgv is not None else 0)).all(), _SVD_PHASE_MESSAGE)
    s2 = s * s
    e = s2.unsqueeze(-2) - s2.unsqueeze(-1) + torch.eye(k, dtype=s.dtype, device=s.device)
    if uhgu is not None and vhgv is not None:
        g = (uhgu * s.unsqueeze(-2) + s.unsqueeze(-1) * vhgv) / e
    elif uhgu is not None:
        g = uhgu * (s.unsqueeze(-2) / e)
    else:
        g = s.unsqueeze(-1) * vhgv / e
    if gs is not None:
        g = g + torch.diag_embed(gs)
    if uhgu is not None:
        g = g + torch.diag_embed(uhgu.diagonal(dim1=-2, dim2=-1) / (2 * s))
    if m > n and gu is not None:
        gus = gu / s.unsqueeze(-2)
        return (u @ g + gus - u @ (_H(u) @ gus)) @ vh
    if m < n and gvh is not None:
        sgvh = gvh / s.unsqueeze(-1)
        return u @ (g @ vh + sgvh - (sgvh @ _H(vh)) @ vh)
    return u @ g @ vh
