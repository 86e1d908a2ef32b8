"""Training throughput of attnmt on real batches: target tokens/s, model FLOP/s, fraction of GEMM peak; vs fairseq.

    python benchmarks/train_throughput.py /tmp/m30k-bin                  # transformer_small + transformer, fp32 + bf16
    python benchmarks/train_throughput.py /tmp/m30k-bin --archs transformer_small --fairseq-venv /work/fairseq-venv
    python benchmarks/train_throughput.py /tmp/m30k-bin --archs transformer_small --precisions bf16 --steps 3 \\
        --warmup 1 --fairseq-venv /work/fairseq-venv --fairseq-updates 6 --fairseq-log-interval 2   # smoke run

attnmt. For each (architecture, precision) it runs full training updates exactly as ``attnmt train`` does (the
real Trainer: autocast, label-smoothed loss, backward, Adam step, LR schedule, dropout on) on batches of
DATA_BIN's train split (``--max-tokens`` per batch), ``--warmup`` + ``--steps`` of them taken evenly spaced from
the seeded epoch, so that their padding is the epoch's (fairseq's figure below is the median over its first
updates' batches, as random as its order): ``--warmup`` untimed updates, then ``--steps`` timed updates on the
other batches twice. The first ("cold") pass meets every batch shape for the first
time, and bf16 matrix products pay oneDNN's kernel generation for each new shape; the second ("warm") pass is the
steady state of a long run, where every shape has been seen in an earlier epoch. ``tgt tok/s`` is the warm figure;
the cold one is printed too. Reported:

* ``tgt tok/s``: target tokens (non-padding, EOS included) per second of update time, fairseq's "wps";
* ``model TFLOP/s``: useful model FLOPs per second, counted per layer as 6 x (multiply-accumulates per token)
  x tokens, i.e. 2 FLOPs per multiply-add and x3 for forward + backward:
  encoder parameters (non-embedding) x source tokens + (decoder parameters (non-embedding) + the output
  projection V x d) x target tokens, plus the attention products (QK^T and AV: 2 x 2 x length x d per token
  per attention layer, x3). Padding and the softmax/LayerNorm/elementwise work are not counted;
* ``% of peak``: that rate over the measured peak of one large dense product (4096^3) in the same dtype on the
  same threads, the best a dense GEMM achieves on this machine: the faster of ``torch.matmul`` (MKL for fp32) and
  oneDNN's inner product (which runs AVX-512 on AMD CPUs, where MKL keeps to AVX2).

attnmt runs as ``attnmt train`` sets it up: the CPU backend's process settings, the model prepared by the backend
(``attnmt/backends``), precision ``auto`` resolved from the CPU. The first line names the CPU and whether it
computes bf16 natively; ``ONEDNN_MAX_CPU_ISA=AVX2 ATTNMT_CPU_BF16=0 ATEN_CPU_CAPABILITY=avx2`` makes a machine
with AVX-512 or AMX measure as an AVX2 CPU.

fairseq (``--fairseq-venv VENV``, a virtualenv with fairseq 0.12.2). DATA_BIN's train and valid splits are
written back to text with DATA_BIN's own dictionary (the same SentencePiece pieces) and binarized with
``fairseq-preprocess --srcdict DATA_BIN/dict.SRC.txt --joined-dictionary`` (the same vocabulary, in the same
order). ``fairseq-train`` then trains the same model as ``transformer_small`` (3+3 layers, d 256, d_ff 1024, 4
heads, dropout 0.3, shared embeddings, label smoothing 0.1, Adam, inverse_sqrt, the same ``--max-tokens``) on
the CPU for ``--fairseq-updates`` updates, in fp32 and with ``--bf16``; its throughput is the median "wps" of its
JSON log intervals after the first (start-up). (fairseq 0.12.2's ``--bf16`` implies ``--tpu`` and stops with an
error on a machine without torch_xla; the failure is reported and fp32 is then fairseq's best CPU mode.) The last line compares attnmt's best transformer_small figure
with fairseq's best. Both run with the same torch thread count (``--threads``; fairseq through
OMP_NUM_THREADS).

The machine must be otherwise idle for meaningful numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FAIRSEQ_ARCH = ["--arch", "transformer", "--encoder-layers", "3", "--decoder-layers", "3",
                "--encoder-embed-dim", "256", "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
                "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4", "--decoder-attention-heads",
                "4", "--share-all-embeddings", "--dropout", "0.3"]
FAIRSEQ_TRAINING = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--optimizer", "adam",
                    "--adam-betas", "(0.9,0.98)", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
                    "--warmup-updates", "500", "--cpu"]
COMPARED_ARCH = "transformer_small"  # the attnmt architecture identical to FAIRSEQ_ARCH


def gemm_peak(dtype: torch.dtype, n: int = 4096, reps: int = 5) -> float:
    """FLOP/s of a large square product (best of ``reps``), by torch.matmul and by oneDNN's inner product."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    products = [lambda: torch.matmul(a, b)]
    try:
        torch.ops.mkldnn._linear_pointwise(a[:64], b, None, "none", [], "")
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    except (AttributeError, RuntimeError):  # no oneDNN, or no bf16 in it on this CPU
        pass
    best = float("inf")
    for product in products:
        product()
        for _ in range(reps):
            t = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def layer_params(model) -> tuple[int, int, int, int]:
    """(encoder non-embedding params, decoder non-embedding params, output projection params, d_model)."""
    def count(module, skip_embeddings: bool) -> int:
        total = 0
        for name, p in module.named_parameters():
            if skip_embeddings and ("embed" in name or "positions" in name):
                continue
            total += p.numel()
        return total

    enc = count(model.encoder, True)
    dec = sum(p.numel() for n, p in model.decoder.named_parameters()
              if "embed" not in n and "positions" not in n and "output_projection" not in n)
    vocab = model.tgt_vocab
    d = model.cfg.decoder_embed_dim
    return enc, dec, vocab * d, d


