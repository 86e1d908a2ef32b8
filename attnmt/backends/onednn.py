"""oneDNN linear layers for the CPU in bf16: the bias and the ReLU inside the matrix product, weights prepacked.

Only used where the CPU runs bf16 natively (``capabilities.cpu().fused_linear``): without AMX or AVX-512 BF16,
oneDNN cannot create these primitives at all. Both modules keep the model's linear contract,
``forward(x, relu=False)`` (``attnmt/models/linear.py``), and the original ``weight`` and ``bias`` parameters, so
a swapped model saves and loads the same state dict and the optimizer keeps its parameters.

``nn.Linear`` on the CPU runs ``addmm``: it first copies the bias into every row of the output, then accumulates
the product onto it (one more write and read of the whole output), and a following ReLU is another pass.
oneDNN's inner product adds the bias and applies the ReLU while each output tile is still in registers; PyTorch
exposes it as ``torch.ops.mkldnn._linear_pointwise`` (the kernel its compiler emits for CPU linear layers). On a
(4032 x 512) x (512 x 2048) bf16 product that was 6.6 ms instead of 9.8 ms for linear + relu (AMX); a training
step of the base Transformer got 8% faster. The outputs are bitwise those of ``nn.Linear`` under autocast. The
backward pass is autograd's (the ReLU mask from the saved output, then the input, weight and bias gradients),
except that the weight gradient's product is laid out the way oneDNN runs fastest (:func:`_weight_grad`), which
can change its rounding but not its value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _LinearPointwise(torch.autograd.Function):
    """``act(x W^T + b)`` with ``act`` "none" or "relu", in ``dtype``; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool, dtype: torch.dtype) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        y = torch.ops.mkldnn._linear_pointwise(x2, w, b, "relu" if relu else "none", [], "")
        ctx.save_for_backward(x2, w, y if relu else None)
        ctx.meta = (shape, x.dtype, weight.dtype, None if bias is None else bias.dtype, relu)
        return y.view(*shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2, w, y = ctx.saved_tensors
        shape, x_dtype, w_dtype, b_dtype, relu = ctx.meta
        g = grad.reshape(-1, w.size(0)).to(w.dtype)
        if relu:
            g = torch.ops.aten.threshold_backward(g, y, 0)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, w).view(shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(g, x2).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


def _weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """``g^T x`` for g (M, N) and x (M, K): oneDNN runs this fastest with the narrower operand transposed into a
    contiguous copy first (measured on M ~ 3700 rows: 25% faster for N = 4K, 30% for K = 4N; N = K as is)."""
    n, k = g.size(1), x.size(1)
    if n > k:
        return torch.mm(x.t().contiguous(), g).t()
    if k > n:
        return torch.mm(g.t().contiguous(), x)
    return torch.mm(g.t(), x)


class Bf16TrainingLinear(nn.Module):
    """A linear layer trained in bf16 with fp32 master weights: the product, bias and ReLU in one oneDNN call.

    Computes what ``nn.Linear`` computes under CPU bf16 autocast (bitwise, forward), whether or not autocast is
    on: the backend swaps it in only for bf16 training, where every forward runs under autocast anyway.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            return _LinearPointwise.apply(x, self.weight, self.bias, relu, torch.bfloat16)


class PackedLinear(nn.Module):
    """A linear layer for bf16 inference with its weight reordered once into oneDNN's blocked layout.

    ``nn.Linear`` repacks its weight for every product; a decoding step is dozens of small products (a few
    hundred rows), for which that packing is a large share: with the weight packed once, oneDNN's inner product
    was 10-45% faster on the decoder's shapes (AMX), with bitwise the same results. ``weight`` and ``bias`` stay as
    they were (bf16). ``relu=True`` applies the ReLU inside the product (the feed-forward's first layer).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        if x.dtype != self.packed.dtype:  # e.g. fp32 features given to a bf16 model's output layer
            y = F.linear(x, self.weight, self.bias)
            return F.relu(y) if relu else y
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "relu" if relu else "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)
