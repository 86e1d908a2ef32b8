"""The work the worker processes do on one part: normalise, encode to pieces, binarize (picklable jobs)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDatasetBuilder
from attnmt.data.subword import TextPipeline, build_tokenizer
from attnmt.data.textio import CHECKPOINT, ScanResult, read_lines, scan
from attnmt.preprocess.config import ENCODE_BATCH
from attnmt.preprocess.plan import Part
from attnmt.registry import get

# ---------------------------------------------------------------------------------------------------- workers
# Top-level functions with picklable arguments, so they run in a process pool. Each worker keeps the pipelines and
# dictionaries it loaded (keyed by what defines them), so a part costs no model loading.

WORKER_CACHE: dict[Any, Any] = {}


@dataclass(frozen=True)
class PipelineSpec:
    tokenizer: str
    lang: str
    lowercase: bool
    bpe: str
    bpe_model: str | None  # path of the learned/reused model file, None before learning or for bpe none
    threads: int = 1

    def build(self) -> TextPipeline:
        key = ("pipeline", self)
        if key not in WORKER_CACHE:
            bpe_cls = get("bpe", self.bpe).obj
            bpe = bpe_cls.load(self.bpe_model) if self.bpe_model else bpe_cls.load()
            WORKER_CACHE[key] = TextPipeline(build_tokenizer(self.tokenizer, self.lang), bpe, lowercase=self.lowercase)
        return WORKER_CACHE[key]


@dataclass
class NormalizeJob:
    part: Part
    inputs: dict[str, str]  # lang -> input file
    outputs: dict[str, str]  # lang -> normalized text file for this part
    specs: dict[str, PipelineSpec]


def _read_part(path: str, part: Part, lang: str) -> list[str]:
    lines = list(read_lines(path, part.offsets[lang], part.count))
    if part.start == 0 and lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]  # a byte-order mark is not text
    return lines


def normalize_part(job: NormalizeJob) -> int:
    """Write the normalized (stripped, tokenized, lowercased) text of a part: what the subword model learns on."""
    for lang, path in job.inputs.items():
        pipe = job.specs[lang].build()
        with open(job.outputs[lang], "w", encoding="utf-8") as f:
            for line in _read_part(path, job.part, lang):
                f.write(pipe.normalize(line) + "\n")
    return job.part.count


@dataclass
class EncodeJob:
    part: Part
    inputs: dict[str, str]  # lang -> input file (raw) or normalized part file
    normalized: bool  # inputs are normalize_part outputs (read from their start)
    outputs: dict[str, str]  # lang -> pieces file for this part
    specs: dict[str, PipelineSpec]
    train: bool
    max_len: int
    dropout: float = 0.0  # > 0: BPE-dropout, a sampled segmentation (outputs are one of the train_sample splits)
    seed: int = 0  # of the sampled segmentation (1, 2, ...)
    dicts: dict[str, str] | None = None  # lang -> dictionary: a sampled word with a piece it lacks stays whole


@dataclass
class EncodeResult:
    split: str
    index: int
    lines: int
    kept: int
    skipped: dict[str, int]
    skipped_examples: dict[str, list[int]]  # reason -> first few (1-based) input line numbers
    counts: dict[str, Counter]  # lang -> piece counts of the kept pairs (train only)
    empty_kept: int  # valid/test: lines with an empty side, kept as </s> alone


def encode_part(job: EncodeJob) -> EncodeResult:
    """Segment a part into pieces; in train, drop empty and overlong pairs; count pieces of the kept pairs."""
    part = job.part
    langs = list(job.inputs)
    pieces: dict[str, list[str]] = {}
    judged: dict[str, list[str]] = {}  # what decides whether a training pair is kept: its deterministic pieces
    for lang in langs:
        pipe = job.specs[lang].build()
        if job.normalized:
            text = list(read_lines(job.inputs[lang]))
            if len(text) != part.count:
                raise RuntimeError(f"{job.inputs[lang]}: {len(text)} lines, expected {part.count}")
        else:
            text = [pipe.normalize(s) for s in _read_part(job.inputs[lang], part, lang)]
        out: list[str] = []
        for i in range(0, len(text), ENCODE_BATCH):
            out.extend(pipe.bpe.encode_batch(text[i: i + ENCODE_BATCH], num_threads=job.specs[lang].threads))
        judged[lang] = pieces[lang] = out
        if job.dropout > 0:  # the sampled pieces of the same pairs, kept or skipped as their deterministic ones are
            sampled: list[str] = []
            for i in range(0, len(text), CHECKPOINT):  # a seed per block of CHECKPOINT input lines (parts start at
                block = (part.start + i) // CHECKPOINT  # one): the same pieces whatever the number of workers
                seed = ((job.seed * 2 + langs.index(lang)) * 1_000_003 + block) % 2**31
                sampled.extend(pipe.bpe.sample_batch(text[i: i + CHECKPOINT], job.dropout, seed))
            pieces[lang] = _known_pieces(sampled, out, _dictionary(job.dicts[lang])) if job.dicts else sampled
    skipped = {"empty": 0, "too_long": 0}
    examples: dict[str, list[int]] = {"empty": [], "too_long": []}
    counts = {lang: Counter() for lang in langs}
    files = {lang: open(job.outputs[lang], "w", encoding="utf-8") for lang in langs}
    kept = empty_kept = 0
    try:
        for i in range(part.count):
            row = {lang: pieces[lang][i] for lang in langs}
            if job.train:
                reason = None
                if any(not judged[lang][i] for lang in langs):
                    reason = "empty"
                elif any(judged[lang][i].count(" ") + 2 > job.max_len for lang in langs):  # pieces + </s>
                    reason = "too_long"
                if reason:
                    skipped[reason] += 1
                    if len(examples[reason]) < 10:
                        examples[reason].append(part.start + i + 1)
                    continue
                if not job.dropout:
                    for lang in langs:
                        counts[lang].update(row[lang].split())
            elif any(not row[lang] for lang in langs):
                empty_kept += 1
            for lang in langs:
                files[lang].write(row[lang] + "\n")
            kept += 1
    finally:
        for f in files.values():
            f.close()
    return EncodeResult(part.split, part.index, part.count, kept, skipped, examples, counts, empty_kept)


def _dictionary(path: str) -> Dictionary:
    key = ("dict", path)
    if key not in WORKER_CACHE:
        WORKER_CACHE[key] = Dictionary.load(path)
    return WORKER_CACHE[key]


def _known_pieces(sampled: list[str], deterministic: list[str], d: Dictionary) -> list[str]:
    """The sampled pieces, but a word with a piece the dictionary lacks (BPE-dropout stops at intermediate merges,
    or single characters, that the deterministic segmentation never keeps) in its deterministic pieces, so that
    nothing becomes <unk> that is not <unk> in the training split."""
    unk = d.unk()
    out = []
    for line, det in zip(sampled, deterministic):
        toks = line.split()
        if all(d.index(t) != unk for t in toks):
            out.append(line)
            continue
        words, det_words = _words(toks), _words(det.split())
        if len(words) != len(det_words):  # not the same words (never with SentencePiece's word-bound pieces)
            out.append(det)
            continue
        out.append(" ".join(" ".join(w if all(d.index(t) != unk for t in w) else dw)
                            for w, dw in zip(words, det_words)))
    return out


def _words(pieces: list[str]) -> list[list[str]]:
    """Pieces grouped into words (a word starts with a piece that starts with the SentencePiece space, \u2581)."""
    words: list[list[str]] = []
    for t in pieces:
        if t.startswith("\u2581") or not words:
            words.append([t])
        else:
            words[-1].append(t)
    return words


@dataclass
class BinarizeJob:
    split: str
    lang: str
    pieces: str  # pieces file of one part and language
    dict_path: str
    prefix: str  # output part dataset
    language_token: str | None = None  # put before every sentence (a multilingual model's language token)


def binarize_part(job: BinarizeJob) -> tuple[int, int, int, int]:
    """Map a pieces file to ids and write a part dataset; return (sentences, tokens incl. </s>, unk, longest)."""
    d = _dictionary(job.dict_path)
    unk = d.unk()
    n = tokens = unks = longest = 0
    with IndexedDatasetBuilder(job.prefix, len(d)) as b:
        first = [] if job.language_token is None else [d.index(job.language_token)]
        for line in read_lines(job.pieces):
            ids = d.encode_line(line)
            if first and len(ids) > 1:
                ids = first + ids
            b.add(ids)
            n += 1
            tokens += len(ids)
            unks += ids.count(unk)
            longest = max(longest, len(ids))
    return n, tokens, unks, longest


def scan_file(path: str) -> ScanResult:
    return scan(path)
