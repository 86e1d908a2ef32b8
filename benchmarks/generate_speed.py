"""Translation speed, peak memory and BLEU of one checkpoint: attnmt in fp32, bf16 and int8, against CTranslate2
(int8 and float32) and, optionally, fairseq-generate, on the same model and sentences.

    python benchmarks/generate_speed.py --path checkpoints/checkpoint_best.pt --data-bin data-bin/multi30k_en_de \\
        --ref /work/shared/data/multi30k/test_2016_flickr.de.gz \\
        --ct2-python /work/fairseq-venv/bin/python --ct2-model /tmp/ct2-multi30k \\
        --fairseq-venv /work/fairseq-venv

Every engine runs in its own process (so that its peak resident memory is its own) with the same thread count
(``--threads``, default: every core), is warmed up on a few sentences, then translates the whole set
``--repeats`` times; the best time counts. Timed: batching and search (encoder, incremental decoder, beam
bookkeeping); not timed: loading, subword encoding, detokenization. Target tokens are those of the best
hypothesis, EOS included, as each engine produced them. BLEU is sacreBLEU (13a, cased) of the detokenized output
against ``--ref`` (default with ``--data-bin``: the binarized target split, decoded back to text).
attnmt runs once per ``--workers`` count (decoding processes sharing the threads, as CTranslate2's translators
do); with workers, the memory reported is the sum of the processes' proportional set sizes after the timed runs
(pages they share, the weights and libraries, counted once; glibc keeps freed memory, so this is close to the
peak), where a single process reports its peak resident size.

What is the same for every engine: the subword pieces of each source sentence, beam size, the length limit
(``a * source length + b``; CTranslate2 and fairseq apply it per batch, attnmt per sentence) and the source
tokens per batch (``--max-tokens``). What differs by design:

* the length penalty: attnmt divides by GNMT's ``((5 + length) / 6) ** alpha``, CTranslate2 and fairseq by
  ``length ** alpha`` (the same ``--lenpen`` number for all), so BLEU can differ a little for that alone;
* when a sentence stops: attnmt's default stops once no live hypothesis can still beat its n-best list (exact:
  the search returns what an unbounded search would), CTranslate2 and fairseq once ``beam`` hypotheses have
  finished, which takes fewer decoder steps. attnmt runs with both rules (``--early-stop exact,beam``), so the
  comparison can be made on equal terms;
* fairseq-generate loads its data itself; its own timer (which this script reads) covers the same work.

``--ct2-model DIR``: a CTranslate2 model directory; when DIR does not exist it is exported from ``--path``
(float32 weights, ``attnmt.interop.ctranslate2`` run with ``--ct2-python``); int8 quantizes at load time.
``--fairseq-venv VENV``: a virtualenv with fairseq 0.12.2; the checkpoint is converted with
``attnmt.interop.fairseq`` and the sentences binarized with the checkpoint's own dictionary.
The last line is the ratio of attnmt's best target tokens/s to CTranslate2 int8's. The machine must be otherwise
idle for meaningful numbers; timings of such short runs still vary by up to 20% from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# run in another toolkit's Python (which has no attnmt installed): attnmt's exporter, imported from this checkout
EXPORT = ("import sys; sys.path.insert(0, sys.argv[1]); from attnmt import checkpoint; "
          "from attnmt.interop.{module} import {function}; {function}(checkpoint.load(checkpoint.resolve(sys.argv[2])), "
          "sys.argv[3])")
# each mode's --precision and --quantize; int8: activations as --precision auto picks them, int8-fp32: fp32 ones
MODE_SETTINGS = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "int8": ("auto", "int8"), "int8-fp32": ("fp32", "int8")}
MODES = tuple(MODE_SETTINGS)
CT2_TYPES = {"int8": "int8", "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "int8_bf16": "int8_bfloat16"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="checkpoint (or directory holding model.pt)")
    p.add_argument("--data-bin", help="binarized data directory (attnmt preprocess)")
    p.add_argument("--gen-subset", default="test", help="split of --data-bin")
    p.add_argument("--src", help="raw source file (one sentence per line, .gz allowed) instead of --data-bin")
    p.add_argument("--ref", help="raw reference file; default with --data-bin: the detokenized binarized target")
    p.add_argument("--modes", default="fp32,bf16,int8",
                   help="attnmt modes, a comma-separated subset of fp32,bf16,int8,int8-fp32 (int8: int8 linear "
                   "layers with the activations in the precision --precision auto picks, bf16 on a CPU with native "
                   "bf16; int8-fp32: with fp32 activations on any CPU)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=8192,
                   help="source tokens per batch, for every engine (default: attnmt's on the CPU)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every engine")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the best counts")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (smoke runs)")
    p.add_argument("--ct2-python", help="a Python interpreter with ctranslate2 (and torch, to export the model)")
    p.add_argument("--ct2-model", help="CTranslate2 model directory (exported from --path when missing)")
    p.add_argument("--ct2-compute-types", default="int8,float32", help="CTranslate2 compute types to run")
    p.add_argument("--fairseq-venv", help="virtualenv with fairseq 0.12.2 (fairseq-generate) to compare with")
    p.add_argument("--json", help="also write all results to this JSON file")
    p.add_argument("--shortlist", help="a vocabulary shortlist (attnmt build-shortlist): every attnmt mode and "
                   "CTranslate2 also run with it (CTranslate2: as the model's vmap.txt, use_vmap=True)")
    p.add_argument("--early-stop", default="exact,beam",
                   help="attnmt stopping rules to run, a comma-separated subset of exact,beam (see --early-stop of "
                        "attnmt generate); beam is the rule CTranslate2 and fairseq use")
    p.add_argument("--workers", default="1,2",
                   help="attnmt decoding processes to run with, a comma-separated list (see --workers of attnmt "
                        "generate; the --threads are split between them)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--worker-early-stop", choices=("exact", "beam"), default="exact", help=argparse.SUPPRESS)
    p.add_argument("--worker-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker-shortlist", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def pss_mb(pid: int) -> float:
    """A process's proportional set size (shared pages divided among the processes sharing them), Linux."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024.0


