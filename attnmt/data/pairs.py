"""A parallel corpus as (source ids, target ids) pairs, and the collate function that makes a padded batch.

Layout of a batch (what criterions and the model receive)::

    {
      "id":         LongTensor (B,)      dataset indices of the sentences
      "nsentences": int,
      "ntokens":    int                  target tokens (incl. EOS), the loss normaliser
      "net_input": {
          "src_tokens":         LongTensor (B, S)  RIGHT-padded with pad, ends with EOS
          "src_lengths":        LongTensor (B,)
          "prev_output_tokens": LongTensor (B, T)  [EOS, y_1 .. y_{n-1}], right-padded (teacher forcing input)
      },
      "target":     LongTensor (B, T)    [y_1 .. y_{n-1}, EOS], right-padded
    }

Both sides are right-padded: the model's positions never depend on padding, so a sentence gives the same output
whatever else is in its batch. Padding is done in numpy (one allocation per tensor, no per-token Python).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class TokenArrays(Protocol):
    """What a pair dataset reads: ``IndexedDataset`` or anything with ``__getitem__``/``__len__``/``sizes``."""

    sizes: np.ndarray

    def __getitem__(self, i: int) -> np.ndarray: ...

    def __len__(self) -> int: ...


class LanguagePairDataset:
    """Aligned source/target token arrays (each sentence ending with EOS)."""

    def __init__(self, src: TokenArrays, tgt: TokenArrays, pad: int, eos: int, pad_to_multiple: int = 1):
        if len(src) != len(tgt):
            raise ValueError(f"source has {len(src)} sentences but target has {len(tgt)}")
        self.src = src
        self.tgt = tgt
        self.src_sizes = np.asarray(src.sizes, dtype=np.int64)
        self.tgt_sizes = np.asarray(tgt.sizes, dtype=np.int64)
        self.pad = pad
        self.eos = eos
        self.pad_to_multiple = pad_to_multiple

    def __len__(self) -> int:
        return len(self.src)

    def num_tokens(self) -> np.ndarray:
        """Per sentence, the padded cost in a batch: max(source length, target length)."""
        return np.maximum(self.src_sizes, self.tgt_sizes)

    def ordered_indices(self, seed: int) -> np.ndarray:
        """Indices sorted by target length, then (stable) by source length, so batches hold similar lengths.

        Ties are broken by a permutation drawn from ``seed`` (not by corpus order) so that sentences of equal length
        from different parts of the corpus meet in a batch.
        """
        order = np.random.RandomState(seed).permutation(len(self))
        order = order[np.argsort(self.tgt_sizes[order], kind="stable")]
        return order[np.argsort(self.src_sizes[order], kind="stable")]

    def collate(self, indices: Sequence[int] | np.ndarray) -> dict:
        """A padded batch for dataset ``indices`` (see the module docstring for the layout)."""
        indices = np.asarray(indices, dtype=np.int64)
        srcs = [np.asarray(self.src[int(i)], dtype=np.int64) for i in indices]
        tgts = [np.asarray(self.tgt[int(i)], dtype=np.int64) for i in indices]
        return collate_pairs(srcs, tgts, indices, self.pad, self.eos, self.pad_to_multiple)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple if multiple > 1 else n


def pad_sequences(seqs: Sequence[Sequence[int]], pad: int, pad_to_multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (n, L) int64 tokens and their (n,) lengths; L is the longest length rounded up to a multiple of
    ``pad_to_multiple``."""
    n = len(seqs)
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
    out = np.full((n, _round_up(int(lengths.max(initial=0)), pad_to_multiple)), pad, dtype=np.int64)
    for row, s in enumerate(seqs):
        out[row, : len(s)] = s
    return out, lengths


def collate_pairs(srcs: list[np.ndarray], tgts: list[np.ndarray], ids: np.ndarray, pad: int, eos: int,
                  pad_to_multiple: int = 1) -> dict:
    """Pad source and target arrays into a batch; ``prev_output_tokens`` is the target shifted right behind EOS."""
    n = len(srcs)
    src, src_lens = pad_sequences(srcs, pad, pad_to_multiple)
    tgt, tgt_lens = pad_sequences(tgts, pad, pad_to_multiple)
    prev = np.full(tgt.shape, pad, dtype=np.int64)
    for row, t in enumerate(tgts):
        if len(t):
            prev[row, 0] = eos
            prev[row, 1: len(t)] = t[:-1]
    return {
        "id": torch.from_numpy(np.asarray(ids, dtype=np.int64)),
        "nsentences": n,
        "ntokens": int(tgt_lens.sum()),
        "net_input": {
            "src_tokens": torch.from_numpy(src),
            "src_lengths": torch.from_numpy(src_lens),
            "prev_output_tokens": torch.from_numpy(prev),
        },
        "target": torch.from_numpy(tgt),
    }


def move_to(batch: dict, device: torch.device) -> dict:
    """The batch with every tensor on ``device`` (non-blocking copies; a tensor already there is itself)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, dict):
            out[k] = move_to(v, device)
        elif torch.is_tensor(v):
            out[k] = v.to(device, non_blocking=True)
        else:
            out[k] = v
    return out
