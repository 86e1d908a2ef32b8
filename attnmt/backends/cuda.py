"""The CUDA backend: autocast on tensor cores, PyTorch's fused attention kernels, no row padding."""

from __future__ import annotations

import torch
from torch import nn

from attnmt.backends.base import Backend
from attnmt.errors import UserError
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

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if torch.cuda.is_available() else "CUDA"
        return f"{self.device} ({name}), {self.precision}"