def summary(name: str, sentences: int, tokens: int, times: list[float], rss: float, hyps: list[str], refs,
            **extra) -> dict:
    best = min(times)
    return {"mode": name, "sentences": sentences, "target_tokens": tokens, "best_s": round(best, 3),
            "times_s": [round(t, 3) for t in times], "sentences_per_s": round(sentences / best, 2),
            "tokens_per_s": round(tokens / best, 1), "peak_rss_mb": round(rss, 1), "bleu": bleu(hyps, refs), **extra}


# ------------------------------------------------------------------------------------------------ data


def load_data(args, bundle) -> tuple[list[list[int]], list[str] | None]:
    """Source id lists and reference texts (or None)."""
    from attnmt.scoring import read_lines

    refs = read_lines(args.ref, "reference") if args.ref else None
    if args.data_bin:
        from attnmt.data.indexed import IndexedDataset
        from attnmt.inference import check_data_dir

        check_data_dir(bundle, args.data_bin)
        prefix = f"{args.data_bin}/{args.gen_subset}.{bundle.source_lang}-{bundle.target_lang}"
        src_ds = IndexedDataset(f"{prefix}.{bundle.source_lang}")
        sources = [src_ds[i].tolist() for i in range(len(src_ds))]
        if refs is None:
            tgt_ds = IndexedDataset(f"{prefix}.{bundle.target_lang}")
            refs = [bundle.detokenize(bundle.tgt_dict.string(tgt_ds[i])) for i in range(len(tgt_ds))]
    elif args.src:
        sources = bundle.encode_sources(read_lines(args.src, "source"))
    else:
        sys.exit("give --data-bin DIR or --src FILE")
    if args.limit:
        sources = sources[: args.limit]
        refs = refs[: args.limit] if refs is not None else None
    if refs is not None and len(refs) != len(sources):
        sys.exit(f"{len(sources)} sources but {len(refs)} references")
    return sources, refs


def bleu(hyps: list[str], refs: list[str] | None) -> float | None:
    if refs is None:
        return None
    from attnmt.scoring import corpus_bleu

    return round(corpus_bleu(hyps, refs).score, 2)


# ------------------------------------------------------------------------------------------------ attnmt


