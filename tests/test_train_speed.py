"""The CPU training fast paths give the same numbers as the plain formulas: dropout from random bits, dropout fused
with the residual addition, logits of selected positions only, the blocked loss, the bf16 residual stream."""

import pytest
import torch
import torch.nn.functional as F

from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig, smoothed_cross_entropy
from attnmt.models import dropout as D
from attnmt.models.transformer import TransformerConfig, TransformerModel

PAD = 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_mask_rate_values_and_scale(dtype, p):
    torch.manual_seed(0)
    mask, scale = D.keep_mask(torch.empty(400_000, dtype=dtype), p)
    assert mask.dtype == dtype and set(mask.unique().tolist()) <= {0.0, 1.0}
    keep = mask.double().mean().item()
    assert keep == pytest.approx(1 - p, abs=4e-3)  # > 5 standard deviations
    assert scale == pytest.approx(1 / (1 - p), rel=1e-4)  # p rounded to 2^-15 at worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dropout_add_forward_and_backward_follow_the_mask(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 7, 16, dtype=dtype, requires_grad=True)
    y = torch.randn(5, 7, 16, dtype=dtype, requires_grad=True)
    g = torch.randn(5, 7, 16, dtype=dtype)
    torch.manual_seed(2)
    out = D.dropout_add(x, y, 0.3, training=True)
    out.backward(g)
    torch.manual_seed(2)
    mask, scale = D.keep_mask(y, 0.3)  # the same random bits
    m = mask.float() * scale
    tol = 0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), x.float() + y.float() * m, atol=tol, rtol=tol)
    assert torch.equal(x.grad, g)
    assert torch.allclose(y.grad.float(), g.float() * m, atol=tol, rtol=tol)
    assert 0 < int((mask == 0).sum()) < mask.numel()


def test_dropout_is_identity_in_eval_and_unbiased_in_training():
    x = torch.ones(200_000)
    layer = D.Dropout(0.3)
    layer.eval()
    assert layer(x) is x and torch.equal(layer.add(x, x), 2 * x)
    layer.train()
    torch.manual_seed(3)
    out = layer(x)
    assert float(out.mean()) == pytest.approx(1.0, abs=1e-2)
    values = out.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / 0.7, rel=1e-4)


def test_dropout_falls_back_for_other_dtypes():
    torch.manual_seed(4)
    x = torch.ones(1000, dtype=torch.float64)
    out = D.dropout(x, 0.5, training=True)
    assert out.dtype == torch.float64 and set(out.unique().tolist()) == {0.0, 2.0}


def _model(dropout: float = 0.0) -> TransformerModel:
    torch.manual_seed(0)
    cfg = TransformerConfig(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=dropout, share_all_embeddings=True)
    return TransformerModel.build(cfg, 50, 50, PAD, joint_vocab=True)


def _batch():
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD], [11, 12, 13, 2, PAD]])
    target = torch.tensor([[20, 21, 22, 2], [23, 2, PAD, PAD], [24, 25, 2, PAD]])
    prev = torch.tensor([[2, 20, 21, 22], [2, 23, PAD, PAD], [2, 24, 25, PAD]])
    lengths = src.ne(PAD).sum(1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(PAD).sum()), "nsentences": 3}


def test_output_mask_selects_rows_of_the_full_logits():
    model = _model().eval()
    b = _batch()
    net = b["net_input"]
    keep = b["target"].ne(PAD)
    with torch.no_grad():
        full = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        part = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], output_mask=keep)
        every = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"],
                      output_mask=torch.ones_like(keep))
    assert part.shape == (int(keep.sum()), 50)
    assert torch.allclose(part, full[keep], atol=1e-6)
    assert torch.allclose(every, full.reshape(-1, 50), atol=1e-6)


def test_criterion_with_fused_projection_equals_full_logits_loss_and_gradients():
    """The criterion's fused projection + loss over the selected positions = the reference formula applied to
    the model's full teacher-forced logits: same loss, NLL and parameter gradients."""
    from attnmt.criterions import label_smoothed_nll_loss

    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), PAD)
    b = _batch()
    net = b["net_input"]
    a_model, b_model = _model(), _model()
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
def test_blocked_loss_matches_reference_across_blocks(monkeypatch, dtype):
    """Rows split over several blocks (a tiny block size) give the reference loss and gradient."""
    import attnmt.criterions as C

    monkeypatch.setattr(C, "_BLOCK_ELEMENTS", 40)  # 40 logits per block and thread: 1-2 rows of 37
    torch.manual_seed(5)
    base = torch.randn(11, 37) * 3
    target = torch.randint(2, 37, (11,))
    logits = base.to(dtype).requires_grad_(True)
    loss, nll = smoothed_cross_entropy(logits, target, PAD, 0.1)
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
def test_bf16_autocast_keeps_the_residual_stream_in_bf16_and_close_to_fp32():
    model = _model().eval()
    b = _batch()
    net = b["net_input"]
    seen = []
    hook = model.encoder.layers[0].self_attn_norm.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad():
        ref = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"]).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"]).float()
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    keep = b["target"].ne(PAD)
    assert (F.log_softmax(low, -1) - F.log_softmax(ref, -1))[keep].abs().max() < 0.1


@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_equals_sdpa(causal):
    from attnmt.models.transformer import plain_attention

    torch.manual_seed(6)
    q, k, v = (torch.randn(3, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    mask = None
    if not causal:
        mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
        mask[1, ..., 3:] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert torch.allclose(plain_attention(q, k, v, mask, causal, 0.0), ref, atol=1e-12)


def test_cpu_attention_math_runs_the_plain_kernel_with_the_same_result():
    import attnmt.models.transformer as T
    from attnmt.backends import backend_for

    model = _model().eval()
    b = _batch()
    net = b["net_input"]
    calls = []
    original = T.plain_attention

    def counting(*args):
        calls.append(1)
        return original(*args)

    with torch.no_grad():
        ref = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        T.plain_attention = counting
        try:
            backend_for("cpu").prepare_training(model, "math")
            out = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        finally:
            T.plain_attention = original
    assert len(calls) == 2 * 1 + 2 * 2  # encoder self-attention, decoder self- and cross-attention, 2 layers
    assert torch.allclose(out, ref, atol=1e-5)


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
