"""``attnmt preprocess``: raw parallel text -> subword model, dictionaries and memory-mapped binarized splits.

Stages (each parallel over ``--workers`` processes, on line ranges of the inputs):

1. scan every input once: UTF-8 check, line count, sha256 of the decompressed text (the input's identity);
   source and target of a split must have the same number of lines;
2. (``--bpe sentencepiece``) normalise the training text and learn one joint BPE model on it, once;
3. encode every split to pieces; in TRAIN, drop pairs with an empty side or more than ``--max-len`` tokens
   (counted, never silent); valid/test keep every line, so line *i* of a binarized test set is input line *i*;
4. build the dictionaries from the pieces of the kept training pairs;
5. binarize each line range to a part dataset, then concatenate the parts in order.

Every stage works on line ranges whose results are combined in input order and dictionaries sort by count then
symbol, so the output files are byte-identical for any number of workers.

All output is built in a temp directory beside ``--destdir`` and renamed into place at the end: ``--destdir``
never holds a half-written preprocessing. A destdir whose ``preprocess.json`` records the same inputs (by
checksum) and options is up to date and left alone; one holding anything else is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDatasetBuilder
from attnmt.data.subword import TextPipeline, build_tokenizer
from attnmt.data.textio import CHECKPOINT, ScanResult, read_lines, resolve_input, scan
from attnmt.errors import UserError
from attnmt.fileio import atomic_open
from attnmt.progress import StageProgress
from attnmt.registry import get

FORMAT_VERSION = 1
ENCODE_BATCH = 10_000
MAX_PART_LINES = 100 * 1024  # bounds a worker's memory: a part's text and pieces are held in RAM
# options that do not change the output (so they do not make a destdir "different")
_NEUTRAL_OPTIONS = ("destdir", "workers", "trainpref", "validpref", "testpref", "srcdict", "tgtdict", "spm_model")


@dataclass
class PreprocessConfig:
    source_lang: str | None = field(default=None, metadata={"help": "source language suffix of the input files",
                                                             "aliases": ("-s",)})
    target_lang: str | None = field(default=None, metadata={"help": "target language suffix of the input files",
                                                             "aliases": ("-t",)})
    trainpref: str | None = field(default=None, metadata={
        "help": "training files prefix: reads PREFIX.SRC and PREFIX.TGT (or PREFIX.LANG.gz)"})
    validpref: str | None = field(default=None, metadata={
        "help": "validation files prefix(es), comma-separated: splits valid, valid1, ..."})
    testpref: str | None = field(default=None, metadata={
        "help": "test files prefix(es), comma-separated: splits test, test1, ..."})
    destdir: str = field(default="data-bin", metadata={"help": "output directory"})
    workers: int = field(default=1, metadata={"help": "number of parallel processes"})
    bpe: str = field(default="none", metadata={
        "help": "subword model: sentencepiece (learn a joint BPE model) or none (text is already segmented)"})
    vocab_size: int = field(default=8000, metadata={"help": "number of subword pieces to learn (--bpe sentencepiece)"})
    bpe_max_sentences: int = field(default=1_000_000, metadata={
        "help": "learn the subword model on at most this many sentences (a fixed-seed sample; 0 = all)"})
    spm_model: str | None = field(default=None, metadata={
        "help": "reuse this SentencePiece model instead of learning one (e.g. to binarize new test data)"})
    tokenizer: str = field(default="none", metadata={"help": "word tokenizer applied before subwords: moses or none"})
    lowercase: bool = field(default=False, metadata={"help": "lowercase the text (after tokenization)"})
    joined_dictionary: bool = field(default=False, metadata={
        "help": "one dictionary for both languages (needed to share embeddings)"})
    srcdict: str | None = field(default=None, metadata={"help": "reuse this source dictionary"})
    tgtdict: str | None = field(default=None, metadata={"help": "reuse this target dictionary"})
    thresholdsrc: int = field(default=0, metadata={"help": "drop source symbols seen fewer times than this"})
    thresholdtgt: int = field(default=0, metadata={"help": "drop target symbols seen fewer times than this"})
    nwordssrc: int = field(default=-1, metadata={
        "help": "source dictionary size, special symbols included (-1 = all)"})
    nwordstgt: int = field(default=-1, metadata={
        "help": "target dictionary size, special symbols included (-1 = all)"})
    padding_factor: int = field(default=8, metadata={"help": "pad dictionary sizes to a multiple of this"})
    max_len: int = field(default=1024, metadata={
        "help": "skip training pairs with a side longer than this many tokens (end-of-sentence included)"})

    def __post_init__(self) -> None:
        if not self.source_lang or not self.target_lang:
            raise UserError("give the languages with -s/--source-lang and -t/--target-lang (e.g. -s en -t de)")
        if self.source_lang == self.target_lang:
            raise UserError(f"source and target language are both '{self.source_lang}'; give two different "
                            f"suffixes with -s and -t")
        if not (self.trainpref or self.validpref or self.testpref):
            raise UserError("nothing to preprocess; give --trainpref and/or --validpref/--testpref")
        for name in ("workers", "vocab_size", "max_len", "padding_factor"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.bpe_max_sentences < 0:
            raise UserError(f"--bpe-max-sentences must be >= 0 (0 = all), got {self.bpe_max_sentences}")
        if self.spm_model and self.bpe != "sentencepiece":
            raise UserError("--spm-model needs --bpe sentencepiece")
        if not self.trainpref:
            if not (self.srcdict and (self.tgtdict or self.joined_dictionary)):
                raise UserError("without --trainpref there is nothing to build dictionaries from; pass --srcdict "
                                "and --tgtdict (or --srcdict with --joined-dictionary) of an earlier preprocessing")
            if self.bpe == "sentencepiece" and not self.spm_model:
                raise UserError("without --trainpref there is nothing to learn SentencePiece from; pass the "
                                "--spm-model of an earlier preprocessing")


# ---------------------------------------------------------------------------------------------------- planning


@dataclass
class Split:
    name: str  # train, valid, valid1, ..., test, test1, ...
    prefix: str
    paths: dict[str, str]  # lang -> input file
    train: bool


def _splits(cfg: PreprocessConfig) -> list[Split]:
    out = []
    langs = (cfg.source_lang, cfg.target_lang)

    def add(kind: str, prefixes: str | None, option: str) -> None:
        if not prefixes:
            return
        for k, pref in enumerate(p.strip() for p in prefixes.split(",")):
            if not pref:
                raise UserError(f"{option} {prefixes!r}: empty prefix in the comma-separated list")
            name = kind if k == 0 else f"{kind}{k}"
            out.append(Split(name, pref, {lang: resolve_input(pref, lang, option) for lang in langs}, kind == "train"))

    if cfg.trainpref and "," in cfg.trainpref:
        raise UserError(f"--trainpref {cfg.trainpref!r}: one training prefix only (concatenate the files first)")
    add("train", cfg.trainpref, "--trainpref")
    add("valid", cfg.validpref, "--validpref")
    add("test", cfg.testpref, "--testpref")
    return out


@dataclass
class Part:
    """Lines ``[start, start + count)`` of one split, the unit of work of a worker."""

    split: str
    index: int
    start: int
    count: int
    offsets: dict[str, int]  # lang -> byte offset of line ``start`` in the decompressed input


def _parts(split: Split, scans: dict[str, ScanResult], workers: int) -> list[Part]:
    """Cut a split into line ranges that start at scan checkpoints (a few per worker for load balance)."""
    lines = scans[split.paths[next(iter(split.paths))]].lines
    if lines == 0:
        return [Part(split.name, 0, 0, 0, {lang: 0 for lang in split.paths})]
    target = max(1, workers * 4) if workers > 1 else 1
    step = min(max(CHECKPOINT, -(-lines // target)), MAX_PART_LINES)
    step = -(-step // CHECKPOINT) * CHECKPOINT
    parts = []
    for k, start in enumerate(range(0, lines, step)):
        offs = {lang: scans[p].offset_of(start) for lang, p in split.paths.items()}
        parts.append(Part(split.name, k, start, min(step, lines - start), offs))
    return parts


# ---------------------------------------------------------------------------------------------------- workers
# Top-level functions with picklable arguments, so they run in a process pool. Each worker keeps the pipelines and
# dictionaries it loaded (keyed by what defines them), so a part costs no model loading.

_CACHE: dict[Any, Any] = {}


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
        if key not in _CACHE:
            bpe_cls = get("bpe", self.bpe).obj
            bpe = bpe_cls.load(self.bpe_model) if self.bpe_model else bpe_cls.load()
            _CACHE[key] = TextPipeline(build_tokenizer(self.tokenizer, self.lang), bpe, lowercase=self.lowercase)
        return _CACHE[key]


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
        pieces[lang] = out
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
                if any(not row[lang] for lang in langs):
                    reason = "empty"
                elif any(row[lang].count(" ") + 2 > job.max_len for lang in langs):  # pieces + </s>
                    reason = "too_long"
                if reason:
                    skipped[reason] += 1
                    if len(examples[reason]) < 10:
                        examples[reason].append(part.start + i + 1)
                    continue
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


@dataclass
class BinarizeJob:
    split: str
    lang: str
    pieces: str  # pieces file of one part and language
    dict_path: str
    prefix: str  # output part dataset


def binarize_part(job: BinarizeJob) -> tuple[int, int, int, int]:
    """Map a pieces file to ids and write a part dataset; return (sentences, tokens incl. </s>, unk, longest)."""
    key = ("dict", job.dict_path)
    if key not in _CACHE:
        _CACHE[key] = Dictionary.load(job.dict_path)
    d: Dictionary = _CACHE[key]
    unk = d.unk()
    n = tokens = unks = longest = 0
    with IndexedDatasetBuilder(job.prefix, len(d)) as b:
        for line in read_lines(job.pieces):
            ids = d.encode_line(line)
            b.add(ids)
            n += 1
            tokens += len(ids)
            unks += ids.count(unk)
            longest = max(longest, len(ids))
    return n, tokens, unks, longest


def scan_file(path: str) -> ScanResult:
    return scan(path)


# ---------------------------------------------------------------------------------------------------- running


class Runner:
    """Runs a list of jobs in order-preserving fashion, in a process pool or (one worker) in this process."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None
        if workers > 1:
            # fork: workers inherit the loaded modules and registered plugins, and nothing re-imports __main__
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self.pool = mp.get_context(method).Pool(workers, initializer=_worker_init)

    def map(self, fn: Callable, jobs: list, progress: Callable[[Any], None] | None = None) -> list:
        if self.pool is None:
            results = []
            for job in jobs:
                results.append(fn(job))
                if progress:
                    progress(job)
            return results
        results = [None] * len(jobs)
        for i, r in self.pool.imap_unordered(_indexed_call, [(fn, i, j) for i, j in enumerate(jobs)]):
            results[i] = r
            if progress:
                progress(jobs[i])
        return results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


