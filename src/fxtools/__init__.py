"""fxtools: readable source-to-source derivatives of PyTorch programs.

Every transform takes a function (or ``nn.Module``) and example arguments and returns a
``torch.fx.GraphModule`` whose ``.code`` is plain PyTorch::

    gm = fxtools.vjp(f, x)          # out, (grad_x,) = gm(x, grad_out)
    gm = fxtools.grad(loss, params, batch)
    fxtools.show(gm)                # the code, with shapes
"""

from .capture.custom import CustomFunctionError, custom_jvp, custom_vjp
from .capture.oplog import log
from .codegen.draw import draw
from .codegen.export import save
from .codegen.show import show
from .errors import DataDependentError, FxtoolsError, MissingRuleError, NonFiniteError
from .functional import functional
from .registry import mark_nondifferentiable, register_vjp, rule_set
from .signature.guards import InputMismatch
from .signature.sizes import SymbolicSizeError
from .training import policies  # noqa: F401 - fxtools.policies, as documented
from .training.aten import AtenSplit, Descriptor, to_aten
from .training.backend import backend, compile  # noqa: A004 - fxtools.compile, like torch.compile
from .training.nonfinite import find_nonfinite
from .training.partition import Split, split
from .transforms.batching import vmap
from .transforms.check import VjpMismatch, check_vjp, check_vjp_fd
from .transforms.forward import jvp
from .transforms.higher import hessian, hvp
from .transforms.jacobians import jacfwd, jacrev, linearize
from .transforms.taylor import jet, laplacian
from .transforms.vjp import grad, value_and_grad, vjp

__all__ = [
    "vjp",
    "grad",
    "value_and_grad",
    "functional",
    "jvp",
    "hvp",
    "hessian",
    "jet",
    "laplacian",
    "vmap",
    "jacrev",
    "jacfwd",
    "linearize",
    "log",
    "show",
    "save",
    "draw",
    "check_vjp",
    "check_vjp_fd",
    "register_vjp",
    "mark_nondifferentiable",
    "rule_set",
    "custom_vjp",
    "custom_jvp",
    "split",
    "Split",
    "compile",
    "backend",
    "to_aten",
    "AtenSplit",
    "Descriptor",
    "FxtoolsError",
    "MissingRuleError",
    "DataDependentError",
    "VjpMismatch",
    "InputMismatch",
    "SymbolicSizeError",
    "CustomFunctionError",
    "find_nonfinite",
    "NonFiniteError",
]