def model_flops(model, batch: dict) -> float:
    """Useful FLOPs of one forward + backward on ``batch`` (see the module docstring)."""
    enc, dec, out, d = layer_params(model)
    cfg = model.cfg
    src = batch["net_input"]["src_lengths"].double()
    tgt = batch["target"].ne(model.pad_idx).sum(1).double()
    n_src, n_tgt = float(src.sum()), float(tgt.sum())
    macs = enc * n_src + (dec + out) * n_tgt
    # attention products per query token: QK^T and AV, each length x d multiply-adds
    macs += 2 * cfg.encoder_layers * float((src * src).sum()) * cfg.encoder_embed_dim
    macs += 2 * cfg.decoder_layers * float((tgt * (tgt + 1) / 2).sum()) * d  # causal self-attention
    macs += 2 * cfg.decoder_layers * float((tgt * src).sum()) * d  # encoder-decoder attention
    return 6.0 * macs


def run(data_bin: str, arch: str, precision: str, steps: int, warmup: int, max_tokens: int, seed: int) -> dict:
    from attnmt.backends import backend_for
    from attnmt.criterions import LabelSmoothedCrossEntropyConfig
    from attnmt.optim import AdamConfig, InverseSqrtConfig, build_adam, build_lr_scheduler
    from attnmt.tasks.translation import TranslationConfig, TranslationTask
    from attnmt.training.config import TrainConfig
    from attnmt.training.data import make_train_iterator
    from attnmt.training.trainer import Trainer

    torch.manual_seed(seed)
    task = TranslationTask(TranslationConfig(), data_bin)
    name, cfg, _ = task.model_config(arch, {})
    model = task.build_model(name, cfg)
    backend = backend_for("cpu", precision)
    backend.prepare_training(model)  # as attnmt train does, before the optimizer
    crit = task.build_criterion("label_smoothed_cross_entropy", LabelSmoothedCrossEntropyConfig())
    backend.prepare_criterion(crit)
    sched = build_lr_scheduler("inverse_sqrt", InverseSqrtConfig())
    trainer = Trainer(model, crit, build_adam(AdamConfig(), model.parameters(), lr=7e-4), sched, backend=backend)
    itr, _ = make_train_iterator(task, TrainConfig(max_tokens=max_tokens, seed=seed), model.max_positions())
    epoch = itr.shard(itr.epoch)  # the index arrays of the epoch's batches, in order
    wanted = min(warmup + steps, len(epoch))
    batches = [itr.collate(epoch[i * len(epoch) // wanted]) for i in range(wanted)]
    for b in batches[:warmup]:
        trainer.train_step([b])
    timed = batches[warmup:]
    tokens = sum(b["ntokens"] for b in timed)
    flops = sum(model_flops(model, b) for b in timed)
    elapsed = {}
    for name in ("cold", "warm"):
        t0 = time.perf_counter()
        for b in timed:
            trainer.train_step([b])
        elapsed[name] = time.perf_counter() - t0
    n = max(len(timed), 1)
    return {"arch": arch, "precision": precision, "params": model.num_parameters(), "steps": len(timed),
            "tok_s": tokens / elapsed["warm"], "tok_s_cold": tokens / elapsed["cold"],
            "flop_s": flops / elapsed["warm"], "s_per_update": elapsed["warm"] / n}


# ---------------------------------------------------------------------------------------------------- fairseq


def fairseq_data(data_bin: str, work: Path, venv: Path, workers: int) -> Path:
    """DATA_BIN's train and valid splits binarized by fairseq-preprocess with DATA_BIN's dictionary."""
    from attnmt.data.dictionary import Dictionary
    from attnmt.data.indexed import IndexedDataset

    meta = json.loads((Path(data_bin) / "preprocess.json").read_text(encoding="utf-8"))
    src, tgt = meta["source_lang"], meta["target_lang"]
    if not meta.get("joined_dictionary"):
        sys.exit(f"{data_bin}: the fairseq comparison shares all embeddings and needs a joined dictionary "
                 f"(attnmt preprocess --joined-dictionary)")
    dest = work / "fairseq-bin"
    if (dest / f"train.{src}-{tgt}.{src}.bin").exists():
        return dest
    text = work / "text"
    text.mkdir(parents=True, exist_ok=True)
    for lang in (src, tgt):
        vocab = Dictionary.load(Path(data_bin) / f"dict.{lang}.txt")
        for split in ("train", "valid"):
            ds = IndexedDataset(str(Path(data_bin) / f"{split}.{src}-{tgt}.{lang}"))
            with open(text / f"{split}.{lang}", "w", encoding="utf-8") as f:
                for ids in ds:
                    f.write(vocab.string(ids) + "\n")
    cmd = [str(venv / "bin" / "fairseq-preprocess"), "-s", src, "-t", tgt, "--trainpref", str(text / "train"),
           "--validpref", str(text / "valid"), "--destdir", str(dest), "--srcdict",
           str(Path(data_bin) / f"dict.{src}.txt"), "--joined-dictionary", "--workers", str(workers),
           "--dataset-impl", "mmap"]
    proc = subprocess.run(cmd, env=_fairseq_env(0), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"fairseq-preprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return dest


def _fairseq_env(threads: int) -> dict:
    env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_fairseq(venv: Path, data: Path, work: Path, bf16: bool, updates: int, log_interval: int, max_tokens: int,
                threads: int, seed: int) -> dict:
    """Train with fairseq-train; throughput from its JSON log (median wps of the intervals after the first)."""
    log_path = work / f"fairseq-{'bf16' if bf16 else 'fp32'}.log"
    cmd = [str(venv / "bin" / "fairseq-train"), str(data), *FAIRSEQ_ARCH, *FAIRSEQ_TRAINING,
           "--max-tokens", str(max_tokens), "--max-update", str(updates), "--log-format", "json",
           "--log-interval", str(log_interval), "--disable-validation", "--no-save", "--seed", str(seed),
           "--num-workers", "0", "--save-dir", str(work / "fairseq-checkpoints")]
    if bf16:
        cmd.append("--bf16")
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, env=_fairseq_env(threads), stdout=log, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    intervals = []
    for line in lines:
        if "| train_inner |" in line:
            intervals.append(json.loads(line.split("| train_inner |", 1)[1]))
    if proc.returncode != 0 or not intervals:
        last = next((ln for ln in reversed(lines) if ln.strip()), "no output")
        return {"ok": False, "error": f"exit {proc.returncode}: {last.strip()[:200]}", "log": str(log_path)}
    timed = intervals[1:] or intervals  # the first interval holds start-up and first-step costs
    wps = statistics.median(float(r["wps"]) for r in timed)
    ups = statistics.median(float(r["ups"]) for r in timed)
    return {"ok": True, "tok_s": wps, "s_per_update": 1.0 / ups if ups else float("nan"),
            "intervals": len(intervals), "wall_s": wall, "log": str(log_path)}


# ------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_bin", help="a DATA_BIN written by attnmt preprocess (e.g. Multi30k)")
    ap.add_argument("--archs", default="transformer_small,transformer")
    ap.add_argument("--precisions", default="fp32,auto",
                    help="comma-separated: fp32, bf16 (needs native bf16), auto (bf16 where native)")
    ap.add_argument("--steps", type=int, default=10, help="timed updates per setting (each timed twice)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for attnmt and fairseq (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gemm-size", type=int, default=4096, help="side of the square matmul measuring the peak")
    ap.add_argument("--fairseq-venv", default=None, help="virtualenv with fairseq 0.12.2: also train with fairseq")
    ap.add_argument("--fairseq-updates", type=int, default=60, help="updates per fairseq run")
    ap.add_argument("--fairseq-log-interval", type=int, default=10, help="fairseq log interval (updates)")
    ap.add_argument("--fairseq-precisions", default="fp32,bf16", help="fairseq modes to run (bf16: --bf16)")
    ap.add_argument("--workdir", default=None, help="keep fairseq data and logs here instead of a temp directory")
    args = ap.parse_args(argv)
    from attnmt.backends import configure_process, cpu, resolve_precision
    from attnmt.cli import load_components
    from attnmt.errors import UserError

    load_components()
    configure_process("train", "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu().describe()}", file=sys.stderr)
    precisions = []
    for p in [p.strip() for p in args.precisions.split(",") if p.strip()]:
        try:
            resolved = resolve_precision(p, torch.device("cpu"))  # auto -> bf16 or fp32; bf16 without native: error
        except UserError as e:
            sys.exit(f"--precisions {p}: {e}")
        if resolved not in precisions:
            precisions.append(resolved)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {p: gemm_peak(dtypes[p], args.gemm_size) for p in precisions}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GEMM peak ({args.gemm_size}^3 matmul): "
          + ", ".join(f"{p} {peaks[p] / 1e12:.2f} TFLOP/s" for p in precisions), file=sys.stderr)
    print(f"{'run':<28} {'params':>11} {'s/update':>9} {'tgt tok/s':>10} {'cold tok/s':>10} {'model TFLOP/s':>14} "
          f"{'% of peak':>9}", flush=True)
    best_ours = None
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        for p in precisions:
            r = run(args.data_bin, arch, p, args.steps, args.warmup, args.max_tokens, args.seed)
            print(f"{'attnmt ' + arch + ' ' + p:<28} {r['params']:>11,} {r['s_per_update']:>9.3f} {r['tok_s']:>10.0f} "
                  f"{r['tok_s_cold']:>10.0f} {r['flop_s'] / 1e12:>14.3f} {100 * r['flop_s'] / peaks[p]:>8.1f}%",
                  flush=True)
            if arch == COMPARED_ARCH and (best_ours is None or r["tok_s"] > best_ours[1]):
                best_ours = (p, r["tok_s"])

    if not args.fairseq_venv:
        return
    venv = Path(args.fairseq_venv)
    if not (venv / "bin" / "fairseq-train").exists():
        sys.exit(f"{venv}/bin/fairseq-train: not found; pass the virtualenv where fairseq 0.12.2 is installed")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="attnmt-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = fairseq_data(args.data_bin, work, venv, workers=max(args.threads, 1))
        best_fairseq = None
        for p in [p.strip() for p in args.fairseq_precisions.split(",") if p.strip()]:
            r = run_fairseq(venv, data, work, p == "bf16", args.fairseq_updates, args.fairseq_log_interval,
                            args.max_tokens, args.threads, args.seed)
            name = f"fairseq {COMPARED_ARCH}-like {p}"
            if not r["ok"]:
                print(f"{name:<28} failed: {r['error']} (log: {r['log']})", flush=True)
                continue
            print(f"{name:<28} {'':>11} {r['s_per_update']:>9.3f} {r['tok_s']:>10.0f} {'':>10} {'':>14} {'':>9}   "
                  f"(median of {r['intervals'] - 1} log intervals of {args.fairseq_log_interval} updates)",
                  flush=True)
            if best_fairseq is None or r["tok_s"] > best_fairseq[1]:
                best_fairseq = (p, r["tok_s"])
        if best_ours and best_fairseq:
            print(f"attnmt {COMPARED_ARCH} {best_ours[0]} / fairseq {best_fairseq[0]}: "
                  f"{best_ours[1] / best_fairseq[1]:.2f}x target tokens/s", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
