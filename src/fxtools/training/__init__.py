"""Training: cut the joint forward+backward graph in two and plug it into ``torch.compile``.

- ``partition``: the partitioner, ``fxtools.split`` (forward and backward graphs, what is saved);
- ``policies``: what the forward saves and what the backward recomputes (``policy=``);
- ``backend``: ``fxtools.compile`` and the ``torch.compile`` backend, a cache of splits per input signature.
"""
