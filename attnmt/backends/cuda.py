"""The CUDA backend: autocast on tensor cores, PyTorch's fused attention kernels, no row padding.

What it decides, once per run:

* **Attention kernels.** Training and translation call ``scaled_dot_product_attention``; PyTorch may pick its
  cuDNN kernel, which builds (and caches) a cuDNN graph for every new (batch, length) shape, and token batching
  makes nearly every batch a new shape (docs/experiments.md has what that cost). :meth:`configure_process` turns
  the cuDNN attention off for the process; the flash and memory-efficient kernels, which need no per-shape
  setup, serve every shape NMT has (any length, padding masks, causal).
* **Length buckets.** Training batches are padded to lengths that are multiples of 8 (fairseq's
  ``--required-seq-len-multiple``, which overrides it): matrix shapes that fill the tensor cores' tiles, and
  a bounded set of shapes for every kernel that specialises on them.
* **Training path.** Three choices for teacher forcing on a GPU, where what costs is not the products but the
  many small passes around them:

  - *padded rows*: the decoder runs on the (B, T) grid (``RowPacking`` off): the CPU's packed rows skip the
    padding's products with a gather and a scatter around every attention, which on a GPU cost more than the
    padding;
  - *the residual stream in the autocast dtype*: CUDA autocast runs ``layer_norm`` in fp32 and returns fp32, so
    after the first LayerNorm the whole stream would be fp32 and every sub-layer would convert it to bf16 and
    back (a copy per linear layer, each way, forward and backward). :class:`StreamLayerNorm` normalises the bf16
    stream with its statistics in fp32 inside the kernel and returns bf16, as fairseq's ``--bf16`` does;
  - ``--compile``: each encoder and decoder layer compiled by ``torch.compile`` (one graph per layer kind, shared
    by every layer of that kind, lengths dynamic, a padding mask always given), which fuses the layer norms, dropout, residual additions and
    casts into a few kernels; compiled graphs are cached on disk by PyTorch (``TORCHINDUCTOR_CACHE_DIR``), and an
    error in compiling falls back to running the layer as written.
* **Translation.** The model is cast once to the run's precision (bf16/fp16, no autocast per step); the search
  scores in fp32, attends over the decoder cache with one fused kernel (``scaled_dot_product_attention``)
  and picks the best extensions with one ``topk`` over ``beam x vocabulary`` (the GPU's own kernel), not with
  the CPU's blockwise scan over bf16 bit patterns (:meth:`decoding_kernels`), all of a batch's rows in one
  block (each block of a step costs its own few dozen launches). Beam search keeps every decoder shape fixed for
  a batch (``models/static_cache.py``) and runs each step as one CUDA graph, captured once per buffer size: a step
  costs one launch instead of a few dozen, which is what bounds translation on a GPU (:class:`CudaGraphSteps`;
  ``ATTNMT_CUDA_GRAPHS=0`` launches the kernels one by one; docs/experiments.md has both measured).
  Batches default to 16,000 source tokens per
  20 GiB of GPU memory, up to 64,000 (:meth:`decoding_max_tokens`).
* **Checkpoint snapshots** go to page-locked host buffers, reused from save to save, so that copying the state
  off the GPU runs at the bus's speed (:meth:`host_staging`).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from attnmt import settings
from attnmt.backends.base import Backend, HostStaging, Mode, stream_in_autocast_dtype
from attnmt.errors import UserError
from attnmt.models.kernels import DecodingKernels, StepRecorder
from attnmt.models.packing import set_row_packing
from attnmt.models.tuning import set_plain_attention_max_len

SCORE_ROWS = 16384  # decoder rows scored per block: every row of any batch the default --max-tokens makes


class StreamLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that keeps a bf16/fp16 input in its dtype under autocast (statistics in fp32 inside the
    kernel); elsewhere exactly ``nn.LayerNorm``. The same parameters, so checkpoints do not change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                weight = None if self.weight is None else self.weight.to(x.dtype)
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        return super().forward(x)


def stream_layer_norms(model: nn.Module) -> int:
    """Turn every ``nn.LayerNorm`` of ``model`` into a :class:`StreamLayerNorm`, in place; returns how many."""
    norms = [m for m in model.modules() if type(m) is nn.LayerNorm]
    for m in norms:
        m.__class__ = StreamLayerNorm
    return len(norms)


def compile_layers(model: nn.Module) -> int:
    """``torch.compile`` every encoder and decoder layer of ``model`` in place (lengths and batch dynamic: one
    graph per layer kind); returns how many. A layer that fails to compile runs as written, with a warning."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # fall back to eager, said once per error by PyTorch
    layers = []
    for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
        if stack is not None and hasattr(stack, "layers"):
            stack.always_mask = True  # a mask argument of one kind: no second graph for unpadded batches
            layers.extend(stack.layers)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


