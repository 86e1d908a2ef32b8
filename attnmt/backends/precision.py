"""``--precision auto|fp32|bf16|fp16``: what the user asks for, resolved against what the device runs fast.

* ``auto`` (the recipes' choice): bf16 where the hardware computes in bf16 natively (a CPU with AMX or AVX-512
  BF16; a GPU of compute capability 8.0 or later for training), fp32 otherwise. Translation on a GPU stays in
  fp32 under ``auto``: the beam search gains little from bf16 there (docs/experiments.md), and fp32 is exact.
* ``bf16`` (also ``--bf16``): bf16 autocast with fp32 master weights. On a CPU without native bf16 this is a
  one-line error naming the missing capability: PyTorch would run it, but emulated bf16 products were several
  to hundreds of times slower than fp32 there, so a run that looks healthy would take days.
* ``fp16`` (also ``--fp16``): on a GPU only; training: fp16 autocast with dynamic loss scaling; translation: the
  model cast to float16.
* ``fp32``: what fairseq does without a precision flag, on every device.
"""

from __future__ import annotations

from typing import Literal

import torch

from attnmt.backends import capabilities
from attnmt.errors import UserError

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on ``t``'s device, or None where autocast is off there."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def without_autocast(t: torch.Tensor) -> torch.autocast:
    """A context in which autocast is off on ``t``'s device (products in the dtypes given)."""
    return torch.autocast(t.device.type, enabled=False)


def requested_precision(precision: str, bf16: bool = False, fp16: bool = False) -> str:
    """``--precision`` combined with the fairseq spellings ``--bf16``/``--fp16`` (which win over the default)."""
    if bf16 and fp16:
        raise ValueError("--bf16 and --fp16 exclude each other; pick one")
    flag = "bf16" if bf16 else "fp16" if fp16 else None
    if flag and precision not in ("fp32", "auto", flag):
        raise ValueError(f"--{flag} and --precision {precision} disagree; give one of them")
    return flag or precision


def resolve_precision(requested: str, device: torch.device, mode: str = "train") -> str:
    """The precision a run on ``device`` uses: "fp32", "bf16" or "fp16" (``mode``: "train" or "generate")."""
    if requested not in PRECISIONS:
        raise UserError(f"--precision {requested!r}: use one of {', '.join(PRECISIONS)}")
    if device.type == "cuda":
        bf16_ok = capabilities.cuda_bf16(device)
        if requested == "auto":
            return "bf16" if bf16_ok and mode == "train" else "fp32"
        if requested == "bf16" and not bf16_ok:
            raise UserError("--bf16: this GPU does not compute in bfloat16 (compute capability < 8.0); use --fp16 "
                            "or --precision fp32")
        return requested
    if requested == "fp16":
        raise UserError(f"--fp16 needs a CUDA GPU (float16 arithmetic is a GPU's); on {device.type} use "
                        f"--precision auto, which picks bf16 where the CPU runs it natively")
    if device.type != "cpu":
        return "fp32" if requested == "auto" else requested
    caps = capabilities.cpu()
    if requested == "auto":
        return "bf16" if caps.native_bf16 else "fp32"
    if requested == "bf16" and not caps.native_bf16:
        raise UserError(f"--bf16: no native bf16 on this CPU ({caps.why_no_bf16()}), where bf16 runs many times "
                        f"slower than fp32; use --precision auto (fp32 here) or drop --bf16")
    return requested
