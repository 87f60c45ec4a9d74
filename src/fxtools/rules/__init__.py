"""fxtools' VJP rules: the derivative of every op, one module per op family.

Importing this package registers every rule (the table is ``fxtools.registry``). To find the
backward of an op, look in the family it belongs to: ``pointwise`` (elementwise math),
``reductions`` (sum, mean, amax, var, norm, logsumexp, ...), ``shape`` (views, reshapes, indexing,
cat/stack/split), ``linalg`` (mm, bmm, matmul, addmm, einsum, ...) and ``nn`` (softmax,
layer_norm, conv, pooling, attention, losses, ...).

``fused`` is not a family but the ``"fused"`` rule set: alternative rules for some of those ops
whose backwards call PyTorch's fused backward kernels (see ``fxtools.rule_set``).

An op with no rule here is covered by ``capture/decompose.py`` (PyTorch's decomposition into ops
that have rules) or, failing that, ``capture/derived.py`` (PyTorch's own derivative formula, traced
into code).
"""

from . import collectives, linalg, nn, pointwise, reductions, shape  # noqa: F401

# isort: split
from . import fused  # noqa: F401,E402  (after the families: its rules fall back on theirs)
