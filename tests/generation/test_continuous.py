"""Continuous batching: sentences that join a running search at different steps get exactly the hypotheses of the
static search, on every attention path (the CPU's step kernel with per-sentence positions, the masked batched
products, the fused form a GPU runs), and the configurations it does not take are refused with their reason."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from attnmt.backends import backend_for
from attnmt.generation.beam import BeamSearchConfig
from attnmt.generation.continuous import ContinuousSearch, unsupported
from attnmt.generation.generator import Generator, collate
from attnmt.generation.search import SearchConfig, Symbols, empty_translation, search
from attnmt.models.kernels import DecodingKernels
from attnmt.models.transformer import TransformerConfig, TransformerModel

SYM = Symbols(eos=2, pad=1, unk=3, bos=0)
VOCAB = 640  # ten blocks of the candidate scan: the score kernel's path is taken


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=0.0, share_all_embeddings=True)
    torch.manual_seed(0)
    m = TransformerModel.build(cfg, VOCAB, VOCAB, SYM.pad, joint_vocab=True).eval()
    with torch.no_grad():  # EOS likely enough that the hypotheses end at many different lengths
        m.decoder.output_projection.weight[SYM.eos] *= 6
    return m


def sources(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 12))] + [SYM.eos] for _ in range(n)]


def kernels_for(path: str) -> DecodingKernels:
    cpu = backend_for("cpu").decoding_kernels()
    if path == "cpu":
        if cpu.step_attention is None:
            pytest.fail("the CPU backend has no compiled step kernel here: the per-sentence positions go untested")
        return cpu
    return DecodingKernels(row_bucket=None, fused_attention=path == "fused", blockwise_topk=path != "fused",
                           low_precision_scores=False)


def run_continuous(gen: Generator, kernels: DecodingKernels, srcs: list[list[int]], in_flight: int):
    """Sentences join whenever fewer than ``in_flight`` are searched, 1-3 at a time (so at every step)."""
    stream = ContinuousSearch(gen, kernels)
    rng = random.Random(1)
    got, nxt, steps = {}, 0, 0
    while nxt < len(srcs) or stream.size:
        if stream.size < in_flight and nxt < len(srcs):
            k = min(rng.randint(1, 3), len(srcs) - nxt)
            stream.add(srcs[nxt:nxt + k], range(nxt, nxt + k))
            nxt += k
        for key, hyps in stream.step():
            assert key not in got
            got[key] = hyps
        steps += 1
    return [got[i] for i in range(len(srcs))], steps


OPTIONS = {
    "beam 4": dict(),
    "greedy": dict(beam=1),
    "nbest 2, lenpen 1, min-len 3": dict(nbest=2, lenpen=1.0, min_len=3),
    "fairseq's stop, negative lenpen": dict(beam=3, lenpen=-0.5, options=BeamSearchConfig(early_stop="beam")),
    "short limits": dict(max_len_a=0.5, max_len_b=1),
}


@pytest.mark.parametrize("path", ["cpu", "plain", "fused"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_sentences_joining_a_running_search_get_the_static_hypotheses(model, path, name):
    cfg = SearchConfig(**OPTIONS[name])
    gen = Generator(model, SYM, cfg)
    kernels = kernels_for(path)
    srcs = sources(40, 5)
    tokens, lengths = collate(srcs, SYM.pad, torch.device("cpu"))
    with torch.inference_mode():
        want = search(model, tokens, lengths, cfg, SYM, kernels=kernels)
    got, steps = run_continuous(gen, kernels, srcs, in_flight=6)
    assert steps < sum(len(h[0].tokens) for h in want)  # sentences were searched side by side
    lengths_seen = {len(h[0].tokens) for h in want}
    assert len(lengths_seen) > 3, "the hypotheses should end at different steps"
    for i, (g, w) in enumerate(zip(got, want)):
        assert [h.tokens for h in g] == [h.tokens for h in w], f"sentence {i}"
        for a, b in zip(g, w):
            assert a.score == pytest.approx(b.score, rel=1e-6, abs=1e-5)
            assert a.positional_scores == pytest.approx(b.positional_scores, abs=1e-5)


def test_the_pool_reuses_the_places_of_finished_sentences(model):
    gen = Generator(model, SYM, SearchConfig())
    stream = ContinuousSearch(gen)
    srcs = sources(30, 6)
    for s in srcs[:4]:
        stream.add([s], [len(stream.keys)])
    done = 0
    nxt = 4
    while stream.size:
        done += len(stream.step())
        while stream.size < 4 and nxt < len(srcs):
            stream.add([srcs[nxt]], [nxt])
            nxt += 1
    assert done == 30
    assert stream.state.cache.places <= 8  # never more than twice the sentences in flight


def test_blank_sentences_leave_at_the_next_step_without_the_model(model):
    gen = Generator(model, SYM, SearchConfig(nbest=2))
    srcs = sources(3, 7)
    want = gen.search_batch(srcs, range(3))
    calls = []
    hook = model.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        stream = ContinuousSearch(gen)
        stream.add([[SYM.eos], [SYM.eos]], ["a", "b"])
        assert stream.size == 2 and calls == []
        assert stream.step() == [("a", empty_translation(SYM.eos, 2)), ("b", empty_translation(SYM.eos, 2))]
        assert stream.size == 0 and calls == []
        assert (gen.stats.sentences, gen.stats.target_tokens, gen.stats.seconds) == (2, 0, 0.0)
        stream.add([srcs[0], [SYM.eos], srcs[1], srcs[2]], [0, "c", 1, 2])  # blanks among sentences with words
        assert calls == [3] and stream.size == 4
        got = {}
        while stream.size:
            got.update(stream.step())
    finally:
        hook.remove()
    assert got.pop("c") == empty_translation(SYM.eos, 2)
    assert [[h.tokens for h in got[i]] for i in range(3)] == [[h.tokens for h in w] for w in want]


def test_dropped_sentences_end_at_the_next_step_and_the_others_are_unchanged(model):
    """A sentence whose caller has gone leaves the search at the next step (cut short), a blank one at once; the
    sentences beside them get the hypotheses they would have had."""
    cfg = SearchConfig(min_len=8, max_len_a=0, max_len_b=40)
    gen = Generator(model, SYM, cfg)
    srcs = sources(4, 8)
    want = gen.search_batch(srcs, range(4))
    stream = ContinuousSearch(gen)
    stream.add(srcs[:3] + [[SYM.eos]], [0, "gone", 2, "blank"])
    assert stream.step() == [("blank", empty_translation(SYM.eos, 1))]  # the blank one leaves first
    stream.drop(["gone"])
    got = dict(stream.step())
    assert set(got) == {"gone"} and len(got["gone"][0].tokens) <= 2  # ended at once, cut short
    stream.add([srcs[3], [SYM.eos]], [3, "blank2"])
    stream.drop(["blank2"])
    while stream.size:
        got.update(stream.step())
    assert "blank2" not in got
    assert [[h.tokens for h in got[i]] for i in (0, 2, 3)] == [[h.tokens for h in want[i]] for i in (0, 2, 3)]


def test_configurations_it_cannot_take_are_named(model):
    assert unsupported(Generator(model, SYM, SearchConfig())) is None
    assert unsupported(Generator(model, SYM, SearchConfig(sampling=True))) == "the sampling search"
    assert unsupported(Generator(model, SYM, SearchConfig(no_repeat_ngram_size=2))) == "--no-repeat-ngram-size"
    assert unsupported(Generator(model, SYM, SearchConfig(unkpen=-1.0))) == "a negative --unkpen"
    with pytest.raises(ValueError, match="continuous batching does not take the sampling search"):
        ContinuousSearch(Generator(model, SYM, SearchConfig(sampling=True)))


def test_a_bf16_model_gets_the_static_hypotheses_up_to_bf16_rounding(model):
    """A joining sentence's first step is scored from one row with its log-probabilities rounded to bf16, as the
    static search's first step is; the products still round with the rows around them (bf16 keeps 8 bits), so a
    score may move by a fraction of a percent and, rarely, a close call go the other way."""
    m = copy.deepcopy(model).to(torch.bfloat16)
    cfg = SearchConfig()
    kernels = kernels_for("cpu")
    srcs = sources(40, 9)
    tokens, lengths = collate(srcs, SYM.pad, torch.device("cpu"))
    with torch.inference_mode():
        want = search(m, tokens, lengths, cfg, SYM, kernels=kernels)
    got, _ = run_continuous(Generator(m, SYM, cfg), kernels, srcs, in_flight=6)
    same = [i for i in range(len(srcs)) if got[i][0].tokens == want[i][0].tokens]
    assert len(same) >= 38, f"{len(srcs) - len(same)} of {len(srcs)} bf16 translations changed"
    assert [got[i][0].score for i in same] == pytest.approx([want[i][0].score for i in same], rel=2e-2)
