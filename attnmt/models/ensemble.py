"""Ensembles (``--path a.pt:b.pt``): several models of one vocabulary searched as one.

At every step the members' next-token distributions are averaged (fairseq's rule): the ensemble's log-probability of
token ``y`` is ``log(mean_i p_i(y))``. The search sees an ordinary :class:`SearchModel`: its "features" are
the members' decoder features side by side, and ``output_layer`` turns them into the averaged log-probabilities
(already normalised, so the search's log-softmax leaves them as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnmt.models.interface import EncoderDecoderModel, SearchModel
from attnmt.models.kernels import DecodingKernels


@dataclass
class EnsembleCache:
    """One decoder cache per member (each member's decoder reads only its own)."""

    members: list

    @property
    def length(self) -> int:
        return self.members[0].length


class Ensemble(SearchModel):
    """The average of ``models``' distributions; every member must share the dictionaries. It is searched and
    translated with, not trained: it implements the search's contract (:class:`SearchModel`) only."""

    def __init__(self, models: list[EncoderDecoderModel]):
        super().__init__()
        if len(models) < 2:
            raise ValueError("an ensemble needs at least two models")
        self.members = nn.ModuleList(models)
        self.widths = [int(m.output_projection_weight().size(1)) for m in models]

    def _average(self, log_probs: list[Tensor]) -> Tensor:
        return torch.logsumexp(torch.stack(log_probs), dim=0) - math.log(len(log_probs))

    def encode(self, src_tokens: Tensor, src_lengths: Tensor) -> list:
        return [m.encode(src_tokens, src_lengths) for m in self.members]

    def decode_features(self, prev_output_tokens: Tensor, enc: list, cache: EnsembleCache | None = None) -> Tensor:
        caches = cache.members if cache is not None else [None] * len(self.members)
        return torch.cat([m.decode_features(prev_output_tokens, e, c)
                          for m, e, c in zip(self.members, enc, caches)], dim=-1)

    def output_layer(self, features: Tensor) -> Tensor:
        parts = features.split(self.widths, dim=-1)
        return self._average([torch.log_softmax(m.output_layer(f).float(), dim=-1)
                              for m, f in zip(self.members, parts)])

    def decode(self, prev_output_tokens: Tensor, enc: list, cache: EnsembleCache | None = None) -> Tensor:
        return self.output_layer(self.decode_features(prev_output_tokens, enc, cache))

    def new_cache(self, beam: int = 1, kernels: DecodingKernels = DecodingKernels()) -> EnsembleCache:
        return EnsembleCache([m.new_cache(beam, kernels) for m in self.members])

    def reorder(self, enc: list, cache: EnsembleCache | None, new_order: Tensor,
                sentences: Tensor | None = None) -> tuple[list, EnsembleCache | None]:
        caches = cache.members if cache is not None else [None] * len(self.members)
        pairs = [m.reorder(e, c, new_order, sentences) for m, e, c in zip(self.members, enc, caches)]
        return [p[0] for p in pairs], (EnsembleCache([p[1] for p in pairs]) if cache is not None else None)

    def max_positions(self) -> tuple[int, int]:
        limits = [m.max_positions() for m in self.members]
        return min(s for s, _ in limits), min(t for _, t in limits)

    def cross_attention_weights(self, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor) -> Tensor:
        from attnmt.models.attention_maps import attention_maps_of

        weights = [attention_maps_of(m)(src_tokens, src_lengths, prev_output_tokens) for m in self.members]
        if len({w.shape for w in weights}) > 1:
            raise ValueError("the ensemble's members have different layers or heads; plot one member's attention")
        return torch.stack(weights).mean(dim=0)
