"""The CPU backend: oneDNN fast paths where the CPU runs bf16 natively, plain PyTorch everywhere else.

What it decides, once per run (see ``capabilities.py`` for how the CPU is detected):

* **Linear layers.** bf16 training on a CPU with native bf16 swaps the model's linear layers for
  :class:`~attnmt.backends.onednn.TrainingLinear` (bias and ReLU inside oneDNN's product); bf16 inference
  casts the model once and packs its weights (:class:`~attnmt.backends.onednn.PackedLinear`); ``--quantize int8``
  swaps them for dynamic int8 layers: with fp32 activations :class:`Int8Linear` (fbgemm's product, oneDNN's
  from ``INT8_ONEDNN_MIN_ROWS`` rows), with bf16 ones
  (``--precision auto`` on a CPU with native bf16) oneDNN's
  (:class:`~attnmt.backends.onednn.Int8PackedLinear`) in an otherwise bf16 model. fp32 runs its linear layers
  through oneDNN as well (fused bias + ReLU, backward products in oneDNN, prepacked weights for inference) on
  CPUs not made by Intel, where MKL keeps to AVX2 and oneDNN's AVX-512 kernels win (``capabilities.CpuCapabilities.onednn_fp32``;
  ``ATTNMT_CPU_ONEDNN_FP32=0|1`` overrides); elsewhere fp32 keeps the plain layers (MKL).
* **Attention.** For sentence-length sequences the plain matmul-softmax-matmul is faster on the CPU than PyTorch's
  fused "flash" kernel, whose advantage starts at several hundred tokens (benchmarks/kernel_choices.py; figures per CPU in docs/experiments.md): "auto" runs the plain form up
  to :data:`PLAIN_ATTENTION_MAX_LEN` tokens. In fp32, where the machine has a C compiler, training runs that
  plain form as one compiled call forward and one backward (:mod:`attnmt.backends.native`: Q, K and V read
  where the projection wrote them, no batched products of tiny matrices; ``ATTNMT_CPU_KERNELS=0`` keeps
  PyTorch's).
* **Dropout masks.** Training draws dropout masks from raw random bits, one integer pass per mask, instead of
  ``bernoulli_`` (a float per element) and two more passes (``attnmt/models/dropout.py``; ``DropoutKernel``);
  where the machine has a C compiler, the compiled kernel of :mod:`attnmt.backends.native` computes each mask
  from a seed and the element's index in the pass that applies it, forward and backward, and stores none.
* **Decoding kernels.** Where the machine has a C compiler, a one-token decoding step attends over the beam cache
  through the compiled kernel of :mod:`attnmt.backends.native` (each row reads only its own history's slots, in
  one call), and the candidate selection reads each row's log-sum-exp and block maxima from its other kernel
  instead of ``log_softmax``'s output; PyTorch's forms elsewhere (``ATTNMT_CPU_KERNELS=0`` forces them).
* **Loss kernel.** Where the machine has a C compiler, the training loss turns each block of logits into its sums
  and its gradient in one compiled call (:mod:`attnmt.backends.native`) instead of PyTorch's five passes
  (``ATTNMT_CPU_KERNELS=0`` keeps those).
* **Decoder row counts.** oneDNN compiles a kernel, and keeps it with its buffers, for every matrix shape it
  meets; as sentences leave a batch the decoder's row count changes almost every step. :meth:`decoding_kernels`
  pads them to a few sizes (:func:`padded_rows`).
* **Process settings** (:meth:`configure_process`, called by the commands):

  - *Page faults on fresh memory.* glibc's ``malloc`` serves large blocks with ``mmap`` and gives them back on
    ``free``; every training step (and every decoding step) allocates the same temporaries again, and each new
    page costs a kernel page fault plus zeroing. Training keeps all freed memory in the heap (``M_MMAP_MAX`` 0,
    no trimming). Translation fixes the mmap threshold at 32 MiB and the trim threshold at 1 GiB. The price: the process keeps its peak heap until it exits. ``ATTNMT_CPU_MALLOC=default`` leaves ``malloc`` alone.
  - *oneDNN kernel generation.* oneDNN keeps the last ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (default 1024)
    kernels; an epoch of Multi30k at 4096 tokens makes about 2,600 shapes, so the cache thrashed and kernels
    were generated again every epoch. Training raises it to 4096 unless the user set it (about 0.5 MB a kernel). oneDNN reads it when it first builds a
    kernel, so the command sets it before any product runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

import torch
from torch import Tensor, nn

from attnmt import settings
from attnmt.backends import capabilities
from attnmt.backends.base import Backend, DecodingKernels, Mode, refuse_compile, stream_in_autocast_dtype, swap_linears
from attnmt.backends.onednn import quantize_u8_affine
from attnmt.errors import UserError
from attnmt.models.linear import Linear
from attnmt.models.tuning import (
    set_dropout_masks,
    set_fused_attention,
    set_plain_attention_max_len,
    set_random_bit_dropout,
)

PLAIN_ATTENTION_MAX_LEN = 256
INT8_ONEDNN_MIN_ROWS = 128  # int8 products of this many rows or more run oneDNN's kernel (Int8Linear)
ONEDNN_CACHE_CAPACITY = 4096

# mallopt parameters from glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_configured: set[str] = set()


LOSS_BLOCK_ELEMENTS = 1 << 18  # logits per loss block and thread: 1 MB in fp32, so a block's passes stay in the L2 cache


def bf16_block_maxima(x: Tensor, n: int, nonpositive: bool) -> Tensor:
    """Maxima of ``n`` equal blocks of each row of ``x`` (R, n * c) -> (R, n), for the search's block scan
    (``DecodingKernels.block_maxima``).

    PyTorch reduces bf16 through float conversions, slower than this (benchmarks/kernel_choices.py): for values
    <= 0 (log-probabilities), the bf16 bit pattern read as an integer, sign bit cleared, orders them by magnitude,
    so the block maximum is the block's smallest such integer with the sign bit put back (exact, -inf and -0
    included). Other inputs take ``amax``.
    """
    if x.dtype != torch.bfloat16 or not nonpositive:
        return x.unflatten(1, (n, -1)).amax(dim=2)
    magnitude = x.view(torch.int16) & 0x7FFF
    return (magnitude.unflatten(1, (n, -1)).amin(dim=2) | -32768).view(torch.bfloat16)


def padded_rows(n: int) -> int:
    """``n`` rounded up to one of eight sizes per power of two (a multiple of 8 at least).

    oneDNN builds (and keeps) a kernel per shape; rows padded to these sizes (at most 1/8 more work) keep the set
    of shapes small and reused.
    """
    step = max(8, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def _mallopt(settings: list[tuple[int, int]]) -> bool:
    """Apply glibc ``mallopt`` settings; False where the C library is not glibc or refuses one."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = True
    for param, value in settings:
        ok = mallopt(param, value) == 1 and ok
    return ok


