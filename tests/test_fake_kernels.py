"""fxtools' fake kernels: used while fxtools traces, absent afterwards, as strict as the CPU kernel."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxtools
from fxtools.capture.fake_kernels import tracing_kernels

OFFS = torch.tensor([3, 3, 8], dtype=torch.int32)


def grouped(a, b, offs=None):
    return torch._grouped_mm(a, b, offs=offs)


@pytest.mark.parametrize(
    "a,b,offs",
    [
        (torch.randn(8, 8), torch.randn(3, 8, 8), OFFS),
        (torch.randn(4, 8), torch.randn(8, 8), OFFS),
        (torch.randn(3, 4, 8), torch.randn(8, 8), OFFS),
        (torch.randn(3, 4, 8), torch.randn(3, 8, 8), None),
    ],
)  # 16-byte aligned rows in every dtype, as the kernel requires
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_traced_shapes_and_dtypes_are_the_kernels(a, b, offs, dtype):
    a, b = a.to(dtype), b.to(dtype)
    gm = fxtools.vjp(grouped, a, b, offs)
    out, _ = gm(a, b, offs, torch.ones(grouped(a, b, offs).shape, dtype=dtype))
    want = grouped(a, b, offs)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert torch.equal(out, want)


def test_pytorch_fake_mode_is_untouched_outside_fxtools():
    """Inside the block float32 works; after it PyTorch's own meta kernel (bfloat16 only) applies,
    also for an identical call its fake-dispatch cache would otherwise answer."""
    mode = FakeTensorMode()
    a, b, offs = (mode.from_tensor(t) for t in (torch.randn(8, 8), torch.randn(3, 8, 4), OFFS))
    with tracing_kernels(), mode:
        assert grouped(a, b, offs).shape == (8, 4)
    with mode, pytest.raises(RuntimeError, match="BF16"):
        grouped(a, b, offs)
    fxtools.vjp(grouped, torch.randn(8, 8), torch.randn(3, 8, 4), OFFS)
    with mode, pytest.raises(RuntimeError, match="BF16"):
        grouped(a, b, offs)


@pytest.mark.parametrize(
    "a,b,offs,error",
    [
        (torch.randn(8, 8, dtype=torch.float64), torch.randn(3, 8, 4, dtype=torch.float64), OFFS, "Float32, BFloat16"),
        (torch.randn(8, 6), torch.randn(3, 6, 4), OFFS, "16 bytes"),
        (torch.randn(8, 8), torch.randn(2, 8, 4), OFFS, "batch sizes"),
        (torch.randn(8, 8), torch.randn(3, 8, 4), OFFS.long(), "int32"),
        (torch.randn(8, 8), torch.randn(3, 8, 4), None, "offsets"),
    ],
)
def test_arguments_the_cpu_kernel_refuses_fail_while_tracing(a, b, offs, error):
    with pytest.raises(RuntimeError):
        grouped(a, b, offs)
    with pytest.raises(RuntimeError, match=error):
        fxtools.vjp(grouped, a, b, offs)
