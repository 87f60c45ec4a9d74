"""Draws docs/split_mlp.svg: ``fxtools.split`` of a small MLP under the recompute_cheap policy.

Run from the repository root: ``.venv/bin/python docs/split_mlp.py`` (needs pydot and Graphviz).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxtools


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x, y):
        h = F.gelu(self.norm(self.fc1(x)))
        return F.cross_entropy(self.fc2(h), y)


if __name__ == "__main__":
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    s = fxtools.split(MLP(), x, y, policy="recompute_cheap")
    print(s.report())
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "split_mlp.svg")
    fxtools.draw(s, path, title='fxtools.split(MLP(), x, y, policy="recompute_cheap")')
    print("wrote", path)
