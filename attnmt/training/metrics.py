"""What training reports: per-interval sums of the loss and throughput, validation, and the best value so far."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnmt.criterions import reduce_metrics
from attnmt.data.batching import EpochBatchIterator
from attnmt.progress import RunLog, fmt_number, hms
from attnmt.training.config import TrainConfig
from attnmt.training.trainer import Trainer, global_sum

DIVERGED_BITS = 64.0  # a uniform guess over 2**64 words; a loss above it means divergence, not a hard task


class Meter:
    """Sums over one log interval; tensors stay on the device until the interval is reported."""

    def __init__(self, device: torch.device):
        self.device = device
        self.warned = False  # the divergence warning is given once
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.nll = torch.zeros((), dtype=torch.float64, device=self.device)
        self.gnorm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.ngnorm = 0
        self.ntokens = 0
        self.nsentences = 0
        self.updates = 0
        self.start = time.perf_counter()

    def add(self, log: dict) -> None:
        self.loss += log["loss"]
        self.nll += log["nll_loss"]
        if log["gnorm"] is not None:
            self.gnorm += log["gnorm"]
            self.ngnorm += 1
        self.ntokens += log["ntokens"]
        self.nsentences += log["nsentences"]
        self.updates += 0 if log["overflow"] else 1

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        loss, nll, ntok, nsent = global_sum([float(self.loss), float(self.nll), self.ntokens, self.nsentences],
                                            self.device)
        out = reduce_metrics(loss, nll, ntok)
        out.update(wps=ntok / elapsed, ups=self.updates / elapsed,
                   gnorm=float(self.gnorm) / max(self.ngnorm, 1), ntokens=int(ntok), nsentences=int(nsent))
        return out


def validate(trainer: Trainer, valid_sets: dict, extra: list[Callable[[torch.nn.Module], dict]]) -> dict[str, dict]:
    """Loss, NLL and perplexity on each validation split (plus the extra validators on the first one)."""
    results = {}
    for i, (split, (data, batches, _)) in enumerate(valid_sets.items()):
        loss = torch.zeros((), dtype=torch.float64, device=trainer.device)
        nll = torch.zeros((), dtype=torch.float64, device=trainer.device)
        ntok = 0
        for b in batches:
            log = trainer.valid_step(data.collate(b))
            loss += log["loss"]
            nll += log["nll_loss"]
            ntok += log["ntokens"]
        loss_f, nll_f, ntok_f = global_sum([float(loss), float(nll), ntok], trainer.device)
        metrics = reduce_metrics(loss_f, nll_f, ntok_f)
        metrics["ntokens"] = int(ntok_f)
        if i == 0:
            for fn in extra:
                metrics.update(fn(trainer.model))
        results[split] = metrics
    return results


@dataclass
class Best:
    """The best validation value so far and the patience counter (saved in every checkpoint)."""

    metric: str
    maximize: bool
    value: float | None = None
    num_updates: int = 0
    bad_validations: int = 0

    def update(self, value: float, num_updates: int) -> bool:
        better = self.value is None or (value > self.value if self.maximize else value < self.value)
        if better:
            self.value, self.num_updates, self.bad_validations = float(value), num_updates, 0
        else:
            self.bad_validations += 1
        return better

    def state(self) -> dict:
        return dataclasses.asdict(self)


def log_train(log: RunLog, meter: Meter, trainer: Trainer, itr: EpochBatchIterator, cfg: TrainConfig, n: int,
               start_updates: int, run_start: float, train_time: float) -> None:
    m = meter.report()
    meter.reset()
    ups_run = (n - start_updates) / max(time.perf_counter() - run_start, 1e-9)
    eta = None
    if ups_run > 0:
        per_epoch = math.ceil(len(itr) / cfg.update_freq)
        left = [cfg.max_update - n] if cfg.max_update else []
        if cfg.max_epoch:
            left.append((cfg.max_epoch - itr.epoch) * per_epoch + math.ceil((len(itr) - itr.offset) / cfg.update_freq))
        eta = min(left) / ups_run if left else None
    rec = {"type": "train", "epoch": itr.epoch, "num_updates": n, "loss": m["loss"], "nll_loss": m["nll_loss"],
           "ppl": m["ppl"], "lr": trainer.lr, "wps": m["wps"], "ups": m["ups"], "gnorm": m["gnorm"],
           "ntokens": m["ntokens"], "nsentences": m["nsentences"], "train_time": train_time, "eta_s": eta}
    log.record(rec)
    text = (f"epoch {itr.epoch} | update {n}{'/' + str(cfg.max_update) if cfg.max_update else ''} | "
            f"loss {m['loss']:.3f} | nll {m['nll_loss']:.3f} | ppl {fmt_number(m['ppl'])} | lr {trainer.lr:.3g} | "
            f"wps {m['wps']:.0f} | ups {m['ups']:.2f} | gnorm {m['gnorm']:.3f}"
            + (f" | eta {hms(eta)}" if eta is not None else ""))
    compact = (f"loss {m['loss']:.3f} ppl {fmt_number(m['ppl'])} lr {trainer.lr:.2e} wps {m['wps']:.0f} "
               f"ups {m['ups']:.2f} gnorm {m['gnorm']:.2f}")
    log.line(text, compact)
    if m["loss"] > DIVERGED_BITS and not meter.warned:
        meter.warned = True
        log.info(f"warning: training loss {fmt_number(m['loss'])} bits per token, far above what even a uniform guess "
                 f"over any vocabulary costs: training is diverging; lower --lr (now {fmt_number(trainer.lr)}) or "
                 f"add --clip-norm")