def worker(args) -> dict:
    """Runs in the subprocess of one attnmt mode; returns its measurements."""
    import torch

    from attnmt.backends import configure_process
    from attnmt.generation.beam import BeamSearchConfig
    from attnmt.generation.generator import GenerationConfig
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_generator

    configure_process("generate", "cpu")  # as attnmt generate does
    mode = args.worker
    search_cfg = SearchConfig(beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                              options=BeamSearchConfig(early_stop=args.worker_early_stop))
    precision, quantize = MODE_SETTINGS[mode]
    gen_cfg = GenerationConfig(max_tokens=args.max_tokens, device="cpu", precision=precision,
                               quantize=quantize, threads=args.threads,
                               workers=args.worker_processes,
                               shortlist=args.shortlist if args.worker_shortlist else None)
    t0 = time.perf_counter()
    bundle, generator = load_generator(args.path, search_cfg, gen_cfg)
    load_s = time.perf_counter() - t0
    sources, refs = load_data(args, bundle)
    n = len(generator.pool) if generator.pool is not None else 1
    list(generator.generate(sources[:16 * n], args.max_tokens, 16))  # warm-up (each worker): kernels, allocator
    times, results = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        results = list(generator.generate(sources, args.max_tokens))
        times.append(time.perf_counter() - t)
    tokens = sum(len(h[0].tokens) for _, h in results if h)
    hyps = [bundle.detokenize(bundle.target_pieces(h[0].tokens)) if h else "" for _, h in results]
    rss, config = peak_rss_mb(), f"early stop: {args.worker_early_stop}"
    if args.worker_shortlist:
        mode, config = f"{mode}+sl", config + ", shortlist"
    threads = torch.get_num_threads()
    if generator.pool is not None:  # see pss_mb
        rss = sum(pss_mb(pid) for pid in [os.getpid(), *(p.pid for p in generator.pool.procs)])
        threads = generator.pool.threads
        config += f", {len(generator.pool)} workers x {threads} thread(s)"
    generator.close()
    return summary(mode, len(sources), tokens, times, rss, hyps, refs, load_s=round(load_s, 2), threads=threads,
                   config=config)


def run_mode(mode: str, early_stop: str, workers: int, argv: list[str], shortlist: bool = False) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--worker", mode,
                           "--worker-early-stop", early_stop, "--worker-processes", str(workers),
                           *(["--worker-shortlist"] if shortlist else [])],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": mode + ("+sl" if shortlist else ""), "config": f"early stop: {early_stop}, {workers} workers",
                "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ CTranslate2

CT2_SCRIPT = r"""
import json, resource, sys, time
import ctranslate2
cfg = json.load(open(sys.argv[1]))
runs = []
for intra, inter, batch_type, batch_size in cfg["configs"]:
    tr = ctranslate2.Translator(cfg["model"], device="cpu", compute_type=cfg["compute_type"], intra_threads=intra,
                                inter_threads=inter)
    opts = dict(beam_size=cfg["beam"], length_penalty=cfg["lenpen"], max_batch_size=batch_size,
                batch_type=batch_type, max_decoding_length=cfg["max_len"], use_vmap=cfg["vmap"])
    tr.translate_batch(cfg["pieces"][:16], **opts)
    times = []
    for _ in range(cfg["repeats"]):
        t = time.perf_counter()
        out = tr.translate_batch(cfg["pieces"], **opts)
        times.append(time.perf_counter() - t)
    runs.append({"config": [intra, inter, batch_type, batch_size], "times_s": times,
                 "hyps": [r.hypotheses[0] for r in out]})
    del tr
print(json.dumps({"runs": runs, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
"""


