"""Translation speed on a GPU: sentences/s, target tokens/s, peak GPU memory, BLEU and the hypothesis/reference
length ratio, per precision (fp32, bf16, fp16) and batch size (source tokens per batch).

    python benchmarks/generate_gpu.py --path runs/multi30k_en_de/checkpoints/averaged.pt \\
        --data-bin runs/multi30k_en_de/data-bin --precisions fp32,bf16,fp16 --max-tokens 4096,16000,32000

Use a trained model (its translations must stop where a real model's do: an untrained one runs every hypothesis
to the length limit). The numbers are those of ``attnmt generate``: the model loaded and prepared by the device's
backend (cast once to the precision), beam search with the backend's decoding kernels, batches of length-sorted
sentences; each setting is warmed up on a few batches, then the whole set is translated ``--repeats`` times, each
timed to the GPU's completion; the best time counts. ``--kernels cpu`` runs the search with the CPU backend's
kernels (blockwise top-k over bf16 bit patterns, bf16 scores): what the GPU ran before its backend chose its own.
One JSON line per setting with ``--json`` (``--hypotheses``: with the translations, to compare two runs).
``--profile`` prints the GPU-busy share and the kernel-time table of one more pass (``gpu_profile.py``);
``--as-before`` scores 256 decoder rows at a time, as the search did on a GPU before. ``--device cpu`` runs it on
the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_speed import load_data  # noqa: E402  (the same sentences and references as the CPU benchmark)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, precision: str, max_tokens: int, graphs: str = "on") -> dict:
    from attnmt.backends.base import DecodingKernels
    from attnmt.generation.beam import BeamSearchConfig
    from attnmt.generation.generator import GenerationConfig
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_generator
    from attnmt.scoring import corpus_bleu

    device = torch.device(args.device)
    search_cfg = SearchConfig(beam=args.beam, lenpen=args.lenpen, options=BeamSearchConfig(early_stop=args.early_stop))
    gen_cfg = GenerationConfig(max_tokens=max_tokens, device=args.device, precision=precision)
    bundle, generator = load_generator(args.path, search_cfg, gen_cfg)
    if args.kernels == "cpu":  # the search as the CPU backend runs it, on this device
        cpu_kernels = DecodingKernels(row_bucket=None, blockwise_topk=True, low_precision_scores=True)
        generator.backend.decoding_kernels = lambda: cpu_kernels
    from attnmt.backends.cuda import CudaGraphSteps

    chosen = replace(generator.backend.decoding_kernels(),  # on: the beam steps as CUDA graphs
                     step_graphs=(lambda: CudaGraphSteps(device)) if graphs == "on" else None)
    generator.backend.decoding_kernels = lambda: chosen
    if args.as_before:  # the device's kernels, scoring 256 rows at a time as before
        before = replace(generator.backend.decoding_kernels(), score_rows=256)
        generator.backend.decoding_kernels = lambda: before
    if max_tokens == 0:
        max_tokens = generator.backend.decoding_max_tokens()
    sources, refs = load_data(args, bundle)
    if refs is None:
        sys.exit("give --ref with --src (BLEU and the length ratio need references)")
    list(generator.generate(sources[: args.warmup], max_tokens))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best, results = float("inf"), []
    for _ in range(args.repeats):
        sync(device)
        t = time.perf_counter()
        results = list(generator.generate(sources, max_tokens))
        sync(device)
        best = min(best, time.perf_counter() - t)
    profile = None
    if args.profile:
        from gpu_profile import profile_table

        try:
            profile = profile_table(lambda: list(generator.generate(sources, max_tokens)), device)
        except Exception as e:  # the profile is extra: the run's figures stand without it
            profile = f"profile failed: {type(e).__name__}: {e}"
    hyps = [bundle.detokenize(bundle.target_pieces(h[0].tokens)) if h else "" for _, h in results]
    tokens = sum(len(h[0].tokens) for _, h in results if h)
    score = corpus_bleu(hyps, refs)
    return {"precision": precision, "max_tokens": max_tokens, "kernels": args.kernels, "device": str(device),
            "graphs": graphs,
            "sentences": len(sources), "sentences_per_s": len(sources) / best, "tokens_per_s": tokens / best,
            "best_s": best, "bleu": round(score.score, 2), "length_ratio": round(score.sys_len / score.ref_len, 4),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "as_before": args.as_before, "profile": profile, "hypotheses": hyps if args.hypotheses else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, help="a trained checkpoint")
    ap.add_argument("--data-bin", help="binarized data (attnmt preprocess) holding --gen-subset")
    ap.add_argument("--gen-subset", default="test")
    ap.add_argument("--src", help="raw source sentences instead of --data-bin (with --ref)")
    ap.add_argument("--ref", help="raw references for --src")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--max-tokens", default="4096,16000,32000",
                    help="source tokens per batch, comma-separated (0: the backend's default)")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--lenpen", type=float, default=0.6)
    ap.add_argument("--early-stop", choices=("exact", "beam"), default="exact")
    ap.add_argument("--kernels", choices=("device", "cpu"), default="device",
                    help="device: the backend's decoding kernels; cpu: the CPU backend's, on this device")
    ap.add_argument("--graphs", default="off", help="on: beam steps replayed as CUDA graphs (ATTNMT_CUDA_GRAPHS=1); "
                                                      "off: the slot cache's steps; comma-separated for both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=200, help="sentences translated first, untimed")
    ap.add_argument("--limit", type=int, default=0, help="only the first N sentences")
    ap.add_argument("--as-before", action="store_true", help="score 256 decoder rows at a time, as before the "
                                                               "CUDA backend scored a whole batch at once")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more pass per setting: GPU-busy share and the kernel-time table")
    ap.add_argument("--hypotheses", action="store_true", help="put the translations in the JSON lines")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per setting")
    args = ap.parse_args(argv)

    from attnmt.backends import configure_process

    configure_process("generate", args.device)
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"{name}, torch {torch.__version__}; beam {args.beam}, lenpen {args.lenpen}, early stop {args.early_stop}, "
          f"{args.kernels} kernels", file=sys.stderr)
    print(f"{'precision':<10} {'max tokens':>10} {'graphs':>6} {'sent/s':>9} {'tgt tok/s':>10} {'GiB':>6} {'BLEU':>6} "
          f"{'len ratio':>9}", flush=True)
    rows = []
    for precision in [p.strip() for p in args.precisions.split(",") if p.strip()]:
        for max_tokens in [int(m) for m in args.max_tokens.split(",") if m.strip()]:
            for graphs in [g.strip() for g in args.graphs.split(",") if g.strip()]:
                r = run(args, precision, max_tokens, graphs)
                rows.append(r)
                mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "-"
                print(f"{precision:<10} {r['max_tokens']:>10} {graphs:>6} {r['sentences_per_s']:>9.1f} "
                      f"{r['tokens_per_s']:>10,.0f} {mem:>6} {r['bleu']:>6.2f} {r['length_ratio']:>9.3f}", flush=True)
                if r["profile"]:
                    print(r["profile"], flush=True)
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
