"""Code generation: from an ATen graph to a GraphModule whose ``.code`` reads like hand-written PyTorch.

- ``render``: ATen ops printed with public names (``a @ b``, ``torch.nn.functional.linear``);
- ``assemble``: pytree arguments in, nested results out;
- ``pycode``: the printed lines (PEP 8 keywords, one statement per multi-output op, frees);
- ``fold``: single-use cheap values printed inside their user's expression; ``flat()`` and
  ``flat_code(gm)`` for the one-op-per-line form;
- ``show``: ``fxtools.show``, the code with shapes; ``export``: ``fxtools.save``, a standalone module;
- ``draw``: ``fxtools.draw``, the forward and backward graphs as a picture.

The module's signature (names, symbolic sizes, guards) is ``fxtools.signature``.
"""

from .fold import flat, flat_code

__all__ = ["flat", "flat_code"]
