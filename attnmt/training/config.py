"""The options of ``attnmt train`` that belong to the loop, and the chosen components (the command line resolved)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from attnmt.backends.precision import requested_precision


@dataclass
class TrainConfig:
    """Options of ``attnmt train`` that belong to the loop (the components have their own configs)."""

    # batching
    max_tokens: int | None = field(default=4096, metadata={
        "help": "max PADDED tokens per batch per process: n_sentences * max(src_len, tgt_len)"})
    batch_size: int | None = field(default=None, metadata={"help": "max sentences per batch (optional cap)",
                                                           "aliases": ("--max-sentences",)})
    skip_invalid_size_inputs_valid_test: bool = field(default=False, metadata={
        "help": "accepted for fairseq command lines: attnmt always skips, and reports, pairs longer than the model "
                "takes"})
    required_batch_size_multiple: int = field(default=8, metadata={"min": 1,
        "help": "full batches hold a multiple of this many sentences (friendlier matrix shapes)"})
    required_seq_len_multiple: int = field(default=0, metadata={
        "help": "pad every batch's source and target length up to a multiple of N (fewer distinct shapes, "
                "lengths aligned to the GPU's tensor-core tiles); 0: the device's choice (8 on a GPU, 1 on the CPU)"})
    update_freq: int = field(default=1, metadata={"help": "accumulate gradients over N batches per update"})
    sampled_segmentations: bool = field(default=False, metadata={
        "help": "train each epoch on the next of the training split's BPE-dropout segmentations (train_sample1, "
                "train_sample2, ..., in turn; written by attnmt preprocess --bpe-dropout) instead of the split "
                "itself; validation and inference keep the deterministic segmentation"})
    # stopping
    max_update: int = field(default=0, metadata={"help": "stop after this many updates (0: no limit)"})
    max_epoch: int = field(default=0, metadata={"help": "stop after this many epochs (0: no limit)"})
    max_time_minutes: float = field(default=0.0, metadata={"min": 0,
        "help": "stop after this much training time, summed over restarts (0: no limit)"})
    patience: int = field(default=-1, metadata={"min": -1,
        "help": "stop when the best validation metric has not improved for N validations (-1: off)"})
    # numerics and device
    seed: int = field(default=1, metadata={"min": 0, "max": 2**32 - 1, "help": "random seed (initialisation, dropout, batch order)"})
    precision: Literal["auto", "fp32", "bf16", "fp16"] = field(default="fp32", metadata={
        "help": "auto: bf16 where the hardware computes it natively (a CPU with AMX or AVX-512 BF16, a GPU of "
                "compute capability >= 8.0), fp32 otherwise; bf16: bf16 autocast with fp32 master weights (an "
                "error on a CPU without native bf16); fp16: fp16 autocast with dynamic loss scaling (CUDA)"})
    bf16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision bf16"})
    fp16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision fp16"})
    cpu: bool = field(default=False, metadata={"help": "train on the CPU even when CUDA is available"})
    threads: int | None = field(default=None, metadata={"min": 1, "max": 4096, "help": "CPU threads for torch (torch.set_num_threads)"})
    clip_norm: float = field(default=0.0, metadata={"min": 0, "help": "clip the gradient norm to this value (0: off)"})
    cpu_attention: Literal["auto", "math", "flash"] = field(default="auto", metadata={
        "help": "attention kernel on CPU: math (matmul-softmax-matmul, fastest for sentences up to ~256 tokens), "
                "flash (fused, faster for long sequences) or auto (math up to 256 tokens, flash beyond)"})
    compile: bool = field(default=False, metadata={
        "help": "CUDA: compile each encoder and decoder layer with torch.compile (fuses the passes around the "
                "products; the first updates wait for the compiler)"})
    # checkpoints
    save_dir: str = field(default="checkpoints", metadata={"help": "directory for checkpoints and train.jsonl"})
    save_interval: int = field(default=1, metadata={"help": "save an epoch checkpoint every N epochs"})
    save_interval_updates: int = field(default=0, metadata={
        "help": "also save checkpoint_EPOCH_UPDATES.pt every N updates (0: off)"})
    save_interval_minutes: float = field(default=0.0, metadata={"min": 0,
        "help": "also save checkpoint_EPOCH_UPDATES.pt every N minutes of training (0: off)"})
    keep_interval_updates: int = field(default=-1, metadata={
        "help": "keep only the newest N update-interval checkpoints (-1: all)"})
    keep_last_epochs: int = field(default=-1, metadata={"help": "keep only the newest N epoch checkpoints (-1: all)"})
    no_epoch_checkpoints: bool = field(default=False, metadata={"help": "do not write checkpointEPOCH.pt files"})
    no_last_checkpoints: bool = field(default=False, metadata={
        "help": "do not write checkpoint_last.pt (a stopped run then cannot resume)"})
    no_save: bool = field(default=False, metadata={"help": "write no checkpoint at all"})
    background_save: bool = field(default=True, metadata={
        "help": "copy the state to host memory at a save and write the file in a background thread while "
                "training goes on (still atomic; the run waits for the last write before it ends); "
                "--no-background-save writes in the training thread"})
    keep_best_checkpoints: int = field(default=-1, metadata={
        "help": "also keep the N best checkpoints by --best-checkpoint-metric, as "
                "checkpoint.best_METRIC_VALUE.pt (-1: off)"})
    restore_file: str = field(default="checkpoint_last.pt", metadata={
        "help": "resume from this file: the default is SAVE_DIR/checkpoint_last.pt; another path is loaded whole "
                "(weights, optimizer, schedule, data position; see the --reset-* options) when SAVE_DIR holds no "
                "checkpoint_last.pt yet"})
    best_checkpoint_metric: str = field(default="loss", metadata={
        "help": "validation metric that picks checkpoint_best.pt: loss, nll_loss, ppl or bleu (needs --eval-bleu)"})
    maximize_best_checkpoint_metric: bool = field(default=False, metadata={
        "help": "higher is better for --best-checkpoint-metric (e.g. bleu)"})
    # validation
    validate_interval: int = field(default=1, metadata={"help": "validate every N epochs"})
    validate_interval_updates: int = field(default=0, metadata={"help": "also validate every N updates (0: off)"})
    disable_validation: bool = field(default=False, metadata={"help": "never validate"})
    eval_bleu: bool = field(default=False, metadata={
        "help": "also decode the validation set with beam search and report detokenized sacreBLEU"})
    eval_bleu_beam: int = field(default=4, metadata={"min": 1, "max": 1024, "help": "beam size for --eval-bleu"})
    eval_bleu_lenpen: float = field(default=0.6, metadata={"help": "length penalty alpha for --eval-bleu"})
    eval_bleu_max_len_a: float = field(default=1.0, metadata={"min": 0, "help": "--eval-bleu max length = a * src_len + b"})
    eval_bleu_max_len_b: int = field(default=50, metadata={"min": 0, "help": "--eval-bleu max length = a * src_len + b"})
    eval_bleu_max_sentences: int = field(default=0, metadata={"min": 0,
        "help": "decode only the first N validation sentences for --eval-bleu (0: all)"})
    eval_bleu_args: str | None = field(default=None, metadata={
        "help": "fairseq's JSON form of the --eval-bleu search: keys beam, lenpen, max_len_a, max_len_b (e.g. "
                "'{\"beam\": 5, \"max_len_a\": 1.2, \"max_len_b\": 10}')", "metavar": "JSON"})
    eval_bleu_detok: Literal["data", "moses", "space"] = field(default="data", metadata={
        "help": "how --eval-bleu turns pieces into text: data (the pipeline attnmt preprocess recorded), moses (also "
                "the Moses detokenizer, for text tokenized outside attnmt), space (none)"})
    eval_bleu_remove_bpe: str | None = field(default=None, metadata={
        "help": "remove subword markers before --eval-bleu scores (fairseq's meaning; a bare flag: '@@ ')",
        "flag_value": "@@ ", "metavar": "[SYMBOL]"})
    eval_tokenized_bleu: bool = field(default=False, metadata={
        "help": "--eval-bleu on the text as it is (sacreBLEU tokenize none) instead of 13a"})
    eval_bleu_print_samples: bool = field(default=False, metadata={
        "help": "log one hypothesis and its reference at each --eval-bleu validation"})
    # resume
    reset_optimizer: bool = field(default=False, metadata={"help": "resume with fresh optimizer state"})
    reset_lr_scheduler: bool = field(default=False, metadata={
        "help": "resume with the LR schedule started again (warm-up from the current update)"})
    reset_dataloader: bool = field(default=False, metadata={"help": "resume from epoch 1, batch 0"})
    reset_meters: bool = field(default=False, metadata={
        "help": "accepted for fairseq command lines: attnmt's meters always start afresh with each run"})
    finetune_from: str | None = field(default=None, metadata={
        "help": "start from this checkpoint's weights only (ignored when SAVE_DIR/checkpoint_last.pt exists)"})
    # output
    log_interval: int = field(default=100, metadata={"min": 1, "help": "log training figures every N updates"})
    progress: Literal["auto", "bar", "lines", "simple", "json", "none"] = field(default="auto", metadata={
        "help": "progress display on stderr: auto (bar on a terminal, lines otherwise), bar, lines, simple (lines "
                "with timestamps), json (the train.jsonl records), none"})
    log_format: Literal["simple", "json", "tqdm", "none"] | None = field(default=None, metadata={
        "help": "fairseq's spelling of --progress: simple, json, tqdm (= bar), none"})
    no_progress_bar: bool = field(default=False, metadata={"help": "fairseq's spelling of --progress simple"})
    log_file: str | None = field(default=None, metadata={
        "help": "also append every log line, with a timestamp, to this file"})
    tensorboard_logdir: str | None = field(default=None, metadata={
        "help": "also write the train and valid figures as TensorBoard scalars here (needs the tensorboard "
                "package: pip install 'attnmt[tensorboard]')"})
    world_size: int = field(default=1, metadata={"help": "number of training processes", "cli": False})
    rank: int = field(default=0, metadata={"help": "this process's rank", "cli": False})
    local_rank: int = field(default=0, metadata={"help": "this process's rank on its machine (its GPU)", "cli": False})

    def __post_init__(self):
        if self.max_tokens is None and self.batch_size is None:
            raise ValueError("give --max-tokens or --batch-size")
        for name in ("max_tokens", "batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.update_freq < 1:
            raise ValueError(f"--update-freq must be >= 1, got {self.update_freq}")
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        for name in ("max_update", "max_epoch", "save_interval_updates", "validate_interval_updates",
                     "required_seq_len_multiple"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(self, name)}")
        for name in ("max_time_minutes", "save_interval_minutes", "clip_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: off), got {getattr(self, name)}")
        for name in ("save_interval", "validate_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("keep_interval_updates", "keep_last_epochs"):
            if getattr(self, name) < -1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= -1 (-1: keep all), got {getattr(self, name)}")
        self.precision = requested_precision(self.precision, self.bf16, self.fp16)
        if self.log_format is not None:
            self.progress = {"tqdm": "bar"}.get(self.log_format, self.log_format)
        elif self.no_progress_bar:
            self.progress = "simple"
        if self.eval_bleu_args:
            self._apply_eval_bleu_args(self.eval_bleu_args)
        if self.keep_best_checkpoints < -1 or self.keep_best_checkpoints == 0:
            raise ValueError(f"--keep-best-checkpoints must be >= 1 (or -1: off), got {self.keep_best_checkpoints}")
        if self.best_checkpoint_metric not in ("loss", "nll_loss", "ppl", "bleu"):
            raise ValueError(f"--best-checkpoint-metric {self.best_checkpoint_metric!r}: use loss, nll_loss, ppl or "
                             f"bleu")
        if self.best_checkpoint_metric == "bleu" and not self.eval_bleu:
            raise ValueError("--best-checkpoint-metric bleu needs --eval-bleu")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")

    def _apply_eval_bleu_args(self, text: str) -> None:
        """fairseq's ``--eval-bleu-args '{"beam": 5, ...}'`` onto the --eval-bleu-* fields."""
        import json

        keys = {"beam": "eval_bleu_beam", "lenpen": "eval_bleu_lenpen", "max_len_a": "eval_bleu_max_len_a",
                "max_len_b": "eval_bleu_max_len_b"}
        try:
            args = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--eval-bleu-args {text!r} is not JSON ({e}); write it as '{{\"beam\": 5}}'") from None
        if not isinstance(args, dict):
            raise ValueError(f"--eval-bleu-args {text!r}: give a JSON object such as '{{\"beam\": 5}}'")
        unknown = sorted(set(args) - set(keys))
        if unknown:
            raise ValueError(f"--eval-bleu-args: unknown key(s) {', '.join(unknown)}; attnmt takes "
                             f"{', '.join(keys)}")
        for key, value in args.items():
            kind = type(getattr(self, keys[key]))
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"--eval-bleu-args: {key} must be a finite number, got {value!r}")
            setattr(self, keys[key], kind(value))


@dataclass
class Setup:
    """The chosen components and their configs (what the command line resolved)."""

    task: str
    task_cfg: Any
    arch: str
    model_overrides: dict
    criterion: str
    criterion_cfg: Any
    optimizer: str
    optimizer_cfg: Any
    lr_scheduler: str
    lr_scheduler_cfg: Any
    notices: tuple[str, ...] = ()  # logged at the start of the run (e.g. defaults that differ from fairseq's)
    # without --arch, --finetune-from's model: (its model name, its model config), the user's options over it
    base_model: tuple[str, dict] | None = None
