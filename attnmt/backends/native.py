"""The CPU's compiled kernels: a beam search step's attention over the cache, what its candidate selection needs
of the logits, the training loss with its gradient, training's attention and its dropout, each in one call.

A beam search step on the CPU spends much of its attention time in PyTorch's batched products of tiny matrices
(a few queries per sentence and head against a few dozen slots) and the copies, masks and softmax around them.
``csrc/step_attention.c`` does the same work per (row, head) pair in one pass: it writes the step's keys and
values, reads only the slots of the row's own history (a quarter of the batched form's at beam 4), and keeps the
scores in a small buffer. ``csrc/logsumexp.c`` reads each row of logits twice (the row's and its vocabulary
blocks' maxima, then the sum of exponentials) where ``log_softmax`` and the block maxima read and write the
vocabulary four times and more (docs/experiments.md has the measurements). ``csrc/smoothed_loss.c`` turns a block
of training logits into the label-smoothed loss's sums and, in place, its gradient, in three passes over each
row while it sits in the cache, where PyTorch's log_softmax, gather, sum, exp and subtraction each read and write
the logits. ``csrc/train_attention.c`` is training's attention for sentence-length sequences in fp32: one task per
(sentence, head) reads Q, K and V where the projection wrote them, and computes the scores, the softmax and the
output (then, backward, the four products' gradients) without the copies into contiguous blocks, the batched
products of tiny matrices and the separate scale, mask and softmax passes of PyTorch's form. ``csrc/dropout.c``
applies training's dropout (with the residual addition) in one pass that computes each element's mask from a seed
and the element's index, forward and backward, where PyTorch's form draws the random numbers, turns them into a
mask in several integer passes, stores it, and applies it.

All five are plain C, compiled together on first use with the machine's C compiler for the vector instructions
PyTorch's own kernels use here (``torch.backends.cpu.get_cpu_capability()``; AVX-512 BF16's dot products as
well where attnmt runs bf16 natively on them, :func:`target`), cached under ``$ATTNMT_CACHE_DIR``
(default ``~/.cache/attnmt``), and loaded with ``ctypes``: no PyTorch headers and no build step at install time.
Where no compiler is found or the compilation fails, :func:`step_attention`, :func:`scores`,
:func:`smoothed_loss`, :func:`training_attention` and :func:`dropout_masks` return None and the search, the loss,
attention and dropout keep PyTorch's forms; ``ATTNMT_CPU_KERNELS=0`` does
the same on purpose (to compare, or to rule the kernels out).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from attnmt import settings
from attnmt.backends.capabilities import CpuCapabilities
from attnmt.models.kernels import DropoutMasks, LossKernel, ScoreKernel, StepAttention, StepRows, TrainingAttention
from attnmt.models.packing import SentenceRows

SWITCH = settings.CPU_KERNELS
TIMEOUT_SWITCH = settings.KERNEL_BUILD_TIMEOUT
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("step_attention.c", "logsumexp.c", "smoothed_loss.c", "train_attention.c", "dropout.c"))
HEADERS = (Path(__file__).with_name("csrc") / "vec.h",)
# x86 vector instructions per PyTorch CPU capability; other CPUs compile for the compiler's default target
_ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
              "AVX2": ["-mavx2", "-mfma"]}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$ATTNMT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnmt``, else
    ``~/.cache/attnmt``."""
    return settings.current().cache


def target(caps: CpuCapabilities) -> str:
    """What to compile for on this CPU: PyTorch's CPU capability ("AVX512", "AVX2", "DEFAULT", ...), with
    "+BF16" where the CPU has AVX-512 BF16 and attnmt uses native bf16 (the bf16 cache's dot products then run
    on its bf16 instructions)."""
    bf16 = caps.isa.upper() == "AVX512" and caps.native_bf16 and "avx512_bf16" in caps.flags
    return caps.isa + ("+BF16" if bf16 else "")


