#!/usr/bin/env python3
"""Get a recipe's corpus files and verify their sha256 checksums.

Usage: python recipes/fetch_data.py MANIFEST --out DIR [--data-dir LOCAL_DIR] [--langs L1,L2]

MANIFEST is a tab-separated file: ``name<TAB>sha256<TAB>source``. Each ``name`` is looked up in ``--data-dir`` (or
the environment variable ATTNMT_DATA_DIR) when given, else fetched from ``source``: a URL, or
``sacrebleu:TESTSET:LANGPAIR:FIELD`` (e.g. ``sacrebleu:wmt14/full:en-de:src``), which asks sacrebleu to download
its official copy of a test set. Either way the checksum must match, and the verified file is linked (or written)
into ``--out``. The checksum is the sha256 of the file's *text*: for a ``.gz`` name, of its decompressed content,
so a local gzipped copy and a fresh download verify the same way. A wrong or corrupted file is reported by name,
with the expected and the found checksum, and the script exits non-zero. ``--langs en,fr`` keeps only the files
of those languages (names ``SPLIT.LANG[.gz]``): a manifest can list a corpus's every language, a run fetches its
pair.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path


def sha256(path: Path) -> str:
    """sha256 of the file's content (decompressed for ``.gz`` names)."""
    h = hashlib.sha256()
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except (OSError, EOFError) as e:  # a truncated or non-gzip ".gz"
        return f"unreadable ({e})"
    return h.hexdigest()


def read_manifest(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            sys.exit(f"fetch_data: error: {path}:{lineno}: expected 'name<TAB>sha256<TAB>source', got {line!r}")
        rows.append((parts[0], parts[1], parts[2]))
    return rows


def language(name: str) -> str:
    """The language code of a corpus file name: ``train.fr.gz`` -> ``fr``."""
    return Path(name.removesuffix(".gz")).suffix.lstrip(".")


def download(source: str, dest: Path) -> None:
    """Fetch ``source`` (a URL or ``sacrebleu:TESTSET:LANGPAIR:FIELD``) into ``dest`` atomically."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if source.startswith("sacrebleu:"):
                _, testset, langpair, field = source.split(":")
                text = subprocess.run(["sacrebleu", "-t", testset, "-l", langpair, "--echo", field],
                                      check=True, capture_output=True).stdout
                if dest.name.endswith(".gz"):
                    text = gzip.compress(text, mtime=0)
                f.write(text)
            else:
                with urllib.request.urlopen(source, timeout=60) as r:
                    shutil.copyfileobj(r, f)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch(manifest: Path, out: Path, data_dir: Path | None, langs: list[str] | None = None) -> int:
    """Fetch and verify the files of ``manifest`` (those of ``langs``, else all) into ``out``; return the number of
    failures."""
    out.mkdir(parents=True, exist_ok=True)
    rows = read_manifest(manifest)
    if langs:
        known = sorted({language(name) for name, _, _ in rows})
        unknown = [lang for lang in langs if lang not in known]
        if unknown:
            print(f"fetch_data: error: {manifest}: no files for language {', '.join(unknown)}; this corpus has "
                  f"{', '.join(known)}", file=sys.stderr)
            return len(unknown)
        rows = [row for row in rows if language(row[0]) in langs]
    bad = 0
    for name, expected, url in rows:
        dest = out / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if data_dir is not None:
            src = data_dir / name
            if not src.exists():
                print(f"fetch_data: error: {src}: missing; put the file there or leave out --data-dir to download "
                      f"it from {url}", file=sys.stderr)
                bad += 1
                continue
        else:
            src = dest
            if url == "-" and not dest.exists():
                print(f"fetch_data: error: {name}: no public copy of this exact file to download; make it with the "
                      f"recipe's prepare step or pass --data-dir with local copies", file=sys.stderr)
                bad += 1
                continue
            if not (dest.exists() and sha256(dest) == expected):
                print(f"fetch_data: downloading {url}", file=sys.stderr)
                try:
                    download(url, dest)
                except (OSError, subprocess.CalledProcessError) as e:
                    print(f"fetch_data: error: {url}: download failed ({e}); pass --data-dir with local copies",
                          file=sys.stderr)
                    bad += 1
                    continue
        found = sha256(src)
        if found != expected:
            print(f"fetch_data: error: {src}: sha256 mismatch: expected {expected}, found {found}; the file is "
                  f"wrong or corrupted, fetch it again", file=sys.stderr)
            bad += 1
            continue
        if src != dest:
            dest.unlink(missing_ok=True)
            try:
                os.symlink(src.resolve(), dest)
            except OSError:
                shutil.copyfile(src, dest)
        print(f"fetch_data: ok {name} sha256 {found[:12]}...", file=sys.stderr)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, default=os.environ.get("ATTNMT_DATA_DIR") or None)
    ap.add_argument("--langs", default="", help="comma-separated language codes: fetch only their files")
    args = ap.parse_args()
    langs = [lang for lang in args.langs.split(",") if lang]
    return 1 if fetch(args.manifest, args.out, args.data_dir, langs) else 0


if __name__ == "__main__":
    sys.exit(main())
