"""Training criterions: label-smoothed cross-entropy (paper section 5.4), plain cross-entropy and R-Drop.

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

from attnmt.backends.precision import autocast_dtype, without_autocast
from attnmt.models.interface import unwrap
from attnmt.models.kernels import LossKernel, Projection
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


def _model_outputs(model, batch, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder features h (N, D) of the N non-padding target positions, the output projection W (V, D) and
    the targets (N,): the loss fuses the projection to the vocabulary (``model`` may be wrapped for DDP)."""
    net = batch["net_input"]
    target = batch["target"]
    keep = target.ne(pad)
    h = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], output_mask=keep, features_only=True)
    return h, unwrap(model).output_projection_weight(), target[keep]


_PROJECTION_ELEMENTS = 1 << 25  # logits per block of the fused output projection (64 MB in bf16)


def _row_blocks(n: int, vocab: int, block_elements: int | None):
    """Row slices of at most ``block_elements`` logits (None or 0: all rows at once; the backend chooses)."""
    step = max(1, block_elements // max(vocab, 1)) if block_elements else max(n, 1)
    for i in range(0, n, step):
        yield slice(i, min(i + step, n))


class _Scratch:
    """An fp32 buffer for one block of rows, allocated on first use and reused for every block."""

    def __init__(self):
        self.buf = None

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return x
        if self.buf is None or self.buf.size(0) < x.size(0) or self.buf.size(1) != x.size(1):
            self.buf = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return self.buf[: x.size(0)].copy_(x)


def _loss_rows(logits: torch.Tensor, target: torch.Tensor, epsilon: float, lp_y: torch.Tensor,
               lp_sum: torch.Tensor, grad: torch.Tensor | None, scratch: _Scratch,
               block_elements: int | None = None) -> None:
    """For logits (R, V), L2-cache-sized block by block: ``lp_y`` (R, 1) = log p(y), ``lp_sum`` (R, 1) =
    sum_v log p(v) (fp32), and when ``grad`` (R, V) is given, ``grad = p - eps / V`` (the target's
    ``- (1 - eps)`` is left to the caller). ``grad`` may be ``logits`` itself: each block is read before its
    gradient overwrites it."""
    n, vocab = logits.shape
    for rows in _row_blocks(n, vocab, block_elements):
        lp = torch.log_softmax(scratch.fp32(logits[rows]), dim=-1)
        torch.gather(lp, 1, target[rows, None], out=lp_y[rows])
        if epsilon:
            torch.sum(lp, dim=-1, keepdim=True, out=lp_sum[rows])
        if grad is not None:
            torch.exp(lp, out=grad[rows]).sub_(epsilon / vocab)


def _smoothed_rows(logits: torch.Tensor, target: torch.Tensor, epsilon: float, lp_y: torch.Tensor,
                   lp_sum: torch.Tensor, grad: torch.Tensor | None, scratch: _Scratch, block_elements: int | None,
                   kernel: LossKernel | None) -> None:
    """:meth:`LossKernel.smoothed_rows` by ``kernel`` where it takes the logits, else by PyTorch's passes."""
    if kernel is not None and kernel.supports(logits):
        kernel.smoothed_rows(logits, target, epsilon, lp_y, lp_sum, grad)
        return
    _loss_rows(logits, target, epsilon, lp_y, lp_sum, grad, scratch, block_elements)
    if grad is not None:
        _add_at_targets(grad, target, -(1.0 - epsilon))


def _add_at_targets(x: torch.Tensor, target: torch.Tensor, value: float | torch.Tensor) -> None:
    """``x[i, target[i]] += value`` for every row i, in place (``value``: a number or a 0-dim tensor)."""
    n, vocab = x.shape
    offsets = torch.arange(n, device=x.device) * vocab + target
    values = (value.to(x.dtype).expand(n) if torch.is_tensor(value)
              else torch.full((n,), value, dtype=x.dtype, device=x.device))
    x.view(-1).index_add_(0, offsets, values)


def _sums(lp_y: torch.Tensor, lp_sum: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
          vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp_y, lp_sum = lp_y.squeeze(1), lp_sum.squeeze(1)
    if weight is not None:
        lp_y, lp_sum = lp_y * weight, lp_sum * weight
    nll_sum = -lp_y.sum()
    if not epsilon:
        return nll_sum.clone(), nll_sum
    return (1.0 - epsilon) * nll_sum - (epsilon / vocab) * lp_sum.sum(), nll_sum


class _SmoothedNLL(torch.autograd.Function):
    """Label-smoothed cross-entropy over logits, with its gradient made in the same pass.

    Per row in fp32: ``lp = log_softmax(x)`` gives ``log p(y) = lp_y`` and ``sum_v lp_v``; when the logits need a
    gradient, ``G = softmax(x) - q = exp(lp) - q`` with the smoothed target ``q = (1 - eps) onehot(y) + eps / V``
    is written right away (in the logits' dtype), while the block is still in cache: ``d loss / d x = G`` (times
    the row weight, 0 on padding). Backward then only scales it by the incoming gradient. The blocks are small
    enough to stay in the L2 cache between the passes over them (conversion, log-softmax, sums, exp); the full
    (N, V) logits are read once and the gradient written once, with no second softmax in the backward pass.
    """

    @staticmethod
    def forward(ctx, logits, target, weight, epsilon: float, block_elements: int | None = None):
        n, vocab = logits.shape
        lp_y = torch.empty(n, 1, dtype=torch.float32, device=logits.device)
        lp_sum = torch.empty(n, 1, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None  # d loss / d logits
        _smoothed_rows(logits, target, epsilon, lp_y, lp_sum, grad, _Scratch(), block_elements, None)
        if grad is not None:
            if weight is not None:
                grad.mul_(weight.to(grad.dtype)[:, None])
        ctx.save_for_backward(grad, target, weight)
        ctx.epsilon = epsilon
        ctx.set_materialize_grads(False)  # an output not backpropagated gets None: no work, no device sync
        return _sums(lp_y, lp_sum, weight, epsilon, vocab)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad, target, weight = ctx.saved_tensors
        eps = ctx.epsilon
        # d nll / dx = p - onehot = G + (q - onehot) = G + eps / V - eps onehot, hence
        # d (g_loss loss + g_nll nll) / dx = (g_loss + g_nll) G + g_nll (eps / V - eps onehot)
        # (the incoming gradients stay tensors: reading them on the host would wait for the device)
        out = grad * _incoming(grad_loss, grad_nll, grad.dtype)
        if grad_nll is not None and eps:
            extra = (grad_nll * (eps / grad.size(1))).to(out.dtype).expand_as(out).clone()
            _add_at_targets(extra, target, grad_nll * -eps)
            if weight is not None:
                extra.mul_(weight.to(extra.dtype)[:, None])
            out += extra
        return out, None, None, None, None


class _ProjectedSmoothedNLL(torch.autograd.Function):
    """The output projection ``logits = h W^T`` (paper 3.4) fused with the label-smoothed loss.

    Rows go through in blocks (a whole batch at once for a 10k vocabulary; ``_PROJECTION_ELEMENTS`` bounds the
    block's logits): the block's logits are computed (by the backend's ``projection``, ``a @ b^T``, where it gave
    one for fp32), turned into loss sums and, in place, into the gradient
    ``G = softmax - q`` (as in :class:`_SmoothedNLL`, in cache-sized pieces) and multiplied back, ``dh = G W``.
    G is kept (in the compute dtype) for the weight gradient ``dW = G^T h``, made in the backward pass. Backward
    then scales ``dh`` (N x D) and ``dW`` (V x D) by the incoming gradient, not the (N x V) G, and ``dW`` is
    computed in the layout its dtype's product runs fastest (:func:`_projection_weight_grad`). (Smaller row
    blocks, to keep the logits in cache, made the projection itself slower: each block streams the whole weight
    again.) ``kernel``: the backend's compiled :class:`LossKernel`, or None for PyTorch's passes. Under autocast,
    h and W are cast to the autocast dtype (bf16): the same products a ``Linear`` would run.
    """

    @staticmethod
    def forward(ctx, h, weight, target, epsilon: float, dtype, block_elements: int | None = None,
                projection: Projection | None = None, kernel: LossKernel | None = None):
        n, _ = h.shape
        vocab = weight.size(0)
        hc, wc = h.to(dtype), weight.to(dtype)
        lp_y = torch.empty(n, 1, dtype=torch.float32, device=h.device)
        lp_sum = torch.empty(n, 1, dtype=torch.float32, device=h.device)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        step = max(256, _PROJECTION_ELEMENTS // vocab)
        # G (N, V): one block's logits become G in place; several blocks' are gathered into one buffer
        grad = torch.empty(n, vocab, dtype=dtype, device=h.device) if need_grad and step < n else None
        grad_h = torch.empty_like(hc) if need_grad else None  # G W (N, D)
        scratch = _Scratch()
        if dtype != torch.float32:
            projection = None  # the backend's product is for fp32 (CPUs where oneDNN outruns MKL)
        wct = wc.t().contiguous() if projection is not None and need_grad else None
        with without_autocast(h):
            for i in range(0, n, step):
                rows = slice(i, min(i + step, n))
                if projection is not None:
                    logits = projection(hc[rows], wc)
                else:
                    logits = torch.mm(hc[rows], wc.t())  # (R, V)
                g = logits if need_grad else None
                _smoothed_rows(logits, target[rows], epsilon, lp_y[rows], lp_sum[rows], g, scratch, block_elements,
                               kernel)
                if g is not None:
                    if projection is not None:
                        grad_h[rows] = projection(g, wct)
                    else:
                        torch.mm(g, wc, out=grad_h[rows])
                    if grad is None:
                        grad = g
                    else:
                        grad[rows] = g
        ctx.save_for_backward(hc, wc, grad, grad_h, target)
        ctx.epsilon = epsilon
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.set_materialize_grads(False)  # an output not backpropagated gets None: no work, no device sync
        return _sums(lp_y, lp_sum, None, epsilon, vocab)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        hc, wc, grad, grad_h, target = ctx.saved_tensors
        eps = ctx.epsilon
        h_dtype, w_dtype = ctx.dtypes
        scale = _incoming(grad_loss, grad_nll, torch.float32)  # a tensor: reading it would wait for the device
        d_h = d_w = None
        with without_autocast(hc):
            if ctx.needs_input_grad[0]:
                d_h = grad_h.float().mul_(scale)
            if ctx.needs_input_grad[1]:
                d_w = _projection_weight_grad(grad, hc).mul_(scale)
            if grad_nll is not None and eps:
                # the nll's own gradient adds g_nll (q - onehot) = g_nll eps (1 / V - onehot) to the logits'
                g = grad_nll.float() * eps
                vocab = wc.size(0)
                if d_h is not None:
                    d_h += g * (wc.float().mean(0) - wc.float()[target])
                if d_w is not None:
                    d_w += (g / vocab) * hc.float().sum(0)
                    d_w.index_add_(0, target, hc.float() * -g)
        d_h = d_h.to(h_dtype) if d_h is not None else None
        d_w = d_w.to(w_dtype) if d_w is not None else None
        return d_h, d_w, None, None, None, None, None, None


def _incoming(grad_loss: torch.Tensor | None, grad_nll: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``g_loss + g_nll``, the scale of ``G`` in backward, as a 0-dim tensor of ``dtype`` (None counts as 0)."""
    grads = [g for g in (grad_loss, grad_nll) if g is not None]
    return sum(grads[1:], grads[0]).to(dtype) if grads else torch.zeros((), dtype=dtype)


def _projection_weight_grad(grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``G^T h`` (V, D) in fp32 for G (N, V) and h (N, D), in the layout each dtype's product runs fastest: fp32
    (MKL) reads G transposed as it is; bf16 (oneDNN) is faster as ``(h^T G)^T`` with h^T made contiguous
    (measured in docs/experiments.md)."""
    if grad.dtype == torch.float32:
        return torch.mm(grad.t(), h)
    d_w = torch.empty(grad.size(1), h.size(1), dtype=torch.float32, device=h.device)
    return d_w.copy_(torch.mm(h.t().contiguous(), grad).t())


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


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pad: int, epsilon: float,
                           block_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, NLL sum) of ``logits`` (N, V), any float dtype, against ``target`` (N,); padding rows ignored.

    The same value as :func:`label_smoothed_nll_loss` on ``log_softmax(logits.float())`` of the non-padding rows,
    computed in fp32 by the one-pass kernel :class:`_SmoothedNLL`.
    """
    logits = logits.contiguous()
    keep = target.ne(pad)
    if bool(keep.all()):  # the training path: padding rows were never projected
        return _SmoothedNLL.apply(logits, target, None, float(epsilon), block_elements)
    return _SmoothedNLL.apply(logits, target.masked_fill(~keep, 0), keep.float(), float(epsilon), block_elements)


def projected_smoothed_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, epsilon: float,
                                     block_elements: int | None = None, projection: Projection | None = None,
                                     kernel: LossKernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, NLL sum) of the logits ``h @ weight.T`` for features ``h`` (N, D), projection ``weight`` (V, D)
    and ``target`` (N,) (no padding rows), without materializing the (N, V) logits: see
    :class:`_ProjectedSmoothedNLL`. Under autocast the products run in the autocast dtype."""
    dtype = autocast_dtype(h) or h.dtype
    return _ProjectedSmoothedNLL.apply(h, weight, target, float(epsilon), dtype, block_elements, projection, kernel)


def _loss(model, batch, pad: int, epsilon: float, kernels: BlockedLoss) -> tuple[torch.Tensor, torch.Tensor]:
    h, weight, target = _model_outputs(model, batch, pad)
    return projected_smoothed_cross_entropy(h, weight, target, epsilon, kernels.block_elements,
                                            kernels.projection, kernels.loss_kernel)


class BlockedLoss:
    """Mixin of criterions whose kernels the backend tunes (``Backend.prepare_criterion``): they go through the
    logits in blocks of ``block_elements`` (cache-sized blocks per CPU thread on the CPU; None: the whole batch at
    once, as on a GPU), with ``projection`` run the fp32 vocabulary projection's products (``a @ b^T``; oneDNN's on
    CPUs where it outruns MKL; None: ``torch.mm``), and with ``loss_kernel`` make the loss and its gradient from
    the logits in one compiled call (:class:`LossKernel`)."""

    block_elements: int | None = None
    projection: Projection | None = None
    loss_kernel: LossKernel | None = None


def _logging(loss: torch.Tensor, nll: torch.Tensor, batch) -> dict:
    return {
        "loss": loss.detach(),
        "nll_loss": nll.detach(),
        "ntokens": batch["ntokens"],
        "nsentences": batch["nsentences"],
        "sample_size": batch["ntokens"],
    }


@register("criterion", "label_smoothed_cross_entropy", config=LabelSmoothedCrossEntropyConfig)
class LabelSmoothedCrossEntropy(BlockedLoss):
    """Cross-entropy against label-smoothed targets (paper 5.4, eps = 0.1); padding ignored."""

    def __init__(self, cfg: LabelSmoothedCrossEntropyConfig, pad: int):
        self.cfg = cfg
        self.pad = pad

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        loss, nll = _loss(model, batch, self.pad, self.cfg.label_smoothing, self)
        return loss, _logging(loss, nll, batch)


@dataclass
class RDropConfig(LabelSmoothedCrossEntropyConfig):
    rdrop_alpha: float = field(
        default=0.0, metadata={"help": "weight of the symmetric KL divergence between the two dropout passes of "
                                       "R-Drop (Liang et al. 2021 use 5 for translation; fairseq's default 0 "
                                       "trains as label_smoothed_cross_entropy)"})

    def __post_init__(self):
        super().__post_init__()
        if not self.rdrop_alpha >= 0.0:
            raise ValueError(f"--rdrop-alpha {self.rdrop_alpha} is negative; use 0 (off) or a positive weight such "
                             f"as 5")


def _twice(batch: dict) -> dict:
    """The batch's sentences twice, one copy after the other (each copy gets its own dropout masks)."""
    net = batch["net_input"]
    return {**batch, "target": batch["target"].repeat(2, 1),
            "net_input": {k: v.repeat(2, *([1] * (v.dim() - 1))) for k, v in net.items()}}


def rdrop_loss(lprobs: torch.Tensor, target: torch.Tensor, epsilon: float,
               alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """R-Drop's objective for fp32 ``lprobs`` (2N, V) of the same N target tokens under two dropout masks (the
    first N rows one pass, the last N the other) and ``target`` (2N,): the label-smoothed loss of both passes plus
    ``alpha`` times the symmetric KL divergence ``(KL(p1 || p2) + KL(p2 || p1)) / 2``, halved so that it is a sum
    over N tokens like the other criterions' (fairseq divides the same sum by 2N). Returns (loss sum, NLL sum)."""
    loss, nll = label_smoothed_nll_loss(lprobs, target, epsilon)
    p, q = lprobs.chunk(2)
    kl = torch.nn.functional.kl_div(p, q, reduction="sum", log_target=True)  # KL(q || p)
    kl = kl + torch.nn.functional.kl_div(q, p, reduction="sum", log_target=True)  # + KL(p || q)
    return (loss + alpha * kl / 2) / 2, nll / 2


@register("criterion", "label_smoothed_cross_entropy_with_rdrop", config=RDropConfig)
class RDropLabelSmoothedCrossEntropy(LabelSmoothedCrossEntropy):
    """R-Drop (Liang et al. 2021): two dropout passes per batch, their symmetric KL added to the smoothed loss.

    Every training batch runs twice through the model, with different dropout masks, and the loss adds the two
    passes' symmetric KL divergence to their label-smoothed cross-entropies, so the model learns to agree with
    itself whatever dropout removes. An update costs about twice the compute of one without it. Evaluation (no
    dropout) gives exactly label_smoothed_cross_entropy's loss, and so does ``--rdrop-alpha 0`` in training
    (fairseq's behaviour)."""

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        if not (model.training and self.cfg.rdrop_alpha > 0):
            return super().__call__(model, batch)
        h, weight, target = _model_outputs(model, _twice(batch), self.pad)
        logits = torch.mm(h, weight.t())  # (2N, V): the KL term needs both passes' whole distributions
        lprobs = torch.log_softmax(logits.float(), dim=-1)
        loss, nll = rdrop_loss(lprobs, target, self.cfg.label_smoothing, self.cfg.rdrop_alpha)
        return loss, _logging(loss, nll, batch)


@register("criterion", "cross_entropy", config=CrossEntropyConfig)
class CrossEntropy(BlockedLoss):
    """Plain token-level cross-entropy (negative log-likelihood); padding ignored."""

    def __init__(self, cfg: CrossEntropyConfig, pad: int):
        self.cfg = cfg
        self.pad = pad

    def __call__(self, model, batch) -> tuple[torch.Tensor, dict]:
        loss, _ = _loss(model, batch, self.pad, 0.0, self)
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
