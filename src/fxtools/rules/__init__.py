"""fxtools' own VJP rules, one module per op family.

Importing this package registers every rule. To find the backward of an op, look in the
family it belongs to: ``pointwise`` (elementwise math), ``reductions`` (sum, mean, amax, var,
norm, logsumexp, ...), ``shape`` (views, reshapes, indexing, cat/stack/split), ``linalg``
(mm, bmm, matmul, addmm, einsum, ...) and ``nn`` (softmax, layer_norm, conv, pooling, attention,
losses, ...).
"""
from . import linalg, nn, pointwise, reductions, shape  # noqa: F401
