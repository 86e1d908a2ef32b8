"""Minimum Bayes risk decoding: chrF against sacreBLEU's, the choice against a reference computation on a real
(tiny, random) Transformer, the exact fast path of top-p sampling, and the options' errors."""

from __future__ import annotations

import pytest
import torch
from helpers import make_checkpoint, sentence_lines
from sacrebleu.metrics import CHRF

from attnmt.errors import UserError
from attnmt.generation import sampling
from attnmt.generation.generator import GenerationConfig
from attnmt.generation.mbr import CharNgrams, chrf, mbr_order
from attnmt.generation.sampling import SamplingConfig
from attnmt.generation.search import SearchConfig

PAIRS = [
    ("Ein Mann fährt Fahrrad.", "Ein Mann fährt auf einem Fahrrad."),
    ("Zwei Hunde spielen im Schnee.", "Zwei Hunde spielen im Schnee."),
    ("Eine Frau", "Ein Kind läuft über eine Wiese."),
    ("a", "ab"),
    ("xyz", "abc"),
    ("", "Ein Mann."),
    ("Ein Mann.", ""),
    ("", ""),
    ("Männer   am  Strand ", "Männer am Strand"),
    ("Das ist das Haus vom Nikolaus, das ist das Haus", "das Haus"),
]


@pytest.mark.parametrize("hyp,ref", PAIRS)
def test_chrf_is_sacrebleus_sentence_chrf(hyp, ref):
    assert chrf(CharNgrams(hyp), CharNgrams(ref)) == pytest.approx(CHRF().sentence_score(hyp, [ref]).score, abs=1e-9)


def test_mbr_order_prefers_what_the_samples_agree_with():
    candidates = ["A dog runs on the beach.", "A cat sleeps.", "A dog is running on the beach."]
    evidence = ["A dog runs on a beach.", "The dog runs on the beach.", "A dog runs along the beach.", "A cat."]
    utility = [sum(CHRF().sentence_score(c, [e]).score for e in evidence) for c in candidates]
    assert mbr_order(candidates, evidence) == sorted(range(3), key=lambda i: -utility[i])
    assert mbr_order(candidates, evidence)[0] == 0
    assert mbr_order(["b", "a"], ["a", "a"]) == [1, 0]
    assert mbr_order(["same", "same"], ["same"]) == [0, 1]  # a tie keeps the beam's order
    assert mbr_order(["x", "y"], []) == [0, 1]


def _reference_draw(logits, keys, step, topk, topp):
    """The whole-vocabulary draw: the filtered logits plus noise for every token."""
    filtered = sampling._filter_logits(logits, topk, topp)
    tokens = torch.arange(logits.size(1))[None, :]
    return (filtered + sampling._gumbel_noise(keys, step, tokens)).argmax(dim=1)


@pytest.mark.parametrize("topk,topp", [(0, 0.9), (0, 0.5), (20, 0.95), (0, 1.0), (5, 1.0)])
def test_top_p_draws_only_the_kept_tokens_noise_and_chooses_as_a_full_draw(topk, topp):
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(48, 500, generator=g) * 6  # trained-model-like: top-p keeps a few tokens
    flat = torch.randn(16, 500, generator=g) * 0.1  # top-p needs hundreds: the full filter
    keys = torch.randint(0, 2**32, (64,), generator=g)
    for logits in (peaked, torch.cat([peaked, flat])):
        logits = torch.log_softmax(logits, dim=1)
        k = keys[: logits.size(0)]
        for step in range(5):
            assert torch.equal(sampling._draw(logits, k, step, topk, topp), _reference_draw(logits, k, step, topk, topp))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _load(ckpt, **search):
    from attnmt.inference import load_generator

    return load_generator(ckpt, SearchConfig(**{"max_len_b": 12, **search}), GenerationConfig(device="cpu"))


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; the process's setting is restored for the tests after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_mbr_outputs_the_beam_hypothesis_of_highest_mean_chrf_against_the_samples(ckpt, one_thread):
    lines = sentence_lines(10, 3)
    bundle, mbr = _load(ckpt, beam=4, nbest=2, mbr_samples=8)
    sources = bundle.encode_sources(lines)
    got = [hyps for _, hyps in mbr.generate(sources)]
    _, beam = _load(ckpt, beam=4, nbest=4)
    _, draws = _load(ckpt, search="sampling", beam=8, nbest=8, options=SamplingConfig(sampling_topp=0.9))
    text = bundle.target_text
    changed = 0
    for i, ((_, cands), (_, samples)) in enumerate(zip(beam.generate(sources), draws.generate(sources))):
        mean = [sum(CHRF().sentence_score(text(c.tokens), [text(s.tokens)]).score for s in samples) for c in cands]
        want = sorted(range(len(cands)), key=lambda j: -mean[j])[:2]
        assert [h.tokens for h in got[i]] == [cands[j].tokens for j in want], i
        assert [h.score for h in got[i]] == [cands[j].score for j in want]  # model scores kept
        changed += want[0] != 0
    assert changed  # the random model's samples overrule beam search somewhere
    again = [hyps for _, hyps in mbr.generate(sources, max_tokens=12)]  # batch-invariant: seeded per sentence
    assert [[h.tokens for h in x] for x in again] == [[h.tokens for h in x] for x in got]
    assert "highest mean chrF against 8 samples" in mbr.search_cfg.describe()


def test_mbr_batches_hold_as_many_rows_as_beam_searchs(ckpt, monkeypatch):
    from attnmt.generation import generator as gen_module

    budgets = []
    real = gen_module.make_batches
    monkeypatch.setattr(gen_module, "make_batches", lambda lengths, max_tokens, *a: budgets.append(max_tokens)
                        or real(lengths, max_tokens, *a))
    for samples in (0, 4, 32):
        bundle, g = _load(ckpt, beam=4, mbr_samples=samples)
        list(g.generate(bundle.encode_sources(["Ein Hund."])))
        list(g.generate(bundle.encode_sources(["Ein Hund."]), max_tokens=100))  # a given budget is kept
    device = budgets[0]
    assert budgets == [device, 100, device, 100, device // 8, 100]


def test_mbr_options_refuse_what_they_cannot_do(ckpt):
    with pytest.raises(ValueError, match="--mbr-samples reranks beam search's hypotheses, not --search sampling"):
        SearchConfig(sampling=True, mbr_samples=4)
    from attnmt.generation.continuous import unsupported

    assert unsupported(_load(ckpt, mbr_samples=4)[1]) == "--mbr-samples"
    from attnmt.api import Translator

    t = Translator(ckpt, device="cpu", mbr_samples=4, max_len_b=12)
    assert isinstance(t.translate("Ein Hund."), str)
    with pytest.raises(UserError, match="continuous batching does not take --mbr-samples"):
        t.continuous_search()
