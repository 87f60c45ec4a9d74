"""Graph clean-up passes, and the small graph predicates every layer shares.

- ``simplify``: dead code, common subexpressions, ``x * 1``, no-op views, folded fills, merged scalings;
- ``inline``: ``call_module`` nodes inlined into one flat graph (for ``fxtools.save``).
"""
