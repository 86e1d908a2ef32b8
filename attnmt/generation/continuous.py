"""Continuous batching: a beam search that sentences join and leave step by step.

A static search (:func:`~attnmt.generation.search.run_search`) starts a batch of sentences together and runs until
the last one ends: as its sentences finish, its steps hold fewer and fewer of them, each step still paying for
every weight of the model. A service whose clients send a sentence at a time never has more than a few dozen
sentences to batch, so its static batches spend most of their steps half empty. Here a sentence joins the
running search at the next step (:meth:`ContinuousSearch.add`) and leaves it as soon as its n-best list is final
(:meth:`ContinuousSearch.step` returns it), so every step decodes all the sentences in flight, each at its own
position (the decoder's pool cache, :mod:`attnmt.models.pool`).

Each sentence is searched exactly as :class:`~attnmt.generation.beam.BeamSearch` searches it: the same
candidates, rules, length limits and early stop, per sentence; only the other rows of the decoder's products
differ, so in fp32 the translations are the static search's (scores equal up to rounding); bf16 and int8 products
round with the batch's shape (int8 quantizes each product's activations with one scale), as static batchings do.

Beam search and greedy decoding (beam 1) of one model, without n-gram blocking, a repetition penalty or a rewarded
unknown word (``--unkpen`` < 0), and without prefixes, constraints or suppressed sequences; :func:`unsupported` says why another configuration is not taken (the caller then batches
statically).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from attnmt.generation.beam import BeamSearch, _options
from attnmt.generation.search import (
    NEG_INF,
    Finished,
    Hypothesis,
    empty_translation,
    finalize,
    max_lengths,
    max_target_positions,
    nothing_to_translate,
    score_extensions,
    score_upper_bound,
)
from attnmt.models.kernels import DecodingKernels


def unsupported(generator) -> str | None:
    """Why ``generator``'s model and search cannot be batched continuously (None: they can)."""
    from attnmt.registry import get, load_builtins

    load_builtins()
    cfg = generator.search_cfg
    if not issubclass(get("search", cfg.search).obj, BeamSearch):
        return f"the {cfg.search} search"
    if cfg.mbr_samples:
        return "--mbr-samples"
    if cfg.no_repeat_ngram_size:
        return "--no-repeat-ngram-size"
    if cfg.unkpen < 0:
        return "a negative --unkpen"
    if cfg.repetition_penalty != 1.0:
        return "--repetition-penalty"
    if not hasattr(generator.model, "new_pool_cache"):
        return f"the model ({type(generator.model).__name__}; ensembles batch statically)"
    if generator.pool is not None:
        return "--workers"
    if generator.shortlist is not None:
        return "--shortlist (each batch's candidates are its own)"
    return None


