"""Process-wide settings that make CPU training faster; applied once when a CPU trainer is built.

Two costs dominate a CPU training step besides the arithmetic, and neither is visible in PyTorch's own profiles:

* **Page faults on fresh memory.** glibc's ``malloc`` serves large blocks (above a threshold that adapts up to
  32 MB) with ``mmap`` and gives them back on ``free``; every training step allocates the same activations
  again, and each new page costs a kernel page fault plus zeroing. Keeping freed memory in the heap
  (``M_MMAP_MAX`` 0: no ``mmap`` blocks; a high ``M_TRIM_THRESHOLD``: no trimming) removed about a third of the
  step time of the small Transformer in bf16. The price: the process keeps its peak heap size until it exits,
  which a training process reaches in its first steps anyway.
* **oneDNN kernel generation.** bf16 matrix products run through oneDNN, which generates (JIT-compiles) a kernel
  for every new problem shape and keeps the last ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (default 1024) of them.
  Batches of sentences have many shapes (rows = sentences x length): an epoch of Multi30k at 4096 tokens makes
  about 2,600 (20 per batch), so with the default capacity the cache thrashes and kernels are generated again
  every epoch (about 3 ms each: a bf16 step of the small model on new shapes took ~35% longer). The capacity is raised to 4096
  unless the user set it. A cached kernel holds about 0.5 MB, so the cache can grow to about 2 GB; on corpora
  with more distinct batch shapes than that it still thrashes. oneDNN reads the setting when it first builds a
  kernel, so it only takes effect if no bf16 matrix product ran before in this process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ONEDNN_CACHE_CAPACITY = 4096

_M_TRIM_THRESHOLD = -1  # mallopt parameters from glibc's <malloc.h>
_M_MMAP_MAX = -4

_applied = False


def _keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel; False when not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    return mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok


def tune_cpu_runtime() -> dict[str, bool | str]:
    """Apply the settings above once per process (later calls do nothing); returns what was set.

    ``ATTNMT_CPU_MALLOC=default`` in the environment leaves ``malloc`` alone (e.g. to compare, or when memory is
    tight); a user-set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is respected.
    """
    global _applied
    if _applied:
        return {}
    _applied = True
    done: dict[str, bool | str] = {}
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    done["onednn_primitive_cache_capacity"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    if os.environ.get("ATTNMT_CPU_MALLOC", "") != "default":
        done["malloc_keep_freed"] = _keep_freed_memory()
    return done
