"""fxtools: readable source-to-source derivatives of PyTorch programs.

Every transform takes a function (or ``nn.Module``) and example arguments and returns a
``torch.fx.GraphModule`` whose ``.code`` is plain PyTorch::

    gm = fxtools.vjp(f, x)          # out, (grad_x,) = gm(x, grad_out)
    gm = fxtools.grad(loss, params, batch)
    fxtools.show(gm)                # the code, with shapes

``import fxtools`` loads only this module: the package (capture, rules, transforms, training) is
imported on first use of any of its names, so that a program or a test collection importing
fxtools does not wait for sympy and torch's decompositions until it makes a module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import registry
from .errors import DataDependentError, FxtoolsError, MissingRuleError, NonFiniteError
from .functional import functional  # before any import of the module fxtools.functional, which would shadow it
from .registry import mark_nondifferentiable, register_vjp, rule_set

if TYPE_CHECKING:
    from .capture.custom import CustomFunctionError, custom_jvp, custom_vjp
    from .capture.oplog import log
    from .codegen.draw import draw
    from .codegen.export import save
    from .codegen.show import show
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
    from .transforms.taylor import bilaplacian, divergence, jet, laplacian
    from .transforms.vjp import grad, value_and_grad, vjp

# Where each public name lives, in the order the package was imported eagerly (rules are
# registered by the transforms' pipeline, before any user rule can replace one).
_LAZY = {
    "CustomFunctionError": ".capture.custom",
    "custom_jvp": ".capture.custom",
    "custom_vjp": ".capture.custom",
    "log": ".capture.oplog",
    "draw": ".codegen.draw",
    "save": ".codegen.export",
    "show": ".codegen.show",
    "InputMismatch": ".signature.guards",
    "SymbolicSizeError": ".signature.sizes",
    "policies": ".training.policies",  # the module itself
    "AtenSplit": ".training.aten",
    "Descriptor": ".training.aten",
    "to_aten": ".training.aten",
    "backend": ".training.backend",
    "compile": ".training.backend",
    "find_nonfinite": ".training.nonfinite",
    "Split": ".training.partition",
    "split": ".training.partition",
    "vmap": ".transforms.batching",
    "VjpMismatch": ".transforms.check",
    "check_vjp": ".transforms.check",
    "check_vjp_fd": ".transforms.check",
    "jvp": ".transforms.forward",
    "hessian": ".transforms.higher",
    "hvp": ".transforms.higher",
    "jacfwd": ".transforms.jacobians",
    "jacrev": ".transforms.jacobians",
    "linearize": ".transforms.jacobians",
    "jet": ".transforms.taylor",
    "laplacian": ".transforms.taylor",
    "divergence": ".transforms.taylor",
    "bilaplacian": ".transforms.taylor",
    "grad": ".transforms.vjp",
    "value_and_grad": ".transforms.vjp",
    "vjp": ".transforms.vjp",
}


_LOADING: list[str] = []
_SUBPACKAGES = {"capture", "cli", "codegen", "graph", "passes", "rules", "signature", "training", "transforms"}


def __getattr__(name: str) -> Any:
    """A public name, its package imported on first use (PEP 562); a subpackage
    (``fxtools.codegen.flat()``, ``from .. import rules``) just imported."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _LAZY or _LOADING:
        raise AttributeError(f"module 'fxtools' has no attribute {name!r}")
    _LOADING.append(name)
    try:
        for attr, module in _LAZY.items():
            value = importlib.import_module(module, __name__)
            globals()[attr] = getattr(value, attr) if hasattr(value, attr) else value  # policies: the module
    finally:
        _LOADING.clear()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})


registry.load_builtin_rules_with(lambda: importlib.import_module(".rules", __name__))

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
    "divergence",
    "bilaplacian",
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
