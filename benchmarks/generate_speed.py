"""Translation speed, memory and BLEU of one checkpoint in fp32, bf16 and int8 (and, optionally, CTranslate2 int8).

Each mode runs in its own subprocess, so that its peak resident memory is its own. In each, the model is loaded,
warmed up on a few sentences, then the whole test set is translated ``--repeats`` times; the best time counts.
Timed: batching + search (encoder, incremental decoder, beam bookkeeping); not timed: loading, subword encoding
and detokenization. BLEU is sacreBLEU (13a, cased) of the detokenized output against the reference.

    python benchmarks/generate_speed.py --path checkpoints/checkpoint_best.pt \\
        --src /work/shared/data/multi30k/test_2016_flickr.en.gz --ref /work/shared/data/multi30k/test_2016_flickr.de.gz

    python benchmarks/generate_speed.py --path model.pt --data-bin data-bin/multi30k --gen-subset test \\
        --ct2-model ct2-model --ct2-python /tmp/peer-venv/bin/python

``--ct2-model`` is a CTranslate2 model directory (``benchmarks/export_ct2.py`` writes one from our checkpoint);
``--ct2-python`` a Python that has ``ctranslate2`` (``/work/shared/peers/install_fairseq.sh VENV`` installs it).
CTranslate2 gets the same subword pieces and beam size; its length penalty divides by ``length ** alpha``
(ours by the GNMT ``((5 + length) / 6) ** alpha``), so BLEU can differ slightly for that reason alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODES = ("fp32", "bf16", "int8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="checkpoint (or directory holding model.pt)")
    p.add_argument("--data-bin", help="binarized data directory (attnmt preprocess)")
    p.add_argument("--gen-subset", default="test", help="split of --data-bin")
    p.add_argument("--src", help="raw source file (one sentence per line, .gz allowed)")
    p.add_argument("--ref", help="raw reference file; default with --data-bin: the detokenized binarized target")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of fp32,bf16,int8")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0, help="torch / CTranslate2 threads (0: default)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode; the best counts")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (smoke runs)")
    p.add_argument("--ct2-model", help="CTranslate2 model directory to compare with (int8)")
    p.add_argument("--ct2-python", help="a Python interpreter with ctranslate2 installed")
    p.add_argument("--json", help="also write all results to this JSON file")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


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


# ------------------------------------------------------------------------------------------------ one mode


def worker(args) -> dict:
    """Runs in the subprocess of one mode; returns its measurements."""
    import torch

    from attnmt.generation.generator import GenerationConfig
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_generator

    mode = args.worker
    search_cfg = SearchConfig(beam=args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a, max_len_b=args.max_len_b)
    gen_cfg = GenerationConfig(max_tokens=args.max_tokens, device="cpu", bf16=mode == "bf16",
                               quantize="int8" if mode == "int8" else "none", threads=args.threads)
    t0 = time.perf_counter()
    bundle, generator = load_generator(args.path, search_cfg, gen_cfg)
    load_s = time.perf_counter() - t0
    sources, refs = load_data(args, bundle)
    list(generator.generate(sources[:16], args.max_tokens))  # warm-up: kernels, allocator, caches
    times, results = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        results = list(generator.generate(sources, args.max_tokens))
        times.append(time.perf_counter() - t)
    best = min(times)
    tokens = sum(len(h[0].tokens) for _, h in results if h)
    hyps = [bundle.detokenize(bundle.target_pieces(h[0].tokens)) if h else "" for _, h in results]
    return {"mode": mode, "sentences": len(sources), "target_tokens": tokens, "best_s": round(best, 3),
            "times_s": [round(t, 3) for t in times], "sentences_per_s": round(len(sources) / best, 2),
            "tokens_per_s": round(tokens / best, 1), "peak_rss_mb": round(peak_rss_mb(), 1), "load_s": round(load_s, 2),
            "bleu": bleu(hyps, refs), "threads": torch.get_num_threads()}


def run_mode(mode: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--worker", mode],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": mode, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ CTranslate2

CT2_SCRIPT = r"""
import json, resource, sys, time
import ctranslate2
cfg = json.load(open(sys.argv[1]))
tr = ctranslate2.Translator(cfg["model"], device="cpu", compute_type="int8", intra_threads=cfg["threads"])
opts = dict(beam_size=cfg["beam"], length_penalty=cfg["lenpen"], max_batch_size=cfg["max_tokens"],
            batch_type="tokens", max_decoding_length=cfg["max_len"])
