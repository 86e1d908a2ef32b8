"""Trials of the Multi30k recipe's training settings at fixed update counts, several at a time, scored on val only.

Each trial trains ``transformer_small`` on a recipe data-bin for a fixed number of updates with the recipe's base
settings plus the trial's own options, then averages the last 5 and the last 10 epoch checkpoints and the 5 of the
lowest valid loss, decodes val with beam 4 at lenpen 0.6, 1.0 and 1.5 and scores it with sacreBLEU: the choices the
recipe itself makes on val (it tries 0.6 and 1.0), and a longer output. One JSON line per trial goes to
OUT/trials.jsonl as soon as the trial ends, with its valid losses so far even when it did not finish.

    python benchmarks/multi30k_sweep.py --data-bin runs/multi30k_en_de/data-bin --refs runs/multi30k_en_de/raw \\
        --out sweep --parallel 4 --trial 'base2100 en de 2100 fp32 --dropout 0.2' ...

A trial is ``NAME SRC TGT UPDATES PRECISION [attnmt train options]``; the data-bin serves both directions.
``--device cuda`` runs trials side by side on one GPU (each process is bound by its kernel launches).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE = ("--arch transformer_small --max-tokens 4096 --warmup-updates 500 --label-smoothing 0.1 "
        "--weight-decay 0.0001 --seed 1 --keep-last-epochs 10 --keep-best-checkpoints 5 --log-interval 100 "
        "--progress none")
SCHEDULES = {  # the learning-rate options each schedule takes in the recipe
    "inverse_sqrt": "--lr 2e-3 --warmup-init-lr 1e-7",
    "polynomial_decay": "--lr 2e-3",
}
LENPENS = ("0.6", "1.0", "1.5")  # the recipe tries 0.6 and 1.0; 1.5 shows what a longer output would give


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def run(cmd: str, log: Path, deadline: float) -> None:
    left = deadline - time.time()
    if left <= 0:
        raise TimeoutError("deadline")
    with open(log, "a") as f:
        f.write(f"$ {cmd}\n")
        f.flush()
        subprocess.run(cmd, shell=True, check=True, stdout=f, stderr=subprocess.STDOUT, timeout=left)


def valid_curve(log: Path) -> list[list[float]]:
    """[update, valid loss] at each validation the training log holds so far (a line cut short is skipped)."""
    curve: dict[int, float] = {}
    if log.exists():
        for line in open(log):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("type") == "valid":
                curve[r["num_updates"]] = round(r["loss"], 4)
    return [[u, loss] for u, loss in sorted(curve.items())]


def trial(spec: str, args, deadline: float) -> dict:
    name, src, tgt, updates, precision, *extra = shlex.split(spec)
    work = args.out / name
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    extra_s = " ".join(shlex.quote(x) for x in extra)
    sched = "polynomial_decay" if "polynomial_decay" in extra else "inverse_sqrt"
    t0 = time.time()
    result = {"name": name, "pair": f"{src}-{tgt}", "updates": int(updates), "precision": precision,
              "options": extra_s}
    a = args.attnmt
    device = "--cpu" if args.device == "cpu" else ""  # train takes the GPU when there is one
    try:
        run(f"{a} train {args.data_bin} -s {src} -t {tgt} --save-dir {work / 'ckpt'} {device} "
            f"--precision {precision} --threads {args.threads} {BASE} {SCHEDULES[sched]} --max-update {updates} "
            f"{extra_s}", log, deadline)
        recs = [json.loads(x) for x in open(work / "ckpt" / "train.jsonl")]
        valid = [r for r in recs if r["type"] == "valid"]
        best = min(valid, key=lambda r: r["loss"])
        summary = next(r for r in recs if r["type"] == "summary")
        result.update(train_minutes=round(summary["train_time"] / 60, 2), best_valid_loss=best["loss"],
                      best_valid_update=best["num_updates"], last_valid_loss=valid[-1]["loss"])
        ckpt = work / "ckpt"
        models = {}
        epochs = len(list(ckpt.glob("checkpoint[0-9]*.pt")))
        for k in [k for k in (5, 10) if k <= epochs]:
            run(f"{a} average-checkpoints --inputs {ckpt} --num-epoch-checkpoints {k} --output {ckpt}/avg{k}.pt",
                log, deadline)
            models[f"last{k}"] = ckpt / f"avg{k}.pt"
        bests = sorted(str(p) for p in ckpt.glob("checkpoint.best_loss_*.pt"))
        if len(bests) >= 2:
            run(f"{a} average-checkpoints --inputs {' '.join(bests)} --output {ckpt}/avgbest.pt", log, deadline)
            models["best5"] = ckpt / "avgbest.pt"
        out = subprocess.run(
            [sys.executable, __file__, "--decode", "--device", args.device, "--precision", precision,
             "--source", str(args.refs / f"val.{src}.gz"), "--reference", str(args.refs / f"val.{tgt}.gz"),
             *[f"{k}={m}" for k, m in models.items()]],
            check=True, capture_output=True, text=True,
            timeout=None if deadline == float("inf") else max(deadline - time.time(), 1))
        scores = json.loads(out.stdout.strip().splitlines()[-1])
        result["val"] = scores
        result["val_best"] = max(scores.items(), key=lambda kv: kv[1])
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, TimeoutError, OSError, StopIteration,
            ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}" + (f" {e.stderr[-500:]}" if getattr(e, "stderr", None) else "")
    result["valid_curve"] = valid_curve(work / "ckpt" / "train.jsonl")  # also of a trial the deadline stopped
    result["minutes"] = round((time.time() - t0) / 60, 2)
    with open(args.out / "trials.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result


def decode(argv: list[str]) -> None:
    """``--decode --device D --precision P --source F --reference F KEY=MODEL...``: val BLEU of each model at
    each of LENPENS (beam 4), one process for all, as one JSON line."""
    import sacrebleu

    from attnmt import Translator

    p = argparse.ArgumentParser()
    p.add_argument("--decode", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="auto")
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--reference", type=Path, required=True)
    p.add_argument("models", nargs="+")
    a = p.parse_args(argv)
    sources, refs = read_lines(a.source), read_lines(a.reference)
    scores = {}
    for km in a.models:
        key, model = km.split("=", 1)
        with Translator(model, device=a.device, precision=a.precision, beam=4) as t:
            for lp in LENPENS:
                hyps = t.translate(sources, lenpen=float(lp))
                scores[f"{key} lp{lp}"] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
    print(json.dumps(scores))


def main() -> None:
    if "--decode" in sys.argv[1:]:
        return decode(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-bin", type=Path, required=True)
    p.add_argument("--refs", type=Path, required=True, help="folder with val.LANG.gz (the detokenized references)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trial", action="append", default=[], help="NAME SRC TGT UPDATES PRECISION [train options]")
    p.add_argument("--trials-file", type=Path, help="one trial a line (# comments)")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=0, help="stop starting and kill trials after this (0: none)")
    p.add_argument("--attnmt", default="attnmt", help="how to run attnmt (e.g. 'python3 -m attnmt.cli')")
    args = p.parse_args()
    specs = list(args.trial)
    if args.trials_file:
        specs += [x.strip() for x in args.trials_file.read_text().splitlines() if x.strip() and not x.startswith("#")]
    if not specs:
        sys.exit("multi30k_sweep: no trials (give --trial or --trials-file)")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.seconds if args.seconds else float("inf")
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda s: trial(s, args, deadline), specs))
    print("\ntrial\tpair\tupdates\tbest valid loss (update)\tval BLEU: " + ", ".join(
        f"{m} lp{lp}" for m in ("last5", "last10", "best5") for lp in LENPENS))
    for r in results:
        v = r.get("val", {})
        cells = [str(v.get(f"{m} lp{lp}", "-")) for m in ("last5", "last10", "best5") for lp in LENPENS]
        loss = f"{r['best_valid_loss']:.3f} ({r['best_valid_update']})" if "best_valid_loss" in r else "-"
        print(f"{r['name']}\t{r['pair']}\t{r['updates']}\t{loss}\t" + "\t".join(cells)
              + (f"\t{r['error']}" if "error" in r else ""))


if __name__ == "__main__":
    main()
