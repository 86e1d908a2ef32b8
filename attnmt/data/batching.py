"""Length-bucketed token batches, the seeded epoch shuffle, sharding by rank and a resumable position.

How an epoch's batches are made (as fairseq):

1. sentences longer than the model's positions (or than ``--max-tokens`` alone) are removed and REPORTED
   (:func:`filter_by_size`), never silently dropped and never a crash;
2. the remaining indices are sorted by length (:meth:`LanguagePairDataset.ordered_indices`) and cut into batches
   of at most ``max_tokens`` PADDED tokens: ``n_sentences * max(src_len, tgt_len) <= max_tokens``, optionally at
   most ``max_sentences`` sentences (:func:`batch_by_size`). The batches are made once;
3. every epoch the LIST of batches is shuffled with ``seed + epoch`` (:class:`EpochBatchIterator`), so each batch
   holds similar lengths but the order of lengths is random;
4. with ``world_size`` W, the shuffled list is padded with empty batches to a multiple of W and rank r takes
   batches r, r+W, r+2W, ... : every rank sees the same number of batches (an empty batch is a dummy that
   contributes nothing), ranks are disjoint and together cover the epoch.

The iterator's position (epoch, batches consumed in this epoch) is part of every checkpoint, so training resumes
with exactly the batch that would have come next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

Plan = tuple[list[np.ndarray], Callable[[np.ndarray], dict]]  # an epoch's batches and what collates them


@dataclass
class Skipped:
    """Sentences left out of training, and why (for the start-up report)."""

    indices: np.ndarray
    reason: str

    def __len__(self) -> int:
        return len(self.indices)

    def describe(self, limit: int = 5) -> str:
        ex = ", ".join(str(int(i)) for i in self.indices[:limit])
        more = ", ..." if len(self.indices) > limit else ""
        return f"{len(self.indices)} sentence(s) skipped ({self.reason}); line index(es) {ex}{more}"


def filter_by_size(indices: np.ndarray, src_sizes: np.ndarray, tgt_sizes: np.ndarray, max_source: int,
                   max_target: int, max_tokens: int | None = None) -> tuple[np.ndarray, Skipped]:
    """Keep the indices whose source fits ``max_source``, target fits ``max_target`` (and both ``max_tokens``)."""
    indices = np.asarray(indices, dtype=np.int64)
    s, t = src_sizes[indices], tgt_sizes[indices]
    ok = (s <= max_source) & (t <= max_target)
    reason = f"longer than the model's max positions (source {max_source}, target {max_target})"
    if max_tokens is not None:
        ok &= np.maximum(s, t) <= max_tokens
        reason += f" or than --max-tokens {max_tokens}"
    return indices[ok], Skipped(np.sort(indices[~ok]), reason)


def batch_by_size(indices: np.ndarray, num_tokens: np.ndarray, max_tokens: int | None,
                  max_sentences: int | None = None, required_multiple: int = 1,
                  oversized_alone: bool = False) -> list[np.ndarray]:
    """Cut ``indices`` (already in length order) into consecutive batches.

    A batch of n sentences whose longest one costs L tokens (``num_tokens[i]`` = max of source and target length)
    costs n * L padded tokens; it never exceeds ``max_tokens`` and never holds more than ``max_sentences``. When a
    batch is closed because it is full and holds more than ``required_multiple`` sentences, its size is rounded
    down to a multiple of ``required_multiple`` (friendlier GEMM shapes); the rest opens the next batch.
    Every index ends up in exactly one batch; one sentence longer than ``max_tokens`` must be filtered first, or
    with ``oversized_alone`` gets a batch of its own (translation, which refuses no input).
    """
    indices = np.asarray(indices, dtype=np.int64)
    if max_tokens is None and max_sentences is None:
        raise ValueError("give max_tokens or max_sentences")
    max_tokens = max_tokens or np.iinfo(np.int64).max
    max_sentences = max_sentences or np.iinfo(np.int64).max
    m = max(int(required_multiple), 1)
    costs = num_tokens[indices].tolist()
    idx = indices.tolist()
    batches: list[np.ndarray] = []
    cur: list[int] = []
    cur_costs: list[int] = []
    longest = 0
    for i, c in zip(idx, costs):
        if c > max_tokens and not oversized_alone:
            raise ValueError(f"sentence {i} costs {c} tokens > max_tokens {max_tokens}; filter it first")
        new_longest = max(longest, c)
        if cur and ((len(cur) + 1) * new_longest > max_tokens or len(cur) + 1 > max_sentences):
            keep = len(cur)
            if m > 1 and keep > m:
                keep = max(m * (keep // m), keep % m)
            batches.append(np.asarray(cur[:keep], dtype=np.int64))
            cur, cur_costs = cur[keep:], cur_costs[keep:]
            longest = max(cur_costs, default=0)
            new_longest = max(longest, c)
        cur.append(i)
        cur_costs.append(c)
        longest = new_longest
    if cur:
        batches.append(np.asarray(cur, dtype=np.int64))
    return batches


def batches_fingerprint(batches: list[np.ndarray]) -> str:
    """A short hash of the batch plan: a resumed run checks it still makes the same batches."""
    h = hashlib.sha256()
    h.update(np.asarray([len(b) for b in batches], dtype=np.int64).tobytes())
    if batches:
        h.update(np.concatenate(batches).astype(np.int64).tobytes())
    return h.hexdigest()[:16]


class EpochBatchIterator:
    """This rank's batches of the current epoch, in the seeded shuffled order, from a resumable position.

    ``collate(indices) -> batch`` turns an index array into a batch; an empty (padding) batch becomes ``None``.
    Iterating advances :attr:`offset` (batches consumed in :attr:`epoch`), which :meth:`state_dict` records.
    ``cycle``: makers of more (batches, collate) plans, for other versions of the data (the BPE-dropout
    segmentations of the training split): epoch e reads plan (e - 1) mod the number of plans, (``batches``,
    ``collate``) being the first. A later plan is made when its epoch starts, and only the current one is kept.
    """

    def __init__(self, batches: list[np.ndarray], collate: Callable[[np.ndarray], dict], seed: int,
                 shuffle: bool = True, world_size: int = 1, rank: int = 0, cycle: Sequence[Callable[[], Plan]] = ()):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self._first: Plan = (batches, collate)
        self._makers = list(cycle)
        self._made: tuple[int, Plan] | None = None  # (plan number, plan) of the latest later plan made
        self.seed = seed
        self.shuffle = shuffle
        self.world_size = world_size
        self.rank = rank
        self.epoch = 1
        self.offset = 0
        self.fingerprint = batches_fingerprint(batches) + (f"x{self.num_plans}" if self._makers else "")

    @property
    def num_plans(self) -> int:
        return 1 + len(self._makers)

    def _plan(self, epoch: int) -> Plan:
        k = (epoch - 1) % self.num_plans
        if k == 0:
            return self._first
        if self._made is None or self._made[0] != k:
            self._made = (k, self._makers[k - 1]())
        return self._made[1]

    @property
    def batches(self) -> list[np.ndarray]:
        """The batches of the current epoch (all ranks')."""
        return self._plan(self.epoch)[0]

    @property
    def collate(self) -> Callable[[np.ndarray], dict]:
        return self._plan(self.epoch)[1]

    def __len__(self) -> int:
        """Batches of the current epoch for this rank (equal on every rank)."""
        return -(-len(self.batches) // self.world_size)

    def epoch_order(self, epoch: int) -> list[np.ndarray]:
        """All ranks' batches of ``epoch`` in order, padded with empty batches to a multiple of world_size."""
        batches = self._plan(epoch)[0]
        if self.shuffle:
            perm = np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(batches))
            order = [batches[i] for i in perm]
        else:
            order = list(batches)
        empty = np.zeros(0, dtype=np.int64)
        order += [empty] * (-(-len(batches) // self.world_size) * self.world_size - len(order))
        return order

    def shard(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of ``epoch``: r, r+W, r+2W, ..."""
        return self.epoch_order(epoch)[self.rank:: self.world_size]

    def end_of_epoch(self) -> bool:
        return self.offset >= len(self)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.offset = 0

    def __iter__(self) -> Iterator[dict | None]:
        """The remaining batches of the current epoch (the offset counts each one as it is handed out)."""
        shard, collate = self.shard(self.epoch), self.collate
        while self.offset < len(shard):
            b = shard[self.offset]
            self.offset += 1
            yield collate(b) if len(b) else None

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "offset": int(self.offset), "num_batches": len(self.batches),
                "world_size": int(self.world_size), "seed": int(self.seed), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> str | None:
        """Restore the position; returns a warning when the batch plan changed (then the epoch restarts)."""
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        same = (state.get("fingerprint") == self.fingerprint and int(state.get("world_size", 1)) == self.world_size
                and int(state.get("seed", self.seed)) == self.seed)
        if same or self.offset == 0:
            return None
        old_len = -(-int(state.get("num_batches", 0)) // max(int(state.get("world_size", 1)), 1))
        if self.offset >= old_len:  # that epoch had finished: the next one starts with the new batches
            self.offset = len(self)
            return None
        self.offset = 0
        return (f"the batches differ from the checkpoint's (changed --max-tokens, --batch-size, --seed, data or "
                f"world size); epoch {self.epoch} starts again from its first batch")
