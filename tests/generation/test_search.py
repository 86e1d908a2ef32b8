"""Beam search, greedy search and sampling against reference computations on a lookup-table model."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnmt.generation.beam import BeamSearchConfig, beam_search, greedy_search
from attnmt.generation.sampling import SamplingConfig, sample_search
from attnmt.generation.search import LengthPenalty, SearchConfig, Symbols, length_penalty, score_upper_bound, search

BOS, PAD, EOS, UNK = 0, 1, 2, 3
SYM = Symbols(eos=EOS, pad=PAD, unk=UNK, bos=BOS)


class TableModel:
    """A deterministic "model": next-token logits are a table row chosen by a hash of (source, prefix).

    It implements the incremental-decoding interface of the Transformer (encode / decode with a cache / new_cache /
    reorder), so the search runs on it unchanged, and its log-probabilities are easy to recompute exactly.
    """

    def __init__(self, vocab: int = 6, rows: int = 211, seed: int = 0, scale: float = 1.5, bias: dict | None = None):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(rows, vocab, generator=g) * scale
        for tok, b in (bias or {}).items():
            self.table[:, tok] += b
        self.rows = rows
        self.calls = 0

    # ---- the interface
    def encode(self, src_tokens, src_lengths):
        pos = torch.arange(src_tokens.size(1))[None, :]
        real = pos < src_lengths[:, None]  # right padding must not matter
        key = ((src_tokens * (pos + 7)) * real).sum(1) % self.rows
        return {"key": key}

    def new_cache(self, beam=1, kernels=None):
        return {"h": None, "beam": beam}

    def decode(self, prev_output_tokens, enc, cache=None):
        self.calls += 1
        assert cache is not None and prev_output_tokens.size(1) == 1
        rows, n = prev_output_tokens.size(0), enc["key"].size(0)
        if cache["h"] is None:  # the first call: one row per sentence (all its hypotheses start alike) or beam
            assert rows in (n, n * cache["beam"])
            h = enc["key"].repeat_interleave(rows // n)
        else:
            assert rows == n * cache["beam"]  # beam rows per sentence
            h = cache["h"]
        h = (h * 31 + prev_output_tokens[:, 0] + 1) % self.rows
        cache["h"] = h.repeat_interleave(n * cache["beam"] // rows)
        return self.table[h][:, None, :]

    def decode_features(self, prev_output_tokens, enc, cache=None):
        return self.decode(prev_output_tokens, enc, cache)  # features = logits ...

    @staticmethod
    def output_layer(features):
        return features  # ... and the identity projection

    @staticmethod
    def output_candidates():
        return None  # every token may come next

    @staticmethod
    def max_positions():
        return 1024, 1024

    @staticmethod
    def reorder(enc, cache, new_order, sentences=None):
        if sentences is None and cache["beam"] == 1:
            sentences = new_order
        key = enc["key"] if sentences is None else enc["key"][sentences]
        return {"key": key}, {"h": None if cache["h"] is None else cache["h"][new_order], "beam": cache["beam"]}

    # ---- the reference
    def sequence_lprobs(self, src: list[int], tokens: list[int]) -> list[float]:
        """Log-probability of each token of ``tokens`` (ending with EOS) given the source, computed directly."""
        enc = self.encode(torch.tensor([src]), torch.tensor([len(src)]))
        h = int(enc["key"][0])
        out = []
        for prev, tok in zip([EOS] + tokens[:-1], tokens):
            h = (h * 31 + prev + 1) % self.rows
            out.append(float(torch.log_softmax(self.table[h], -1)[tok]))
        return out


def batch(sources: list[list[int]]):
    lengths = torch.tensor([len(s) for s in sources])
    tokens = torch.full((len(sources), int(lengths.max())), PAD, dtype=torch.long)
    for i, s in enumerate(sources):
        tokens[i, : len(s)] = torch.tensor(s)
    return tokens, lengths


def exhaustive(model: TableModel, src: list[int], words: list[int], max_len: int, min_len: int, alpha: float,
               unkpen: float = 0.0, style: str = "gnmt"):
    """Every output of 1..max_len words + EOS, scored as documented, best first."""
    out = []
    for n in range(min_len, max_len + 1):
        for seq in itertools.product(words, repeat=n):
            toks = list(seq) + [EOS]
            lps = model.sequence_lprobs(src, toks)
            lps = [lp - unkpen if t == UNK else lp for t, lp in zip(toks, lps)]
            lp = ((5 + len(toks)) / 6) ** alpha if style == "gnmt" else len(toks) ** alpha  # as documented
            out.append((sum(lps) / lp, toks))
    out.sort(key=lambda x: -x[0])
    return out


SOURCES = [[5, 4, 4, EOS], [4, EOS], [3, 5, 5, 4, 5, EOS]]


@pytest.mark.parametrize("style", ["gnmt", "fairseq"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.5, -0.5])
def test_beam_search_equals_exhaustive_search(alpha, style):
    model = TableModel(seed=1)
    nbest = 5
    # a beam this wide keeps every prefix, so the only thing that can go wrong is the scoring or the early stop
    cfg = SearchConfig(beam=64, nbest=nbest, lenpen=alpha, lenpen_style=style, max_len_a=0, max_len_b=4, min_len=1)
    hyps = beam_search(model, *batch(SOURCES), cfg, SYM)
    for src, got in zip(SOURCES, hyps):
        want = exhaustive(model, src, [UNK, 4, 5], max_len=4, min_len=1, alpha=alpha, style=style)[:nbest]
        assert [h.tokens for h in got] == [w[1] for w in want]
        assert [h.score for h in got] == pytest.approx([w[0] for w in want], rel=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_early_stop_never_drops_a_long_winner(seed):
    # a strong length penalty and a likely EOS: short hypotheses finish first, longer ones win later; an early-stop
    # bound that ignored the longest reachable length would stop too soon here
    model = TableModel(vocab=5, seed=seed, bias={EOS: 2.0})
    cfg = SearchConfig(beam=64, nbest=1, lenpen=2.5, max_len_a=0, max_len_b=6, min_len=1)
    for src, got in zip(SOURCES, beam_search(model, *batch(SOURCES), cfg, SYM)):
        want = exhaustive(model, src, [UNK, 4], max_len=6, min_len=1, alpha=2.5)[0]
        assert got[0].tokens == want[1]


@pytest.mark.parametrize("unkpen", [0.7, -0.8])
def test_unkpen_is_applied_as_documented_and_search_stays_exact(unkpen):
    model = TableModel(seed=4, bias={UNK: 1.0})
    cfg = SearchConfig(beam=64, nbest=3, lenpen=0.6, max_len_a=0, max_len_b=4, unkpen=unkpen)
    hyps = beam_search(model, *batch(SOURCES), cfg, SYM)
    for src, got in zip(SOURCES, hyps):
        want = exhaustive(model, src, [UNK, 4, 5], max_len=4, min_len=1, alpha=0.6, unkpen=unkpen)[:3]
        assert [h.tokens for h in got] == [w[1] for w in want]


def test_reported_score_is_logprob_over_gnmt_length_penalty():
    model = TableModel(seed=2)
    for alpha in (0.0, 0.6, 1.3):
        cfg = SearchConfig(beam=4, nbest=4, lenpen=alpha, max_len_a=1, max_len_b=3)
        for src, hyps in zip(SOURCES, beam_search(model, *batch(SOURCES), cfg, SYM)):
            for h in hyps:
                assert h.tokens[-1] == EOS and EOS not in h.tokens[:-1]
                # positional scores are the model's log-probabilities of the tokens
                assert h.positional_scores == pytest.approx(model.sequence_lprobs(src, h.tokens), abs=1e-5)
                expected = sum(h.positional_scores) / ((5 + len(h.tokens)) / 6) ** alpha
                assert h.score == pytest.approx(expected, rel=1e-5)


def test_length_penalty_formula():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(7, 0.6) == pytest.approx(2.0 ** 0.6)
    assert length_penalty(10, 0.0) == 1.0
    assert LengthPenalty(0.6, "fairseq")(7) == pytest.approx(7 ** 0.6)  # fairseq's --lenpen
    assert LengthPenalty(0.6)(7) == pytest.approx(2.0 ** 0.6)
    assert "((5 + length) / 6)^0.6" in SearchConfig().length_penalty.formula()
    assert "length^1 (fairseq)" in SearchConfig(lenpen=1.0, lenpen_style="fairseq").length_penalty.formula()
    with pytest.raises(ValueError, match="--lenpen-style must be one of gnmt, fairseq"):
        SearchConfig(lenpen_style="marian")


def test_score_upper_bound_is_a_bound_and_tight():
    cum = torch.tensor([-3.0, -0.5, 0.0])
    max_len = torch.tensor([10, 4, 6])
    b = score_upper_bound(cum, 2, max_len, LengthPenalty(0.6))
    assert b.tolist() == pytest.approx([-3.0 / length_penalty(11, 0.6), -0.5 / length_penalty(5, 0.6), 0.0])
    # alpha < 0: the shortest completion (EOS next) is the best case
    assert score_upper_bound(cum, 2, max_len, LengthPenalty(-0.5)).tolist() == pytest.approx((cum / length_penalty(3, -0.5)).tolist())
    # with a reward of 1 per token the best completion is the longest one here
    assert float(score_upper_bound(torch.tensor([-3.0]), 2, torch.tensor([10]), LengthPenalty(0.0), bonus=1.0)) == pytest.approx(5.0)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_greedy_is_exactly_beam_search_with_beam_one(alpha):
    model = TableModel(vocab=9, seed=3)
    sources = [[5, 4, 4, EOS], [4, EOS], [3, 5, 5, 4, 5, 7, 8, 6, EOS], [8, 8, EOS]]
    cfg = SearchConfig(beam=1, lenpen=alpha, max_len_a=1.0, max_len_b=5)
    g = greedy_search(model, *batch(sources), cfg, SYM)
    b = beam_search(model, *batch(sources), cfg, SYM)
    assert [h[0].tokens for h in g] == [h[0].tokens for h in b]
    assert [h[0].score for h in g] == [h[0].score for h in b]
    assert [h[0].positional_scores for h in g] == [h[0].positional_scores for h in b]
    assert search(model, *batch(sources), cfg, SYM)[0][0].tokens == g[0][0].tokens


def test_early_stop_ends_the_search_long_before_max_len():
    model = TableModel(seed=5, bias={EOS: 6.0})  # EOS is by far the most likely token everywhere
    cfg = SearchConfig(beam=4, lenpen=0.6, max_len_a=0, max_len_b=200)
    hyps = beam_search(model, *batch([[4, 5, EOS]]), cfg, SYM)
    assert len(hyps[0][0].tokens) == 2  # min_len 1, then EOS
    assert model.calls < 10


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_invariance_of_the_search(beam):
    model = TableModel(vocab=9, seed=6)
    sources = [[5, 4, 4, EOS], [4, EOS], [3, 5, 5, 4, 5, 7, 8, 6, EOS], [8, 8, EOS], [6, 7, 3, EOS]]
    cfg = SearchConfig(beam=beam, nbest=beam, lenpen=0.6, max_len_a=1.0, max_len_b=2)
    together = search(model, *batch(sources), cfg, SYM)
    for src, hyps in zip(sources, together):
        alone = search(model, *batch([src]), cfg, SYM)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in hyps]
        assert [h.score for h in alone] == pytest.approx([h.score for h in hyps], abs=1e-6)


def test_max_len_is_per_sentence():
    model = TableModel(seed=7, bias={EOS: -50.0})  # never wants to stop
    sources = [[4, EOS], [4, 5, 5, 5, 5, 4, EOS]]
    cfg = SearchConfig(beam=3, lenpen=0.6, max_len_a=1.0, max_len_b=1)
    hyps = beam_search(model, *batch(sources), cfg, SYM)
    assert [len(h[0].tokens) for h in hyps] == [2 + 1 + 1, 7 + 1 + 1]  # floor(1 * S + 1) tokens, then EOS


def test_min_len():
    model = TableModel(seed=8, bias={EOS: 6.0})
    for beam in (1, 4):
        cfg = SearchConfig(beam=beam, min_len=3, max_len_b=10)
        hyps = search(model, *batch(SOURCES), cfg, SYM)
        assert all(len(h[0].tokens) == 4 for h in hyps)


def _ngrams(seq, n):
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_blocks_repeats(n):
    model = TableModel(vocab=10, seed=9, bias={4: 6.0, 5: 3.0, EOS: -20.0})  # loves "4 4 4 ...", hates stopping
    for beam in (1, 3):
        base = search(model, *batch(SOURCES), SearchConfig(beam=beam, max_len_a=0, max_len_b=8), SYM)
        assert any(len(set(_ngrams(h[0].tokens, n))) < len(_ngrams(h[0].tokens, n)) for h in base)
        cfg = SearchConfig(beam=beam, nbest=beam, max_len_a=0, max_len_b=8, no_repeat_ngram_size=n)
        for hyps in search(model, *batch(SOURCES), cfg, SYM):
            for h in hyps:
                words = h.tokens[:-1]
                assert len(set(_ngrams(words, n))) == len(_ngrams(words, n)), words


def test_nbest_distinct_and_sorted():
    model = TableModel(vocab=12, seed=10)
    cfg = SearchConfig(beam=6, nbest=5, max_len_b=6)
    for hyps in beam_search(model, *batch(SOURCES), cfg, SYM):
        assert len(hyps) == 5
        assert len({tuple(h.tokens) for h in hyps}) == 5
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_unkpen_lowers_unk():
    model = TableModel(vocab=8, seed=11, bias={UNK: 3.0})
    for beam in (1, 4):
        plain = search(model, *batch(SOURCES), SearchConfig(beam=beam, max_len_b=5), SYM)
        assert any(UNK in h[0].tokens for h in plain)
        hyps = search(model, *batch(SOURCES), SearchConfig(beam=beam, max_len_b=5, unkpen=1.5), SYM)
        for src, h in zip(SOURCES, hyps):
            ref = model.sequence_lprobs(src, h[0].tokens)
            for tok, got, want in zip(h[0].tokens, h[0].positional_scores, ref):
                assert got == pytest.approx(want - (1.5 if tok == UNK else 0.0), abs=1e-5)
        strict = search(model, *batch(SOURCES), SearchConfig(beam=beam, max_len_b=5, unkpen=100.0), SYM)
        assert not any(UNK in h[0].tokens for h in strict)


def test_sampling_draws_from_the_model_distribution():
    model = TableModel(vocab=6, seed=12, scale=1.0)
    src = [4, 5, EOS]
    n_sent, k = 250, 8
    tokens, lengths = batch([src] * n_sent)
    cfg = SearchConfig(beam=k, nbest=k, sampling=True, options=SamplingConfig(seed=3), max_len_a=0, max_len_b=1, min_len=1)
    hyps = sample_search(model, tokens, lengths, cfg, SYM, sample_ids=torch.arange(n_sent))
    firsts = torch.tensor([h.tokens[0] for hs in hyps for h in hs])
    assert firsts.numel() == n_sent * k
    h0 = (int(model.encode(tokens[:1], lengths[:1])["key"][0]) * 31 + EOS + 1) % model.rows
    p = torch.softmax(model.table[h0], -1)
    p[[BOS, PAD, EOS]] = 0  # barred (EOS by --min-len)
    p = p / p.sum()
    freq = torch.bincount(firsts, minlength=6).double() / firsts.numel()
    sd = torch.sqrt(p * (1 - p) / firsts.numel())
    assert torch.all((freq - p).abs() <= 4 * sd + 1e-9), (freq, p)


def test_sampling_topk_topp_and_batch_independence():
    model = TableModel(vocab=10, seed=13, scale=1.0)
    src = [4, 5, EOS]
    tokens, lengths = batch([src] * 100)
    h0 = (int(model.encode(tokens[:1], lengths[:1])["key"][0]) * 31 + EOS + 1) % model.rows
    logp = torch.log_softmax(model.table[h0], -1)
    logp[[BOS, PAD, EOS]] = float("-inf")
    order = logp.argsort(descending=True).tolist()
    cfg = SearchConfig(beam=4, nbest=4, sampling=True, options=SamplingConfig(sampling_topk=2), max_len_a=0, max_len_b=1)
    got = {h.tokens[0] for hs in sample_search(model, tokens, lengths, cfg, SYM) for h in hs}
    assert got == set(order[:2])
    p = torch.softmax(logp, -1)
    need = next(i for i in range(10) if float(p[order[: i + 1]].sum()) >= 0.5) + 1
    cfg = SearchConfig(beam=4, nbest=4, sampling=True, options=SamplingConfig(sampling_topp=0.5), max_len_a=0, max_len_b=1)
    got = {h.tokens[0] for hs in sample_search(model, tokens, lengths, cfg, SYM) for h in hs}
    assert got == set(order[:need])
    # a sentence's samples depend on (seed, its id), not on its batch
    sources = [[5, 4, 4, EOS], [4, EOS], [3, 5, 5, 4, 5, EOS]]
    cfg = SearchConfig(beam=3, nbest=3, sampling=True, options=SamplingConfig(seed=7), max_len_b=5)
    together = sample_search(model, *batch(sources), cfg, SYM, sample_ids=torch.tensor([10, 11, 12]))
    for i, src in enumerate(sources):
        alone = sample_search(model, *batch([src]), cfg, SYM, sample_ids=torch.tensor([10 + i]))[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
    other_seed = sample_search(model, *batch(sources), SearchConfig(beam=3, nbest=3, sampling=True, options=SamplingConfig(seed=8),
                                                                    max_len_b=5), SYM, torch.tensor([10, 11, 12]))
    assert [[h.tokens for h in hs] for hs in other_seed] != [[h.tokens for h in hs] for hs in together]
    for hs in together:
        assert [h.score for h in hs] == sorted((h.score for h in hs), reverse=True)


def test_config_validation_messages():
    with pytest.raises(ValueError, match="--nbest"):
        SearchConfig(beam=2, nbest=3)
    with pytest.raises(ValueError, match="--sampling-topp"):
        SamplingConfig(sampling_topp=0.0)
    assert math.isclose(SearchConfig().lenpen, 0.6) and SearchConfig().beam == 4


@pytest.mark.precision
def test_bf16_block_maxima_of_log_probabilities_are_exact():
    from attnmt.backends.cpu import bf16_block_maxima

    g = torch.Generator().manual_seed(0)
    x = -(torch.rand(7, 4 * 64, generator=g) * 30).to(torch.bfloat16)
    x[0, :64] = float("-inf")  # a block of masked tokens
    x[1, 70] = -0.0
    x[2, 5] = 0.0
    got = bf16_block_maxima(x, 4, nonpositive=True)
    want = x.float().unflatten(1, (4, -1)).amax(dim=2).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), want.float())
    assert got[0, 0] == float("-inf")


@pytest.mark.parametrize("seed", range(6))
def test_beam_early_stop_is_a_prefix_of_the_exact_search(seed):
    # early_stop="beam" follows the same beam and stops once `beam` hypotheses have finished: never more decoder
    # steps, never a better result than the exact stop, and the same output whatever the batching
    sources = [[5, 4, 4, EOS], [4, EOS], [3, 5, 5, 4, 5, EOS]]
    exact_model, beam_model = TableModel(vocab=7, seed=seed, bias={EOS: 1.0}), TableModel(vocab=7, seed=seed,
                                                                                        bias={EOS: 1.0})
    exact = beam_search(exact_model, *batch(sources), SearchConfig(beam=3, lenpen=1.5, max_len_b=12), SYM)
    cfg = SearchConfig(beam=3, lenpen=1.5, max_len_b=12, options=BeamSearchConfig(early_stop="beam"))
    early = beam_search(beam_model, *batch(sources), cfg, SYM)
    assert beam_model.calls <= exact_model.calls
    for src, e, b in zip(sources, exact, early):
        assert b[0].score <= e[0].score + 1e-6
        assert [h.tokens for h in beam_search(TableModel(vocab=7, seed=seed, bias={EOS: 1.0}), *batch([src]), cfg,
                                              SYM)[0]] == [h.tokens for h in b]


def test_beam_early_stop_takes_fewer_steps_when_short_hypotheses_finish_first():
    fewer = 0
    for seed in range(10):
        exact_model, beam_model = TableModel(vocab=7, seed=seed, bias={EOS: 1.5}), TableModel(vocab=7, seed=seed,
                                                                                            bias={EOS: 1.5})
        beam_search(exact_model, *batch(SOURCES), SearchConfig(beam=3, lenpen=2.0, max_len_b=12), SYM)
        beam_search(beam_model, *batch(SOURCES), SearchConfig(beam=3, lenpen=2.0, max_len_b=12, options=BeamSearchConfig(early_stop="beam")),
                    SYM)
        fewer += beam_model.calls < exact_model.calls
    assert fewer > 0


@pytest.mark.parametrize("options", [dict(), dict(unkpen=1.5), dict(unkpen=-2.0, min_len=4)])
@pytest.mark.parametrize("step", [0, 3, 4])
def test_token_bias_is_the_rules_that_apply_to_every_row(options, step):
    """log_softmax + token_bias is step_log_probs wherever no row is at its length limit and no n-gram is blocked
    (what the score kernels rely on)."""
    from attnmt.generation.search import step_log_probs, token_bias

    cfg = SearchConfig(beam=2, **options)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(step))
    max_len = torch.full((5,), 10)
    generated = torch.randint(4, 40, (5, step))
    expected = step_log_probs(logits, step, max_len, generated, cfg, SYM)
    got = torch.log_softmax(logits, dim=-1) + token_bias(40, step, cfg, SYM, logits.device)
    assert torch.equal(got, expected)


def test_a_forced_first_token_is_the_only_one_at_step_0_and_leaves_later_rows_alone():
    """M2M-100's target language token: rows at step 0 may write only it, at log-probability 0; rows at other
    steps (continuous batching mixes them) keep the usual rules."""
    from attnmt.generation.search import step_log_probs

    sym = Symbols(eos=2, pad=1, unk=3, bos=0, forced=7)
    logits = torch.randn(2, 12)
    lp = step_log_probs(logits, torch.tensor([0, 3]), torch.tensor([10, 10]), None, SearchConfig(), sym)
    assert lp[0, 7] == 0 and torch.isinf(lp[0, torch.arange(12) != 7]).all()
    want = torch.log_softmax(logits[1], -1)
    want[[0, 1]] = float("-inf")
    assert torch.equal(lp[1], want)
    lp = step_log_probs(logits, 0, torch.tensor([10, 10]), None, SearchConfig(), sym)
    assert (lp[:, 7] == 0).all()
