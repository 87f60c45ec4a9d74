import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype (the oracle's precision)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
