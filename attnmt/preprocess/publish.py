"""A destdir's identity (fingerprint of inputs and options), the up-to-date check, and the atomic publish."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from attnmt.data.textio import ScanResult
from attnmt.errors import UserError
from attnmt.fileio import umask
from attnmt.preprocess.config import FORMAT_VERSION, NEUTRAL_OPTIONS, PreprocessConfig
from attnmt.preprocess.plan import Split

# ---------------------------------------------------------------------------------------------------- main


def _sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make_fingerprint(cfg: PreprocessConfig, splits: list[Split], scans: dict[str, ScanResult]) -> dict[str, Any]:
    """What decides the output: the options that change it and the checksums of everything read."""
    opts = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NEUTRAL_OPTIONS}
    if not cfg.bpe_dropout:  # without BPE-dropout the output is what it was before these options existed
        opts = {k: v for k, v in opts.items() if k not in ("bpe_dropout", "bpe_dropout_samples")}
    inputs = {s.name: {lang: scans[p].sha256 for lang, p in s.paths.items()} for s in splits}
    reused = {}
    for name in ("srcdict", "tgtdict", "spm_model", "bpe_codes"):
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


def check_destdir(destdir: Path, fingerprint: dict) -> dict | None:
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


def check_parallel(split: Split, scans: dict[str, ScanResult], src: str, tgt: str) -> None:
    a, b = scans[split.paths[src]], scans[split.paths[tgt]]
    if a.lines != b.lines:
        short, long_ = (a, b) if a.lines < b.lines else (b, a)
        raise UserError(
            f"{short.path}:{short.lines + 1}: line missing: {short.path} ends after line {short.lines} but "
            f"{long_.path} has {long_.lines} lines; source and target of split '{split.name}' must have the same "
            f"number of lines (one sentence pair per line), fix the files")


def publish_dir(tmp: Path, destdir: Path) -> None:
    # temp files are created private (0600/0700); the published data gets the usual umask permissions
    mask = umask()
    for p in [tmp, *tmp.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
    if destdir.exists():
        destdir.rmdir()  # empty (checked before); a non-empty one would make rmdir fail, never lose data
    os.replace(tmp, destdir)
