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
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from attnmt.errors import UserError
from attnmt.models.kernels import DecodingKernels
from attnmt.models.paths import AttentionPath, cached_output, heads_for_cache, kv_for_cache
from attnmt.registry import get


class LayerCache(AttentionPath):
    """One decoder layer's keys and values while decoding step by step; the path of the layer's attention calls.
    A cache implements ``self_attention`` and ``cross_attention`` on heads; ``attend`` is the glue to the model's
    projections (``models/paths.py``)."""

    def attend(self, attn, x, memory, mask, is_causal):
        """``attn`` from the newest positions ``x`` (R, T, D) under the cache's own masks: self-attention
        (``memory`` None) stores their keys/values and attends to each row's history; encoder-decoder attention
        projects ``memory``'s keys/values once per sentence (the cache calls back) and attends to them."""
        if memory is None:
            q, k, v = heads_for_cache(attn, *attn.split_qkv(attn.qkv_proj(x)))  # (R, H, T, Dh) each
            return cached_output(attn, self.self_attention(q, k, v))
        q = heads_for_cache(attn, attn.split_heads(attn.q_proj(x)))[0]
        return cached_output(attn, self.cross_attention(q, lambda m: kv_for_cache(attn, m), memory))

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

    A decoder call runs ``prepare`` once, then each layer with its own ``layers[i]`` (the path of its attention),
    then the final layer norm, then ``advance``.
    """

    length: int
    layers: list[LayerCache]
    runs_decoder = False  # the cache runs whole decoder steps itself (``run``), as a CUDA graph may

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


class Candidates(NamedTuple):
    """The target tokens a model's ``output_layer`` can give a finite logit, where it is only some of them (a
    vocabulary shortlist): ``ids`` (C,) sorted target ids of a vocabulary of ``vocab``."""

    ids: Tensor
    vocab: int

    def widen(self, logits: Tensor) -> Tensor:
        """Logits (..., C) of the candidates as logits (..., V) of the vocabulary, every other token at -inf."""
        out = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, logits)


class SearchModel(nn.Module, ABC):
    """What the search, inference and the plots call: a trained model, or an ensemble of them (``models/ensemble.py``).

    Search calls ``encode`` once, then per step ``decode_features`` + ``output_layer`` (or ``decode``) with the
    state ``new_cache`` made, and ``reorder`` to follow the hypotheses.
    """

    @abstractmethod
    def encode(self, src_tokens: Tensor, src_lengths: Tensor) -> Any:
        """The encoder output for right-padded ``src_tokens`` (B, S), in whatever form ``decode`` takes."""

    @abstractmethod
    def decode(self, prev_output_tokens: Tensor, enc: Any, cache: Any = None) -> Tensor:
        """Logits (R, T, V) of the next tokens; with ``cache``, only the newest tokens are given."""

    @abstractmethod
    def decode_features(self, prev_output_tokens: Tensor, enc: Any, cache: Any = None) -> Tensor:
        """``decode`` before the projection to the vocabulary: (R, T, D)."""

    @abstractmethod
    def output_layer(self, features: Tensor) -> Tensor:
        """Logits (..., V) of decoder features (..., D)."""

    def output_candidates(self) -> Candidates | None:
        """The tokens ``output_layer`` can give a finite logit, where it is only some (a vocabulary shortlist);
        None: every token."""
        return None

    def candidate_logits(self, features: Tensor) -> Tensor:
        """Logits (..., C) of ``output_candidates()``' tokens alone, in their order; ``output_layer``'s
        (..., V) where every token is a candidate. The search scores over them where its rules allow."""
        return self.output_layer(features)

    @abstractmethod
    def new_cache(self, beam: int = 1, kernels: DecodingKernels = DecodingKernels()) -> Any:
        """An empty cache; ``decode`` then takes ``beam`` consecutive rows per sentence of ``enc``, except on the
        first call, which may take one row per sentence (all hypotheses start alike; its keys/values serve all).
        ``kernels``: the backend's row padding and attention form."""

    def new_pool_cache(self, beam: int, kernels: DecodingKernels = DecodingKernels(), device: Any = "cpu") -> Any:
        """An empty cache of sentence places for a running search that sentences join (``admit(enc)``: their
        encoder output, before the call that first decodes them) and leave (``reorder``), each decoded at its own
        position, ``beam`` rows each; None where the model cannot be decoded that way (then it batches
        statically)."""
        return None

    @abstractmethod
    def reorder(self, enc: Any, cache: Any, new_order: Tensor,
                sentences: Tensor | None = None) -> tuple[Any, Any]:
        """Follow the search: row ``r`` of the next ``decode`` continues current row ``new_order[r]``;
        ``sentences``: the current sentences that stay (None: all; with beam 1, ``new_order``)."""

    @abstractmethod
    def max_positions(self) -> tuple[int, int]:
        """(source, target) length limits in tokens."""

    def num_parameters(self) -> int:
        """Trainable parameters, a shared matrix counted once."""
        return sum(p.numel() for p in self.parameters())


class EncoderDecoderModel(SearchModel):
    """A sequence-to-sequence model family: the search's contract, and what training calls.

    ``build`` makes it from its config and the dictionaries' sizes. Teacher-forced training calls ``forward``
    with ``features_only=True`` and the non-padding positions, then projects with ``output_projection_weight``
    inside the loss. Its ``new_cache`` is a :class:`DecoderCache`.
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


@runtime_checkable
class AttentionMaps(Protocol):
    """What a model offers for attention heat maps (``attnmt plot``), where it does: not part of the contract a
    model family must implement."""

    def cross_attention_weights(self, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor) -> Tensor:
        """Encoder-decoder attention weights (B, L, H, T, S) of every decoder layer and head, in eval mode."""


def unwrap(model: nn.Module) -> EncoderDecoderModel:
    """The model inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def build_model(name: str, cfg: Any, src_vocab: int, tgt_vocab: int, pad_idx: int, *,
                joint_vocab: bool) -> EncoderDecoderModel:
    """The registered model ``name`` built from ``cfg`` (what training and inference both call)."""
    cls = get("model", name).obj
    if not (isinstance(cls, type) and issubclass(cls, EncoderDecoderModel)):
        raise UserError(f"model '{name}' ({cls!r}) does not subclass attnmt.models.interface.EncoderDecoderModel; "
                        f"a registered model must implement that interface")
    return cls.build(cfg, src_vocab, tgt_vocab, pad_idx, joint_vocab=joint_vocab)
