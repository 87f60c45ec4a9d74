"""VJP rules of torch.distributed's functional collectives (``torch.ops._c10d_functional``).

These are what DTensor's redistributions run (``capture/subclasses.py`` traces a DTensor program
as its local tensors). Each rank's graph is differentiated as a function of its local tensors, so
a collective's rule is its adjoint across the ranks of its group: the adjoint of gathering is
scattering the sum (``all_gather_into_tensor`` <-> ``reduce_scatter_tensor``), of summing onto
every rank summing again (``all_reduce``), and of waiting nothing. An average is a sum divided by
the group's size, and its adjoint is the same. The cotangent of a maximum (minimum) goes to the
ranks holding it, split evenly between ties; a product has no rule.

The backward communicates where eager's does: the sum an ``all_reduce``'s or an
``all_gather_into_tensor``'s rule needs is no collective when its cotangent is the same on every
rank of the group (``capture/replicated.py``): ``n * ct``, or ``g`` itself for the shares
``g / n`` of a gradient ``g`` every rank holds whole (from ``to_local`` of a replicated DTensor);
the all-gather's then takes this rank's part of it. That reads the graph traced so far, not only
the arguments' metadata, so these rules are never replayed from an earlier call (``replay=False``).
"""

from __future__ import annotations

import torch

from ..capture.replicated import group_rank, group_size, replicated
from ..capture.subclasses import shared_replica
from ..registry import vjp_rule

c10d = torch.ops._c10d_functional

_LINEAR = ("sum", "avg")


def _wait(t):
    return c10d.wait_tensor(t)


def _linear(op: str, what: str) -> None:
    if op not in _LINEAR:
        raise NotImplementedError(f"fxtools has no VJP rule for {what} with reduce_op={op!r} (only 'sum' and 'avg')")


@vjp_rule(c10d.wait_tensor)
def wait_tensor(ct, out, x):
    return ct


def _summed(ct, group_name):
    """The sum over the group of ``ct``: ``g`` itself for shares ``g / n`` of a replicated ``g``,
    ``n * ct`` for a replicated ``ct``."""
    whole = shared_replica(ct, group_name)
    if whole is not None:
        return whole
    if replicated(ct, group_name):
        return ct * group_size(group_name)
    return _wait(c10d.all_reduce(ct, "sum", group_name))


@vjp_rule(c10d.all_reduce, replay=False)
def all_reduce(ct, out, x, reduce_op, group_name):
    if reduce_op in ("max", "min"):
        # the summed cotangent goes to the ranks holding the extreme, split evenly between ties
        # (as torch.amax's rule splits it between the maxima)
        hit = (x == out).to(ct.dtype)
        return _summed(ct, group_name) * hit / _wait(c10d.all_reduce(hit, "sum", group_name))
    _linear(reduce_op, "all_reduce")
    if reduce_op == "sum":
        return _summed(ct, group_name)
    return _wait(c10d.all_reduce(ct, reduce_op, group_name))


@vjp_rule(c10d.all_gather_into_tensor, replay=False)
def all_gather_into_tensor(ct, out, x, group_size, group_name):
    # a replicated cotangent's sum over the group, scattered: this rank's part of it, no collective
    whole = shared_replica(ct, group_name)
    if whole is None and replicated(ct, group_name):
        whole = ct * group_size
    if whole is not None:
        n = x.shape[0]
        return whole.narrow(0, group_rank(group_name) * n, n)
    return _wait(c10d.reduce_scatter_tensor(ct.contiguous(), "sum", group_size, group_name))


@vjp_rule(c10d.reduce_scatter_tensor)
def reduce_scatter_tensor(ct, out, x, reduce_op, group_size, group_name):
    _linear(reduce_op, "reduce_scatter_tensor")
    gathered = _wait(c10d.all_gather_into_tensor(ct.contiguous(), group_size, group_name))
    return gathered / group_size if reduce_op == "avg" else gathered
