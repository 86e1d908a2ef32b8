"""Search over target sequences: beam search, greedy decoding and sampling.

Strategies (``SearchStrategy``) are registered like every other component and chosen with ``--search``; the
built-in ones live in ``beam.py`` (beam search and greedy decoding) and ``sampling.py``. All through its incremental-decoding interface (``encode``, ``decode_features`` +
``output_layer`` or ``decode`` with a cache, ``output_candidates``, ``new_cache``, ``reorder``, ``max_positions``: see
:class:`attnmt.models.interface.SearchModel`) and return, per source sentence, a list of finished :class:`Hypothesis` sorted best
first.

Scores
    A hypothesis ``Y`` (its generated tokens, the final EOS included) scores ``logprob(Y) / lp(|Y|)`` with the
    GNMT length penalty of Wu et al. (2016), which "Attention Is All You Need" uses with alpha = 0.6::

        lp(|Y|) = ((5 + |Y|) / 6) ** alpha

    ``|Y|`` counts the EOS. alpha = 0 ranks by plain log-probability; larger alpha favours longer outputs. fairseq's
    ``--lenpen`` divides by ``|Y| ** alpha`` instead (the two agree only at alpha = 0): ``--lenpen-style fairseq``
    selects it (:class:`LengthPenalty`). Log-probabilities are natural logarithms here; ``--format fairseq`` prints
    them in base 2, as fairseq does.

Lengths
    A sentence whose source has ``S`` tokens (its EOS included, as the model sees it) may generate at most
    ``max_len = floor(a * S + b)`` tokens before the EOS, capped so that the decoder never runs past the model's
    target positions. The limit is per sentence, never per batch, so a translation does not depend on what else is in
    its batch.

Early stopping
    Log-probabilities are <= 0, so extending a live hypothesis with cumulative log-probability ``s`` (after ``t``
    tokens) can only lower ``s``. Its final score is ``s' / lp(L)`` with ``s' <= s`` and ``t + 1 <= L <= max_len + 1``;
    as ``s' <= 0`` this is at most ``s / max(lp(t + 1), lp(max_len + 1))``: ``lp(max_len + 1)`` when alpha >= 0 (lp
    grows with length), ``lp(t + 1)`` when alpha < 0. (A negative ``--unkpen`` rewards unknown words, each token can
    then add up to ``-unkpen``, and the bound is maximised over every reachable length instead.) A sentence is
    finished once it holds ``nbest`` finished hypotheses and no live hypothesis' bound exceeds the ``nbest``-th best
    finished score: from then on its n-best list can no longer change. Every sentence stops on its own, which keeps
    the search batch-invariant.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from attnmt.models.interface import SearchModel
from attnmt.models.kernels import BlockMaxima, DecodingKernels
from attnmt.registry import get

NEG_INF = float("-inf")


@dataclass
class SearchConfig:
    """How hypotheses are searched for and ranked: the options every strategy shares, the strategy's name and its own
    options (``options``: the config the strategy registered, None for its defaults)."""

    search: str = field(default="beam", metadata={
        "help": "Search strategy (registered: beam, sampling, and any plugin's); see attnmt list."})
    beam: int = field(default=4, metadata={"min": 1, "max": 1024, "help": "Beam size; 1 is greedy search. With --sampling: samples drawn per sentence."})
    lenpen: float = field(default=0.6, metadata={
        "help": "Length penalty alpha: score = logprob / ((5 + length) / 6) ** alpha (GNMT, the paper's); 0 ranks by "
                "logprob. --lenpen-style fairseq divides by length ** alpha instead."})
    lenpen_style: Literal["gnmt", "fairseq"] = field(default="gnmt", metadata={
        "help": "gnmt: ((5 + length) / 6) ** alpha, as in the paper (Wu et al. 2016); fairseq: length ** alpha, "
                "what fairseq's --lenpen means."})
    max_len_a: float = field(default=1.0, metadata={"min": 0, "help": "Generate at most a * source_length + b tokens (a)."})
    max_len_b: int = field(default=50, metadata={"min": 0, "help": "Generate at most a * source_length + b tokens (b)."})
    min_len: int = field(default=1, metadata={"min": 0, "help": "Generate at least this many tokens before the end of sentence."})
    nbest: int = field(default=1, metadata={"min": 1, "help": "Output this many hypotheses per sentence (at most --beam)."})
    unkpen: float = field(default=0.0, metadata={"help": "Subtract this from the log-probability of the unknown word."})
    no_repeat_ngram_size: int = field(default=0, metadata={"min": 0, "help": "Never repeat an n-gram of this size (0: off)."})
    disable_unk: bool = field(default=False, metadata={"help": "Never generate the unknown word."})
    repetition_penalty: float = field(default=1.0, metadata={"help":
        "Penalize tokens the hypothesis already holds (CTRL's, as CTranslate2 and transformers): their logit is "
        "divided by this where positive, multiplied where negative (1: off; > 1 discourages repeats)."})
    sampling: bool = field(default=False, metadata={"help": "Sample from the model instead of searching (fairseq's "
                                                            "spelling of --search sampling)."})
    mbr_samples: int = field(default=0, metadata={"min": 0, "max": 1024, "help":
        "Minimum Bayes risk decoding: draw this many samples per sentence (top-p 0.9) and output, of the --beam "
        "hypotheses, the one with the highest mean chrF against them (0: off; beam search only)."})
    options: Any = field(default=None, metadata={"cli": False})

    def __post_init__(self):
        if self.sampling:
            self.search = "sampling"
        if self.beam < 1:
            raise ValueError(f"--beam must be at least 1, got {self.beam}")
        if not 1 <= self.nbest <= self.beam:
            raise ValueError(f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}; raise --beam")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise ValueError("--max-len-a and --max-len-b must not be negative")
        if self.min_len < 0:
            raise ValueError(f"--min-len must not be negative, got {self.min_len}")
        if self.max_len_a == 0 and self.min_len > self.max_len_b:
            raise ValueError(f"--min-len {self.min_len} is above the length limit --max-len-b {self.max_len_b} "
                             f"(with --max-len-a 0); lower --min-len or raise --max-len-b")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"--repetition-penalty must be a positive number, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"--no-repeat-ngram-size must not be negative, got {self.no_repeat_ngram_size}")
        if not math.isfinite(self.lenpen):
            raise ValueError(f"--lenpen must be a finite number, got {self.lenpen}")
        if self.mbr_samples < 0:
            raise ValueError(f"--mbr-samples must not be negative, got {self.mbr_samples}")
        if self.mbr_samples and self.search != "beam":
            raise ValueError(f"--mbr-samples reranks beam search's hypotheses, not --search {self.search}'s; drop "
                             f"one of them")
        if self.lenpen_style not in LENPEN_STYLES:
            raise ValueError(f"--lenpen-style must be one of {', '.join(LENPEN_STYLES)}, got {self.lenpen_style!r}")

    @property
    def length_penalty(self) -> LengthPenalty:
        return LengthPenalty(self.lenpen, self.lenpen_style)

    def describe(self) -> str:
        """The search in one line, for the run's summary: strategy, beam and the active scoring formula."""
        mbr = f", the hypothesis of highest mean chrF against {self.mbr_samples} samples" if self.mbr_samples else ""
        return (f"{self.search} {self.beam}, score = {self.length_penalty.formula()}, at most "
                f"{self.max_len_a:g} * source + {self.max_len_b} tokens{mbr}")


