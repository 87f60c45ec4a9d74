"""VJP rules of neural-network ops: softmax, normalisation, attention, convolution, pooling, losses."""
from __future__ import annotations

import torch

from ..registry import vjp_rule  # noqa: F401

aten = torch.ops.aten
