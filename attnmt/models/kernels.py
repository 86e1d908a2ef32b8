"""The contracts between the model, the search and the loss on one side and a backend's kernels on the other.

A backend (``attnmt/backends/``) may give the model, the search or the training loss a kernel that computes one of
their steps faster on its hardware; each kernel implements one of these contracts, says with ``supports`` which
operands it takes, and computes what the plain PyTorch form computes, up to rounding. The model, the cache, the
search and the criterion hold a kernel only through these types and never ask which device they run on; the CPU's
compiled kernels (:mod:`attnmt.backends.native`) are the implementations today. The contracts sit in the model
layer, below the backends that implement them, so that the model never imports a backend.

* :class:`StepAttention`: a decoding step's attention over the slot cache; :class:`StepRows` says which rows are
  whose.
* :class:`ScoreKernel`: what a beam step needs of its logits (log-sum-exp, block maxima).
* :class:`TrainingAttention`: training's attention heads, forward and backward.
* :class:`DropoutMasks`: dropout whose mask is a function of a seed and the element's index.
* :class:`LossKernel` and :data:`Projection`: the label-smoothed loss's pass over the logits, the vocabulary
  projection's product.
* :class:`DecodingKernels`: how a search step runs on a device, the bundle of the above a backend hands the search.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from attnmt.models.packing import SentenceRows

RowBucket = Callable[[int], int]  # rows -> the row count a decoder call is padded to (the backend's choice)


@dataclass(frozen=True)
class StepRows:
    """Which sentence of a step cache's buffers each query row of a decoding step belongs to.

    ``count``: the live rows (the first rows of the call; padding rows may follow); ``per_sentence``: consecutive
    rows per sentence in this call (the beam, or 1 on the first step); ``live``: (A,) int64, the buffered index of
    each live sentence (None: row ``r`` belongs to sentence ``r // per_sentence``); ``beam``: slots per position
    in the self-attention buffers.
    """

    count: int
    per_sentence: int
    live: Tensor | None
    beam: int


class StepAttention(ABC):
    """One decoding step's attention over a slot cache's buffers (``attnmt/models/incremental.py``) in one call:
    a backend's kernel, in place of the batched matmul-softmax-matmul under a mask.

    Both methods take the step's queries ``q`` (rows, H, 1, Dh) and return the heads concatenated, (rows, 1, H *
    Dh), the rows past ``rows.count`` zero. Buffers are (N, H, slots, Dh), contiguous.
    """

    @abstractmethod
    def supports(self, q: Tensor) -> bool:
        """Whether the kernel takes queries like ``q`` (their dtype and layout)."""

    @abstractmethod
    def self_attention(self, q: Tensor, k: Tensor, v: Tensor, k_buf: Tensor, v_buf: Tensor, rows: StepRows,
                       position: int | Tensor, ancestors: Tensor | None, ancestor_rows: int) -> Tensor:
        """Write the step's keys/values ``k``/``v`` (rows, H, 1, Dh) of row ``r`` to slot ``position * beam + r %
        per_sentence``, then attend from each row to its history: position ``s`` <= ``position`` in slot ``s *
        beam + ancestors[r * ancestor_rows, s]`` (int32; None with beam 1: slot ``s``). ``position``: the step's,
        or (N,) int64, one per buffered sentence, when the sentences are at different steps (continuous
        batching)."""

    @abstractmethod
    def cross_attention(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, rows: StepRows,
                        keep: Tensor | None) -> Tensor:
        """Attend from each row to its sentence's encoder keys/values; ``keep`` (N, S) bool, False = padding
        (None: no padding)."""


class TrainingAttention(ABC):
    """Multi-head attention's heads, softmax(Q K^T / sqrt(d_k)) V, with the backward pass, each in one call (a
    backend's kernel), in place of splitting the heads, the plain matmul-softmax-matmul (``plain_attention`` in
    ``models/transformer.py``, without dropout) and concatenating them: the same value up to rounding.

    Q, K and V are read where the projections wrote them, one row per position with the heads side by side:
    ``q`` (R, C) holds Q in its first H * Dh columns and, for self-attention (``kv`` None), K and V in the next
    two blocks of H * Dh; otherwise ``kv`` (R_k, 2 H Dh) holds K then V. ``queries`` and ``keys`` say which rows
    hold each sentence's positions (:class:`~attnmt.models.packing.SentenceRows`; self-attention passes the
    same for both); ``mask`` (B, 1, 1, S) bool (True = attend, S = ``keys.longest``) or None; ``is_causal``:
    query i sees keys up to i."""

    @abstractmethod
    def supports(self, q: Tensor, kv: Tensor | None, heads: int, keys: SentenceRows, mask: Tensor | None) -> bool:
        """Whether the kernel takes these operands (dtype, device, sizes, layout)."""

    @abstractmethod
    def attend(self, q: Tensor, kv: Tensor | None, heads: int, queries: SentenceRows, keys: SentenceRows,
               mask: Tensor | None, is_causal: bool) -> Tensor:
        """Concat(head_1..head_H) (R, H * Dh), rows as ``q``'s, differentiable in ``q`` and ``kv``."""


