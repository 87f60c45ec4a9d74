"""Module conversions (``.double()``, ``.to(dtype)``, ``.to(device)``, ``.half()``) inside a traced program.

``nn.Module._apply`` converts a module's parameters in place (``param.data = ...`` or
``torch.utils.swap_tensors``). Neither works on a parameter made while fxtools traces (a
FakeTensor the trace holds weak references to): PyTorch fails with "Couldn't swap
Linear.weight". While fxtools captures, ``_apply`` is replaced:

- a tensor the program made (a module built inside it): the parameter takes the converted value
  in place, as in eager mode (``w = m.weight; m.double()`` leaves ``w`` the double parameter),
  the trace's record of it becoming the conversion's node, so gradients flow back through the
  conversion to whatever the parameter was computed from; a buffer is replaced by its converted
  value, as PyTorch does;
- a tensor made outside the program (a closed-over module's parameter or buffer, or an argument
  such as ``fxtools.functional``'s parameters, which eager would convert in place): a conversion
  that leaves it as it is (``m.to(x.device)`` on the device it is on, ``m.double()`` on a double
  module) is skipped, as in eager mode; any other is refused, naming the line, since it would
  change the user's module each time fxtools traces while the generated code would not.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import FxtoolsError, current_user_line

_DATA: Any = torch._C.TensorBase.data  # the descriptor of ``Tensor.data``


def _made_by_program(t: torch.Tensor) -> bool:
    """A tensor the program computed: fake (closed-over tensors stay real while tracing), and not
    an argument (``fxtools.functional``'s parameters are arguments standing in a module)."""
    if not isinstance(t, FakeTensor):
        return False
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    slot = proxy_tensor.get_proxy_slot(t, mode.tracer, None) if mode is not None else None
    return slot is None or slot.proxy.node.op != "placeholder"


def _unchanged_by(fn, t: torch.Tensor) -> bool:
    """Whether ``fn`` returns ``t`` itself (a conversion to what ``t`` already is), run outside the trace."""
    with torch._C.DisableTorchFunction(), _disable_current_modes(), torch.no_grad():
        return fn(t) is t


def _refuse(module: torch.nn.Module, key: str, kind: str) -> None:
    raise FxtoolsError(
        f"{current_user_line()}: converts {type(module).__name__}.{key}, a {kind} made outside the traced program "
        "(.double(), .to(dtype or device), .half(), ...): that would change your module each time fxtools traces, "
        "and the generated code would not do it. Convert the module before calling fxtools (model.double(), "
        "model.to(device)), or build the module inside the program."
    )


def _convert_parameter(module: torch.nn.Module, key: str, param: torch.Tensor, fn) -> None:
    if not _made_by_program(param):
        if _unchanged_by(fn, param) and (param.grad is None or _unchanged_by(fn, param.grad)):
            return
        _refuse(module, key, "parameter")
    with torch.no_grad():
        applied = fn(param)
    if applied is param:
        return
    grad = param.grad
    if not _set_traced_data(param, applied):
        module._parameters[key] = param = torch.nn.Parameter(applied, requires_grad=param.requires_grad)
    if grad is not None:
        with torch.no_grad():
            param.grad = fn(grad)


def _set_traced_data(param: torch.Tensor, applied: torch.Tensor) -> bool:
    """``param.data = applied`` as eager's ``_apply`` does (the program's references to the
    parameter see the converted value), with the trace's record of ``param`` made ``applied``'s;
    False where the trace holds no record of ``applied`` (the caller replaces the parameter)."""
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    slot = proxy_tensor.get_proxy_slot(applied, mode.tracer, None) if mode is not None else None
    if slot is None or not isinstance(applied, FakeTensor) or type(param) not in (torch.nn.Parameter, FakeTensor):
        return False
    with torch._C.DisableTorchFunction():
        _DATA.__set__(param, applied)  # the tensor's own setter: fxtools refuses `.data =` in programs
    param.fake_device = applied.fake_device  # type: ignore[attr-defined]
    mode.tracer.tensor_tracker[param] = slot
    return True


def _apply(module: torch.nn.Module, fn, recurse: bool = True) -> torch.nn.Module:
    """``nn.Module._apply`` for a traced program (module docstring)."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, param in list(module._parameters.items()):
        if param is not None:
            _convert_parameter(module, key, param, fn)
    for key, buf in list(module._buffers.items()):
        if buf is None:
            continue
        if not _made_by_program(buf):
            if _unchanged_by(fn, buf):
                continue
            _refuse(module, key, "buffer")
        module._buffers[key] = fn(buf)
    return module


@contextlib.contextmanager
def module_conversions():
    """Replace ``nn.Module._apply`` while the program is traced (module docstring)."""
    original = torch.nn.Module._apply
    torch.nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]
