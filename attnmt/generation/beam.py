"""Beam search and greedy decoding (beam 1), with the GNMT length penalty and an exact early stop.

See :mod:`attnmt.generation.search` for the scores, length limits and the early-stopping bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from attnmt.generation.search import Hypothesis, SearchConfig, SearchStrategy, Symbols, next_token_extensions
from attnmt.models.interface import SearchModel
from attnmt.models.kernels import DecodingKernels
from attnmt.registry import register


@dataclass
class BeamSearchConfig:
    """Options of beam search."""

    early_stop: Literal["exact", "beam"] = field(default="exact", metadata={
        "help": "When a sentence stops: exact (once no live hypothesis can beat its n-best list: the result of an "
                "unbounded search) or beam (also once --beam hypotheses ending in EOS have ranked among the --beam best "
                "extensions of a step, as fairseq and CTranslate2 stop; as in fairseq, only EOS extensions among "
                "those --beam best finish a hypothesis: fewer decoder steps, but a hypothesis that would have scored "
                "higher can be missed)."})


def _options(cfg: SearchConfig) -> BeamSearchConfig:
    return BeamSearchConfig() if cfg.options is None else cfg.options


@register("search", "beam", config=BeamSearchConfig)
class BeamSearch(SearchStrategy):
    """Beam search (--beam N; greedy decoding with --beam 1), GNMT length penalty, exact or fairseq-style stop.

    Each step scores all ``beam * vocab`` extensions of a sentence's live hypotheses at once and keeps the best
    ``2 * beam`` (:func:`~attnmt.generation.search.next_token_extensions`): the EOS ones among them are finished
    (at most one per beam, so at least ``beam`` others remain), the best ``beam`` others stay live. A sentence
    leaves the batch as soon as its n-best list is final. With beam 1 this is greedy decoding: the same
    arithmetic, one row per sentence. Note that this is not plain argmax decoding: an EOS among the two best
    extensions finishes a hypothesis and the best non-EOS one stays live; with a length penalty that live one may
    still win, so the search goes on until the early-stopping bound rules it out.
    """

    def __init__(self, cfg: SearchConfig):
        super().__init__(cfg)
        self.beam_stop = _options(cfg).early_stop == "beam"
        self.top_eos = torch.zeros(0, dtype=torch.long)  # per unit: EOS hypotheses among the beam best (beam_stop)

    def start(self, model, src_tokens, src_lengths, kernels, sample_ids):
        self.top_eos = torch.zeros(src_tokens.size(0), dtype=torch.long, device=src_tokens.device)
        return super().start(model, src_tokens, src_lengths, kernels, sample_ids)

    def add_units(self, n: int, device: torch.device) -> None:
        self.top_eos = torch.cat([self.top_eos.to(device), torch.zeros(n, dtype=torch.long, device=device)])

    def candidates(self, model, tokens, step, enc, cache, max_len, scores, sym, kernels):
        return next_token_extensions(model, tokens, step, enc, cache, max_len, scores, self.cfg.beam, self.cfg, sym,
                                     kernels, self.rules)

    def finishing(self, fin: Tensor) -> Tensor:
        if self.beam_stop:  # fairseq's rule: only EOS extensions among the `beam` best finish a hypothesis
            fin[:, self.cfg.beam:] = False
        return fin

    def done(self, step, best, fin, max_len, kth_best):
        done = super().done(step, best, fin, max_len, kth_best)
        if self.beam_stop:  # fairseq's rule: `beam` EOS hypotheses ranked among the `beam` best extensions
            self.top_eos += fin[:, :self.cfg.beam].sum(dim=1)
            done |= self.top_eos >= self.cfg.beam
        return done

    def keep_units(self, keep: Tensor) -> None:
        self.top_eos = self.top_eos[keep]


def beam_search(model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig,
                sym: Symbols, kernels: DecodingKernels = DecodingKernels()) -> list[list[Hypothesis]]:
    """Beam search with the GNMT length penalty and a per-sentence, exact early stop (:class:`BeamSearch`)."""
    return BeamSearch(cfg)(model, src_tokens, src_lengths, sym, kernels=kernels)


def greedy_search(model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig,
                  sym: Symbols, kernels: DecodingKernels = DecodingKernels()) -> list[list[Hypothesis]]:
    """Beam search with beam 1 (greedy decoding): the same loop and arithmetic, hence exactly the same output."""
    if cfg.nbest != 1:
        raise ValueError("greedy search returns one hypothesis per sentence; use --beam N for --nbest N")
    return BeamSearch(dataclasses.replace(cfg, beam=1))(model, src_tokens, src_lengths, sym, kernels=kernels)