def _worker_init() -> None:
    # Ctrl-C and kill reach the main process, which ends the pool; workers just die when told to
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _terminate_unwinds():
    """SIGTERM (a scheduler's kill, ``timeout``) unwinds like Ctrl-C, so the temp directory is removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _indexed_call(arg):
    fn, i, job = arg
    return i, fn(job)


# ---------------------------------------------------------------------------------------------------- main


def _sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fingerprint(cfg: PreprocessConfig, splits: list[Split], scans: dict[str, ScanResult]) -> dict[str, Any]:
    """What decides the output: the options that change it and the checksums of everything read."""
    opts = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NEUTRAL_OPTIONS}
    inputs = {s.name: {lang: scans[p].sha256 for lang, p in s.paths.items()} for s in splits}
    reused = {}
    for name in ("srcdict", "tgtdict", "spm_model"):
        path = getattr(cfg, name)
        if path:
            if not os.path.isfile(path):
                raise UserError(f"{path}: file given with --{name.replace('_', '-')} not found; check the path")
            reused[name] = _sha256_file(path)
    return {"format_version": FORMAT_VERSION, "options": opts, "inputs": inputs, "reused": reused}


def _describe_difference(old: dict, new: dict) -> str:
    diffs = []
    if old.get("format_version") != new["format_version"]:
        diffs.append(f"format version {old.get('format_version')} vs {new['format_version']}")
    oo, no = old.get("options") or {}, new["options"]
    for k in sorted(set(oo) | set(no)):
        if oo.get(k) != no.get(k):
            diffs.append(f"--{k.replace('_', '-')} {oo.get(k)!r} vs {no.get(k)!r}")
    oi, ni = old.get("inputs") or {}, new["inputs"]
    if set(oi) != set(ni):
        diffs.append(f"splits {sorted(oi)} vs {sorted(ni)}")
    else:
        for s in ni:
            for lang in ni[s]:
                if (oi.get(s) or {}).get(lang) != ni[s][lang]:
                    diffs.append(f"{s}.{lang} input content (sha256)")
    if (old.get("reused") or {}) != new["reused"]:
        diffs.append("reused dictionary/SentencePiece model")
    return "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "") if diffs else "unknown difference"


def _check_destdir(destdir: Path, fingerprint: dict) -> dict | None:
    """The existing summary if destdir is up to date; None if destdir is free; UserError if it holds other data."""
    if not destdir.exists():
        return None
    if not destdir.is_dir():
        raise UserError(f"{destdir}: exists and is not a directory; choose another --destdir")
    meta_path = destdir / "preprocess.json"
    if not meta_path.exists():
        if any(destdir.iterdir()):
            raise UserError(f"{destdir}: not empty and holds no preprocess.json (not an attnmt preprocessing); "
                            f"choose another --destdir or delete {destdir}")
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{meta_path}: unreadable ({e}); choose another --destdir or delete {destdir}") from None
    old = meta.get("fingerprint") or {}
    if old == fingerprint:
        return meta
    raise UserError(f"{destdir} holds a different preprocessing ({_describe_difference(old, fingerprint)}); "
                    f"choose another --destdir or delete {destdir} to redo it")


def _check_parallel(split: Split, scans: dict[str, ScanResult], src: str, tgt: str) -> None:
    a, b = scans[split.paths[src]], scans[split.paths[tgt]]
    if a.lines != b.lines:
        short, long_ = (a, b) if a.lines < b.lines else (b, a)
        raise UserError(
            f"{short.path}:{short.lines + 1}: line missing: {short.path} ends after line {short.lines} but "
            f"{long_.path} has {long_.lines} lines; source and target of split '{split.name}' must have the same "
            f"number of lines (one sentence pair per line), fix the files")


def _publish(tmp: Path, destdir: Path) -> None:
    # temp files are created private (0600/0700); the published data gets the usual umask permissions
    umask = os.umask(0)
    os.umask(umask)
    for p in [tmp, *tmp.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
    if destdir.exists():
        destdir.rmdir()  # empty (checked before); a non-empty one would make rmdir fail, never lose data
    os.replace(tmp, destdir)


def preprocess(cfg: PreprocessConfig, quiet: bool = False) -> dict[str, Any]:
    """Run the whole preprocessing; return the summary written to ``DESTDIR/preprocess.json``.

    The summary also has ``up_to_date`` (True when DESTDIR already held this exact preprocessing and nothing was
    done), ``destdir`` and ``elapsed_s``.
    """
    t0 = time.time()
    get("bpe", cfg.bpe)
    get("tokenizer", cfg.tokenizer)
    splits = _splits(cfg)
    with _terminate_unwinds():
        return _preprocess(cfg, splits, quiet, t0)


def _preprocess(cfg: PreprocessConfig, splits: list[Split], quiet: bool, t0: float) -> dict[str, Any]:
    src, tgt = cfg.source_lang, cfg.target_lang
    destdir = Path(cfg.destdir)
    _CACHE.clear()  # models/dictionaries of an earlier run in this process are not this run's
    runner = Runner(cfg.workers)  # fork the workers before any thread exists (progress display, trainer)
    progress = StageProgress(quiet)
    try:
        paths = list(dict.fromkeys(p for s in splits for p in s.paths.values()))
        stage = progress.stage("reading and checking inputs", len(paths))
        scans = dict(zip(paths, runner.map(scan_file, paths, stage)))
        for s in splits:
            _check_parallel(s, scans, src, tgt)
        fingerprint = _fingerprint(cfg, splits, scans)
        existing = _check_destdir(destdir, fingerprint)
        stage.done(f" ({len(paths)} files, {sum(scans[p].lines for p in paths):,} lines)")
        if existing is not None:
            progress.close()
            return {**existing, "up_to_date": True, "destdir": str(destdir), "elapsed_s": time.time() - t0}
        destdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{destdir.name}.tmp-", dir=destdir.parent))
        try:
            summary = _build(cfg, splits, scans, fingerprint, tmp, runner, progress)
            summary["elapsed_s"] = round(time.time() - t0, 3)
            with atomic_open(tmp / "preprocess.json", "w") as f:
                json.dump(summary, f, indent=2, ensure_ascii=False)
                f.write("\n")
            _publish(tmp, destdir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        progress.close()
        runner.close()
        _CACHE.clear()
    return {**summary, "up_to_date": False, "destdir": str(destdir), "elapsed_s": time.time() - t0}


def _bpe_model_name(bpe: str) -> str:
    return "spm.model" if bpe == "sentencepiece" else f"{bpe}.model"


def _build(cfg: PreprocessConfig, splits: list[Split], scans: dict[str, ScanResult], fingerprint: dict,
           tmp: Path, runner: Runner, progress: StageProgress) -> dict[str, Any]:
    src, tgt = cfg.source_lang, cfg.target_lang
    langs = (src, tgt)
    work = tmp / ".work"
    work.mkdir()
    parts = {s.name: _parts(s, scans, cfg.workers) for s in splits}
    threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    bpe_cls = get("bpe", cfg.bpe).obj

    def specs(bpe_name: str, model: str | None) -> dict[str, PipelineSpec]:
        return {lang: PipelineSpec(cfg.tokenizer, lang, cfg.lowercase, bpe_name, model, threads) for lang in langs}

    # ---- subword model
    train = next((s for s in splits if s.train), None)
    normalized: dict[tuple[str, int], dict[str, str]] = {}
    model_file: str | None = None
    bpe_info: dict[str, Any] = {}
    if cfg.spm_model:
        bpe = bpe_cls.load(cfg.spm_model)
    elif cfg.bpe != "none" and train is not None:
        jobs = []
        for p in parts[train.name]:
            outs = {lang: str(work / f"norm.{lang}.{p.index:05d}") for lang in langs}
            normalized[(train.name, p.index)] = outs
            jobs.append(NormalizeJob(p, train.paths, outs, specs("none", None)))
        stage = progress.stage("normalizing training text", len(jobs))
        runner.map(normalize_part, jobs, stage)
        stage.done()
        files = [normalized[(train.name, p.index)][lang] for lang in langs for p in parts[train.name]]
        stage = progress.stage(f"learning {cfg.vocab_size} {cfg.bpe} subwords", 1)
        bpe = bpe_cls.train(files, cfg.vocab_size, str(work / "bpe"), cfg.bpe_max_sentences)
        stage()
        stage.done()
        bpe_info["sentences_used"] = getattr(bpe, "training_sentences", None)
    else:
        bpe = bpe_cls.load()
    if bpe.model_bytes():
        name = _bpe_model_name(cfg.bpe)
        with atomic_open(tmp / name, "wb") as f:
            f.write(bpe.model_bytes())
        model_file = str(tmp / name)
        bpe_info.update(model=name, model_sha256=hashlib.sha256(bpe.model_bytes()).hexdigest())
        if hasattr(bpe, "piece_size"):
            bpe_info["pieces"] = bpe.piece_size()

    # ---- pieces
    enc_jobs = []
    for s in splits:
        for p in parts[s.name]:
            norm = normalized.get((s.name, p.index))
            outs = {lang: str(work / f"{s.name}.{lang}.pieces.{p.index:05d}") for lang in langs}
            enc_jobs.append(EncodeJob(p, norm or s.paths, norm is not None, outs, specs(cfg.bpe, model_file), s.train,
                                      cfg.max_len))
    stage = progress.stage("segmenting", len(enc_jobs))
    enc = runner.map(encode_part, enc_jobs, stage)
    stage.done()

    # ---- dictionaries
    dicts = _dictionaries(cfg, [r for r in enc if r.split == (train.name if train else None)])
    dict_paths = {}
    for lang in langs:
        dict_paths[lang] = str(tmp / f"dict.{lang}.txt")
        dicts[lang].save(dict_paths[lang])

    # ---- binarize parts, then concatenate them in order
    bin_jobs = []
    for job in enc_jobs:
        for lang in langs:
            bin_jobs.append(BinarizeJob(job.part.split, lang, job.outputs[lang], dict_paths[lang],
                                        job.outputs[lang] + ".ds"))
    stage = progress.stage("binarizing", len(bin_jobs))
    counts = runner.map(binarize_part, bin_jobs, stage)
    stage.done()
    totals = {(s.name, lang): [0, 0, 0, 0] for s in splits for lang in langs}
    for job, (n, toks, unks, longest) in zip(bin_jobs, counts):
        t = totals[(job.split, job.lang)]
        totals[(job.split, job.lang)] = [t[0] + n, t[1] + toks, t[2] + unks, max(t[3], longest)]
    for s in splits:
        for lang in langs:
            with IndexedDatasetBuilder(tmp / f"{s.name}.{src}-{tgt}.{lang}", len(dicts[lang])) as b:
                for p in parts[s.name]:
                    b.merge(work / f"{s.name}.{lang}.pieces.{p.index:05d}.ds")
    shutil.rmtree(work)

    return _summary(cfg, splits, scans, fingerprint, enc, totals, dicts, dict_paths, bpe_info)


def _dictionaries(cfg: PreprocessConfig, train_results: Iterable[EncodeResult]) -> dict[str, Dictionary]:
    src, tgt = cfg.source_lang, cfg.target_lang
    train_results = list(train_results)

    def counted(langs: Iterable[str], threshold: int, nwords: int) -> Dictionary:
        total: Counter = Counter()
        for r in train_results:
            for lang in langs:
                total.update(r.counts[lang])
        d = Dictionary()
        d.update(total)
        d.finalize(threshold=threshold, nwords=nwords, padding_factor=cfg.padding_factor)
        return d

    if cfg.joined_dictionary:
        if cfg.srcdict and cfg.tgtdict:
            a, b = Dictionary.load(cfg.srcdict), Dictionary.load(cfg.tgtdict)
            if a != b:
                raise UserError(f"--joined-dictionary with --srcdict {cfg.srcdict} and --tgtdict {cfg.tgtdict}, "
                                f"which differ; pass only one of them")
            d = a
        elif cfg.srcdict or cfg.tgtdict:
            d = Dictionary.load(cfg.srcdict or cfg.tgtdict)
        else:
            d = counted((src, tgt), cfg.thresholdsrc, cfg.nwordssrc)
        return {src: d, tgt: d}
    s = Dictionary.load(cfg.srcdict) if cfg.srcdict else counted((src,), cfg.thresholdsrc, cfg.nwordssrc)
    t = Dictionary.load(cfg.tgtdict) if cfg.tgtdict else counted((tgt,), cfg.thresholdtgt, cfg.nwordstgt)
    return {src: s, tgt: t}


def _summary(cfg, splits, scans, fingerprint, enc, totals, dicts, dict_paths, bpe_info) -> dict[str, Any]:
    src, tgt = cfg.source_lang, cfg.target_lang
    split_info = {}
    for s in splits:
        rs = [r for r in enc if r.split == s.name]
        skipped = {k: sum(r.skipped[k] for r in rs) for k in ("empty", "too_long")}
        examples = {k: [n for r in rs for n in r.skipped_examples[k]][:10] for k in ("empty", "too_long")}
        sides = {}
        for lang in (src, tgt):
            n, toks, unks, longest = totals[(s.name, lang)]
            words = toks - n  # </s> is never unknown
            sides[lang] = {"tokens": toks, "unk": unks, "unk_rate": round(unks / words, 6) if words else 0.0,
                           "max_tokens": longest}
        split_info[s.name] = {
            "prefix": s.prefix,
            "inputs": {lang: {"path": p, "sha256": scans[p].sha256, "lines": scans[p].lines}
                       for lang, p in s.paths.items()},
            "lines": scans[s.paths[src]].lines,
            "pairs": sum(r.kept for r in rs),
            "skipped": {**skipped, "max_len": cfg.max_len} if s.train else {"empty": 0, "too_long": 0},
            "skipped_lines_examples": examples if s.train else {},
            "empty_lines_kept": sum(r.empty_kept for r in rs),
            "sides": sides,
        }
    return {
        "format_version": FORMAT_VERSION,
        "source_lang": src,
        "target_lang": tgt,
        "langs": {"src": src, "tgt": tgt},
        "joined_dictionary": cfg.joined_dictionary,
        "bpe": cfg.bpe,
        "bpe_model": bpe_info.get("model"),
        "bpe_settings": {"vocab_size": cfg.vocab_size, "max_sentences": cfg.bpe_max_sentences,
                         "reused_model": cfg.spm_model, **bpe_info},
        "tokenizer": cfg.tokenizer,
        "lowercase": cfg.lowercase,
        "vocab_size": cfg.vocab_size,
        "tokens_counted": "tokens include one </s> per sentence; unk_rate is unk / (tokens - sentences)",
        "dictionaries": {lang: {"file": Path(dict_paths[lang]).name, "size": len(dicts[lang]),
                                "sha256": dicts[lang].checksum()} for lang in (src, tgt)},
        "splits": split_info,
        "options": dataclasses.asdict(cfg),
        "fingerprint": fingerprint,
    }


# ---------------------------------------------------------------------------------------------------- report


def print_summary(summary: dict[str, Any], file=None) -> None:
    """A readable table of what was done (to stderr)."""
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stderr
    console = Console(file=file, highlight=False, width=None if file.isatty() else 120)
    src, tgt = summary["source_lang"], summary["target_lang"]
    if summary.get("up_to_date"):
        console.print(f"{summary['destdir']} is up to date (same inputs and options); nothing to do")
        return
    max_len = summary["options"]["max_len"]
    table = Table(title=f"attnmt preprocess {src}-{tgt}", title_justify="left")
    for col in ("split", "lines", "pairs", "skipped: empty", f"skipped: >{max_len} tokens", f"tokens {src}",
                f"tokens {tgt}", f"unk {src}", f"unk {tgt}"):
        table.add_column(col, justify="left" if col == "split" else "right")
    for name, s in summary["splits"].items():
        sk = s["skipped"]
        table.add_row(name, f"{s['lines']:,}", f"{s['pairs']:,}", f"{sk['empty']:,}", f"{sk['too_long']:,}",
                      f"{s['sides'][src]['tokens']:,}", f"{s['sides'][tgt]['tokens']:,}",
                      f"{100 * s['sides'][src]['unk_rate']:.2f}%", f"{100 * s['sides'][tgt]['unk_rate']:.2f}%")
    console.print(table)
    kept_empty = {n: s["empty_lines_kept"] for n, s in summary["splits"].items() if s.get("empty_lines_kept")}
    if kept_empty:
        console.print("empty lines kept (as </s> alone, to stay line-aligned): "
                      + ", ".join(f"{n} {k:,}" for n, k in kept_empty.items()))
    d = summary["dictionaries"]
    dicts = (f"joined dictionary: {d[src]['size']:,} symbols" if summary["joined_dictionary"]
             else f"dictionaries: {src} {d[src]['size']:,} symbols, {tgt} {d[tgt]['size']:,} symbols")
    bpe = summary["bpe"]
    if summary.get("bpe_model"):
        bpe += f" ({summary['bpe_settings'].get('pieces', '?')} pieces, {summary['bpe_model']})"
    console.print(f"{dicts}; subwords: {bpe}; tokenizer: {summary['tokenizer']}"
                  f"{'; lowercased' if summary['lowercase'] else ''}")
    console.print(f"done in {summary['elapsed_s']:.1f} s; output: {summary['destdir']}")
