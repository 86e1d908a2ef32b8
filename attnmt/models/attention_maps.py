"""The Transformer's encoder-decoder attention weights written out, for attention heat maps (``attnmt plot``).

Training and translation never form these weights: ``scaled_dot_product_attention`` computes attention without
returning them. This module runs the decoder teacher-forced as ``decode`` does without a cache, except that each
layer's encoder-decoder attention is the explicit softmax(Q K^T / sqrt(d_k)) (:func:`attention_weights`),
multiplied into V as the fused kernel would: the same outputs, and the weights besides. :func:`attention_maps_of`
gives any model's maps: a model that offers its own implements :class:`~attnmt.models.interface.AttentionMaps`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from attnmt.errors import UserError
from attnmt.models.interface import AttentionMaps
from attnmt.models.transformer import (
    DecoderLayer,
    EncoderOut,
    TransformerModel,
    attention_scores,
    key_padding_mask,
    residual,
)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) written out, (B, H, T, S); masked keys (``mask`` False) get exactly 0.
    ``combine_heads(weights @ V)`` reproduces the attention without dropout."""
    return torch.softmax(attention_scores(q, k, mask, False), dim=-1)


def layer_with_cross_attention(layer: DecoderLayer, x: Tensor, memory: Tensor,
                               memory_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """A decoder layer's teacher-forced output (B, T, D) and its encoder-decoder attention weights (B, H, T, S)."""
    pre = layer.normalize_before
    weights: list[Tensor] = []

    def cross(h: Tensor) -> Tensor:
        q = layer.cross_attn.project_q(h)  # (B, H, T, Dh)
        k, v = layer.cross_attn.project_kv(memory)  # (B, H, S, Dh) each
        w = attention_weights(q, k, memory_mask)  # (B, H, T, S)
        weights.append(w)
        return layer.cross_attn.combine_heads(torch.matmul(w, v))

    x = residual(x, lambda h: layer.self_attn(h, is_causal=True), layer.self_attn_norm,
                 layer.dropout, pre)
    x = residual(x, cross, layer.cross_attn_norm, layer.dropout, pre)
    return residual(x, layer.ffn, layer.ffn_norm, layer.dropout, pre), weights[0]


def decode_with_cross_attention(model: TransformerModel, prev_output_tokens: Tensor,
                                enc: EncoderOut) -> tuple[Tensor, Tensor]:
    """Teacher-forced logits (B, T, V) and every decoder layer's encoder-decoder attention weights (B, L, H, T, S);
    the arithmetic of ``decode`` without a cache (call it in eval mode: no attention dropout here)."""
    decoder = model.decoder
    x = decoder.embed(prev_output_tokens)  # (B, T, D)
    memory_mask = key_padding_mask(enc.padding_mask)  # (B, 1, 1, S) or None
    weights = []
    for layer in decoder.layers:
        x, w = layer_with_cross_attention(layer, x, enc.out, memory_mask)
        weights.append(w)
    if decoder.final_norm is not None:
        x = decoder.final_norm(x)
    return decoder.output_projection(x), torch.stack(weights, dim=1)


def attention_maps_of(model) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``(src_tokens, src_lengths, prev_output_tokens) -> weights (B, L, H, T, S)`` for ``model``: its own
    ``cross_attention_weights`` (:class:`AttentionMaps`), or this module's for a Transformer; a one-line error
    for a model that has neither."""
    if isinstance(model, AttentionMaps):
        return model.cross_attention_weights
    if isinstance(model, TransformerModel):
        return functools.partial(cross_attention_weights, model)
    raise UserError(f"this model ({type(model).__name__}) does not give its attention weights, so there is no "
                    f"attention map to plot")


def cross_attention_weights(model: TransformerModel, src_tokens: Tensor, src_lengths: Tensor,
                            prev_output_tokens: Tensor) -> Tensor:
    """Encoder-decoder attention weights (B, L, H, T, S) of every decoder layer and head, in eval mode.

    Row ``t`` of a head's (T, S) map is the distribution over source tokens with which the decoder, fed
    ``prev_output_tokens[:, :t + 1]``, predicts target token ``t``; it sums to 1 over the sentence's real source
    tokens and is 0 on padding. For a single sentence, ``[0]`` gives (L, H, T, S). The model is switched to eval
    mode for the call (no dropout) and back afterwards; no gradients are kept.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _, weights = decode_with_cross_attention(model, prev_output_tokens,
                                                     model.encode(src_tokens, src_lengths))
    finally:
        model.train(was_training)
    return weights
