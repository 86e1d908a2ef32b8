"""The Transformer's fast paths give the plain formulas' numbers: logits of selected positions only, the bf16
residual stream, the matmul-softmax attention kernel."""

import pytest
import torch
import torch.nn.functional as F
from helpers import PAD, small_batch, small_model


def test_output_mask_selects_rows_of_the_full_logits():
    model = small_model().eval()
    b = small_batch()
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


@pytest.mark.precision
def test_bf16_autocast_keeps_the_residual_stream_in_bf16_and_close_to_fp32():
    model = small_model().eval()
    b = small_batch()
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

    model = small_model().eval()
    b = small_batch()
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
