"""The paper's Table 3 (Vaswani et al. 2017, section 6.2) at the scale of the data at hand.

Every row varies the base model in one factor, as the paper's rows do, and is trained for the same number of
updates from the same seed; then, as a fixed protocol, the last checkpoint (no averaging) is scored on dev:
perplexity per piece (the validation NLL, label smoothing off) and sacreBLEU of beam 4, lenpen 0.6. Parameters are
counted. The table is printed in the paper's layout, with the paper's own dev figures beside ours, and written to
OUT/table3.md, OUT/table3.json and OUT/table3_bleu.png (dev BLEU per row).

    python recipes/paper_table3/table3.py --data-bin BIN --valid-source val.en.gz --valid-reference val.de.gz \\
        --out OUT --rows A,B,C,D,E --updates 600

A row is named as in the paper, group and position: ``A1`` (h 1) ... ``A4``, ``B1``, ``B2``, ``C1`` ... ``C7``,
``D1`` ... ``D4``, ``E``, ``big``; ``--rows`` takes groups (``A``), single rows (``C5``) or both; ``base`` is always
trained. ``--base`` scales the paper's base to the data: ``paper`` is the paper's own (N 6, d_model 512, d_ff 2048,
h 8), ``multi30k`` a quarter of its width at half its depth (N 3, d_model 128, d_ff 512, h 8, d_k 16), which a CPU
trains in minutes. The rows keep the paper's ratios to the base: row C's N 2/4/8 are a third, two thirds and four
thirds of the base's N; d_model and d_ff are halved and doubled; row A keeps h d_k = d_model, row B divides d_k by
4 and 2. Dropout and label smoothing (row D) take the paper's values. The learning rate follows the paper's schedule
in proportion, d_model^-0.5: the rows that change d_model change the peak by sqrt(base d_model / theirs).
``--budget-hours`` picks the updates from a 50-update probe of the base on this machine (three quarters of the budget
for training, the rest for scoring dev and starting processes), each row's time estimated from its multiply-adds
per token relative to the base's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

# The paper's Table 3: (train steps, dev PPL, dev BLEU, params x 10^6); None where the table leaves it blank.
PAPER = {
    "base": (100_000, 4.92, 25.8, 65), "A1": (None, 5.29, 24.9, None), "A2": (None, 5.00, 25.5, None),
    "A3": (None, 4.91, 25.8, None), "A4": (None, 5.01, 25.4, None), "B1": (None, 5.16, 25.1, 58),
    "B2": (None, 5.01, 25.4, 60), "C1": (None, 6.11, 23.7, 36), "C2": (None, 5.19, 25.3, 50),
    "C3": (None, 4.88, 25.5, 80), "C4": (None, 5.75, 24.5, 28), "C5": (None, 4.66, 26.0, 168),
    "C6": (None, 5.12, 25.4, 53), "C7": (None, 4.75, 26.2, 90), "D1": (None, 5.77, 24.6, None),
    "D2": (None, 4.95, 25.5, None), "D3": (None, 4.67, 25.3, None), "D4": (None, 5.47, 25.7, None),
    "E": (None, 4.92, 25.7, None), "big": (300_000, 4.33, 26.4, 213),
}
GROUPS = ("A", "B", "C", "D", "E", "big")
BEAM, LENPEN = 4, 0.6


@dataclass(frozen=True)
class Model:
    """One row's model and regularisation: the paper's columns."""

    layers: int
    d_model: int
    d_ff: int
    heads: int
    d_k: int
    d_v: int
    dropout: float
    label_smoothing: float
    learned_pos: bool = False

    def train_options(self) -> list[str]:
        opts = ["--arch", "transformer", "--share-all-embeddings"]
        for side in ("encoder", "decoder"):
            opts += [f"--{side}-layers", str(self.layers), f"--{side}-embed-dim", str(self.d_model),
                     f"--{side}-ffn-embed-dim", str(self.d_ff), f"--{side}-attention-heads", str(self.heads)]
        if self.d_k != self.d_v:
            opts += ["--attention-key-dim", str(self.d_k)]
        opts += ["--dropout", str(self.dropout), "--label-smoothing", str(self.label_smoothing)]
        return opts + (["--learned-pos"] if self.learned_pos else [])

    def macs_per_token(self, vocab: int) -> float:
        """Multiply-adds per target token of training's forward pass (projections, FFNs, output layer), the
        source as long as the target: what the rows' training times scale with."""
        attention = 2 * self.d_model * self.heads * self.d_k + 2 * self.d_model * self.d_model
        ffn = 2 * self.d_model * self.d_ff
        return self.layers * (attention + ffn) + self.layers * (2 * attention + ffn) + vocab * self.d_model


