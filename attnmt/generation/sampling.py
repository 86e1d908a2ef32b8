"""Sampling (``--search sampling`` or ``--sampling``): ``--beam`` samples per sentence from the model's distribution,
filtered (top-k, top-p) and tempered, with randomness that does not depend on batching."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnmt.generation.search import (
    NEG_INF,
    Hypothesis,
    SearchConfig,
    SearchStrategy,
    Symbols,
    start_rows,
    step_log_probs,
)
from attnmt.models.interface import SearchModel
from attnmt.models.kernels import DecodingKernels
from attnmt.registry import register


@dataclass
class SamplingConfig:
    """Options of sampling."""

    sampling_topk: int = field(default=0, metadata={"min": 0, "help": "Sample from the k most probable tokens only (0: all)."})
    sampling_topp: float = field(default=1.0, metadata={"above": 0, "max": 1,
        "help": "Sample from the smallest set of tokens whose probability reaches p (1.0: all)."})
    temperature: float = field(default=1.0, metadata={"above": 0, "help": "Sampling temperature (scores stay model log-probs)."})
    seed: int = field(default=1, metadata={"min": 0, "max": 2**32 - 1, "help": "Seed for --sampling; a sentence's samples depend on it and its index."})

    def __post_init__(self):
        if self.sampling_topk < 0:
            raise ValueError(f"--sampling-topk must not be negative, got {self.sampling_topk}")
        if not 0.0 < self.sampling_topp <= 1.0:
            raise ValueError(f"--sampling-topp must be in (0, 1], got {self.sampling_topp}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be positive, got {self.temperature}")


def _options(cfg: SearchConfig) -> SamplingConfig:
    return SamplingConfig() if cfg.options is None else cfg.options


_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values below 2**32."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _sample_keys(seed: int, sample_ids: Tensor, copy: Tensor) -> Tensor:
    """One random stream per (seed, sentence id, sample number): independent of batching."""
    h = _mix32(torch.full_like(sample_ids, seed & _M32))
    h = _mix32(h ^ (sample_ids & _M32))
    return _mix32(h ^ copy)


def _gumbel_noise(keys: Tensor, step: int, tokens: Tensor) -> Tensor:
    """Gumbel(0, 1) noise (R, W) for the token ids ``tokens`` ((1, V) or (R, W)) from counter-based uniforms: a
    pure function of (key, step, token), so noise drawn for some tokens equals the noise of a full draw there."""
    h = _mix32(keys ^ step)
    tok = (tokens * 0x9E3779B1) & _M32
    bits = _mix32(h[:, None] ^ tok) >> 8  # 24 uniform bits: exact in float32
    u = (bits.float() + 0.5) * (2.0 ** -24)
    return -torch.log(-torch.log(u))


def _filter_logits(logits: Tensor, topk: int, topp: float) -> Tensor:
    """Keep the ``topk`` best tokens and the smallest set reaching probability ``topp``; the rest get -inf."""
    if topk and topk < logits.size(1):
        kth = logits.topk(topk, dim=1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if topp < 1.0:
        probs = torch.softmax(logits, dim=1)
        sorted_p, order = probs.sort(dim=1, descending=True)
        drop_sorted = (sorted_p.cumsum(dim=1) - sorted_p) >= topp  # the mass before this token already reaches p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


# Top-p keeps few tokens of a trained model's distribution: look for them among each row's best this many first.
_TOPP_WIDTH = 256


def _full_draw(logits: Tensor, keys: Tensor, step: int, topp: float) -> Tensor:
    """Gumbel-max over the whole vocabulary: the top-p filtered logits plus noise for every token."""
    tokens = torch.arange(logits.size(1), device=logits.device, dtype=torch.long)[None, :]
    return (_filter_logits(logits, 0, topp) + _gumbel_noise(keys, step, tokens)).argmax(dim=1)


def _draw(logits: Tensor, keys: Tensor, step: int, topk: int, topp: float) -> Tensor:
    """One token per row: argmax of the filtered logits plus Gumbel noise (the Gumbel-max trick).

    A filtered-out token (-inf) never wins, so under top-p a row whose best ``_TOPP_WIDTH`` tokens reach p (a
    token is dropped once the mass before it reaches p, so every later one is) draws noise for those tokens only:
    the choice of a draw over the whole vocabulary (up to the rounding of the mass at the boundary p), without
    hashing rows x vocabulary counters every step. The other rows (a flat distribution) draw over the whole
    vocabulary.
    """
    if topk and topk < logits.size(1):
        logits = _filter_logits(logits, topk, 1.0)
    if topp >= 1.0:
        return _full_draw(logits, keys, step, topp)
    top_p, order = torch.softmax(logits, dim=1).topk(min(_TOPP_WIDTH, logits.size(1)), dim=1)
    mass = top_p.cumsum(dim=1)
    narrow = mass[:, -1] >= topp
    drop = (mass - top_p) >= topp
    drop[:, 0] = False
    values = logits.gather(1, order).masked_fill(drop, NEG_INF)
    choice = order.gather(1, (values + _gumbel_noise(keys, step, order)).argmax(dim=1, keepdim=True))[:, 0]
    if not bool(narrow.all()):
        wide = (~narrow).nonzero()[:, 0]
        choice[wide] = _full_draw(logits[wide], keys[wide], step, topp)
    return choice


@register("search", "sampling", config=SamplingConfig)
class Sampling(SearchStrategy):
    """--beam samples per sentence (Gumbel-max over the filtered, tempered distribution), the nbest best kept.

    Each sample is a unit of one row of the search loop: it draws one token per step and ends at its EOS.
    Randomness is a hash of (``--seed``, sentence id, sample number, step, token), so a sentence's samples are
    the same however the input is batched. Scores are the model's log-probabilities (``--unkpen`` applied, no
    temperature) under the length penalty.
    """

    @property
    def units_per_sentence(self) -> int:
        return self.cfg.beam

    def rows_per_unit(self) -> int:
        return 1

    def kept_per_sentence(self) -> int:
        return self.cfg.beam

    def start(self, model, src_tokens, src_lengths, kernels, sample_ids):
        B, K, dev = src_tokens.size(0), self.cfg.beam, src_tokens.device
        ids = torch.arange(B, device=dev) if sample_ids is None else sample_ids.to(dev).long()
        self.opts = _options(self.cfg)
        self.keys = _sample_keys(self.opts.seed, ids.repeat_interleave(K), torch.arange(K, device=dev).repeat(B))
        return start_rows(model, src_tokens, src_lengths, K, kernels)

    def candidates(self, model, tokens, step, enc, cache, max_len, scores, sym, kernels):
        logits = model.decode(tokens[:, step:step + 1], enc, cache)[:, -1]
        lprobs = step_log_probs(logits, step, max_len, tokens[:, 1:step + 1], self.cfg, sym, rules=self.rules)
        choice = _draw(lprobs / self.opts.temperature, self.keys, step, self.opts.sampling_topk,
                       self.opts.sampling_topp)
        lp = lprobs.gather(1, choice[:, None])[:, 0]
        return (scores + lp)[:, None], lp[:, None], torch.zeros_like(choice)[:, None], choice[:, None]

    def done(self, step, best, fin, max_len, kth_best):
        return fin[:, 0]  # a sample ends with its EOS

    def keep_units(self, keep):
        self.keys = self.keys[keep]


def sample_search(model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig, sym: Symbols,
                  sample_ids: Tensor | None = None,
                  kernels: DecodingKernels = DecodingKernels()) -> list[list[Hypothesis]]:
    """Draw ``cfg.beam`` samples per sentence and return the ``nbest`` best of each (:class:`Sampling`)."""
    return Sampling(cfg)(model, src_tokens, src_lengths, sym, sample_ids, kernels)
