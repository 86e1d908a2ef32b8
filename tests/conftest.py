"""Shared test helpers: the CPU's bf16 support, detected once, a switch that hides it, a tiny Transformer."""

import pytest
import torch

from attnmt.backends import capabilities

NATIVE_BF16 = capabilities.cpu().native_bf16

# tests of the fast paths that only exist where the CPU computes bf16 natively (AMX, AVX-512 BF16)
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16, reason=f"no native bf16 on this CPU ({capabilities.cpu().why_no_bf16()})")


@pytest.fixture
def cpu_env(monkeypatch):
    """``cpu_env(NAME=value, ...)``: set environment variables that the CPU detection reads, detect again."""

    def apply(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        capabilities.cpu.cache_clear()

    yield apply
    monkeypatch.undo()
    capabilities.cpu.cache_clear()


def tiny_transformer(seed: int = 0):
    """A 2+2-layer Transformer (d 32, 4 heads, no dropout) over a joint 50-symbol vocabulary, padding index 1."""
    from attnmt.models.transformer import TransformerConfig, TransformerModel

    cfg = TransformerConfig(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=0.0)
    torch.manual_seed(seed)
    return TransformerModel.build(cfg, 50, 50, 1, joint_vocab=True)


@pytest.fixture
def no_native_bf16(cpu_env):
    """Run the test as on a CPU without native bf16 (ATTNMT_CPU_BF16=0), in this process and its children."""
    cpu_env(**{capabilities.BF16_SWITCH: "0"})