_graph_failure_said = False


def _say_graphs_off(err: BaseException) -> None:
    global _graph_failure_said
    if not _graph_failure_said:
        _graph_failure_said = True
        print(f"attnmt: warning: decoding steps run without CUDA graphs (the capture failed: "
              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); translations are the same",
              file=sys.stderr)


class CudaGraphSteps(StepRecorder):
    """A fixed-shape cache's steps as CUDA graphs: each recorded step runs once on a side stream (allocations
    and library handles made before the capture, as CUDA graphs need), then is captured into a graph and replayed
    from then on. A step that cannot be captured runs eagerly from then on (said once).

    Each capture gets a memory pool of its own. A pool shared by the captures would die with the last graph
    captured into it: the cache drops a buffer size's graph before it records the next size, and PyTorch's
    allocator refuses to capture into a pool whose graphs are all gone (an internal assertion, seen on an H200
    with torch 2.11: every step after the first growth ran eagerly). One step's pool is small, and it is freed
    with its graph."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.failed = False
        self.captures = 0  # graphs captured
        self._stream = None  # the side stream of the warm-up runs and the captures

    def record(self, step):
        if self.failed:
            step()
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after every step queued before
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            # the capture itself, without torch.cuda.graph's collection and cache emptying at each capture;
            # thread-local, so that another thread's CUDA work (a service's) does not break it
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    step()  # recorded, not run: the step is idempotent, its results stand
                finally:
                    graph.capture_end()
            self.captures += 1
            return graph.replay
        except Exception as err:  # a step that cannot be captured runs eagerly, said once
            self.failed = True
            _say_graphs_off(err)
            return None


class CudaBackend(Backend):
    name = "cuda"
    process_unit = "GPU"

    def prepare_training(self, model: nn.Module, attention: str = "auto", compile: bool = False) -> nn.Module:
        stream_in_autocast_dtype(model)
        set_plain_attention_max_len(model, 0)  # SDPA's flash/memory-efficient kernels
        set_row_packing(model, False)
        if self.autocast_dtype is not None:
            stream_layer_norms(model)
        if compile:
            compile_layers(model)
        return model

    def prepare_inference(self, model: nn.Module, quantize: str = "none") -> nn.Module:
        if quantize != "none":
            raise UserError(f"--quantize {quantize} runs on the CPU only; add --device cpu")
        return super().prepare_inference(model)

    def configure_process(self, mode: Mode) -> dict:
        torch.backends.cuda.enable_cudnn_sdp(False)
        return {"cudnn_attention": False}

    def decoding_kernels(self) -> DecodingKernels:
        return DecodingKernels(row_bucket=None, fused_attention=True, blockwise_topk=False, low_precision_scores=False,
                               score_rows=SCORE_ROWS,
                               step_graphs=(lambda: CudaGraphSteps(self.device)) if settings.current().cuda_graphs
                               else None)

    def decoding_max_tokens(self) -> int:
        # a beam step is bound by launch overhead until the batch has thousands of rows: larger batches fill the
        # GPU; 16,000 source tokens for every 20 GiB of GPU memory, up to 64,000 (a transformer_big's fp32 beam-4
        # cache for 64,000 WMT-length source tokens: about half an 80 GB GPU)
        total = torch.cuda.get_device_properties(self.device).total_memory if torch.cuda.is_available() else 0
        return 16000 * max(1, min(4, total // (20 * 2**30)))

    def length_multiple(self) -> int:
        return 8  # tensor-core tiles; and 8x fewer distinct shapes for the kernels that specialise on them

    def host_staging(self) -> HostStaging:
        return HostStaging(pinned=True, sync=lambda: torch.cuda.synchronize(self.device))

    def device_rng_state(self):
        return torch.cuda.get_rng_state_all()

    def set_device_rng_state(self, state) -> None:
        with contextlib.suppress(RuntimeError):  # a different number of visible GPUs
            torch.cuda.set_rng_state_all(state)

    def collectives(self) -> str:
        return "nccl"

    def bind_process(self) -> None:
        torch.cuda.set_device(self.device)

    def ddp_device_ids(self) -> list[int] | None:
        return [self.device.index if self.device.index is not None else torch.cuda.current_device()]

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if torch.cuda.is_available() else "CUDA"
        return f"{self.device} ({name}), {self.precision}"
