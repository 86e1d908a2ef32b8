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

from attnmt.generation.beam import BeamSearch
from attnmt.generation.generator import collate
from attnmt.generation.search import (
    Finished,
    Hypothesis,
    SearchState,
    empty_translation,
    max_lengths,
    max_target_positions,
    nothing_to_translate,
    search_step,
)
from attnmt.models.kernels import DecodingKernels
from attnmt.registry import get


def unsupported(generator) -> str | None:
    """Why ``generator``'s model and search cannot be batched continuously (None: they can)."""
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
    if generator.pool is not None:
        return "--workers"
    if generator.shortlist is not None:
        return "--shortlist (each batch's candidates are its own)"
    if generator.model.new_pool_cache(cfg.beam, DecodingKernels(), generator.device) is None:
        return f"the model ({type(generator.model).__name__}; ensembles batch statically)"
    return None


class ContinuousSearch:
    """The running search of a :class:`~attnmt.generation.generator.Generator`'s model and beam search options.

    ``add`` sentences (id lists, each with a caller's key) at any time, then call ``step`` until ``size`` is 0:
    each step decodes one token of every sentence in flight and returns ``(key, hypotheses)`` of the sentences
    it finished, best first (``nbest`` of them), as ``Generator.generate`` gives them. A step is
    :func:`~attnmt.generation.search.search_step`, the static search's, over units at their own steps.
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
        self.strategy = get("search", self.cfg.search).obj(self.cfg)
        self.strategy.add_units(0, self.device)
        cache = self.model.new_pool_cache(self.cfg.beam, self.kernels, self.device)
        self.state = SearchState.start(0, self.cfg.beam, torch.zeros(0, dtype=torch.long, device=self.device), [],
                                       Finished(self.cfg.nbest), None, cache, self.sym, width=2, step=None)
        self.keys: dict[int, Hashable] = {}  # per sentence in flight (its number), the caller's key
        self.count = 0  # sentences numbered so far
        self.blank: list[tuple[Hashable, list[Hypothesis]]] = []  # nothing to translate: done at the next step

    @property
    def size(self) -> int:
        """Sentences in flight."""
        return len(self.keys) + len(self.blank)

    def add(self, sources: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> None:
        """Let ``sources`` (id lists with their final EOS, within the model's limit) join at the next step."""
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
        state = self.state
        with torch.inference_mode(), g.autocast():
            src, lengths = collate(sources, self.sym.pad, self.device)
            enc = self.model.encode(src, lengths)
            state.cache.admit(enc)  # the cache holds the joining sentences' encoder output until the next step
            numbers = list(range(self.count, self.count + len(sources)))
            limit = max_lengths(lengths, self.cfg, max_target_positions(self.model))
            fresh = SearchState.start(len(sources), self.cfg.beam, limit, numbers, state.finished, enc, state.cache,
                                      self.sym)
            state.join(fresh, self.sym.eos)
            state.enc = enc
            self.strategy.add_units(len(sources), self.device)
        self.count += len(sources)
        self.keys.update(zip(numbers, keys))
        g.stats.seconds += time.perf_counter() - t0

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Let the sentences of ``keys`` (whose caller has gone) end at the next step: their length limit becomes
        the tokens they have, so that step returns them cut short (the caller discards them)."""
        gone = set(keys)
        self.blank = [(k, h) for k, h in self.blank if k not in gone]
        rows = [i for i, n in enumerate(self.state.sentences) if self.keys[n] in gone]
        if rows:
            with torch.inference_mode():
                at = torch.tensor(rows, device=self.device)
                self.state.max_len[at] = self.state.steps[at]

    def step(self) -> list[tuple[Hashable, list[Hypothesis]]]:
        """Decode one token of every sentence in flight; the sentences this finished, with their hypotheses (those
        with nothing to translate at once)."""
        done, self.blank = self.blank, []
        g = self.generator
        g.stats.sentences += len(done)
        if self.keys:
            t0 = time.perf_counter()
            with torch.inference_mode(), g.autocast():
                left = search_step(self.strategy, self.model, self.state, self.sym, self.kernels)
            found = [(self.keys.pop(n), self.state.finished.take(n, self.cfg.nbest)) for n in left]
            g.stats.seconds += time.perf_counter() - t0
            g.stats.sentences += len(found)
            g.stats.target_tokens += sum(len(h[0].tokens) for _, h in found if h)
            done += found
        return done