def ct2_export(args) -> str | None:
    """The CTranslate2 model directory, exported from the checkpoint when it does not exist; None on failure."""
    if os.path.isdir(args.ct2_model):
        return None
    print(f"exporting {args.path} to CTranslate2 ({args.ct2_model}) ...", file=sys.stderr, flush=True)
    code = EXPORT.format(module="ctranslate2", function="export_model")
    proc = subprocess.run([args.ct2_python, "-c", code, str(HERE.parent), args.path, args.ct2_model],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return "export failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


def ct2_configs(args) -> list[list]:
    """CTranslate2 settings to try, (intra_threads, inter_threads, batch_type, max_batch_size); the best counts.

    With several threads CTranslate2 can split each product (intra) or translate batches in parallel, one
    translator per thread (inter); on two cores the second was up to twice as fast. Its batches are cut by source
    tokens (``--max-tokens``, as attnmt's) or by sentences (64, where small batches ran faster).
    """
    layouts = [(args.threads, 1)] + ([(1, args.threads)] if args.threads > 1 else [])
    return [[intra, inter, bt, size] for intra, inter in layouts
            for bt, size in (("tokens", args.max_tokens), ("examples", 64))]


def run_ct2(args, bundle, sources, refs, compute_type: str, vmap: bool = False) -> dict:
    """CTranslate2 on the same pieces, in the interpreter ``--ct2-python``: the best of ``ct2_configs``;
    ``vmap``: with the model's vocabulary map (``use_vmap``)."""
    name = f"ct2-{compute_type}" + ("+vmap" if vmap else "")
    pieces = [bundle.source_pieces(s).split() for s in sources]  # without EOS: CTranslate2 appends it
    longest = max(len(s) for s in sources)  # with EOS, as attnmt counts the source length
    cfg = {"model": args.ct2_model, "compute_type": CT2_TYPES.get(compute_type, compute_type),
           "configs": ct2_configs(args), "beam": args.beam, "lenpen": args.lenpen, "repeats": args.repeats,
           "pieces": pieces, "max_len": int(args.max_len_a * longest + args.max_len_b), "vmap": vmap}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        proc = subprocess.run([args.ct2_python, "-c", CT2_SCRIPT, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return {"mode": name, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    results = []
    for run in r["runs"]:
        hyps = [bundle.detokenize(" ".join(t for t in h if t != "</s>")) for h in run["hyps"]]
        tokens = sum(len(h) + 1 for h in run["hyps"])  # + EOS, counted as attnmt counts it
        intra, inter, bt, size = run["config"]
        results.append(summary(name, len(sources), tokens, run["times_s"], r["peak_rss_mb"], hyps, refs,
                               threads=args.threads, config=f"intra {intra} inter {inter}, {size} {bt}"))
    best = max(results, key=lambda x: x["tokens_per_s"])
    best["all_configs"] = [{k: x[k] for k in ("config", "tokens_per_s", "best_s")} for x in results]
    return best


# ------------------------------------------------------------------------------------------------ fairseq

_FAIRSEQ_SUMMARY = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s")
FAIRSEQ_SCRIPT = r"""
import resource, sys
from fairseq_cli.generate import cli_main
sys.argv = ["fairseq-generate"] + sys.argv[1:]
try:
    cli_main()
finally:
    print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def run_fairseq(args, bundle, sources, refs, work: Path) -> dict:
    """fairseq-generate on the converted checkpoint and the same pieces, binarized with the same dictionary."""
    venv = Path(args.fairseq_venv)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # fairseq 0.12 checkpoints hold an argparse.Namespace

    def fail(what: str, proc) -> dict:
        return {"mode": "fairseq", "error": f"{what} failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]}

    model_dir = work / "model"
    code = EXPORT.format(module="fairseq", function="export_checkpoint")
    proc = subprocess.run([py, "-c", code, str(HERE.parent), args.path, str(model_dir)], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        return fail("the fairseq export", proc)
    src, tgt = bundle.source_lang, bundle.target_lang
    text = "".join(bundle.source_pieces(s) + "\n" for s in sources)
    for lang in (src, tgt):  # fairseq-preprocess wants a target side; it is not used to translate
        (work / f"test.{lang}").write_text(text, encoding="utf-8")
    data = work / "bin"
    proc = subprocess.run([str(venv / "bin" / "fairseq-preprocess"), "-s", src, "-t", tgt, "--testpref",
                           str(work / "test"), "--destdir", str(data), "--srcdict", str(model_dir / "dict.txt"),
                           "--joined-dictionary", "--workers", "1"], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return fail("fairseq-preprocess", proc)
    cmd = [py, "-c", FAIRSEQ_SCRIPT, str(data), "--path", str(model_dir / "checkpoint.pt"), "--gen-subset", "test",
           "-s", src, "-t", tgt, "--beam", str(args.beam), "--lenpen", str(args.lenpen), "--max-len-a",
           str(args.max_len_a), "--max-len-b", str(args.max_len_b), "--max-tokens", str(args.max_tokens), "--cpu"]
    times, peak, tokens, lines = [], 0.0, 0, []
    for _ in range(args.repeats):  # each run loads the model anew; fairseq's timer covers the translation only
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        m = _FAIRSEQ_SUMMARY.search(proc.stderr + proc.stdout)
        if proc.returncode != 0 or not m:
            return fail("fairseq-generate", proc)
        times.append(float(m.group(3)))
        tokens = int(m.group(2).replace(",", ""))  # the hypotheses' tokens, EOS included
        rss = re.search(r"PEAK_RSS_KB (\d+)", proc.stderr)
        peak = max(peak, int(rss.group(1)) / 1024.0 if rss else 0.0)
        lines = proc.stdout.splitlines()
    best: dict[int, str] = {}
    for line in lines:  # H-<id> <score> <pieces>, best hypothesis first
        if line.startswith("H-"):
            idx, _score, pieces = line[2:].split("\t", 2)
            best.setdefault(int(idx), pieces)
    hyps = [bundle.detokenize(best.get(i, "")) for i in range(len(sources))]
    return summary("fairseq", len(sources), tokens, times, peak, hyps, refs, threads=args.threads)


# ------------------------------------------------------------------------------------------------ main


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r.get("mode") == "fp32" and "error" not in r), None)
    print(f"{'engine':12} {'sent/s':>9} {'tok/s':>9} {'best s':>8} {'tokens':>7} {'peak RSS MB':>12} {'BLEU':>6} "
          f"{'vs fp32':>8}  settings")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:12} failed: {r['error']}  {r.get('config', '')}")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        b = "-" if r.get("bleu") is None else f"{r['bleu']:.2f}"
        print(f"{r['mode']:12} {r['sentences_per_s']:9.2f} {r['tokens_per_s']:9.1f} {r['best_s']:8.2f} "
              f"{r['target_tokens']:7d} {r['peak_rss_mb']:12.1f} {b:>6} {ratio:>8}  {r.get('config', '')}")
    for tail, theirs in (("", "ct2-int8"), ("+sl", "ct2-int8+vmap")):
        ours = [r for r in results if r.get("mode") in {m + tail for m in MODES} and "error" not in r]
        ct2 = next((r for r in results if r.get("mode") == theirs and "error" not in r), None)
        if ours and ct2:
            best = max(ours, key=lambda r: r["tokens_per_s"])
            print(f"attnmt best ({best['mode']}, {best['config']}) / CTranslate2 {theirs[4:]}, target tokens/s: "
                  f"{best['tokens_per_s'] / ct2['tokens_per_s']:.2f}x")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if bool(args.ct2_model) != bool(args.ct2_python):
        sys.exit("--ct2-model and --ct2-python go together")
    stops = [m.strip() for m in args.early_stop.split(",") if m.strip()]
    if not stops or any(m not in ("exact", "beam") for m in stops):
        sys.exit(f"--early-stop takes exact, beam or both, got {args.early_stop!r}")
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        workers = []
    if not workers or min(workers) < 1:
        sys.exit(f"--workers takes positive numbers, got {args.workers!r}")
    results = []
    for n in workers:
        for stop in stops:
            for mode in modes:
                for short in [False, True] if args.shortlist else [False]:
                    print(f"running attnmt {mode} (early stop: {stop}, {n} workers{', shortlist' if short else ''}) "
                          f"...", file=sys.stderr, flush=True)
                    results.append(run_mode(mode, stop, n, argv, short))
    if args.ct2_model or args.fairseq_venv:
        from attnmt.inference import load_for_inference

        bundle = load_for_inference(args.path)
        sources, refs = load_data(args, bundle)
        if args.ct2_model:
            failed = ct2_export(args)
            if args.shortlist and not failed:  # the same map, as CTranslate2 reads it
                import shutil

                shutil.copyfile(args.shortlist, os.path.join(args.ct2_model, "vmap.txt"))
            for ct in [c.strip() for c in args.ct2_compute_types.split(",") if c.strip()]:
                if failed:
                    results.append({"mode": f"ct2-{ct}", "error": failed})
                    continue
                for vmap in [False, True] if args.shortlist else [False]:
                    print(f"running CTranslate2 {ct}{' with the vmap' if vmap else ''} ...", file=sys.stderr,
                          flush=True)
                    results.append(run_ct2(args, bundle, sources, refs, ct, vmap))
        if args.fairseq_venv:
            print("running fairseq-generate ...", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory(prefix="attnmt-fairseq-") as work:
                results.append(run_fairseq(args, bundle, sources, refs, Path(work)))
    print_table(results)
    if args.json:
        from attnmt.fileio import atomic_open

        with atomic_open(args.json) as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
