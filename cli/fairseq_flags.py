"""fairseq options that attnmt does not take, each with what to use instead.

An unknown option that fairseq knows gets this one-line answer instead of click's "No such option"; the options
attnmt shares with fairseq are ordinary options of the commands (``--remove-bpe``, ``--lenpen-style``,
``--eval-bleu-args``, ``--log-format``, ``--restore-file``, ...).
"""

from __future__ import annotations

DROP = "drop the option"

INSTEAD = {
    "--force-anneal": "fairseq's annealing of --lr-scheduler fixed for its convolutional models; attnmt's fixed "
                      "schedule keeps --lr, use --lr-scheduler inverse_sqrt (the paper's), polynomial_decay, or " + DROP,
    "--lr-shrink": "fairseq's shrink factor of --lr-scheduler fixed / reduce_lr_on_plateau; attnmt has fixed, "
                   "inverse_sqrt and polynomial_decay: " + DROP,
    "--ddp-backend": "attnmt has one data-parallel implementation (PyTorch's DistributedDataParallel): " + DROP,
    "--num-workers": "attnmt reads the memory-mapped data in the training process, no loader workers: " + DROP,
    "--dataset-impl": "attnmt reads memory-mapped data-bins with either index (its own or fairseq's mmap) as they "
                      "are; only attnmt preprocess takes --dataset-impl, to choose the index it writes: " + DROP,
    "--fp16-init-scale": "attnmt's --fp16 scales the loss with PyTorch's GradScaler (initial scale 65536): " + DROP,
    "--fp16-scale-window": "attnmt's --fp16 scales the loss with PyTorch's GradScaler: " + DROP,
    "--memory-efficient-fp16": "use --fp16 (or --bf16, which needs no loss scaling)",
    "--encoder-learned-pos": "use --learned-pos (learned positions on both sides)",
    "--decoder-learned-pos": "use --learned-pos (learned positions on both sides)",
    "--wandb-project": "attnmt logs to train.jsonl, --log-file and --tensorboard-logdir: " + DROP,
    "--lang-pairs": "fairseq's multilingual task, which attnmt does not implement; train one model per pair",
    "--share-decoders": "fairseq's multilingual task, which attnmt does not implement; train one model per pair",
    "--sacrebleu": "attnmt score computes sacreBLEU by default; fairseq's tokenized BLEU is attnmt score --tokenized-bleu",
    "--replace-unk": "attnmt's subword models (SentencePiece, BPE) leave no unknown words in a translation to "
                     "replace from the source: " + DROP,
    "--min-lr": "fairseq's lower bound at which training stops (--stop-min-lr); attnmt stops at --max-update, "
                "--max-epoch or --max-time-minutes, and its schedules never fall to 1e-9 before: " + DROP,
    "--stop-min-lr": "fairseq's lower bound at which training stops; attnmt stops at --max-update, --max-epoch or "
                     "--max-time-minutes: " + DROP,
    "--task": "attnmt's commands take the task from the data-bin or the checkpoint (translation): " + DROP,
    "--moses-source-lang": "attnmt preprocess --tokenizer moses records the languages; nothing to give at "
                           "translation time",
    "--moses-target-lang": "attnmt preprocess --tokenizer moses records the languages; nothing to give at "
                           "translation time",
}


def instead(option: str) -> str | None:
    """The one-line answer for fairseq option ``option`` (``--name`` or ``--name=value``), if it is one."""
    name = option.split("=", 1)[0]
    hint = INSTEAD.get(name)
    return f"{name} is a fairseq option that attnmt does not take: {hint}" if hint else None


def refusals(command, argv: list[str], first: str) -> list[str]:
    """One line per ``--option`` of ``argv`` that ``command`` does not take (``first``, the one click stopped at,
    included): fairseq's with what to use instead."""
    known = {o for p in command.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))}
    names = [first.split("=", 1)[0]]
    for a in argv:
        name = a.split("=", 1)[0]
        if a.startswith("--") and name not in known and name not in names and name != "--":
            names.append(name)
    return [instead(n) or f"{n}: no such option" for n in names]
