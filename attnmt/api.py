"""The Python API: a trained model loaded once, translating and scoring lists of raw sentences.

    from attnmt import Translator

    with Translator("checkpoints/checkpoint_best.pt", beam=4) as t:
        t.translate(["A man rides a bike.", "Two dogs play."])   # -> ["Ein Mann ...", "Zwei Hunde ..."]

A ``Translator`` is ``attnmt translate`` as an object: the options are the command's (Python spelling: ``beam``,
``lenpen``, ``device``, ``precision``, ``quantize``, ``max_tokens``, ``workers``, ...), checked the same way, and a
list is batched, ordered and searched exactly as the command does it, on the same backend, so the translations are
the command's. Bad input raises :class:`attnmt.errors.UserError` with the command's one-line message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnmt.backends import configure_process, warn_if_forked
from attnmt.errors import UserError
from attnmt.generation.alignment import attention_rows
from attnmt.generation.continuous import ContinuousSearch, unsupported
from attnmt.generation.forced import reference_log_probs
from attnmt.generation.generator import Generator, make_batches
from attnmt.generation.guidance import CONSTRAINT_ORDERS, suppressed, target_ids
from attnmt.generation.options import generation_configs, known_options, search_config, search_option_names
from attnmt.generation.search import Guidance, Hypothesis, SearchConfig, max_target_positions
from attnmt.inference import load_generator
from attnmt.interop.hub import resolve

__all__ = ["Alignment", "ReferenceScore", "Translation", "Translator"]


@dataclass
class Alignment:
    """Encoder-decoder attention of one translation: ``weights[t][s]``, the last decoder layer's weights averaged
    over its heads, for target token ``t`` (predicted from row ``t``) over source token ``s``."""

    source_tokens: list[str]  # the source pieces, the final </s> included
    target_tokens: list[str]  # the target pieces, the final </s> included
    weights: list[list[float]]


@dataclass
class Translation:
    """One sentence's translation with its details (``Translator.translate(..., details=True)``)."""

    text: str  # the best hypothesis, detokenized
    score: float  # its search score: log-probability / length penalty (natural log)
    tokens: list[str]  # its target pieces, the final </s> included
    positional_scores: list[float]  # log-probability of each token (natural log)
    hypotheses: list[Translation] = field(default_factory=list)  # the ``nbest`` best, this one first
    alignment: Alignment | None = None  # with ``alignment=True``


@dataclass
class ReferenceScore:
    """How likely the model finds a given translation (``Translator.score``): teacher-forced log-probabilities."""

    logprob: float  # sum over the target tokens, the final </s> included (natural log)
    positional_scores: list[float]
    tokens: list[str]

    @property
    def score(self) -> float:
        """The mean log-probability per token (fairseq's ``--score-reference`` score, in natural log)."""
        return self.logprob / max(1, len(self.positional_scores))


