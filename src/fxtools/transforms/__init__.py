"""Differentiation transforms: each takes a function and example arguments, returns a GraphModule.

- ``vjp``: ``vjp``, ``grad``, ``value_and_grad`` and ``prepare`` (capture, functionalize, expand), the
  front every transform shares;
- ``reverse``: reverse mode on a captured graph, running each op's rule (the engine of all transforms);
- ``replay``: a rule call on tensors like an earlier one is replayed instead of traced again;
- ``forward``: ``jvp`` (forward mode, by transposing the VJP);
- ``batching``: ``vmap``;
- ``higher``: ``hvp`` and ``hessian``, compositions of the above;
- ``check``: ``check_vjp`` / ``check_vjp_fd``, a generated VJP against autograd or finite differences.

A new transform goes here, built on ``vjp.prepare`` and ``reverse`` (see docs/architecture.md).
"""