BASES = {
    "paper": Model(6, 512, 2048, 8, 64, 64, 0.1, 0.1),
    "multi30k": Model(3, 128, 512, 8, 16, 16, 0.1, 0.1),
}


def rows_of(base: Model) -> dict[str, tuple[str, Model]]:
    """Every row of Table 3 as (the paper's label, this base's model), in the paper's order."""
    d, n, h, dk = base.d_model, base.layers, base.heads, base.d_k
    rows = {"base": ("base", base)}
    for i, heads in enumerate((1, 4, 16, 32), 1):  # (A): h d_k = d_model, constant computation
        rows[f"A{i}"] = (f"h {heads}", replace(base, heads=heads, d_k=d // heads, d_v=d // heads))
    for i, div in enumerate((4, 2), 1):  # (B): smaller d_k, d_v unchanged
        rows[f"B{i}"] = (f"d_k {max(dk // div, 1)}", replace(base, d_k=max(dk // div, 1)))
    for i, layers in enumerate((n // 3, 2 * n // 3, 4 * n // 3), 1):  # (C): model size
        rows[f"C{i}"] = (f"N {max(layers, 1)}", replace(base, layers=max(layers, 1)))
    for i, width in enumerate((d // 2, 2 * d), 4):
        rows[f"C{i}"] = (f"d_model {width}", replace(base, d_model=width, d_k=width // h, d_v=width // h))
    for i, ff in enumerate((base.d_ff // 2, 2 * base.d_ff), 6):
        rows[f"C{i}"] = (f"d_ff {ff}", replace(base, d_ff=ff))
    for i, p in enumerate((0.0, 0.2), 1):  # (D): regularisation
        rows[f"D{i}"] = (f"P_drop {p}", replace(base, dropout=p))
    for i, ls in enumerate((0.0, 0.2), 3):
        rows[f"D{i}"] = (f"eps_ls {ls}", replace(base, label_smoothing=ls))
    rows["E"] = ("learned positions", replace(base, learned_pos=True))
    rows["big"] = ("big", replace(base, d_model=2 * d, d_ff=2 * base.d_ff, heads=2 * h, d_k=d // h, d_v=d // h,
                                  dropout=0.3))
    return rows


def select(rows: dict, spec: str) -> list[str]:
    """``A,C5,E`` -> the rows named (groups expanded), base first, in the paper's order."""
    wanted = {"base"}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        names = [r for r in rows if r == part or (part in GROUPS and part != "big" and r[:-1] == part)
                 or (part == "E" and r == "E")]
        if not names:
            raise SystemExit(f"table3: unknown row {part!r} in --rows; use groups {', '.join(GROUPS)} or rows such "
                             f"as A1, C5 (the paper's order within a group)")
        wanted.update(names)
    return [r for r in rows if r in wanted]


# ---------------------------------------------------------------------------------------------- running


def read_lines(path: Path) -> list[str]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env)


def train_command(args, model: Model, save_dir: Path, updates: int, seed: int, threads: int, lr: float) -> list[str]:
    warmup = max(1, min(4000, updates // 4))  # the paper warms up for 4,000 of 100,000; short runs for a quarter
    cmd = [*args.attnmt, "train", str(args.data_bin), "--save-dir", str(save_dir), *model.train_options(),
           "--max-tokens", str(args.max_tokens), "--lr", f"{lr:.6g}", "--warmup-updates", str(warmup),
           "--warmup-init-lr", "1e-7", "--max-update", str(updates), "--seed", str(seed), "--precision", args.precision, "--threads",
           str(threads), "--no-epoch-checkpoints", "--log-interval", "50", "--progress", "none"]
    return cmd + (["--cpu"] if args.device == "cpu" else [])


def trial(args, name: str, label: str, model: Model, seed: int, updates: int, base_d: int, threads: int) -> dict:
    work = args.out / f"{name}.seed{seed}"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    lr = args.lr * math.sqrt(base_d / model.d_model)
    result = {"row": name, "label": label, "seed": seed, "updates": updates, "lr": round(lr, 6),
              "options": " ".join(model.train_options())}
    t0 = time.time()
    try:
        done = work / "result.json"
        if done.exists() and not args.smoke:  # a finished trial of an interrupted run is not trained again
            return json.loads(done.read_text())
        run(train_command(args, model, work / "ckpt", updates, seed, threads, lr), log)
        recs = [json.loads(x) for x in open(work / "ckpt" / "train.jsonl", encoding="utf-8")]
        summary = next(r for r in recs if r["type"] == "summary")
        valid = summary.get("valid") or [r for r in recs if r["type"] == "valid"][-1]
        out = subprocess.run([sys.executable, __file__, "--score", str(work / "ckpt" / "checkpoint_last.pt"),
                              str(args.valid_source), str(args.valid_reference), args.device, args.precision,
                              str(threads), str(args.smoke_sentences if args.smoke else 0)],
                             check=True, capture_output=True, text=True)
        scored = json.loads(out.stdout.strip().splitlines()[-1])
        result.update(dev_ppl=round(valid["ppl"], 3), dev_bleu=scored["bleu"], params=scored["params"],
                      train_minutes=round(summary["train_time"] / 60, 2))
        done.write_text(json.dumps(result | {"minutes": round((time.time() - t0) / 60, 2)}))
    except (subprocess.CalledProcessError, OSError, StopIteration, ValueError, KeyError, IndexError) as e:
        tail = getattr(e, "stderr", None) or (log.read_text()[-400:] if log.exists() else "")
        result["error"] = f"{type(e).__name__}: {e} {tail[-400:]}".strip()
    result["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(result), flush=True)
    return result


def score(argv: list[str]) -> None:
    """``--score CKPT SOURCE REFERENCE DEVICE PRECISION THREADS LINES``: parameters and dev sacreBLEU (beam 4,
    lenpen 0.6) of one checkpoint, as one JSON line (a process of its own, so trials do not share a model)."""
    import sacrebleu
    import torch

    from attnmt import Translator
    from attnmt.inference import load_for_inference

    path, source, reference, device, precision, threads, lines = argv
    torch.set_num_threads(int(threads))
    sources, refs = read_lines(Path(source)), read_lines(Path(reference))
    if int(lines):
        sources, refs = sources[: int(lines)], refs[: int(lines)]
    params = load_for_inference(path).model.num_parameters()
    with Translator(path, device=device, precision=precision, beam=BEAM, workers=1) as t:
        hyps = t.translate(sources, lenpen=LENPEN)
    print(json.dumps({"bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2), "params": params}))


def probe_seconds_per_update(args, base: Model, threads: int) -> float:
    """The base's seconds per update on this machine: the median of 40 updates after 10 of warm-up."""
    work = args.out / "probe"
    cmd = train_command(args, base, work, 50, 1, threads, args.lr)
    cmd = [c for c in cmd if c != "--no-epoch-checkpoints"] + ["--no-save", "--disable-validation"]
    cmd[cmd.index("--log-interval") + 1] = "10"
    run(cmd, args.out / "probe.log")
    recs = [json.loads(x) for x in open(work / "train.jsonl", encoding="utf-8")]
    rates = sorted(r["ups"] for r in recs if r["type"] == "train" and r["num_updates"] > 10)
    return 1.0 / rates[len(rates) // 2]


# ---------------------------------------------------------------------------------------------- the table


def summarize(results: list[dict], names: list[str], rows: dict) -> list[dict]:
    table = []
    for name in names:
        runs = [r for r in results if r["row"] == name and "error" not in r]
        label, model = rows[name]
        paper = PAPER[name]
        entry = {"row": name, "label": label, "N": model.layers, "d_model": model.d_model, "d_ff": model.d_ff,
                 "h": model.heads, "d_k": model.d_k, "d_v": model.d_v, "P_drop": model.dropout,
                 "eps_ls": model.label_smoothing, "learned_pos": model.learned_pos, "seeds": len(runs),
                 "paper": {"steps": paper[0], "dev_ppl": paper[1], "dev_bleu": paper[2], "params_M": paper[3]}}
        if runs:
            entry["updates"] = runs[0]["updates"]
            entry["params_M"] = round(runs[0]["params"] / 1e6, 2)
            for key in ("dev_ppl", "dev_bleu"):
                values = [r[key] for r in runs]
                entry[key] = round(statistics.mean(values), 2 if key == "dev_bleu" else 3)
                entry[key + "_sd"] = round(statistics.stdev(values), 3) if len(values) > 1 else None
        errors = [r["error"] for r in results if r["row"] == name and "error" in r]
        if errors:
            entry["errors"] = errors
        table.append(entry)
    return table


def cell(entry: dict, key: str) -> str:
    if key not in entry:
        return "failed" if entry.get("errors") else "-"
    sd = entry.get(key + "_sd")
    return f"{entry[key]:g}" + (f" ± {sd:g}" if sd is not None else "")


def markdown(table: list[dict], base: dict) -> str:
    """The paper's layout: the varied columns filled, the others blank (= base); our dev figures, then the
    paper's."""
    cols = ("N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "eps_ls")
    head = ("| | " + " | ".join(cols) + " | updates | dev PPL | dev BLEU | params (M) | paper: PPL | BLEU | params |")
    lines = [head, "|" + "---|" * (len(cols) + 8)]
    for e in table:
        group = "" if e["row"] in ("base", "big") else e["row"].rstrip("0123456789")
        first = e["row"] if e["row"] in ("base", "big") else f"({group}) {e['row']}"
        if e["row"] == "E":
            vals = ["positional embedding instead of sinusoids"] + [""] * (len(cols) - 1)
        else:
            vals = [str(e[c]) if e["row"] in ("base", "big") or e[c] != base[c] else "" for c in cols]
        p = e["paper"]
        paper = [f"{p['dev_ppl']:g}", f"{p['dev_bleu']:g}", "" if p["params_M"] is None else f"{p['params_M']:g}"]
        lines.append(f"| {first} | " + " | ".join(vals) + f" | {e.get('updates', '-')} | {cell(e, 'dev_ppl')} | "
                     f"{cell(e, 'dev_bleu')} | {e.get('params_M', '-')} | " + " | ".join(paper) + " |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    from attnmt.plots import new_figure, save_png

    done = [e for e in table if "dev_bleu" in e]
    fig = new_figure(max(6.0, 0.45 * len(done) + 2), 3.6)
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(done))
    ax.bar(xs, [e["dev_bleu"] for e in done], yerr=[e.get("dev_bleu_sd") or 0 for e in done], color="#4878a8")
    base = next((e["dev_bleu"] for e in done if e["row"] == "base"), None)
    if base is not None:
        ax.axhline(base, color="#444444", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(xs), [e["row"] for e in done], rotation=60, fontsize=8)
    ax.set_ylabel("dev BLEU (beam 4, lenpen 0.6)")
    ax.set_title("Table 3 rows at this scale (dashed: base)")
    save_png(fig, path)


def main() -> None:
    if sys.argv[1:2] == ["--score"]:
        return score(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-bin", type=Path, required=True)
    p.add_argument("--valid-source", type=Path, required=True, help="dev source text (raw; .gz read as such)")
    p.add_argument("--valid-reference", type=Path, required=True, help="dev reference text (detokenized)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="A,B,C,D,E")
    p.add_argument("--base", choices=sorted(BASES), default="multi30k")
    p.add_argument("--updates", type=int, default=0, help="updates of every row (0: from --budget-hours)")
    p.add_argument("--budget-hours", type=float, default=0.0, help="pick --updates so the whole table fits")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; every row is trained with each")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--parallel", type=int, default=1, help="trials side by side")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads in all")
    p.add_argument("--precision", default="auto")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3, help="the base's peak learning rate")
    p.add_argument("--smoke", action="store_true", help="every row for --updates updates, dev cut to a few lines")
    p.add_argument("--smoke-sentences", type=int, default=8)
    p.add_argument("--attnmt", default="attnmt", help="how to run attnmt (e.g. 'python -m attnmt.cli')")
    if sys.argv[1:2] == ["--check-rows"]:  # the recipe's check of ROWS, before it fetches any data
        select(rows_of(BASES["paper"]), sys.argv[2])
        return None
    args = p.parse_args()
    args.attnmt = shlex.split(args.attnmt)
    base = BASES[args.base]
    rows = rows_of(base)
    names = select(rows, args.rows)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"table3: --seeds {args.seeds!r}: give whole numbers separated by commas, such as 1,2") \
            from None
    if not seeds or args.parallel < 1 or args.threads < 1:
        raise SystemExit("table3: give at least one seed, --parallel 1 or more and --threads 1 or more")
    if (args.updates > 0) == (args.budget_hours > 0):
        raise SystemExit("table3: give either --updates or --budget-hours")
    for path in (args.valid_source, args.valid_reference, args.data_bin):
        if not path.exists():
            raise SystemExit(f"table3: {path}: not found")
    args.out.mkdir(parents=True, exist_ok=True)
    threads = max(1, args.threads // args.parallel) if args.device == "cpu" else 1
    vocab = sum(1 for _ in open(args.data_bin / next(f for f in os.listdir(args.data_bin)
                                                     if f.startswith("dict.")), encoding="utf-8")) + 4
    updates = args.updates
    if not updates:
        seconds = probe_seconds_per_update(args, base, threads)
        cost = sum(rows[n][1].macs_per_token(vocab) for n in names) / base.macs_per_token(vocab) * len(seeds)
        # 75% of the budget trains; the rest scores dev (beam 4 over it, once per trial) and starts processes
        updates = max(10, int(0.75 * args.budget_hours * 3600 * args.parallel / (cost * seconds)))
        print(f"table3: the base takes {seconds:.3f} s an update here; {len(names)} rows x {len(seeds)} seed(s) "
              f"cost {cost:.1f} base trainings -> {updates} updates each in {args.budget_hours:g} h", flush=True)
    jobs = [(n, s) for n in names for s in seeds]
    print(f"table3: {len(jobs)} trials of {updates} updates ({args.base} base: {' '.join(base.train_options())})",
          flush=True)
    t0 = time.time()
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda j: trial(args, j[0], rows[j[0]][0], rows[j[0]][1], j[1], updates,
                                                base.d_model, threads), jobs))
    table = summarize(results, names, rows)
    base_entry = {"N": base.layers, "d_model": base.d_model, "d_ff": base.d_ff, "h": base.heads, "d_k": base.d_k,
                  "d_v": base.d_v, "P_drop": base.dropout, "eps_ls": base.label_smoothing}
    text = markdown(table, base_entry)
    (args.out / "table3.md").write_text(text, encoding="utf-8")
    (args.out / "table3.json").write_text(json.dumps({"base": args.base, "updates": updates, "seeds": seeds,
                                                      "device": args.device, "minutes": round((time.time() - t0) / 60,
                                                                                              1),
                                                      "rows": table}, indent=1), encoding="utf-8")
    try:
        plot(table, args.out / "table3_bleu.png")
    except Exception as e:  # the table stands without its plot (matplotlib missing)
        print(f"table3: no plot: {e}", file=sys.stderr)
    print("\n" + text)
    failed = [e["row"] for e in table if e.get("errors")]
    if failed:
        raise SystemExit(f"table3: {len(failed)} row(s) failed: {', '.join(failed)} (their logs: {args.out}/ROW.seedN/log.txt)")


if __name__ == "__main__":
    main()