class Int8Linear(nn.Module):
    """Dynamic int8 quantization of a linear layer: int8 weights with one scale per output row (per-channel, more
    accurate than one scale per matrix at the same speed), activations quantized on the fly per product to all 8
    bits; the model's linear contract, ``forward(x, relu=False)``, with the ReLU fused into the product.

    Two kernels share the same int8 weights. fbgemm's (PyTorch's dynamic quantized linear layer) quantizes the
    activations inside its product and costs little per call: it runs the decoding steps of a few sentences.
    From ``onednn_rows`` rows on, oneDNN's int8 inner product (``torch.ops.onednn.qlinear_pointwise``) takes over,
    its activations quantized over their range as fbgemm's (:func:`~attnmt.backends.onednn.quantize_u8_affine`):
    faster than fbgemm's on many rows, about even on a few hundred, with or without VNNI (docs/experiments.md). ``onednn_rows=None`` keeps fbgemm's alone; the price of both is a second copy of the int8
    weights.

    ``weight_bits``: 8 where the CPU accumulates the products in 32 bits (``CpuCapabilities.int8_full_range``), 7
    elsewhere. The AVX2 kernels of both libraries add pairs of u8 x s8 products in 16 bits; with weights in
    [-64, 63] a pair stays below 2 x 255 x 64 = 32,640 and cannot saturate. The bit is taken from the weights
    rather than from the activations (PyTorch's ``reduce_range``): an activation's scale covers a whole batch, so
    its rounding error is the larger, and on Multi30k 7-bit activations cost up to 0.25 BLEU where 7-bit weights
    cost none (docs/experiments.md). torch 2.x marks ``torch.ao.quantization`` deprecated in favour of torchao but
    still ships it; its warnings are silenced because the user asked for exactly this.
    """

    def __init__(self, linear: nn.Linear, weight_bits: int, onednn_rows: int | None = None):
        super().__init__()
        if weight_bits not in (7, 8):
            raise ValueError(f"weight_bits must be 7 or 8, got {weight_bits}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
            from torch.ao.quantization import PerChannelMinMaxObserver, QConfig, default_dynamic_quant_observer

            half = 1 << (weight_bits - 1)
            weights = PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                                         quant_min=-half, quant_max=half - 1)
            plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
            plain.weight, plain.bias = linear.weight, linear.bias
            plain.qconfig = QConfig(activation=default_dynamic_quant_observer, weight=weights)
            self.inner = DynamicLinear.from_float(plain)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_bits = weight_bits
        self.fbgemm_weight = self.inner._packed_params._packed_params  # read per call: no module lookups
        self.onednn_rows = onednn_rows
        if onednn_rows is not None:  # the same int8 weights, packed for oneDNN
            qweight, bias = self.inner._packed_params._weight_bias()
            self.onednn_weight = torch.ops.onednn.qlinear_prepack(qweight.int_repr(), None)
            self.weight_scale = qweight.q_per_channel_scales().float()
            self.weight_zero_point = torch.zeros(self.out_features, dtype=torch.int64)
            self.onednn_bias = None if bias is None else bias.detach().float()

    def forward(self, x: Tensor, relu: bool = False) -> Tensor:
        rows = x.numel() // self.in_features
        if self.onednn_rows is not None and rows >= self.onednn_rows and x.dtype == torch.float32:
            qx, scale, zero_point = quantize_u8_affine(x.reshape(rows, self.in_features))
            y = torch.ops.onednn.qlinear_pointwise.tensor(
                qx, scale, zero_point, self.onednn_weight, self.weight_scale, self.weight_zero_point,
                self.onednn_bias, 1.0, 0, torch.float32, "relu" if relu else "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        op = torch.ops.quantized.linear_relu_dynamic if relu else torch.ops.quantized.linear_dynamic
        return op(x, self.fbgemm_weight, False).to(x.dtype)  # False: 8-bit activations


class CpuBackend(Backend):
    name = "cpu"
    worker_processes = True
    process_unit = "CPU share"

    def __init__(self, device: torch.device, precision: str = "fp32"):
        super().__init__(device, precision)
        if precision == "fp16":
            raise UserError("--fp16 needs a CUDA GPU; on the CPU use --precision auto")
        self.caps = capabilities.cpu()

    def prepare_training(self, model: nn.Module, attention: str = "auto", compile: bool = False) -> nn.Module:
        refuse_compile(compile, self.device)
        stream_in_autocast_dtype(model)
        limits = {"auto": PLAIN_ATTENTION_MAX_LEN, "math": 1 << 30, "flash": 0}
        if attention not in limits:
            raise ValueError(f"unknown attention choice {attention!r}: use auto, math or flash")
        set_plain_attention_max_len(model, limits[attention])
        from attnmt.backends import native

        set_fused_attention(model, native.training_attention(native.target(self.caps)))
        set_random_bit_dropout(model, True)
        set_dropout_masks(model, native.dropout_masks(native.target(self.caps)))
        from attnmt.backends.onednn import TrainingLinear

        if self.precision == "bf16" and self.caps.fused_linear:
            swap_linears(model, lambda m: TrainingLinear(m, torch.bfloat16), (Linear,))
        elif self.precision == "fp32" and self.caps.onednn_fp32:
            avx512 = self.caps.onednn_avx512
            swap_linears(model, lambda m: TrainingLinear(m, torch.float32, onednn_backward=True,
                                                         onednn_weight_grad=avx512), (Linear,))
        return model

    def prepare_inference(self, model: nn.Module, quantize: str = "none") -> nn.Module:
        if quantize not in ("none", "int8"):
            raise ValueError(f"unknown quantization {quantize!r}")
        from attnmt.backends.onednn import Int8PackedLinear, PackedLinear

        if quantize == "int8" and self.precision == "fp32":
            bits = 8 if self.caps.int8_full_range else 7
            rows = INT8_ONEDNN_MIN_ROWS if self.caps.onednn_qlinear else None
            swap_linears(model, lambda m: Int8Linear(m, bits, rows), (Linear, nn.Linear))
            return model.eval()
        if quantize == "int8":  # bf16 activations: the products in int8, the rest as a bf16 model
            if not self.caps.onednn_int8:
                raise UserError(f"--quantize int8 with --precision {self.precision}: this CPU ({self.caps.name}) "
                                f"has no int8 instructions next to its bf16 ones; use --precision fp32")
            model = model.to(torch.bfloat16)
            swap_linears(model, Int8PackedLinear, (Linear, nn.Linear))
            return model.eval()
        if self.precision == "bf16":
            model = model.to(torch.bfloat16)  # once, instead of autocast casting at every step
            if self.caps.fused_linear:
                swap_linears(model, PackedLinear, (Linear, nn.Linear))
        elif self.caps.onednn_fp32:
            swap_linears(model, PackedLinear, (Linear, nn.Linear))
        return model

    def decoding_kernels(self) -> DecodingKernels:
        from attnmt.backends import native

        target = native.target(self.caps)
        return DecodingKernels(row_bucket=padded_rows, blockwise_topk=True, low_precision_scores=True,
                               step_attention=native.step_attention(target), scores=native.scores(target),
                               block_maxima=bf16_block_maxima)

    def loss_kernel(self):
        from attnmt.backends import native

        return native.smoothed_loss(native.target(self.caps))

    def decoding_max_tokens(self) -> int:
        # a decoding step costs the same Python and kernel overhead whatever its row count: fewer, larger batches
        # (docs/experiments.md)
        return 8192

    def loss_block_elements(self) -> int | None:
        return LOSS_BLOCK_ELEMENTS * torch.get_num_threads()  # L2-cache-sized blocks for every thread

    def loss_projection(self):
        if self.precision == "fp32" and self.caps.onednn_fp32:
            from attnmt.backends.onednn import product

            return product
        return None

    def configure_process(self, mode: Mode) -> dict:
        if mode in _configured:
            return {}
        _configured.add(mode)
        done: dict = {}
        if mode == "train":
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
            done["onednn_primitive_cache_capacity"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
        if settings.current().cpu_malloc != "default":
            if mode == "train":
                done["malloc_keep_freed"] = _mallopt([(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)])
            else:
                done["malloc_keep_freed"] = _mallopt([(_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30)])
        return done

    def describe(self) -> str:
        from attnmt.backends import native

        return (f"cpu ({self.caps.describe()}), {self.precision}; compiled kernels "
                f"{native.status(native.target(self.caps))}")
