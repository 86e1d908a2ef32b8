"""Dropout for CPU training: a cheap mask, and dropout fused with the residual addition (paper 5.4).

``torch.nn.Dropout`` on the CPU draws its mask with ``bernoulli_`` (one float per element) and multiplies in
two more passes; in a bf16 training step of the small Transformer that was about an eighth of the time. Here:

* the mask comes from raw random bits: one 64-bit draw gives four 16-bit lanes, and a lane keeps its element
  when its low 15 bits are >= ``round(p * 2**15)``. Integer arithmetic turns that comparison straight into the
  bit pattern of 1.0 or 0.0 in the activation dtype (for fp32, after widening the lanes to 32 bits), so there
  is no bool tensor and no slow bool-to-float conversion. The drop probability is ``p`` rounded to a multiple
  of 2^-15, and kept elements are scaled by the exact ``1 / (1 - p_rounded)``, so the output is unbiased.
  Drawing the random numbers is most of a mask's cost: 16-bit lanes for fp32 too (instead of 32-bit ones)
  halve it (docs/experiments.md);
* ``x + dropout(y)``, the residual connection, is one ``addcmul`` (forward) and one multiply (backward);
* where the backend gives a kernel for the masks (``DropoutKernel.dropout_masks``, a
  :class:`~attnmt.models.kernels.DropoutMasks`: the CPU's compiled one), each element's 15 bits come from a
  hash of a seed and its index, inside the one pass that applies them: forward and backward each read and write
  the activations once, and no mask is stored (the backward pass computes it again from the seed). The drop
  probability and the scale are the same; the seed is one draw from the global generator per call.

The backend chooses these masks (``DropoutKernel.random_bit_dropout``, set by the CPU backend for training);
without that choice, in other dtypes, or with ``p == 0`` these fall back to ``torch.nn.functional.dropout``.
Each call draws fresh random numbers from the global generator, so seeded runs (and resumed runs, which restore
the generator) are reproducible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmt.models.kernels import DropoutMasks
from attnmt.models.tuning import DropoutKernel

# activation dtype -> (integer dtype of the same width, bit pattern of 1.0 in that dtype)
_LANES = {
    torch.bfloat16: (torch.int16, 0x3F80),
    torch.float16: (torch.int16, 0x3C00),
    torch.float32: (torch.int32, 0x3F800000),
}
_VALUE_BITS = 15  # random bits per lane: a 16-bit lane's, less its sign


def _fast(t: Tensor, p: float, random_bits: bool) -> bool:
    if not random_bits or t.dtype not in _LANES:
        return False
    return 0 < round(p * 2**_VALUE_BITS) < 2**_VALUE_BITS


def keep_mask(like: Tensor, p: float) -> tuple[Tensor, float]:
    """A tensor shaped and typed like ``like`` holding 1.0 (keep) or 0.0 (drop), and the scale for kept elements.

    P(drop) is ``p`` rounded to a multiple of 2^-15; the scale is ``1 / (1 - P(drop))`` exactly.
    """
    int_dtype, one_bits = _LANES[like.dtype]
    n = like.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=like.device)
    words.random_(-(2**63), None)  # all 64 bits uniform: four 16-bit lanes
    lanes = words.view(torch.int16)[:n]
    threshold = round(p * 2**_VALUE_BITS)
    # keep <=> (lane & (2^b - 1)) >= threshold <=> (threshold - 1 - low) < 0 <=> its sign bit, spread by >> b
    lanes.bitwise_and_(2**_VALUE_BITS - 1).neg_().add_(threshold - 1).bitwise_right_shift_(_VALUE_BITS)
    if int_dtype != torch.int16:
        lanes = lanes.to(int_dtype)  # sign-extended: all ones stay all ones
    lanes.bitwise_and_(one_bits)  # all-ones -> 1.0, zero -> 0.0
    return lanes.view(like.dtype).view(like.shape), 2**_VALUE_BITS / (2**_VALUE_BITS - threshold)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, p: float) -> Tensor:
        mask, scale = keep_mask(y, p)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return torch.mul(y, mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mask,) = ctx.saved_tensors
        return torch.mul(grad, mask).mul_(ctx.scale).to(mask.dtype), None


class _DropoutAdd(torch.autograd.Function):
    """``x + dropout(y)`` as ``addcmul(x, y, mask, value=scale)``."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, p: float) -> Tensor:
        mask, scale = keep_mask(y, p)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        ctx.x_dtype = x.dtype
        return torch.addcmul(x, y, mask, value=scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mask,) = ctx.saved_tensors
        grad_y = torch.mul(grad, mask).mul_(ctx.scale).to(mask.dtype)
        return grad.to(ctx.x_dtype), grad_y, None