@dataclass(frozen=True)
class Symbols:
    """The special token ids the search needs.

    ``start``: the token the decoder starts from (None: EOS, as fairseq and attnmt; Marian starts from the
    padding symbol); ``forced``: a token that must be the first one generated, at log-probability 0 (M2M-100 and
    NLLB force the target language's token there)."""

    eos: int
    pad: int
    unk: int
    bos: int | None = None
    start: int | None = None
    forced: int | None = None

    @classmethod
    def from_dictionary(cls, d, start: int | None = None, forced: int | None = None) -> Symbols:
        return cls(eos=d.eos(), pad=d.pad(), unk=d.unk(), bos=d.bos(), start=start, forced=forced)

    @property
    def first(self) -> int:
        """The decoder's first input token."""
        return self.eos if self.start is None else self.start


@dataclass
class Hypothesis:
    """A finished translation: ``tokens`` end with EOS; ``score = sum(positional_scores) / lp(len(tokens))``."""

    tokens: list[int]
    score: float
    positional_scores: list[float]

    @property
    def logprob(self) -> float:
        return float(sum(self.positional_scores))


def nothing_to_translate(source: Sequence[int], eos: int) -> bool:
    """Whether a source holds no token but its final EOS (an empty or blank line): its translation is empty,
    and no model runs for it."""
    return len(source) == 1 and int(source[0]) == eos


def empty_translation(eos: int, nbest: int) -> list[Hypothesis]:
    """The hypotheses of a source with nothing to translate: the empty text, of log-probability 0, ``nbest``
    times, so that every sentence keeps its ``nbest`` output lines."""
    return [Hypothesis(tokens=[eos], score=0.0, positional_scores=[0.0]) for _ in range(nbest)]


@dataclass
class Guidance:
    """What a translator asks of one batch's search beyond :class:`SearchConfig` (every field may be empty).

    ``prefixes``: per sentence, target ids its hypotheses must start with (after a model's forced first token),
    each keeping its log-probability under the model (fairseq's ``--prefix-size``, CTranslate2's
    ``target_prefix``); ``constraints``: per sentence, target phrases (id lists) every hypothesis must contain
    (searched by the ``constrained`` strategy), in the given order with ``ordered``, else in any order;
    ``suppress``: id sequences no hypothesis may contain (CTranslate2's ``suppress_sequences``)."""

    prefixes: list[list[int]] | None = None
    constraints: list[list[list[int]]] | None = None
    suppress: tuple[tuple[int, ...], ...] = ()
    ordered: bool = False

    def subset(self, idx: Sequence[int]) -> Guidance:
        """The guidance of the sentences ``idx`` (in that order)."""
        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]
        return Guidance(pick(self.prefixes), pick(self.constraints), self.suppress, self.ordered)

    def __bool__(self) -> bool:
        return bool(self.suppress) or any(self.prefixes or ()) or any(self.constraints or ())


class Rules:
    """The per-row rules of a running search from its :class:`Guidance`: each row's forced tokens (a row tensor
    reordered with the rows, as the tokens are) and the suppressed sequences.

    ``forced`` (R, P): the token row r must generate at step j (-1: none), P the longest prefix (with a model's
    forced first token, column 0 is left to that rule); ``banned`` (V,)-indexable ids of one-token suppressed
    sequences (every row alike: a token bias); ``patterns``: the longer ones, by length."""

    def __init__(self, guide: Guidance | None, batch: int, rows_per_sentence: int, sym: Symbols, device):
        guide = guide or Guidance()
        start = 1 if sym.forced is not None else 0
        self.forced: Tensor | None = None
        prefixes = guide.prefixes or []
        if any(prefixes):
            width = start + max(len(p) for p in prefixes)
            forced = torch.full((batch, width), -1, dtype=torch.long)
            for b, p in enumerate(prefixes):
                if p:
                    forced[b, start:start + len(p)] = torch.tensor(p, dtype=torch.long)
            self.forced = forced.repeat_interleave(rows_per_sentence, dim=0).to(device)
        self.banned = sorted({s[0] for s in guide.suppress if len(s) == 1})
        by_len: dict[int, list[tuple[int, ...]]] = {}
        for s in guide.suppress:
            if len(s) > 1:
                by_len.setdefault(len(s), []).append(tuple(s))
        self.patterns = {n: torch.tensor(sorted(set(v)), dtype=torch.long, device=device)
                         for n, v in sorted(by_len.items())}

    def per_row(self, step: int, cfg: SearchConfig) -> bool:
        """Whether rules that differ between rows apply at ``step`` (which the score kernel cannot take)."""
        forced_now = self.forced is not None and step < self.forced.size(1)
        return forced_now or bool(self.patterns) or cfg.repetition_penalty != 1.0

    def reorder(self, order: Tensor) -> None:
        """The rows ``order`` continue (the loop's reordering of the tokens)."""
        if self.forced is not None:
            self.forced = self.forced[order]

    def rows(self, sl: slice) -> Rules:
        """These rules for the rows ``sl`` of the batch (a block of the score projection)."""
        part = object.__new__(Rules)
        part.forced = None if self.forced is None else self.forced[sl]
        part.banned, part.patterns = self.banned, self.patterns
        return part


def _apply_rules(lprobs: Tensor, step: int, generated: Tensor | None, rules: Rules) -> None:
    """Bar the last token of every suppressed sequence whose other tokens end a row; force each row's prefix
    token at this step (keeping its log-probability: a prefix wins over the suppressed sequences), in place."""
    forced = None
    if rules.forced is not None and step < rules.forced.size(1):
        tok = rules.forced[:, step]
        rows = (tok >= 0).nonzero(as_tuple=True)[0]
        if rows.numel():
            forced = rows, tok[rows], lprobs[rows, tok[rows]].clone()
    if rules.banned:
        lprobs[:, rules.banned] = NEG_INF
    if generated is not None:
        length = generated.size(1)
        for n, pats in rules.patterns.items():  # (M, n)
            if length < n - 1:
                continue
            tail = generated[:, length - n + 1:]  # (R, n - 1)
            hit = (tail[:, None, :] == pats[None, :, :-1]).all(dim=2)  # (R, M)
            rows, m = hit.nonzero(as_tuple=True)
            if rows.numel():
                lprobs[rows, pats[m, -1]] = NEG_INF
    if forced is not None:
        rows, tok, keep = forced
        lprobs[rows] = NEG_INF
        lprobs[rows, tok] = keep


