#!/usr/bin/env python3
"""Extract the WMT14 en-de training pairs from the three verified archives (as fairseq's prepare-wmt14en2de.sh).

Usage: python recipes/wmt14_en_de/get_train.py ARCHIVE_DIR OUT_PREFIX
Writes OUT_PREFIX.en.gz and OUT_PREFIX.de.gz: Europarl v7 + CommonCrawl + News Commentary v9, de-en, in that
order, one sentence per line (about 4.5M pairs). Pairs with an empty side are kept here; `attnmt preprocess` skips
and counts them.
"""

from __future__ import annotations

import gzip
import sys
import tarfile
from pathlib import Path

CORPORA = [
    ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en"),
    ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
    ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en"),
]


def main() -> int:
    archive_dir, out = Path(sys.argv[1]), sys.argv[2]
    counts = {}
    outs = {lang: gzip.open(f"{out}.{lang}.gz.tmp", "wt", encoding="utf-8") for lang in ("en", "de")}
    for archive, stem in CORPORA:
        with tarfile.open(archive_dir / archive) as tar:
            lines = {}
            for lang in ("en", "de"):
                member = tar.extractfile(f"{stem}.{lang}")
                if member is None:
                    sys.exit(f"get_train: error: {archive}: has no {stem}.{lang}; the archive is not the WMT14 one")
                lines[lang] = member.read().decode("utf-8", errors="replace").splitlines()
            if len(lines["en"]) != len(lines["de"]):
                sys.exit(f"get_train: error: {archive}: {stem}.en has {len(lines['en'])} lines but {stem}.de has "
                         f"{len(lines['de'])}; the archive is corrupted, download it again")
            for lang in ("en", "de"):
                outs[lang].write("\n".join(line.strip() for line in lines[lang]) + "\n")
            counts[archive] = len(lines["en"])
    for lang, f in outs.items():
        f.close()
        Path(f"{out}.{lang}.gz.tmp").replace(f"{out}.{lang}.gz")
    for archive, n in counts.items():
        print(f"get_train: {archive}: {n:,} pairs", file=sys.stderr)
    print(f"get_train: {sum(counts.values()):,} pairs -> {out}.{{en,de}}.gz", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
