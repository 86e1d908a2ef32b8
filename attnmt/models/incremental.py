"""Decoder state for step-by-step decoding, laid out so that beam search never copies it per step.

Beam search keeps ``beam`` hypotheses (rows) per sentence and, after every step, reorders them: a row continues
the prefix of some row of the same sentence. A cache that stores each row's keys/values contiguously has to copy
its whole history to follow that reordering, and a cache of the encoder output per row copies the encoder output
as well, at every step. This cache avoids both:

* **Encoder side, per sentence.** The encoder output and the encoder-decoder keys/values are kept once per
  sentence, (N, H, S, Dh). The ``beam`` rows of a sentence are consecutive; their queries are viewed as one
  sentence with ``beam * T`` queries, (N, H, beam * T, Dh), which attend to the sentence's keys as before.
* **Self-attention, written once, never moved.** Keys/values of position ``s`` computed by row ``j`` of a
  sentence go to slot ``s * beam + j`` of that sentence's buffer, (N, H, capacity * beam, Dh), and stay there.
  The cache remembers, per row and position, which of the sentence's rows holds the row's ancestor
  (``ancestors``, (R, capacity)); a row's queries attend to all slots of its sentence under a mask that keeps
  exactly its own history. Reordering the beams only reorders ``ancestors`` (a few integers per row); the
  attention costs ``beam`` times more multiply-adds, which is small next to the projections. The buffers hold
  the written positions rounded up to ``CAPACITY_STEP`` (growing copies them every few steps), so that the
  queries never read many unwritten slots (with a step kernel, which reads none, the buffers double instead).
  The first step, where every hypothesis of a sentence has the same prefix, runs one row per sentence, and its
  keys/values serve all the sentence's rows.
* **Finished sentences are dropped lazily.** When sentences leave the batch, the remaining ones are recorded in
  ``live``: the decoder runs only on their rows, and their queries are scattered into the buffers' batch for
  the two attentions (the dead sentences' attention outputs are computed and discarded). The buffers are
  compacted (a copy of the filled slots of the sentences left) once at most half of the buffered sentences are
  live, so a batch is compacted about log2(sentences) times instead of at every step.

A backend may pass a kernel for one-token steps (``DecodingKernels.step_attention``, the CPU's compiled one):
it writes a step's keys/values and reads, per row, only the slots of the row's own history (``ancestors``), in
one call; the masks are then never built. Calls of several tokens and queries it does not take use the batched
form above.

With ``beam`` 1 (greedy search, sampling, teacher-forced checks), rows are sentences and the mask is the usual
causal one. Numerically, every row gets the same attention as with a plain per-row cache (masked slots weigh 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnmt.models.interface import DecoderCache, LayerCache
from attnmt.models.kernels import RowBucket, StepAttention, StepRows

# compact the buffers once the live sentences are at most this fraction of the buffered ones
COMPACT_FRACTION = 0.5
CAPACITY_STEP = 4  # the self-attention buffers hold the written positions rounded up to a multiple of this


def _pad(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows``."""
    if x.size(0) >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.size(0),) + x.shape[1:])])


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """softmax(Q K^T / sqrt(d) + bias) V in the dtype of the inputs; ``bias`` is 0 or -inf (masked).

    The plain matmul-softmax-matmul, the CPU backend's choice: a decoding step is thousands of tiny (beam x keys)
    products, where SDPA's blocked CPU kernel spends most of its time packing operands (benchmarks/kernel_choices.py;
    figures per CPU in docs/experiments.md). A GPU takes the fused form (``fused_attention``, :func:`_attend_fused`).
    """
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(q.size(-1) ** -0.5)  # (N, H, M, L)
    if bias is not None:
        s.add_(bias)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _attend_fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """The same attention in one fused kernel (``scaled_dot_product_attention``; ``mask``: True = attend): what a
    GPU runs best, where the three separate products each cost a launch and a round trip through memory."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _bias(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean attention mask (True = attend) as an additive one: 0 where allowed, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class SlotLayerCache(LayerCache):
    """One decoder layer's keys/values; the layout and masks are shared through its ``SlotCache``."""

    def __init__(self, owner: SlotCache):
        self.owner = owner
        self.k: Tensor | None = None  # (N, H, capacity * beam, Dh): slot s * beam + j = position s of row j
        self.v: Tensor | None = None
        self.cross_k: Tensor | None = None  # (N, H, S, Dh), one per sentence
        self.cross_v: Tensor | None = None

    # -------------------------------------------------------------------------------- attention

    def self_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this call's keys/values (R, H, T, Dh) and attend; returns the heads concatenated, (R, T, H * Dh).

        The queries attend to the whole buffer, the unwritten slots (fewer than ``CAPACITY_STEP`` positions)
        masked: a slice of it would not be one dense block per (sentence, head), which the batched matmul needs.
        A backend's step kernel (one-token steps) writes the keys/values and reads each row's own slots instead.
        """
        c = self.owner
        padded = q.size(0)
        R, K, kc = c.rows, c.beam, c.call_beam  # the real rows come first; kc rows per sentence in this call
        _, H, T, Dh = q.shape
        self._ensure_capacity(H, Dh, q)
        kernel = c.step_kernel(q)
        if kernel is not None:
            ancestors = c.ancestors if K > 1 else None
            return kernel.self_attention(q, k, v, self.k, self.v, c.step_rows(), c.length, ancestors, K // kc)
        q, k, v = q[:R], k[:R], v[:R]
        A = R // kc
        end = c.length + T
        for buf, new in ((self.k, k), (self.v, v)):
            dst = buf.view(c.buffered, H, c.capacity, K, Dh)[:, :, c.length:end, :kc]  # (N, H, T, kc, Dh)
            src = new.view(A, kc, H, T, Dh).permute(0, 2, 3, 1, 4)  # (A, H, T, kc, Dh)
            if c.live is None:
                dst.copy_(src)
            else:
                dst.index_copy_(0, c.live, src)
        return _pad(c.attend(q, self.k, self.v, "self"), padded)

    def cross_attention(self, q: Tensor, project_kv, memory: Tensor) -> Tensor:
        """Attend from the decoder queries (R, H, T, Dh) to the encoder output; returns (R, T, H * Dh).

        ``project_kv(memory)`` gives the keys/values, computed on the first call for the buffered sentences.
        """
        c = self.owner
        if self.cross_k is None:
            self.cross_k, self.cross_v = project_kv(memory)
        kernel = c.step_kernel(q)
        if kernel is not None:
            return kernel.cross_attention(q, self.cross_k, self.cross_v, c.step_rows(), c.memory_keep())
        return _pad(c.attend(q[: c.rows], self.cross_k, self.cross_v, "memory"), q.size(0))

    # -------------------------------------------------------------------------------- buffers

    def _ensure_capacity(self, H: int, Dh: int, like: Tensor) -> None:
        """Buffers of the owner's capacity; growing copies the filled slots (slot numbers do not change)."""
        c = self.owner
        size = c.capacity * c.beam
        if self.k is not None and self.k.dtype == like.dtype and self.k.size(2) == size:
            return
        filled = c.length * c.beam if self.k is not None else 0
        new_k, new_v = like.new_empty(c.buffered, H, size, Dh), like.new_empty(c.buffered, H, size, Dh)
        for new, old in ((new_k, self.k), (new_v, self.v)):
            if filled:
                new[:, :, :filled] = old[:, :, :filled]
            # zeros, not garbage: masked slots still enter the matmuls (with weight 0) and must not hold NaNs
            new[:, :, filled:].zero_()
        self.k, self.v = new_k, new_v

    def select(self, sentences: Tensor, filled: int, increasing: bool) -> None:
        """Keep the buffered sentences ``sentences`` (in that order, repeats allowed); copy only ``filled`` slots.

        ``increasing`` (sentences only leave): the kept ones move to the front of the same buffers, which keep
        their memory (the slots past ``filled`` hold stale but finite values, which no live row attends to).
        """
        if self.k is not None:
            if increasing:
                n = sentences.numel()
                self.k[:n, :, :filled] = self.k[sentences, :, :filled]
                self.v[:n, :, :filled] = self.v[sentences, :, :filled]
                self.k, self.v = self.k[:n], self.v[:n]
            else:
                k, v = self.k, self.v
                self.k = k.new_zeros((sentences.numel(),) + k.shape[1:])
                self.v = v.new_zeros((sentences.numel(),) + v.shape[1:])
                torch.index_select(k[:, :, :filled], 0, sentences, out=self.k[:, :, :filled])
                torch.index_select(v[:, :, :filled], 0, sentences, out=self.v[:, :, :filled])
        if self.cross_k is not None:
            self.cross_k = self.cross_k.index_select(0, sentences)
            self.cross_v = self.cross_v.index_select(0, sentences)


