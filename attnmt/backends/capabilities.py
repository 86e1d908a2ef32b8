"""What this machine can run fast, detected once per process.

The one place that asks the hardware: every precision choice and every fast path that needs a CPU feature reads
:func:`cpu` (or :func:`cuda_bf16`) instead of probing on its own.

**Native bf16 on the CPU** means oneDNN runs bf16 matrix products in hardware: AMX (Intel Sapphire Rapids and
later) or AVX-512 BF16 (Intel Cooper Lake, AMD Zen 4 and later). Without it (AVX2-only CPUs, AVX-512 without
BF16), a bf16 product is emulated or falls back to reference code: several to hundreds of times slower than fp32,
and the oneDNN fused/packed layers cannot be created at all. Two switches turn it off for testing the fallback
paths on a machine that has it:

* ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's own): its kernels behave like an AVX2 CPU's, and PyTorch reports no
  bf16 support;
* ``ATTNMT_CPU_BF16=0`` (this project's): attnmt treats the CPU as one without native bf16, whatever oneDNN can
  do, so that ``--precision auto`` picks fp32 and no bf16 fast path is used.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

from attnmt import settings

BF16_SWITCH = settings.CPU_BF16
# ONEDNN_MAX_CPU_ISA values that leave oneDNN no 32-bit int8 accumulation (AVX2_VNNI and up have it)
_ONEDNN_CAPS_WITHOUT_VNNI = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})


@dataclass(frozen=True)
class CpuCapabilities:
    name: str  # the CPU model, as the OS reports it
    vendor: str  # "GenuineIntel", "AuthenticAMD", ... ("" where the OS does not say)
    isa: str  # the vector instruction set PyTorch's own kernels use (torch.backends.cpu.get_cpu_capability())
    flags: frozenset[str]  # the CPU's feature flags (/proc/cpuinfo; empty where the OS does not say)
    onednn: bool  # PyTorch was built with oneDNN (mkldnn)
    onednn_bf16: bool  # oneDNN reports bf16 support (honours ONEDNN_MAX_CPU_ISA)
    switched_off: bool  # ATTNMT_CPU_BF16=0
    onednn_fp32_choice: str = ""  # ATTNMT_CPU_ONEDNN_FP32: "1" or "0" overrides the CPU-based choice

    @property
    def bf16_hardware(self) -> str | None:
        """"AMX", "AVX-512 BF16", or None: the CPU's own bf16 matrix instructions."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX-512 BF16"
        return None

    @property
    def native_bf16(self) -> bool:
        """bf16 matrix products run in hardware through oneDNN: bf16 is the fast precision here."""
        if self.switched_off or not (self.onednn and self.onednn_bf16):
            return False
        # Where the OS lists no flags (not Linux), trust oneDNN's answer.
        return self.bf16_hardware is not None or not self.flags

    @property
    def fused_linear(self) -> bool:
        """oneDNN's inner product with bias and ReLU fused (``torch.ops.mkldnn._linear_pointwise``) and its weight
        prepacking can be used for bf16: both need native bf16."""
        return self.native_bf16 and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight")

    @property
    def onednn_avx512(self) -> bool:
        """oneDNN runs AVX-512 kernels here (the CPU has them and ONEDNN_MAX_CPU_ISA does not cap them)."""
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        below = cap == "AVX" or cap.startswith(("SSE", "AVX2"))
        return self.onednn and "avx512f" in self.flags and not below

    @property
    def onednn_fp32(self) -> bool:
        """fp32 linear layers run faster through oneDNN than through MKL: on CPUs not made by Intel, where MKL
        keeps to its AVX2 code (CTranslate2 makes the same choice) (benchmarks/kernel_choices.py; figures per CPU in docs/experiments.md).
        ``ATTNMT_CPU_ONEDNN_FP32=0|1`` overrides the choice."""
        if self.onednn_fp32_choice in ("0", "1"):
            return self.onednn and self.onednn_fp32_choice == "1"
        return self.onednn and self.vendor not in ("", "GenuineIntel") and hasattr(torch.ops.mkldnn,
                                                                                  "_linear_pointwise")

    @property
    def int8_full_range(self) -> bool:
        """The int8 products of ``cpu.Int8Linear`` (fbgemm's, and oneDNN's on many rows) accumulate in 32 bits
        (AVX-512 VNNI or AMX), so weights and activations can both use all 8 bits. Without VNNI, the AVX2 kernels
        of both add pairs of u8 x s8 products in 16 bits, which saturate unless one side has 7 bits: the weights
        get them. ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` (fbgemm's own cap) or an ``ONEDNN_MAX_CPU_ISA`` below VNNI
        (oneDNN's) turns it off: either library's kernels then saturate on 8-bit weights."""
        fbgemm_cap = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
        onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        vnni = "avx512_vnni" in self.flags or "amx_int8" in self.flags
        return vnni and not fbgemm_cap.startswith(("AVX2", "SSE")) and onednn_cap not in _ONEDNN_CAPS_WITHOUT_VNNI

    @property
    def onednn_int8(self) -> bool:
        """oneDNN's int8 products (u8 activations x s8 weights, ``torch.ops.onednn.qlinear_pointwise``) run on
        VNNI or AMX int8 instructions with 32-bit accumulation, next to native bf16: what ``--quantize int8`` with
        bf16 activations needs. Every CPU with native bf16 so far also has VNNI; without it oneDNN's AVX2 int8
        kernels can saturate."""
        vnni = "avx512_vnni" in self.flags or "amx_int8" in self.flags
        return self.native_bf16 and self.onednn_avx512 and vnni and hasattr(torch.ops.onednn, "qlinear_pointwise")

    @property
    def onednn_qlinear(self) -> bool:
        """oneDNN's int8 inner product (``torch.ops.onednn.qlinear_pointwise``) can run fp32 models' large int8
        products (``cpu.Int8Linear``) on x86 CPUs with AVX2 or more (measured there), as the weights' width (7
        bits without 32-bit accumulation) already keeps its AVX2 kernels from saturating."""
        return self.onednn and "avx2" in self.flags and hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(
            torch.ops.onednn, "qlinear_prepack")

    def why_no_bf16(self) -> str:
        """Why bf16 is not native here, in a phrase (for error messages)."""
        if self.switched_off:
            return f"{BF16_SWITCH}=0 is set"
        if not self.onednn:
            return "this PyTorch build has no oneDNN"
        if not self.onednn_bf16:
            isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
            if isa:
                return f"ONEDNN_MAX_CPU_ISA={isa} caps oneDNN below bf16 instructions"
            return f"the CPU ({self.name}) has neither AMX nor AVX-512 BF16"
        return f"the CPU ({self.name}) has neither AMX nor AVX-512 BF16"

    def describe(self) -> str:
        """One line for logs and benchmark reports."""
        hw = self.bf16_hardware or "no bf16 instructions"
        mode = "bf16 native" if self.native_bf16 else f"no native bf16 ({self.why_no_bf16()})"
        return f"{self.name}: {self.isa}, {hw}; {mode}"


def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    name, vendor, flags = "", "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "unknown CPU", vendor, flags


@functools.lru_cache(maxsize=1)
def cpu() -> CpuCapabilities:
    """The CPU's capabilities (detected on first use, then cached for the process)."""
    name, vendor, flags = _cpuinfo()
    switches = settings.current()
    try:
        onednn = bool(torch.backends.mkldnn.is_available())
    except (AttributeError, RuntimeError):
        onednn = False
    try:
        onednn_bf16 = onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = False
    try:
        isa = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        isa = "unknown"
    return CpuCapabilities(name=name, vendor=vendor, isa=isa, flags=flags, onednn=onednn, onednn_bf16=onednn_bf16,
                           switched_off=not switches.cpu_bf16, onednn_fp32_choice=switches.cpu_onednn_fp32)


def cuda_bf16(device: torch.device) -> bool:
    """The GPU computes in bf16 (compute capability 8.0 and later)."""
    with torch.cuda.device(device):
        return bool(torch.cuda.is_bf16_supported())
