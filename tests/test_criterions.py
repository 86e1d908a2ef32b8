"""Criterions: label smoothing against a hand computation, padding ignored, plain CE, metric reduction."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import small_batch, small_model

from attnmt.criterions import (
    CrossEntropy,
    CrossEntropyConfig,
    LabelSmoothedCrossEntropy,
    LabelSmoothedCrossEntropyConfig,
    reduce_metrics,
    smoothed_cross_entropy,
)
from attnmt.errors import UserError

PAD = 1


class FixedLogits(torch.nn.Module):
    """A 'model' with given logits: its features are the logits and its output projection the identity, which
    reproduces them exactly (the criterion calls only ``forward`` and ``output_projection_weight``)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, src_tokens, src_lengths, prev_output_tokens, output_mask=None, features_only=False):
        assert features_only
        return self.logits[output_mask]

    def output_projection_weight(self):
        return torch.eye(self.logits.size(-1))


def _batch(target):
    ntok = int(target.ne(PAD).sum())
    return {"net_input": {"src_tokens": None, "src_lengths": None, "prev_output_tokens": None},
            "target": target, "ntokens": ntok, "nsentences": target.size(0)}


def test_label_smoothing_matches_hand_computation():
    torch.manual_seed(0)
    V, eps = 7, 0.1
    logits = torch.randn(2, 3, V)
    target = torch.tensor([[4, 5, 2], [6, 2, PAD]])
    loss, log = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(eps), PAD)(FixedLogits(logits), _batch(target))
    # by hand: q = (1-eps) onehot + eps/V; loss = sum over real tokens of -sum_v q_v log p_v
    expected = 0.0
    expected_nll = 0.0
    for b in range(2):
        for t in range(3):
            y = int(target[b, t])
            if y == PAD:
                continue
            logp = torch.log_softmax(logits[b, t].double(), -1)
            q = torch.full((V,), eps / V, dtype=torch.float64)
            q[y] += 1 - eps
            expected += float(-(q * logp).sum())
            expected_nll += float(-logp[y])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(log["nll_loss"]) == pytest.approx(expected_nll, rel=1e-6)
    assert log["ntokens"] == 5 and log["sample_size"] == 5


def test_padding_positions_do_not_change_the_loss():
    torch.manual_seed(1)
    logits = torch.randn(1, 4, 9)
    target = torch.tensor([[3, 4, 2, PAD]])
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)
    a, _ = crit(FixedLogits(logits), _batch(target))
    changed = logits.clone()
    changed[0, 3] = torch.randn(9) * 100  # garbage at the padded position
    b, _ = crit(FixedLogits(changed), _batch(target))
    assert torch.equal(a, b)
    # and the loss equals the one of the unpadded sentence
    c, _ = crit(FixedLogits(logits[:, :3]), _batch(target[:, :3]))
    assert torch.allclose(a, c)


def test_cross_entropy_equals_torch_and_zero_smoothing():
    torch.manual_seed(2)
    logits = torch.randn(3, 5, 11)
    target = torch.randint(2, 11, (3, 5))
    target[0, 3:] = PAD
    ce, log = CrossEntropy(CrossEntropyConfig(), PAD)(FixedLogits(logits), _batch(target))
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), ignore_index=PAD, reduction="sum")
    assert torch.allclose(ce, ref)
    assert torch.allclose(log["nll_loss"], ref)
    ls0, _ = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.0), PAD)(FixedLogits(logits), _batch(target))
    assert torch.allclose(ls0, ref)


@pytest.mark.precision
def test_loss_is_fp32_under_bf16_autocast():
    logits = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    target = torch.tensor([[3, 4, 2], [5, 2, PAD]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)(FixedLogits(logits),
                                                                                       _batch(target))
    assert loss.dtype == torch.float32


def test_reduce_metrics_base2_and_ppl():
    m = reduce_metrics(loss_sum=10 * math.log(2) * 3.0, nll_sum=10 * math.log(2) * 2.0, ntokens=10)
    assert m["loss"] == pytest.approx(3.0)
    assert m["nll_loss"] == pytest.approx(2.0)
    assert m["ppl"] == pytest.approx(4.0)  # 2 ** 2 == exp(nll in nats)


def test_label_smoothing_out_of_range_is_a_user_error():
    from attnmt.config import make_config

    with pytest.raises(UserError, match="label-smoothing"):
        make_config(LabelSmoothedCrossEntropyConfig, {"label_smoothing": 1.5})


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_loss_gradient_equals_autograd_reference(eps):
    from attnmt.criterions import label_smoothed_nll_loss, smoothed_cross_entropy

    torch.manual_seed(3)
    logits = torch.randn(10, 13, requires_grad=True)
    target = torch.randint(2, 13, (10,))
    target[[1, 7]] = PAD
    loss, nll = smoothed_cross_entropy(logits, target, PAD, eps)
    (2.5 * loss).backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    keep = target.ne(PAD)
    ref_loss, ref_nll = label_smoothed_nll_loss(torch.log_softmax(ref_logits[keep], -1), target[keep], eps)
    (2.5 * ref_loss).backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-6) and torch.allclose(nll, ref_nll, rtol=1e-6)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    assert torch.count_nonzero(logits.grad[[1, 7]]) == 0  # padding rows get no gradient
    # the NLL's own gradient (a loss mixing both outputs), padding rows weighted 0
    logits.grad = ref_logits.grad = None
    loss, nll = smoothed_cross_entropy(logits, target, PAD, eps)
    (0.7 * loss + 0.3 * nll).backward()
    ref_loss, ref_nll = label_smoothed_nll_loss(torch.log_softmax(ref_logits[keep], -1), target[keep], eps)
    (0.7 * ref_loss + 0.3 * ref_nll).backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    assert torch.count_nonzero(logits.grad[[1, 7]]) == 0