class _SeededDropoutAdd(torch.autograd.Function):
    """``x + dropout(y)`` (``dropout(y)`` without x) by a :class:`DropoutMasks` kernel: the mask from a seed drawn
    here, computed again from it in backward."""

    @staticmethod
    def forward(ctx, x: Tensor | None, y: Tensor, p: float, masks: DropoutMasks) -> Tensor:
        threshold = round(p * 2**_VALUE_BITS)
        scale = 2**_VALUE_BITS / (2**_VALUE_BITS - threshold)
        seed = int(torch.empty((), dtype=torch.int64).random_())  # from the global generator: seeded runs repeat
        ctx.args = (threshold, scale, seed, masks, y.dtype, None if x is None else x.dtype)
        return masks.apply(x, y, threshold, scale, seed)

    @staticmethod
    def backward(ctx, grad: Tensor):
        threshold, scale, seed, masks, y_dtype, x_dtype = ctx.args
        grad_y = masks.apply(None, grad.to(y_dtype).contiguous(), threshold, scale, seed)
        return None if x_dtype is None else grad.to(x_dtype), grad_y, None, None


def _seeded(masks: DropoutMasks | None, y: Tensor, x: Tensor | None, p: float) -> bool:
    return masks is not None and _fast(y, p, True) and masks.supports(y, x)


def dropout(y: Tensor, p: float, training: bool, random_bits: bool = False,
            masks: DropoutMasks | None = None) -> Tensor:
    """``F.dropout(y, p, training)``, with the mask from raw random bits when ``random_bits``, or computed by
    ``masks`` where it takes ``y``."""
    if not training or p == 0.0:
        return y
    if _seeded(masks, y, None, p):
        return _SeededDropoutAdd.apply(None, y, p, masks)
    if _fast(y, p, random_bits):
        return _Dropout.apply(y, p)
    return F.dropout(y, p, True)


def dropout_add(x: Tensor, y: Tensor, p: float, training: bool, random_bits: bool = False,
                masks: DropoutMasks | None = None) -> Tensor:
    """``x + F.dropout(y, p, training)``; with ``random_bits``, one fused pass and the mask from raw random bits;
    with ``masks`` (where it takes x and y), one pass that computes the mask too."""
    if not training or p == 0.0:
        return x + y
    if _seeded(masks, y, x, p):
        return _SeededDropoutAdd.apply(x, y, p, masks)
    if _fast(y, p, random_bits):
        return _DropoutAdd.apply(x, y, p)
    return x + F.dropout(y, p, True)


class Dropout(DropoutKernel, nn.Module):
    """Drop-in for ``nn.Dropout`` (no parameters or state, so checkpoints are unchanged) with :meth:`add`."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, y: Tensor) -> Tensor:
        return dropout(y, self.p, self.training, self.random_bit_dropout, self.dropout_masks)

    def add(self, x: Tensor, y: Tensor) -> Tensor:
        """``x + self(y)``: the residual connection around a sub-layer."""
        return dropout_add(x, y, self.p, self.training, self.random_bit_dropout, self.dropout_masks)

    def extra_repr(self) -> str:
        return f"p={self.p}"