def _penalize_repeats(logits: Tensor, generated: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019) on the logits of the tokens each row already holds."""
    logits = logits.float().clone()
    if generated.size(1) == 0:
        return logits
    seen = logits.gather(1, generated)
    logits.scatter_(1, generated, torch.where(seen > 0, seen / penalty, seen * penalty))
    return logits


# ------------------------------------------------------------------------------------------------ scoring


def length_penalty(length, alpha: float):
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (a float or a tensor, like ``length``)."""
    return ((5.0 + length) / 6.0) ** alpha


LENPEN_STYLES = ("gnmt", "fairseq")


@dataclass(frozen=True)
class LengthPenalty:
    """``lp(|Y|)``, the divisor of a hypothesis' log-probability: GNMT's (the paper's) or fairseq's ``|Y| ** alpha``.

    Both grow with the length when alpha >= 0 and shrink when alpha < 0, which the early-stopping bound relies on.
    """

    alpha: float
    style: str = "gnmt"

    def __call__(self, length):
        if self.style == "fairseq":
            return length ** self.alpha
        return length_penalty(length, self.alpha)

    def formula(self) -> str:
        if self.style == "fairseq":
            return f"logprob / length^{self.alpha:g} (fairseq)"
        return f"logprob / ((5 + length) / 6)^{self.alpha:g} (GNMT)"


def max_lengths(src_lengths: Tensor, cfg: SearchConfig, max_target_positions: int | None = None) -> Tensor:
    """Per sentence, the most tokens that may precede the EOS: ``floor(a * S + b)``, at least 1, within the model."""
    lim = torch.floor(src_lengths.double() * cfg.max_len_a + cfg.max_len_b).long().clamp(min=1)
    if max_target_positions is not None:
        # the decoder sees EOS + the generated tokens: max_len + 1 positions to emit the final EOS
        lim = lim.clamp(max=max(1, max_target_positions - 1))
    return lim


def score_upper_bound(cum: Tensor, n_tokens: int | Tensor, max_len: Tensor, penalty: LengthPenalty,
                      bonus: float = 0.0) -> Tensor:
    """The best final score any completion of live hypotheses can reach (see "Early stopping" above).

    ``cum``: cumulative log-probabilities (<= 0 unless ``bonus`` > 0) of hypotheses with ``n_tokens`` generated
    tokens (or (R,), each row's) and no EOS yet; ``max_len``: per-row token limit; ``bonus``: the most one more
    non-EOS token can add to the log-probability (``-unkpen`` when the unknown word is rewarded, else 0; with a
    single ``n_tokens`` only).
    """
    first = n_tokens + 1  # shortest completion: EOS right away
    if bonus <= 0.0:
        if penalty.alpha >= 0:
            lp_max = penalty((max_len + 1).to(cum.dtype))
        elif isinstance(first, Tensor):
            lp_max = penalty(first.to(cum.dtype))
        else:
            lp_max = torch.full_like(cum, penalty(float(first)))
        return cum / lp_max
    # (cum + (L - first) * bonus) / lp(L) over every reachable length L
    top = int(max_len.max()) + 1
    lengths = torch.arange(first, max(first, top) + 1, device=cum.device, dtype=cum.dtype)
    cand = (cum[:, None] + (lengths - first) * bonus) / penalty(lengths)
    cand = cand.masked_fill(lengths[None, :] > (max_len + 1)[:, None].to(cum.dtype), NEG_INF)
    return cand.max(dim=1).values


# ------------------------------------------------------------------------------------------------ per-step rules


def _block_ngram_repeats(lprobs: Tensor, generated: Tensor, n: int) -> None:
    """Forbid every token that would complete an n-gram already present in the row (in place, vectorised)."""
    length = generated.size(1)
    if length < n or n == 0:
        return
    windows = generated.unfold(1, n, 1)  # (R, W, n)
    if n > 1:
        suffix = generated[:, length - n + 1:]  # the n-1 newest tokens
        match = (windows[:, :, :-1] == suffix[:, None, :]).all(dim=2)
    else:
        match = torch.ones(windows.shape[:2], dtype=torch.bool, device=generated.device)
    rows, wins = match.nonzero(as_tuple=True)
    if rows.numel():
        lprobs[rows, windows[rows, wins, -1]] = NEG_INF


def step_log_probs(logits: Tensor, step: int | Tensor, max_len: Tensor, generated: Tensor | None, cfg: SearchConfig,
                   sym: Symbols, keep_bf16: bool = False, rules: Rules | None = None) -> Tensor:
    """Log-probabilities of the next token under the search's rules.

    ``logits``: (R, V) for the token at position ``step`` (0-based count of tokens generated so far; or (R,), each
    row's, when the rows are at different steps: no n-gram blocking then);
    ``max_len``: (R,) per-row limits; ``generated``: (R, step) the tokens so far. Padding (and BOS) never appear,
    ``--unkpen`` is subtracted from the unknown word, EOS is barred before ``--min-len`` and forced at ``max_len``;
    a first token the model forces (``Symbols.forced``) is the only one at step 0; ``--disable-unk`` bars the
    unknown word and ``--repetition-penalty`` lowers the logits of tokens already generated; ``rules`` (the
    batch's :class:`Rules`) bar suppressed sequences and force prefix tokens (each keeps its log-probability; the
    length limit still wins).
    The result is float32, or with ``keep_bf16`` and bf16 logits, bf16: the softmax is computed in float32 either
    way, and rounding its result to bf16 (relative error 2^-9) halves the cost of this step, the costliest after
    the output projection, while the logits of a bf16 model carry larger errors already.
    """
    if cfg.repetition_penalty != 1.0 and generated is not None:
        logits = _penalize_repeats(logits, generated, cfg.repetition_penalty)
    if keep_bf16 and logits.dtype == torch.bfloat16:
        lprobs = torch.log_softmax(logits, dim=-1)
    else:
        lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    lprobs[:, sym.pad] = NEG_INF
    if sym.bos is not None and sym.bos != sym.eos:
        lprobs[:, sym.bos] = NEG_INF
    if cfg.unkpen:
        lprobs[:, sym.unk] -= cfg.unkpen
    if cfg.disable_unk:
        lprobs[:, sym.unk] = NEG_INF
    if cfg.no_repeat_ngram_size:
        _block_ngram_repeats(lprobs, generated, cfg.no_repeat_ngram_size)
    eos_lp = lprobs[:, sym.eos].clone()
    if rules is not None and not isinstance(step, Tensor):
        _apply_rules(lprobs, step, generated, rules)
    if isinstance(step, Tensor):
        lprobs[:, sym.eos].masked_fill_(step < cfg.min_len, NEG_INF)
    elif step < cfg.min_len:
        lprobs[:, sym.eos] = NEG_INF
    at_limit = max_len <= step
    if bool(at_limit.any()):
        rows = at_limit.nonzero(as_tuple=True)[0]
        lprobs[rows] = NEG_INF
        lprobs[rows, sym.eos] = eos_lp[rows]
    if sym.forced is not None:  # the first token is the forced one, at log-probability 0
        first = step == 0 if isinstance(step, Tensor) else torch.full((lprobs.size(0),), step == 0,
                                                                           device=lprobs.device)
        if bool(first.any()):
            rows = first.nonzero(as_tuple=True)[0]
            lprobs[rows] = NEG_INF
            lprobs[rows, sym.forced] = 0.0
    return lprobs


