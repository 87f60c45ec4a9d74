"""A generated module's signature: what it is called with and what it accepts.

- ``naming``: where names come from (argument names and pytree paths, ``params['fc1.weight']`` -> ``fc1_weight``);
- ``sizes``: symbolic sizes from ``dynamic_shapes=`` (torch.export's ``Dim``) and their names in the code;
- ``guards``: what a generated module accepts, checked when it is called (``gm.guards``);
- ``closures``: what the program read outside its arguments, checked (values) or read again (tensors) at each call.
"""
