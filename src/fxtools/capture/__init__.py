"""Capture: a user's program as one flat, functional graph of ATen ops, ready to differentiate.

- ``trace``: ``capture``: ``make_fx(pre_dispatch=True)`` on FakeTensors, argument pytrees, user stack traces;
- ``functionalize``: in-place ops on intermediates rewritten into functional ops;
- ``replacements``: torch functions that read tensor values on the host, captured through replacements;
- ``fake_kernels``: FakeTensor kernels PyTorch lacks, supplied while tracing;
- ``custom``: ``custom_vjp`` and ``torch.autograd.Function`` calls kept as one node with their own rule;
- ``nested``: ``torch.func`` transforms nested in differentiated code are refused;
- ``checkpoint``: ``torch.utils.checkpoint`` regions marked on the nodes they run;
- ``decompose``: ops without a rule replaced by PyTorch's decompositions; ``derived``: failing that, the
  rule traced from PyTorch's own derivative formula;
- ``closures``, ``layout_reads``, ``names``: what the program reads outside its arguments, the layouts it
  reads, and the user's names for values;
- ``oplog``: ``fxtools.log``, every ATen op a program runs, printed with shapes.
"""