# --------------------------------------------------------------------------------------- candidate selection

TOPK_BLOCK = 64  # best_extensions scans the vocabulary as blocks of this many tokens


def block_maxima(x: Tensor, n: int, nonpositive: bool) -> Tensor:
    """Maxima of ``n`` equal blocks of each row of ``x`` (R, n * c) -> (R, n); ``nonpositive``: every value is
    <= 0 (log-probabilities), which a backend's faster form (``DecodingKernels.block_maxima``) may rely on."""
    return x.unflatten(1, (n, -1)).amax(dim=2)


def token_bias(vocab: int, step: int, cfg: SearchConfig, sym: Symbols, device: torch.device,
               banned: Sequence[int] = ()) -> Tensor:
    """The rules of :func:`step_log_probs` that apply to every row alike, as one float32 value per token added to
    the log-probabilities: -inf for padding and BOS, ``-unkpen`` for the unknown word (-inf with
    ``--disable-unk``), -inf for EOS before ``--min-len`` and for the ``banned`` tokens (suppressed one-token
    sequences)."""
    bias = torch.zeros(vocab, device=device)
    bias[sym.pad] = NEG_INF
    if sym.bos is not None and sym.bos != sym.eos:
        bias[sym.bos] = NEG_INF
    if cfg.unkpen:
        bias[sym.unk] -= cfg.unkpen
    if cfg.disable_unk:
        bias[sym.unk] = NEG_INF
    if step < cfg.min_len:
        bias[sym.eos] = NEG_INF
    if banned:
        bias[list(banned)] = NEG_INF
    return bias


@dataclass(frozen=True)
class Normalizer:
    """Log-probabilities kept as their logits: ``log_prob = (logits + bias) - lse``; ``maxima``: those of
    ``logits + bias`` per vocabulary block of ``TOPK_BLOCK`` tokens (a backend's ``ScoreKernel``)."""

    bias: Tensor  # (V,) float32
    maxima: Tensor  # (R, V // TOPK_BLOCK) float32
    lse: Tensor  # (R,) float32
    no_eos: Tensor | None = None  # (R,) bool: rows whose EOS is barred (before --min-len; their maxima exclude it)
    eos: int = -1