class SlotCache(DecoderCache):
    """Per-layer keys/values for step-by-step decoding; ``length``: target tokens decoded so far.

    ``beam``: rows per sentence. The decoder is called with ``beam`` consecutive rows per live sentence of the
    encoder output (see the module docstring); ``beam`` 1 means one row per sentence.
    """

    def __init__(self, num_layers: int, beam: int = 1, row_bucket: RowBucket | None = None,
                 fused_attention: bool = False, step_attention: StepAttention | None = None):
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        self.row_bucket = row_bucket  # rows -> the row count a decoder call is padded to (None: no padding)
        self.fused_attention = fused_attention  # scaled_dot_product_attention instead of the plain products
        self.step_attention = step_attention  # the backend's kernel for one-token steps, where it takes the queries
        self.kernel_ran = False  # the step kernel ran the last call's attention
        self.layers: list[LayerCache] = [SlotLayerCache(self) for _ in range(num_layers)]
        self.length = 0
        self.beam = beam
        self.buffered = 0  # sentences in the buffers (and in the encoder output that goes with them)
        self.live: Tensor | None = None  # (A,) buffered index of each live sentence; None: all, in order
        self.capacity = 0  # positions the self-attention buffers hold
        self.call_beam = beam  # rows per sentence in this call: beam, or 1 on the first call (see begin)
        self.rows = 0  # live rows of the current call (its inputs may carry padding rows after them)
        self.ancestors: Tensor | None = None  # (R, capacity) int32: row j of the sentence holding position s
        self.memory_mask: Tensor | None = None  # (N, 1, 1, S) True=attend, or None when nothing is padded
        self.memory_mask_ready = False
        self._memory_keep: Tensor | None = None  # memory_mask as (N, S), contiguous (the step kernel's form)
        self.new_tokens = 0  # positions given per row in this call
        self.self_mask: Tensor | None = None  # this call's self-attention mask over the buffers' slots (on demand)
        self._step_rows: StepRows | None = None
        self._device = torch.device("cpu")  # of this call's inputs
        self._biases: dict[tuple[str, torch.dtype], Tensor | None] = {}  # the masks above, as additive biases

    # -------------------------------------------------------------------------------- per call

    def prepare(self, x: Tensor, memory: Tensor, memory_padding: Tensor,
                mask_of: Callable[[Tensor], Tensor | None]) -> tuple[Tensor, Tensor | None]:
        """Start a decoder call on ``x`` (R, T, D): the memory mask (made on the first call and after a
        compaction), this call's self-attention mask, and ``x`` padded to the row bucket."""
        if not self.memory_mask_ready:
            self.set_memory(memory.size(0), mask_of(memory_padding))
        self.begin(x.size(0), x.size(1), x.device)
        return self.pad_rows(x), self.memory_mask

    def advance(self, x: Tensor, new_tokens: int, rows: int) -> Tensor:
        self.length += new_tokens
        return x[:rows]

    def set_memory(self, buffered: int, memory_mask: Tensor | None) -> None:
        """The encoder output the buffers go with: its sentence count and padding mask (first call, compaction)."""
        self.buffered = buffered
        self.memory_mask = memory_mask
        self.memory_mask_ready = True
        self._memory_keep = None
        self._biases.pop(("memory", torch.float32), None)
        self._biases.pop(("memory", torch.bfloat16), None)

    def begin(self, rows: int, new_tokens: int, device: torch.device) -> None:
        """Prepare a decoder call of ``new_tokens`` per row: the rows' ancestry (this call's self-attention mask
        follows from it when asked for, :meth:`call_self_mask`).

        The first call may give one row per sentence instead of ``beam``: every hypothesis of a sentence starts
        from the same prefix, so its keys/values are computed once and every row's history starts with them.
        """
        K, start, T = self.beam, self.length, new_tokens
        end = start + T
        self._biases = {key: b for key, b in self._biases.items() if key[0] != "self"}
        live_sents = self.buffered if self.live is None else self.live.numel()
        first = start == 0 and K > 1 and rows == live_sents
        if rows != live_sents * K and not first:
            raise ValueError(f"the decoder got {rows} rows but the cache holds {live_sents} live sentences of "
                             f"{K} rows each")
        self.rows = rows
        self.new_tokens = T
        self.call_beam = 1 if first else K
        self.self_mask = None
        self._step_rows = None
        self._device = device
        if end > self.capacity:  # every growth copies the filled slots
            self.capacity = -(-end // CAPACITY_STEP) * CAPACITY_STEP  # the written positions rounded up
            if self.kernel_ran:  # the step kernel reads written slots only: double, copying far less often
                self.capacity = max(self.capacity, 2 * self.length)
        if K == 1:
            return
        if self.ancestors is None or self.ancestors.size(1) < self.capacity:
            grown = torch.zeros(live_sents * K, self.capacity, dtype=torch.int32, device=device)
            if self.ancestors is not None:
                grown[:, :start] = self.ancestors[:, :start]
            self.ancestors = grown
        if first:  # row 0 of each sentence computes the shared first positions for all of its rows
            self.ancestors[:, start:end] = 0
        else:
            self.ancestors[:, start:end] = torch.arange(K, dtype=torch.int32, device=device).repeat(rows // K)[:, None]

    def call_self_mask(self) -> Tensor:
        """This call's self-attention mask over the buffers' slots (True = attend), made on first use: (T,
        capacity) with beam 1, else (N, 1, beam * T, capacity * beam) over the sentences' slots."""
        if self.self_mask is not None:
            return self.self_mask
        K, start, T, n, rows = self.beam, self.length, self.new_tokens, self.capacity, self.rows
        device = self._device
        # query start+i sees positions 0..start+i of the buffer (T, n): causal, and no unwritten slot
        seen = torch.arange(n, device=device)[None, :] <= (start + torch.arange(T, device=device))[:, None]
        if K == 1:
            self.self_mask = seen
            return seen
        own = torch.arange(K, dtype=torch.int32, device=device)
        if self.call_beam == 1:  # the first call: every row's history is row 0's
            mask = (seen[:, :, None] & (own == 0)).reshape(1, 1, T, n * K).expand(rows, 1, T, n * K)
            self.self_mask = mask  # (A, 1, T, n * beam); live is None on the first call
            return mask
        mask = self.ancestors[:, :n, None] == own  # (R, n, beam): slot (s, j) holds row r's position s
        mask = mask.view(rows // K, K, 1, n * K) & seen.repeat_interleave(K, dim=1)[None, None]
        mask = mask.reshape(rows // K, 1, K * T, n * K)  # (A, 1, beam * T, n * beam)
        if self.live is not None:
            full = torch.ones((self.buffered,) + mask.shape[1:], dtype=torch.bool, device=device)
            mask = full.index_copy_(0, self.live, mask)
        self.self_mask = mask
        return mask

    def step_kernel(self, q: Tensor) -> StepAttention | None:
        """The backend's step kernel where this call is a one-token step it takes ``q`` for, else None."""
        kernel = self.step_attention
        if kernel is None or self.new_tokens != 1 or not kernel.supports(q):
            self.kernel_ran = False
            return None
        self.kernel_ran = True
        return kernel

    def step_rows(self) -> StepRows:
        """The rows of this call, for the step kernel."""
        if self._step_rows is None:
            self._step_rows = StepRows(self.rows, self.call_beam, self.live, self.beam)
        return self._step_rows

    def memory_keep(self) -> Tensor | None:
        """The memory mask as (N, S) bool, contiguous (None: no padding)."""
        if self.memory_mask is None:
            return None
        if self._memory_keep is None:
            m = self.memory_mask
            self._memory_keep = m.reshape(m.size(0), m.size(-1)).contiguous()
        return self._memory_keep

    def pad_rows(self, x: Tensor) -> Tensor:
        """The decoder's input rows (R, T, D) padded with zero rows to ``row_bucket(R)`` (the backend's choice:
        on the CPU a few row counts per power of two, so that oneDNN reuses its kernels)."""
        if self.row_bucket is None:
            return x
        return _pad(x, self.row_bucket(x.size(0)))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, which: str) -> Tensor:
        """Attention of the live rows' queries (R, H, T, Dh) to per-sentence keys/values (N, H, L, Dh).

        Each sentence's ``beam`` rows are one sentence of ``beam * T`` queries; the live sentences are scattered
        into the buffers' batch; ``which`` mask applies: "self" (causal and beam ancestry) or "memory" (source
        padding). Returns the heads concatenated, (R, T, H * Dh).
        """
        R, H, T, Dh = q.shape
        K = self.call_beam
        A = R // K
        qs = q.view(A, K, H, T, Dh).transpose(1, 2).reshape(A, H, K * T, Dh)
        if self.live is not None:
            qs = q.new_zeros((self.buffered, H, K * T, Dh)).index_copy_(0, self.live, qs)
        mask = self.call_self_mask() if which == "self" else self.memory_mask
        if self.fused_attention:
            out = _attend_fused(qs, k, v, mask)  # (N, H, beam * T, Dh)
        else:
            key = (which, q.dtype)
            if key not in self._biases:
                self._biases[key] = _bias(mask, q.dtype)
            out = _attend(qs, k, v, self._biases[key])
        if self.live is not None:
            out = out.index_select(0, self.live)
        return out.view(A, H, K, T, Dh).permute(0, 2, 3, 1, 4).reshape(R, T, H * Dh)

    # -------------------------------------------------------------------------------- beam bookkeeping

    def reorder(self, new_order: Tensor, sentences: Tensor | None = None) -> Tensor | None:
        """Follow the search: row ``r`` of the next call continues current row ``new_order[r]``.

        ``sentences``: the current live sentences that stay, in order (None: all stay). With ``beam`` 1 rows are
        sentences, so ``sentences`` defaults to ``new_order`` and may repeat or permute them; with a larger beam
        each row must continue a row of its own sentence. Returns the buffered sentences the encoder output must
        be reduced to (``enc.index_select``) when the buffers were compacted, else None.
        """
        if self.beam > 1 and self.ancestors is not None:
            self.ancestors = self.ancestors.index_select(0, new_order)
        if sentences is None:
            if self.beam > 1:
                return None  # beams reordered within their sentences: only their ancestry changed
            sentences = new_order
        keep = sentences if self.live is None else self.live.index_select(0, sentences)
        n = keep.numel()
        increasing = n < 2 or bool((keep[1:] > keep[:-1]).all())
        started = any(lc.k is not None or lc.cross_k is not None for lc in self.layers)
        if started and increasing and n > COMPACT_FRACTION * self.buffered:
            self.live = None if n == self.buffered else keep
            return None
        for lc in self.layers:
            lc.select(keep, self.length * self.beam, increasing)
        self.live = None
        self.buffered = n
        self.memory_mask_ready = False
        return keep
