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

import inspect
import math
from dataclasses import dataclass, field

import torch

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


def _accepts_output_mask(model) -> bool:
    """Whether the model (or the one inside a DDP wrapper) takes ``output_mask`` (see TransformerModel.forward)."""
    inner = getattr(model, "module", model)
    try:
        return "output_mask" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def _logits_and_target(model, batch, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (N, V) and targets (N,): only the non-padding positions when the model can select them."""
    net = batch["net_input"]
    target = batch["target"]
    if _accepts_output_mask(model):
        keep = target.ne(pad)
        logits = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], output_mask=keep)
        return logits, target[keep]  # (N, V), (N,)
    logits = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])  # (B, T, V)
    return logits.reshape(-1, logits.size(-1)), target.reshape(-1)


_BLOCK_ELEMENTS = 1 << 18  # logits per block and thread: 1 MB in fp32, so a block's passes stay in the L2 cache


def _row_blocks(n: int, vocab: int):
    step = max(1, _BLOCK_ELEMENTS * torch.get_num_threads() // max(vocab, 1))
    for i in range(0, n, step):
        yield slice(i, min(i + step, n))


class _SmoothedNLL(torch.autograd.Function):
    """Label-smoothed cross-entropy over logits, block of rows by block of rows, with its gradient written directly.

    Forward, per row in fp32: ``lp = log_softmax(x)``, then ``log p(y) = lp_y`` and ``sum_v lp_v``. Backward:
    ``d loss / d x = softmax(x) - q`` with the smoothed target ``q = (1 - eps) onehot(y) + eps / V``, zero on
    rows of weight 0 (padding). The blocks are small enough to stay in the L2 cache between the passes over
    them (conversion, log-softmax, sums); the full (N, V) logits are read once per direction. For bf16 logits
    the backward's softmax runs on bf16 in, bf16 out (fp32 inside the kernel): the gradient is bf16 anyway.
    """

    @staticmethod
    def forward(ctx, logits, target, weight, epsilon: float):
        n, vocab = logits.shape
        lp_y = torch.empty(n, 1, dtype=torch.float32, device=logits.device)  # log p(y) per row
        lp_sum = torch.empty(n, 1, dtype=torch.float32, device=logits.device)  # sum_v log p(v) per row
        buf = None
        for rows in _row_blocks(n, vocab):
            x = logits[rows]
            if x.dtype != torch.float32:
                if buf is None:
                    buf = torch.empty(rows.stop - rows.start, vocab, dtype=torch.float32, device=logits.device)
                x = buf[: rows.stop - rows.start].copy_(x)
            lp = torch.log_softmax(x, dim=-1)
            torch.gather(lp, 1, target[rows, None], out=lp_y[rows])
            if epsilon:
                torch.sum(lp, dim=-1, keepdim=True, out=lp_sum[rows])
        lp_y, lp_sum = lp_y.squeeze(1), lp_sum.squeeze(1)
        if weight is not None:
            lp_y, lp_sum = lp_y * weight, lp_sum * weight
        nll_sum = -lp_y.sum()
        if epsilon:
            loss = (1.0 - epsilon) * nll_sum - (epsilon / vocab) * lp_sum.sum()
        else:
            loss = nll_sum.clone()
        ctx.save_for_backward(logits, target, weight)
        ctx.epsilon = epsilon
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        logits, target, weight = ctx.saved_tensors
        eps = ctx.epsilon
        n, vocab = logits.shape
        # d/dx of (g_loss * loss + g_nll * nll) = (g_loss + g_nll) * p - g_loss * eps / V - ((1 - eps) g_loss + g_nll) onehot
        g_loss = float(grad_loss) if grad_loss is not None else 0.0
        g_nll = float(grad_nll) if grad_nll is not None else 0.0
        g_p = g_loss + g_nll
        grad = torch.empty_like(logits)
        if g_p == 0.0:  # e.g. a batch of weight 0 that only keeps distributed ranks in step
            grad.fill_(-g_loss * eps / vocab)
        else:
            shift = g_loss * eps / vocab / g_p
            for rows in _row_blocks(n, vocab):
                p = torch.softmax(logits[rows], dim=-1)  # (rows, V) in the logits' dtype
                if shift:
                    p.sub_(shift)
                torch.mul(p, g_p, out=grad[rows])
        hot = torch.full((n,), -((1.0 - eps) * g_loss + g_nll), dtype=grad.dtype, device=grad.device)
        offsets = torch.arange(n, device=grad.device) * vocab
        grad.view(-1).index_add_(0, offsets + target, hot)
        if weight is not None:
            grad.mul_(weight.to(grad.dtype)[:, None])
        return grad, None, None, None


def label_smoothed_nll_loss(lprobs: torch.Tensor, target: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL for fp32 ``lprobs`` (N, V) and ``target`` (N,): the reference formula.

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


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int,
                           epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, NLL sum) of ``logits`` (N, V), any float dtype, against ``target`` (N,); padding rows ignored.

    The same value as :func:`label_smoothed_nll_loss` on ``log_softmax(logits.float())`` of the non-padding rows,
    computed in fp32 by the one-pass kernel :class:`_SmoothedNLL`.
    """
    logits = logits.contiguous()
    keep = target.ne(pad)
    if bool(keep.all()):  # the training path: padding rows were never projected
        return _SmoothedNLL.apply(logits, target, None, float(epsilon))
    return _SmoothedNLL.apply(logits, target.masked_fill(~keep, 0), keep.float(), float(epsilon))


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
        logits, target = _logits_and_target(model, batch, self.pad)
        loss, nll = smoothed_cross_entropy(logits, target, self.pad, self.cfg.label_smoothing)
        return loss, _logging(loss, nll, batch)


@register("criterion", "cross_entropy", config=CrossEntropyConfig)
class CrossEntropy:
    """Plain token-level cross-entropy (negative log-likelihood); padding ignored."""

    def __init__(self, cfg: CrossEntropyConfig, pad: int):
        self.cfg = cfg
        self.pad = pad

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        logits, target = _logits_and_target(model, batch, self.pad)
        loss, _ = smoothed_cross_entropy(logits, target, self.pad, 0.0)
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
