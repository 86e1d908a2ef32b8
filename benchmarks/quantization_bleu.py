"""What a precision costs in BLEU: each mode's BLEU against fp32's over several splits and batchings.

    python benchmarks/quantization_bleu.py --path M/checkpoints/averaged.pt --data-bin M/data-bin \\
        --subsets valid,test,test1,test2,test3 --modes fp32,bf16,int8 --batchings 8192,2048,w2

One BLEU figure moves by a few tenths whenever any rounding changes (bf16 against fp32 too), and int8's
activation scales depend on what else is in the batch, so one split in one batching says little. This script
translates every split of ``--subsets`` in every batching of ``--batchings`` (``N``: one process, N source
tokens per batch; ``wN``: N worker processes at the CPU's default batch, as ``attnmt generate --workers N``)
with each mode (as in generate_speed.py: fp32, bf16, int8 = int8 layers with the activations ``--precision auto``
picks, int8-fp32 = int8 layers with fp32 activations), and prints each figure, then per mode the mean difference
to the first mode and its range. References: the binarized target split decoded back to text. Search: beam 4,
lenpen 0.6, the beam stop rule, unless told otherwise. ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_speed import MODE_SETTINGS, MODES, load_data  # noqa: E402  (the same data loading and mode names)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="checkpoint (or directory holding model.pt)")
    p.add_argument("--data-bin", required=True, help="binarized data directory (attnmt preprocess)")
    p.add_argument("--subsets", default="valid,test", help="splits of --data-bin, comma-separated")
    p.add_argument("--modes", default="fp32,bf16,int8",
                   help="comma-separated subset of fp32,bf16,int8,int8-fp32; the first is the reference")
    p.add_argument("--batchings", default="8192,2048,w2",
                   help="comma-separated: N (one process, N source tokens per batch) or wN (N workers)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: every core)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--early-stop", choices=("exact", "beam"), default="beam")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences of each split (smoke runs)")
    p.add_argument("--json", help="also write every figure to this JSON file")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    args.batchings = args.batchings.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode {bad[0]!r}: use {', '.join(MODES)}")
    for b in args.batchings:
        if not (b.isdigit() or (b[:1] == "w" and b[1:].isdigit())) or b in ("0", "w0"):
            p.error(f"--batchings: {b!r} is neither N (source tokens per batch) nor wN (N workers)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import sacrebleu

    from attnmt.backends import configure_process
    from attnmt.generation.beam import BeamSearchConfig
    from attnmt.generation.generator import GenerationConfig
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_generator

    configure_process("generate", "cpu")  # as attnmt generate does
    threads = args.threads or os.cpu_count() or 1
    search_cfg = SearchConfig(beam=args.beam, lenpen=args.lenpen, options=BeamSearchConfig(early_stop=args.early_stop))
    bleu: dict[tuple[str, str, str], float] = {}
    for mode in args.modes:
        precision, quantize = MODE_SETTINGS[mode]
        for batching in args.batchings:
            workers = int(batching[1:]) if batching.startswith("w") else 1
            max_tokens = 0 if workers > 1 else int(batching)  # 0: the backend's default batch
            gen_cfg = GenerationConfig(max_tokens=max_tokens, device="cpu", precision=precision, quantize=quantize,
                                       threads=threads, workers=workers)
            bundle, generator = load_generator(args.path, search_cfg, gen_cfg)
            try:
                for subset in args.subsets.split(","):
                    data_args = argparse.Namespace(ref=None, data_bin=args.data_bin, gen_subset=subset, src=None,
                                                   limit=args.limit)
                    sources, refs = load_data(data_args, bundle)
                    results = list(generator.generate(sources, max_tokens))  # 0: the backend's default
                    hyps = [bundle.detokenize(bundle.target_pieces(h[0].tokens)) if h else "" for _, h in results]
                    bleu[(subset, batching, mode)] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
                    print(f"{subset:>10} {batching:>6} {mode:>9} BLEU {bleu[(subset, batching, mode)]:.2f}", flush=True)
            finally:
                generator.close()
    ref_mode = args.modes[0]
    print(f"\nmean difference to {ref_mode} over {len(args.subsets.split(','))} splits x {len(args.batchings)} "
          f"batchings (range):")
    for mode in args.modes[1:]:
        diffs = [bleu[(s, b, mode)] - bleu[(s, b, ref_mode)] for s, b, m in bleu if m == mode]
        print(f"{mode:>9} {statistics.mean(diffs):+.3f} ({min(diffs):+.2f} to {max(diffs):+.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps([{"subset": s, "batching": b, "mode": m, "bleu": v}
                                               for (s, b, m), v in bleu.items()], indent=1))


if __name__ == "__main__":
    main()
