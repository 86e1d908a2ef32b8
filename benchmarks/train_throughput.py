"""Training throughput of attnmt on real batches: target tokens/s, achieved model FLOP/s, fraction of GEMM peak.

    python benchmarks/train_throughput.py /tmp/m30k-bin                  # transformer_small + transformer, fp32 + bf16
    python benchmarks/train_throughput.py /tmp/m30k-bin --archs transformer_small --precisions bf16 --steps 5

For each (architecture, precision) it runs full training updates exactly as ``attnmt train`` does (the real
Trainer: autocast, label-smoothed loss, backward, Adam step, LR schedule, dropout on) on the first ``--steps``
batches of the seeded epoch order of DATA_BIN's train split (``--max-tokens`` per batch), after ``--warmup``
untimed updates. Reported:

* ``tgt tok/s``: target tokens (non-padding, EOS included) per second of update time, fairseq's "wps";
* ``model TFLOP/s``: useful model FLOPs per second, counted per layer as 6 x (multiply-accumulates per token)
  x tokens, i.e. 2 FLOPs per multiply-add and x3 for forward + backward:
  encoder parameters (non-embedding) x source tokens + (decoder parameters (non-embedding) + the output
  projection V x d) x target tokens, plus the attention products (QK^T and AV: 2 x 2 x length x d per token
  per attention layer, x3). Padding and the softmax/LayerNorm/elementwise work are not counted;
* ``% of peak``: that rate over the measured peak of one large ``torch.matmul`` (4096^3) in the same dtype on
  the same threads, the best a dense GEMM achieves on this machine.

The machine must be otherwise idle for meaningful numbers.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def gemm_peak(dtype: torch.dtype, n: int = 4096, reps: int = 5) -> float:
    """FLOP/s of a large square matmul (best of ``reps``)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b)
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
    tgt = batch["target"].ne(1).sum(1).double()
    n_src, n_tgt = float(src.sum()), float(tgt.sum())
    macs = enc * n_src + (dec + out) * n_tgt
    # attention products per query token: QK^T and AV, each length x d multiply-adds
    macs += 2 * cfg.encoder_layers * float((src * src).sum()) * cfg.encoder_embed_dim
    macs += 2 * cfg.decoder_layers * float((tgt * (tgt + 1) / 2).sum()) * d  # causal self-attention
    macs += 2 * cfg.decoder_layers * float((tgt * src).sum()) * d  # encoder-decoder attention
    return 6.0 * macs


def run(data_bin: str, arch: str, precision: str, steps: int, warmup: int, max_tokens: int, seed: int) -> dict:
    from attnmt.criterions import LabelSmoothedCrossEntropyConfig
    from attnmt.optim import AdamConfig, InverseSqrtConfig, build_adam, build_lr_scheduler
    from attnmt.tasks.translation import TranslationConfig, TranslationTask
    from attnmt.training.loop import TrainConfig, make_train_iterator
    from attnmt.training.trainer import Trainer

    torch.manual_seed(seed)
    task = TranslationTask(TranslationConfig(), data_bin)
    name, cfg, _ = task.model_config(arch, {})
    model = task.build_model(name, cfg)
    crit = task.build_criterion("label_smoothed_cross_entropy", LabelSmoothedCrossEntropyConfig())
    sched = build_lr_scheduler("inverse_sqrt", InverseSqrtConfig())
    trainer = Trainer(model, crit, build_adam(AdamConfig(), model.parameters(), lr=7e-4), sched,
                      device=torch.device("cpu"), precision=precision)
    itr, _ = make_train_iterator(task, TrainConfig(max_tokens=max_tokens, seed=seed), model.max_positions())
    batches = []
    for b in itr:
        batches.append(b)
        if len(batches) == warmup + steps:
            break
    for b in batches[:warmup]:
        trainer.train_step([b])
    tokens = 0
    flops = 0.0
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        trainer.train_step([b])
        tokens += b["ntokens"]
        flops += model_flops(model, b)
    elapsed = time.perf_counter() - t0
    return {"arch": arch, "precision": precision, "params": model.num_parameters(), "steps": len(batches) - warmup,
            "tok_s": tokens / elapsed, "flop_s": flops / elapsed, "s_per_update": elapsed / max(len(batches) - warmup, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_bin", help="a DATA_BIN written by attnmt preprocess (e.g. Multi30k)")
    ap.add_argument("--archs", default="transformer_small,transformer")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=10, help="timed updates per setting")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--gemm-size", type=int, default=4096, help="side of the square matmul measuring the peak")
    args = ap.parse_args(argv)
    from attnmt.registry import load_builtins

    load_builtins()
    if args.threads:
        torch.set_num_threads(args.threads)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {p: gemm_peak(dtypes[p], args.gemm_size) for p in precisions}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GEMM peak ({args.gemm_size}^3 matmul): "
          + ", ".join(f"{p} {peaks[p] / 1e12:.2f} TFLOP/s" for p in precisions), file=sys.stderr)
    print(f"{'arch':<20} {'prec':<5} {'params':>11} {'s/update':>9} {'tgt tok/s':>10} {'model TFLOP/s':>14} "
          f"{'% of peak':>9}")
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        for p in precisions:
            r = run(args.data_bin, arch, p, args.steps, args.warmup, args.max_tokens, args.seed)
            print(f"{arch:<20} {p:<5} {r['params']:>11,} {r['s_per_update']:>9.3f} {r['tok_s']:>10.0f} "
                  f"{r['flop_s'] / 1e12:>14.3f} {100 * r['flop_s'] / peaks[p]:>8.1f}%", flush=True)


if __name__ == "__main__":
    main()
