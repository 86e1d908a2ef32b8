"""Where a GPU's time goes, for the GPU benchmarks' ``--profile``: ``torch.profiler`` around a piece of work, the
kernels' share of the wall time (how busy the GPU was) and the table of the kernels that took the most time.

    from gpu_profile import profile_table
    print(profile_table(lambda: work(), device))
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch


def _device_time_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value:
            return float(value)
    return 0.0


def profile_table(work: Callable[[], None], device: torch.device, rows: int = 18) -> str:
    """Run ``work`` once under ``torch.profiler`` (CPU and CUDA activity); return a text table: the wall time,
    the GPU's kernel time and its share of the wall time (GPU busy), then the kernels by total time (calls,
    total ms, share of kernel time, mean us), and the operators that launched the most kernel time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        work()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    ops: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = _device_time_us(e)
        if not us:
            continue
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels[e.key][0] += e.count
            kernels[e.key][1] += us
        else:
            ops[e.key] += us
    busy = sum(v[1] for v in kernels.values()) or float("nan")  # nan: no kernel ran (no GPU)
    lines = [f"wall {wall_us / 1e3:.1f} ms, GPU kernels {busy / 1e3:.1f} ms: GPU busy {100 * busy / wall_us:.1f}%",
             f"{'kernel':<70} {'calls':>7} {'ms':>8} {'share':>6} {'mean us':>8}"]
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:rows]:
        lines.append(f"{name[:70]:<70} {count:>7} {us / 1e3:>8.2f} {100 * us / busy:>5.1f}% {us / max(count, 1):>8.1f}")
    lines.append(f"{'operator (its own kernels)':<70} {'':>7} {'ms':>8} {'share':>6}")
    for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{name[:70]:<70} {'':>7} {us / 1e3:>8.2f} {100 * us / busy:>5.1f}%")
    return "\n".join(lines)
