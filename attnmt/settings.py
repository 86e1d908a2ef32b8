"""The environment's switches, typed: every ``ATTNMT_*`` environment variable is read here and nowhere else.

A switch is a field of :class:`Settings`; :func:`current` reads the environment's values (each call: a test or a
command that sets a variable sees it at once). The backends (``attnmt/backends/``: the hardware switches), the
compiled kernels' cache, the imported checkpoints' cache and the plugin loader take the field they need; the
model, the criterion and the search never see a switch. A base-layer module, so that reading a switch imports
nothing else (``attnmt score`` starts without PyTorch).

========================== ============================================================================
``ATTNMT_CPU_BF16=0``      a CPU with native bf16 behaves as one without (``cpu_bf16``)
``ATTNMT_CPU_KERNELS=0``   PyTorch's forms instead of the compiled CPU kernels (``cpu_kernels``)
``ATTNMT_CPU_MALLOC``      ``default``: leave glibc's allocator settings as they are (``cpu_malloc``)
``ATTNMT_CPU_ONEDNN_FP32`` ``1`` / ``0``: fp32 training layers from oneDNN or not, whatever the CPU
                           (``cpu_onednn_fp32``; unset: the backend's choice by vendor)
``ATTNMT_CUDA_GRAPHS=0``   beam steps on a GPU launched kernel by kernel, not replayed as CUDA graphs
                           (``cuda_graphs``)
``ATTNMT_KERNEL_BUILD_TIMEOUT`` seconds a kernel build may take (``kernel_build_timeout``, default 120)
``ATTNMT_CACHE_DIR``       compiled kernels and imported checkpoints (``cache_dir``; else
                           ``$XDG_CACHE_HOME/attnmt``, else ``~/.cache/attnmt``)
``ATTNMT_USER_DIR``        plugin directories, ``os.pathsep``-separated (``user_dirs``)
========================== ============================================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CPU_BF16 = "ATTNMT_CPU_BF16"
CPU_KERNELS = "ATTNMT_CPU_KERNELS"
CPU_MALLOC = "ATTNMT_CPU_MALLOC"
CPU_ONEDNN_FP32 = "ATTNMT_CPU_ONEDNN_FP32"
CUDA_GRAPHS = "ATTNMT_CUDA_GRAPHS"
KERNEL_BUILD_TIMEOUT = "ATTNMT_KERNEL_BUILD_TIMEOUT"
CACHE_DIR = "ATTNMT_CACHE_DIR"
USER_DIR = "ATTNMT_USER_DIR"
KERNELS_SAID = "_ATTNMT_KERNELS_SAID"  # set by a process that said why the compiled kernels are off, for its workers

DEFAULT_BUILD_TIMEOUT = 120.0


@dataclass(frozen=True)
class Settings:
    """The switches' values (the defaults: nothing set)."""

    cpu_bf16: bool = True
    cpu_kernels: bool = True
    cpu_malloc: str = ""
    cpu_onednn_fp32: str = ""
    cuda_graphs: bool = True
    kernel_build_timeout: float = DEFAULT_BUILD_TIMEOUT
    cache_dir: Path | None = None  # None: the default place (``cache_dir()`` of the module)
    user_dirs: tuple[str, ...] = ()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        raw_dirs = env.get(USER_DIR) or ""
        return cls(cpu_bf16=env.get(CPU_BF16, "").strip() != "0",
                   cpu_kernels=env.get(CPU_KERNELS, "").strip() != "0",
                   cpu_malloc=env.get(CPU_MALLOC, "").strip(),
                   cpu_onednn_fp32=env.get(CPU_ONEDNN_FP32, "").strip(),
                   cuda_graphs=env.get(CUDA_GRAPHS, "").strip() != "0",
                   kernel_build_timeout=_seconds(env.get(KERNEL_BUILD_TIMEOUT, "")),
                   cache_dir=Path(env[CACHE_DIR]) if env.get(CACHE_DIR) else None,
                   user_dirs=tuple(p for p in raw_dirs.split(os.pathsep) if p))

    @property
    def cache(self) -> Path:
        """Where attnmt keeps what it builds or imports."""
        if self.cache_dir is not None:
            return self.cache_dir
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "attnmt"


def _seconds(raw: str) -> float:
    try:
        value = float(raw) if raw.strip() else DEFAULT_BUILD_TIMEOUT
    except ValueError:
        value = DEFAULT_BUILD_TIMEOUT
    return value if 0 < value < float("inf") else DEFAULT_BUILD_TIMEOUT


def current() -> Settings:
    """The switches as the environment sets them now."""
    return Settings.from_environment()


def kernels_said() -> bool:
    """Whether this process, or the one that started it, already said why the compiled kernels are off."""
    return bool(os.environ.get(KERNELS_SAID))


def mark_kernels_said(said: bool = True) -> None:
    """Remember (for this process and the workers it starts) that the kernels' state was said, or forget it."""
    if said:
        os.environ[KERNELS_SAID] = "1"
    else:
        os.environ.pop(KERNELS_SAID, None)
