"""The contracts between a model and the code that drives it.

The training criterion, the search, inference and the plots call a model only through
:class:`EncoderDecoderModel`; the decoder layers call their step-by-step state only through
:class:`DecoderCache` and :class:`LayerCache`. A new model family implements these and plugs in (``@register("model",
...)``) without any caller having to learn about it; nothing inspects a model's signature or probes its attributes.

Shapes: B sentences, S source tokens, T target tokens, D decoder width, V target vocabulary, R decoder rows
(``beam`` consecutive rows per sentence when searching).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

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
                       position: int, ancestors: Tensor | None, ancestor_rows: int) -> Tensor:
        """Write the step's keys/values ``k``/``v`` (rows, H, 1, Dh) of row ``r`` to slot ``position * beam + r %
        per_sentence``, then attend from each row to its history: position ``s`` <= ``position`` in slot ``s *
        beam + ancestors[r * ancestor_rows, s]`` (int32; None with beam 1: slot ``s``)."""

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


class LayerCache(ABC):
    """One decoder layer's keys and values while decoding step by step."""

    @abstractmethod
    def self_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this call's keys/values (R, H, T, Dh), attend from ``q`` (R, H, T, Dh) to the row's history;
        returns the heads concatenated, (R, T, H * Dh)."""

    @abstractmethod
    def cross_attention(self, q: Tensor, project_kv: Callable[[Tensor], tuple[Tensor, Tensor]],
                        memory: Tensor) -> Tensor:
        """Attend from ``q`` (R, H, T, Dh) to the encoder output ``memory``; ``project_kv(memory)`` gives its
        keys/values (computed once). Returns (R, T, H * Dh)."""


class DecoderCache(ABC):
    """The decoder's state between steps: ``length`` target tokens decoded so far, one :class:`LayerCache` a layer.

    A decoder call runs ``prepare`` once, then each layer with its own ``layers[i]``, then ``advance``.
    """

    length: int
    layers: list[LayerCache]

    @abstractmethod
    def prepare(self, x: Tensor, memory: Tensor, memory_padding: Tensor,
                mask_of: Callable[[Tensor], Tensor | None]) -> tuple[Tensor, Tensor | None]:
        """Start a call on the new positions' inputs ``x`` (R, T, D) for the encoder output ``memory`` (N, S, D)
        with padding ``memory_padding`` (N, S); ``mask_of(padding)`` makes the attention mask. Returns the rows
        the layers run on (possibly padded) and the memory mask."""

    @abstractmethod
    def advance(self, x: Tensor, new_tokens: int, rows: int) -> Tensor:
        """End a call of ``new_tokens`` positions: count them, return the first ``rows`` rows of ``x``."""

    @abstractmethod
    def reorder(self, new_order: Tensor, sentences: Tensor | None = None) -> Tensor | None:
        """Row ``r`` of the next call continues current row ``new_order[r]``; ``sentences``: the sentences that stay.
        Returns the sentences the encoder output must be reduced to, or None when it stays as it is."""


class EncoderDecoderModel(nn.Module, ABC):
    """A sequence-to-sequence model: what training, search, inference and analysis call.

    ``build`` makes it from its config and the dictionaries' sizes. Teacher-forced training calls ``forward``
    with ``features_only=True`` and the non-padding positions, then projects with ``output_projection_weight``
    inside the loss. Search calls ``encode`` once, then per step ``decode_features`` + ``output_layer`` (or
    ``decode``) with a cache from ``new_cache``, and ``reorder`` to follow the beams.
    """

    @classmethod
    @abstractmethod
    def build(cls, cfg: Any, src_vocab: int, tgt_vocab: int, pad_idx: int, *, joint_vocab: bool) -> EncoderDecoderModel:
        """The model for dictionaries of ``src_vocab`` / ``tgt_vocab`` symbols (``joint_vocab``: one shared one)."""

    @abstractmethod
    def forward(self, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor,
                output_mask: Tensor | None = None, features_only: bool = False) -> Tensor:
        """Teacher-forced logits (B, T, V); (N, V) for the positions where ``output_mask`` (B, T) is True; with
        ``features_only`` the decoder output before the projection, (B, T, D) or (N, D)."""

    @abstractmethod
    def output_projection_weight(self) -> Tensor:
        """The (V, D) weight of the projection to the vocabulary (no bias): logits = features @ weight.T."""

    @abstractmethod
    def encode(self, src_tokens: Tensor, src_lengths: Tensor) -> Any:
        """The encoder output for right-padded ``src_tokens`` (B, S), in whatever form ``decode`` takes."""

    @abstractmethod
    def decode(self, prev_output_tokens: Tensor, enc: Any, cache: DecoderCache | None = None) -> Tensor:
        """Logits (R, T, V) of the next tokens; with ``cache``, only the newest tokens are given."""

    @abstractmethod
    def decode_features(self, prev_output_tokens: Tensor, enc: Any, cache: DecoderCache | None = None) -> Tensor:
        """``decode`` before the projection to the vocabulary: (R, T, D)."""

    @abstractmethod
    def output_layer(self, features: Tensor) -> Tensor:
        """Logits (..., V) of decoder features (..., D)."""

    @abstractmethod
    def new_cache(self, beam: int = 1, kernels: DecodingKernels = DecodingKernels()) -> DecoderCache:
        """An empty cache; ``decode`` then takes ``beam`` consecutive rows per sentence of ``enc``, except on the
        first call, which may take one row per sentence (all hypotheses start alike; its keys/values serve all).
        ``kernels``: the backend's row padding and attention form."""

    @abstractmethod
    def reorder(self, enc: Any, cache: DecoderCache | None, new_order: Tensor,
                sentences: Tensor | None = None) -> tuple[Any, DecoderCache | None]:
        """Follow the search: row ``r`` of the next ``decode`` continues current row ``new_order[r]``;
        ``sentences``: the current sentences that stay (None: all; with beam 1, ``new_order``)."""

    @abstractmethod
    def max_positions(self) -> tuple[int, int]:
        """(source, target) length limits in tokens."""

    @abstractmethod
    def cross_attention_weights(self, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor) -> Tensor:
        """Encoder-decoder attention weights (B, L, H, T, S) of every decoder layer and head, in eval mode."""

    def num_parameters(self) -> int:
        """Trainable parameters, a shared matrix counted once."""
        return sum(p.numel() for p in self.parameters())


def unwrap(model: nn.Module) -> EncoderDecoderModel:
    """The model inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def build_model(name: str, cfg: Any, src_vocab: int, tgt_vocab: int, pad_idx: int, *,
                joint_vocab: bool) -> EncoderDecoderModel:
    """The registered model ``name`` built from ``cfg`` (what training and inference both call)."""
    from attnmt.errors import UserError
    from attnmt.registry import get

    cls = get("model", name).obj
    if not (isinstance(cls, type) and issubclass(cls, EncoderDecoderModel)):
        raise UserError(f"model '{name}' ({cls!r}) does not subclass attnmt.models.interface.EncoderDecoderModel; "
                        f"a registered model must implement that interface")
    return cls.build(cfg, src_vocab, tgt_vocab, pad_idx, joint_vocab=joint_vocab)