class DropoutMasks(ABC):
    """Dropout whose mask is a function of a seed and each element's index (a backend's kernel): ``x + keep * y *
    scale`` in one pass, where element e is kept when 15 bits drawn from (seed, e) are >= ``threshold`` (P(drop) =
    threshold / 2^15, scale = 2^15 / (2^15 - threshold)). The backward pass is the same call on the gradient,
    with the same seed and no ``x``: no mask is stored."""

    @abstractmethod
    def supports(self, y: Tensor, x: Tensor | None) -> bool:
        """Whether the kernel takes these operands (dtype, device, layout)."""

    @abstractmethod
    def apply(self, x: Tensor | None, y: Tensor, threshold: int, scale: float, seed: int) -> Tensor:
        """``x + keep * y * scale`` (``keep * y * scale`` without ``x``), a new tensor shaped as ``y``."""


class ScoreKernel(ABC):
    """What a beam search step needs of its logits, in one pass over them: each row's log-sum-exp and the maxima
    of its vocabulary blocks after a per-token bias (a backend's kernel). The candidate selection then reads the
    log-probabilities of a few blocks only, and the (rows, V) log-probabilities are never written."""

    @abstractmethod
    def supports(self, logits: Tensor) -> bool:
        """Whether the kernel takes logits like these (dtype, layout)."""

    @abstractmethod
    def logsumexp_blocks(self, logits: Tensor, bias: Tensor | None, block: int) -> tuple[Tensor, Tensor]:
        """For logits (R, V) and a bias (V,) float32 (None: none): the maxima of ``logits + bias`` over each of the
        ``V // block`` whole blocks of ``block`` tokens, (R, V // block), and ``logsumexp(logits)`` per row, (R,),
        both float32."""


BlockMaxima = Callable[[Tensor, int, bool], Tensor]  # (x (R, n * c), n, nonpositive) -> the maxima of n blocks (R, n)


@dataclass(frozen=True)
class DecodingKernels:
    """How a search step runs on a device: the backend's choice (``Backend.decoding_kernels``); the cache and the
    search call what they are given and check no device.

    ``row_bucket``: rows -> the row count a decoder step is padded to (None: no padding); ``fused_attention``: the
    cache attends with ``scaled_dot_product_attention`` (one fused kernel) instead of matmul-softmax-matmul;
    ``blockwise_topk``: pick the best extensions by a max scan over vocabulary blocks and a top-k over the few
    best blocks (on the CPU several times faster than ``torch.topk`` over ``beam x vocabulary``) rather than one
    ``topk`` (the GPU's own kernel); ``low_precision_scores``: a bf16 model's log-probabilities stay bf16
    (computed in fp32, rounded), halving the CPU's memory traffic for the step, instead of fp32. Row padding,
    the attention form and the candidate selection never change a result beyond rounding. ``step_attention``:
    a kernel for one-token steps (:class:`StepAttention`; the CPU's compiled one), used where it ``supports`` the
    queries; the matmul or fused form otherwise. ``scores``: a :class:`ScoreKernel` for the blockwise selection
    (the CPU's compiled one), used where it ``supports`` the logits; ``log_softmax`` and block maxima otherwise.
    ``block_maxima``: how those maxima are taken (None: ``amax`` over each block; the CPU's reads bf16
    log-probabilities as integers).
    ``step_graphs``: beam search keeps a cache of fixed shapes for the whole batch
    (:class:`~attnmt.models.static_cache.StaticCache`), whose steps the recorder this makes (one per cache:
    a CUDA device's captures them once as a graph and replays them, one launch a step instead of a few dozen;
    :class:`EagerSteps` runs them as they are) runs: the same translations up to rounding. None: the slot cache.
    ``score_rows``: about how many rows a step projects to the vocabulary and scores at a time (whole sentences):
    few on a CPU, so that the logits stay in cache and their memory is reused; on a GPU all the batch's at once,
    where every block costs its own few dozen kernel launches. Each sentence's numbers are the same either way.
    """

    row_bucket: RowBucket | None = None
    score_rows: int = 256
    fused_attention: bool = False
    step_attention: StepAttention | None = None
    scores: ScoreKernel | None = None
    blockwise_topk: bool = True
    low_precision_scores: bool = True
    block_maxima: BlockMaxima | None = None
    step_graphs: Callable[[], StepRecorder] | None = None


class StepRecorder(ABC):
    """How a cache of fixed shapes runs its decoding steps (a backend's: ``DecodingKernels.step_graphs``)."""

    @abstractmethod
    def record(self, step: Callable[[], None]) -> Callable[[], None] | None:
        """Run ``step`` (a function of the cache's buffers alone, the same work at every call) once; return what
        replays it on the buffers' new contents, or None where it is to be run again as it is."""


class EagerSteps(StepRecorder):
    """Every step run as it is (what a device without graphs does)."""

    def record(self, step: Callable[[], None]) -> None:
        step()
        return None


Projection = Callable[[Tensor, Tensor], Tensor]  # (a, b) -> a @ b^T


class LossKernel(ABC):
    """A compiled form of the loss's pass over the logits (the CPU backend's, ``attnmt/backends/native.py``):
    what :func:`_loss_rows` and the target's term compute, in one call."""

    @abstractmethod
    def supports(self, logits: Tensor) -> bool:
        """Whether :meth:`smoothed_rows` takes these logits (device, dtype, layout)."""

    @abstractmethod
    def smoothed_rows(self, logits: Tensor, target: Tensor, epsilon: float, lp_y: Tensor,
                      lp_sum: Tensor, grad: Tensor | None) -> None:
        """For logits (R, V) and target (R,): ``lp_y`` (R values) = log p(y), ``lp_sum`` = sum_v log p(v) (fp32),
        and when ``grad`` (R, V, the logits' dtype; may be ``logits`` itself) is given, the whole gradient
        ``softmax - q`` of the smoothed loss, the target's ``- (1 - eps)`` included."""
