"""What every backend provides (see ``attnmt/backends/__init__.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from attnmt.models.linear import Linear

Mode = Literal["train", "generate"]


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], kinds: tuple[type, ...]) -> int:
    """Replace every child module whose type is exactly one of ``kinds`` by ``make(child)``; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) in kinds]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)


class Backend:
    """One device and one resolved precision ("fp32", "bf16" or "fp16")."""

    name = "generic"

    def __init__(self, device: torch.device, precision: str = "fp32"):
        if precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"unresolved precision {precision!r}: resolve it with resolve_precision() first")
        self.device = torch.device(device)
        self.precision = precision

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self):
        """The autocast context of a forward pass (a no-op in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare_training(self, model: nn.Module, attention: str = "auto") -> nn.Module:
        """Make ``model`` (already on the device) train fast here; in place, parameters unchanged. ``attention``:
        "auto", "math" (plain matmul-softmax-matmul) or "flash" (fused kernels)."""
        return model

    def prepare_criterion(self, criterion) -> None:
        """Tune a criterion that goes through the logits in blocks (``criterions.BlockedLoss``) for this device."""
        from attnmt.criterions import BlockedLoss

        if isinstance(criterion, BlockedLoss):
            criterion.block_elements = self.loss_block_elements()
            criterion.onednn_projection = self.onednn_projection()

    def onednn_projection(self) -> bool:
        """The fp32 vocabulary projection of the loss runs through oneDNN rather than ``torch.mm``."""
        return False

    def loss_block_elements(self) -> int | None:
        """Logits per block of the loss (0: the whole batch at once; None: the CPU's default)."""
        return 0

    def prepare_inference(self, model: nn.Module, quantize: str = "none") -> nn.Module:
        """Make ``model`` (on the device, eval mode) translate fast here; returns it (cast, packed, quantized)."""
        if quantize != "none":
            raise ValueError(f"--quantize {quantize} is not available on {self.device}")
        if self.precision == "bf16":
            model = model.to(torch.bfloat16)  # once, instead of autocast casting at every step
        return model

    def row_bucket(self, rows: int) -> int:
        """The row count to pad a decoder step's rows to (the same here: no padding)."""
        return rows

    def configure_process(self, mode: Mode) -> dict:
        """Process-wide runtime settings for ``mode``; called once by a command. Returns what was set."""
        return {}

    def describe(self) -> str:
        return f"{self.device} ({self.name}), {self.precision}"


__all__ = ["Backend", "Linear", "Mode", "swap_linears"]
