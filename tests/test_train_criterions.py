"""Criterions: label smoothing against a hand computation, padding ignored, plain CE, metric reduction."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnmt.criterions import (
    CrossEntropy,
    CrossEntropyConfig,
    LabelSmoothedCrossEntropy,
    LabelSmoothedCrossEntropyConfig,
    reduce_metrics,
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
