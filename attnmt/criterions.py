"""Training criterions: label-smoothed cross-entropy (paper section 5.4) and plain cross-entropy.

A criterion is called as ``criterion(model, batch) -> (loss_sum, logging)``. It returns the loss SUMMED over the
non-padding target tokens; the trainer divides by the (global) number of target tokens of the whole update, so the
gradient does not depend on how the update was split into micro-batches or ranks.

Both criterions compute ``log_softmax`` in fp32 even under bf16/fp16 autocast: a softmax over a 10k-40k vocabulary
in bf16 loses too much precision for a loss and its gradient.

Logged figures follow fairseq's convention so that numbers can be compared with fairseq logs: ``loss`` and
``nll_loss`` are reported in BASE 2 (bits per target token) and perplexity is ``ppl = 2 ** nll_loss`` (which equals
``exp`` of the natural-log NLL). The raw sums in ``logging`` are in nats; :func:`reduce_metrics` converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnmt.registry import register

LN2 = math.log(2.0)


@dataclass
class LabelSmoothedCrossEntropyConfig:
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon of label smoothing (paper 5.4: 0.1); 0 gives plain cross-entropy"})

    def __post_init__(self):
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing {self.label_smoothing} is out of range; use a value in [0, 1)")


@dataclass
class CrossEntropyConfig:
    pass


def _flat_logits_and_target(model, batch, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model and keep only non-padding target positions (the loss never sees padding)."""
    net = batch["net_input"]
    logits = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])  # (B, T, V)
    target = batch["target"]  # (B, T)
    keep = target.ne(pad)
    return logits[keep], target[keep]  # (N, V), (N,)


def label_smoothed_nll_loss(lprobs: torch.Tensor, target: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL for fp32 ``lprobs`` (N, V) and ``target`` (N,).

    The smoothed target distribution is q = (1 - eps) * onehot(y) + eps / V (uniform over the whole vocabulary,
    Szegedy et al. 2016, as in the paper). The cross-entropy against q is
    ``(1 - eps) * nll + eps / V * smooth`` with ``nll = -log p(y)`` and ``smooth = -sum_v log p(v)``.
    """
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (N,)
    nll_sum = nll.sum()
    if epsilon == 0.0:
        return nll_sum, nll_sum
    smooth_sum = -lprobs.sum()
    vocab = lprobs.size(-1)
    loss = (1.0 - epsilon) * nll_sum + (epsilon / vocab) * smooth_sum
    return loss, nll_sum


def _logging(loss: torch.Tensor, nll: torch.Tensor, batch) -> dict:
    return {
        "loss": loss.detach(),
        "nll_loss": nll.detach(),
        "ntokens": batch["ntokens"],
        "nsentences": batch["nsentences"],
        "sample_size": batch["ntokens"],
    }


@register("criterion", "label_smoothed_cross_entropy", config=LabelSmoothedCrossEntropyConfig)
class LabelSmoothedCrossEntropy:
    """Cross-entropy against label-smoothed targets (paper 5.4, eps = 0.1); padding ignored."""

    def __init__(self, cfg: LabelSmoothedCrossEntropyConfig, pad: int):
        self.cfg = cfg
        self.pad = pad

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        logits, target = _flat_logits_and_target(model, batch, self.pad)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        loss, nll = label_smoothed_nll_loss(lprobs, target, self.cfg.label_smoothing)
        return loss, _logging(loss, nll, batch)


@register("criterion", "cross_entropy", config=CrossEntropyConfig)
class CrossEntropy:
    """Plain token-level cross-entropy (negative log-likelihood); padding ignored."""

    def __init__(self, cfg: CrossEntropyConfig, pad: int):
        self.cfg = cfg
        self.pad = pad

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        logits, target = _flat_logits_and_target(model, batch, self.pad)
        loss = F.cross_entropy(logits.float(), target, reduction="sum")
        return loss, _logging(loss, loss, batch)


def build_criterion(name: str, cfg, pad: int):
    from attnmt.registry import get

    return get("criterion", name).obj(cfg, pad)


def reduce_metrics(loss_sum: float, nll_sum: float, ntokens: float) -> dict[str, float]:
    """Per-token loss and NLL in base 2 and perplexity 2**nll (fairseq's convention)."""
    n = max(float(ntokens), 1.0)
    loss = float(loss_sum) / n / LN2
    nll = float(nll_sum) / n / LN2
    return {"loss": loss, "nll_loss": nll, "ppl": 2.0 ** min(nll, 1000.0)}
