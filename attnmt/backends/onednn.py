"""oneDNN linear layers for the CPU in bf16: the bias and the ReLU inside the matrix product, weights prepacked.

Used for bf16 where the CPU runs it natively (``capabilities.cpu().fused_linear``: without AMX or AVX-512 BF16,
oneDNN cannot create the bf16 primitives at all), and for fp32 where oneDNN's kernels outrun MKL's
(``capabilities.cpu().onednn_fp32``: CPUs not made by Intel, where MKL keeps to AVX2). Both modules keep the model's linear contract,
``forward(x, relu=False)`` (``attnmt/models/linear.py``), and the original ``weight`` and ``bias`` parameters, so
a swapped model saves and loads the same state dict and the optimizer keeps its parameters.

``nn.Linear`` on the CPU runs ``addmm``: it first copies the bias into every row of the output, then accumulates
the product onto it (one more write and read of the whole output), and a following ReLU is another pass.
oneDNN's inner product adds the bias and applies the ReLU while each output tile is still in registers; PyTorch
exposes it as ``torch.ops.mkldnn._linear_pointwise`` (the kernel its compiler emits for CPU linear layers), and
it is the faster of the two on the model's shapes (benchmarks/kernel_choices.py; figures per CPU in docs/results.md). The outputs are bitwise those of ``nn.Linear`` under autocast. The
backward pass is autograd's (the ReLU mask from the saved output, then the input, weight and bias gradients),
except that the weight gradient's product is laid out the way oneDNN runs fastest (:func:`_weight_grad`), which
can change its rounding but not its value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b^T`` through oneDNN's inner product (both operands made contiguous)."""
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), None, "none", [], "")


class _LinearPointwise(torch.autograd.Function):
    """``act(x W^T + b)`` with ``act`` "none" or "relu", in ``dtype``; gradients in the inputs' dtypes.

    ``onednn_backward``: the two backward products through oneDNN as well (fp32 on CPUs where oneDNN outruns
    MKL; in bf16, ``torch.mm`` already runs oneDNN); ``onednn_weight_grad``: the weight gradient too, which needs
    transposed copies of both operands and pays off only with AVX-512."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool, dtype: torch.dtype,
                onednn_backward: bool = False, onednn_weight_grad: bool = False) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        y = torch.ops.mkldnn._linear_pointwise(x2, w, b, "relu" if relu else "none", [], "")
        ctx.save_for_backward(x2, w, y if relu else None)
        ctx.meta = (shape, x.dtype, weight.dtype, None if bias is None else bias.dtype, relu, onednn_backward,
                    onednn_weight_grad)
        return y.view(*shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2, w, y = ctx.saved_tensors
        shape, x_dtype, w_dtype, b_dtype, relu, onednn_backward, onednn_weight_grad = ctx.meta
        g = grad.reshape(-1, w.size(0)).to(w.dtype)
        if relu:
            g = torch.ops.aten.threshold_backward(g, y, 0)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gx = _product(g, w.t()) if onednn_backward else torch.mm(g, w)
            grad_x = gx.view(shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            if onednn_weight_grad:
                gw = _product(g.t(), x2.t())
            elif w.dtype == torch.bfloat16:
                gw = _weight_grad(g, x2)
            else:  # fp32 in MKL, which takes the transposed operand as it is (no copy)
                gw = torch.mm(g.t(), x2)
            grad_w = gw.to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def _weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """``g^T x`` for g (M, N) and x (M, K): oneDNN runs this fastest with the narrower operand transposed into a
    contiguous copy first when one side is much larger than the other (N = 4K or K = 4N; N = K as is)."""
    n, k = g.size(1), x.size(1)
    if n > k:
        return torch.mm(x.t().contiguous(), g).t()
    if k > n:
        return torch.mm(g.t().contiguous(), x)
    return torch.mm(g.t(), x)


class TrainingLinear(nn.Module):
    """A linear layer trained through oneDNN: the product, bias and ReLU in one call, in ``dtype``.

    bf16 (fp32 master weights): computes what ``nn.Linear`` computes under CPU bf16 autocast (bitwise, forward),
    whether or not autocast is on: the backend swaps it in only for bf16 training, where every forward runs under
    autocast anyway. fp32: what ``nn.Linear`` computes, up to the summation order of oneDNN's kernels;
    ``onednn_backward``/``onednn_weight_grad`` as in :class:`_LinearPointwise`.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16, onednn_backward: bool = False,
                 onednn_weight_grad: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.dtype, self.onednn_backward, self.onednn_weight_grad = dtype, onednn_backward, onednn_weight_grad

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            return _LinearPointwise.apply(x, self.weight, self.bias, relu, self.dtype, self.onednn_backward,
                                          self.onednn_weight_grad)


class PackedLinear(nn.Module):
    """A linear layer for inference with its weight reordered once into oneDNN's blocked layout (bf16; fp32 where
    oneDNN outruns MKL).

    ``nn.Linear`` repacks its weight for every product; a decoding step is dozens of small products (a few
    hundred rows), for which that packing is a large share: packed once, with bitwise the same results
    (benchmarks/kernel_choices.py; figures per CPU in docs/results.md). ``weight`` and ``bias`` stay as
    they were. ``relu=True`` applies the ReLU inside the product (the feed-forward's first layer).
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
