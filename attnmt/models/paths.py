"""The Transformer's attention and decoder computed other than as written in ``models/transformer.py``: the same
numbers, laid out where the backend or the decoding state needs them.

``MultiHeadAttention`` computes the paper's formula itself unless its call carries an :class:`AttentionPath`, or the
backend gave it one (``default_path``, set with its kernel by ``models/tuning.py``):

* :class:`RowsPath`: the encoder and teacher forcing. The backend's attention kernel
  (:class:`~attnmt.models.kernels.TrainingAttention`) reads the projections' outputs as they lie, where it takes
  the operands, and the decoder's states may be packed rows (``models/packing.py``) instead of the (B, T) grid.
* :class:`~attnmt.models.interface.LayerCache`: decoding step by step. The cache stores the new keys/values and
  attends under its own masks (``LayerCache.attend``, with the glue between the model's heads and the cache's
  below).

The decoder runs a call through a :class:`~attnmt.models.interface.DecoderCache` while decoding and through
:class:`TeacherForcing` otherwise: ``prepare``, each layer with its own path (``layers[i]``), ``advance``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from attnmt.models.kernels import TrainingAttention
from attnmt.models.packing import PackedRows, SentenceRows, is_prefix


class MultiHeadAttention(Protocol):
    """What a path reads of ``models/transformer.py``'s ``MultiHeadAttention``: its projections, its sizes and
    its head reshapes."""

    num_heads: int
    key_dim: int  # d_k
    head_dim: int  # d_v
    widths: list[int]  # the widths of Q, K, V in ``qkv_proj``'s output
    dropout: float
    training: bool
    fused_attention: TrainingAttention | None  # the backend's kernel
    qkv_proj: nn.Module
    q_proj: nn.Module
    kv_proj: nn.Module
    out_proj: nn.Module

    def use_plain_attention(self, queries: int, keys: int) -> bool: ...
    def split_heads(self, x: Tensor) -> Tensor: ...
    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...
    def split_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]: ...
    def scaled_dot_product(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                           is_causal: bool = False) -> Tensor: ...
    def combine_heads(self, out: Tensor) -> Tensor: ...


class AttentionPath(ABC):
    """How one attention call runs: ``attend`` gives what ``MultiHeadAttention`` would, shaped as ``x``."""

    @abstractmethod
    def attend(self, attn: MultiHeadAttention, x: Tensor, memory: Tensor | None, mask: Tensor | None,
               is_causal: bool) -> Tensor:
        """``attn``'s attention from ``x`` to ``memory`` (``x`` itself where None) under ``mask``/``is_causal``."""


# ------------------------------------------------------------------------ the encoder, teacher forcing


class RowsPath(AttentionPath):
    """Attention on the (B, T) grid (``rows`` None) or on the decoder's packed ``rows`` (N, D), through the
    backend's kernel (``attn.fused_attention``) where the plain form would run without dropout and the kernel
    takes the operands, by PyTorch's operations otherwise."""

    def __init__(self, rows: PackedRows | None = None):
        self.rows = rows

    def attend(self, attn, x, memory, mask, is_causal):
        rows = self.rows
        length = x.size(1) if rows is None else rows.length
        if memory is None:  # self-attention
            qkv = attn.qkv_proj(x)
            kernel = _kernel(attn, length, length)
            if kernel is not None:
                queries = rows.sentences if rows is not None else SentenceRows.grid(x.size(0), length, x.device)
                out = _attend_rows(attn, kernel, x, qkv, None, queries, queries, mask, is_causal)
                if out is not None:
                    return out
            if rows is None:
                q, k, v = attn.split_qkv(qkv)
            elif attn.key_dim == attn.head_dim:
                q, k, v = rows.split_heads(qkv, 3, attn.num_heads)
            else:
                q, k, v = (rows.split_heads(part, 1, attn.num_heads)[0] for part in qkv.split(attn.widths, dim=-1))
        else:  # encoder-decoder attention
            q, kv = attn.q_proj(x), attn.kv_proj(memory)
            B, S, _ = memory.shape
            kernel = _kernel(attn, length, S)
            if kernel is not None:
                queries = rows.sentences if rows is not None else SentenceRows.grid(B, x.size(1), x.device)
                out = _attend_rows(attn, kernel, x, q, kv, queries, SentenceRows.grid(B, S, memory.device), mask,
                                   False)
                if out is not None:
                    return out
            q = rows.split_heads(q, 1, attn.num_heads)[0] if rows is not None else attn.split_heads(q)
            k, v = attn.split_kv(kv)
        out = attn.scaled_dot_product(q, k, v, mask, is_causal)  # (B, H, T, Dh)
        return attn.combine_heads(out) if rows is None else attn.out_proj(rows.merge_heads(out))


