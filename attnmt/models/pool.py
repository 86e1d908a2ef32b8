"""Decoder state for continuous batching: sentences join and leave a running search, each at its own step.

A static search (:class:`~attnmt.models.incremental.SlotCache`) starts its sentences together and runs until the
last one ends, so its steps hold fewer and fewer of them. This cache is a pool of sentence **places** instead: a
sentence takes a free place when it joins (its encoder-decoder keys/values are projected into the place on its
first step), decodes at its own position, and frees the place when its search ends, for the next sentence to
join. Nothing is copied when sentences join or leave; the buffers grow (doubling) only when more places or more
positions are needed than ever before.

Layout per layer, as the slot cache's, per place instead of per batch sentence:

* self-attention keys/values (places, H, positions * beam, Dh): position ``s`` of row ``j`` of a place in slot
  ``s * beam + j``, written once; ``ancestors`` (rows, positions) int32 says which row of the sentence holds each
  position of a row's history, so that reordering the beams moves a few integers, never keys;
* encoder-decoder keys/values (places, H, S, Dh) and ``keep`` (places, S) bool, False past a sentence's source
  (``S``: the longest source seen so far);
* ``lengths`` (places,) int64: the positions each place has decoded.

The decoder is called with ``beam`` consecutive rows per live sentence, sentences in the order of ``live`` (their
places), one token per row; each row's position is its sentence's length (``length``, per row). A backend's step
kernel (``DecodingKernels.step_attention``) takes the per-place lengths; without one, the batched attention runs
over every place under a mask (the free places' queries are zeros and their outputs are dropped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnmt.models.incremental import _attend, _attend_fused, _bias, _pad
from attnmt.models.interface import DecoderCache, LayerCache
from attnmt.models.kernels import RowBucket, StepAttention, StepRows

FIRST_POSITIONS = 16  # positions the self-attention buffers hold at first (doubled when a sentence needs more)


def _grown(buf: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A zeroed tensor of ``shape`` (like ``like``) holding ``buf`` in its leading corner."""
    new = like.new_zeros(shape)
    if buf is not None:
        new[tuple(slice(0, n) for n in buf.shape)] = buf
    return new


def _widened(x: Tensor, width: int) -> Tensor:
    """``x`` (n, S, D) with zero positions appended up to ``width``."""
    return x if x.size(1) >= width else torch.cat([x, x.new_zeros(x.size(0), width - x.size(1), x.size(2))], dim=1)


class PoolLayerCache(LayerCache):
    """One decoder layer's keys/values in the pool's places."""

    def __init__(self, owner: PoolCache):
        self.owner = owner
        self.k: Tensor | None = None  # (places, H, positions * beam, Dh)
        self.v: Tensor | None = None
        self.cross_k: Tensor | None = None  # (places, H, S, Dh)
        self.cross_v: Tensor | None = None

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.owner
        K, R = c.beam, c.rows
        _, H, T, Dh = q.shape
        if T != 1:
            raise ValueError(f"a pool cache decodes one token per row and step, got {T}")
        shape = (c.places, H, c.positions * K, Dh)
        if self.k is None or self.k.shape != shape or self.k.dtype != q.dtype:
            self.k, self.v = _grown(self.k, shape, q), _grown(self.v, shape, q)
        kernel = c.step_kernel(q)
        if kernel is not None:
            return kernel.self_attention(q, k, v, self.k, self.v, c.step_rows(), c.lengths,
                                         c.ancestors if K > 1 else None, 1)
        A = R // K
        pos = c.lengths.index_select(0, c.live)
        for buf, new in ((self.k, k), (self.v, v)):  # row j's key of position pos -> slot pos * beam + j
            buf.view(c.places, H, c.positions, K, Dh)[c.live, :, pos] = new[:R].reshape(A, K, H, Dh).transpose(1, 2)
        return _pad(c.attend(q[:R], self.k, self.v, "self"), q.size(0))

    def cross_attention(self, q: Tensor, project_kv, memory: Tensor) -> Tensor:
        """The encoder output of the sentences that joined since the last call is projected into their places now
        (the cache holds it: ``memory`` is not read); the others' keys/values are in place already."""
        c = self.owner
        if c.joining is not None:
            k, v = project_kv(c.joining_memory)  # (n, H, S_new, Dh)
            shape = (c.places, k.size(1), c.source_positions, k.size(3))
            if self.cross_k is None or self.cross_k.shape != shape or self.cross_k.dtype != k.dtype:
                self.cross_k, self.cross_v = _grown(self.cross_k, shape, k), _grown(self.cross_v, shape, k)
            self.cross_k[c.joining, :, : k.size(2)] = k
            self.cross_v[c.joining, :, : v.size(2)] = v
        kernel = c.step_kernel(q)
        if kernel is not None:
            return kernel.cross_attention(q, self.cross_k, self.cross_v, c.step_rows(), c.keep)
        return _pad(c.attend(q[: c.rows], self.cross_k, self.cross_v, "memory"), q.size(0))


