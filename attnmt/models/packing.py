"""The decoder's real positions as packed rows: teacher forcing without computing the target's padding.

A batch's targets are padded on the right to its longest sentence; on the Multi30k recipe's batches 12% of the
decoder's positions are padding, and every decoder layer would multiply them through its projections and its
feed-forward layer. Under the causal mask (3.2.3) a position attends only to itself and to earlier positions,
so when the positions wanted (``output_mask``) are a prefix of each sentence, their outputs do not depend on any
position after them: computing the padding changes nothing the loss sees. :class:`PackedRows` keeps the
decoder's hidden states as the (N, D) rows of the N real positions instead; the position-wise layers (the
projections, the feed-forward layers, the layer norms, residual dropout) run on those rows as they would on
(B, T, D). A backend's attention kernel (:class:`~attnmt.models.kernels.TrainingAttention`) reads the rows
where they are, told where each sentence's rows lie (:class:`SentenceRows`). PyTorch's attention needs the
(B, T) grid: :meth:`PackedRows.split_heads` writes the rows into zero-padded (B, H, T, Dh) heads and
:meth:`PackedRows.merge_heads` reads them back, one copy each way, the same copy that splitting the heads of a
(B, T, D) tensor makes anyway.

Each copy is an ``index_select`` (a row gather) whose adjoint is an ``index_copy_`` into zeros (a row scatter to
distinct rows), and the other way round; the two autograd functions below pair them explicitly, because
autograd's own backward for ``index_select`` accumulates with ``index_add_``, which PyTorch's CPU kernel runs one
row at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SentenceRows:
    """Which rows of a (rows, ...) matrix hold each sentence's positions: sentence b's position t is row
    ``start[b] + t`` for t < ``length[b]``; ``longest`` bounds the lengths (the padded length); ``rows``: the
    matrix's row count. A (B, T, ...) tensor flattened to (B * T, ...) is :meth:`grid`; packed rows
    (:class:`PackedRows`) start where the previous sentence ends."""

    start: Tensor  # (B,) int64
    length: Tensor  # (B,) int64
    longest: int
    rows: int

    @classmethod
    def grid(cls, batch: int, length: int, device: torch.device) -> SentenceRows:
        """Every sentence ``length`` rows long, sentence b from row b * length."""
        return cls(torch.arange(batch, device=device) * length,
                   torch.full((batch,), length, dtype=torch.long, device=device), length, batch * length)


def _scatter(x: Tensor, index: Tensor, total: int) -> Tensor:
    """(total, ...) zeros with row ``index[i]`` set to ``x[i]`` (``index`` holds distinct rows)."""
    out = x.new_zeros((total, *x.shape[1:]))
    return out.index_copy_(0, index, x)


class _GatherRows(torch.autograd.Function):
    """``x[index]`` for x (total, ...); backward scatters the gradient back into zeros."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.total = x.size(0)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return _scatter(grad, index, ctx.total), None


class _ScatterRows(torch.autograd.Function):
    """:func:`_scatter`; backward gathers the gradient's rows ``index``."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, total: int) -> Tensor:
        ctx.save_for_backward(index)
        return _scatter(x, index, total)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class RowPacking:
    """Mixin of decoders that can run teacher forcing on packed rows (:class:`PackedRows`); the backend chooses
    (:func:`set_row_packing`): on a CPU the padding's products cost more than the gathers and scatters that skip
    them, on a GPU the other way round (there a padded row costs little next to a kernel launch and a scatter)."""

    pack_rows: bool = True


def set_row_packing(model: torch.nn.Module, on: bool) -> None:
    """Choose whether every decoder of ``model`` packs its rows in teacher forcing."""
    for m in model.modules():
        if isinstance(m, RowPacking):
            m.pack_rows = on


def is_prefix(mask: Tensor) -> bool:
    """Whether every row of the bool ``mask`` (B, T) is True up to some length and False after it."""
    lengths = mask.sum(dim=1, keepdim=True)
    return bool(torch.equal(mask, torch.arange(mask.size(1), device=mask.device) < lengths))


class PackedRows:
    """The positions where ``keep`` (B, T) is True, a prefix of each row, as N rows in row-major order."""

    def __init__(self, keep: Tensor):
        self.batch, self.length = keep.shape
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (N,) positions in the flattened (B*T) grid
        lengths = keep.sum(dim=1)
        self.sentences = SentenceRows(lengths.cumsum(0) - lengths, lengths, self.length, self.index.numel())
        self._head_rows: dict[tuple[int, int], Tensor] = {}

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (N, D): the kept positions' rows."""
        return _GatherRows.apply(x.reshape(-1, x.size(-1)), self.index)

    def split_heads(self, x: Tensor, parts: int, heads: int) -> tuple[Tensor, ...]:
        """(N, parts * heads * Dh) rows (e.g. Q, K, V side by side) -> ``parts`` contiguous (B, H, T, Dh) tensors,
        zero at the padding positions."""
        dh = x.size(-1) // (parts * heads)
        out = _ScatterRows.apply(x.reshape(-1, dh), self._rows_of_heads(parts, heads),
                                 parts * self.batch * heads * self.length)
        return out.view(parts, self.batch, heads, self.length, dh).unbind(0)

    def merge_heads(self, out: Tensor) -> Tensor:
        """(B, H, T, Dh) -> (N, H * Dh): the kept positions with their heads side by side (Concat, 3.2.2)."""
        _, heads, _, dh = out.shape
        return _GatherRows.apply(out.reshape(-1, dh), self._rows_of_heads(1, heads)).view(-1, heads * dh)

    def _rows_of_heads(self, parts: int, heads: int) -> Tensor:
        """For each row (n, j, h) of packed (N, parts, H, Dh) heads, its row (j, b, h, t) of (parts, B, H, T, Dh)."""
        key = (parts, heads)
        if key not in self._head_rows:
            B, T = self.batch, self.length
            b, t = (self.index // T)[:, None, None], (self.index % T)[:, None, None]
            j = torch.arange(parts, device=self.index.device)[None, :, None]
            h = torch.arange(heads, device=self.index.device)[None, None, :]
            self._head_rows[key] = (((j * B + b) * heads + h) * T + t).reshape(-1)
        return self._head_rows[key]