def compile_flags(isa: str, openmp: bool = True) -> list[str]:
    """The compiler flags for ``isa`` (see :func:`target`); ``openmp``: the kernels split their rows over
    ``torch.get_num_threads()`` threads (one thread without)."""
    flags = ["-O3", "-std=gnu11", "-shared", "-fPIC"] + (["-fopenmp"] if openmp else [])
    base, _, extra = isa.upper().partition("+")
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += _ISA_FLAGS.get(base, [])
        if base == "AVX512" and extra == "BF16":
            flags.append("-mavx512bf16")
    return flags


class Unavailable(Exception):
    """The kernels cannot be had; the message is one phrase saying why and what to do."""


def _compiler() -> list[str]:
    """The compiler command: ``$CC`` split into words as a shell would (``CC="ccache gcc"``), else ``cc`` or
    ``gcc`` on the PATH."""
    raw = os.environ.get("CC", "")
    try:
        words = shlex.split(raw)
    except ValueError as e:
        raise Unavailable(f"CC={raw!r} does not parse as a command ({e}); fix or unset CC") from None
    if words:
        return words
    found = shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise Unavailable("no C compiler (cc or gcc) on the PATH; install gcc or set CC")
    return [found]


def has_compiler() -> bool:
    """Whether a C compiler is there to build the kernels with (``$CC`` or ``cc``/``gcc`` on the PATH)."""
    try:
        words = _compiler()
    except Unavailable:
        return False
    return shutil.which(words[0]) is not None or os.path.isfile(words[0])