def _kernel(attn: MultiHeadAttention, queries: int, keys: int) -> TrainingAttention | None:
    """The backend's attention kernel where the plain form would run without dropout, else None."""
    dropout_p = attn.dropout if attn.training else 0.0
    if (attn.fused_attention is not None and dropout_p == 0.0 and attn.key_dim == attn.head_dim
            and attn.use_plain_attention(queries, keys)):
        return attn.fused_attention
    return None


def _attend_rows(attn: MultiHeadAttention, kernel: TrainingAttention, x: Tensor, q: Tensor, kv: Tensor | None,
                 queries: SentenceRows, keys: SentenceRows, mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """W^O of the kernel's heads, read and written where the projections put them (``q``, ``kv`` as they came
    from them); shaped as ``x``. None where the kernel does not take these operands."""
    q = q.reshape(-1, q.size(-1))
    kv = None if kv is None else kv.reshape(-1, kv.size(-1))
    if not kernel.supports(q, kv, attn.num_heads, keys, mask):
        return None
    out = kernel.attend(q, kv, attn.num_heads, queries, keys, mask, is_causal)
    return attn.out_proj(out.view(*x.shape[:-1], out.size(-1)))


class TeacherForcing:
    """A decoder call without a cache: the whole target at once under the causal mask. Where the backend packs
    rows (``pack_rows``) and the wanted positions (``output_mask`` (B, T)) are a prefix of each sentence, the
    layers run on those positions' rows alone; ``advance`` gives the wanted positions' outputs (N, D), or all
    (B, T, D) without a mask."""

    length = 0  # positions decoded before this call
    runs_decoder = False

    def __init__(self, num_layers: int, output_mask: Tensor | None, pack_rows: bool, always_mask: bool):
        self.num_layers = num_layers
        self.output_mask = output_mask
        self.pack_rows = pack_rows
        self.always_mask = always_mask  # a memory mask even when nothing is padded (compiled layers)
        self.rows: PackedRows | None = None
        self.layers: list[AttentionPath | None] = [None] * num_layers

    def prepare(self, x: Tensor, memory: Tensor, memory_padding: Tensor,
                mask_of: Callable[..., Tensor | None]) -> tuple[Tensor, Tensor | None]:
        memory_mask = mask_of(memory_padding, self.always_mask)  # (B, 1, 1, S) or None
        keep = self.output_mask
        if keep is not None and self.pack_rows and not bool(keep.all()) and is_prefix(keep):
            self.rows = PackedRows(keep)
            x = self.rows.pack(x)  # (N, D)
            self.layers = [RowsPath(self.rows)] * self.num_layers
        return x, memory_mask

    def advance(self, x: Tensor, new_tokens: int, rows: int) -> Tensor:
        keep = self.output_mask
        if keep is None or self.rows is not None:
            return x
        x = x.reshape(-1, x.size(-1))  # (N, D): padding never reaches the (large) output projection
        if not bool(keep.all()):
            x = x.index_select(0, keep.reshape(-1).nonzero().squeeze(1))  # = x[keep], faster
        return x


# ------------------------------------------------------------------------------ decoding step by step

# A decoder cache holds queries, keys and values of one head size. Where d_k differs from d_v, the heads go to it
# zero-padded to the larger of the two, the queries scaled by sqrt(that / d_k): the padding adds nothing to Q K^T
# or to the values, and the cache's 1/sqrt(head size) becomes the model's 1/sqrt(d_k).


def heads_for_cache(attn: MultiHeadAttention, q: Tensor | None = None, k: Tensor | None = None,
                    v: Tensor | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Heads (.., T, d_k or d_v) as a decoder cache holds them (None stays None)."""
    if attn.key_dim == attn.head_dim:
        return q, k, v
    size = max(attn.key_dim, attn.head_dim)

    def pad(t: Tensor | None) -> Tensor | None:
        return t if t is None or t.size(-1) == size else F.pad(t, (0, size - t.size(-1)))

    if q is not None and attn.key_dim < size:
        q = pad(q) * math.sqrt(size / attn.key_dim)
    return q, pad(k), pad(v)


def kv_for_cache(attn: MultiHeadAttention, memory: Tensor) -> tuple[Tensor, Tensor]:
    """Encoder-decoder keys/values of ``memory`` (B, S, D_enc) as a decoder cache holds them."""
    _, k, v = heads_for_cache(attn, None, *attn.split_kv(attn.kv_proj(memory)))
    return k, v


def cached_output(attn: MultiHeadAttention, out: Tensor) -> Tensor:
    """W^O of a cache's attention output (R, T, H * cache head size)."""
    if attn.head_dim < attn.key_dim:
        R, T, _ = out.shape
        out = out.view(R, T, attn.num_heads, attn.key_dim)[..., : attn.head_dim].reshape(R, T, -1)
    return attn.out_proj(out)