class PoolCache(DecoderCache):
    """Places for sentences at different steps of one search (see the module docstring); ``beam`` rows each."""

    def __init__(self, num_layers: int, beam: int = 1, row_bucket: RowBucket | None = None,
                 fused_attention: bool = False, step_attention: StepAttention | None = None,
                 device: torch.device | str = "cpu"):
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        self.beam = beam
        self.row_bucket = row_bucket
        self.fused_attention = fused_attention
        self.step_attention = step_attention
        self.device = torch.device(device)
        self.layers: list[LayerCache] = [PoolLayerCache(self) for _ in range(num_layers)]
        self.places = 0  # places in the buffers
        self.free: list[int] = []  # free places, the next one last
        self.live = torch.zeros(0, dtype=torch.int64, device=self.device)  # (A,) the live sentences' places
        self.lengths = torch.zeros(0, dtype=torch.int64, device=self.device)  # (places,) positions decoded
        self.positions = FIRST_POSITIONS  # positions the self-attention buffers hold
        self.source_positions = 1  # source positions the encoder-decoder buffers hold
        self.keep = torch.zeros(0, 1, dtype=torch.bool, device=self.device)  # (places, S): False = no source there
        self.ancestors = torch.zeros(0, self.positions, dtype=torch.int32, device=self.device)  # (rows, positions)
        self.joining: Tensor | None = None  # places whose encoder-decoder keys/values the next call projects
        self.joining_memory: Tensor | None = None  # (joining, S, D) their encoder output
        self.rows = 0
        self._step_rows: StepRows | None = None
        self._masks: dict[tuple[str, torch.dtype], Tensor | None] = {}

    @property
    def length(self) -> Tensor:  # type: ignore[override]
        """Each row's position in this call, (rows, 1): its sentence's decoded length."""
        return self.lengths.index_select(0, self.live).repeat_interleave(self.beam)[:, None]

    @property
    def size(self) -> int:
        """Live sentences."""
        return self.live.numel()

    # -------------------------------------------------------------------------------- sentences join and leave

    def admit(self, enc) -> Tensor:
        """Give the sentences of an encoder output ``enc`` (``out`` (n, S, D), ``padding_mask`` (n, S)) places
        after the live ones (their rows come last in the next call, which projects their keys/values from it);
        returns the places."""
        padding = enc.padding_mask
        n, S = padding.shape
        if n > len(self.free):
            self._grow_places(max(2 * self.places, self.places + n - len(self.free)))
        places = torch.tensor([self.free.pop() for _ in range(n)], dtype=torch.int64, device=self.device)
        if S > self.source_positions:
            self.source_positions = S
            self.keep = _grown(self.keep, (self.places, S), self.keep)
        self.keep[places] = False
        self.keep[places, :S] = ~padding
        self.lengths[places] = 0
        self.live = torch.cat([self.live, places])
        self.ancestors = torch.cat([self.ancestors, self.ancestors.new_zeros(n * self.beam, self.positions)])
        if self.joining is None:
            self.joining, self.joining_memory = places, enc.out
        else:  # two groups before a call: one memory, the shorter sources padded
            a, b = self.joining_memory, enc.out
            width = max(a.size(1), b.size(1))
            self.joining = torch.cat([self.joining, places])
            self.joining_memory = torch.cat([_widened(a, width), _widened(b, width)])
        return places

    def _grow_places(self, places: int) -> None:
        self.free.extend(range(places - 1, self.places - 1, -1))  # the lowest new place is taken first
        self.lengths = _grown(self.lengths, (places,), self.lengths)
        self.keep = _grown(self.keep, (places, self.source_positions), self.keep)
        self.places = places

    def reorder(self, new_order: Tensor, sentences: Tensor | None = None) -> None:
        """Row ``r`` of the next call continues row ``new_order[r]`` of this one, a row of the same sentence;
        ``sentences``: the live sentences that stay, in order (None: all); the others' places are freed."""
        if self.beam > 1:
            self.ancestors = self.ancestors.index_select(0, new_order)
        elif sentences is not None:
            self.ancestors = self.ancestors.index_select(0, sentences)
        if sentences is not None:
            stays = torch.zeros(self.live.numel(), dtype=torch.bool, device=self.device)
            stays[sentences] = True
            self.free.extend(self.live[~stays].tolist())
            self.live = self.live.index_select(0, sentences)

    # -------------------------------------------------------------------------------- per call

    def prepare(self, x: Tensor, memory: Tensor, memory_padding: Tensor,
                mask_of: Callable[[Tensor], Tensor | None]) -> tuple[Tensor, Tensor | None]:
        """Start a call on ``x`` (rows, 1, D): each row's history gets its own slot at its position; returns
        ``x`` padded to the row bucket (the masks live in the cache)."""
        K = self.beam
        rows = x.size(0)
        if rows != self.live.numel() * K or x.size(1) != 1:
            raise ValueError(f"the decoder got {rows} rows of {x.size(1)} tokens but the pool holds "
                             f"{self.live.numel()} live sentences of {K} rows, one token each")
        self.rows = rows
        self._step_rows = None
        self._masks = {}  # made on demand, for this call's rows
        pos = self.lengths.index_select(0, self.live)
        longest = int(pos.max()) + 1 if rows else 0
        if longest > self.positions:
            while longest > self.positions:
                self.positions *= 2
            self.ancestors = _grown(self.ancestors, (self.ancestors.size(0), self.positions), self.ancestors)
        if K > 1 and rows:
            own = torch.arange(K, dtype=torch.int32, device=self.device).repeat(rows // K)
            self.ancestors[torch.arange(rows, device=self.device), pos.repeat_interleave(K)] = own
        return (x if self.row_bucket is None else _pad(x, self.row_bucket(rows))), None

    def advance(self, x: Tensor, new_tokens: int, rows: int) -> Tensor:
        self.lengths[self.live] += new_tokens
        self.joining = self.joining_memory = None
        return x[:rows]

    def step_kernel(self, q: Tensor) -> StepAttention | None:
        kernel = self.step_attention
        return kernel if kernel is not None and kernel.supports(q) else None

    def step_rows(self) -> StepRows:
        if self._step_rows is None:
            self._step_rows = StepRows(self.rows, self.beam, self.live, self.beam)
        return self._step_rows

    # -------------------------------------------------------------------------------- the batched attention

    def _mask(self, which: str) -> Tensor:
        """True = attend: "self" (places, 1, beam, positions * beam): a row's own history; "memory" (places, 1,
        1, S): the source. Free places see everything (their queries are zeros; no row of NaNs)."""
        if which == "memory":
            free = torch.ones(self.places, dtype=torch.bool, device=self.device).index_fill_(0, self.live, False)
            return (self.keep | free[:, None])[:, None, None, :]
        K, P, A = self.beam, self.positions, self.live.numel()
        pos = self.lengths.index_select(0, self.live)
        seen = torch.arange(P, device=self.device)[None, :] <= pos[:, None]  # (A, P)
        own = self.ancestors[:, :P, None] == torch.arange(K, dtype=torch.int32, device=self.device)  # (R, P, K)
        mask = own.view(A, K, P * K) & seen.repeat_interleave(K, dim=1)[:, None, :]
        full = torch.ones(self.places, 1, K, P * K, dtype=torch.bool, device=self.device)
        return full.index_copy_(0, self.live, mask[:, None])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, which: str) -> Tensor:
        """Attention of the live rows' queries (R, H, 1, Dh) to the places' keys/values; (R, 1, H * Dh)."""
        R, H, _, Dh = q.shape
        K = self.beam
        qs = q.new_zeros((self.places, H, K, Dh)).index_copy_(0, self.live, q.reshape(R // K, K, H, Dh).transpose(1, 2))
        key = (which, torch.bool if self.fused_attention else q.dtype)
        if key not in self._masks:
            mask = self._mask(which)
            self._masks[key] = mask if self.fused_attention else _bias(mask, q.dtype)
        out = (_attend_fused if self.fused_attention else _attend)(qs, k, v, self._masks[key])
        return out.index_select(0, self.live).transpose(1, 2).reshape(R, 1, H * Dh)