class Translator:
    """A checkpoint (or an ensemble ``a.pt:b.pt``) loaded once, with ``attnmt translate``'s options.

    ``options``: any option of ``attnmt translate`` in Python spelling, e.g. ``beam=5, lenpen=1.0,
    precision="auto", quantize="int8", device="cpu", max_tokens=4000, workers=2, remove_bpe="@@ "``. Search
    options may also be given per call of ``translate``. Thread-safe: calls are served one at a time.
    """

    def __init__(self, path: str | os.PathLike, **options: Any):
        remove_bpe = options.pop("remove_bpe", None)
        self._check_names(options, known_options(), "Translator")
        self.search_cfg, self.gen_cfg = generation_configs(_given(options))
        configure_process("generate", self.gen_cfg.device)
        self.bundle, self.generator = load_generator(resolve(path), self.search_cfg, self.gen_cfg)
        self.note = self.bundle.with_remove_bpe(remove_bpe)  # what --remove-bpe would print, if anything
        self._options = options
        self._generators: dict[str, Any] = {repr(self.search_cfg): self.generator}
        self._lock = threading.Lock()  # one call translates at a time
        self._generators_lock = threading.Lock()
        self._next_id = 0  # numbers sentences across calls, as a stream: sampling seeds follow it
        self.closed = False

    @classmethod
    def from_pretrained(cls, name_or_dir: str | os.PathLike, **options: Any) -> Translator:
        """A pretrained model ready to translate: a Hugging Face hub name (``Helsinki-NLP/opus-mt-en-de``, read
        from the local Hugging Face cache, downloaded into it first where a network is reachable), a directory
        ``save_pretrained`` wrote, or an attnmt checkpoint; the options are ``Translator``'s (``src_lang`` and
        ``tgt_lang`` choose a multilingual model's pair). A Hugging Face model is imported once into attnmt's cache
        (``attnmt.interop.hub.resolve``); ``Translator(path)`` takes the same names."""
        return cls(name_or_dir, **options)

    # ---------------------------------------------------------------------------------------------- properties

    @property
    def source_lang(self) -> str:
        return self.bundle.source_lang

    @property
    def target_lang(self) -> str:
        return self.bundle.target_lang

    @property
    def device(self) -> torch.device:
        return self.generator.device

    @property
    def precision(self) -> str:
        return self.generator.backend.precision

    @property
    def stats(self):
        """Sentences, tokens and seconds translated so far (``GenerationStats``, all configs together)."""
        return self.generator.stats

    # ---------------------------------------------------------------------------------------------- translate

    def translate(self, sources: str | Sequence[str], *, details: bool = False, alignment: bool = False,
                  prefix: str | Sequence[str | None] | None = None,
                  constraints: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
                  constraint_order: str = "unordered", suppress: Sequence[str] = (),
                  return_alternatives: bool = False, min_alternative_expansion_prob: float = 0.0, **search: Any):
        """Translate one sentence (a ``str``) or a list of them, in order.

        Returns the translation (``str``), or with ``nbest`` > 1 the list of the ``nbest`` best; for a list of
        sources, a list of those. ``details=True`` (or ``alignment=True``) returns :class:`Translation` objects
        instead: text, score, pieces, per-token log-probabilities, the ``nbest`` hypotheses and, with
        ``alignment=True``, the attention weights. ``search``: search options for this call (``beam``, ``nbest``,
        ``lenpen``, ``sampling``, ...), on top of the ones given when loading; for a multilingual model,
        ``src_lang`` and ``tgt_lang`` choose this call's language pair.

        Steering (per sentence for a list: a list of these): ``prefix``, the target text the translation starts
        with (forced); ``constraints``, target phrases every hypothesis contains (``constraint_order``
        ``"ordered"``: in that order); ``suppress``, texts (or lists of target token ids) no translation contains; ``return_alternatives``:
        the ``nbest`` most probable continuations at the end of the prefix (each token at least
        ``min_alternative_expansion_prob`` likely), each completed by the search, as CTranslate2 returns them.
        """
        single = isinstance(sources, str)
        lines = _lines([sources] if single else sources, "sources")
        if single:
            prefix = None if prefix is None else [prefix]
            constraints = None if constraints is None else [constraints]
        guide = self.guidance(len(lines), prefix, constraints, constraint_order, suppress)
        if return_alternatives:
            results = self.alternatives(lines, guide, min_alternative_expansion_prob, details or alignment, **search)
        else:
            results = self.translate_batch(lines, details=details or alignment, alignment=alignment, guide=guide,
                                           **search)
        return results[0] if single else results

    def guidance(self, n: int, prefix=None, constraints=None, constraint_order: str = "unordered",
                 suppress: Sequence[str] = ()):
        """The :class:`~attnmt.generation.search.Guidance` of ``n`` sentences from texts (see :meth:`translate`);
        a ``UserError`` naming the bad item."""
        if constraint_order not in CONSTRAINT_ORDERS:
            raise UserError(f"constraint_order must be one of {', '.join(CONSTRAINT_ORDERS)}, got "
                            f"{shown_value(constraint_order)}")
        b = self.bundle
        prefixes = phrases = None
        if prefix is not None:
            items = _per_sentence(prefix, n, "prefix")
            prefixes = []
            for i, p in enumerate(items):
                if p is not None and not isinstance(p, str):
                    raise UserError(f"prefix[{i}]: expected a string or None, got {type(p).__name__}")
                prefixes.append(target_ids(b, p, f"prefix[{i}]:") if p and p.strip() else [])
        if constraints is not None:
            items = _per_sentence(constraints, n, "constraints")
            phrases = []
            for i, c in enumerate(items):
                texts = _lines(c, f"constraints[{i}]") if c is not None else []
                phrases.append([target_ids(b, t, f"constraints[{i}]:") for t in texts if t.strip()])
        items = [suppress] if isinstance(suppress, str) else list(suppress)
        ids = [x for x in items if not isinstance(x, str)]  # token id lists, as transformers' bad_words_ids
        for seq in ids:
            if not isinstance(seq, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in seq):
                raise UserError(f"suppress: give texts or lists of token ids, got {shown_value(seq)}")
        texts = _lines([x for x in items if isinstance(x, str)], "suppress")
        return Guidance(prefixes, phrases, suppressed(b, texts, ids), constraint_order == "ordered")

    def alternatives(self, lines: list[str], guide, min_prob: float = 0.0, details: bool = False, **search: Any):
        """Per sentence, the ``nbest`` alternatives at the end of its prefix (see :meth:`translate`): a list of
        texts, or with ``details`` a :class:`Translation` whose ``hypotheses`` are them, in the alternatives'
        order."""
        if not (isinstance(min_prob, (int, float)) and math.isfinite(min_prob) and 0 <= min_prob <= 1):
            raise UserError(f"min_alternative_expansion_prob must be a probability (0 to 1), got "
                            f"{shown_value(min_prob)}")
        if guide.constraints is not None and any(guide.constraints):
            raise UserError("return_alternatives takes a prefix, not constraints; drop one of them")
        return self.alternatives_encoded(self.encode_batch(lines, search.get("src_lang")), guide, min_prob, details,
                                         **search)

    def alternatives_encoded(self, sources: list[list[int]], guide, min_prob: float = 0.0, details: bool = False,
                             **search: Any):
        """:meth:`alternatives` for sentences already encoded (what the service calls)."""
        warn_if_forked()
        n = search.pop("nbest", None) or self.search_cfg.nbest  # alternatives, each searched alone: not bound by beam
        if not (isinstance(n, int) and 1 <= n <= 1024):
            raise UserError(f"nbest (the number of alternatives) must be an integer from 1 to 1024, got {shown_value(n)}")
        generator = self.generator_for(search)
        out = []
        with self._lock:
            self._check_open()
            for i, ids in enumerate(sources):
                if len(ids) > self.max_source_tokens():
                    raise UserError(f"sources[{i}]: the source has {len(ids)} tokens but the model accepts at most "
                                    f"{self.max_source_tokens()}; shorten or split it")
                prefix = guide.prefixes[i] if guide.prefixes is not None else []
                generator.check_guide([ids], type(guide)(prefixes=[prefix + [0]]), i, "sources")
                hyps = generator.alternatives(ids, prefix, n, float(min_prob), guide.suppress)
                k = max(2, len(hyps))  # a list of them, however many (how _result shapes an n-best list)
                cfg = dataclasses.replace(generator.search_cfg, beam=max(k, generator.search_cfg.beam), nbest=k)
                res = self._result(ids, hyps, cfg, details, False)
                out.append(res if details else list(res) if isinstance(res, list) else [res])
        return out

    def translate_batch(self, lines: list[str], *, details: bool = False, alignment: bool = False, guide=None,
                        **search: Any):
        """``translate`` for a list of strings already checked (``guide``: their :meth:`guidance`)."""
        return self.translate_encoded(self.encode_batch(lines, search.get("src_lang")), details=details,
                                      alignment=alignment, guide=guide, **search)

    def translate_encoded(self, sources: list[list[int]], *, details: bool = False, alignment: bool = False,
                          cancelled=None, guide=None, **search: Any):
        """``translate`` for sentences already encoded (``encode``): what the service calls per batch.
        ``cancelled()``: asked between search batches; True stops there (the sentences not searched get None);
        ``guide``: the sentences' :meth:`guidance`."""
        warn_if_forked()
        generator = self.generator_for(search)
        limit = self.max_source_tokens()
        if not self.gen_cfg.truncate_source:
            for i, ids in enumerate(sources):
                if len(ids) > limit:
                    raise UserError(f"sources[{i}]: the source has {len(ids)} tokens but the model accepts at most "
                                    f"{limit}; shorten or split it, or load with truncate_source=True")
        if guide:
            generator.check_guide(sources, guide, 0, "sources")
        with self._lock:
            self._check_open()
            first, self._next_id = self._next_id, self._next_id + len(sources)
            out: list[Any] = [None] * len(sources)
            for i, hyps in generator.generate(sources, self.gen_cfg.max_tokens, self.gen_cfg.batch_size,
                                              first_id=first, where="input", guide=guide):
                out[i] = self._result(sources[i], hyps, generator.search_cfg, details or alignment, alignment)
                if cancelled is not None and cancelled():
                    break
        return out

    def continuous_unsupported(self, **search: Any) -> str | None:
        """Why sentences of these search options cannot be batched continuously (None: they can)."""
        return unsupported(self.generator_for(search))

    def continuous_search(self, **search: Any):
        """A running search of these search options that sentences join and leave step by step (continuous
        batching, what ``attnmt serve --batching continuous`` runs): ``add(sources, keys)`` encoded sentences at
        any time, then ``step()`` until ``size`` is 0, each step returning the ``(key, hypotheses)`` it finished;
        :meth:`finish` turns hypotheses into what ``translate`` returns. In fp32 each translation is the one
        ``translate`` gives. Use it from one thread. Raises :class:`UserError` where the model or the options need
        static batches (:meth:`continuous_unsupported`)."""
        reason = self.continuous_unsupported(**search)
        if reason is not None:
            raise UserError(f"continuous batching does not take {reason}; translate with translate() instead")
        self._check_open()
        return ContinuousSearch(self.generator_for(search))

    def finish(self, source_ids: list[int], hyps: list[Hypothesis], *, details: bool = False,
               alignment: bool = False, **search: Any):
        """What ``translate_encoded`` returns for the sentence ``source_ids``, from its ``hyps`` (best first)."""
        cfg = self.generator_for(search).search_cfg
        return self._result(source_ids, hyps, cfg, details or alignment, alignment)

    def encode(self, line: str) -> list[int]:
        """The source ids of a raw line (its final </s> included), as ``translate`` segments it."""
        return self.bundle.encode_source(line)

    def encode_batch(self, lines: list[str], src_lang: str | None = None) -> list[list[int]]:
        """``encode`` for a list of lines (``src_lang``: a multilingual model's source language for them)."""
        return self.bundle.encode_sources(lines, src_lang)

    def max_source_tokens(self) -> int:
        """The longest source, in tokens with the final </s>, the model accepts."""
        return self.bundle.max_source_positions()

    def max_target_tokens(self, source_tokens: int) -> int:
        """The most tokens the search may write for a source of ``source_tokens`` (``--max-len-a/b`` within the
        model's positions), the final </s> not counted."""
        cfg = self.search_cfg
        bound = max(1, math.floor(source_tokens * cfg.max_len_a + cfg.max_len_b))
        return min(bound, max(1, max_target_positions(self.bundle.model) - 1))

    def generator_for(self, search: dict[str, Any]):
        """The generator of this call's search options and target language (the loaded one when there are none)."""
        search = dict(search)
        search.pop("src_lang", None)  # the encoding's (encode_batch)
        target = search.pop("tgt_lang", None)
        if target == self.bundle.target_lang:
            target = None
        if not search and target is None:
            return self.generator

        self._check_names(search, _search_names(), "translate")
        symbols = self.bundle.symbols_for(target)
        given = {**_given({k: v for k, v in self._options.items() if k in _search_names()}), **_given(search)}
        cfg = search_config(given)
        key = f"{cfg!r} -> {target}"
        with self._generators_lock:
            found = self._generators.get(key)
            if found is None:
                if self.generator.pool is not None:
                    what = ", ".join(sorted(search) + (["tgt_lang"] if target is not None else []))
                    raise UserError(f"search options per call ({what}) need workers=1: "
                                    f"the {len(self.generator.pool)} decoding workers were started with the "
                                    f"Translator's own; give them when loading")
                found = Generator(self.bundle.model, symbols, cfg, self.generator.backend,
                                  max_source_positions=self.bundle.max_source_positions(),
                                  truncate_source=self.gen_cfg.truncate_source,
                                  target_text=self.bundle.target_text)
                found.stats = self.generator.stats
                self._generators[key] = found
        return found

    def _result(self, source_ids: list[int], hyps: list[Hypothesis], cfg: SearchConfig, details: bool,
                alignment: bool):
        b = self.bundle
        texts = [b.detokenize(b.target_pieces(h.tokens)) for h in hyps] or [""]
        if not details:
            return texts[0] if cfg.nbest == 1 else texts
        found = [Translation(text=t, score=float(h.score), tokens=[b.tgt_dict[i] for i in h.tokens],
                             positional_scores=[float(p) for p in h.positional_scores]) for t, h in zip(texts, hyps)]
        if not found:  # nothing within the length limit: an empty translation, as the command writes
            found = [Translation(text="", score=float("-inf"), tokens=[], positional_scores=[])]
        best = found[0]
        best.hypotheses = found
        if alignment and hyps:
            best.alignment = self._alignment(source_ids, list(hyps[0].tokens))
        return best

    def _alignment(self, source_ids: list[int], target_ids: list[int]) -> Alignment:
        b, g = self.bundle, self.generator
        with torch.inference_mode(), g.autocast():
            weights = attention_rows(b.model, source_ids, [target_ids], b.symbols.pad, b.symbols.first, g.device)[0]
        return Alignment(source_tokens=[b.src_dict[i] for i in source_ids],
                         target_tokens=[b.tgt_dict[i] for i in target_ids],
                         weights=[[round(float(w), 6) for w in row] for row in weights])

    # ---------------------------------------------------------------------------------------------- score

    def score(self, sources: Sequence[str], references: Sequence[str]) -> list[ReferenceScore]:
        """How likely the model finds each reference as the translation of its source (forced decoding), batched
        by length as ``translate`` batches."""
        srcs, refs = _lines(sources, "sources"), _lines(references, "references")
        if len(srcs) != len(refs):
            raise UserError(f"score: {len(srcs)} sources but {len(refs)} references; give one reference per source")
        b, g = self.bundle, self.generator
        with self._lock:
            self._check_open()
            src_ids = b.encode_sources(srcs)
            for i, ids in enumerate(src_ids):
                if len(ids) > self.max_source_tokens():
                    raise UserError(f"sources[{i}]: the source has {len(ids)} tokens but the model accepts at most "
                                    f"{self.max_source_tokens()}; shorten or split it")
            pieces = b.tgt_pipeline.encode_batch(refs) if refs else []
            tgt_ids = [b.tgt_dict.encode_line(p) for p in pieces]
            limit = b.model.max_positions()[1]
            for i, t in enumerate(tgt_ids):
                if len(t) > limit:
                    raise UserError(f"references[{i}]: the reference has {len(t)} tokens but the model accepts "
                                    f"at most {limit}; shorten or split it")
            max_tokens = self.gen_cfg.max_tokens or g.backend.decoding_max_tokens()
            lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
            out: list[ReferenceScore | None] = [None] * len(srcs)
            for batch in make_batches(lengths, max_tokens, self.gen_cfg.batch_size):
                for i, lp in zip(batch, self.score_encoded([src_ids[i] for i in batch], [tgt_ids[i] for i in batch])):
                    out[i] = ReferenceScore(logprob=float(sum(lp)), positional_scores=lp,
                                            tokens=[b.tgt_dict[k] for k in tgt_ids[i]])
        return out  # type: ignore[return-value]

    def score_encoded(self, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        """Per-token log-probabilities of each target (ids, final </s> included) given its source (ids), in one
        batch."""
        warn_if_forked()
        return reference_log_probs(self.generator, sources, targets)

    # ---------------------------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Stop the decoding workers (if any); the translator refuses work afterwards."""
        with self._lock:
            self.closed = True
            self.generator.close()

    def __enter__(self) -> Translator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Translator({str(self.bundle.path)!r}, {self.source_lang}->{self.target_lang}, "
                f"{self.bundle.arch or 'model'}, {self.device}, {self.precision}, {self.search_cfg.describe()})")

    def _check_open(self) -> None:
        if self.closed:
            raise UserError("this Translator was closed; load the model again")

    @staticmethod
    def _check_names(given: dict[str, Any], valid: set[str], what: str) -> None:
        unknown = sorted(k for k in given if k not in valid)
        if unknown:
            raise UserError(f"{what}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; valid: "
                            f"{', '.join(sorted(valid))}")


def _search_names() -> set[str]:
    return search_option_names()


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """Options given in Python: the command line's spelling of a value (``None`` leaves the default)."""
    return {k: v for k, v in options.items() if v is not None}


def shown_value(v: Any) -> str:
    """A value in an error message, cut short."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _per_sentence(items: Any, n: int, what: str) -> list:
    """One item per sentence: a list of ``n``."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or len(items) != n:
        raise UserError(f"{what}: expected a list of {n} (one per sentence), got "
                        f"{type(items).__name__}{f' of {len(items)}' if isinstance(items, Sequence) else ''}")
    return list(items)


def _lines(items: Any, what: str) -> list[str]:
    """A list of sentences, each a ``str`` on one line; anything else is refused with where it is."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise UserError(f"{what}: expected a list of strings, got {type(items).__name__}")
    out = []
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise UserError(f"{what}[{i}]: expected a string, got {type(s).__name__}; decode bytes to str first")
        if "\n" in s or "\r" in s:
            raise UserError(f"{what}[{i}]: a sentence spans several lines; give one line per sentence")
        out.append(s)
    return out

