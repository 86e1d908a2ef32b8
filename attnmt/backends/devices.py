"""Which device a command runs on: the user's ``--device`` for translation, one GPU per process for training."""

from __future__ import annotations

import torch

from attnmt.errors import UserError


def auto_device() -> torch.device:
    """What ``auto`` means, everywhere: the first GPU when CUDA is usable, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str) -> torch.device:
    """``--device auto|cpu|cuda|cuda:N``: auto is :func:`auto_device`."""
    if device == "auto":
        return auto_device()
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available; use --device cpu")
    return dev


def training_device(local_rank: int, cpu: bool) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is usable (one GPU per training process), else the CPU (``--cpu``)."""
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise UserError(f"LOCAL_RANK {local_rank}, but this machine shows {n} GPU(s); start at most {n} "
                        f"processes per node (--nproc-per-node {n}), or add --cpu")
    return torch.device("cuda", local_rank)


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's equivalent."""
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if oom_types and isinstance(e, oom_types):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
