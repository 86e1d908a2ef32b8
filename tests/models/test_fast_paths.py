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
    from attnmt.backends.base import stream_in_autocast_dtype

    model = small_model().eval()
    assert stream_in_autocast_dtype(model) == 2  # the encoder's and the decoder's embeddings, as training prepares
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
    from attnmt.models.tuning import set_fused_attention

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
            set_fused_attention(model, None)  # PyTorch's operations (the compiled form: tests/backends/test_native.py)
            out = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        finally:
            T.plain_attention = original
    assert len(calls) == 2 * 1 + 2 * 2  # encoder self-attention, decoder self- and cross-attention, 2 layers
    assert torch.allclose(out, ref, atol=1e-5)


def _loss_and_grads(model, net, keep, weights):
    """A loss over the logits of the kept positions, and the gradient of every parameter."""
    model.zero_grad()
    logits = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], output_mask=keep)
    loss = (torch.log_softmax(logits, -1) * weights).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("plain_max_len", [0, 1024])  # SDPA's kernels, the plain matmul-softmax attention
def test_packed_decoder_rows_give_the_padded_decoders_loss_and_gradients(plain_max_len):
    """Teacher forcing on the real target positions only (a prefix of each row) computes what the padded
    decoder computes at those positions, gradients included; a mask that is not a prefix takes the padded path."""
    import attnmt.models.packing as packing
    from attnmt.models.tuning import set_plain_attention_max_len

    model = small_model().double().eval()
    set_plain_attention_max_len(model, plain_max_len)
    b = small_batch()
    net = b["net_input"]
    keep = b["target"].ne(PAD)
    assert packing.is_prefix(keep) and not bool(keep.all())
    weights = torch.randn(int(keep.sum()), 50, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    made = []
    original = packing.PackedRows.__init__

    def counting(self, mask):
        made.append(mask.clone())
        original(self, mask)

    packing.PackedRows.__init__ = counting
    try:
        loss, grads = _loss_and_grads(model, net, keep, weights)
        # every position kept but the first of the second sentence: not a prefix, so not packed
        holes = torch.ones_like(keep)
        holes[1, 0] = False
        hole_logits = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], output_mask=holes)
    finally:
        packing.PackedRows.__init__ = original
    assert len(made) == 1 and torch.equal(made[0], keep)

    # the reference: the padded decoder, all positions projected, the kept ones selected afterwards
    model.zero_grad()
    full = model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
    ref_loss = (torch.log_softmax(full[keep], -1) * weights).sum()
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-9, atol=1e-12), name
    assert torch.allclose(hole_logits, full[holes], atol=1e-12)


def test_packed_rows_split_and_merge_heads_are_the_padded_layout_and_adjoint():
    from attnmt.models.packing import PackedRows

    torch.manual_seed(4)
    keep = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
    rows = PackedRows(keep)
    B, T, H, Dh = 3, 3, 2, 4
    padded = torch.randn(B, T, 3 * H * Dh, dtype=torch.float64) * keep[..., None]  # zero at padding
    x = rows.pack(padded)
    assert torch.equal(x, padded[keep])
    q, k, v = rows.split_heads(x, 3, H)
    for got, part in zip((q, k, v), padded.chunk(3, dim=-1)):
        assert got.is_contiguous()
        assert torch.equal(got, part.view(B, T, H, Dh).transpose(1, 2))
    o = torch.randn(B, H, T, Dh, dtype=torch.float64)
    assert torch.equal(rows.merge_heads(o), o.transpose(1, 2).reshape(B, T, H * Dh)[keep])
    # backward of each copy is the adjoint of its forward: <split(x), g> = <x, split^T(g)>
    x.requires_grad_(True)
    gs = [torch.randn(B, H, T, Dh, dtype=torch.float64) for _ in range(3)]
    (dx,) = torch.autograd.grad(sum((a * g).sum() for a, g in zip(rows.split_heads(x, 3, H), gs)), x)
    assert torch.allclose((dx * x.detach()).sum(), sum((a * g).sum() for a, g in zip((q, k, v), gs)))
    o.requires_grad_(True)
    gm = torch.randn(int(keep.sum()), H * Dh, dtype=torch.float64)
    (do,) = torch.autograd.grad((rows.merge_heads(o) * gm).sum(), o)
    assert torch.allclose((do * o.detach()).sum(), (rows.merge_heads(o.detach()) * gm).sum())
    assert torch.equal(do.transpose(1, 2)[~keep], torch.zeros(int((~keep).sum()), H, Dh, dtype=torch.float64))


def test_padded_rows_where_the_backend_chooses_them_give_the_packed_loss_and_gradients():
    """With row packing off (the CUDA backend's choice) teacher forcing runs on the (B, T) grid and gives the
    packed path's loss and gradients."""
    import attnmt.models.packing as packing

    model = small_model().double().eval()
    b = small_batch()
    net = b["net_input"]
    keep = b["target"].ne(PAD)
    weights = torch.randn(int(keep.sum()), 50, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    packed_loss, packed_grads = _loss_and_grads(model, net, keep, weights)

    packing.set_row_packing(model, False)
    made = []
    original = packing.PackedRows.__init__
    packing.PackedRows.__init__ = lambda self, mask: made.append(mask) or original(self, mask)
    try:
        loss, grads = _loss_and_grads(model, net, keep, weights)
    finally:
        packing.PackedRows.__init__ = original
    assert made == []
    assert torch.allclose(loss, packed_loss, rtol=1e-12)
    for name, g in grads.items():
        assert torch.allclose(g, packed_grads[name], rtol=1e-9, atol=1e-12), name