def build_timeout() -> float:
    """Seconds a build may take before it is stopped (``$ATTNMT_KERNEL_BUILD_TIMEOUT``, default 120)."""
    return settings.current().kernel_build_timeout


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``command`` with its output captured; past ``timeout`` seconds its whole process group is killed (a
    compiler driver's children included) and ``subprocess.TimeoutExpired`` raised."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, command, out, err)
    return subprocess.CompletedProcess(command, 0, out, err)


def _failure_file(directory: Path, compiler: list[str], flags: list[str]) -> Path:
    """Where a failed build of these sources with this compiler command and these flags is remembered."""
    digest = hashlib.sha256(" ".join([*compiler, platform.machine(), *flags]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return directory / f"failed-{digest.hexdigest()[:16]}.txt"


def _identity(compiler: list[str], timeout: float) -> str:
    """The compiler's version line and the C library's version: a cache entry is never shared by builds of
    another compiler or for another C library."""
    try:
        version = _run([*compiler, "--version"], timeout).stdout.strip().splitlines()[:1]
    except subprocess.TimeoutExpired:
        raise Unavailable(f"'{' '.join(compiler)} --version' did not answer within {timeout:.0f} s") from None
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"'{' '.join(compiler)} --version' failed (exit {e.returncode})") from None
    except OSError as e:
        raise Unavailable(f"the C compiler {compiler[0]!r} cannot be run ({e.strerror or e}); install gcc or set "
                          f"CC") from None
    return " ".join([*version, *platform.libc_ver()])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verified(library: Path) -> bool:
    """Whether ``library`` is a complete build of ours: its bytes match the checksum written beside it at the
    end of its build (a truncated or replaced file would crash the process that loads it)."""
    check = library.with_suffix(".sha256")
    try:
        return check.read_text(encoding="ascii").strip() == _digest(library)
    except (OSError, UnicodeDecodeError):
        return False


class Busy(Unavailable):
    """Another process held a cache entry's build lock past the time limit (not remembered as a failed build)."""


@contextlib.contextmanager
def _locked(path: Path, deadline: float):
    """An exclusive lock on ``path`` (created if needed, never through a symbolic link), held for the block: one
    build per key at a time. Waits for another holder until ``deadline`` (``time.monotonic()``), then raises
    :class:`Busy`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Busy(f"another process has held the build lock {path} for longer than the build limit "
                               f"(its compiler may hang; raise {TIMEOUT_SWITCH} to wait longer)") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def remove_dead_builds(directory: Path) -> None:
    """Delete the temp files that killed builds left in the cache: ``.kernels-*.so.PID.*.tmp`` whose process no
    longer runs, and those of builds before the pid was in the name (``tmp*.so.tmp``) older than an hour."""
    from attnmt.fileio import pid_alive

    with contextlib.suppress(OSError):
        for p in directory.iterdir():
            name = p.name
            if name.startswith(".kernels-") and name.endswith(".tmp"):
                pid = name.split(".so.", 1)[-1].split(".", 1)[0]
                dead = pid.isdigit() and not pid_alive(int(pid))
            elif name.startswith("tmp") and name.endswith((".so.tmp", ".sha256.tmp")):
                dead = time.time() - p.stat().st_mtime > 3600
            else:
                continue
            if dead:
                with contextlib.suppress(OSError):
                    p.unlink()


def _library_path(directory: Path, compiler: list[str], flags: list[str], timeout: float) -> Path:
    """The cache entry of a build: named by the sources, the flags, the compiler and its version, the C library."""
    digest = hashlib.sha256(" ".join([*compiler, _identity(compiler, timeout), platform.machine(), *flags]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return directory / f"kernels-{digest.hexdigest()[:16]}.so"


def build(isa: str, directory: Path | None = None, openmp: bool = True) -> Path:
    """The kernels' library for ``isa``, compiled unless a verified build of the same sources, flags, compiler
    version and C library is cached.

    The compiler is ``$CC`` (split into words as a shell would), else ``cc`` or ``gcc`` on the PATH. Raises
    :class:`Unavailable` where there is no usable C compiler, ``subprocess.CalledProcessError`` where it fails
    and ``subprocess.TimeoutExpired`` where it takes longer than :func:`build_timeout`. One process builds a key
    at a time (a lock per key); the library and its checksum are written elsewhere, flushed to disk and renamed
    into place, so no process ever loads half a file, and a damaged cached file (:func:`verified`) is built again.
    """
    compiler = _compiler()
    flags = compile_flags(isa, openmp)
    timeout = build_timeout()
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Unavailable(f"the kernel cache {directory} cannot be created ({e.strerror or e}); set "
                          f"ATTNMT_CACHE_DIR to a writable directory") from None
    start = time.monotonic()
    target = _library_path(directory, compiler, flags, timeout)
    if verified(target):
        return target
    remove_dead_builds(directory)
    with _locked(target.with_suffix(".lock"), start + timeout):
        if verified(target):  # another process built it while this one waited
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=directory)
        os.close(fd)
        check_tmp = Path(tmp).with_suffix(".sha256.tmp")
        try:  # the limit counts from the start of the wait for the lock
            _run([*compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], max(1.0, start + timeout - time.monotonic()))
            _fsync(Path(tmp))
            check_tmp.write_text(_digest(Path(tmp)) + "\n", encoding="ascii")
            _fsync(check_tmp)
            os.replace(check_tmp, target.with_suffix(".sha256"))
            os.replace(tmp, target)
            _fsync(directory)
        finally:
            for leftover in (Path(tmp), check_tmp):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
    return target


_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _bind(library: ctypes.CDLL, prefix: str, argtypes: list) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """The library's ``{prefix}_f32`` and ``{prefix}_bf16`` functions by dtype, with their argument types."""
    functions = {}
    for dtype, name in _DTYPES.items():
        fn = getattr(library, f"{prefix}_{name}")
        fn.argtypes, fn.restype = argtypes, None
        functions[dtype] = fn
    return functions


def _takes_rows(x: Tensor, functions: dict) -> bool:
    """Whether a row kernel takes ``x``: contiguous 2-d rows on the CPU, in one of its dtypes."""
    return x.dtype in functions and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()


class CompiledStepAttention(StepAttention):
    """:class:`~attnmt.models.kernels.StepAttention` by the compiled kernel (fp32 and bf16 queries); it runs
    on ``torch.get_num_threads()`` threads, as PyTorch's own kernels do."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library
        p, i64, i32 = _P, _I64, _I32
        self.functions = _bind(library, "step_attention", [p, i64, p, p, i64, p, i32, p, i64, i32, i32, p, p, p, i64,
                                                            i64, p, i32, i32, i32, i32, ctypes.c_float, p, i32])
        library.step_attention_max_dh.restype = i32
        self.max_head_dim = library.step_attention_max_dh()  # head sizes: multiples of 8 up to this

    def supports(self, q: Tensor) -> bool:
        dh = q.size(-1)
        return (q.dtype in self.functions and q.device.type == "cpu" and dh % 8 == 0 and dh <= self.max_head_dim
                and q.stride(-1) == 1 and q.stride(1) == dh)

    def _run(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, rows: StepRows, positions: int, *,
             ancestors: Tensor | None = None, ancestor_rows: int = 1, keep: Tensor | None = None,
             k: Tensor | None = None, v: Tensor | None = None, position: int | Tensor = 0) -> Tensor:
        total, H, _, Dh = q.shape
        per_sentence = None
        if isinstance(position, Tensor):  # each buffered sentence at its own step
            if position.dtype != torch.int64 or not position.is_contiguous() or position.numel() != k_buf.size(0):
                raise ValueError("the step kernel needs one int64 position per buffered sentence")
            per_sentence, position = position, 0
        if not (k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == q.dtype == v_buf.dtype):
            raise ValueError("the step kernel needs contiguous buffers of the queries' dtype")
        out = q.new_empty(total, 1, H * Dh)
        if rows.count < total:
            out[rows.count:].zero_()
        if k is not None and not (self.supports(k) and self.supports(v) and k.stride(0) == v.stride(0)):
            k, v = k.contiguous(), v.contiguous()
        live = rows.live
        if live is not None and (live.dtype != torch.int64 or not live.is_contiguous()):
            live = live.to(torch.int64).contiguous()
        if ancestors is not None and (ancestors.dtype != torch.int32 or ancestors.stride(1) != 1):
            raise ValueError("the step kernel needs int32 ancestors with contiguous rows")
        self.functions[q.dtype](
            q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(), k_buf.size(2),
            None if live is None else live.data_ptr(), rows.per_sentence,
            None if ancestors is None else ancestors.data_ptr(), 0 if ancestors is None else ancestors.stride(0),
            ancestor_rows, rows.beam, None if keep is None else keep.data_ptr(),
            None if k is None else k.data_ptr(), None if v is None else v.data_ptr(), 0 if k is None else k.stride(0),
            position, None if per_sentence is None else per_sentence.data_ptr(), rows.count, H, Dh, positions,
            Dh ** -0.5, out.data_ptr(), torch.get_num_threads())
        return out

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor, rows: StepRows,
                       position: int | Tensor, ancestors: Tensor | None, ancestor_rows: int) -> Tensor:
        # per-sentence positions: the kernel reads each sentence's own count; the buffers' length bounds them
        longest = k_buf.size(2) // rows.beam if isinstance(position, Tensor) else position + 1
        return self._run(q, k_buf, v_buf, rows, longest, ancestors=ancestors, ancestor_rows=ancestor_rows,
                         k=k, v=v, position=position)

    def cross_attention(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, rows: StepRows,
                        keep: Tensor | None) -> Tensor:
        if keep is not None and (keep.dtype != torch.bool or not keep.is_contiguous()):
            raise ValueError("the step kernel needs a contiguous bool padding mask")
        return self._run(q, k_buf, v_buf, rows, k_buf.size(2), keep=keep)


class CompiledScores(ScoreKernel):
    """:class:`~attnmt.models.kernels.ScoreKernel` by the compiled kernel (fp32 and bf16 logits), on
    ``torch.get_num_threads()`` threads."""

    def __init__(self, library: ctypes.CDLL):
        self.functions = _bind(library, "logsumexp_blocks", [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I32])

    def supports(self, logits: Tensor) -> bool:
        return _takes_rows(logits, self.functions)

    def logsumexp_blocks(self, logits: Tensor, bias: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
        R, V = logits.shape
        if block % 8 or block <= 0:
            raise ValueError(f"blocks must be a positive multiple of 8 tokens, got {block}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (V,) or not bias.is_contiguous()):
            raise ValueError("the bias must be a contiguous float32 vector, one value per token")
        maxima = logits.new_empty((R, V // block), dtype=torch.float32)
        lse = logits.new_empty(R, dtype=torch.float32)
        self.functions[logits.dtype](logits.data_ptr(), R, V, None if bias is None else bias.data_ptr(),
                                     maxima.data_ptr(), lse.data_ptr(), block, V // block, torch.get_num_threads())
        return maxima, lse


class CompiledSmoothedLoss(LossKernel):
    """:class:`~attnmt.models.kernels.LossKernel` by the compiled kernel (fp32 and bf16 logits), on
    ``torch.get_num_threads()`` threads."""

    def __init__(self, library: ctypes.CDLL):
        self.functions = _bind(library, "smoothed_loss", [_P, _I64, _I64, _P, ctypes.c_float, _P, _P, _P, _I32])

    def supports(self, logits: Tensor) -> bool:
        return _takes_rows(logits, self.functions)

    def smoothed_rows(self, logits: Tensor, target: Tensor, epsilon: float, lp_y: Tensor, lp_sum: Tensor,
                      grad: Tensor | None) -> None:
        if not self.supports(logits):
            raise ValueError("the loss kernel takes contiguous 2-d fp32 or bf16 logits on the CPU")
        R, V = logits.shape
        if grad is not None and (grad.shape != logits.shape or grad.dtype != logits.dtype or not grad.is_contiguous()):
            raise ValueError("the loss kernel writes the gradient into a contiguous tensor shaped as the logits")
        for out in (lp_y, lp_sum):
            if out.dtype != torch.float32 or out.numel() != R or not out.is_contiguous():
                raise ValueError("the loss kernel writes its sums into contiguous float32 tensors, one value a row")
        target = target.to(torch.int64).contiguous()
        if R and not (0 <= int(target.min()) and int(target.max()) < V):
            raise ValueError(f"targets must be token ids below the vocabulary size {V}")
        self.functions[logits.dtype](logits.data_ptr(), R, V, target.data_ptr(), epsilon, lp_y.data_ptr(),
                                     lp_sum.data_ptr(), None if grad is None else grad.data_ptr(),
                                     torch.get_num_threads())


class _FusedAttention(torch.autograd.Function):
    """The compiled kernel's forward and backward as one autograd node; saves the probabilities (B, H, T, S).
    Arguments as :meth:`CompiledTrainingAttention.attend`'s; ``keep`` (B, S) uint8 or None."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor | None, heads: int, queries: SentenceRows, keys: SentenceRows,
                keep: Tensor | None, is_causal: bool, kernel: CompiledTrainingAttention) -> Tensor:
        src = q if kv is None else kv  # the rows holding K and V
        width = q.size(1) // 3 if kv is None else kv.size(1) // 2  # H * Dh
        dh = width // heads
        k_col = width if kv is None else 0  # K's first column in src; V's follows at k_col + width
        B, T, S = queries.start.numel(), queries.longest, keys.longest
        out = q.new_empty(q.size(0), width)
        probs = q.new_empty(B, heads, T, S)
        k_ptr = src.data_ptr() + 4 * k_col  # byte addresses: 4 bytes a float
        kernel.forward_fn(q.data_ptr(), q.stride(0), queries.start.data_ptr(), queries.length.data_ptr(), k_ptr,
                          k_ptr + 4 * width, src.stride(0), keys.start.data_ptr(), keys.length.data_ptr(),
                          None if keep is None else keep.data_ptr(), B, heads, T, S, dh, int(is_causal),
                          dh ** -0.5, out.data_ptr(), probs.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(q, kv, probs)
        ctx.layout = (heads, queries, keys, is_causal, width, dh, k_col)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, kv, probs = ctx.saved_tensors
        heads, queries, keys, is_causal, width, dh, k_col = ctx.layout
        src = q if kv is None else kv
        B, _, T, S = probs.shape
        grad = grad.contiguous()
        d_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # for self-attention dQ, dK and dV side by side
        d_kv = None if kv is None else torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        d_src = d_q if kv is None else d_kv
        k_ptr, dk_ptr = src.data_ptr() + 4 * k_col, d_src.data_ptr() + 4 * k_col
        ctx.kernel.backward_fn(q.data_ptr(), q.stride(0), queries.start.data_ptr(), queries.length.data_ptr(),
                               k_ptr, k_ptr + 4 * width, src.stride(0), keys.start.data_ptr(),
                               keys.length.data_ptr(), B, heads, T, S, dh, int(is_causal), dh ** -0.5,
                               probs.data_ptr(), grad.data_ptr(), d_q.data_ptr(),
                               d_q.stride(0), dk_ptr, dk_ptr + 4 * width, d_src.stride(0), torch.get_num_threads())
        return d_q, d_kv, None, None, None, None, None, None


class CompiledTrainingAttention(TrainingAttention):
    """:class:`~attnmt.models.kernels.TrainingAttention` by the compiled kernel (fp32), on
    ``torch.get_num_threads()`` threads."""

    def __init__(self, library: ctypes.CDLL):
        p, i64, i32, f32 = _P, _I64, _I32, ctypes.c_float
        self.forward_fn = library.train_attention_forward_f32
        self.forward_fn.argtypes = [p, i64, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i32, i32, f32, p, p, i32]
        self.forward_fn.restype = None
        self.backward_fn = library.train_attention_backward_f32
        self.backward_fn.argtypes = [p, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i32, i32, f32, p, p, p, i64,
                                     p, p, i64, i32]
        self.backward_fn.restype = None
        library.train_attention_max_dh.restype = library.train_attention_max_keys.restype = i32
        self.max_head_dim = library.train_attention_max_dh()  # head sizes: multiples of 8 up to this
        self.max_keys = library.train_attention_max_keys()

    def supports(self, q: Tensor, kv: Tensor | None, heads: int, keys: SentenceRows, mask: Tensor | None) -> bool:
        parts = 3 if kv is None else 1
        if not all(x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
                   for x in (q, kv) if x is not None) or q.size(1) % (parts * heads):
            return False
        dh = q.size(1) // (parts * heads)
        B, S = keys.start.numel(), keys.longest
        return (dh % 8 == 0 and dh <= self.max_head_dim and 0 < S <= self.max_keys
                and (kv is None or kv.size(1) == 2 * heads * dh)
                and (mask is None or (mask.dtype == torch.bool and mask.shape == (B, 1, 1, S))))

    def attend(self, q: Tensor, kv: Tensor | None, heads: int, queries: SentenceRows, keys: SentenceRows,
               mask: Tensor | None, is_causal: bool) -> Tensor:
        if not self.supports(q, kv, heads, keys, mask):
            raise ValueError("the attention kernel takes fp32 CPU rows with heads of a multiple of 8 up to "
                             f"{self.max_head_dim}, up to {self.max_keys} keys, and a (B, 1, 1, S) bool mask")
        if (queries.rows != q.size(0) or keys.rows != (q if kv is None else kv).size(0)
                or queries.start.numel() != keys.start.numel()):
            raise ValueError("the sentences' rows do not match the operands' rows")
        keep = None if mask is None else mask.reshape(mask.size(0), -1).contiguous().view(torch.uint8)
        return _FusedAttention.apply(q, kv, heads, queries, keys, keep, is_causal, self)


class CompiledDropout(DropoutMasks):
    """:class:`~attnmt.models.kernels.DropoutMasks` by the compiled kernel (fp32 and bf16), on
    ``torch.get_num_threads()`` threads."""

    def __init__(self, library: ctypes.CDLL):
        self.functions = _bind(library, "dropout_add", [_P, _P, _P, _I64, _I32, ctypes.c_float, ctypes.c_uint64,
                                                        _I64, _I32])
        library.dropout_block_elements.restype = _I32
        self.block = library.dropout_block_elements()

    def supports(self, y: Tensor, x: Tensor | None) -> bool:
        return (y.dtype in self.functions and y.device.type == "cpu" and y.is_contiguous()
                and (x is None or (x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
                                   and x.is_contiguous())))

    def apply(self, x: Tensor | None, y: Tensor, threshold: int, scale: float, seed: int) -> Tensor:
        if not self.supports(y, x):
            raise ValueError("the dropout kernel takes contiguous fp32 or bf16 CPU tensors of one dtype and shape")
        if not 0 < threshold < 2**15:
            raise ValueError(f"the drop threshold must be in (0, 2^15), got {threshold}")
        out = torch.empty_like(y)
        n = y.numel()
        self.functions[y.dtype](None if x is None else x.data_ptr(), y.data_ptr(), out.data_ptr(), n, threshold,
                                scale, seed % 2**64, -(-n // self.block), torch.get_num_threads())
        return out


# every function the classes below bind: a library missing one is not a build of these sources
SYMBOLS = ("step_attention_f32", "step_attention_bf16", "step_attention_max_dh", "logsumexp_blocks_f32",
           "logsumexp_blocks_bf16", "smoothed_loss_f32", "smoothed_loss_bf16", "train_attention_forward_f32",
           "train_attention_backward_f32", "train_attention_max_dh", "train_attention_max_keys", "dropout_add_f32",
           "dropout_add_bf16", "dropout_block_elements")
_status: dict[str, str] = {}  # isa -> what happened in this process ("on (...)" or "off (...)")


def _load(path: Path) -> ctypes.CDLL:
    """``path`` loaded, once :func:`verified`, with every function of :data:`SYMBOLS` present."""
    if not verified(path):
        raise Unavailable(f"{path} does not match its checksum")
    lib = ctypes.CDLL(str(path))
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise Unavailable(f"{path} lacks {', '.join(missing[:2])}")
    return lib


def _discard(path: Path) -> None:
    for p in (path, path.with_suffix(".sha256")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def _build_and_load(isa: str) -> tuple[ctypes.CDLL, Path]:
    """Build (or find) and load the library; a cached file that fails to load is deleted and built again once."""
    try:
        path = build(isa)
        openmp = True
    except subprocess.CalledProcessError:  # e.g. clang without an OpenMP runtime: the kernels on one thread
        path = build(isa, openmp=False)
        openmp = False
    try:
        return _load(path), path
    except (OSError, Unavailable) as e:
        log.info("the cached kernels %s failed to load (%s); building them again", path, e)
        _discard(path)
        path = build(isa, openmp=openmp)
        return _load(path), path


def _say(message: str) -> None:
    """One warning line on stderr, once for a process and the worker processes it starts."""
    if settings.kernels_said():
        return
    settings.mark_kernels_said()
    print(f"attnmt: warning: {message}", file=sys.stderr, flush=True)


@functools.cache
def library(isa: str) -> ctypes.CDLL | None:
    """The compiled kernels for PyTorch's CPU capability ``isa``, or None where they cannot be had (no compiler,
    a failed or timed-out build, ``ATTNMT_CPU_KERNELS=0``); built or loaded once per process. A failed build is
    said once on stderr and remembered in the cache (``failed-*.txt``), so later runs do not wait on it again."""
    if not settings.current().cpu_kernels:
        _status[isa] = f"off ({SWITCH}=0)"
        return None
    failure: Path | None = None  # where a failed build is remembered (None: nothing worth remembering)
    try:
        compiler = _compiler()
        remembered = _failure_file(cache_dir(), compiler, compile_flags(isa))
        if remembered.exists():
            reason = remembered.read_text(encoding="utf-8", errors="replace").strip()[:300]
            raise Unavailable(f"an earlier build failed ({reason}); delete {remembered} to try again")
        failure = remembered
        lib, path = _build_and_load(isa)
    except (OSError, Unavailable, subprocess.SubprocessError) as e:
        reason = _reason(e)
        if failure is not None and not isinstance(e, Busy):  # a held lock is another run's, not a failed build
            with contextlib.suppress(OSError):
                failure.write_text(reason + "\n", encoding="utf-8")
        _status[isa] = f"off ({reason})"
        _say(f"the compiled CPU kernels are off: {reason}. Using PyTorch's operations instead (the same results "
             f"up to rounding, slower).")
        return None
    _status[isa] = f"on ({path})"
    return lib


def _reason(e: BaseException) -> str:
    """A failed build or load in one phrase."""
    if isinstance(e, subprocess.TimeoutExpired):
        return (f"the C compiler took longer than {e.timeout:.0f} s and was stopped (raise "
                f"{TIMEOUT_SWITCH} to wait longer)")
    if isinstance(e, subprocess.CalledProcessError):
        first = next((line for line in (e.stderr or "").splitlines() if "error" in line.lower()),
                     (e.stderr or "").strip()[:200])
        return f"the C compiler failed (exit {e.returncode}): {first.strip()[:200]}"
    if isinstance(e, OSError):
        return f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
    return str(e)


def status(isa: str) -> str:
    """The kernels' state for ``isa`` in one phrase, without building anything: what happened in this process,
    else what the cache holds (for ``attnmt --version``, ``attnmt list`` and the training start line)."""
    if isa in _status:
        return _status[isa]
    if not settings.current().cpu_kernels:
        return f"off ({SWITCH}=0)"
    try:
        compiler = _compiler()
    except Unavailable as e:
        return f"off ({e})"
    failure = _failure_file(cache_dir(), compiler, compile_flags(isa))
    if failure.exists():
        return f"off (an earlier build failed; delete {failure} to try again)"
    try:
        cached = _library_path(cache_dir(), compiler, compile_flags(isa), 10.0)
    except Unavailable as e:
        return f"off ({e})"
    if verified(cached):
        return f"built ({cached})"
    return f"built on first use with {' '.join(compiler)} into {cache_dir()}"


@functools.cache
def _kernel(cls: type, isa: str):
    """One ``cls(library(isa))`` per process, or None where the library cannot be had (see :func:`library`)."""
    lib = library(isa)
    return None if lib is None else cls(lib)


def step_attention(isa: str) -> CompiledStepAttention | None:
    """The compiled step attention for ``isa``, or None."""
    return _kernel(CompiledStepAttention, isa)


def scores(isa: str) -> CompiledScores | None:
    """The compiled score kernel for ``isa``, or None."""
    return _kernel(CompiledScores, isa)


def smoothed_loss(isa: str) -> CompiledSmoothedLoss | None:
    """The compiled loss kernel for ``isa``, or None."""
    return _kernel(CompiledSmoothedLoss, isa)


def training_attention(isa: str) -> CompiledTrainingAttention | None:
    """The compiled training attention for ``isa``, or None."""
    return _kernel(CompiledTrainingAttention, isa)


def dropout_masks(isa: str) -> CompiledDropout | None:
    """The compiled dropout for ``isa``, or None."""
    return _kernel(CompiledDropout, isa)


def clear() -> None:
    """Forget the loaded kernels and what was said about them (the next call builds or loads them again; for
    tests)."""
    library.cache_clear()
    _kernel.cache_clear()
    _status.clear()
    settings.mark_kernels_said(False)
