"""Training speed on a GPU, step by step: target tok/s, model FLOP/s against the GPU's measured peak, step-time
median/mean/p95 over updates that include epoch ends (with their checkpoint saves), peak GPU memory.

WMT-length batches: newstest2014 (3,003 sentences, ../shared/data/wmt14_en_de) repeated as a training set,
joint SentencePiece 16k, as the paper's models see WMT batches:

    mkdir -p /tmp/wmt && for l in en de; do for i in $(seq 10); do gzip -cd newstest2014.$l.gz; done \\
        > /tmp/wmt/train.$l; gzip -cd newstest2014.$l.gz | head -500 > /tmp/wmt/valid.$l; done
    attnmt preprocess -s en -t de --trainpref /tmp/wmt/train --validpref /tmp/wmt/valid --destdir /tmp/wmt/bin \\
        --bpe sentencepiece --vocab-size 16000 --joined-dictionary
    python benchmarks/train_gpu.py /tmp/wmt/bin --archs transformer_big,transformer --precisions bf16,fp16

For each (architecture, precision) it runs ``--updates`` real training updates (the Trainer of ``attnmt train``:
autocast or loss scaling, label-smoothed loss, backward, fused Adam, inverse-sqrt schedule, dropout on) after
``--warmup`` untimed ones, each timed to the GPU's completion (``torch.cuda.synchronize``). At every epoch end it
saves the model and optimizer state the way training does (``--save background``: the host snapshot and the
background write of ``attnmt/checkpoint/saver.py``; ``foreground``: written in the loop; ``none``), so that the
step-time mean shows what saving costs. The process settings are those of ``attnmt train`` (the CUDA backend's
``configure_process``: cuDNN attention off); ``--cudnn-attention`` turns cuDNN's attention back on, which is how
the GPU ran before the CUDA backend made that choice.

Reported per run: s/update median, mean and p95; target tokens/s (all timed updates, epoch ends included, and at
the median step); model TFLOP/s (forward + backward multiply-adds x 6, the count of
``benchmarks/train_throughput.py``) and its share of the measured peak of one large product (8192^3 by default)
in the run's dtype; peak GPU memory. One JSON line per run follows the table (``--json``). ``--device cpu``
runs the same measurement on the CPU (a smoke test of the script; the peak is then the CPU's).

``--profile N`` profiles N more updates after the timed ones and prints how busy the GPU was and the kernels'
time table (``gpu_profile.py``); ``--valid`` reports the valid split's loss after the updates (with ``--lr`` and
``--warmup-updates`` for a short run that learns); ``--compile`` compiles the layers as ``attnmt train
--compile`` does; ``--as-before`` runs the GPU path as it was before the CUDA backend's training choices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import model_flops  # noqa: E402  (the same FLOP count as the CPU benchmark)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10) -> float:
    """FLOP/s of the best of ``reps`` n^3 products on ``device``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def run(data_bin: str, arch: str, precision: str, device: torch.device, args) -> dict:
    from attnmt.backends import backend_for
    from attnmt.checkpoint.saver import CheckpointSaver
    from attnmt.criterions import LabelSmoothedCrossEntropyConfig
    from attnmt.optim import AdamConfig, InverseSqrtConfig, build_adam, build_lr_scheduler
    from attnmt.tasks.translation import TranslationConfig, TranslationTask
    from attnmt.training.config import TrainConfig
    from attnmt.training.data import make_train_iterator
    from attnmt.training.trainer import Trainer

    torch.manual_seed(args.seed)
    task = TranslationTask(TranslationConfig(), data_bin)
    name, cfg, _ = task.model_config(arch, {})
    model = task.build_model(name, cfg).to(device)
    backend = backend_for(device, precision)
    backend.prepare_training(model, compile=args.compile)
    if args.as_before:  # the path the GPU ran before its backend chose its own: packed rows, fp32 LayerNorms
        from attnmt.models.packing import set_row_packing

        set_row_packing(model, True)
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.__class__ = torch.nn.LayerNorm
    crit = task.build_criterion("label_smoothed_cross_entropy", LabelSmoothedCrossEntropyConfig())
    backend.prepare_criterion(crit)
    optimizer = build_adam(AdamConfig(), model.parameters(), lr=args.lr)
    schedule = InverseSqrtConfig(lr=args.lr, warmup_updates=args.warmup_updates)
    trainer = Trainer(model, crit, optimizer, build_lr_scheduler("inverse_sqrt", schedule), backend=backend)
    multiple = args.required_seq_len_multiple or backend.length_multiple()
    itr, _ = make_train_iterator(task, TrainConfig(max_tokens=args.max_tokens, seed=args.seed), model.max_positions(),
                                 multiple)
    save_dir = Path(tempfile.mkdtemp(prefix="attnmt-gpu-bench-"))
    saver = CheckpointSaver(save_dir, backend.host_staging(), background=args.save == "background")

    def batches():
        while True:
            if itr.end_of_epoch():
                itr.next_epoch()
            for b in itr:
                yield b, itr.end_of_epoch()

    times, tokens, flops, epoch_ends = [], [], [], 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stream = batches()
    t_start = time.perf_counter()
    warmup_s = 0.0
    save_s: list[float] = []
    for i in range(args.warmup + args.updates):
        batch, epoch_end = next(stream)
        sync(device)
        t0 = time.perf_counter()
        trainer.train_step([batch])
        if epoch_end and args.save != "none":
            sync(device)
            t_save = time.perf_counter()
            saver.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, ["checkpoint_last.pt"])
            sync(device)
            save_s.append(time.perf_counter() - t_save)  # the step's share waiting for the snapshot
        sync(device)
        if i == args.warmup - 1:
            warmup_s = time.perf_counter() - t_start  # with --compile: the compiler's time
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(batch["ntokens"])
            flops.append(model_flops(model, batch))
            epoch_ends += epoch_end
    profile = None
    if args.profile:
        from gpu_profile import profile_table

        profiled = [next(stream)[0] for _ in range(args.profile)]
        try:
            profile = profile_table(lambda: [trainer.train_step([b]) for b in profiled], device)
        except Exception as e:  # the profile is extra: the run's figures stand without it
            profile = f"profile failed: {type(e).__name__}: {e}"
    valid = valid_loss(task, trainer, model, args) if args.valid else None
    saver.close()
    for p in save_dir.iterdir():
        p.unlink()
    save_dir.rmdir()
    total = sum(times)
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    median = statistics.median(times)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"arch": arch, "precision": precision, "device": str(device), "params": model.num_parameters(),
            "updates": len(times), "epoch_ends": epoch_ends, "s_median": median, "s_mean": total / len(times),
            "s_p95": p95, "tok_s": sum(tokens) / total, "tok_s_at_median": statistics.median(tokens) / median,
            "flop_s": sum(flops) / total, "tokens_per_update": sum(tokens) / len(tokens), "peak_mem_gib": peak_mem,
            "save": args.save, "cudnn_attention": args.cudnn_attention, "length_multiple": multiple,
            "warmup_s": warmup_s, "compile": args.compile, "as_before": args.as_before, "valid_loss": valid,
            "seed": args.seed, "profile": profile, "save_s": save_s}


