"""The CUDA backend: autocast on tensor cores, PyTorch's fused attention kernels, no row padding.

What it decides, once per run:

* **Attention kernels.** Training and translation call ``scaled_dot_product_attention``; PyTorch may pick its
  cuDNN kernel, which builds (and caches) a cuDNN graph for every new (batch, length) shape: 7-9 ms per call on an
  H100, and token batching makes nearly every batch a new shape, so that this alone made transformer_big's
  updates three times slower (0.322 s vs 0.101 s with cuDNN's attention off). :meth:`configure_process` turns
  the cuDNN attention off for the process; the flash and memory-efficient kernels, which need no per-shape
  setup, serve every shape NMT has (any length, padding masks, causal).
* **Length buckets.** Training batches are padded to lengths that are multiples of 8 (fairseq's
  ``--required-seq-len-multiple``, which overrides it): matrix shapes that fill the tensor cores' tiles, and
  a bounded set of shapes for every kernel that specialises on them.
* **Translation.** The model is cast once to the run's precision (bf16/fp16, no autocast per step); the search
  scores in fp32, attends over the decoder cache with one fused kernel (``scaled_dot_product_attention``)
  and picks the best extensions with one ``topk`` over ``beam x vocabulary`` (the GPU's own kernel), not with
  the CPU's blockwise scan over bf16 bit patterns (:meth:`decoding_kernels`); batches default to 16,000 source
  tokens (:meth:`decoding_max_tokens`).
* **Checkpoint snapshots** go to page-locked host buffers, reused from save to save, so that copying 2.4 GB of
  transformer_big state off the GPU takes a fraction of a second (:meth:`host_staging`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnmt.backends.base import Backend, HostStaging, Mode
from attnmt.errors import UserError
from attnmt.models.interface import DecodingKernels
from attnmt.models.linear import set_plain_attention_max_len


class CudaBackend(Backend):
    name = "cuda"

    def prepare_training(self, model: nn.Module, attention: str = "auto") -> nn.Module:
        set_plain_attention_max_len(model, 0)  # SDPA's flash/memory-efficient kernels
        return model

    def prepare_inference(self, model: nn.Module, quantize: str = "none") -> nn.Module:
        if quantize != "none":
            raise UserError(f"--quantize {quantize} runs on the CPU only; add --device cpu")
        return super().prepare_inference(model)

    def configure_process(self, mode: Mode) -> dict:
        torch.backends.cuda.enable_cudnn_sdp(False)
        return {"cudnn_attention": False}

    def decoding_kernels(self) -> DecodingKernels:
        return DecodingKernels(row_bucket=None, fused_attention=True, blockwise_topk=False, low_precision_scores=False)

    def decoding_max_tokens(self) -> int:
        # a beam step is bound by launch overhead until the batch has thousands of rows: larger batches fill the
        # GPU (measured on an H100: 4096 -> 16000 source tokens took the Multi30k model from 10.9k to 14.5k tok/s)
        return 16000

    def length_multiple(self) -> int:
        return 8  # tensor-core tiles; and 8x fewer distinct shapes for the kernels that specialise on them

    def host_staging(self) -> HostStaging:
        return HostStaging(pinned=True, sync=lambda: torch.cuda.synchronize(self.device))

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if torch.cuda.is_available() else "CUDA"
        return f"{self.device} ({name}), {self.precision}"
