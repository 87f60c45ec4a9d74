"""Every public transform goes through the shared front and back (``transforms/pipeline.py``).

Each public transform of ``fxtools.__all__`` that builds GraphModules is called once on a tiny
function; every module it returns must carry the back's stamp (``meta.BUILT_BY``) naming the
transform that finished it and a front that prepared its program, and the transform must be in
the registry of pipeline users (``pipeline.USERS``) with its contract stated.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import fxtools
from fxtools.transforms import pipeline
from fxtools.transforms.calling import TRANSFORMS


def f(x, w):
    return (torch.sin(x * w) * x).sum()


def g(x):
    return torch.tanh(x) * x


fxtools.grad  # noqa: B018 - `import fxtools` is lazy: the first public name loads the transforms, which register here

X, W = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

# name -> (call, the made_by of the front that prepared its program)
CALLS = {
    "vjp": (lambda: fxtools.vjp(g, X), "fxtools.vjp"),
    "grad": (lambda: fxtools.grad(f, X, W), "fxtools.grad"),
    "value_and_grad": (lambda: fxtools.value_and_grad(f, X, W), "fxtools.value_and_grad"),
    "jvp": (lambda: fxtools.jvp(g, X), "fxtools.jvp"),
    "hvp": (lambda: fxtools.hvp(f, X, W), "fxtools.hvp"),
    "hessian": (lambda: fxtools.hessian(f, X, W), "fxtools.hessian"),
    "jacrev": (lambda: fxtools.jacrev(g, X), "fxtools.jacrev"),
    "jacfwd": (lambda: fxtools.jacfwd(g, X), "fxtools.jacfwd"),
    "linearize": (lambda: fxtools.linearize(g, X)[1], "fxtools.jvp"),
    "vmap": (lambda: fxtools.vmap(g, X.reshape(3, 1)), "fxtools.vmap"),
    "jet": (lambda: fxtools.jet(g, X, order=2), "fxtools.jet"),
    "laplacian": (lambda: fxtools.laplacian(f, X, W), "fxtools.laplacian"),
    "divergence": (lambda: fxtools.divergence(g, X), "fxtools.divergence"),
    "bilaplacian": (lambda: fxtools.bilaplacian(f, X, W), "fxtools.bilaplacian"),
    "split": (lambda: fxtools.split(f, X, W), "fxtools.split"),
}


def _modules(result) -> list[fx.GraphModule]:
    if isinstance(result, fxtools.Split):
        return [result.forward, result.backward, result.backward_boxed]
    return [result]


def test_every_public_transform_is_a_pipeline_user():
    """Every public name registered as a transform (``calling.transform``) is in ``pipeline.USERS``
    under its own name, says what its modules return (its docstring), and is called below."""
    public = {name for name in fxtools.__all__ if f"fxtools.{name}" in pipeline.USERS}
    assert public == set(CALLS), sorted(public ^ set(CALLS))
    for name in CALLS:
        assert pipeline.USERS[f"fxtools.{name}"].name == f"fxtools.{name}"
        assert getattr(fxtools, name).__doc__, name


def test_public_transforms_all_registered():
    """Every public transform (``calling.transform`` names them) that builds modules is registered."""
    checks = {"fxtools.check_vjp", "fxtools.check_vjp_fd"}  # compare with torch.autograd; build no module
    missing = sorted(TRANSFORMS - checks - set(pipeline.USERS))
    assert not missing, f"public transforms outside the pipeline registry: {missing}"
    assert {f"fxtools.{name}" for name in CALLS} == TRANSFORMS - checks


def test_every_module_is_built_by_the_shared_front_and_back():
    for name, (call, front) in CALLS.items():
        for gm in _modules(call()):
            built = pipeline.built_by(gm)
            assert built is not None, f"fxtools.{name}: a module the shared back did not finish"
            assert built.back == f"fxtools.{name}", (name, built)
            assert built.front == front, (name, built)