tr.translate_batch(cfg["pieces"][:16], **opts)
times = []
for _ in range(cfg["repeats"]):
    t = time.perf_counter()
    out = tr.translate_batch(cfg["pieces"], **opts)
    times.append(time.perf_counter() - t)
print(json.dumps({"hyps": [r.hypotheses[0] for r in out], "times_s": times,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
"""


def run_ct2(args) -> dict:
    """CTranslate2 int8 on the same pieces, in the interpreter ``--ct2-python``."""
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(args.path)
    sources, refs = load_data(args, bundle)
    pieces = [bundle.source_pieces(s).split() for s in sources]  # CTranslate2 appends the EOS itself
    longest = max(len(p) for p in pieces)
    cfg = {"model": args.ct2_model, "threads": args.threads, "beam": args.beam, "lenpen": args.lenpen,
           "max_tokens": args.max_tokens, "repeats": args.repeats, "pieces": pieces,
           "max_len": int(args.max_len_a * longest + args.max_len_b)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        proc = subprocess.run([args.ct2_python, "-c", CT2_SCRIPT, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        return {"mode": "ct2-int8", "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    best = min(r["times_s"])
    hyps = [bundle.detokenize(" ".join(t for t in h if t != "</s>")) for h in r["hyps"]]
    tokens = sum(len(h) + 1 for h in r["hyps"])  # + EOS, counted as ours are
    return {"mode": "ct2-int8", "sentences": len(sources), "target_tokens": tokens, "best_s": round(best, 3),
            "times_s": [round(t, 3) for t in r["times_s"]], "sentences_per_s": round(len(sources) / best, 2),
            "tokens_per_s": round(tokens / best, 1), "peak_rss_mb": round(r["peak_rss_mb"], 1),
            "bleu": bleu(hyps, refs)}


# ------------------------------------------------------------------------------------------------ main


def print_table(results: list[dict]) -> None:
    base = next((r for r in results if r.get("mode") == "fp32" and "error" not in r), None)
    print(f"{'mode':10} {'sent/s':>9} {'tok/s':>9} {'best s':>8} {'peak RSS MB':>12} {'BLEU':>6} {'vs fp32':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:10} failed: {r['error']}")
            continue
        ratio = f"{r['sentences_per_s'] / base['sentences_per_s']:.2f}x" if base else "-"
        b = "-" if r.get("bleu") is None else f"{r['bleu']:.2f}"
        print(f"{r['mode']:10} {r['sentences_per_s']:9.2f} {r['tokens_per_s']:9.1f} {r['best_s']:8.2f} "
              f"{r['peak_rss_mb']:12.1f} {b:>6} {ratio:>8}")
    ours = next((r for r in results if r.get("mode") == "int8" and "error" not in r), None)
    ct2 = next((r for r in results if r.get("mode") == "ct2-int8" and "error" not in r), None)
    if ours and ct2:
        print(f"CTranslate2 int8 / attnmt int8 speed: {ct2['sentences_per_s'] / ours['sentences_per_s']:.2f}x")


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
    results = []
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        results.append(run_mode(mode, argv))
    if args.ct2_model:
        print("running CTranslate2 int8 ...", file=sys.stderr, flush=True)
        results.append(run_ct2(args))
    print_table(results)
    if args.json:
        from attnmt.fileio import atomic_open

        with atomic_open(args.json) as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