def best_extensions(lprobs: Tensor, scores: Tensor, beam: int, nonpositive: bool = False, blockwise: bool = True,
                    normalizer: Normalizer | None = None,
                    maxima_of: BlockMaxima | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The best ``C = min(2 * beam, beam * V)`` one-token extensions of each sentence's hypotheses, best first.

    ``lprobs`` (A * beam, V): next-token log-probabilities of each sentence's ``beam`` hypotheses (consecutive
    rows); ``scores`` (A * beam,): their cumulative log-probabilities. Returns, each (A, C): the extended
    cumulative scores (float32), the new token's log-probability (float32), the hypothesis extended
    (0..beam-1) and the token; the same as a top-C over the (A, beam * V) sums, without forming them.
    ``nonpositive``: every log-probability is <= 0 (no ``--unkpen`` reward), which allows a faster bf16 scan;
    ``maxima_of``: the backend's block maxima (``DecodingKernels.block_maxima``; None: :func:`block_maxima`).

    ``torch.topk`` over a 10k vocabulary costs several times a max reduction over it, so each row is cut into
    blocks of ``TOPK_BLOCK`` tokens. A block's candidates score at most its hypothesis' score plus the block's
    best log-probability; the C best extensions of a sentence lie in its C blocks with the highest such bound
    (each of those holds a candidate at least as good as anything in an unselected block), so one max reduction
    over the rows, a top-C over the blocks and a top-C over the ``C * TOPK_BLOCK`` candidates they hold give the
    same values. Among equal values the indices chosen may differ from a plain top-k; a sentence's result
    depends on its own rows only. ``blockwise=False``: one ``topk`` over the sums (what a GPU does best).

    With a ``normalizer``, ``lprobs`` holds the logits, and only the candidates read are turned into
    log-probabilities (the block scan needs more than ``C`` blocks then).
    """
    R, V = lprobs.shape
    A, c = R // beam, TOPK_BLOCK
    C = min(2 * beam, beam * V)
    n = V // c
    dev = lprobs.device
    first_row = (torch.arange(A, device=dev) * beam)[:, None]  # (A, 1)
    if n <= C or not blockwise:  # one top-k over all extensions
        if normalizer is not None:
            raise ValueError(f"logits with a normalizer need the block scan, over more than {C} blocks")
        top_s, j = (scores.view(-1, 1) + lprobs.float()).view(A, beam * V).topk(C, dim=1)
        return top_s, lprobs.reshape(A, beam * V).gather(1, j).float(), j // V, j % V
    if normalizer is None:
        maxima = (maxima_of or block_maxima)(lprobs[:, : n * c], n, nonpositive).float()
    else:
        maxima = normalizer.maxima - normalizer.lse[:, None]
    bound = maxima + scores.view(-1, 1)  # (R, n)
    blocks = bound.view(A, beam * n).topk(C, dim=1).indices  # (A, C): hypothesis * n + block
    start = (first_row + blocks // n) * V + (blocks % n) * c  # (A, C) offset of each block in lprobs
    offsets = (start[:, :, None] + torch.arange(c, device=dev)).view(A, C * c)
    if n * c < V:  # the last, shorter block: its tokens are always candidates
        tail = (torch.arange(R, device=dev) * V)[:, None] + torch.arange(n * c, V, device=dev)  # (R, V - n c)
        offsets = torch.cat([offsets, tail.view(A, -1)], dim=1)
    flat = lprobs.reshape(-1)
    cand_lp = flat.take(offsets).float()
    rows = offsets // V
    if normalizer is not None:  # the same operations, in the same order, as the bound's
        cand_lp = (cand_lp + normalizer.bias.take(offsets % V)) - normalizer.lse.take(rows)
        if normalizer.no_eos is not None:
            cand_lp.masked_fill_(normalizer.no_eos.take(rows) & (offsets % V == normalizer.eos), NEG_INF)
    cand = cand_lp + scores.view(-1).take(rows)
    top_s, j = cand.topk(C, dim=1)
    off = offsets.gather(1, j)
    return top_s, cand_lp.gather(1, j), off // V - first_row, off % V


def _normalize_in_kernel(logits: Tensor, step: int | Tensor, per: int, beam: int, max_len: Tensor, cfg: SearchConfig,
                         kernels: DecodingKernels) -> bool:
    """Whether the backend's score kernel serves this block: the block scan over more than ``2 * beam`` blocks,
    rules that are the same for every row (no n-gram blocking, no row at its length limit), and a row per
    hypothesis (every step but the first)."""
    return (kernels.scores is not None and kernels.blockwise_topk and per == beam and not cfg.no_repeat_ngram_size
            and cfg.repetition_penalty == 1.0 and logits.size(1) // TOPK_BLOCK > min(2 * beam, beam * logits.size(1))
            and kernels.scores.supports(logits) and not bool((max_len <= step).any()))


def next_token_extensions(model, tokens: Tensor, step: int | Tensor, enc, cache, max_len: Tensor, scores: Tensor,
                          beam: int, cfg: SearchConfig, sym: Symbols, kernels: DecodingKernels = DecodingKernels(),
                          rules: Rules | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decode one step and return ``best_extensions`` of every sentence under the search's rules.

    ``tokens`` (R, T): column ``step`` holds each row's newest token; ``step``: the tokens every row has generated,
    or (R,) each row's (a running search that sentences join: those at step 0 come last); ``max_len`` (R,): per-row
    limits; ``scores`` (R,): cumulative log-probabilities; ``beam`` consecutive rows per sentence. The decoder
    features are projected to the vocabulary (``output_layer``) about ``kernels.score_rows`` rows (whole
    sentences) at a time: on a CPU, 400 sentences x beam 4 would otherwise build 60 MB of logits and as much of
    log-probabilities per step, memory that is mapped afresh and zeroed by the kernel at every step, while small
    blocks are reused and stay in cache; a GPU takes the whole batch at once. Each sentence's numbers are the same
    either way. ``kernels``: the backend's row padding, score blocks, candidate selection and score precision
    (``Backend.decoding_kernels``); ``rules``: the batch's per-row :class:`Rules` (a common step only).

    A sentence's first step is scored from one row (its hypotheses start alike: the row stands for all of them),
    so that its numbers are the same whether it starts with its batch or joins a running search.
    """
    if isinstance(step, Tensor):
        if rules is not None:
            raise ValueError("prefixes, constraints and suppressed text need the sentences at one step")
        feats = model.decode_features(tokens.gather(1, step[:, None]), enc, cache)[:, -1]  # (R, D)
        fresh = int((step[::beam] == 0).sum())
        old = feats.size(0) - fresh * beam
        parts = []
        if old:
            parts.append(score_extensions(model, feats[:old], step[:old], max_len[:old], None, scores[:old], beam,
                                          cfg, sym, kernels))
        if fresh:
            parts.append(score_extensions(model, feats[old::beam], 0, max_len[old:], None, scores[old:], beam, cfg,
                                          sym, kernels, per=1))
        return parts[0] if len(parts) == 1 else tuple(torch.cat(p) for p in zip(*parts))
    per = 1 if step == 0 else beam  # the first step decodes one row per sentence: its hypotheses start alike
    prev = tokens[::beam // per, step:step + 1]
    feats = model.decode_features(prev, enc, cache)[:, -1]  # (R or A, D)
    return score_extensions(model, feats, step, max_len, tokens[:, 1:step + 1], scores, beam, cfg, sym, kernels, per,
                            rules)


def score_extensions(model, feats: Tensor, step: int | Tensor, max_len: Tensor, generated: Tensor | None,
                     scores: Tensor, beam: int, cfg: SearchConfig, sym: Symbols, kernels: DecodingKernels,
                     per: int | None = None, rules: Rules | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``best_extensions`` of decoder features ``feats`` under the search's rules, projected to the vocabulary a
    block of rows at a time (see :func:`next_token_extensions`).

    ``feats`` holds ``per`` rows per sentence: ``beam``, or 1 where a sentence's hypotheses start alike (its first
    step; the row stands for all of them); ``max_len``, ``generated`` and ``scores`` have ``beam`` rows per
    sentence. ``step``: the tokens generated so far, or (R,) each row's when the sentences are at different steps
    (continuous batching; no n-gram blocking then: ``generated`` None): the score kernel then bars EOS per row
    before ``--min-len``. A model with ``output_candidates`` (a shortlist) is scored over its candidates alone
    where the score kernel serves the block (their tokens mapped back to the vocabulary's ids), and over the
    whole vocabulary, the others at -inf, where per-row rules apply.
    """
    per = beam if per is None else per
    rows = max(1, kernels.score_rows // beam) * per
    bias = None
    parts = []
    short = model.output_candidates()  # a shortlist: scored over its tokens where the rules are every row's
    eos = sym.eos  # EOS's column of the logits (among the candidates: looked up with the bias, once)
    for a in range(0, feats.size(0), rows):
        b = min(a + rows, feats.size(0))
        block = feats[a:b]
        if b - a < rows and kernels.row_bucket is not None:  # the last block: the backend's row counts only
            block = torch.cat([block, block.new_zeros(kernels.row_bucket(b - a) - (b - a), block.size(1))])
        lo, hi, every = a * beam // per, b * beam // per, beam // per  # the block's rows of the full arrays
        logits = (model.output_layer(block) if short is None else model.candidate_logits(block))[: b - a]
        st = step if isinstance(step, int) else step[lo:hi:every]
        forced_now = sym.forced is not None and bool((st == 0).any() if isinstance(st, Tensor) else st == 0)
        block_rules = None if rules is None else rules.rows(slice(lo, hi, every))
        forced_now = forced_now or (rules is not None and isinstance(st, int) and rules.per_row(st, cfg))
        if not forced_now and _normalize_in_kernel(logits, st, per, beam, max_len[lo:hi], cfg, kernels):
            if bias is None:  # with per-row steps, EOS is barred per row below
                bias = token_bias(logits.size(1) if short is None else short.vocab,
                                  step if isinstance(step, int) else cfg.min_len, cfg, sym, logits.device,
                                  () if rules is None else rules.banned)
                if short is not None:
                    bias = bias[short.ids]
                    eos = int(torch.searchsorted(short.ids, sym.eos))
            maxima, lse = kernels.scores.logsumexp_blocks(logits, bias, TOPK_BLOCK)
            no_eos = None if isinstance(st, int) else _bar_eos(logits, st, maxima, bias, cfg.min_len, eos)
            ext = best_extensions(logits, scores[lo:hi], beam, normalizer=Normalizer(bias, maxima, lse, no_eos, eos))
            parts.append(ext if short is None else (*ext[:3], short.ids[ext[3]]))
            continue
        if short is not None:
            logits = short.widen(logits)
        lprobs = step_log_probs(logits, st, max_len[lo:hi:every], None if generated is None else generated[lo:hi:every],
                                cfg, sym, keep_bf16=kernels.low_precision_scores, rules=block_rules)
        if per != beam:
            lprobs = lprobs.repeat_interleave(beam // per, dim=0)
        parts.append(best_extensions(lprobs, scores[lo:hi], beam, cfg.unkpen >= 0, kernels.blockwise_topk,
                                     maxima_of=kernels.block_maxima))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(p) for p in zip(*parts))


def _bar_eos(logits: Tensor, steps: Tensor, maxima: Tensor, bias: Tensor, min_len: int, eos: int) -> Tensor | None:
    """The rows before ``--min-len`` (their EOS is barred), with their EOS block's maxima taken without EOS
    (in place); None when there are none."""
    young = steps < min_len
    if not bool(young.any()):
        return None
    blk = eos // TOPK_BLOCK
    if blk < maxima.size(1):
        rows = young.nonzero(as_tuple=True)[0]
        start = blk * TOPK_BLOCK
        seg = logits[rows, start:start + TOPK_BLOCK].float() + bias[start:start + TOPK_BLOCK]
        seg[:, eos - start] = NEG_INF
        maxima[rows, blk] = seg.amax(dim=1)
    return young


# ------------------------------------------------------------------------------------------------ bookkeeping


class Finished:
    """Per sentence (any hashable id), the ``nbest`` best finished hypotheses (sorted, best first; ties keep the
    earlier one)."""

    def __init__(self, nbest: int):
        self.nbest = nbest
        self.hyps: dict[int, list[Hypothesis]] = {}

    def add(self, sent: int, hyp: Hypothesis) -> float:
        """Insert ``hyp``; return the ``nbest``-th best score of the sentence (-inf while fewer are finished)."""
        lst = self.hyps.setdefault(sent, [])
        bisect.insort_right(lst, hyp, key=lambda h: -h.score)
        del lst[self.nbest:]
        return lst[-1].score if len(lst) == self.nbest else NEG_INF

    def take(self, sent: int, n: int) -> list[Hypothesis]:
        """The ``n`` best of sentence ``sent``, which leaves."""
        return self.hyps.pop(sent, [])[:n]


def finalize(finished: Finished, kth_best: Tensor, sent_ids, local: Tensor, rows: Tensor,
              tokens: Tensor, pos_scores: Tensor, step: int | Tensor, eos_lp: Tensor, cum: Tensor,
              penalty: LengthPenalty, eos: int) -> None:
    """Finish the prefixes in ``rows`` (``step`` tokens each, or (n,) each row's) with EOS.

    ``local``: each row's sentence among the active ones; ``sent_ids``: active sentence -> position in the batch;
    ``eos_lp``/``cum``: the EOS log-probability and the cumulative log-probability with it. Updates ``kth_best``
    (per active sentence, the score a live hypothesis must beat) in place.
    """
    if isinstance(step, Tensor):  # rows at different steps: each row's penalty, rounded as a single one is
        lengths = step.tolist()
        lp = torch.tensor([penalty(float(n + 1)) for n in lengths], dtype=cum.dtype, device=cum.device)
        width = max(lengths)
    else:
        lengths, lp, width = [step] * rows.numel(), penalty(float(step + 1)), step
    toks = tokens[rows, 1:width + 1].tolist()
    ps = pos_scores[rows, :width].tolist()
    final = (cum / lp).tolist()
    eos_lps = eos_lp.tolist()
    updates: dict[int, float] = {}
    for m, a in enumerate(local.tolist()):
        n = lengths[m]
        hyp = Hypothesis(toks[m][:n] + [eos], final[m], ps[m][:n] + [eos_lps[m]])
        updates[a] = finished.add(sent_ids[a], hyp)
    if updates:
        idx = torch.tensor(list(updates), device=kth_best.device)
        kth_best[idx] = torch.tensor(list(updates.values()), dtype=kth_best.dtype, device=kth_best.device)


# ------------------------------------------------------------------------------------------------ searches


def max_target_positions(model: SearchModel) -> int:
    return int(model.max_positions()[1])


def start_rows(model, src_tokens: Tensor, src_lengths: Tensor, copies: int, kernels: DecodingKernels):
    """Encode once; give every sentence ``copies`` independent rows (samples) of encoder output and cache."""
    enc = model.encode(src_tokens, src_lengths)
    cache = model.new_cache(1, kernels)
    if copies > 1:
        order = torch.arange(src_tokens.size(0), device=src_tokens.device).repeat_interleave(copies)
        enc, cache = model.reorder(enc, cache, order)
    return enc, cache


Extensions = tuple[Tensor, Tensor, Tensor, Tensor]  # per unit (A, C): cumulative score, token log-prob, row, token


class SearchStrategy:
    """A way to search: registered as ``@register("search", NAME, config=ITS_OPTIONS)`` and chosen with ``--search
    NAME``; its own options arrive as ``cfg.options`` (an instance of its config, or None for the defaults).

    Every strategy runs the one search step (:func:`search_step`, looped by :func:`run_search` over a static batch
    and by continuous batching over sentences that join and leave); a strategy says how a step extends the
    hypotheses and when they end. The step keeps **units** of ``rows_per_unit()`` hypotheses (a beam;
    ``units_per_sentence`` units per sentence: samples are units of one row each), and at every step asks for
    each unit's candidate extensions, best first (:meth:`candidates`): the EOS ones finish a hypothesis, the
    first ``rows_per_unit()`` others stay live, and a unit leaves the batch when :meth:`done` says its n-best list
    can no longer change. A new strategy needs only :meth:`step` (candidates from the step's log-probabilities);
    the built-in ones override :meth:`candidates` with faster paths and :meth:`done` with their stopping rules.
    """

    units_per_sentence = 1
    rules: Rules | None = None  # the batch's per-row rules (set by the loop before start): pass to step_log_probs

    def __init__(self, cfg: SearchConfig):
        self.cfg = cfg

    def guide(self, guide: Guidance, sym: Symbols, max_len: Tensor) -> None:
        """Check the batch's guidance before the search starts (``max_len``: per sentence, the token limit);
        raise ValueError naming the sentence (0-based in the batch) where it cannot be followed."""
        if guide.constraints is not None and any(guide.constraints):
            raise ValueError(f"--search {self.cfg.search} does not take constraints; constrained decoding runs "
                             f"beam search (--search beam)")
        start = 1 if sym.forced is not None else 0
        for b, p in enumerate(guide.prefixes or ()):
            if p and start + len(p) > int(max_len[b]):
                raise ValueError(f"sentence {b}: its prefix has {len(p)} tokens but at most {int(max_len[b]) - start} "
                                 f"may be generated; shorten it or raise --max-len-a/--max-len-b")

    def rows_per_unit(self) -> int:
        """Live hypotheses per unit (the beam)."""
        return self.cfg.beam

    def kept_per_sentence(self) -> int:
        """Finished hypotheses kept per sentence while searching (the ``nbest`` best are returned)."""
        return self.cfg.nbest

    def start(self, model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, kernels: DecodingKernels,
              sample_ids: Tensor | None):
        """The encoder output and the decoder cache for the batch's units (and the strategy's own state)."""
        return model.encode(src_tokens, src_lengths), model.new_cache(self.rows_per_unit(), kernels)

    def candidates(self, model: SearchModel, tokens: Tensor, step: int | Tensor, enc, cache, max_len: Tensor,
                   scores: Tensor, sym: Symbols, kernels: DecodingKernels) -> Extensions:
        """Decode step ``step`` (column ``step`` of ``tokens`` (R, T) holds each row's newest token) and return
        every unit's candidate extensions (:meth:`step` of the log-probabilities under the search's rules).
        ``step`` is (R,), each row's, in a running search that units join (only beam search is run that way)."""
        logits = model.decode(tokens[:, step:step + 1], enc, cache)[:, -1]
        lprobs = step_log_probs(logits, step, max_len, tokens[:, 1:step + 1], self.cfg, sym, rules=self.rules)
        return self.step(step, lprobs, scores)

    def step(self, step: int, lprobs: Tensor, scores: Tensor) -> Extensions:
        """For ``lprobs`` (A * K, V), the next token's log-probabilities of each unit's K rows (consecutive), and
        their cumulative ``scores`` (A * K,): each unit's C candidate extensions, best first, as (A, C) tensors:
        the extended cumulative score, the token's log-probability, the row extended (0..K-1) and the token.
        Among them at least K that are not EOS, or the unit's search ends."""
        raise NotImplementedError(f"{type(self).__name__} defines neither step() nor candidates()")

    def finishing(self, fin: Tensor) -> Tensor:
        """Which EOS candidates (``fin``, (A, C) bool) finish a hypothesis (all of them by default)."""
        return fin

    def done(self, step: int, best: Tensor, fin: Tensor, max_len: Tensor, kth_best: Tensor) -> Tensor:
        """(A,) bool: the units whose n-best list can no longer change, given each unit's ``best`` live cumulative
        score (after ``step + 1`` tokens), the candidates that finished, the length limits and the score a live
        hypothesis must beat (the exact bound of "Early stopping" above)."""
        bonus = max(0.0, -self.cfg.unkpen)
        return score_upper_bound(best, step + 1, max_len, self.cfg.length_penalty, bonus) <= kth_best

    def keep_units(self, keep: Tensor) -> None:
        """The units ``keep`` stay (in that order): drop the strategy's state of the others."""

    def add_units(self, n: int, device: torch.device) -> None:
        """``n`` fresh units join the running search after the others (continuous batching): give them the
        strategy's state."""

    def chosen(self, sel: Tensor) -> None:
        """The step's candidates that stay live: ``sel`` (A, K), per unit, the indices of its candidates (those
        :meth:`candidates` returned) the K rows continue, in row order."""

    def __call__(self, model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, sym: Symbols,
                 sample_ids: Tensor | None = None, kernels: DecodingKernels = DecodingKernels(),
                 guide: Guidance | None = None) -> list[list[Hypothesis]]:
        """Per sentence of the right-padded batch, its ``cfg.nbest`` hypotheses, best first."""
        return run_search(self, model, src_tokens, src_lengths, sym, sample_ids, kernels, guide)


@dataclass
class SearchState:
    """What a search carries from one step to the next: ``A`` units of ``K`` rows (a unit: a beam, or a sample).

    Every unit is at its own step (``steps``); ``step`` is their common one where they started together (a static
    batch), None where units joined a running search later (continuous batching: :meth:`join`).
    """

    tokens: Tensor  # (A * K, T) column 0: the decoder's start token; column t + 1: the token generated at step t
    pos_scores: Tensor  # (A * K, T) column t: that token's log-probability
    scores: Tensor  # (A, K) the live rows' cumulative log-probabilities
    steps: Tensor  # (A,) int64: tokens each unit has generated
    max_len: Tensor  # (A,) each unit's length limit
    kth_best: Tensor  # (A,) the score a live hypothesis must beat (its sentence's nbest-th finished one)
    sentences: list  # each unit's sentence (its key in ``finished``)
    finished: Finished
    enc: Any  # the encoder output, in the form the model's decode takes
    cache: Any  # the decoder's state (the model's new_cache, or new_pool_cache for units that join later)
    step: int | None = 0

    @classmethod
    def start(cls, units: int, rows: int, max_len: Tensor, sentences: list, finished: Finished, enc, cache,
              sym: Symbols, width: int | None = None, step: int | None = 0) -> SearchState:
        """``units`` units of ``rows`` rows, each with only its first row alive (a unit's rows start identical),
        under the limits ``max_len`` (units,); ``width``: token columns (None: the longest limit's)."""
        dev = max_len.device
        T = int(max_len.max()) + 2 if width is None else width
        tokens = torch.full((units * rows, T), sym.eos, dtype=torch.long, device=dev)
        tokens[:, 0] = sym.first  # column 0: the decoder's start token (EOS)
        scores = torch.full((units, rows), NEG_INF, device=dev)
        scores[:, 0] = 0.0
        return cls(tokens, torch.zeros((units * rows, T), dtype=torch.float32, device=dev), scores,
                   torch.zeros(units, dtype=torch.long, device=dev), max_len, torch.full((units,), NEG_INF, device=dev),
                   sentences, finished, enc, cache, step)

    @property
    def units(self) -> int:
        return len(self.sentences)

    def join(self, other: SearchState, eos: int) -> None:
        """Append ``other``'s units (fresh ones, at step 0; token columns widened with ``eos``); the units are at
        different steps from then on."""
        width = max(self.tokens.size(1), other.tokens.size(1))
        self.tokens = torch.cat([_widen(self.tokens, width, eos), _widen(other.tokens, width, eos)])
        self.pos_scores = torch.cat([_widen(self.pos_scores, width, 0.0), _widen(other.pos_scores, width, 0.0)])
        for name in ("scores", "steps", "max_len", "kth_best"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.sentences = self.sentences + other.sentences
        self.step = None


def _widen(x: Tensor, width: int, value) -> Tensor:
    """``x`` (N, W, ...) with columns of ``value`` appended up to ``width``."""
    if x.size(1) >= width:
        return x
    return torch.cat([x, x.new_full((x.size(0), width - x.size(1)) + tuple(x.shape[2:]), value)], dim=1)


def search_step(strategy: SearchStrategy, model: SearchModel, state: SearchState, sym: Symbols,
                kernels: DecodingKernels) -> list:
    """One step of every unit of ``state`` (updated in place); returns the sentences of the units that left.

    The units' candidate extensions (the strategy's): the EOS ones (those the strategy lets finish) become
    finished hypotheses, the first K others of each unit stay live (a unit's rows continue rows of the same unit),
    and the units whose n-best list is final, or that are at their length limit, leave (their rows of encoder
    output and cache are dropped).
    """
    cfg = strategy.cfg
    K, A, dev = strategy.rows_per_unit(), state.units, state.tokens.device
    step = state.step if state.step is not None else state.steps.repeat_interleave(K)  # the tokens each row has
    row_max_len = state.max_len.repeat_interleave(K) if K > 1 else state.max_len
    top_s, top_lp, beam_i, tok = strategy.candidates(model, state.tokens, step, state.enc, state.cache, row_max_len,
                                                     state.scores.view(-1), sym, kernels)  # (A, C) each
    is_eos = tok == sym.eos
    fin = strategy.finishing(is_eos & (top_s > NEG_INF))
    if bool(fin.any()):
        local, c = fin.nonzero(as_tuple=True)
        finalize(state.finished, state.kth_best, state.sentences, local, local * K + beam_i[local, c], state.tokens,
                 state.pos_scores, state.step if state.step is not None else state.steps[local], top_lp[local, c],
                 top_s[local, c], cfg.length_penalty, sym.eos)
    C = top_s.size(1)
    sel = (is_eos.long() * C + torch.arange(C, device=dev)).topk(K, dim=1, largest=False).indices
    new_s, new_tok, new_lp = top_s.gather(1, sel), tok.gather(1, sel), top_lp.gather(1, sel)
    src_rows = (torch.arange(A, device=dev) * K)[:, None] + beam_i.gather(1, sel)
    strategy.chosen(sel)
    # the best live score: the first for strategies whose candidates come best first, not for all (constrained)
    done = strategy.done(state.step if state.step is not None else state.steps, new_s.max(dim=1).values, fin,
                         state.max_len, state.kth_best)
    done |= state.steps >= state.max_len  # at the limit only EOS was allowed
    keep, left = None, []
    if bool(done.any()):
        left = [state.sentences[i] for i in done.nonzero(as_tuple=True)[0].tolist()]
        keep = (~done).nonzero(as_tuple=True)[0]
        src_rows, new_s, new_tok, new_lp = src_rows[keep], new_s[keep], new_tok[keep], new_lp[keep]
        state.kth_best, state.max_len, state.steps = state.kth_best[keep], state.max_len[keep], state.steps[keep]
        strategy.keep_units(keep)
        state.sentences = [state.sentences[i] for i in keep.tolist()]
    order = src_rows.reshape(-1)
    if K > 1 or keep is not None:  # with one row per unit and none leaving, every row continues itself
        state.tokens, state.pos_scores = state.tokens[order], state.pos_scores[order]
        state.enc, state.cache = model.reorder(state.enc, state.cache, order, keep)
        if strategy.rules is not None:
            strategy.rules.reorder(order)
    if state.step is not None:
        state.tokens[:, state.step + 1] = new_tok.reshape(-1)
        state.pos_scores[:, state.step] = new_lp.reshape(-1)
        state.step += 1
    else:
        at = state.steps.repeat_interleave(K)
        rows = torch.arange(order.numel(), device=dev)
        state.tokens[rows, at + 1] = new_tok.reshape(-1)
        state.pos_scores[rows, at] = new_lp.reshape(-1)
    state.steps += 1
    state.scores = new_s
    return left


@torch.inference_mode()
def run_search(strategy: SearchStrategy, model: SearchModel, src_tokens: Tensor, src_lengths: Tensor,
               sym: Symbols, sample_ids: Tensor | None = None, kernels: DecodingKernels = DecodingKernels(),
               guide: Guidance | None = None) -> list[list[Hypothesis]]:
    """The static search every strategy runs (see :class:`SearchStrategy`): the batch's units start together
    and :func:`search_step` runs until none is left (or at the longest length limit)."""
    cfg = strategy.cfg
    dev = src_tokens.device
    B, U, K = src_tokens.size(0), strategy.units_per_sentence, strategy.rows_per_unit()
    max_len = max_lengths(src_lengths.to(dev), cfg, max_target_positions(model))  # per sentence
    guide = guide or Guidance()
    strategy.guide(guide, sym, max_len)
    strategy.rules = Rules(guide, B, U * K, sym, dev) if guide else None
    if U > 1:
        max_len = max_len.repeat_interleave(U)  # per unit
    enc, cache = strategy.start(model, src_tokens, src_lengths, kernels, sample_ids)
    state = SearchState.start(B * U, K, max_len, [a // U for a in range(B * U)],
                              Finished(strategy.kept_per_sentence()), enc, cache, sym)
    last = state.tokens.size(1) - 1
    while state.units and state.step < last:
        search_step(strategy, model, state, sym, kernels)
    return [state.finished.take(b, cfg.nbest) for b in range(B)]


def search(model: SearchModel, src_tokens: Tensor, src_lengths: Tensor, cfg: SearchConfig, sym: Symbols,
           sample_ids: Tensor | None = None, kernels: DecodingKernels = DecodingKernels(),
           guide: Guidance | None = None) -> list[list[Hypothesis]]:
    """Translate a batch of right-padded sources with the strategy ``cfg.search``; per sentence, its ``cfg.nbest``
    hypotheses, best first.

    ``sample_ids`` (one id per sentence, e.g. its input line) seed ``--sampling`` per sentence, so that a sample
    does not depend on batching; other searches ignore them. ``kernels``: how the device runs a step
    (``Backend.decoding_kernels``: row padding, candidate selection, score precision); the row padding and the
    candidate selection never change a result. ``guide``: prefixes, constraints and suppressed sequences
    (:class:`Guidance`); sentences with constraints are searched by the ``constrained`` strategy.
    """
    name = cfg.search
    if guide is not None and guide.constraints is not None and any(guide.constraints) and name == "beam":
        name = "constrained"
    strategy = get("search", name).obj
    if not guide:  # a strategy written before guidance existed keeps working
        return strategy(cfg)(model, src_tokens, src_lengths, sym, sample_ids=sample_ids, kernels=kernels)
    return strategy(cfg)(model, src_tokens, src_lengths, sym, sample_ids=sample_ids, kernels=kernels, guide=guide)
