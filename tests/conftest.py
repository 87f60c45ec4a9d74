import os
import shutil
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Graphviz is optional for users (the scripts never install it system-wide); CI installs it, so
# there a missing dot program fails the drawing tests instead of skipping them.
needs_graphviz = pytest.mark.skipif(
    shutil.which("dot") is None and os.environ.get("CI") != "true",
    reason="Graphviz's dot program is not installed (optional: apt-get install graphviz)",
)


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype (the oracle's precision)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# A model file fxtools has never seen (the CLI and --svg tests load it by path).
MODEL = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.norm = nn.LayerNorm(16)
            self.fc2 = nn.Linear(16, 3)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

        def forward(self, x):
            h = F.gelu(self.norm(self.fc1(x))) * self.scale
            return self.fc2(h).logsumexp(-1).mean()


    def embed(table, idx, n):
        return (table[idx].tanh() * n).sum()
""")


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    return tmp_path
