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
it is the faster of the two on the model's shapes (benchmarks/kernel_choices.py; figures per CPU in docs/experiments.md). The outputs are bitwise those of ``nn.Linear`` under autocast. The
backward pass is autograd's (the ReLU mask from the saved output, then the input, weight and bias gradients),
except that the weight gradient's product is laid out the way oneDNN runs fastest (:func:`_weight_grad`), which
can change its rounding but not its value.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def product(a: Tensor, b: Tensor) -> Tensor:
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
            gx = product(g, w.t()) if onednn_backward else torch.mm(g, w)
            grad_x = gx.view(shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            if onednn_weight_grad:
                gw = product(g.t(), x2.t())
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
    (benchmarks/kernel_choices.py; figures per CPU in docs/experiments.md). ``weight`` and ``bias`` stay as
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


INT8_MIN_ROWS = 128  # fewer rows: the bf16 product, as quantizing the activations costs more than it saves
_ZERO_POINT_U8 = 128  # activations as unsigned bytes, 0 stored as 128 (the u8 x s8 products VNNI and AMX run)
QUANTIZE_BLOCK = 1 << 20  # elements quantized at a time: a 4 MB float32 copy
# torch 2.x warns (once per process) that quantized tensor types are deprecated in favour of torchao; quantize_u8
# only borrows their quantization kernel for an instant, so the warning would tell the user nothing
warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)


class Int8PackedLinear(nn.Module):
    """A bf16 model's linear layer with int8 weights (one scale per output row) and activations quantized on the
    fly (one scale per product, all 8 bits), through oneDNN's int8 inner product; the result comes out in bf16.

    For CPUs with native bf16 and VNNI or AMX int8 instructions (``CpuCapabilities.onednn_int8``), where an int8
    product runs about twice as fast as a bf16 one: everything but the matrix products (attention over the cache,
    layer norms, the scores) stays in bf16, as CTranslate2's int8 runs next to float32. Quantizing the activations
    is a pass over the input of its own (min/max, then scale and round), which costs more than the int8 product
    saves on fewer than ``INT8_MIN_ROWS`` rows: those run the bf16 packed weight. On more rows every product gains,
    the most where the output is much wider than the input (the output projection to the vocabulary, the
    feed-forward's first layer), the least where it is as wide or narrower (benchmarks/kernel_choices.py;
    docs/experiments.md). ``relu=True`` applies the ReLU
    inside the product.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.bf16 = PackedLinear(linear)
        w = linear.weight.detach().float()
        self.weight_scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,) float32
        q = torch.round(w / self.weight_scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.packed_int8 = torch.ops.onednn.qlinear_prepack(q, None)
        self.weight_zero_point = torch.zeros(self.out_features, dtype=torch.int64)
        self.zero_point = torch.tensor(_ZERO_POINT_U8)
        self.bias_bf16 = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.size(0) < INT8_MIN_ROWS or x.dtype != torch.bfloat16:
            return self.bf16(x, relu)
        qx, scale = quantize_u8(x2)
        y = torch.ops.onednn.qlinear_pointwise.tensor(
            qx, scale, self.zero_point, self.packed_int8, self.weight_scale, self.weight_zero_point, self.bias_bf16,
            1.0, 0, torch.bfloat16, "relu" if relu else "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def quantize_u8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x / scale rounded to the nearest integer, ties to even, + 128 as unsigned bytes, scale) with one scale for
    the whole tensor: its largest magnitude maps to 127 (symmetric, so 0 stays exact).

    ``torch.quantize_per_tensor`` scales, rounds and stores in one vectorized pass, in float32 (bf16 cannot hold
    x / scale + 128 to the unit), where the same arithmetic as tensor operations takes five passes
    (benchmarks/kernel_choices.py). Its bytes are then read as a plain uint8
    tensor, without a copy. Inputs of more than ``QUANTIZE_BLOCK`` elements are converted in blocks of rows, so
    that no float32 copy of a whole encoder batch is allocated: the allocator would map such a block afresh, and
    the kernel zero it, every time.
    """
    lo, hi = torch.aminmax(x)
    scale = max(float(torch.maximum(-lo, hi)), 1e-30) / 127
    x2 = x.reshape(-1, x.size(-1))
    rows = max(1, QUANTIZE_BLOCK // x2.size(1))
    if x2.size(0) <= rows:
        q = _bytes(torch.quantize_per_tensor(x2.float(), scale, _ZERO_POINT_U8, torch.quint8))
    else:
        q = torch.empty(x2.shape, dtype=torch.uint8)
        for a in range(0, x2.size(0), rows):
            q[a:a + rows] = _bytes(torch.quantize_per_tensor(x2[a:a + rows].float(), scale, _ZERO_POINT_U8,
                                                             torch.quint8))
    return q.view(x.shape), torch.tensor(scale)


def quantize_u8_affine(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float32 ``x`` as unsigned bytes over its own range: (bytes, scale, zero point) with ``x ~ scale * (byte -
    zero point)``, where [min(x, 0), max(x, 0)] spans the 256 values (fbgemm's dynamic quantization, which
    :class:`~attnmt.backends.cpu.Int8Linear` matches on its oneDNN path). Against :func:`quantize_u8`'s symmetric
    bytes this doubles the resolution of inputs of one sign, such as the ReLU output entering the feed-forward
    layer's second product. One pass for the range, one to scale, round and store."""
    lo, hi = torch.aminmax(x)
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max(hi - lo, 1e-30) / 255
    zero_point = min(255, max(0, round(-lo / scale)))
    q = _bytes(torch.quantize_per_tensor(x.float(), scale, zero_point, torch.quint8))
    return q, torch.tensor(scale), torch.tensor(zero_point)


def _bytes(q: Tensor) -> Tensor:
    """The unsigned bytes of a quint8 tensor as a uint8 tensor sharing its storage (``int_repr`` would copy them,
    one element at a time)."""
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())
