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


def _gumbel_noise(keys: Tensor, step: int, vocab: int) -> Tensor:
    """Gumbel(0, 1) noise (R, V) from counter-based uniforms: a pure function of (key, step, token)."""
    h = _mix32(keys ^ step)
    tok = (torch.arange(vocab, device=keys.device, dtype=torch.long) * 0x9E3779B1) & _M32
    bits = _mix32(h[:, None] ^ tok[None, :]) >> 8  # 24 uniform bits: exact in float32
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
        lprobs = step_log_probs(logits, step, max_len, tokens[:, 1:step + 1], self.cfg, sym)
        filtered = _filter_logits(lprobs / self.opts.temperature, self.opts.sampling_topk, self.opts.sampling_topp)
        choice = (filtered + _gumbel_noise(self.keys, step, lprobs.size(1))).argmax(dim=1)
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
