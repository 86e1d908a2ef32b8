"""The model's linear layer, the first place a backend may tune (``models/tuning.py`` lists the three).

:class:`Linear` is ``nn.Linear`` whose forward can also apply the ReLU that follows it, ``forward(x, relu=False)``.
Every linear layer of the Transformer keeps this contract; the model is written with this plain version, and a
backend may swap it, once, for a module with the same contract that runs faster on its hardware (oneDNN's fused
bias + ReLU for bf16 training on the CPU, weights prepacked for bf16 inference, int8 weights).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Linear(nn.Linear):
    """``y = x W^T + b``, then ``max(0, y)`` when ``relu``."""

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return F.relu(y) if relu else y
