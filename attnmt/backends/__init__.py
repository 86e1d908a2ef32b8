"""The hardware seam: every decision that depends on the device is made here, once, and nowhere else.

* :mod:`attnmt.backends.capabilities` detects what the machine runs fast (native bf16 on the CPU, bf16 on the
  GPU) once per process.
* :func:`resolve_device` and :func:`training_device` pick the device a command runs on.
* :func:`resolve_precision` turns the user's ``--precision auto|fp32|bf16|fp16`` into the precision a run uses,
  or a one-line error naming the missing capability.
* :func:`backend_for` returns the :class:`Backend` of a device and precision. It prepares a model once (swaps its
  linear layers for the hardware's fused or packed ones, sets the attention implementation, casts or quantizes
  it), gives the autocast context, and the decoder's row bucketing; :meth:`Backend.configure_process` applies
  process-wide runtime settings and is called by the commands, not by library constructors.

The model, the criterion and the search hold no device checks: they call what the backend gave them.
"""

from __future__ import annotations

from attnmt.backends.base import Backend, Mode
from attnmt.backends.capabilities import CpuCapabilities, cpu
from attnmt.backends.devices import auto_device, resolve_device, training_device
from attnmt.backends.precision import PRECISIONS, Precision, resolve_precision

__all__ = ["Backend", "CpuCapabilities", "Mode", "PRECISIONS", "Precision", "auto_device", "backend_for",
           "configure_process",
           "cpu", "forked_threads", "report", "resolve_device", "resolve_precision", "set_threads",
           "training_device", "warn_if_forked"]


def backend_for(device, precision: str = "fp32") -> Backend:
    """The backend of ``device`` (a ``torch.device`` or its name) for a resolved ``precision``."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        from attnmt.backends.cpu import CpuBackend

        return CpuBackend(device, precision)
    if device.type == "cuda":
        from attnmt.backends.cuda import CudaBackend

        return CudaBackend(device, precision)
    return Backend(device, precision)


_forked_said = False
_forked_from = 0  # in a process forked from one that computed on several threads: how many it had


def _one_thread_after_fork() -> None:
    """In a forked child: compute on one thread. GNU OpenMP's thread pool does not survive ``fork``, and a child
    whose parent ran a parallel region hangs in its first one of more than one thread; one-thread regions never
    touch the pool."""
    global _forked_from
    import torch

    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        _forked_from = threads


def forked_threads() -> int:
    """The threads of the parent this process was forked from, where it had more than one (this process then
    computes on one); else 0."""
    return _forked_from


def warn_if_forked() -> None:
    """Say once, on stderr, that this forked process computes on one thread (:func:`forked_threads`)."""
    global _forked_said
    if _forked_from and not _forked_said:
        import sys

        _forked_said = True
        print(f"attnmt: warning: this process was forked from one that computed on {_forked_from} threads, and "
              f"computes on one (GNU OpenMP's threads do not survive fork); to use more, create the Translator "
              f"after the fork or start processes with 'spawn'", file=sys.stderr, flush=True)


def set_threads(threads: int | None) -> None:
    """The CPU threads this process's PyTorch computes with (``--threads``, a decoding worker's share); None or 0
    leaves PyTorch's default (every core). In a process forked from a multi-threaded one it stays one
    (:func:`forked_threads`)."""
    import torch

    if threads and not _forked_from:
        torch.set_num_threads(threads)


def _register_fork_handler() -> None:
    import os

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_one_thread_after_fork)


_register_fork_handler()


def configure_process(mode: Mode, device: str = "auto") -> dict:
    """Apply the process-wide runtime settings of ``device``'s backend for ``mode`` ("train" or "generate"), once
    per process; called by the commands before any model runs. ``device``: a device name, or "auto"."""
    import torch

    try:
        dev = auto_device() if device == "auto" else torch.device(device)
    except RuntimeError:
        return {}  # the command reports the bad --device itself
    return backend_for(dev).configure_process(mode)


def report() -> list[str]:
    """What this machine gives attnmt, a line each (``attnmt --version``, ``attnmt list``): the CPU and its bf16,
    the compiled CPU kernels' state (without building them), the GPUs."""
    import torch

    from attnmt.backends import native

    caps = cpu()
    lines = [f"cpu: {caps.describe()}", f"compiled CPU kernels: {native.status(native.target(caps))}"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"cuda: {', '.join(names)}")
    else:
        lines.append("cuda: none")
    return lines
