#!/usr/bin/env python3
"""Get a recipe's corpus files and verify their sha256 checksums.

Usage: python recipes/fetch_data.py MANIFEST --out DIR [--data-dir LOCAL_DIR]

MANIFEST is a tab-separated file: ``name<TAB>sha256<TAB>url``. Each ``name`` is looked up in ``--data-dir`` (or the
environment variable ATTNMT_DATA_DIR) when given, else downloaded from ``url``. Either way its sha256 must match,
and the verified file is linked (or copied) into ``--out``. A wrong or corrupted file is reported by name, with the
expected and the found checksum, and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            sys.exit(f"fetch_data: error: {path}:{lineno}: expected 'name<TAB>sha256<TAB>url', got {line!r}")
        rows.append((parts[0], parts[1], parts[2]))
    return rows


def download(url: str, dest: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with urllib.request.urlopen(url, timeout=60) as r, os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(r, f)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, default=os.environ.get("ATTNMT_DATA_DIR") or None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for name, expected, url in read_manifest(args.manifest):
        dest = args.out / name
        if args.data_dir is not None:
            src = args.data_dir / name
            if not src.exists():
                print(f"fetch_data: error: {src}: missing; put the file there or leave out --data-dir to download "
                      f"it from {url}", file=sys.stderr)
                bad += 1
                continue
        else:
            src = dest
            if not (dest.exists() and sha256(dest) == expected):
                print(f"fetch_data: downloading {url}", file=sys.stderr)
                try:
                    download(url, dest)
                except OSError as e:
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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
