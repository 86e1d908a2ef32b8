"""Minimum Bayes risk decoding (``--mbr-samples N``): of the beam's hypotheses, the one the model's own samples agree
with most.

Beam search returns the most probable translation, which is not the one with the highest expected quality: an
unusual wording can be the likeliest single string while most of the model's probability mass says something
else. MBR decoding (Kumar and Byrne 2004; Eikema and Aziz 2020; Freitag et al. 2022) draws ``N`` samples from the
model as stand-ins for references and outputs the candidate with the highest mean utility against them. Here the
candidates are the ``--beam`` hypotheses of beam search, the samples are drawn with top-p ``MBR_TOPP`` (nucleus
sampling keeps the pseudo-references fluent), and the utility is sentence chrF (character 6-grams, beta 2, as
sacreBLEU computes it), computed on the detokenized texts.

Samples are seeded per sentence, as ``--sampling`` is, so a sentence's translation does not depend on its batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

from attnmt.generation.search import Hypothesis, SearchConfig

CHAR_ORDER = 6
BETA = 2
MBR_TOPP = 0.9


class CharNgrams:
    """A text's character n-grams of orders 1..``CHAR_ORDER`` (whitespace removed) and their totals: chrF's
    statistics of one side, computed once per text and compared with many."""

    __slots__ = ("counts", "totals")

    def __init__(self, text: str):
        line = "".join(text.split())
        self.counts = [Counter(line[i:i + n] for i in range(len(line) - n + 1)) for n in range(1, CHAR_ORDER + 1)]
        self.totals = [sum(c.values()) for c in self.counts]


def chrf(hyp: CharNgrams, ref: CharNgrams) -> float:
    """Sentence chrF (0-100) of ``hyp`` against ``ref``: sacreBLEU's ``CHRF().sentence_score`` (character 6-grams,
    beta 2, no word n-grams, precision and recall averaged over the orders both sides have)."""
    factor = BETA ** 2
    prec_sum = rec_sum = 0.0
    orders = 0
    for h, r, n_hyp, n_ref in zip(hyp.counts, ref.counts, hyp.totals, ref.totals):
        if not n_hyp or not n_ref:
            continue
        match = 0
        for gram, count in h.items():
            other = r.get(gram)
            if other:
                match += count if count < other else other
        prec_sum += match / n_hyp
        rec_sum += match / n_ref
        orders += 1
    if not orders:
        return 0.0
    prec, rec = prec_sum / orders, rec_sum / orders
    if prec + rec == 0:
        return 0.0
    return 100 * (1 + factor) * prec * rec / (factor * prec + rec)


def mbr_order(candidates: Sequence[str], evidence: Sequence[str]) -> list[int]:
    """Indices of ``candidates`` by decreasing mean chrF against ``evidence`` (ties keep the candidates' order)."""
    if not evidence or len(candidates) < 2:
        return list(range(len(candidates)))
    ev = [CharNgrams(t) for t in evidence]
    utility = [sum(chrf(c, e) for e in ev) for c in map(CharNgrams, candidates)]
    return sorted(range(len(candidates)), key=lambda i: -utility[i])


def sampling_config(cfg: SearchConfig) -> SearchConfig:
    """The search that draws the ``cfg.mbr_samples`` pseudo-references: sampling with ``cfg``'s length limits and
    penalties, top-p ``MBR_TOPP``."""
    from attnmt.generation.sampling import SamplingConfig

    n = cfg.mbr_samples
    return replace(cfg, search="sampling", sampling=False, beam=n, nbest=n, mbr_samples=0,
                   options=SamplingConfig(sampling_topp=MBR_TOPP))


def rerank(hyps: list[Hypothesis], samples: list[Hypothesis], text: Callable[[list[int]], str],
           nbest: int) -> list[Hypothesis]:
    """The ``nbest`` of ``hyps`` (one sentence's beam) with the highest mean chrF against ``samples``' texts; each
    keeps its model score."""
    order = mbr_order([text(h.tokens) for h in hyps], [text(s.tokens) for s in samples])
    return [hyps[i] for i in order[:nbest]]
