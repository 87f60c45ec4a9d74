"""Code generation: from an ATen graph to a GraphModule whose ``.code`` reads like hand-written PyTorch.

- ``naming``: where names come from (argument names and pytree paths, ``params['fc1.weight']`` -> ``fc1_weight``);
- ``render``: ATen ops printed with public names (``a @ b``, ``torch.nn.functional.linear``);
- ``assemble``: pytree arguments in, nested results out;
- ``guards``: what a generated module accepts, checked when it is called (``gm.guards``);
- ``sizes``: symbolic sizes from ``dynamic_shapes=`` (torch.export's ``Dim``) and their names in the code;
- ``show``: ``fxtools.show``, the code with shapes; ``export``: ``fxtools.save``, a standalone module;
- ``draw``: ``fxtools.draw``, the forward and backward graphs as a picture.
"""
