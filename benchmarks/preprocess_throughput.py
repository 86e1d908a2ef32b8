"""Throughput (lines/s) and peak memory of ``attnmt preprocess``, optionally next to ``fairseq-preprocess``.

Three timed runs on the same training text, each a fresh process (imports included, as a user sees it):

1. ``attnmt preprocess --bpe sentencepiece``: the whole job (read, learn SentencePiece, segment, binarize);
2. ``attnmt preprocess --bpe none`` on the SentencePiece-segmented text written from run 1's model;
3. ``fairseq-preprocess`` on that same segmented text with the same ``--workers`` (with ``--fairseq-venv``).

Runs 2 and 3 do the same work (dictionary + binarization of identical pieces), so their ratio compares the
tools. Peak RSS is given two ways: the largest single process (``wait4`` rusage, covers every worker) and the
largest sum over the whole process tree (sampled from /proc every 20 ms).

    python benchmarks/preprocess_throughput.py --workers 2 --fairseq-venv /work/fairseq-venv
    python benchmarks/preprocess_throughput.py --limit-lines 2000          # a quick smoke run
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def resolve(prefix: str, lang: str) -> Path:
    for p in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if p.exists():
            return p
    sys.exit(f"no input {prefix}.{lang}[.gz]")


def _tree_rss_kb(root: int) -> int:
    """Sum of VmRSS over ``root`` and all its descendants (0 for processes that are gone)."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; return wall time, peak RSS of its largest process and of its whole tree (MiB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tree_peak = 0
    while True:
        tree_peak = max(tree_peak, _tree_rss_kb(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    return {"wall_s": wall, "max_rss_mib": usage.ru_maxrss / 1024, "tree_rss_mib": tree_peak / 1024}


def best_of(runs: int, cmd: list[str], destdir: Path, env: dict | None = None) -> dict:
    results = []
    for _ in range(runs):
        shutil.rmtree(destdir, ignore_errors=True)
        results.append(measure(cmd, env))
    return {"wall_s": min(r["wall_s"] for r in results),
            "wall_median_s": statistics.median(r["wall_s"] for r in results),
            "max_rss_mib": max(r["max_rss_mib"] for r in results),
            "tree_rss_mib": max(r["tree_rss_mib"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainpref", default="/work/shared/data/multi30k/train")
    ap.add_argument("-s", "--source-lang", default="en")
    ap.add_argument("-t", "--target-lang", default="de")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool; the fastest is reported")
    ap.add_argument("--limit-lines", type=int, default=0, help="use only the first N lines (smoke test)")
    ap.add_argument("--fairseq-venv", default=None, help="virtualenv with fairseq 0.12.2 (fairseq-preprocess)")
    ap.add_argument("--workdir", default=None, help="keep the outputs here instead of a temp directory")
    args = ap.parse_args()

    src, tgt = args.source_lang, args.target_lang
    work = Path(args.workdir or tempfile.mkdtemp(prefix="attnmt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    texts = {lang: read_lines(resolve(args.trainpref, lang)) for lang in (src, tgt)}
    if args.limit_lines:
        texts = {lang: lines[: args.limit_lines] for lang, lines in texts.items()}
    n = len(texts[src])
    raw = work / "raw" / "train"
    raw.parent.mkdir(exist_ok=True)
    for lang, lines in texts.items():
        Path(f"{raw}.{lang}").write_text("".join(s + "\n" for s in lines), encoding="utf-8")

    attnmt = [sys.executable, "-m", "attnmt.cli", "preprocess", "-q", "-s", src, "-t", tgt, "--joined-dictionary",
              "--workers", str(args.workers)]
    rows = {}
    full_dir = work / "attnmt-spm"
    rows["attnmt (read + learn spm + segment + binarize)"] = best_of(
        args.repeat, attnmt + ["--trainpref", str(raw), "--destdir", str(full_dir), "--bpe", "sentencepiece",
                               "--vocab-size", str(args.vocab_size)], full_dir)

    # the segmented text both binarizers read (untimed)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(full_dir / "spm.model"))
    enc = work / "enc" / "train"
    enc.parent.mkdir(exist_ok=True)
    for lang, lines in texts.items():
        pieces = sp.encode([s.strip() for s in lines], out_type=str)
        Path(f"{enc}.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")

    none_dir = work / "attnmt-none"
    rows["attnmt --bpe none (segmented text)"] = best_of(
        args.repeat, attnmt + ["--trainpref", str(enc), "--destdir", str(none_dir), "--bpe", "none"], none_dir)

    if args.fairseq_venv:
        exe = Path(args.fairseq_venv) / "bin" / "fairseq-preprocess"
        if not exe.exists():
            sys.exit(f"{exe}: not found; install fairseq with /work/shared/peers/install_fairseq.sh VENV")
        fs_dir = work / "fairseq"
        env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
        rows["fairseq-preprocess (segmented text)"] = best_of(
            args.repeat, [str(exe), "-s", src, "-t", tgt, "--trainpref", str(enc), "--destdir", str(fs_dir),
                          "--joined-dictionary", "--workers", str(args.workers), "--dataset-impl", "mmap"],
            fs_dir, env)

    print(f"training text: {args.trainpref} ({n:,} sentence pairs), workers={args.workers}, "
          f"vocab={args.vocab_size}, best of {args.repeat}, cpus={os.cpu_count()}")
    print(f"{'run':50s} {'wall s':>8s} {'lines/s':>10s} {'max RSS MiB':>12s} {'tree RSS MiB':>13s}")
    for name, r in rows.items():
        print(f"{name:50s} {r['wall_s']:8.2f} {n / r['wall_s']:10,.0f} {r['max_rss_mib']:12.0f} "
              f"{r['tree_rss_mib']:13.0f}")
    fs = rows.get("fairseq-preprocess (segmented text)")
    if fs:
        ours = rows["attnmt --bpe none (segmented text)"]
        print(f"throughput ratio attnmt/fairseq on the same segmented text: {fs['wall_s'] / ours['wall_s']:.2f}x; "
              f"peak tree RSS ratio attnmt/fairseq: {ours['tree_rss_mib'] / fs['tree_rss_mib']:.2f}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