def valid_loss(task, trainer, model, args) -> float:
    """The label-smoothed loss per target token (base 2, as ``attnmt train`` logs it) on the data-bin's valid
    split: the validation of ``attnmt train``."""
    from attnmt.training.config import TrainConfig
    from attnmt.training.data import make_valid_batches
    from attnmt.training.metrics import validate

    valid = make_valid_batches(task, TrainConfig(max_tokens=args.max_tokens), "valid", model.max_positions(),
                               trainer.backend.length_multiple())
    return validate(trainer, {"valid": valid}, [])["valid"]["loss"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_bin", help="a DATA_BIN written by attnmt preprocess (WMT-length sentences: see above)")
    ap.add_argument("--archs", default="transformer_big,transformer")
    ap.add_argument("--precisions", default="bf16,fp16", help="comma-separated: bf16, fp16, fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=25000)
    ap.add_argument("--updates", type=int, default=120, help="timed updates per run (epoch ends included)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed updates first")
    ap.add_argument("--save", choices=("background", "foreground", "none"), default="background",
                    help="how the state is saved at each epoch end")
    ap.add_argument("--required-seq-len-multiple", type=int, default=0, help="0: the backend's choice")
    ap.add_argument("--cudnn-attention", action="store_true", help="leave cuDNN's attention kernels on")
    ap.add_argument("--gemm-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="compile the layers (attnmt train --compile)")
    ap.add_argument("--as-before", action="store_true",
                    help="the GPU path before the CUDA backend's training choices: packed decoder rows, fp32 "
                         "LayerNorm outputs under autocast")
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--warmup-updates", type=int, default=4000, help="of the inverse-sqrt schedule")
    ap.add_argument("--valid", action="store_true", help="report the valid split's loss after the updates")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed updates, profile N more: GPU-busy share and the kernel-time table")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per run")
    args = ap.parse_args(argv)

    from attnmt.backends import configure_process
    from attnmt.cli import load_components

    load_components()
    device = torch.device(args.device)
    configure_process("train", args.device)
    if args.cudnn_attention and device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in dtypes:
            sys.exit(f"--precisions {p}: use bf16, fp16 or fp32")
    peaks = {p: gemm_peak(device, dtypes[p], args.gemm_size) for p in precisions}
    print(f"{name}, torch {torch.__version__}; peak ({args.gemm_size}^3 matmul): "
          + ", ".join(f"{p} {peaks[p] / 1e12:.2f} TFLOP/s" for p in precisions)
          + f"; cuDNN attention {'on' if args.cudnn_attention else 'off'}; save {args.save}", file=sys.stderr)
    print(f"{'run':<26} {'s median':>9} {'s mean':>8} {'s p95':>8} {'tgt tok/s':>10} {'at median':>10} "
          f"{'TFLOP/s':>8} {'% peak':>7} {'GiB':>6} {'epoch ends':>10} {'warm-up s':>9}"
          + (f" {'valid loss':>10}" if args.valid else ""), flush=True)
    rows = []
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        for p in precisions:
            r = run(args.data_bin, arch, p, device, args)
            r["peak_flop_s"] = peaks[p]
            rows.append(r)
            print(f"{arch + ' ' + p:<26} {r['s_median']:>9.4f} {r['s_mean']:>8.4f} {r['s_p95']:>8.4f} "
                  f"{r['tok_s']:>10,.0f} {r['tok_s_at_median']:>10,.0f} {r['flop_s'] / 1e12:>8.1f} "
                  f"{100 * r['flop_s'] / peaks[p]:>6.1f}% {r['peak_mem_gib']:>6.1f} {r['epoch_ends']:>10} "
                  f"{r['warmup_s']:>9.1f}" + (f" {r['valid_loss']:>10.4f}" if args.valid else ""), flush=True)
            if r["profile"]:
                print(r["profile"], flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
