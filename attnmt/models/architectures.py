"""The Transformer's named architectures (``--arch``): the paper's base and big (Table 3), smaller models for CPU
training, and fairseq 0.12's names for the same models, each a dict of
:class:`~attnmt.models.transformer.TransformerConfig` fields. The other rows of Table 3 are options on top of these
(recipes/paper_table3 trains them all)."""

from __future__ import annotations

from attnmt.registry import register_arch


@register_arch("transformer", model="transformer")
def transformer_base() -> dict:
    """Transformer base (Vaswani et al. 2017, Table 3 'base'): 6+6 layers, d 512, d_ff 2048, 8 heads."""
    return dict(encoder_layers=6, decoder_layers=6, encoder_embed_dim=512, decoder_embed_dim=512,
                encoder_ffn_embed_dim=2048, decoder_ffn_embed_dim=2048, encoder_attention_heads=8,
                decoder_attention_heads=8, dropout=0.1)


@register_arch("transformer_big", model="transformer")
def transformer_big() -> dict:
    """Transformer big (Table 3 'big'): 6+6 layers, d 1024, d_ff 4096, 16 heads, dropout 0.3 (EN-DE)."""
    return dict(transformer_base(), encoder_embed_dim=1024, decoder_embed_dim=1024, encoder_ffn_embed_dim=4096,
                decoder_ffn_embed_dim=4096, encoder_attention_heads=16, decoder_attention_heads=16, dropout=0.3)


@register_arch("transformer_iwslt_de_en", model="transformer")
def transformer_iwslt_de_en() -> dict:
    """Small model for IWSLT'14 De-En, as fairseq defines it: 6+6 layers, d 512, d_ff 1024, 4 heads, and the base
    model's dropout 0.1 (fairseq's IWSLT command line gives --dropout 0.3, as recipes/iwslt14_de_en does)."""
    return dict(transformer_base(), encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
                encoder_attention_heads=4, decoder_attention_heads=4)


@register_arch("transformer_small", model="transformer")
def transformer_small() -> dict:
    """Multi30k-sized model for CPU training: 3+3 layers, d 256, d_ff 1024, 4 heads, dropout 0.3, shared embeddings."""
    return dict(encoder_layers=3, decoder_layers=3, encoder_embed_dim=256, decoder_embed_dim=256,
                encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024, encoder_attention_heads=4,
                decoder_attention_heads=4, dropout=0.3, share_all_embeddings=True)


@register_arch("transformer_mini", model="transformer")
def transformer_mini() -> dict:
    """A smaller Multi30k model for slow CPUs: transformer_small at 4+4 layers, d 128, d_ff 256 (Wu et al. 2021's
    text-only Multi30k Transformer). Its extra updates per second pay where transformer_small gets few in the time
    budget; recipes/multi30k/run.sh measures the speed-up and trains it where it is large enough."""
    return dict(transformer_small(), encoder_layers=4, decoder_layers=4, encoder_embed_dim=128, decoder_embed_dim=128,
                encoder_ffn_embed_dim=256, decoder_ffn_embed_dim=256)


# fairseq's names for the same models, so that a fairseq command line runs unchanged (fairseq 0.12's presets)


@register_arch("transformer_wmt_en_de", model="transformer")
def transformer_wmt_en_de() -> dict:
    """fairseq's name for the Transformer base (= transformer)."""
    return transformer_base()


@register_arch("transformer_vaswani_wmt_en_de_big", model="transformer")
def transformer_vaswani_wmt_en_de_big() -> dict:
    """fairseq's name for the Transformer big, EN-DE (= transformer_big: dropout 0.3)."""
    return transformer_big()


@register_arch("transformer_vaswani_wmt_en_fr_big", model="transformer")
def transformer_vaswani_wmt_en_fr_big() -> dict:
    """fairseq's Transformer big for EN-FR: transformer_big with dropout 0.1 (the paper's EN-FR setting)."""
    return dict(transformer_big(), dropout=0.1)


@register_arch("transformer_wmt_en_de_big", model="transformer")
def transformer_wmt_en_de_big() -> dict:
    """fairseq's transformer_wmt_en_de_big: transformer_big with attention dropout 0.1."""
    return dict(transformer_big(), attention_dropout=0.1)


@register_arch("transformer_wmt_en_de_big_t2t", model="transformer")
def transformer_wmt_en_de_big_t2t() -> dict:
    """fairseq's transformer_wmt_en_de_big_t2t: pre-norm big, attention and activation dropout 0.1."""
    return dict(transformer_big(), encoder_normalize_before=True, decoder_normalize_before=True,
                attention_dropout=0.1, activation_dropout=0.1)


@register_arch("transformer_tiny", model="transformer")
def transformer_tiny() -> dict:
    """fairseq's transformer_tiny (for tests): 2+2 layers, d 64, d_ff 64, 2 heads."""
    return dict(transformer_base(), encoder_layers=2, decoder_layers=2, encoder_embed_dim=64, decoder_embed_dim=64,
                encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=2,
                decoder_attention_heads=2)
