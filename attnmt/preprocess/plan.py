"""What to build: the splits named by the options, and the line ranges (parts) the workers share."""

from __future__ import annotations

from dataclasses import dataclass

from attnmt.data.textio import CHECKPOINT, ScanResult, resolve_input
from attnmt.errors import UserError
from attnmt.preprocess.config import MAX_PART_LINES, PreprocessConfig


@dataclass
class Split:
    name: str  # train, valid, valid1, ..., test, test1, ...
    prefix: str
    paths: dict[str, str]  # lang -> input file
    train: bool


def plan_splits(cfg: PreprocessConfig) -> list[Split]:
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


def plan_parts(split: Split, scans: dict[str, ScanResult], workers: int) -> list[Part]:
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
