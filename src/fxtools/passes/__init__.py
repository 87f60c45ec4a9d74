"""Graph clean-up passes, run by the shared back (``transforms/pipeline.py``) on every result.

- ``simplify``: dead code, common subexpressions, ``x * 1``, no-op views, folded fills, merged scalings;
- ``accumulate``: a gradient added to a scatter into zeros, scattered into directly (a tied weight's two gradients);
- ``views``: chains of reshapes that end where they started, collapsed (batched code);
- ``subgraphs``: the subgraphs of control-flow ops, walked and named with their parent;
- ``inline``: ``call_module`` nodes inlined into one flat graph (for ``fxtools.save``).

The small predicates on nodes every stage asks (``is_float``, ``is_impure``, ``ancestors``) live in
``graph/nodes.py``.
"""
