"""Beam search and greedy decoding (beam 1), with the GNMT length penalty and an exact early stop.

See :mod:`attnmt.generation.search` for the scores, length limits and the early-stopping bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from attnmt.generation.search import (
    NEG_INF,
    Finished,
    Hypothesis,
    SearchConfig,
    SearchStrategy,
    Symbols,
    finalize,
    max_lengths,
    max_target_positions,
    next_token_extensions,
    score_upper_bound,
    start_rows,
)
from attnmt.models.interface import DecodingKernels, EncoderDecoderModel
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
    """Beam search (--beam N; greedy decoding with --beam 1), GNMT length penalty, exact or fairseq-style stop."""

    def __call__(self, model, src_tokens, src_lengths, sym, sample_ids=None, kernels=DecodingKernels()):
        run = greedy_search if self.cfg.beam == 1 else beam_search
        return run(model, src_tokens, src_lengths, self.cfg, sym, kernels=kernels)


@torch.inference_mode()
def beam_search(model: EncoderDecoderModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig,
                sym: Symbols, kernels: DecodingKernels = DecodingKernels()) -> list[list[Hypothesis]]:
    """Beam search with the GNMT length penalty and a per-sentence, exact early stop.

    Each step scores all ``beam * vocab`` extensions of a sentence's live hypotheses at once and keeps the best
    ``2 * beam``: the EOS ones among them are finished (at most one per beam, so at least ``beam`` others remain),
    the best ``beam`` others stay live. A sentence leaves the batch (its rows of encoder output and cache are
    dropped) as soon as its n-best list is final; the search ends when none is left.
    """
    dev = src_tokens.device
    B, K = src_tokens.size(0), cfg.beam
    max_len = max_lengths(src_lengths.to(dev), cfg, max_target_positions(model))
    enc, cache = model.encode(src_tokens, src_lengths), model.new_cache(K, kernels)  # encoder: once a sentence
    T = int(max_len.max()) + 2
    tokens = torch.full((B * K, T), sym.eos, dtype=torch.long, device=dev)  # column 0: the decoder's start EOS
    pos_scores = torch.zeros((B * K, T), dtype=torch.float32, device=dev)
    scores = torch.full((B, K), NEG_INF, device=dev)
    scores[:, 0] = 0.0  # all beams start identical: keep only the first one alive at step 0
    kth_best = torch.full((B,), NEG_INF, device=dev)
    sent_ids = list(range(B))
    finished = Finished(B, cfg.nbest)
    bonus = max(0.0, -cfg.unkpen)
    A = B
    arange_a = torch.arange(A, device=dev)
    beam_stop = _options(cfg).early_stop == "beam"
    top_eos = torch.zeros(A, dtype=torch.long, device=dev)  # per sentence, for beam_stop
    for step in range(T - 1):
        top_s, top_lp, beam_i, tok = next_token_extensions(model, tokens, step, enc, cache, max_len.repeat_interleave(K),
                                                           scores.view(-1), K, cfg, sym, kernels)  # (A, C) each
        is_eos = tok == sym.eos
        fin = is_eos & (top_s > NEG_INF)
        if beam_stop:  # fairseq's rule: only EOS extensions among the `beam` best finish a hypothesis
            fin[:, K:] = False
        if bool(fin.any()):
            local, c = fin.nonzero(as_tuple=True)
            finalize(finished, kth_best, sent_ids, local, local * K + beam_i[local, c], tokens, pos_scores, step,
                      top_lp[local, c], top_s[local, c], cfg.length_penalty, sym.eos)
        C = top_s.size(1)
        sel = (is_eos.long() * C + torch.arange(C, device=dev)).topk(K, dim=1, largest=False).indices
        new_s, new_tok, new_lp = top_s.gather(1, sel), tok.gather(1, sel), top_lp.gather(1, sel)
        src_rows = (arange_a * K)[:, None] + beam_i.gather(1, sel)
        done = score_upper_bound(new_s[:, 0], step + 1, max_len, cfg.length_penalty, bonus) <= kth_best
        if beam_stop:  # fairseq's rule: `beam` EOS hypotheses ranked among the `beam` best extensions
            top_eos += fin[:, :K].sum(dim=1)
            done |= top_eos >= K
        keep = None
        if bool(done.any()):
            keep = (~done).nonzero(as_tuple=True)[0]
            if keep.numel() == 0:
                break
            src_rows, new_s, new_tok, new_lp = src_rows[keep], new_s[keep], new_tok[keep], new_lp[keep]
            kth_best, max_len, top_eos = kth_best[keep], max_len[keep], top_eos[keep]
            sent_ids = [sent_ids[i] for i in keep.tolist()]
            A = keep.numel()
            arange_a = torch.arange(A, device=dev)
        order = src_rows.reshape(-1)
        tokens = tokens[order]
        tokens[:, step + 1] = new_tok.reshape(-1)
        pos_scores = pos_scores[order]
        pos_scores[:, step] = new_lp.reshape(-1)
        scores = new_s
        enc, cache = model.reorder(enc, cache, order, keep)
    return finished.hyps


@torch.inference_mode()
def greedy_search(model: EncoderDecoderModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig,
                  sym: Symbols, kernels: DecodingKernels = DecodingKernels()) -> list[list[Hypothesis]]:
    """Beam search with beam 1, without the beam bookkeeping: the same arithmetic, so exactly the same output.

    As in beam search, an EOS among the two best extensions finishes a hypothesis and the best non-EOS one stays
    live; with a length penalty that live one may still win, so the search goes on until the early-stopping bound
    rules it out. The cache is only reordered when sentences leave the batch.
    """
    if cfg.nbest != 1:
        raise ValueError("greedy search returns one hypothesis per sentence; use --beam N for --nbest N")
    dev = src_tokens.device
    B = src_tokens.size(0)
    max_len = max_lengths(src_lengths.to(dev), cfg, max_target_positions(model))
    enc, cache = start_rows(model, src_tokens, src_lengths, 1, kernels)
    T = int(max_len.max()) + 2
    tokens = torch.full((B, T), sym.eos, dtype=torch.long, device=dev)
    pos_scores = torch.zeros((B, T), dtype=torch.float32, device=dev)
    scores = torch.zeros((B,), device=dev)
    kth_best = torch.full((B,), NEG_INF, device=dev)
    sent_ids = list(range(B))
    finished = Finished(B, 1)
    bonus = max(0.0, -cfg.unkpen)
    beam_stop = _options(cfg).early_stop == "beam"
    for step in range(T - 1):
        # the same arithmetic as beam search with one beam
        top_s, top_lp, _, top_i = next_token_extensions(model, tokens, step, enc, cache, max_len, scores, 1, cfg, sym,
                                                        kernels)
        is_eos = top_i == sym.eos
        fin = is_eos & (top_s > NEG_INF)
        if beam_stop:  # fairseq's rule: only the best extension can finish
            fin[:, 1:] = False
        if bool(fin.any()):
            local, c = fin.nonzero(as_tuple=True)
            finalize(finished, kth_best, sent_ids, local, local, tokens, pos_scores, step, top_lp[local, c],
                      top_s[local, c], cfg.length_penalty, sym.eos)
        pick = is_eos[:, :1].long()  # the first non-EOS of the two
        new_s, new_tok, new_lp = top_s.gather(1, pick)[:, 0], top_i.gather(1, pick)[:, 0], top_lp.gather(1, pick)[:, 0]
        done = score_upper_bound(new_s, step + 1, max_len, cfg.length_penalty, bonus) <= kth_best
        if beam_stop:  # fairseq's rule with beam 1: EOS is the best extension
            done |= fin[:, 0]
        if bool(done.any()):
            keep = (~done).nonzero(as_tuple=True)[0]
            if keep.numel() == 0:
                break
            new_s, new_tok, new_lp = new_s[keep], new_tok[keep], new_lp[keep]
            kth_best, max_len = kth_best[keep], max_len[keep]
            sent_ids = [sent_ids[i] for i in keep.tolist()]
            tokens, pos_scores = tokens[keep], pos_scores[keep]
            enc, cache = model.reorder(enc, cache, keep, keep)
        tokens[:, step + 1] = new_tok
        pos_scores[:, step] = new_lp
        scores = new_s
    return finished.hyps
