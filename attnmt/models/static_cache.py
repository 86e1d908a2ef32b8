"""Decoder state of fixed shapes for a whole beam search, so that a GPU can replay each step as one CUDA graph.

The slot cache (:mod:`attnmt.models.incremental`) keeps its buffers as small as the search allows: it grows them a
few positions at a time and drops finished sentences from its rows. Every decoding step is then a few dozen
kernels of new shapes, launched one by one from Python, and a GPU waits on those launches most of the time. This
cache instead fixes every shape for as long as it can:

* **Rows.** A finished sentence keeps its ``beam`` rows: they go on computing (on their last tokens) and are not
  read; the search sees only the live rows, gathered from the step's output. The finished sentences' rows are
  dropped only where the step is captured anew anyway (the buffers grow), or once the live sentences are an
  eighth of the rows' sentences, so that a long tail does not run on the whole batch's rows.
* **Positions.** The self-attention buffers hold ``positions`` steps (16 at first, doubled when a step needs
  more); the step's position is a one-element tensor on the device, so the same kernels serve every step.
* **Layout.** As the slot cache's: the keys/values of position ``s`` computed by row ``j`` of a sentence sit in
  slot ``s * beam + j`` of the sentence's buffer and never move; ``ancestors`` (rows, positions) says which row
  of the sentence holds each position of a row's history, and reordering the beams moves only these integers.
  The encoder-decoder keys/values are projected once, on the first step.

:meth:`StaticCache.run` runs a step of the decoder on these buffers through the backend's recorder
(``DecodingKernels.step_graphs``): eagerly, or, on a CUDA device (``attnmt/backends/cuda.py``), by capturing the
step (embedding, every layer, the final norm) once per buffer size as a CUDA graph and replaying it: one launch
per step instead of one per kernel. A step computes the same function either way, and the same one as the
slot cache's fused attention up to rounding (more masked slots enter the attention's sums, with weight 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnmt.models.interface import DecoderCache, LayerCache
from attnmt.models.kernels import EagerSteps, StepRecorder
from attnmt.models.paths import kv_for_cache

FIRST_POSITIONS = 16  # positions the self-attention buffers hold at first (doubled when a step needs more)
COMPACT_FRACTION = 0.125  # drop the finished sentences' rows once the live ones are at most this fraction


class StaticLayerCache(LayerCache):
    """One decoder layer's keys/values: (sentences, H, positions * beam, Dh) self-attention buffers and the
    (sentences, H, S, Dh) encoder-decoder keys/values."""

    def __init__(self, owner: StaticCache):
        self.owner = owner
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.cross_k: Tensor | None = None
        self.cross_v: Tensor | None = None

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c = self.owner
        B, K, L = c.sentences, c.beam, c.positions
        _, H, _, Dh = q.shape
        if self.k is None:  # the first (eager) run of a buffer size allocates; a captured step only writes
            self.k = q.new_zeros(B, H, L * K, Dh)
            self.v = q.new_zeros(B, H, L * K, Dh)
        for buf, new in ((self.k, k), (self.v, v)):  # row j's key of position pos -> slot pos * beam + j
            buf.view(B, H, L, K, Dh).index_copy_(2, c.position, new.view(B, K, H, 1, Dh).permute(0, 2, 3, 1, 4))
        return c.attend(q, self.k, self.v, c.self_mask)

    def cross_attention(self, q: Tensor, project_kv: Callable[[Tensor], tuple[Tensor, Tensor]],
                        memory: Tensor) -> Tensor:
        return self.owner.attend(q, self.cross_k, self.cross_v, self.owner.memory_mask)

    def select(self, sentences: Tensor) -> None:
        """Keep the buffers of ``sentences`` only."""
        for name in ("k", "v", "cross_k", "cross_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, sentences))

    def grow(self, positions: int) -> None:
        """Buffers of ``positions`` positions holding the current ones (slot numbers do not change)."""
        c = self.owner
        for name in ("k", "v"):
            old = getattr(self, name)
            if old is None:
                continue
            B, H, _, Dh = old.shape
            new = old.new_zeros(B, H, positions * c.beam, Dh)
            new[:, :, : old.size(2)] = old
            setattr(self, name, new)


class StaticCache(DecoderCache):
    """Fixed-shape decoder state for a beam search of ``beam`` rows per sentence (see the module docstring).

    ``recorder``: how its steps run (the backend's; None: eagerly), e.g. captured as a CUDA graph once per buffer
    size and replayed.
    The search drives it as any cache: one token per row and call (the first call may give one row per sentence,
    standing for all of its rows), and ``reorder`` after each step.
    """

    runs_decoder = True

    def __init__(self, num_layers: int, beam: int, max_positions: int, recorder: StepRecorder | None = None):
        if beam < 2:
            raise ValueError(f"a static cache serves beam search (beam >= 2), got beam {beam}")
        self.beam = beam
        self.recorder = EagerSteps() if recorder is None else recorder  # how steps run: the backend's
        self.layers: list[LayerCache] = [StaticLayerCache(self) for _ in range(num_layers)]
        self.length = 0
        self.sentences = 0
        self.max_positions = max_positions  # the model's target positions: the search never decodes past them
        self.positions = min(FIRST_POSITIONS, max_positions)
        self.live: Tensor | None = None  # (A,) the live sentences (None: all, in order)
        self.live_rows: Tensor | None = None  # (A * beam,) their rows
        # set up on the first call
        self.tokens: Tensor | None = None  # (R, 1) the step's input tokens
        self.position: Tensor | None = None  # (1,) int64: the step's position
        self.ancestors: Tensor | None = None  # (R, positions) int32
        self.own: Tensor | None = None  # (R, 1) int32: each row's index in its sentence
        self.memory_mask: Tensor | None = None  # (N, 1, 1, S) True = attend, or None
        self.self_mask: Tensor | None = None  # this step's (N, 1, beam, positions * beam), made inside the step
        self.features: Tensor | None = None  # (R, D) the step's output
        self._replay: Callable[[], None] | None = None  # the recorded step of the buffers' current sizes
        self.replays = 0  # steps run by replaying a captured graph

    # -------------------------------------------------------------------------------- the interface

    def prepare(self, x, memory, memory_padding, mask_of):
        raise RuntimeError("a static cache runs the decoder's step itself (StaticCache.run)")

    def advance(self, x, new_tokens, rows):
        raise RuntimeError("a static cache runs the decoder's step itself (StaticCache.run)")

    def reorder(self, new_order: Tensor, sentences: Tensor | None = None) -> None:
        """Row ``r`` of the next call continues live row ``new_order[r]`` (of the same sentence); ``sentences``:
        the live sentences that stay (None: all). Moves only ancestry; the encoder output stays as it is."""
        cur = self.live_rows
        src = new_order if cur is None else cur.index_select(0, new_order)
        if sentences is not None:
            self.live = sentences if self.live is None else self.live.index_select(0, sentences)
            own = torch.arange(self.beam, device=sentences.device)
            self.live_rows = (self.live[:, None] * self.beam + own).reshape(-1)
        if self.live_rows is None:
            self.ancestors.copy_(self.ancestors.index_select(0, src))
        else:
            self.ancestors.index_copy_(0, self.live_rows, self.ancestors.index_select(0, src))
        return None

    # -------------------------------------------------------------------------------- a step

    def run(self, decoder: nn.Module, tokens: Tensor, memory: Tensor, memory_padding: Tensor,
            mask_of: Callable[[Tensor], Tensor | None]) -> Tensor:
        """The decoder's output (rows, 1, D) for one token per live row (``tokens`` (rows, 1)); the first call
        may give one row per sentence (its rows start alike). ``decoder``: embedding (``embed``), ``layers``
        and ``final_norm`` of a Transformer decoder."""
        if tokens.size(1) != 1:
            raise ValueError(f"a static cache decodes one token per row and step, got {tokens.size(1)}")
        K = self.beam
        first = self.length == 0
        if first:
            self._setup(decoder, tokens, memory, memory_padding, mask_of)
        if self.live is not None and (self.length >= self.positions
                                      or self.live.numel() <= COMPACT_FRACTION * self.sentences):
            self._compact()  # at a new capture anyway, or once few sentences are left
        if self.length >= self.positions:
            self._grow(min(2 * self.positions, max(self.max_positions, self.length + 1)))
        if first:
            self.tokens.copy_(tokens.repeat_interleave(K, dim=0) if tokens.size(0) != self.tokens.size(0) else tokens)
        elif self.live_rows is None:
            self.tokens.copy_(tokens)
        else:
            self.tokens.index_copy_(0, self.live_rows, tokens)
        self.position.fill_(self.length)
        if self._replay is not None:
            self._replay()
            self.replays += 1
        else:  # run the step; the recorder may capture it for the next steps of these sizes
            self._replay = self.recorder.record(lambda: self._step(decoder, memory))
        self.length += 1
        out = self.features
        if first and tokens.size(0) != out.size(0):
            out = out[::K]
        out = out.clone() if self.live_rows is None or first else out.index_select(0, self.live_rows)
        return out[:, None]

    def _setup(self, decoder, tokens, memory, memory_padding, mask_of) -> None:
        B = memory.size(0)
        if tokens.size(0) not in (B, B * self.beam):
            raise ValueError(f"the decoder got {tokens.size(0)} rows for {B} sentences of {self.beam} rows each")
        dev, R = memory.device, B * self.beam
        self.sentences = B
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.ancestors = torch.zeros(R, self.positions, dtype=torch.int32, device=dev)
        self.own = torch.arange(self.beam, dtype=torch.int32, device=dev).repeat(B)[:, None]
        self.memory_mask = mask_of(memory_padding)
        for layer, lc in zip(decoder.layers, self.layers):
            lc.cross_k, lc.cross_v = kv_for_cache(layer.cross_attn, memory)

    def _compact(self) -> None:
        """Keep only the live sentences' rows (the next step captures the new sizes)."""
        keep, rows = self.live, self.live_rows
        for lc in self.layers:
            lc.select(keep)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, keep)
        self.ancestors = self.ancestors.index_select(0, rows)
        self.tokens = self.tokens.index_select(0, rows)
        self.own = self.own[: rows.numel()]  # 0..beam-1 repeated: the same for any number of sentences
        self.features = None
        self.sentences = keep.numel()
        self.live = self.live_rows = None
        self._replay = None

    def _grow(self, positions: int) -> None:
        for lc in self.layers:
            lc.grow(positions)
        grown = self.ancestors.new_zeros(self.ancestors.size(0), positions)
        grown[:, : self.positions] = self.ancestors
        self.ancestors = grown
        self.positions = positions
        self._replay = None  # the next step is recorded at the new sizes

    def _step(self, decoder, memory) -> None:
        """One step on the buffers: what the graph holds. Writes ``features``."""
        K, L, B = self.beam, self.positions, self.sentences
        embed = decoder.embed
        pos = self.position.view(1, 1).expand(self.tokens.size(0), 1)
        x = embed.scale * embed.tokens(self.tokens) + embed.positions(pos, L)  # (R, 1, D)
        x = embed.dropout(x)
        self.ancestors.index_copy_(1, self.position, self.own)  # each row's own slot at this position
        seen = torch.arange(L, device=x.device) <= self.position  # (L,): no unwritten slot
        own = self.ancestors.view(B, K, L, 1) == torch.arange(K, dtype=torch.int32, device=x.device)
        self.self_mask = (own & seen[:, None]).view(B, 1, K, L * K)
        for layer, lc in zip(decoder.layers, self.layers):
            x = layer(x, memory, self.memory_mask, lc)
        if decoder.final_norm is not None:
            x = decoder.final_norm(x)
        if self.features is None or self.features.shape != x[:, -1].shape or self.features.dtype != x.dtype:
            self.features = torch.empty_like(x[:, -1])
        self.features.copy_(x[:, -1])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Each sentence's ``beam`` query rows (R, H, 1, Dh) as one sentence of ``beam`` queries, attending to its
        keys/values (N, H, L, Dh) under ``mask``; returns the heads concatenated, (R, 1, H * Dh)."""
        R, H, _, Dh = q.shape
        K = self.beam
        qs = q.view(R // K, K, H, Dh).transpose(1, 2)  # (N, H, beam, Dh)
        out = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(R, 1, H * Dh)
