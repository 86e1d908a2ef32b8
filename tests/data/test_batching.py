"""Batching: padded-token budget, sentence cap, coverage, seeded shuffle, rank sharding, overlong pairs, collate."""

import numpy as np
import pytest
import torch

from attnmt.data.batching import EpochBatchIterator, batch_by_size, batches_fingerprint, filter_by_size
from attnmt.data.pairs import LanguagePairDataset, collate_pairs

PAD, EOS = 1, 2


class Arrays:
    def __init__(self, seqs):
        self.seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
        self.sizes = np.asarray([len(s) for s in seqs], dtype=np.int32)

    def __getitem__(self, i):
        return self.seqs[i]

    def __len__(self):
        return len(self.seqs)


def _dataset(n=300, seed=0, max_len=30):
    rng = np.random.RandomState(seed)
    src = [list(rng.randint(4, 50, size=rng.randint(1, max_len))) + [EOS] for _ in range(n)]
    tgt = [list(rng.randint(4, 50, size=rng.randint(1, max_len))) + [EOS] for _ in range(n)]
    return LanguagePairDataset(Arrays(src), Arrays(tgt), pad=PAD, eos=EOS)


def _batches(ds, max_tokens=128, max_sentences=None, multiple=1):
    order = ds.ordered_indices(seed=1)
    return batch_by_size(order, ds.num_tokens(), max_tokens, max_sentences, multiple)


@pytest.mark.parametrize("multiple", [1, 8])
def test_max_tokens_counts_padding_and_every_index_once(multiple):
    ds = _dataset()
    batches = _batches(ds, max_tokens=512, multiple=multiple)
    cost = ds.num_tokens()
    for b in batches:
        assert len(b) * cost[b].max() <= 512
        # the collated tensors really are within budget (padding counted)
        batch = ds.collate(b)
        assert batch["net_input"]["src_tokens"].numel() <= 512 and batch["target"].numel() <= 512
    allidx = np.concatenate(batches)
    assert sorted(allidx.tolist()) == list(range(len(ds)))
    if multiple == 8:  # full batches are multiples of 8 where they hold more than 8
        full = [len(b) for b in batches[:-1] if len(b) > 8]
        assert full and all(n % 8 == 0 for n in full)


def test_batch_size_cap():
    ds = _dataset()
    batches = _batches(ds, max_tokens=10_000, max_sentences=7)
    assert max(len(b) for b in batches) == 7
    assert sum(len(b) for b in batches) == len(ds)


def test_length_order_sorts_by_source_then_target():
    ds = _dataset()
    order = ds.ordered_indices(seed=3)
    keys = list(zip(ds.src_sizes[order], ds.tgt_sizes[order]))
    assert keys == sorted(keys)


def test_seeded_shuffle_reproducible_and_different_across_epochs():
    ds = _dataset()
    batches = _batches(ds)
    a = EpochBatchIterator(batches, ds.collate, seed=5)
    b = EpochBatchIterator(batches, ds.collate, seed=5)
    c = EpochBatchIterator(batches, ds.collate, seed=6)
    same = [x.tolist() for x in a.epoch_order(1)] == [x.tolist() for x in b.epoch_order(1)]
    assert same
    assert [x.tolist() for x in a.epoch_order(1)] != [x.tolist() for x in a.epoch_order(2)]
    assert [x.tolist() for x in a.epoch_order(1)] != [x.tolist() for x in c.epoch_order(1)]
    # the shuffle permutes whole batches: the same batches, in another order
    assert sorted(map(tuple, a.epoch_order(2))) == sorted(map(tuple, batches))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_shards_are_disjoint_equal_length_and_cover(world):
    ds = _dataset(n=101)
    batches = _batches(ds, max_tokens=64)
    its = [EpochBatchIterator(batches, ds.collate, seed=1, world_size=world, rank=r) for r in range(world)]
    shards = [it.shard(3) for it in its]
    assert len({len(s) for s in shards}) == 1 and all(len(it) == len(shards[0]) for it in its)
    seen = np.concatenate([b for s in shards for b in s])
    assert sorted(seen.tolist()) == list(range(len(ds)))  # disjoint and covering
    # rank r takes batches r, r+W, ... of the common epoch order
    order = its[0].epoch_order(3)
    for r, s in enumerate(shards):
        assert [b.tolist() for b in s] == [b.tolist() for b in order[r::world]]
    # the padding batches come out as None
    got = [x for x in its[-1]]
    n_empty = len(shards[0]) * world - len(batches)
    assert sum(x is None for it in its for x in ([] if it is its[-1] else list(it))) + sum(
        x is None for x in got) == n_empty


