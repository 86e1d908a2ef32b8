"""What every backend provides (see ``attnmt/backends/__init__.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from attnmt.models.kernels import DecodingKernels
from attnmt.models.linear import Linear
from attnmt.models.transformer import InputEmbedding

Mode = Literal["train", "generate"]


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], kinds: tuple[type, ...]) -> int:
    """Replace every child module whose type is exactly one of ``kinds`` by ``make(child)``; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) in kinds]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)


class AutocastStream(nn.Module):
    """The embeddings' output in the autocast dtype while autocast is on: the whole residual stream stays in the
    low-precision dtype (as in fairseq --bf16). Every matmul runs in it anyway, LayerNorm on bf16 input computes
    its statistics in fp32 and returns bf16, and an fp32 stream would cost a conversion before and after every
    sub-layer. Outside autocast (fp32, or a model cast to bf16 for translation) it passes the input through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def stream_in_autocast_dtype(model: nn.Module) -> int:
    """Give every input embedding of ``model`` an :class:`AutocastStream`, in place; returns how many."""
    found = [m for m in model.modules() if isinstance(m, InputEmbedding)]
    for m in found:
        m.stream = AutocastStream()
    return len(found)


def refuse_compile(compile: bool, device: torch.device) -> None:
    """``--compile`` is the CUDA backend's: elsewhere a one-line error."""
    if compile:
        from attnmt.errors import UserError

        raise UserError(f"--compile compiles the layers for a CUDA GPU; training on {device.type} runs without it "
                        f"(drop --compile)")


class HostStaging:
    """Host memory that a checkpoint's tensors are copied into before a background write, kept from one save to
    the next (the same shapes come back every time); ``pinned``: page-locked, so that copies from a GPU run
    asynchronously at full bus speed, ``sync`` waits for them."""

    def __init__(self, pinned: bool = False, sync: Callable[[], None] | None = None):
        self.pinned = pinned
        self.sync = sync
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
            self.buffers[key] = buf
        return buf.copy_(t.detach(), non_blocking=self.pinned)

    def done(self) -> None:
        """Every copy has landed (the copies from a GPU are asynchronous)."""
        if self.sync is not None:
            self.sync()


class Backend:
    """One device and one resolved precision ("fp32", "bf16" or "fp16")."""

    name = "generic"
    worker_processes = False  # translation may run in several decoding processes (--workers)
    process_unit = "device"  # what each torchrun process trains on, in the start line

    def __init__(self, device: torch.device, precision: str = "fp32"):
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"unresolved precision {precision!r}: resolve it with resolve_precision() first")
        self.device = torch.device(device)
        self.precision = precision

    def with_precision(self, precision: str) -> Backend:
        """This backend's kind on the same device, for another resolved precision."""
        return type(self)(self.device, precision)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self):
        """The autocast context of a forward pass (a no-op in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare_training(self, model: nn.Module, attention: str = "auto", compile: bool = False) -> nn.Module:
        """Make ``model`` (already on the device) train fast here; in place, parameters unchanged. ``attention``:
        "auto", "math" (plain matmul-softmax-matmul) or "flash" (fused kernels); ``compile``: compile the layers
        (``--compile``, where the backend does)."""
        refuse_compile(compile, self.device)
        stream_in_autocast_dtype(model)
        return model

    def prepare_criterion(self, criterion) -> None:
        """Tune a criterion that goes through the logits in blocks (``criterions.BlockedLoss``) for this device."""
        from attnmt.criterions import BlockedLoss

        if isinstance(criterion, BlockedLoss):
            criterion.block_elements = self.loss_block_elements()
            criterion.projection = self.loss_projection()
            criterion.loss_kernel = self.loss_kernel()

    def loss_kernel(self):
        """The compiled loss kernel (``models.kernels.LossKernel``) of this device, or None: PyTorch's passes."""
        return None

    def loss_projection(self):
        """The product ``a @ b^T`` of the fp32 vocabulary projection in the loss (``models.kernels.Projection``), or
        None: ``torch.mm``."""
        return None

    def loss_block_elements(self) -> int | None:
        """Logits per block of the loss (None: the whole batch at once)."""
        return None

    def prepare_inference(self, model: nn.Module, quantize: str = "none") -> nn.Module:
        """Make ``model`` (on the device, eval mode) translate fast here; returns it (cast, packed, quantized)."""
        if quantize != "none":
            raise ValueError(f"--quantize {quantize} is not available on {self.device}")
        if self.autocast_dtype is not None:
            model = model.to(self.autocast_dtype)  # once, instead of autocast casting at every step
        return model

    def loss_scaler(self):
        """The dynamic loss scaler of fp16 training (``torch.amp.GradScaler``), or None (no scaling)."""
        return torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None

    def length_multiple(self) -> int:
        """Training batches' lengths are padded up to a multiple of this (1: not at all)."""
        return 1

    def host_staging(self) -> HostStaging:
        """Where checkpoint snapshots are staged in host memory (see ``checkpoint/saver.py``)."""
        return HostStaging()

    def decoding_max_tokens(self) -> int:
        """Source tokens per translation batch when the user gives none (``--max-tokens 0``)."""
        return 4096

    def decoding_kernels(self) -> DecodingKernels:
        """What the search runs its steps with on this device."""
        return DecodingKernels(row_bucket=None, fused_attention=False, blockwise_topk=False, low_precision_scores=False)

    def configure_process(self, mode: Mode) -> dict:
        """Process-wide runtime settings for ``mode``; called once by a command. Returns what was set."""
        return {}

    def device_rng_state(self):
        """The device's own random generators' state for a checkpoint (None: the CPU's generator is all)."""
        return None

    def set_device_rng_state(self, state) -> None:
        """Restore what :meth:`device_rng_state` gave (where this device has such generators)."""

    def collectives(self) -> str:
        """The ``torch.distributed`` backend for this device's tensors."""
        return "gloo"

    def bind_process(self) -> None:
        """Make this device the process's own (before joining a process group)."""

    def ddp_device_ids(self) -> list[int] | None:
        """``DistributedDataParallel``'s ``device_ids`` for a model on this device."""
        return None

    def describe(self) -> str:
        return f"{self.device} ({self.name}), {self.precision}"


__all__ = ["Backend", "DecodingKernels", "HostStaging", "Linear", "Mode", "swap_linears"]
