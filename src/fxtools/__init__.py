"""fxtools: readable source-to-source derivatives of PyTorch programs.

Every transform takes a function (or ``nn.Module``) and example arguments and returns a
``torch.fx.GraphModule`` whose ``.code`` is plain PyTorch::

    gm = fxtools.vjp(f, x)          # out, (grad_x,) = gm(x, grad_out)
    gm = fxtools.grad(loss, params, batch)
    print(gm.code)
"""
from .api import grad, value_and_grad, vjp
from .errors import DataDependentError, FxtoolsError, MissingRuleError
from .registry import mark_nondifferentiable, register_vjp

__all__ = [
    "vjp", "grad", "value_and_grad", "register_vjp", "mark_nondifferentiable",
    "FxtoolsError", "MissingRuleError", "DataDependentError",
]