def test_iterator_position_resumes_mid_epoch():
    ds = _dataset()
    batches = _batches(ds)
    a = EpochBatchIterator(batches, ds.collate, seed=2)
    a.next_epoch()  # epoch 2
    it = iter(a)
    first = [next(it)["id"].tolist() for _ in range(3)]
    state = a.state_dict()
    rest_a = [b["id"].tolist() for b in it]
    b = EpochBatchIterator(batches, ds.collate, seed=2)
    assert b.load_state_dict(state) is None
    rest_b = [x["id"].tolist() for x in b]
    assert state["epoch"] == 2 and state["offset"] == 3
    assert rest_a == rest_b and len(first) + len(rest_a) == len(batches)
    assert a.end_of_epoch() and b.end_of_epoch()


def test_epochs_read_the_cycled_plans_in_turn_and_resume_in_the_right_one():
    """Versions of one corpus (BPE-dropout segmentations): epoch e reads plan (e - 1) mod n, with its own
    batches and collate, and a resumed run continues in the plan of its epoch."""
    versions = [_dataset(seed=s) for s in (0, 1, 2)]
    plans = [(_batches(ds), ds.collate) for ds in versions]

    made = []

    def maker(plan):
        return lambda: made.append(plan) or plan

    def make():
        return EpochBatchIterator(*plans[0], seed=4, cycle=[maker(p) for p in plans[1:]])

    a = make()
    for epoch in range(1, 6):
        ds = versions[(epoch - 1) % 3]
        assert a.epoch == epoch and a.batches is plans[(epoch - 1) % 3][0] and len(a) == len(a.batches)
        got = list(a)
        assert len(got) == len(a.batches)
        for batch in got:  # each batch holds that version's sentences
            ids = batch["id"].tolist()
            assert batch["net_input"]["src_tokens"].shape[0] == len(ids)
            assert max(len(ds.src[i]) for i in ids) == batch["net_input"]["src_tokens"].shape[1]
        assert sorted(i for b in got for i in b["id"].tolist()) == list(range(len(ds)))
        a.next_epoch()
    assert [id(x) for x in made] == [id(plans[k]) for k in (1, 2, 1)]  # a later plan is made when its epoch starts
    b = make()
    b.next_epoch()  # epoch 2: the second version, stopped after two batches
    it = iter(b)
    next(it), next(it)
    c = make()
    assert c.load_state_dict(b.state_dict()) is None and c.epoch == 2 and c.batches is plans[1][0]
    assert [x["id"].tolist() for x in c] == [x["id"].tolist() for x in it]
    single = EpochBatchIterator(*plans[0], seed=4)  # one plan: the fingerprint of before (old checkpoints resume)
    assert single.fingerprint == batches_fingerprint(plans[0][0]) != make().fingerprint


def test_changed_batches_restart_the_epoch_with_a_warning():
    ds = _dataset()
    a = EpochBatchIterator(_batches(ds, 128), ds.collate, seed=2)
    next(iter(a))
    b = EpochBatchIterator(_batches(ds, 256), ds.collate, seed=2)
    warning = b.load_state_dict(a.state_dict())
    assert "differ" in warning and b.offset == 0


def test_overlong_pairs_are_skipped_and_reported():
    ds = _dataset(n=50, max_len=30)
    order = ds.ordered_indices(seed=1)
    kept, skipped = filter_by_size(order, ds.src_sizes, ds.tgt_sizes, 20, 25)
    too_long = {i for i in range(len(ds)) if ds.src_sizes[i] > 20 or ds.tgt_sizes[i] > 25}
    assert set(skipped.indices.tolist()) == too_long and len(too_long) > 0
    assert set(kept.tolist()) == set(range(len(ds))) - too_long
    text = skipped.describe()
    assert f"{len(too_long)} sentence(s) skipped" in text and str(min(too_long)) in text
    # a sentence over --max-tokens is skipped too, not a crash
    kept2, skipped2 = filter_by_size(order, ds.src_sizes, ds.tgt_sizes, 1000, 1000, max_tokens=10)
    assert all(max(ds.src_sizes[i], ds.tgt_sizes[i]) <= 10 for i in kept2)
    assert len(skipped2) + len(kept2) == len(ds)
    with pytest.raises(ValueError, match="filter it first"):
        batch_by_size(order, ds.num_tokens(), 10)


def test_collate_right_pads_and_shifts_target():
    srcs = [np.array([5, 6, EOS]), np.array([7, EOS])]
    tgts = [np.array([8, EOS]), np.array([9, 10, 11, EOS])]
    b = collate_pairs(srcs, tgts, np.array([4, 9]), PAD, EOS)
    assert b["net_input"]["src_tokens"].tolist() == [[5, 6, EOS], [7, EOS, PAD]]
    assert b["net_input"]["src_lengths"].tolist() == [3, 2]
    assert b["target"].tolist() == [[8, EOS, PAD, PAD], [9, 10, 11, EOS]]
    assert b["net_input"]["prev_output_tokens"].tolist() == [[EOS, 8, PAD, PAD], [EOS, 9, 10, 11]]
    assert b["ntokens"] == 6 and b["nsentences"] == 2 and b["id"].tolist() == [4, 9]
    assert b["target"].dtype == torch.int64
