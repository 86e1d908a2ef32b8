"""The batches training reads: shuffled token batches of the train split, sharded by rank; validation batches."""

from __future__ import annotations

import random

import numpy as np
import torch

from attnmt.data.batching import EpochBatchIterator, Skipped, batch_by_size, filter_by_size
from attnmt.data.meta import SAMPLE_SPLIT
from attnmt.errors import UserError
from attnmt.training.config import TrainConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def chunks(it, n: int):
    """Groups of ``n`` consecutive items (the last one may be shorter): the batches of one update."""
    group = []
    for x in it:
        group.append(x)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def make_train_iterator(task, cfg: TrainConfig, max_positions: tuple[int, int],
                        pad_to_multiple: int = 1) -> tuple[EpochBatchIterator, Skipped]:
    """Filter overlong pairs, bucket by length into --max-tokens batches, shuffle per epoch, shard by rank;
    ``pad_to_multiple``: batch lengths rounded up to a multiple of it. With --sampled-segmentations the epochs
    read the BPE-dropout segmentations of the training split in turn (one batch plan each)."""
    splits = sampled_splits(task) if cfg.sampled_segmentations else [task.cfg.train_subset]
    batches, collate, skipped = _train_plan(task, cfg, splits[0], max_positions, pad_to_multiple)

    def maker(split: str):
        return lambda: _train_plan(task, cfg, split, max_positions, pad_to_multiple)[:2]

    return EpochBatchIterator(batches, collate, seed=cfg.seed, shuffle=True, world_size=cfg.world_size,
                              rank=cfg.rank, cycle=[maker(s) for s in splits[1:]]), skipped


def sampled_splits(task) -> list[str]:
    """The splits train_sample1, train_sample2, ... that DATA_BIN holds (attnmt preprocess --bpe-dropout)."""
    from attnmt.data.indexed import exists

    names = []
    while exists(str(task.split_prefix(f"{SAMPLE_SPLIT}{len(names) + 1}", task.src_lang))):
        names.append(f"{SAMPLE_SPLIT}{len(names) + 1}")
    if not names:
        raise UserError(f"{task.data_bin}: --sampled-segmentations needs the BPE-dropout segmentations of the "
                        f"training split ({SAMPLE_SPLIT}1, ...); preprocess with --bpe-dropout 0.1, or train "
                        f"without --sampled-segmentations")
    return names


def _train_plan(task, cfg: TrainConfig, split: str, max_positions: tuple[int, int], pad_to_multiple: int):
    data = task.dataset(split, pad_to_multiple)
    if len(data) == 0:
        raise UserError(f"{task.split_prefix(split, task.src_lang)}: the training split is empty; "
                        f"binarize a corpus with sentences in it (attnmt preprocess --trainpref)")
    order = data.ordered_indices(cfg.seed)
    kept, skipped = filter_by_size(order, data.src_sizes, data.tgt_sizes, max_positions[0], max_positions[1],
                                   cfg.max_tokens)
    batches = batch_by_size(kept, data.num_tokens(), cfg.max_tokens, cfg.batch_size, cfg.required_batch_size_multiple)
    if not batches:
        raise UserError(f"{task.split_prefix(split, task.src_lang)}: no training pair fits "
                        f"(all {len(data)} skipped: {skipped.reason}); raise --max-tokens or the model's max positions")
    if len(batches) < cfg.world_size:
        raise UserError(f"{task.split_prefix(split, task.src_lang)}: {len(batches)} batch(es) of "
                        f"--max-tokens {cfg.max_tokens} for {cfg.world_size} processes; every process needs at least "
                        f"one: lower --max-tokens or start fewer processes")
    return batches, data.collate, skipped


def make_valid_batches(task, cfg: TrainConfig, split: str, max_positions: tuple[int, int], pad_to_multiple: int = 1):
    """(dataset, batches, skipped) for a validation split: every pair that fits, in length order, no shuffle."""
    data = task.dataset(split, pad_to_multiple)
    order = data.ordered_indices(0)
    kept, skipped = filter_by_size(order, data.src_sizes, data.tgt_sizes, max_positions[0], max_positions[1],
                                   cfg.max_tokens)
    if len(kept) == 0:  # a loss over nothing would read 0 and make an unbeatable best checkpoint
        why = "it is empty" if len(data) == 0 else f"no pair fits ({skipped.reason})"
        raise UserError(f"{task.split_prefix(split, task.src_lang)}: validation split '{split}': {why}; binarize a "
                        f"non-empty one (attnmt preprocess --validpref), choose another --valid-subset, or train "
                        f"with --disable-validation")
    batches = batch_by_size(kept, data.num_tokens(), cfg.max_tokens, cfg.batch_size, 1)
    batches = batches[cfg.rank:: cfg.world_size]
    return data, batches, skipped
