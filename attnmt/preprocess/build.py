"""``preprocess(cfg)``: scan, learn subwords, encode, build dictionaries, binarize, publish, summarise."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDatasetBuilder
from attnmt.data.meta import SAMPLE_SPLIT
from attnmt.data.textio import ScanResult
from attnmt.errors import UserError
from attnmt.fileio import (
    WRITE_ERRNOS,
    atomic_open,
    check_output_dir,
    exclusive,
    remove_stale_temps,
    temp_prefix,
    write_error,
)
from attnmt.preprocess.config import FORMAT_VERSION, PreprocessConfig
from attnmt.preprocess.jobs import (
    WORKER_CACHE,
    BinarizeJob,
    EncodeJob,
    EncodeResult,
    NormalizeJob,
    PipelineSpec,
    binarize_part,
    encode_part,
    normalize_part,
    scan_file,
)
from attnmt.preprocess.plan import Split, plan_parts, plan_splits
from attnmt.preprocess.publish import check_destdir, check_parallel, make_fingerprint, publish_dir
from attnmt.preprocess.runner import Runner
from attnmt.progress import StageProgress
from attnmt.registry import get


def preprocess(cfg: PreprocessConfig, quiet: bool = False) -> dict[str, Any]:
    """Run the whole preprocessing; return the summary written to ``DESTDIR/preprocess.json``.

    The summary also has ``up_to_date`` (True when DESTDIR already held this exact preprocessing and nothing was
    done), ``destdir`` and ``elapsed_s``.
    """
    t0 = time.time()
    destdir = Path(cfg.destdir)
    if destdir.exists() and not destdir.is_dir():
        raise UserError(f"{destdir}: --destdir is a file, not a directory; choose a directory")
    check_output_dir(destdir.parent, "--destdir")  # the output is built beside it, then renamed into place
    if cfg.from_model:
        cfg = _from_model(cfg)
    get("bpe", cfg.bpe)
    get("tokenizer", cfg.tokenizer)
    splits = plan_splits(cfg)
    with exclusive(destdir.parent / f".{destdir.name}.lock", f"--destdir {destdir}",
                   "wait for it to finish, or choose another --destdir"):
        remove_stale_temps(destdir.parent, destdir.name)  # a killed run's half-built directory
        return _preprocess(cfg, splits, quiet, t0)  # SIGTERM unwinds like Ctrl-C (attnmt.signals): tmp is removed


def _preprocess(cfg: PreprocessConfig, splits: list[Split], quiet: bool, t0: float) -> dict[str, Any]:
    src, tgt = cfg.source_lang, cfg.target_lang
    destdir = Path(cfg.destdir)
    WORKER_CACHE.clear()  # models/dictionaries of an earlier run in this process are not this run's
    runner = Runner(cfg.workers)  # fork the workers before any thread exists (progress display, trainer)
    progress = StageProgress(quiet)
    try:
        paths = list(dict.fromkeys(p for s in splits for p in s.paths.values()))
        stage = progress.stage("reading and checking inputs", len(paths))
        scans = dict(zip(paths, runner.map(scan_file, paths, stage)))
        for s in splits:
            check_parallel(s, scans, src, tgt)
            if s.train and scans[s.paths[src]].lines == 0:
                raise UserError(f"{s.paths[src]}: the training text is empty; give --trainpref a corpus with "
                                f"sentences in it")
        fingerprint = make_fingerprint(cfg, splits, scans)
        existing = check_destdir(destdir, fingerprint)
        stage.done(f" ({len(paths)} files, {sum(scans[p].lines for p in paths):,} lines)")
        if existing is not None:
            progress.close()
            return {**existing, "up_to_date": True, "destdir": str(destdir), "elapsed_s": time.time() - t0}
        destdir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(destdir.name), dir=destdir.parent))
        try:
            try:
                summary = _build(cfg, splits, scans, fingerprint, tmp, runner, progress)
            except OSError as e:  # the work files are written inside tmp, beside --destdir
                if e.errno not in WRITE_ERRNOS:
                    raise
                raise write_error(destdir, e, "--destdir") from None
            summary["elapsed_s"] = round(time.time() - t0, 3)
            with atomic_open(tmp / "preprocess.json", "w") as f:
                json.dump(summary, f, indent=2, ensure_ascii=False)
                f.write("\n")
            publish_dir(tmp, destdir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        progress.close()
        runner.close()
        WORKER_CACHE.clear()
    return {**summary, "up_to_date": False, "destdir": str(destdir), "elapsed_s": time.time() - t0}


def _from_model(cfg: PreprocessConfig) -> PreprocessConfig:
    """``cfg`` with the text pipeline of the ``--from-model`` checkpoint (its ``model_data`` the checkpoint's)."""
    from attnmt import checkpoint

    path = checkpoint.resolve(cfg.from_model)
    data = checkpoint.DataSection.from_dict(checkpoint.load(path)["data"], path)
    if data.bpe != "sentencepiece" or data.bpe_model_bytes() is None:
        raise UserError(f"--from-model {path}: the checkpoint carries no SentencePiece model; binarize with "
                        f"--srcdict/--tgtdict and the subword model its data was made with")
    langs = data.language_tokens or {}
    if langs:
        for lang, what in ((cfg.source_lang, "source"), (cfg.target_lang, "target")):
            if lang not in langs:
                raise UserError(f"--{what}-lang {lang}: not a language of {path.name} (e.g. "
                                f"{', '.join(sorted(langs)[:10])}); name the files by the model's language codes")
    elif (cfg.source_lang, cfg.target_lang) != (data.source_lang, data.target_lang) and \
            (data.source_lang, data.target_lang) != ("src", "tgt"):
        raise UserError(f"-s {cfg.source_lang} -t {cfg.target_lang}: {path.name} translates {data.source_lang}->"
                        f"{data.target_lang}; give its languages")
    cfg = dataclasses.replace(cfg, bpe="sentencepiece", tokenizer=data.tokenizer, lowercase=data.lowercase,
                              joined_dictionary=data.joint_dictionary)
    cfg.model_data = data  # not an option: what _build takes from the checkpoint
    return cfg


def _bpe_model_name(bpe: str) -> str:
    return {"sentencepiece": "spm.model", "subword_nmt": "bpecodes"}.get(bpe, f"{bpe}.model")


def _build(cfg: PreprocessConfig, splits: list[Split], scans: dict[str, ScanResult], fingerprint: dict,
           tmp: Path, runner: Runner, progress: StageProgress) -> dict[str, Any]:
    src, tgt = cfg.source_lang, cfg.target_lang
    langs = (src, tgt)
    work = tmp / ".work"
    work.mkdir()
    parts = {s.name: plan_parts(s, scans, cfg.workers) for s in splits}
    threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    bpe_cls = get("bpe", cfg.bpe).obj

    model_data = getattr(cfg, "model_data", None)  # --from-model's checkpoint data section
    tgt_model_file: str | None = None  # the target side's own subword model (--from-model)

    def specs(bpe_name: str, model: str | None) -> dict[str, PipelineSpec]:
        files = {src: model, tgt: tgt_model_file or model}
        return {lang: PipelineSpec(cfg.tokenizer, lang, cfg.lowercase, bpe_name, files[lang], threads)
                for lang in langs}

    # ---- subword model
    train = next((s for s in splits if s.train), None)
    normalized: dict[tuple[str, int], dict[str, str]] = {}
    model_file: str | None = None
    bpe_info: dict[str, Any] = {}
    if model_data is not None:
        bpe = bpe_cls.from_bytes(model_data.bpe_model_bytes("src"), what=f"--from-model {cfg.from_model}")
        if model_data.tgt_bpe_model is not None:
            tgt_model_file = str(tmp / "spm.tgt.model")
            with atomic_open(tgt_model_file, "wb") as f:
                f.write(model_data.bpe_model_bytes("tgt"))
            bpe_info.update(tgt_model="spm.tgt.model")
    elif cfg.spm_model or cfg.bpe_codes:
        bpe = bpe_cls.load(cfg.spm_model or cfg.bpe_codes)
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
    else:
        bpe = bpe_cls.load()
    if bpe.model_bytes():
        name = _bpe_model_name(cfg.bpe)
        with atomic_open(tmp / name, "wb") as f:
            f.write(bpe.model_bytes())
        model_file = str(tmp / name)
        bpe_info.update(model=name, model_sha256=hashlib.sha256(bpe.model_bytes()).hexdigest())
        bpe_info.update(bpe.describe())

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
    if train is not None and sum(r.kept for r in enc if r.split == train.name) == 0:
        raise UserError(f"{train.paths[cfg.source_lang]}: no training pair is left (every one has an empty side or "
                        f"more than --max-len {cfg.max_len} tokens); check the corpus or raise --max-len")

    # ---- dictionaries
    if model_data is not None:
        dicts = dict(zip(langs, model_data.dictionaries(cfg.from_model)))
    else:
        dicts = _dictionaries(cfg, [r for r in enc if r.split == (train.name if train else None)])
    language_tokens = (model_data.language_tokens or {}) if model_data is not None else {}
    dict_paths = {}
    for lang in langs:
        dict_paths[lang] = str(tmp / f"dict.{lang}.txt")
        dicts[lang].save(dict_paths[lang])

    # ---- binarize parts, then concatenate them in order
    bin_jobs = []
    for job in enc_jobs:
        for lang in langs:
            bin_jobs.append(BinarizeJob(job.part.split, lang, job.outputs[lang], dict_paths[lang],
                                        job.outputs[lang] + ".ds", language_tokens.get(lang)))
    stage = progress.stage("binarizing", len(bin_jobs))
    counts = runner.map(binarize_part, bin_jobs, stage)
    stage.done()
    totals = {(s.name, lang): [0, 0, 0, 0] for s in splits for lang in langs}
    for job, (n, toks, unks, longest) in zip(bin_jobs, counts):
        t = totals[(job.split, job.lang)]
        totals[(job.split, job.lang)] = [t[0] + n, t[1] + toks, t[2] + unks, max(t[3], longest)]
    for s in splits:
        for lang in langs:
            with IndexedDatasetBuilder(tmp / f"{s.name}.{src}-{tgt}.{lang}", len(dicts[lang]),
                                       cfg.dataset_impl) as b:
                for p in parts[s.name]:
                    b.merge(work / f"{s.name}.{lang}.pieces.{p.index:05d}.ds")
    sampled = _sampled_segmentations(cfg, train, parts, normalized, specs(cfg.bpe, model_file), dict_paths, tmp,
                                     len(dicts[src]), len(dicts[tgt]), runner, progress) if cfg.bpe_dropout else None
    shutil.rmtree(work)

    summary = _summary(cfg, splits, scans, fingerprint, enc, totals, dicts, dict_paths, bpe_info)
    if model_data is not None:  # the conventions a model fine-tuned on this data keeps
        summary["model"] = {"from": str(cfg.from_model), "tgt_bpe_model": bpe_info.get("tgt_model"),
                            "decoder_start": model_data.decoder_start,
                            "language_tokens": model_data.language_tokens}
    if sampled is not None:
        summary["bpe_dropout"] = sampled
    return summary


def _sampled_segmentations(cfg: PreprocessConfig, train: Split, parts, normalized, specs, dict_paths: dict[str, str],
                           tmp: Path, src_size: int, tgt_size: int, runner: Runner,
                           progress: StageProgress) -> dict[str, Any]:
    """Write the training split again, --bpe-dropout-samples times, each time segmented with BPE-dropout and a
    seed of its own, as the splits train_sample1, ...: the same pairs in the same order as train, with the same
    dictionaries. Returns what preprocess.json records about them."""
    src, tgt = cfg.source_lang, cfg.target_lang
    work = tmp / ".work"
    names = [f"{SAMPLE_SPLIT}{k}" for k in range(1, cfg.bpe_dropout_samples + 1)]
    enc_jobs, bin_jobs = [], []
    for k, name in enumerate(names, start=1):
        for p in parts[train.name]:
            norm = normalized.get((train.name, p.index))
            outs = {lang: str(work / f"{name}.{lang}.pieces.{p.index:05d}") for lang in (src, tgt)}
            enc_jobs.append(EncodeJob(p, norm or train.paths, norm is not None, outs, specs, True, cfg.max_len,
                                      dropout=cfg.bpe_dropout, seed=k, dicts=dict_paths))
            bin_jobs += [BinarizeJob(name, lang, outs[lang], dict_paths[lang], outs[lang] + ".ds") for lang in outs]
    stage = progress.stage(f"BPE-dropout {cfg.bpe_dropout}: {len(names)} segmentations of {train.name}", len(enc_jobs))
    runner.map(encode_part, enc_jobs, stage)
    stage.done()
    stage = progress.stage("binarizing the BPE-dropout segmentations", len(bin_jobs))
    counts = runner.map(binarize_part, bin_jobs, stage)
    stage.done()
    tokens = {src: 0, tgt: 0}
    unks = {src: 0, tgt: 0}
    for job, (_, toks, unk, _) in zip(bin_jobs, counts):
        tokens[job.lang] += toks
        unks[job.lang] += unk
    for name in names:
        for lang, size in ((src, src_size), (tgt, tgt_size)):
            with IndexedDatasetBuilder(tmp / f"{name}.{src}-{tgt}.{lang}", size, cfg.dataset_impl) as b:
                for p in parts[train.name]:
                    b.merge(work / f"{name}.{lang}.pieces.{p.index:05d}.ds")
    n = len(names)
    return {"dropout": cfg.bpe_dropout, "samples": n, "splits": names,
            "sides": {lang: {"tokens_per_sample": round(tokens[lang] / n), "unk": unks[lang]} for lang in (src, tgt)}}


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
        "joined_dictionary": cfg.joined_dictionary,
        "bpe": cfg.bpe,
        "bpe_model": bpe_info.get("model"),
        "bpe_settings": {"vocab_size": cfg.vocab_size, "max_sentences": cfg.bpe_max_sentences,
                         "reused_model": cfg.spm_model or cfg.bpe_codes, **bpe_info},
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