class ContinuousSearch:
    """The running search of a :class:`~attnmt.generation.generator.Generator`'s model and beam search options.

    ``add`` sentences (id lists, each with a caller's key) at any time, then call ``step`` until ``size`` is 0:
    each step decodes one token of every sentence in flight and returns ``(key, hypotheses)`` of the sentences
    it finished, best first (``nbest`` of them), as ``Generator.generate`` gives them.
    """

    def __init__(self, generator, kernels: DecodingKernels | None = None):
        """``kernels``: how the steps run (None: the generator's backend's ``decoding_kernels()``)."""
        reason = unsupported(generator)
        if reason is not None:
            raise ValueError(f"continuous batching does not take {reason}")
        self.generator = generator
        self.model, self.sym, self.cfg = generator.model, generator.symbols, generator.search_cfg
        self.kernels = generator.backend.decoding_kernels() if kernels is None else kernels
        self.device = generator.device
        self.K = self.cfg.beam
        self.beam_stop = _options(self.cfg).early_stop == "beam"
        self.cache = self.model.new_pool_cache(self.K, self.kernels, self.device)
        dev = self.device
        self.keys: list[Hashable] = []  # per live sentence, in row order
        self.finished = Finished(0, self.cfg.nbest)
        self.steps = torch.zeros(0, dtype=torch.long, device=dev)  # tokens each sentence has generated
        self.max_len = torch.zeros(0, dtype=torch.long, device=dev)
        self.kth_best = torch.zeros(0, device=dev)  # the score a live hypothesis must beat
        self.top_eos = torch.zeros(0, dtype=torch.long, device=dev)  # EOS among the beam best (--early-stop beam)
        self.scores = torch.zeros(0, self.K, device=dev)
        self.tokens = torch.zeros(0, 2, dtype=torch.long, device=dev)  # column t + 1: token t; column 0: start
        self.pos_scores = torch.zeros(0, 2, device=dev)
        self.joining = None  # the encoder output of the sentences added since the last step
        self.blank: list[tuple[Hashable, list[Hypothesis]]] = []  # nothing to translate: done at the next step

    @property
    def size(self) -> int:
        """Sentences in flight."""
        return len(self.keys) + len(self.blank)

    # ------------------------------------------------------------------------------------------ join

    def add(self, sources: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> None:
        """Let ``sources`` (id lists with their final EOS, within the model's limit) join at the next step."""
        from attnmt.generation.generator import collate
        from attnmt.models.transformer import EncoderOut

        keys = list(keys)
        if len(keys) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(keys)} keys")
        if not sources:
            return
        g = self.generator
        sources = [g.check_length(list(map(int, s)), i, "sources") for i, s in enumerate(sources)]
        blank = [nothing_to_translate(s, self.sym.eos) for s in sources]
        self.blank += [(k, empty_translation(self.sym.eos, self.cfg.nbest)) for k, b in zip(keys, blank) if b]
        keys = [k for k, b in zip(keys, blank) if not b]
        sources = [s for s, b in zip(sources, blank) if not b]
        if not sources:
            return
        t0 = time.perf_counter()
        with torch.inference_mode(), g.autocast():
            src, lengths = collate(sources, self.sym.pad, self.device)
            enc = self.model.encode(src, lengths)
            self.cache.admit(enc.padding_mask)
            if self.joining is not None:  # two groups before a step: one encoder output, padded alike
                a, b = self.joining, enc
                S = max(a.out.size(1), b.out.size(1))
                enc = EncoderOut(torch.cat([_pad_to(a.out, S, 0), _pad_to(b.out, S, 0)]),
                                 torch.cat([_pad_to(a.padding_mask, S, True), _pad_to(b.padding_mask, S, True)]))
            self.joining = enc
            n, K, dev = len(sources), self.K, self.device
            limit = max_lengths(lengths, self.cfg, max_target_positions(self.model))
            width = int(limit.max()) + 2
            if width > self.tokens.size(1):
                self.tokens = _pad_to(self.tokens, width, self.sym.eos)
                self.pos_scores = _pad_to(self.pos_scores, width, 0.0)
            fresh = self.tokens.new_full((n * K, self.tokens.size(1)), self.sym.eos)
            fresh[:, 0] = self.sym.first  # the decoder's start token
            self.tokens = torch.cat([self.tokens, fresh])
            self.pos_scores = torch.cat([self.pos_scores, self.pos_scores.new_zeros(n * K, self.tokens.size(1))])
            scores = torch.full((n, K), NEG_INF, device=dev)
            scores[:, 0] = 0.0  # a sentence's rows start identical: only the first one is alive at first
            self.scores = torch.cat([self.scores, scores])
            self.steps = torch.cat([self.steps, self.steps.new_zeros(n)])
            self.max_len = torch.cat([self.max_len, limit])
            self.kth_best = torch.cat([self.kth_best, torch.full((n,), NEG_INF, device=dev)])
            self.top_eos = torch.cat([self.top_eos, self.top_eos.new_zeros(n)])
        self.keys.extend(keys)
        self.finished.hyps.extend([] for _ in range(n))
        g.stats.seconds += time.perf_counter() - t0

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Let the sentences of ``keys`` (whose caller has gone) end at the next step: their length limit becomes
        the tokens they have, so that step returns them cut short (the caller discards them)."""
        gone = set(keys)
        self.blank = [(k, h) for k, h in self.blank if k not in gone]
        rows = [i for i, k in enumerate(self.keys) if k in gone]
        if rows:
            with torch.inference_mode():
                at = torch.tensor(rows, device=self.device)
                self.max_len[at] = self.steps[at]

    # ------------------------------------------------------------------------------------------ step

    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """Decode one token of every sentence in flight; the sentences this finished, with their hypotheses (those
        with nothing to translate at once)."""
        done, self.blank = self.blank, []
        g = self.generator
        g.stats.sentences += len(done)
        if self.keys:
            t0 = time.perf_counter()
            with torch.inference_mode(), g.autocast():
                found = self._step()
            g.stats.seconds += time.perf_counter() - t0
            g.stats.sentences += len(found)
            g.stats.target_tokens += sum(len(h[0].tokens) for _, h in found if h)
            done += found
        return done

    def _step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        from attnmt.models.transformer import EncoderOut

        cfg, K, dev, eos = self.cfg, self.K, self.device, self.sym.eos
        A = len(self.keys)
        row_steps = self.steps.repeat_interleave(K)
        prev = self.tokens.gather(1, row_steps[:, None])  # each row's newest token
        enc = self.joining
        if enc is None:  # no new encoder output: the places hold every sentence's keys/values
            enc = EncoderOut(self.tokens.new_zeros(0, 1, 1).float(), self.tokens.new_zeros(0, 1).bool())
        feats = self.model.decode_features(prev, enc, self.cache)[:, -1]
        self.joining = None
        top_s, top_lp, beam_i, tok = self._extensions(feats, row_steps, self.max_len.repeat_interleave(K))
        is_eos = tok == eos
        fin = is_eos & (top_s > NEG_INF)
        if self.beam_stop:  # fairseq's rule: only EOS extensions among the `beam` best finish a hypothesis
            fin[:, K:] = False
        if bool(fin.any()):
            local, c = fin.nonzero(as_tuple=True)
            finalize(self.finished, self.kth_best, range(A), local, local * K + beam_i[local, c], self.tokens,
                     self.pos_scores, self.steps[local], top_lp[local, c], top_s[local, c], cfg.length_penalty, eos)
        C = top_s.size(1)
        sel = (is_eos.long() * C + torch.arange(C, device=dev)).topk(K, dim=1, largest=False).indices
        new_s, new_tok, new_lp = top_s.gather(1, sel), tok.gather(1, sel), top_lp.gather(1, sel)
        src_rows = (torch.arange(A, device=dev) * K)[:, None] + beam_i.gather(1, sel)
        penalty = cfg.length_penalty
        done = score_upper_bound(new_s[:, 0], self.steps + 1, self.max_len, penalty) <= self.kth_best
        done |= self.steps >= self.max_len  # at the limit only EOS was allowed
        if self.beam_stop:
            self.top_eos += fin[:, :K].sum(dim=1)
            done |= self.top_eos >= K
        out: list[tuple[Hashable, list[Hypothesis]]] = []
        keep = None
        if bool(done.any()):
            gone = done.nonzero(as_tuple=True)[0].tolist()
            out = [(self.keys[i], self.finished.hyps[i][: cfg.nbest]) for i in gone]
            keep = (~done).nonzero(as_tuple=True)[0]
            kept = keep.tolist()
            self.keys = [self.keys[i] for i in kept]
            self.finished.hyps = [self.finished.hyps[i] for i in kept]
            src_rows, new_s, new_tok, new_lp = src_rows[keep], new_s[keep], new_tok[keep], new_lp[keep]
            self.steps, self.max_len = self.steps[keep], self.max_len[keep]
            self.kth_best, self.top_eos = self.kth_best[keep], self.top_eos[keep]
        order = src_rows.reshape(-1)
        self.tokens, self.pos_scores = self.tokens[order], self.pos_scores[order]
        self.cache.reorder(order, keep)
        rows = torch.arange(order.numel(), device=dev)
        at = self.steps.repeat_interleave(K)
        self.tokens[rows, at + 1] = new_tok.reshape(-1)
        self.pos_scores[rows, at] = new_lp.reshape(-1)
        self.scores = new_s
        self.steps = self.steps + 1
        return out

    def _extensions(self, feats: Tensor, row_steps: Tensor, row_max_len: Tensor):
        """Every sentence's best extensions (as ``next_token_extensions``), each row at its own step.

        The sentences that joined since the last step are the last ones (a sentence joins at the end, and every
        step advances all); they are scored as the static search scores its first step, from one row each (their
        rows start alike), so that their numbers are its numbers in every precision.
        """
        K, cfg, sym, kernels = self.K, self.cfg, self.sym, self.kernels
        fresh = int((self.steps == 0).sum())
        old = feats.size(0) - fresh * K
        scores = self.scores.view(-1)
        parts = []
        if old:
            parts.append(score_extensions(self.model, feats[:old], row_steps[:old], row_max_len[:old], None,
                                          scores[:old], K, cfg, sym, kernels))
        if fresh:
            parts.append(score_extensions(self.model, feats[old::K], 0, row_max_len[old:], None, scores[old:], K,
                                          cfg, sym, kernels, per=1))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(p) for p in zip(*parts))


def _pad_to(x: Tensor, width: int, value) -> Tensor:
    """``x`` with dimension 1 padded with ``value`` up to ``width``."""
    if x.size(1) >= width:
        return x
    pad = x.new_full((x.size(0), width - x.size(1)) + tuple(x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)
