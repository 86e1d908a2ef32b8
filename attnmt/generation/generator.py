"""Batched translation: length-sorted batches through the search, results handed back in input order.

Sentences are sorted by length and cut into batches of at most ``--max-tokens`` padded source tokens (and
``--batch-size`` sentences), so little compute goes to padding; each batch is encoded once and searched with the
incremental cache; results are buffered and released strictly in input order, as soon as every earlier sentence
is done. Output lines are formatted here too (plain text, or fairseq's ``S/T/H/D/P`` lines).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from attnmt.backends import Backend, backend_for
from attnmt.backends.precision import requested_precision
from attnmt.data.batching import batch_by_size
from attnmt.data.pairs import pad_sequences
from attnmt.errors import UserError
from attnmt.generation import mbr
from attnmt.generation.search import (
    Guidance,
    Hypothesis,
    Rules,
    SearchConfig,
    Symbols,
    empty_translation,
    max_lengths,
    nothing_to_translate,
    search,
    step_log_probs,
)
from attnmt.generation.shortlist import ShortlistedModel
from attnmt.generation.workers import WorkerPool


@dataclass
class GenerationConfig:
    """How translation runs: batching, device, numeric precision."""

    max_tokens: int | None = field(default=0, metadata={
        "help": "Most padded source tokens per batch (the beam multiplies the work); sentences are length-sorted. "
                "0: the device's choice (8192 on the CPU, 16000 on a GPU, which needs larger batches to fill it)."})
    batch_size: int | None = field(default=None, metadata={"help": "Most sentences per batch (none: no limit).",
                                                           "aliases": ("--max-sentences",)})
    device: str = field(default="auto", metadata={"help": "auto (cuda when available), cpu, cuda or cuda:N."})
    cpu: bool = field(default=False, metadata={"help": "fairseq's spelling of --device cpu."})
    precision: Literal["auto", "fp32", "bf16", "fp16"] = field(default="fp32", metadata={
        "help": "auto: bf16 where the CPU computes it natively (AMX, AVX-512 BF16), fp32 otherwise and on GPUs; "
                "bf16: the model cast to bfloat16 once (an error on a CPU without native bf16); fp16: cast to "
                "float16 (GPU only); search scores stay float32."})
    bf16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision bf16."})
    fp16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision fp16 (GPU only)."})
    quantize: Literal["none", "int8"] = field(default="none", metadata={
        "help": "int8: dynamic int8 quantization of the linear layers (CPU only); activations in fp32 (fbgemm), "
                "or in bf16 with --precision auto/bf16 on a CPU with native bf16 (oneDNN; int8 for the wide "
                "products, which is fastest there)."})
    threads: int = field(default=0, metadata={"min": 0, "max": 4096, "help": "CPU threads for torch (0: torch's default)."})
    workers: int = field(default=1, metadata={"min": 1, "max": 256,
        "help": "Decoding processes on the CPU, each translating whole batches with --threads/N threads; "
                "2 on 2 cores suits small models (CTranslate2's inter_threads)."})
    truncate_source: bool = field(default=False, metadata={
        "help": "Cut sources longer than the model accepts instead of refusing them."})
    src_lang: str | None = field(default=None, metadata={
        "help": "A multilingual model's source language (M2M-100: en, de, ...; NLLB: eng_Latn, ...) [default: the "
                "one it was imported with]."})
    tgt_lang: str | None = field(default=None, metadata={
        "help": "A multilingual model's target language [default: the one it was imported with]."})
    shortlist: str | None = field(default=None, metadata={
        "help": "A vocabulary shortlist (attnmt build-shortlist; CTranslate2's vmap.txt format): each batch is "
                "searched over the target tokens its source words map to, the projection to the vocabulary "
                "computed for those only."})

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"--max-tokens must be positive (or 0: the device's choice), got {self.max_tokens}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be positive, got {self.batch_size}")
        if self.threads < 0:
            raise ValueError(f"--threads must not be negative, got {self.threads}")
        if self.workers < 1:
            raise ValueError(f"--workers must be positive, got {self.workers}")
        self.precision = requested_precision(self.precision, self.bf16, self.fp16)
        if self.cpu:
            if self.device not in ("auto", "cpu"):
                raise ValueError(f"--cpu and --device {self.device} disagree; give one of them")
            self.device = "cpu"
        if self.precision == "fp16" and self.quantize != "none":
            raise ValueError("--fp16 and --quantize int8 are alternatives (int8 runs on the CPU); choose one")


def make_batches(lengths: Sequence[int], max_tokens: int | None, batch_size: int | None,
                 workers: int = 1) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first.

    A batch of ``n`` sentences whose longest has ``L`` tokens costs ``n * L`` padded tokens; it is kept within
    ``max_tokens`` (a longer single sentence still gets a batch of its own) and ``batch_size``.

    ``workers``: the batches are translated by this many processes side by side, each taking the next. Cut at
    ``max_tokens``, the last batch is a remainder, often small, that one worker translates while the others wait
    (also when the number of batches is a multiple of ``workers``: 6,120 + 6,132 padded tokens for one worker,
    6,137 + 531 for the other); so the number of batches is rounded up to a multiple of ``workers`` and the token
    budget lowered to the smallest that still gives no more batches than that: batches of about equal size, taken
    when the workers would then finish sooner (padded tokens standing for the time a batch takes).
    """
    order = np.asarray(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), dtype=np.int64)
    if max_tokens is None and batch_size is None:
        return [order.tolist()] if len(order) else []
    sizes = np.asarray(lengths, dtype=np.int64)

    def cut(budget: int | None) -> list[np.ndarray]:
        return batch_by_size(order, sizes, budget, batch_size, oversized_alone=True)

    batches = cut(max_tokens)
    if workers > 1 and max_tokens is not None and len(batches) > 1:  # a multiple of workers may still end small
        target = -(-len(batches) // workers) * workers
        lo, hi = 1, max_tokens  # fewer tokens never give fewer batches: the smallest budget giving <= target
        while lo < hi:
            mid = (lo + hi) // 2
            if len(cut(mid)) <= target:
                hi = mid
            else:
                lo = mid + 1
        even = cut(lo)
        if _finish(even, sizes, workers) < _finish(batches, sizes, workers):
            batches = even
    return [b.tolist() for b in batches]


def _finish(batches: list[np.ndarray], lengths: np.ndarray, workers: int) -> int:
    """When the last of ``workers`` workers, each taking the next batch when free, finishes (in padded tokens)."""
    free = [0] * workers
    for b in batches:
        heapq.heapreplace(free, free[0] + len(b) * int(lengths[b].max()))
    return max(free)


def collate(sources: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, S) tokens and (B,) lengths."""
    tokens, lengths = pad_sequences(sources, pad)
    return torch.from_numpy(tokens).to(device), torch.from_numpy(lengths).to(device)


@dataclass
class GenerationStats:
    sentences: int = 0
    source_tokens: int = 0
    target_tokens: int = 0  # of the best hypotheses, final EOS included
    seconds: float = 0.0

    def summary(self, wall: float | None = None) -> str:
        """One line; rates are per second of search (batching, encoder, decoder); ``wall`` adds the total time."""
        s = self.seconds
        rates = f": {self.sentences / s:.2f} sentences/s, {self.target_tokens / s:.1f} target tokens/s" if s > 0 else ""
        total = f", {wall:.1f}s wall time in all (loading and text processing included)" if wall is not None else ""
        return (f"translated {self.sentences} sentences ({self.target_tokens} target tokens) in {s:.1f}s of search"
                f"{rates}{total}")


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection during a search.

    A decoder step creates a few hundred short-lived objects; the collector, triggered by those allocations,
    would walk the whole heap (the model's modules included) again and again. The search creates no reference
    cycles, so nothing is left for the collector when it resumes.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Generator:
    """Runs a model's search over id sequences; see the module docstring."""

    def __init__(self, model, symbols: Symbols, search_cfg: SearchConfig, backend: Backend | None = None,
                 max_source_positions: int | None = None, truncate_source: bool = False,
                 target_text: Callable[[list[int]], str] | None = None):
        """``backend``: the run's (its device and resolved precision; None: the CPU in fp32); a float32 model under
        a "bf16" backend runs under autocast. ``target_text``: a hypothesis' detokenized text, which
        ``--mbr-samples`` compares (required for it)."""
        if search_cfg.mbr_samples and target_text is None:
            raise ValueError("--mbr-samples compares texts: the generator needs target_text")
        self.model = model
        self.symbols = symbols
        self.search_cfg = search_cfg
        self.backend = backend if backend is not None else backend_for("cpu")
        self.device = self.backend.device
        self.max_source_positions = max_source_positions
        self.truncate_source = truncate_source
        self.target_text = target_text
        self.stats = GenerationStats()
        self.pool = None  # a WorkerPool once start_workers() ran
        self.shortlist = None  # (Shortlist, projection maker, vocabulary size) once use_shortlist() ran

    def use_shortlist(self, shortlist, make_projection: Callable, vocab: int) -> None:
        """Search every batch over its shortlisted target tokens (``attnmt.generation.shortlist``);
        ``make_projection(ids)``: the output projection of those rows, as the backend runs it."""
        self.shortlist = (shortlist, make_projection, vocab)

    def search_model(self, sources: Sequence[Sequence[int]], guide: Guidance | None):
        """The model a batch is searched with: the model, or with a shortlist the model over the batch's
        candidates (its sources', the special symbols, its prefixes' and constraints' tokens)."""
        if self.shortlist is None:
            return self.model

        shortlist, make, vocab = self.shortlist
        sym = self.symbols
        extra = {sym.eos, sym.unk, sym.pad, *(t for t in (sym.bos, sym.forced) if t is not None)}
        if guide is not None:
            for p in guide.prefixes or ():
                extra.update(p or ())
            for phrases in guide.constraints or ():
                for phrase in phrases or ():
                    extra.update(phrase)
        ids = torch.tensor(shortlist.candidates(sources, extra), dtype=torch.long, device=self.device)
        return ShortlistedModel(self.model, ids, make(ids), vocab)

    def start_workers(self, workers: int, threads: int, load=None) -> None:
        """Translate batches in ``workers`` processes of ``threads`` CPU threads each (``attnmt.generation.workers``;
        ``load``: how a worker of several threads loads its own copy, needed for those)."""
        if not self.backend.worker_processes:
            raise UserError(f"--workers runs several decoding processes on the CPU; on {self.device} use one "
                            f"(drop --workers)")
        self.close()
        self.pool = WorkerPool(self.search_batch, workers, threads, load)

    def close(self) -> None:
        """Stop the decoding workers, if any."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def autocast(self):
        """bf16 autocast for a float32 model (e.g. validation during training); a model already cast to bfloat16
        for inference (``load_generator``) runs as it is."""
        if next(self.model.parameters()).dtype == self.backend.autocast_dtype:
            return contextlib.nullcontext()
        return self.backend.autocast()

    def check_length(self, ids: list[int], index: int, where: str) -> list[int]:
        """``ids`` within the model's source limit: cut with ``truncate_source``, else a ``UserError`` naming
        ``where`` and the 0-based ``index``'s line."""
        limit = self.max_source_positions
        if limit is None or len(ids) <= limit:
            return ids
        if self.truncate_source:
            return list(ids[: limit - 1]) + [self.symbols.eos]
        raise UserError(f"{where}:{index + 1}: the source has {len(ids)} tokens but the model accepts at most "
                        f"{limit}; shorten or split the line, or pass --truncate-source")

    def check_guide(self, sources: list[list[int]], guide: Guidance, first_id: int, where: str) -> None:
        """A ``UserError`` naming the line whose prefix and constraints need more tokens than the search may
        generate for it, or whose lists do not match the sources."""
        for name in ("prefixes", "constraints"):
            given = getattr(guide, name)
            if given is not None and len(given) != len(sources):
                raise UserError(f"{where}: {len(sources)} sources but {len(given)} {name}; give one per source")
        if guide.constraints is not None and any(guide.constraints) and self.search_cfg.search not in ("beam", "constrained"):
            raise UserError(f"constraints are searched by beam search, not --search {self.search_cfg.search}; drop "
                            f"one of them")
        lengths = torch.tensor([len(s) for s in sources])
        limits = max_lengths(lengths, self.search_cfg, int(self.model.max_positions()[1])).tolist()
        start = 1 if self.symbols.forced is not None else 0
        for i, src in enumerate(sources):
            prefix = guide.prefixes[i] if guide.prefixes is not None else []
            phrases = guide.constraints[i] if guide.constraints is not None else []
            need = start + len(prefix) + sum(len(p) for p in phrases)
            if need > limits[i] and not nothing_to_translate(src, self.symbols.eos):
                what = " and ".join(w for w, x in (("prefix", prefix), ("constraints", phrases)) if x)
                raise UserError(f"{where}:{first_id + i + 1}: the {what} need {need - start} target tokens but at "
                                f"most {limits[i] - start} may be generated for this source; shorten them or raise "
                                f"--max-len-a/--max-len-b")

    def search_batch(self, sources: Sequence[Sequence[int]], ids: Sequence[int],
                     guide: Guidance | None = None) -> list[list[Hypothesis]]:
        """Hypotheses for one batch of sources (each a list of ids with its final EOS), in the given order;
        ``guide``: the batch's prefixes, constraints and suppressed sequences (per sentence, in that order)."""
        tokens, lengths = collate(sources, self.symbols.pad, self.device)
        sample_ids = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)
        cfg, kernels = self.search_cfg, self.backend.decoding_kernels()
        guide = guide if guide else None
        with torch.inference_mode(), self.autocast(), _gc_paused():
            model = self.search_model(sources, guide)
            if not cfg.mbr_samples:
                return search(model, tokens, lengths, cfg, self.symbols, sample_ids, kernels=kernels,
                              guide=guide)

            beams = search(model, tokens, lengths, replace(cfg, nbest=cfg.beam, mbr_samples=0), self.symbols,
                           sample_ids, kernels=kernels, guide=guide)
            samples = search(model, tokens, lengths, mbr.sampling_config(cfg), self.symbols, sample_ids,
                             kernels=kernels, guide=guide)
        return [mbr.rerank(h, s, self.target_text, cfg.nbest) for h, s in zip(beams, samples)]

    def alternatives(self, source: list[int], prefix: list[int], n: int, min_prob: float = 0.0,
                     suppress: tuple[tuple[int, ...], ...] = ()) -> list[Hypothesis]:
        """CTranslate2's ``return_alternatives``: the ``n`` most probable tokens after the target ``prefix`` (each at
        least ``min_prob`` likely; never EOS), each continued by the search (one hypothesis each), in the order of
        those tokens' probabilities."""
        sym = self.symbols
        lead = [sym.forced] if sym.forced is not None else []
        with torch.inference_mode(), self.autocast():
            src, lengths = collate([source], sym.pad, self.device)
            prev = torch.tensor([[sym.first, *lead, *prefix]], device=self.device)
            model = self.search_model([source], Guidance(prefixes=[prefix]))
            logits = model.decode(prev, model.encode(src, lengths))[0, -1:]
            limit = max_lengths(lengths, self.search_cfg, int(self.model.max_positions()[1]))
            cfg = replace(self.search_cfg, min_len=max(self.search_cfg.min_len, len(lead) + len(prefix) + 1))
            lprobs = step_log_probs(logits, len(lead) + len(prefix), limit, prev[:, 1:], cfg, sym,
                                    rules=Rules(Guidance(suppress=suppress), 1, 1, sym, self.device))[0]
        top = lprobs.topk(min(n, lprobs.numel()))
        picks = [int(t) for v, t in zip(top.values.tolist(), top.indices.tolist())
                 if v > float("-inf") and math.exp(v) >= min_prob]
        if not picks:
            return []
        one = replace(self.search_cfg, nbest=1)
        gen = Generator(self.model, sym, one, self.backend, self.max_source_positions, self.truncate_source,
                        self.target_text)
        gen.stats = self.stats
        gen.shortlist = self.shortlist
        guide = Guidance(prefixes=[[*prefix, t] for t in picks], suppress=suppress)
        return [h[0] for _, h in gen.generate([source] * len(picks), guide=guide) if h]

    def _search_batches(self, checked: list[list[int]], batches: list[list[int]], first_id: int,
                        guide: Guidance | None) -> Iterator[tuple[list[int], list[list[Hypothesis]]]]:
        """``(batch, hypotheses)`` per batch: here one after the other, or by the workers as they finish."""
        def part(b):
            return guide.subset(b) if guide else None

        if self.pool is None:
            for batch in batches:
                t0 = time.perf_counter()
                hyps = self.search_batch([checked[i] for i in batch], [first_id + i for i in batch], part(batch))
                self.stats.seconds += time.perf_counter() - t0
                yield batch, hyps
            return
        t0 = time.perf_counter()
        tasks = ((k, [checked[i] for i in b], [first_id + i for i in b], part(b)) for k, b in enumerate(batches))
        for k, hyps in self.pool.map_unordered(tasks):
            self.stats.seconds += time.perf_counter() - t0  # wall time: the workers search side by side
            t0 = time.perf_counter()
            yield batches[k], hyps
        self.stats.seconds += time.perf_counter() - t0

    def generate(self, sources: Sequence[Sequence[int]], max_tokens: int | None = 0, batch_size: int | None = None,
                 first_id: int = 0, where: str = "input", progress=None,
                 guide: Guidance | None = None) -> Iterator[tuple[int, list[Hypothesis]]]:
        """Yield ``(index, hypotheses)`` for every source, in input order, as soon as each can be released.

        ``first_id`` numbers the sources (it seeds sampling per sentence, so a continuing stream keeps counting);
        ``where`` names the input in error messages; ``progress(n)`` is called after each batch of ``n`` sentences;
        ``guide``: target prefixes and constraints per source (lists aligned with ``sources``) and suppressed
        sequences (:class:`~attnmt.generation.search.Guidance`).
        A source with nothing to translate (an empty or blank line) gets the empty translation without a search.
        """
        if max_tokens == 0:
            max_tokens = self.backend.decoding_max_tokens()
            cfg = self.search_cfg
            if cfg.mbr_samples > cfg.beam:  # the device's batch holds the samples' rows, not only the beam's
                max_tokens = max(1, max_tokens * cfg.beam // cfg.mbr_samples)
        checked = [self.check_length(list(map(int, s)), first_id + i, where) for i, s in enumerate(sources)]
        if guide:
            self.check_guide(checked, guide, first_id, where)
        eos = self.symbols.eos
        blank = [nothing_to_translate(s, eos) for s in checked]
        todo = [i for i, b in enumerate(blank) if not b]
        pending = {i: empty_translation(eos, self.search_cfg.nbest) for i, b in enumerate(blank) if b}
        self.stats.sentences += len(pending)
        if pending and progress is not None:
            progress(len(pending))
        workers = len(self.pool) if self.pool is not None else 1
        batches = [[todo[j] for j in b] for b in make_batches([len(checked[i]) for i in todo], max_tokens,
                                                                batch_size, workers)]
        next_out = 0
        searched = self._search_batches(checked, batches, first_id, guide)
        for batch, hyps in itertools.chain([([], [])], searched):  # a first round releases the leading blanks
            self.stats.sentences += len(batch)
            self.stats.source_tokens += sum(len(checked[i]) for i in batch)
            self.stats.target_tokens += sum(len(h[0].tokens) for h in hyps if h)
            for i, h in zip(batch, hyps):
                pending[i] = h
            if batch and progress is not None:
                progress(len(batch))
            while next_out in pending:
                yield next_out, pending.pop(next_out)
                next_out += 1


# ------------------------------------------------------------------------------------------------ output


LN2 = math.log(2.0)  # fairseq prints log-probabilities in base 2


def format_result(index: int, hyps: list[Hypothesis], bundle, fmt: str, source: str | None = None,
                  reference: str | None = None, alignments: list[str] | None = None) -> list[str]:
    """Output lines for one sentence.

    ``plain``: the detokenized hypotheses (one line each; one per sentence unless ``--nbest`` > 1).
    ``fairseq``: ``S-i`` source, ``T-i`` reference (when known), then per hypothesis ``H-i score pieces``,
    ``D-i score text`` and ``P-i`` the per-token log-probabilities (final EOS included), in base 2 as fairseq
    prints them, so that they compare with a fairseq run's lines; with ``alignments`` (one per hypothesis,
    ``attnmt.generation.alignment``) an ``A-i`` line after each hypothesis' ``P-i``.
    """
    lines = []
    if fmt == "fairseq":
        if source is not None:
            lines.append(f"S-{index}\t{source}")
        if reference is not None:
            lines.append(f"T-{index}\t{reference}")
    for k, h in enumerate(hyps):
        pieces = bundle.target_pieces(h.tokens)
        text = bundle.detokenize(pieces)
        if fmt == "fairseq":
            score = h.score / LN2
            lines.append(f"H-{index}\t{score:.6f}\t{bundle.hypothesis_pieces(pieces)}")
            lines.append(f"D-{index}\t{score:.6f}\t{text}")
            lines.append(f"P-{index}\t{' '.join(f'{p / LN2:.4f}' for p in h.positional_scores)}")
            if alignments is not None:
                lines.append(f"A-{index}\t{alignments[k]}")
        else:
            lines.append(text)
    if not hyps and fmt != "fairseq":
        lines.append("")  # keep line i = input i even if nothing could be generated
    return lines


def write_lines(out, lines: Iterable[str]) -> None:
    for ln in lines:
        out.write(ln + "\n")
