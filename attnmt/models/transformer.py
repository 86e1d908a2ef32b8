"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in one file.

Read top to bottom, the file follows the paper:

* 3.5   positional encoding        -> ``sinusoid_table``, ``SinusoidalPositions``, ``LearnedPositions``
* 3.4   embeddings (x sqrt(d_model), shared with the pre-softmax projection) -> ``InputEmbedding``
* 3.2.1 scaled dot-product attention, 3.2.2 multi-head attention -> ``MultiHeadAttention``
* 3.3   position-wise feed-forward network -> ``FeedForward``
* 5.4   residual dropout around every sub-layer -> ``residual``
* 3.1   encoder and decoder stacks  -> ``EncoderLayer``, ``DecoderLayer``, ``TransformerEncoder``, ``TransformerDecoder``
* 3.2.3 uses of attention: padding masks for encoder self-attention and encoder-decoder attention, a causal
  mask for decoder self-attention -> ``key_padding_mask`` and ``is_causal`` in the decoder
* the model and its config -> ``TransformerModel``, ``TransformerConfig`` (the options Table 3 varies, including
  d_k apart from d_v; its named architectures and fairseq's names in ``models/architectures.py``)
* analysis: the encoder-decoder attention weights written out (SDPA does not return them), for attention heat
  maps, live in ``models/attention_maps.py``

Label smoothing (5.4) belongs to the training criterion, not to the model.

Conventions. Tensors are batch-first: B sentences, S source tokens, T target tokens, D model width, H heads,
Dh = D / H (d_k = d_v; ``attention_key_dim`` sets a d_k of its own), V vocabulary. Batches are right-padded with
``pad_idx``; a token's position is its index among the real tokens of its sentence, so a sentence's outputs do
not depend on how much padding its batch needed.
What runs the same formulas faster (a decoder cache while decoding step by step, the decoder's real positions as
packed rows in teacher forcing, a backend's attention kernel) lives outside this file: ``models/paths.py`` says
how a call runs its attention (``path``), ``models/caches.py`` which cache the backend's ``DecodingKernels`` choose.
Residual blocks are post-norm as in the paper, ``LayerNorm(x + Dropout(Sublayer(x)))``; pre-norm
(``x + Dropout(Sublayer(LayerNorm(x)))`` plus a final LayerNorm per stack) is an option. So are what imported
models differ in (``interop/huggingface.py``), their defaults the paper's: the sinusoids' layout
(``sinusoid_style``) and the feed-forward activation (``activation_fn``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmt.errors import UserError
from attnmt.models.caches import decoder_cache, pool_cache
from attnmt.models.dropout import Dropout
from attnmt.models.dropout import dropout as dropout_weights
from attnmt.models.interface import DecoderCache, EncoderDecoderModel
from attnmt.models.kernels import DecodingKernels
from attnmt.models.linear import Linear
from attnmt.models.packing import RowPacking
from attnmt.models.paths import AttentionPath, TeacherForcing
from attnmt.models.tuning import AttentionKernel, DropoutKernel
from attnmt.registry import register

# ------------------------------------------------------------------------------------------------ config


@dataclass
class TransformerConfig:
    """Hyper-parameters of the Transformer; every field is a command-line option (``--encoder-layers`` ...)."""

    encoder_layers: int = field(default=6, metadata={"min": 1, "max": 1000, "help": "number of encoder layers (N in the paper)"})
    decoder_layers: int = field(default=6, metadata={"min": 1, "max": 1000, "help": "number of decoder layers (N in the paper)"})
    encoder_embed_dim: int = field(default=512, metadata={"min": 1, "max": 65536, "help": "encoder model width d_model"})
    decoder_embed_dim: int = field(default=512, metadata={"min": 1, "max": 65536, "help": "decoder model width d_model"})
    encoder_ffn_embed_dim: int = field(default=2048, metadata={"min": 1, "max": 262144, "help": "encoder feed-forward inner width d_ff"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"min": 1, "max": 262144, "help": "decoder feed-forward inner width d_ff"})
    encoder_attention_heads: int = field(default=8, metadata={"min": 1, "max": 4096, "help": "encoder attention heads h"})
    decoder_attention_heads: int = field(default=8, metadata={"min": 1, "max": 4096, "help": "decoder attention heads h"})
    attention_key_dim: int = field(default=0, metadata={"min": 0, "max": 65536, "help": (
        "size d_k of each head's queries and keys in every attention (0: d_model / h, the paper's; d_v stays "
        "d_model / h, as in Table 3 row B)")})
    dropout: float = field(default=0.1, metadata={
        "help": "residual dropout P_drop: on embeddings + positions and on every sub-layer output"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the feed-forward ReLU"})
    source_word_dropout: float = field(default=0.0, metadata={
        "help": "in training, zero a source token's embedding with this probability (whole tokens, kept ones "
                "scaled by 1/(1-p); Marian's --dropout-src); not in the paper"})
    encoder_normalize_before: bool = field(default=False, metadata={
        "help": "pre-norm encoder: LayerNorm before each sub-layer and after the stack (the paper is post-norm)"})
    decoder_normalize_before: bool = field(default=False, metadata={
        "help": "pre-norm decoder: LayerNorm before each sub-layer and after the stack (the paper is post-norm)"})
    learned_pos: bool = field(default=False, metadata={
        "help": "learned positional embeddings instead of sinusoids (paper 3.5 found them equivalent)"})
    sinusoid_style: Literal["paper", "halves", "fairseq"] = field(default="paper", metadata={
        "help": "the sinusoids' layout: paper (sin and cos interleaved, position 0 first), halves (the paper's "
                "frequencies, all sines then all cosines: Marian), fairseq (sines then cosines with fairseq's "
                "frequencies, positions numbered from 2: fairseq, FSMT, M2M-100, NLLB)"})
    activation_fn: Literal["relu", "gelu", "swish"] = field(default="relu", metadata={
        "help": "the feed-forward activation: relu (the paper), gelu (erf form) or swish (SiLU, as in OPUS-MT)"})
    no_scale_embedding: bool = field(default=False, metadata={
        "help": "do not multiply token embeddings by sqrt(d_model)"})
    share_all_embeddings: bool = field(default=False, metadata={
        "help": "one matrix for source embeddings, target embeddings and the output projection (needs a joined "
                "dictionary)"})
    share_decoder_input_output_embed: bool = field(default=False, metadata={
        "help": "one matrix for target embeddings and the output projection"})
    max_source_positions: int = field(default=1024, metadata={"min": 1, "max": 1048576, "help": "longest source sentence in tokens"})
    max_target_positions: int = field(default=1024, metadata={"min": 1, "max": 1048576, "help": "longest target sentence in tokens"})

    def __post_init__(self) -> None:
        for side in ("encoder", "decoder"):
            layers, dim = getattr(self, f"{side}_layers"), getattr(self, f"{side}_embed_dim")
            ffn, heads = getattr(self, f"{side}_ffn_embed_dim"), getattr(self, f"{side}_attention_heads")
            opt = f"--{side}"
            if layers < 1:
                raise ValueError(f"{opt}-layers must be at least 1, got {layers}")
            if dim < 1 or ffn < 1 or heads < 1:
                raise ValueError(f"{opt}-embed-dim, {opt}-ffn-embed-dim and {opt}-attention-heads must be "
                                 f"positive, got {dim}, {ffn}, {heads}")
            if dim % heads:
                raise ValueError(f"{opt}-embed-dim {dim} is not divisible by {opt}-attention-heads {heads}; "
                                 f"choose a head count that divides the width (e.g. {_divisor_hint(dim, heads)})")
            if not self.learned_pos and dim % 2:
                raise ValueError(f"{opt}-embed-dim {dim} is odd; sinusoidal positions need an even width "
                                 f"(use {dim + 1} or --learned-pos)")
        if self.attention_key_dim < 0:
            raise ValueError(f"--attention-key-dim must be 0 (d_model / h) or positive, got {self.attention_key_dim}")
        if self.sinusoid_style not in SINUSOID_STYLES:
            raise ValueError(f"--sinusoid-style must be one of {', '.join(SINUSOID_STYLES)}, got "
                             f"{self.sinusoid_style!r}")
        if self.activation_fn not in ACTIVATIONS:
            raise ValueError(f"--activation-fn must be one of {', '.join(ACTIVATIONS)}, got {self.activation_fn!r}")
        for name in ("dropout", "attention_dropout", "activation_dropout", "source_word_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {p}")
        for name in ("max_source_positions", "max_target_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.share_all_embeddings and self.encoder_embed_dim != self.decoder_embed_dim:
            raise ValueError(f"--share-all-embeddings needs --encoder-embed-dim == --decoder-embed-dim, got "
                             f"{self.encoder_embed_dim} and {self.decoder_embed_dim}; make them equal or pass "
                             f"--no-share-all-embeddings")


def _divisor_hint(dim: int, heads: int) -> int:
    """The divisor of ``dim`` closest to ``heads``, to suggest in an error message."""
    return min((h for h in range(1, dim + 1) if dim % h == 0), key=lambda h: (abs(h - heads), h))


# ---------------------------------------------------------------------------- 3.5 positional encoding


SINUSOID_STYLES = ("paper", "halves", "fairseq")


def sinusoid_table(num_positions: int, dim: int, style: str = "paper") -> Tensor:
    """The paper's formula, sin and cos interleaved: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(.).

    Other toolkits lay the same idea out differently; checkpoints are not interchangeable between layouts, so the
    imported models keep theirs (``--sinusoid-style``): ``halves`` puts all sines before all cosines (Marian);
    ``fairseq`` does the same with frequencies ``10000^(-i/(d/2 - 1))`` and numbers the first position 2 (its
    padding index 1, plus 1), as fairseq, FSMT and M2M-100 do. Row ``p`` holds the ``p``-th position of a sentence.
    """
    pos = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    half = torch.arange(0, dim, 2, dtype=torch.float64)  # 2i, (D/2,)
    if style == "fairseq":
        pos = pos + 2
        inv_freq = torch.exp(torch.arange(dim // 2, dtype=torch.float64) * -(math.log(10000.0) / (dim // 2 - 1)))
    else:
        inv_freq = torch.exp(half * (-math.log(10000.0) / dim))  # (D/2,)
    angles = pos * inv_freq  # (P, D/2)
    if style in ("halves", "fairseq"):
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids (3.5). The table is a non-persistent buffer (not in checkpoints) that grows on demand, so
    sentences longer than any seen in training still get well-defined positions."""

    def __init__(self, dim: int, initial_size: int = 256, style: str = "paper"):
        super().__init__()
        self.dim, self.style = dim, style
        self.register_buffer("table", sinusoid_table(initial_size, dim, style), persistent=False)

    def forward(self, positions: Tensor, max_len: int) -> Tensor:  # positions (B, T) with values < max_len
        if max_len > self.table.size(0):
            self.table = sinusoid_table(max(max_len, 2 * self.table.size(0)), self.dim, self.style).to(self.table)
        return F.embedding(positions, self.table)  # (B, T, D)


class LearnedPositions(nn.Module):
    """One learned vector per position (the paper's alternative in 3.5); limited to ``max_positions``."""

    def __init__(self, max_positions: int, dim: int, what: str):
        super().__init__()
        self.what = what  # the option that sets the limit, for the error message
        self.weight = nn.Parameter(torch.empty(max_positions, dim))
        nn.init.normal_(self.weight, mean=0.0, std=dim**-0.5)

    def forward(self, positions: Tensor, max_len: int) -> Tensor:
        if max_len > self.weight.size(0):
            raise UserError(f"a sentence of {max_len} tokens is longer than {self.what} {self.weight.size(0)} "
                            f"of this model (learned positions); filter long sentences or train with a larger "
                            f"{self.what}")
        return F.embedding(positions, self.weight)  # (B, T, D)


def positions_of(tokens: Tensor, pad_idx: int, start: int | Tensor = 0) -> Tensor:
    """Position of each token among the real tokens of its sentence, counted from ``start``.

    For right-padded batches this is ``start + 0..T-1``; counting non-pad tokens makes the positions (hence the
    outputs) independent of the padding even for left-padded input. Pad tokens get a position they never use.
    A sentence's first token (at ``start`` 0) always counts: a decoder may start from the padding symbol (Marian).
    """
    real = tokens.ne(pad_idx)
    if isinstance(start, Tensor):
        real[:, :1] |= start.reshape(-1, 1) == 0
    elif start == 0:
        real[:, :1] = True
    return (torch.cumsum(real, dim=1) - 1).clamp_(min=0) + start  # (B, T)


# ------------------------------------------------------------------------------------- 3.4 embeddings


class InputEmbedding(nn.Module):
    """Token embedding x sqrt(d_model) (3.4) + positional encoding (3.5), then dropout (5.4).

    ``tokens`` is shared between stacks and with the output projection when embeddings are shared.
    ``word_dropout`` (the encoder's ``--source-word-dropout``) zeroes whole token vectors in training, before
    the positions are added, and scales the kept ones by 1/(1-p).
    """

    def __init__(self, tokens: nn.Embedding, positions: nn.Module, scale: bool, dropout: float, pad_idx: int,
                 word_dropout: float = 0.0):
        super().__init__()
        self.tokens = tokens
        self.word_dropout = word_dropout
        self.positions = positions
        self.scale = math.sqrt(tokens.embedding_dim) if scale else 1.0
        self.dropout = Dropout(dropout)
        self.pad_idx = pad_idx
        self.stream = nn.Identity()  # the residual stream's dtype: the backend's to set (training under autocast)

    def forward(self, tokens: Tensor, start: int | Tensor = 0) -> Tensor:  # tokens (B, T)
        """``start``: the position of the first token, or (B, 1), each row's (continuous batching)."""
        pos = positions_of(tokens, self.pad_idx, start)  # (B, T)
        longest = int(start.max()) if isinstance(start, Tensor) and start.numel() else int(start)
        x = self.scale * self.tokens(tokens)  # (B, T, D)
        if self.training and self.word_dropout > 0.0:
            keep = torch.rand(tokens.shape, device=tokens.device) >= self.word_dropout  # (B, T)
            x = x * (keep.unsqueeze(-1).to(x.dtype) / (1.0 - self.word_dropout))
        x = x + self.positions(pos, longest + tokens.size(1))  # (B, T, D)
        return self.dropout(self.stream(x))


def token_embedding(num_embeddings: int, dim: int, pad_idx: int) -> nn.Embedding:
    """N(0, d^-1/2) init: after the sqrt(d) scaling, token vectors have unit-scale entries, comparable to the sinusoids (in [-1, 1])."""
    emb = nn.Embedding(num_embeddings, dim, padding_idx=pad_idx)
    nn.init.normal_(emb.weight, mean=0.0, std=dim**-0.5)
    with torch.no_grad():
        emb.weight[pad_idx].zero_()
    return emb


def linear(in_features: int, out_features: int, bias: bool = True) -> Linear:
    """A linear layer with Xavier-uniform weights and zero bias (fairseq's choice for the Transformer)."""
    layer = Linear(in_features, out_features, bias=bias)
    nn.init.xavier_uniform_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


# ------------------------------------------------------------------------------------------ 3.2 attention


def key_padding_mask(padding_mask: Tensor, always: bool = False) -> Tensor | None:
    """(B, S) True=pad -> boolean attention mask (B, 1, 1, S) True=attend, or None when nothing is padded (a mask
    all the same with ``always``: compiled layers then see one kind of argument).

    A sentence with no real token at all would leave every key masked, and softmax over nothing is NaN; such
    rows attend to everything instead (their output is meaningless but finite, and nothing real depends on it).
    """
    if not always and not padding_mask.any():
        return None  # lets SDPA pick its fastest kernel
    attend = ~padding_mask | padding_mask.all(dim=1, keepdim=True)  # (B, S)
    return attend[:, None, None, :]  # (B, 1, 1, S): broadcast over heads and queries


class MultiHeadAttention(AttentionKernel, DropoutKernel, nn.Module):
    """Multi-head attention (3.2.2) over scaled dot-product attention (3.2.1).

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O`` with ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.
    Self-attention projects Q, K and V with one fused (D -> 3D) matmul (D -> 2 H d_k + D with a ``key_dim`` d_k of
    its own); encoder-decoder attention projects the query from the decoder and K, V (one fused matmul) from the
    encoder output. ``Attention`` is ``F.scaled_dot_product_attention``, which picks a fused kernel and applies
    attention dropout to the weights in training, or the same formula as :func:`plain_attention` for sequences up
    to ``plain_attention_max_len`` (the backend's choice: ``AttentionKernel``; faster for short sentences on a CPU).
    A call may run another way, with the same numbers (``path``, ``models/paths.py``): through a decoder cache, on
    packed rows, or through the backend's kernel.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, kv_dim: int | None = None,
                 key_dim: int = 0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads  # d_v
        self.key_dim = key_dim or self.head_dim  # d_k
        self.dropout = dropout
        qk, v = num_heads * self.key_dim, embed_dim  # widths of all heads' queries (and keys), and values
        if kv_dim is None:  # self-attention
            self.qkv_proj = Linear(embed_dim, 2 * qk + v)
            fused = [(self.qkv_proj, [qk, qk, v])]
        else:  # encoder-decoder attention
            self.q_proj = Linear(embed_dim, qk)
            self.kv_proj = Linear(kv_dim, qk + v)
            fused = [(self.q_proj, [qk]), (self.kv_proj, [qk, v])]
        self.widths = [qk, qk, v]
        # Initialize each of W^Q, W^K, W^V as its own matrix, as if unfused: Xavier-uniform scaled by 1/sqrt(2)
        # (fairseq's choice, which it found to converge better), zero bias.
        for proj, widths in fused:
            for block in proj.weight.split(widths, dim=0):
                nn.init.xavier_uniform_(block, gain=1 / math.sqrt(2))
            nn.init.zeros_(proj.bias)
        self.out_proj = linear(embed_dim, embed_dim)  # W^O

    def forward(self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None, is_causal: bool = False,
                path: AttentionPath | None = None) -> Tensor:
        """Attention from ``x`` (B, T, D) to ``memory`` (B, S, D_enc), or to ``x`` itself (self-attention) where
        ``memory`` is None; ``mask`` (broadcastable to (B, H, T, S), True = attend) or ``is_causal``. (B, T, D)."""
        path = path or self.default_path
        if path is not None:
            return path.attend(self, x, memory, mask, is_causal)
        if memory is None:
            q, k, v = self.split_qkv(self.qkv_proj(x))  # (B, H, T, d_k) twice, (B, H, T, d_v)
        else:
            q, (k, v) = self.project_q(x), self.project_kv(memory)
        return self.combine_heads(self.scaled_dot_product(q, k, v, mask, is_causal))

    def split_heads(self, x: Tensor) -> Tensor:  # (B, T, H * Dh) -> (B, H, T, Dh)
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, -1).transpose(1, 2)

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The self-attention projection's output (B, T, 2 H d_k + H d_v) as Q, K, V heads."""
        q, k, v = qkv.split(self.widths, dim=-1)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def split_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """The encoder-decoder projection's output (B, S, H d_k + H d_v) as K, V heads."""
        k, v = kv.split(self.widths[1:], dim=-1)
        return self.split_heads(k).contiguous(), self.split_heads(v).contiguous()

    def project_q(self, x: Tensor) -> Tensor:
        return self.split_heads(self.q_proj(x))  # (B, H, T, d_k)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder attention: K, V from the encoder output (B, S, D_enc), (B, H, S, d_k) and (.., d_v)."""
        return self.split_kv(self.kv_proj(memory))

    def scaled_dot_product(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                           is_causal: bool = False) -> Tensor:
        """head_i = Attention(Q_i, K_i, V_i) of every head (B, H, T, Dh), dropout on the weights in training."""
        dropout_p = self.dropout if self.training else 0.0
        if self.use_plain_attention(q.size(-2), k.size(-2)) and (mask is None or mask.dtype == torch.bool):
            return plain_attention(q, k, v, mask, is_causal, dropout_p, self.random_bit_dropout)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p)

    def combine_heads(self, out: Tensor) -> Tensor:
        """Concat(head_1..head_h) W^O: (B, H, T, Dh) -> (B, T, D)."""
        B, H, T, Dh = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, T, H * Dh))


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                    dropout_p: float, random_bit_dropout: bool = False) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V (3.2.1) as matmul, softmax, matmul in the inputs' dtype; (B, H, T, Dh).

    ``mask`` (broadcastable to (B, H, T, S), True = attend) or ``is_causal`` as in SDPA; ``dropout_p`` drops
    attention weights (masks from raw random bits with ``random_bit_dropout``: ``DropoutKernel``). Under bf16 the
    products accumulate in fp32 and softmax computes in fp32 internally.
    """
    weights = torch.softmax(attention_scores(q, k, mask, is_causal), dim=-1)
    return torch.matmul(dropout_weights(weights, dropout_p, dropout_p > 0.0, random_bit_dropout), v)


def attention_scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """Q K^T / sqrt(d_k) (B, H, T, S), masked positions (``mask`` False, or after the query with ``is_causal``,
    top-left aligned as in SDPA) set to -inf."""
    scores = torch.matmul(q, k.transpose(-2, -1))  # (B, H, T, S)
    scores.mul_(1.0 / math.sqrt(q.size(-1)))
    if is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril_()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


# ------------------------------------------------------------------------ 3.3 position-wise feed-forward


ACTIVATIONS = {"relu": None, "gelu": F.gelu, "swish": F.silu}  # None: fused into the product


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position separately (3.3).

    ``activation`` replaces the ReLU for imported models (``gelu``; ``swish``, x * sigmoid(x), in OPUS-MT)."""

    def __init__(self, embed_dim: int, ffn_dim: int, activation_dropout: float, activation: str = "relu"):
        super().__init__()
        self.fc1 = linear(embed_dim, ffn_dim)
        self.fc2 = linear(ffn_dim, embed_dim)
        self.activation_dropout = Dropout(activation_dropout)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D)
        if self.activation is None:
            hidden = self.fc1(x, relu=True)  # a backend may fuse the bias and ReLU into the product (models/linear.py)
        else:
            hidden = self.activation(self.fc1(x))
        return self.fc2(self.activation_dropout(hidden))  # (B, T, D)


# ------------------------------------------------------------- 5.4 residual dropout around each sub-layer


def residual(x: Tensor, sublayer, norm: nn.LayerNorm, dropout: Dropout, normalize_before: bool) -> Tensor:
    """Post-norm (the paper, 3.1): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-norm (optional): x + Dropout(Sublayer(LayerNorm(x))), which trains deep stacks without warm-up tricks."""
    if normalize_before:
        return dropout.add(x, sublayer(norm(x)))
    return norm(dropout.add(x, sublayer(x)))


# -------------------------------------------------------------------------------- incremental decoding


@dataclass
class EncoderOut:
    """What the decoder needs from the encoder."""

    out: Tensor  # (B, S, D) encoder output
    padding_mask: Tensor  # (B, S) bool, True at padding


# ---------------------------------------------------------------------------------- 3.1 encoder, decoder


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection with layer normalization."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.encoder_embed_dim
        self.normalize_before = cfg.encoder_normalize_before
        self.self_attn = MultiHeadAttention(d, cfg.encoder_attention_heads, cfg.attention_dropout,
                                            key_dim=cfg.attention_key_dim)
        self.self_attn_norm = nn.LayerNorm(d)
        self.ffn = FeedForward(d, cfg.encoder_ffn_embed_dim, cfg.activation_dropout, cfg.activation_fn)
        self.ffn_norm = nn.LayerNorm(d)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:  # (B, S, D)
        x = residual(x, lambda h: self.self_attn(h, mask=mask), self.self_attn_norm, self.dropout,
                     self.normalize_before)
        return residual(x, self.ffn, self.ffn_norm, self.dropout, self.normalize_before)  # (B, S, D)


class DecoderLayer(nn.Module):
    """Causal self-attention, encoder-decoder attention, feed-forward; each in a residual block (3.1)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.decoder_embed_dim
        self.normalize_before = cfg.decoder_normalize_before
        self.self_attn = MultiHeadAttention(d, cfg.decoder_attention_heads, cfg.attention_dropout,
                                            key_dim=cfg.attention_key_dim)
        self.self_attn_norm = nn.LayerNorm(d)
        self.cross_attn = MultiHeadAttention(d, cfg.decoder_attention_heads, cfg.attention_dropout,
                                             kv_dim=cfg.encoder_embed_dim, key_dim=cfg.attention_key_dim)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.ffn = FeedForward(d, cfg.decoder_ffn_embed_dim, cfg.activation_dropout, cfg.activation_fn)
        self.ffn_norm = nn.LayerNorm(d)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None,
                path: AttentionPath | None = None) -> Tensor:
        """x (B, T, D); memory (B, S, D_enc). 3.2.3: each position attends to itself and earlier positions, then
        to the encoder output (padding masked)."""
        pre = self.normalize_before
        x = residual(x, lambda h: self.self_attn(h, is_causal=True, path=path), self.self_attn_norm, self.dropout,
                     pre)
        x = residual(x, lambda h: self.cross_attn(h, memory, memory_mask, path=path), self.cross_attn_norm,
                     self.dropout, pre)
        return residual(x, self.ffn, self.ffn_norm, self.dropout, pre)  # like x


class TransformerEncoder(nn.Module):
    """Embeddings + N encoder layers (3.1); pre-norm adds a final LayerNorm."""

    always_mask = False  # pass a padding mask even when nothing is padded (set for compiled layers)

    def __init__(self, cfg: TransformerConfig, embed: InputEmbedding):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.final_norm = nn.LayerNorm(cfg.encoder_embed_dim) if cfg.encoder_normalize_before else None

    def forward(self, src_tokens: Tensor) -> EncoderOut:  # (B, S)
        padding_mask = src_tokens.eq(self.embed.pad_idx)  # (B, S)
        mask = key_padding_mask(padding_mask, self.always_mask)  # (B, 1, 1, S) or None
        x = self.embed(src_tokens)  # (B, S, D)
        for layer in self.layers:
            x = layer(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return EncoderOut(out=x, padding_mask=padding_mask)


class TransformerDecoder(RowPacking, nn.Module):
    """Embeddings + N decoder layers (3.1) + the pre-softmax linear projection (3.4)."""

    always_mask = False  # in teacher forcing, a memory mask even when nothing is padded (for compiled layers)

    def __init__(self, cfg: TransformerConfig, embed: InputEmbedding, output_projection: nn.Linear):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.final_norm = nn.LayerNorm(cfg.decoder_embed_dim) if cfg.decoder_normalize_before else None
        self.output_projection = output_projection

    def forward(self, prev_output_tokens: Tensor, enc: EncoderOut, cache: DecoderCache | None = None,
                output_mask: Tensor | None = None, features_only: bool = False) -> Tensor:
        """Logits (B, T, V), or (N, V) for the N positions where ``output_mask`` (B, T) is True; with
        ``features_only``, the last layer's output (B, T, D) or (N, D) before the output projection.

        Without ``cache``, the whole target at once (teacher forcing); with it, the newest token(s) after the
        ``cache.length`` decoded so far, whose keys/values the cache keeps (``models/paths.py`` says how either runs
        its layers: ``prepare``, each layer with its own attention path, ``advance``)."""
        run = cache if cache is not None else TeacherForcing(len(self.layers), output_mask, self.pack_rows,
                                                             self.always_mask)
        if run.runs_decoder:  # the backend's recorded step (one CUDA graph) on fixed buffers
            x = run.run(self, prev_output_tokens, enc.out, enc.padding_mask, key_padding_mask)
        else:
            x = self.embed(prev_output_tokens, run.length)  # (B, T, D)
            x, memory_mask = run.prepare(x, enc.out, enc.padding_mask, key_padding_mask)
            for layer, path in zip(self.layers, run.layers):
                x = layer(x, enc.out, memory_mask, path)
            if self.final_norm is not None:
                x = self.final_norm(x)
            x = run.advance(x, prev_output_tokens.size(1), prev_output_tokens.size(0))
        if features_only:
            return x
        return self.output_projection(x)  # (B, T, V) or (N, V)


# --------------------------------------------------------------------------------------------- the model


@register("model", "transformer", config=TransformerConfig)
class TransformerModel(EncoderDecoderModel):
    """Transformer encoder-decoder (Vaswani et al., 2017) with optional pre-norm, learned positions, shared embeddings."""

    def __init__(self, cfg: TransformerConfig, src_vocab: int, tgt_vocab: int, pad_idx: int, *, joint_vocab: bool):
        super().__init__()
        if cfg.share_all_embeddings:
            if not joint_vocab or src_vocab != tgt_vocab:
                raise UserError("--share-all-embeddings needs a joined dictionary (preprocess --joined-dictionary); "
                                "re-run preprocess with --joined-dictionary or train with --no-share-all-embeddings")
        self.cfg = cfg
        self.pad_idx = pad_idx
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab

        src_tokens = token_embedding(src_vocab, cfg.encoder_embed_dim, pad_idx)
        tgt_tokens = src_tokens if cfg.share_all_embeddings else token_embedding(tgt_vocab, cfg.decoder_embed_dim,
                                                                                 pad_idx)
        output_projection = nn.Linear(cfg.decoder_embed_dim, tgt_vocab, bias=False)
        if cfg.share_all_embeddings or cfg.share_decoder_input_output_embed:
            output_projection.weight = tgt_tokens.weight  # 3.4: the same matrix, tied
        else:
            nn.init.normal_(output_projection.weight, mean=0.0, std=cfg.decoder_embed_dim**-0.5)

        def positions(dim: int, max_positions: int, what: str) -> nn.Module:
            return (LearnedPositions(max_positions, dim, what) if cfg.learned_pos
                    else SinusoidalPositions(dim, style=cfg.sinusoid_style))

        scale = not cfg.no_scale_embedding
        self.encoder = TransformerEncoder(cfg, InputEmbedding(
            src_tokens, positions(cfg.encoder_embed_dim, cfg.max_source_positions, "--max-source-positions"),
            scale, cfg.dropout, pad_idx, cfg.source_word_dropout))
        self.decoder = TransformerDecoder(cfg, InputEmbedding(
            tgt_tokens, positions(cfg.decoder_embed_dim, cfg.max_target_positions, "--max-target-positions"),
            scale, cfg.dropout, pad_idx), output_projection)

    @classmethod
    def build(cls, cfg: TransformerConfig, src_vocab: int, tgt_vocab: int, pad_idx: int, *,
              joint_vocab: bool) -> TransformerModel:
        """The model for dictionaries of ``src_vocab`` / ``tgt_vocab`` symbols (``joint_vocab``: one shared one)."""
        return cls(cfg, src_vocab, tgt_vocab, pad_idx, joint_vocab=joint_vocab)

    def forward(self, src_tokens: Tensor, src_lengths: Tensor, prev_output_tokens: Tensor,
                output_mask: Tensor | None = None, features_only: bool = False) -> Tensor:
        """Teacher-forced logits (B, T, V) for right-padded ``src_tokens`` (B, S) and ``prev_output_tokens`` (B, T).

        With ``output_mask`` (B, T) bool: logits (N, V) of only the N positions where it is True, in row-major
        order (``logits_full[output_mask]``). Training passes the non-padding target positions: the projection to
        the vocabulary and the loss are the largest per-token costs, and padding rows would be computed for
        nothing. With ``features_only``: the decoder's output before the projection, (B, T, D) or (N, D); the
        training criterion then fuses the projection (``output_projection_weight``) with the loss.
        """
        return self.decoder(prev_output_tokens, self.encode(src_tokens, src_lengths), output_mask=output_mask,
                            features_only=features_only)

    def output_projection_weight(self) -> Tensor:
        """The (V, D) weight of the pre-softmax projection (3.4; no bias), tied to the embeddings when shared."""
        return self.decoder.output_projection.weight

    def encode(self, src_tokens: Tensor, src_lengths: Tensor) -> EncoderOut:
        """Encoder output (B, S, D) and padding mask (B, S).

        Padding is read from the tokens (``pad_idx``); ``src_lengths`` is part of the interface shared with
        the batching code and is not needed here.
        """
        return self.encoder(src_tokens)

    def decode(self, prev_output_tokens: Tensor, enc: EncoderOut, cache: DecoderCache | None = None) -> Tensor:
        """Logits (B, T, V).

        Without ``cache``: the whole target prefix at once (teacher forcing). With ``cache``: only the newest
        token(s) (B, 1), at positions following the ``cache.length`` tokens already decoded; their self-attention
        keys/values are appended to the cache, and the encoder-decoder keys/values are computed on the first call
        and reused.
        """
        return self.decoder(prev_output_tokens, enc, cache)

    def decode_features(self, prev_output_tokens: Tensor, enc: EncoderOut, cache: DecoderCache | None = None) -> Tensor:
        """``decode`` without the output projection: the decoder's output (B, T, D); ``output_layer`` finishes it.

        Beam search projects the features a block of rows at a time, so that the (rows x vocabulary) logits and
        log-probabilities stay small enough to be reused from the allocator instead of freshly mapped each step.
        """
        return self.decoder(prev_output_tokens, enc, cache, features_only=True)

    def output_layer(self, features: Tensor) -> Tensor:
        """Logits (..., V) of decoder features (..., D): the pre-softmax projection (3.4)."""
        return self.decoder.output_projection(features)

    def new_cache(self, beam: int = 1, kernels: DecodingKernels = DecodingKernels()) -> DecoderCache:
        """An empty cache for ``decode``; ``beam``: decoder rows per sentence of the encoder output; ``kernels``:
        the backend's choice of cache and attention form (``models/caches.py``).

        With ``beam`` > 1, ``decode`` takes ``beam`` consecutive rows per sentence of ``enc`` (hypotheses of one
        sentence), which share that sentence's encoder output and encoder-decoder keys/values.
        """
        return decoder_cache(len(self.decoder.layers), beam, self.cfg.max_target_positions, kernels)

    def new_pool_cache(self, beam: int, kernels: DecodingKernels = DecodingKernels(),
                       device: torch.device | str = "cpu") -> DecoderCache:
        """An empty cache of sentence places for continuous batching (``attnmt.generation.continuous``):
        sentences join and leave it between calls, each decoded at its own position, ``beam`` rows each."""
        return pool_cache(len(self.decoder.layers), beam, kernels, device)

    @staticmethod
    def reorder(enc: EncoderOut, cache: DecoderCache | None, new_order: Tensor,
                sentences: Tensor | None = None) -> tuple[EncoderOut, DecoderCache | None]:
        """Follow the search: row ``r`` of the next ``decode`` continues current row ``new_order[r]``.

        ``sentences``: the current sentences that stay, in order (None: all stay, or with a cache of beam 1 where
        rows are sentences, ``new_order`` itself, which may repeat or shuffle them). With a larger beam, rows move
        only within their sentence. The cache is updated in place (use the returned one; the old ``enc`` may no
        longer match it): beam reordering touches no keys/values, and finished sentences are dropped lazily.
        """
        if cache is None:
            keep = new_order if sentences is None else sentences
        else:
            keep = cache.reorder(new_order, sentences)
        if keep is not None:
            enc = EncoderOut(enc.out.index_select(0, keep), enc.padding_mask.index_select(0, keep))
        return enc, cache

    def max_positions(self) -> tuple[int, int]:
        """(source, target) length limits in tokens."""
        return self.cfg.max_source_positions, self.cfg.max_target_positions

