"""FakeTensors made from meta tensors as ``FakeTensor(mode, meta, device)`` makes them, at a sixth of the cost.

fxtools makes FakeTensors of known metadata itself where tracing would make the same ones (a replayed
rule call's values, a re-trace's examples): a meta tensor wrapped as FakeTensorMode's own fast paths
(``fast_detach``) wrap one. ``FakeTensor.__new__`` spends most of its 30-35 us checking its
arguments, normalizing the device and setting fifteen empty memo slots through their descriptors;
what it leaves in the new tensor's ``__dict__`` depends only on the mode and the device. ``Wrapper``
makes one FakeTensor through the constructor itself, keeps the state it left, and gives later
tensors of the same mode and device that state (``Tensor._make_subclass`` as the constructor calls
it, the mutable-data-pointer flag as it sets it, then the same ``__dict__``): 5-6 us each. Where that
state holds anything but the mode, the device and ``None`` (a PyTorch whose constructor records more,
``FakeTensorConfig.debug``'s traceback), the constructor is called every time.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, in_kernel_invocation_manager


class Wrapper:
    """``wrap(meta)`` is ``FakeTensor(mode, meta, device)`` (``meta`` a tensor on the meta device)."""

    __slots__ = ("device", "mode", "state")

    def __init__(self, mode, device):
        self.mode, self.device = mode, device
        self.state: dict | None = None  # the constructor's state, once one tensor has been made

    def wrap(self, meta: torch.Tensor) -> FakeTensor:
        state = self.state
        if not state or FakeTensorConfig.debug or meta.device.type != "meta" or _tracks_leaks():
            fake = FakeTensor(self.mode, meta, self.device)
            if state is None and not FakeTensorConfig.debug:
                self.state = _plain_state(fake, self.mode)
            return fake
        fake = torch.Tensor._make_subclass(
            FakeTensor, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=state["_fake_device"]
        )
        if not self.mode._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(fake)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(fake)
        fake.__dict__.update(state)
        return fake


_NO_STATE: dict = {}
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mode -> {device: Wrapper}


def wrapper(mode, device) -> Wrapper:
    """The ``Wrapper`` of FakeTensors of ``mode`` on ``device`` (one per mode and device, so that
    the constructor runs once for each)."""
    by_device = _WRAPPERS.get(mode)
    if by_device is None:
        by_device = _WRAPPERS[mode] = {}
    w = by_device.get(device)
    if w is None:
        w = by_device[device] = Wrapper(mode, device)
    return w


def _plain_state(fake: FakeTensor, mode) -> dict:
    """``fake.__dict__`` if it holds only the mode, the device and ``None``: a state every FakeTensor
    of this mode and device made by the constructor has. Otherwise an empty dict: ``Wrapper`` then
    calls the constructor every time."""
    state = dict(fake.__dict__)
    device = state.get("_fake_device")
    if not isinstance(device, torch.device) or state.get("fake_mode") is not mode:
        return _NO_STATE
    if any(v is not None for k, v in state.items() if k not in ("_fake_device", "fake_mode")):
        return _NO_STATE
    return state


def _tracks_leaks() -> bool:
    """Whether ``FakeTensor.__init__`` records each new tensor (non-strict ``torch.export``'s leak check)."""
    return torch.compiler.is_exporting() and torch._export.config.detect_non_strict_fake_tensor_leaks


def from_cache_entry(mode, entry, func, args) -> FakeTensor | None:
    """The FakeTensor ``mode._get_output_tensor_from_cache_entry(state, entry, key, func, args)`` makes
    for a cache hit, or None where that method must make it itself.

    FakeTensorMode answers most of a trace's ops from its cache: it makes the output from the cached
    metadata, an ``empty_strided`` on the meta device (``set_`` onto the input's storage for a view op)
    under its kernel invocation and the shape environment's guard suppression, wrapped by the
    constructor. With every size, stride and offset an int (no symbol, so no guard to suppress) and a
    plain strided layout, this makes the same tensor with ``Wrapper`` and without the Python dispatcher
    (the meta kernels of ``empty_strided`` and ``set_`` in C++, as ``fast_detach`` runs ``detach``):
    80-100 us a hit rather than 250-350 in a traced GPT-2 (about 700 hits a ``fxtools.split``).
    In-place ops, constants, outputs of symbolic sizes and views of storages of symbolic size
    return None."""
    metadata = entry.metadata
    if entry.inplace_idx is not None or metadata is None or metadata.layout is not torch.strided:
        return None
    shape, stride, offset = metadata.shape, metadata.stride, metadata.storage_offset
    if (
        type(offset) is not int
        or not all(type(s) is int for s in shape)
        or not all(type(s) is int for s in stride)
        or not (metadata.storage_bytes is None or type(metadata.storage_bytes) is int)
    ):
        return None
    storage = None
    if isinstance(func, torch._ops.OpOverload) and func.is_view:
        if entry.view_idx is None:
            return None
        base = args[entry.view_idx]
        if type(base) is not FakeTensor:
            return None
        storage = base.untyped_storage()
        if type(storage.nbytes()) is not int:
            return None
    shape, stride = tuple(shape), tuple(stride)
    with no_python_dispatcher(), in_kernel_invocation_manager(mode):
        empty = torch.empty_strided(
            shape, stride, dtype=metadata.dtype, layout=metadata.layout, device="meta", requires_grad=metadata.requires_grad
        )
        if metadata.is_conj:
            torch._C._set_conj(empty, True)
        if metadata.is_neg:
            torch._C._set_neg(empty, True)
        if storage is not None:
            empty.set_(storage, offset, shape, stride)
    return wrapper(mode, metadata.device).wrap(empty)


_UNSEEN = object()


def cache_key_parts(extract, flatten_into, prep_args):
    """Faster stand-ins for FakeTensorMode's ``extract_tensor_metadata`` and ``TensorMetadata._flatten_into``
    (given as ``extract`` and ``flatten_into``, with ``prep_args``: ``FakeTensorMode._prep_args_for_hash``),
    which every fake dispatch calls on each tensor argument to make its cache key (about 0.1 ms an argument).

    For a plain strided FakeTensor of static sizes the metadata is read as ``extract`` reads it, except the
    memory format: a function of the sizes and strides alone (``suggest_memory_format`` then
    ``is_contiguous``), asked once per distinct sizes and strides. The flattening appends what ``flatten_into``
    appends, reading the fields from a list rather than ``dataclasses.fields`` and writing a tuple of ints
    (sizes, strides) as ``prep_args`` would (its type, its length, then each int's type and value).
    Anything else (symbolic sizes, other layouts and subclasses, a mode with its own ``prep_args``) is
    left to the originals. Returns ``(extract, flatten_into)``; the memo lives as long as they do."""
    from torch._subclasses.fake_tensor import TensorMetadata

    formats: dict = {}
    names = [f.name for f in dataclasses.fields(TensorMetadata)]

    def extract_fast(t):
        if type(t) is not FakeTensor or t.layout is not torch.strided or t._has_symbolic_sizes_strides:
            return extract(t)
        shape, stride = t.shape, t.stride()
        memory_format = formats.get((shape, stride), _UNSEEN)
        if memory_format is _UNSEEN:
            memory_format = formats[(shape, stride)] = extract(t).memory_format
        return TensorMetadata(
            t.dtype,
            shape,
            stride,
            t.device,
            torch.strided,
            memory_format,
            t.storage_offset(),
            t.untyped_storage().nbytes(),
            t.requires_grad,
            t.is_quantized,
            t.is_conj(),
            t.is_neg(),
            t.is_inference(),
            False,
            None,
            None,
            None,
        )

    def flatten_fast(self, result, mode, state):
        if type(mode)._prep_args_for_hash is not prep_args:
            return flatten_into(self, result, mode, state)
        for name in names:
            value = getattr(self, name)
            if isinstance(value, (tuple, list)):  # torch.Size too
                if all(type(v) is int for v in value):
                    result.append(type(value))
                    result.append(f"length_{len(value)}")
                    for v in value:
                        result.append(int)
                        result.append(v)
                else:
                    prep_args(mode, result, value, state, [])
            elif isinstance(value, torch.SymInt):
                state.convert_sym_int(result, value)
            else:
                result.append(value)
        return None

    return extract_fast, flatten_fast


def detached(t: FakeTensor) -> FakeTensor:
    """``fast_detach(t.fake_mode, t)``: make_fx's snapshot of a traced value (``node.meta["val"]``),
    its ``aten.detach`` run in the mode's kernel invocation and wrapped by ``wrapper``."""
    mode, device = t.fake_mode, t.device
    with no_python_dispatcher(), in_kernel_invocation_manager(mode):
        out = torch.ops.aten.detach.default(t)
    return wrapper(mode, device).wrap(out)