@pytest.mark.precision
def test_fused_loss_on_bf16_logits_gives_bf16_gradient_close_to_fp32():
    from attnmt.criterions import smoothed_cross_entropy

    torch.manual_seed(4)
    base = torch.randn(6, 40)
    target = torch.randint(2, 40, (6,))
    x32 = base.clone().requires_grad_(True)
    x16 = base.to(torch.bfloat16).requires_grad_(True)
    l32, _ = smoothed_cross_entropy(x32, target, PAD, 0.1)
    l16, _ = smoothed_cross_entropy(x16, target, PAD, 0.1)
    l32.backward()
    l16.backward()
    assert l16.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16
    assert float(l16.detach()) == pytest.approx(float(l32.detach()), rel=1e-2)
    assert torch.allclose(x16.grad.float(), x32.grad, atol=1e-2)


# ------------------------------------------------------- fused and blocked kernels against the reference formula

def test_criterion_with_fused_projection_equals_full_logits_loss_and_gradients():
    """The criterion's fused projection + loss over the selected positions = the reference formula applied to
    the model's full teacher-forced logits: same loss, NLL and parameter gradients."""
    from attnmt.criterions import label_smoothed_nll_loss

    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)
    b = small_batch()
    net = b["net_input"]
    a_model, b_model = small_model(), small_model()
    a_model.eval(), b_model.eval()
    loss_a, log_a = crit(a_model, b)
    full = b_model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])  # (B, T, V)
    keep = b["target"].ne(PAD)
    loss_b, nll_b = label_smoothed_nll_loss(torch.log_softmax(full[keep], -1), b["target"][keep], 0.1)
    loss_a.backward()
    loss_b.backward()
    assert torch.allclose(loss_a, loss_b, rtol=1e-5) and torch.allclose(log_a["nll_loss"], nll_b, rtol=1e-5)
    for (name, pa), pb in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_loss_matches_reference_across_blocks(dtype):
    """Rows split over several blocks (a tiny block size) give the reference loss and gradient."""
    torch.manual_seed(5)
    base = torch.randn(11, 37) * 3
    target = torch.randint(2, 37, (11,))
    logits = base.to(dtype).requires_grad_(True)
    loss, nll = smoothed_cross_entropy(logits, target, PAD, 0.1, 40)  # 40 logits per block: 1-2 rows of 37
    (0.3 * loss).backward()
    ref = base.to(dtype).float().requires_grad_(True)
    lp = torch.log_softmax(ref.double(), -1)
    ref_nll = -lp.gather(1, target[:, None]).sum()
    ref_loss = 0.9 * ref_nll - 0.1 / 37 * lp.sum()
    (0.3 * ref_loss).backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert float(nll.detach()) == pytest.approx(float(ref_nll.detach()), rel=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 3e-3
    assert torch.allclose(logits.grad.float(), ref.grad, atol=tol)


@pytest.mark.precision
@pytest.mark.parametrize("bf16", [False, True])
def test_projected_loss_equals_projection_then_loss_with_nll_gradient(monkeypatch, bf16):
    """The fused projection + loss gives the reference values and gradients, also for the NLL output and over
    several row blocks."""
    import attnmt.criterions as C

    monkeypatch.setattr(C, "_PROJECTION_ELEMENTS", 97 * 300)  # row blocks of 300 (at least 256)
    torch.manual_seed(7)
    h = torch.randn(700, 32, requires_grad=True)
    w = torch.randn(97, 32, requires_grad=True)
    t = torch.randint(2, 97, (700,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, nll = C.projected_smoothed_cross_entropy(h, w, t, 0.1)
    (0.5 * loss + 0.25 * nll).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = h @ w.t()
    lp = torch.log_softmax(logits.double(), -1)
    ref_nll = -lp.gather(1, t[:, None]).sum()
    ref_loss = 0.9 * ref_nll - 0.1 / 97 * lp.sum()
    (0.5 * ref_loss + 0.25 * ref_nll).backward()
    assert loss.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert float(nll.detach()) == pytest.approx(float(ref_nll.detach()), rel=1e-5)
    tol = 2e-2 if bf16 else 1e-5
    assert torch.allclose(gh, h.grad, atol=tol * h.grad.abs().max())
    assert torch.allclose(gw, w.grad, atol=tol * w.grad.abs().max())


def test_projected_loss_without_gradients_keeps_nothing_large():
    from attnmt.criterions import projected_smoothed_cross_entropy

    torch.manual_seed(8)
    h, w, t = torch.randn(50, 16), torch.randn(40, 16), torch.randint(0, 40, (50,))
    with torch.no_grad():
        loss, nll = projected_smoothed_cross_entropy(h, w, t, 0.1)
    ref, ref_nll = smoothed_cross_entropy(h @ w.t(), t, -1, 0.1)
    assert torch.allclose(loss, ref) and torch.allclose(nll, ref_nll)


# ------------------------------------------------------------------------------------------------------- R-Drop

def test_rdrop_loss_matches_hand_computation():
    """Two passes' smoothed cross-entropies plus alpha times their symmetric KL, halved (a sum over N tokens)."""
    from attnmt.criterions import rdrop_loss

    torch.manual_seed(4)
    n, V, eps, alpha = 5, 7, 0.1, 5.0
    lp = torch.log_softmax(torch.randn(2 * n, V, dtype=torch.float64), -1)
    target = torch.randint(0, V, (n,)).repeat(2)
    loss, nll = rdrop_loss(lp, target, eps, alpha)
    q = torch.full((2 * n, V), eps / V, dtype=torch.float64)
    q[torch.arange(2 * n), target] += 1 - eps
    ce = -(q * lp).sum()
    p1, p2 = lp[:n].exp(), lp[n:].exp()
    kl12 = (p1 * (lp[:n] - lp[n:])).sum()
    kl21 = (p2 * (lp[n:] - lp[:n])).sum()
    assert float(loss) == pytest.approx(float(ce + alpha * (kl12 + kl21) / 2) / 2, rel=1e-9)
    assert float(nll) == pytest.approx(float(-lp[torch.arange(2 * n), target].sum()) / 2, rel=1e-9)


def test_rdrop_without_dropout_equals_label_smoothing_and_its_gradients():
    """With no dropout both passes are the same, the KL term is 0 and its gradient too: R-Drop's loss and gradients
    equal label_smoothed_cross_entropy's. The two copies' rows must line up for that (a shifted copy gives KL > 0)."""
    from attnmt.criterions import RDropConfig, RDropLabelSmoothedCrossEntropy

    b = small_batch()
    a_model, b_model = small_model(), small_model()
    a_model.train(), b_model.train()
    loss_a, log_a = RDropLabelSmoothedCrossEntropy(RDropConfig(0.1, rdrop_alpha=5.0), PAD)(a_model, b)
    loss_b, log_b = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)(b_model, b)
    loss_a.backward()
    loss_b.backward()
    assert torch.allclose(loss_a, loss_b, rtol=1e-5) and torch.allclose(log_a["nll_loss"], log_b["nll_loss"], rtol=1e-5)
    assert log_a["ntokens"] == b["ntokens"]
    for (name, pa), pb in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5), name


def test_rdrop_with_dropout_adds_the_disagreement_of_two_masks():
    """With dropout the two passes differ: the training loss exceeds the one without the KL term (alpha 0, which is
    exactly label_smoothed_cross_entropy from the same random state), and evaluation has no KL term at all."""
    from attnmt.criterions import RDropConfig, RDropLabelSmoothedCrossEntropy

    b = small_batch()
    model = small_model(dropout=0.3)
    model.train()
    torch.manual_seed(7)
    off, _ = RDropLabelSmoothedCrossEntropy(RDropConfig(0.1, rdrop_alpha=0.0), PAD)(model, b)
    torch.manual_seed(7)
    plain, _ = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)(model, b)
    assert torch.equal(off, plain)
    crit = RDropLabelSmoothedCrossEntropy(RDropConfig(0.1, rdrop_alpha=5.0), PAD)
    torch.manual_seed(7)
    with_kl, _ = crit(model, b)
    torch.manual_seed(7)
    ce_only, _ = RDropLabelSmoothedCrossEntropy(RDropConfig(0.1, rdrop_alpha=1e-9), PAD)(model, b)  # same masks
    assert float(with_kl.detach()) > float(ce_only.detach()) + 1e-3
    model.eval()
    assert torch.allclose(crit(model, b)[0], LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)(model, b)[0])


def test_rdrop_alpha_negative_is_a_user_error():
    from attnmt.config import make_config
    from attnmt.criterions import RDropConfig

    with pytest.raises(UserError, match="--rdrop-alpha -1.0 is negative"):
        make_config(RDropConfig, {"rdrop_alpha": -1.0})
