"""The ``fxtools`` command: ``python -m fxtools`` / ``fxtools demo|grad|vjp|jvp|split|show|ops|bench``.

- ``main``: the entry point and ``fxtools demo``;
- ``commands``: the subcommands that load a model file (``grad``, ``vjp``, ``jvp``, ``split``, ``show``, ``bench``);
- ``examples``: built-in example programs (the demo, the tests and the benchmarks use them);
- ``coverage``: which mechanism differentiates each OpInfo op (``fxtools ops``).
"""
