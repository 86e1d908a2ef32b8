"""Generation with a real (tiny, random) Transformer: search equivalences, batch invariance, input order, and the
``attnmt generate`` / ``attnmt translate`` command lines on a self-contained checkpoint."""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import SENTENCE_WORDS, make_checkpoint, sentence_lines

from attnmt import registry
from attnmt.backends import backend_for
from attnmt.errors import UserError
from attnmt.generation.beam import beam_search, greedy_search
from attnmt.generation.generator import GenerationConfig, Generator, make_batches
from attnmt.generation.search import SearchConfig, empty_translation, length_penalty
from attnmt.models.kernels import EagerSteps

WORDS = SENTENCE_WORDS


def _lines(n: int, seed: int) -> list[str]:
    return sentence_lines(n, seed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A self-contained checkpoint: random tiny Transformer, SentencePiece model and joined dictionary."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight over shared cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _load(ckpt, **search):
    from attnmt.inference import load_generator

    cfg = SearchConfig(**{"max_len_b": 12, **search})
    return load_generator(ckpt, cfg, GenerationConfig(device="cpu"))


SENTENCES = _lines(12, 1) + ["", "Dog."]


def test_beam_one_equals_greedy_on_a_transformer(ckpt):
    bundle, gen = _load(ckpt, beam=1, lenpen=0.6)
    from attnmt.generation.generator import collate

    tokens, lengths = collate(bundle.encode_sources(SENTENCES), bundle.symbols.pad, torch.device("cpu"))
    g = greedy_search(bundle.model, tokens, lengths, gen.search_cfg, bundle.symbols)
    b = beam_search(bundle.model, tokens, lengths, gen.search_cfg, bundle.symbols)
    assert [h[0].tokens for h in g] == [h[0].tokens for h in b]
    assert [h[0].score for h in g] == [h[0].score for h in b]
    assert len({len(h[0].tokens) for h in g}) > 1  # the test sees hypotheses of different lengths


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_invariance_and_input_order(ckpt, beam):
    bundle, gen = _load(ckpt, beam=beam, nbest=beam)
    sources = bundle.encode_sources(SENTENCES)
    eos = bundle.symbols.eos
    assert sources.count([eos]) == 1  # "" has nothing to translate: its translation is empty, without a search
    alone = [empty_translation(eos, beam) if s == [eos] else gen.search_batch([s], [i])[0]
             for i, s in enumerate(sources)]
    # small batches of length-sorted sentences: several batches, results handed back in input order
    assert len(make_batches([len(s) for s in sources], 40, None)) > 2
    got = list(gen.generate(sources, max_tokens=40))
    assert [i for i, _ in got] == list(range(len(sources)))
    together = list(gen.generate(sources, max_tokens=10_000))
    for (i, hyps), (_, hyps_all) in zip(got, together):
        for h in (hyps, hyps_all):
            assert [x.tokens for x in h] == [x.tokens for x in alone[i]]
            assert [x.score for x in h] == pytest.approx([x.score for x in alone[i]], abs=1e-5)


def test_blank_sources_get_the_empty_translation_and_no_search(ckpt):
    bundle, gen = _load(ckpt, nbest=2)
    eos = bundle.symbols.eos
    lines = ["", "Dog.", "   ", SENTENCES[0], "\t", ""]
    sources = bundle.encode_sources(lines)
    blank = [i for i, ln in enumerate(lines) if not ln.strip()]
    assert [i for i, s in enumerate(sources) if s == [eos]] == blank
    searched = {1: gen.search_batch([sources[1]], [1])[0], 3: gen.search_batch([sources[3]], [3])[0]}
    calls = []
    hook = bundle.model.encoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    sizes = []
    try:
        got = list(gen.generate(sources, progress=sizes.append))
        assert calls == [2]  # one search, of the two sentences with words
        calls.clear()
        gen.stats = type(gen.stats)()
        only_blank = list(gen.generate([sources[i] for i in blank]))
        assert calls == []
    finally:
        hook.remove()
    assert [i for i, _ in got] == list(range(len(lines))) and sum(sizes) == len(lines)
    for i, hyps in got:
        if i in blank:
            assert [(h.tokens, h.score, h.positional_scores) for h in hyps] == [([eos], 0.0, [0.0])] * 2
            assert bundle.detokenize(bundle.target_pieces(hyps[0].tokens)) == ""
        else:
            assert [h.tokens for h in hyps] == [h.tokens for h in searched[i]]
    assert [h for _, h in only_blank] == [empty_translation(eos, 2)] * len(blank)
    summary = gen.stats.summary()  # no search ran: no rates over zero seconds
    assert summary.startswith(f"translated {len(blank)} sentences") and "/s" not in summary


@pytest.mark.parametrize("beam", [1, 4])
def test_the_gpus_decoding_kernels_give_the_cpus_translations(ckpt, beam):
    """One topk over beam x vocabulary in fp32, the fused attention and, for beam search, the cache of fixed
    shapes whose steps a GPU replays as CUDA graphs (the CUDA backend's choices; run eagerly here) give the CPU's
    hypotheses and scores in fp32; so do the row padding, the default kernels of the search, scoring one
    sentence's rows at a time instead of the whole batch's, and the fused attention over the slot cache."""
    import dataclasses

    from attnmt.backends.base import Backend, DecodingKernels
    from attnmt.backends.cuda import CudaBackend
    from attnmt.generation.generator import collate
    from attnmt.generation.search import search

    gpu = CudaBackend(torch.device("cuda")).decoding_kernels()
    assert not gpu.blockwise_topk and not gpu.low_precision_scores and gpu.row_bucket is None and gpu.fused_attention
    assert gpu.score_rows > 10000  # a whole batch scored at once
    assert gpu.step_graphs is not None  # CUDA graphs need a GPU: their cache runs eagerly below (EagerSteps)
    gpu = dataclasses.replace(gpu, step_graphs=None)
    assert Backend(torch.device("meta")).decoding_kernels() == dataclasses.replace(gpu, fused_attention=False,
                                                                                   score_rows=256)
    bundle, gen = _load(ckpt, beam=beam, nbest=beam, lenpen=0.6)
    tokens, lengths = collate(bundle.encode_sources(SENTENCES), bundle.symbols.pad, torch.device("cpu"))
    cpu = gen.backend.decoding_kernels()
    assert cpu.blockwise_topk and cpu.row_bucket is not None
    results = [search(bundle.model, tokens, lengths, gen.search_cfg, bundle.symbols, kernels=k)
               for k in (cpu, gpu, DecodingKernels(), dataclasses.replace(gpu, score_rows=beam),  # 1 sentence a block
                         dataclasses.replace(gpu, step_graphs=EagerSteps))]
    for other in results[1:]:
        assert [[x.tokens for x in h] for h in other] == [[x.tokens for x in h] for h in results[0]]
        for h, g in zip(other, results[0]):
            assert [x.score for x in h] == pytest.approx([x.score for x in g], abs=1e-5)


def test_the_static_cache_grows_drops_sentences_and_gives_the_slot_caches_translations(ckpt, monkeypatch):
    """The fixed-shape cache a GPU replays as CUDA graphs (the CUDA default), run eagerly: its buffers
    grow (16 positions, then doubled), sentences leave the search at different steps, their rows are dropped when
    the buffers grow, and every hypothesis and score is the slot cache's (fp32)."""
    import dataclasses

    from attnmt.backends.cuda import CudaBackend
    from attnmt.generation.generator import collate
    from attnmt.generation.search import search
    from attnmt.models.static_cache import StaticCache

    bundle, gen = _load(ckpt, beam=4, nbest=2, max_len_b=40)
    tokens, lengths = collate(bundle.encode_sources(SENTENCES), bundle.symbols.pad, torch.device("cpu"))
    monkeypatch.setenv("ATTNMT_CUDA_GRAPHS", "0")
    assert CudaBackend(torch.device("cuda")).decoding_kernels().step_graphs is None  # kernels launched one by one
    monkeypatch.delenv("ATTNMT_CUDA_GRAPHS")
    gpu = CudaBackend(torch.device("cuda")).decoding_kernels()
    assert gpu.step_graphs is not None  # the default
    gpu = dataclasses.replace(gpu, step_graphs=EagerSteps)  # no CUDA here: the steps run as they are
    calls = []
    run = StaticCache.run

    def spy(self, *args):
        live = self.sentences if self.live is None else self.live.numel()
        calls.append((self.positions, len(SENTENCES) if self.length == 0 else live, self.sentences))
        return run(self, *args)

    monkeypatch.setattr(StaticCache, "run", spy)
    static = search(bundle.model, tokens, lengths, gen.search_cfg, bundle.symbols, kernels=gpu)
    slot = search(bundle.model, tokens, lengths, gen.search_cfg, bundle.symbols,
                  kernels=dataclasses.replace(gpu, step_graphs=None))
    assert len(calls) > 32 and calls[0][0] == 16 and calls[-1][0] > 32  # grown twice at least
    assert len({live for _, live, _ in calls}) > 3  # sentences left at several steps
    assert calls[1][2] == len(SENTENCES) and calls[-1][2] < len(SENTENCES)  # finished sentences' rows dropped
    assert [[x.tokens for x in h] for h in static] == [[x.tokens for x in h] for h in slot]
    for h, g in zip(static, slot):
        assert [x.score for x in h] == pytest.approx([x.score for x in g], abs=1e-5)
    assert len({len(h[0].tokens) for h in static}) > 3


def test_max_tokens_zero_is_the_devices_choice(ckpt):
    from attnmt.backends.cuda import CudaBackend

    assert GenerationConfig().max_tokens == 0
    assert CudaBackend(torch.device("cuda")).decoding_max_tokens() == 16000
    bundle, gen = _load(ckpt, beam=2)
    assert gen.backend.decoding_max_tokens() == 8192
    sources = bundle.encode_sources(SENTENCES)
    assert [h[0].tokens for _, h in gen.generate(sources)] == \
        [h[0].tokens for _, h in gen.generate(sources, max_tokens=8192)]
    with pytest.raises(ValueError, match="--max-tokens must be positive"):
        GenerationConfig(max_tokens=-1)
    with pytest.raises(UserError, match="--fp16 needs a CUDA GPU"):
        _load_precision(ckpt, "fp16")


def _load_precision(ckpt, precision):
    from attnmt.inference import load_generator

    return load_generator(ckpt, SearchConfig(), GenerationConfig(device="cpu", precision=precision))


def test_scores_follow_the_length_penalty_on_a_transformer(ckpt):
    bundle, gen = _load(ckpt, beam=4, nbest=4, lenpen=1.0)
    sources = bundle.encode_sources(SENTENCES[:4])
    for src, hyps in zip(sources, gen.search_batch(sources, range(4))):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            # recompute the log-probabilities with one teacher-forced pass
            prev = torch.tensor([[bundle.symbols.eos] + h.tokens[:-1]])
            with torch.no_grad():
                lp = torch.log_softmax(bundle.model(torch.tensor([src]), torch.tensor([len(src)]), prev), -1)[0]
            ref = lp.gather(1, torch.tensor(h.tokens)[:, None])[:, 0]
            assert h.positional_scores == pytest.approx(ref.tolist(), abs=1e-4)
            assert h.score == pytest.approx(float(ref.sum()) / length_penalty(len(h.tokens), 1.0), abs=1e-4)


def test_make_batches_respects_limits():
    lengths = [5, 1, 9, 3, 3, 7, 2, 20]
    batches = make_batches(lengths, 12, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 12
    assert [7] in batches  # longer than --max-tokens alone: a batch of its own


def test_make_batches_for_workers_finish_together():
    lengths = [10] * 8  # at 30 tokens: 3 + 3 + 2 sentences, the last batch left to one worker (time 5 vs 4)
    assert [len(b) for b in make_batches(lengths, 30, None)] == [3, 3, 2]
    even = make_batches(lengths, 30, None, workers=2)
    assert [len(b) for b in even] == [2, 2, 2, 2]  # the smallest budget that gives 4 batches: 20 tokens
    assert sorted(i for b in even for i in b) == list(range(8))
    assert make_batches(lengths, 30, None, workers=3) == make_batches(lengths, 30, None)  # 3 batches already
    # 4 + 4 + 1 at 40 tokens takes 5 units on 2 workers; its even cut, 3 + 3 + 3, would take 6: kept as it is
    assert make_batches([10] * 9, 40, None, workers=2) == make_batches([10] * 9, 40, None)
    # 4 batches for 2 workers, yet uneven: 6 | 5 | 4 + 3 (8 padded) | 2 keeps one worker 5 + 8 = 13 units, the
    # other 6 + 2; cut at 6 tokens, 6 | 5 | 4 | 3 + 2 (6) takes 6 + 6 = 12 and 5 + 4
    assert make_batches([6, 5, 4, 3, 2], 8, None) == [[0], [1], [2, 3], [4]]
    assert make_batches([6, 5, 4, 3, 2], 8, None, workers=2) == [[0], [1], [2], [3, 4]]
    lengths = [5, 1, 9, 3, 3, 7, 2, 20, 4, 6, 8]
    for workers in (2, 3, 4):
        batches = make_batches(lengths, 12, 3, workers)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:  # the limits still hold
            assert len(b) <= 3 and (len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 12)


@pytest.mark.precision
def test_int8_quantization_and_bf16_stay_close(ckpt):
    from attnmt.backends import backend_for
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(ckpt)
    src = torch.tensor([bundle.encode_source(SENTENCES[0])])
    prev = torch.tensor([[bundle.symbols.eos] + bundle.encode_source(SENTENCES[1])])
    with torch.no_grad():
        ref = bundle.model(src, torch.tensor([src.size(1)]), prev)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf = bundle.model(src, torch.tensor([src.size(1)]), prev).float()
        q = backend_for("cpu").prepare_inference(bundle.model, "int8")(src, torch.tensor([src.size(1)]), prev)
    scale = ref.abs().max()
    assert float((q - ref).abs().max() / scale) < 0.1
    assert float((bf - ref).abs().max() / scale) < 0.1


# ------------------------------------------------------------------------------------------------ command line


def run_cli(args: list[str], stdin: str = "") -> tuple[str, str]:
    from attnmt.cli import cli

    registry.load_plugins()
    result = CliRunner().invoke(cli, args, input=stdin, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def library_translations(ckpt, lines, **search) -> list[str]:
    bundle, gen = _load(ckpt, **search)
    out = []
    for _, hyps in gen.generate(bundle.encode_sources(lines)):
        out.append(bundle.detokenize(bundle.target_pieces(hyps[0].tokens)))
    return out


def library_hypotheses(ckpt, lines, **search):
    bundle, gen = _load(ckpt, **search)
    return [hyps for _, hyps in gen.generate(bundle.encode_sources(lines))]


def test_cli_generate_raw_input_plain_and_fairseq(ckpt, tmp_path):
    stdin = "\n".join(SENTENCES) + "\n"
    plain, err = run_cli(["generate", "--path", str(ckpt), "--input", "-", "--max-len-b", "12", "--max-tokens", "30"],
                         stdin)
    lines = plain.split("\n")[:-1]
    assert lines == library_translations(ckpt, SENTENCES)
    assert "sentences/s" in err and "target tokens/s" in err

    bundle_dir = tmp_path / "bundle"  # --path may name a directory holding model.pt
    bundle_dir.mkdir()
    shutil.copy(ckpt, bundle_dir / "model.pt")
    fs, _ = run_cli(["generate", "--path", str(bundle_dir), "--input", "-", "--max-len-b", "12",
                     "--format", "fairseq", "--nbest", "2"], stdin)
    rows = [ln.split("\t") for ln in fs.split("\n")[:-1]]
    for i, sentence in enumerate(SENTENCES):
        mine = [r for r in rows if r[0].endswith(f"-{i}")]
        assert [r[0][0] for r in mine] == ["S", "H", "D", "P", "H", "D", "P"]  # no reference for raw input
        assert mine[0][1] == sentence
        assert mine[2][2] == lines[i]  # D- of the best hypothesis = the plain output
        assert float(mine[1][1]) >= float(mine[4][1])
        pos = [float(x) for x in mine[3][1].split()]
        assert float(mine[1][1]) == pytest.approx(sum(pos) / length_penalty(len(pos), 0.6), abs=1e-3)
    best = library_hypotheses(ckpt, SENTENCES[:1])[0][0]  # printed in base 2, as fairseq prints them
    first = [r for r in rows if r[0] == "H-0"][0]
    assert float(first[1]) == pytest.approx(best.score / math.log(2), abs=1e-5)

    # --output writes the same text atomically
    out = tmp_path / "hyp.txt"
    run_cli(["generate", "--path", str(ckpt), "--input", "-", "--max-len-b", "12", "--output", str(out), "--quiet"],
            stdin)
    assert out.read_text(encoding="utf-8") == plain
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _data_bin(ckpt, tmp_path, lines, refs) -> Path:
    """A binarized test split as attnmt preprocess writes it (dictionaries + indexed datasets)."""
    from attnmt.data.indexed import IndexedDatasetBuilder
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(ckpt)
    d = tmp_path / "data-bin"
    d.mkdir()
    bundle.src_dict.save(d / "dict.en.txt")
    bundle.tgt_dict.save(d / "dict.de.txt")
    for lang, texts in (("en", lines), ("de", refs)):
        with IndexedDatasetBuilder(d / f"test.en-de.{lang}", len(bundle.src_dict)) as b:
            for ids in bundle.encode_sources(texts):
                b.add(ids)
    return d


def test_cli_generate_binarized_split(ckpt, tmp_path):
    lines = SENTENCES[:6]
    refs = _lines(6, 7)
    data_bin = _data_bin(ckpt, tmp_path, lines, refs)
    plain, _ = run_cli(["generate", str(data_bin), "--path", str(ckpt), "--max-len-b", "12"])
    assert plain.split("\n")[:-1] == library_translations(ckpt, lines)
    fs, _ = run_cli(["generate", str(data_bin), "--path", str(ckpt), "--max-len-b", "12", "--format", "fairseq"])
    t_lines = [ln.split("\t", 1)[1] for ln in fs.splitlines() if ln.startswith("T-")]
    assert t_lines == refs

    # a data directory binarized with another dictionary is refused
    (data_bin / "dict.en.txt").write_text("foo 3\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"dict\.en\.txt: the source dictionary differs"):
        run_cli(["generate", str(data_bin), "--path", str(ckpt)])


def test_cli_generate_prefix_size_forces_the_references_first_tokens(ckpt, tmp_path):
    """fairseq's --prefix-size N: each hypothesis starts with its reference's first N tokens, as a prefix given to
    the library would make it."""
    from attnmt import Translator

    lines, refs = SENTENCES[:6], _lines(6, 7)
    data_bin = _data_bin(ckpt, tmp_path, lines, refs)
    fs, _ = run_cli(["generate", str(data_bin), "--path", str(ckpt), "--max-len-b", "12", "--format", "fairseq",
                     "--prefix-size", "2"])
    hyps = {int(ln.split("\t")[0][2:]): ln.split("\t")[2].split() for ln in fs.splitlines() if ln.startswith("H-")}
    with Translator(str(ckpt), max_len_b=12) as t:
        for i, ref in enumerate(refs):
            first = t.bundle.tgt_pipeline.encode(ref).split()[:2]
            assert hyps[i][:2] == first
            assert hyps[i] == t.translate(lines[i], prefix=t.bundle.detokenize(" ".join(first)), details=True).tokens[:-1]


def test_cli_generate_print_alignment_hard_and_soft(ckpt, tmp_path):
    """fairseq's A- lines: soft rows are the head-averaged last-layer attention of each target token (final </s>
    included) over the source tokens (</s> included); hard pairs are each row's most attended source token, the
    final </s> of both sides left out (benchmarks/fairseq_generate_compare.sh compares both with fairseq's)."""
    lines = SENTENCES[:4]
    data_bin = _data_bin(ckpt, tmp_path, lines, _lines(4, 7))
    base = ["generate", str(data_bin), "--path", str(ckpt), "--max-len-b", "12", "--format", "fairseq", "--nbest", "2"]
    hard, _ = run_cli([*base, "--print-alignment"])
    soft, _ = run_cli([*base, "--print-alignment", "soft"])
    plain, _ = run_cli(base)
    strip = [ln for ln in hard.splitlines() if not ln.startswith("A-")]
    assert strip == plain.splitlines()  # the alignment adds lines, changes none
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(ckpt)
    n_src = [len(ids) for ids in bundle.encode_sources(lines)]  # final </s> included
    tagged = [ln.split("\t") for ln in hard.splitlines()]
    hard_rows = [(t, f[-1]) for t, f in zip(hard.splitlines(), tagged) if t.startswith("A-")]
    soft_rows = [ln.split("\t")[1] for ln in soft.splitlines() if ln.startswith("A-")]
    p_rows = [ln.split("\t")[1].split() for ln in hard.splitlines() if ln.startswith("P-")]
    assert len(hard_rows) == len(soft_rows) == len(p_rows) == 8  # one per hypothesis, after its P- line
    assert all(a.startswith("A-") and b.startswith("P-") for a, b in zip(hard.splitlines()[1:], hard.splitlines())
               if a.startswith("A-"))
    for (line, pairs), weights, p in zip(hard_rows, soft_rows, p_rows):
        i = int(line.split("\t")[0][2:])
        rows = [[float(x) for x in row.split(",")] for row in weights.split()]
        assert len(rows) == len(p) and all(len(r) == n_src[i] for r in rows)  # T x S, </s> on both sides
        assert all(abs(sum(r) - 1) < 1e-4 for r in rows)
        expected = [f"{max(range(n_src[i] - 1), key=lambda s: r[s])}-{t}" for t, r in enumerate(rows[:-1])]
        assert pairs.split() == expected
    with pytest.raises(UserError, match="--print-alignment writes fairseq's A- lines, which only --format fairseq"):
        run_cli(["generate", str(data_bin), "--path", str(ckpt), "--print-alignment"])


def test_cli_generate_score_reference_equals_the_searchs_own_scores(ckpt, tmp_path):
    """fairseq's --score-reference: the references become the hypotheses, scored by forced decoding. With the
    search's own best hypotheses as references, the P- lines are the search's per-token scores (computed step by
    step there, in one pass here) and H- is their mean (fairseq's SequenceScorer), in base 2."""
    from attnmt.data.indexed import IndexedDatasetBuilder
    from attnmt.inference import load_for_inference

    lines = SENTENCES[:5]
    best = [h[0] for h in library_hypotheses(ckpt, lines)]
    bundle = load_for_inference(ckpt)
    d = tmp_path / "data-bin"
    d.mkdir()
    bundle.src_dict.save(d / "dict.en.txt")
    bundle.tgt_dict.save(d / "dict.de.txt")
    for lang, rows in (("en", bundle.encode_sources(lines)), ("de", [h.tokens for h in best])):
        with IndexedDatasetBuilder(d / f"test.en-de.{lang}", len(bundle.src_dict)) as b:
            for ids in rows:
                b.add(ids)
    out, _ = run_cli(["generate", str(d), "--path", str(ckpt), "--score-reference", "--format", "fairseq"])
    rows = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in out.splitlines()}
    for i, h in enumerate(best):
        p = [float(x) for x in rows[f"P-{i}"][0].split()]
        assert p == pytest.approx([x / math.log(2) for x in h.positional_scores], abs=2e-4)
        assert float(rows[f"H-{i}"][0]) == pytest.approx(sum(p) / len(p), abs=1e-4)
        assert rows[f"D-{i}"][1] == bundle.detokenize(bundle.target_pieces(h.tokens))
    with pytest.raises(UserError, match="--score-reference scores the references of a binarized split, and --input "
                                        "has none"):
        run_cli(["generate", "--path", str(ckpt), "--input", "-", "--score-reference"], "a dog\n")


def test_cli_generate_skip_invalid_size_inputs(ckpt, tmp_path):
    """fairseq's --skip-invalid-size-inputs-valid-test: an overlong sentence is left out and named, not refused."""
    long = " ".join(WORDS * 20)
    lines = [SENTENCES[0], long, SENTENCES[1]]
    data_bin = _data_bin(ckpt, tmp_path, lines, _lines(3, 7))
    args = ["generate", str(data_bin), "--path", str(ckpt), "--max-len-b", "12", "--format", "fairseq"]
    with pytest.raises(UserError, match=r"test:2: the source has \d+ tokens but the model accepts at most 96"):
        run_cli(args)
    out, err = run_cli([*args, "--skip-invalid-size-inputs-valid-test", "--fairseq"])
    assert "1 sentence(s) longer than the model accepts (96 source tokens) skipped" in err and "ids 1" in err
    assert sorted(ln.split("\t")[0] for ln in out.splitlines() if ln[:2] in ("S-", "D-")) == ["D-0", "D-2", "S-0", "S-2"]
    assert out.splitlines()[-1].startswith("Generate test with beam=5: BLEU4 = ")


@pytest.mark.precision
def test_cli_options_and_errors(ckpt, tmp_path):
    stdin = "\n".join(SENTENCES[:5]) + "\n"
    base = ["generate", "--path", str(ckpt), "--input", "-", "--max-len-b", "8"]
    # sampling is reproducible and does not depend on batching
    a, _ = run_cli(base + ["--sampling", "--seed", "3", "--max-tokens", "8"], stdin)
    b, _ = run_cli(base + ["--sampling", "--seed", "3"], stdin)
    assert a == b and len(a.splitlines()) == 5
    bf, _ = run_cli(base + ["--precision", "auto"], stdin)
    q, _ = run_cli(base + ["--quantize", "int8", "--threads", "1"], stdin)
    q_auto, _ = run_cli(base + ["--quantize", "int8", "--precision", "auto", "--threads", "1"], stdin)
    assert len(bf.splitlines()) == len(q.splitlines()) == len(q_auto.splitlines()) == 5
    long_line = " ".join(["water"] * 100)
    with pytest.raises(UserError, match=r"stdin:2: the source has \d+ tokens but the model accepts at most 96"):
        run_cli(base, f"Dog.\n{long_line}\n")
    out, _ = run_cli(base + ["--truncate-source"], f"Dog.\n{long_line}\n")
    assert len(out.splitlines()) == 2
    with pytest.raises(UserError, match="--nbest must be between 1 and --beam"):
        run_cli(base + ["--nbest", "5"], stdin)
    with pytest.raises(UserError, match="give either DATA_BIN"):
        run_cli(["generate", str(tmp_path), "--path", str(ckpt), "--input", "-"])
    with pytest.raises(UserError, match="nothing to translate"):
        run_cli(["generate", "--path", str(ckpt)])
    with pytest.raises(UserError, match="no such checkpoint"):
        run_cli(["generate", "--path", str(tmp_path / "missing.pt"), "--input", "-"])
    with pytest.raises(UserError, match="without model.pt"):
        run_cli(["generate", "--path", str(tmp_path), "--input", "-"])


def test_cli_translate_through_a_pipe(ckpt):
    stdin = "\n".join(SENTENCES) + "\n"
    proc = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt), "--max-len-b", "12",
                           "--buffer-size", "5", "--threads", "1"], input=stdin, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == library_translations(ckpt, SENTENCES)
    # the same through the in-process runner (a stream without a file descriptor)
    out, _ = run_cli(["translate", "--path", str(ckpt), "--max-len-b", "12", "--buffer-size", "3"], stdin)
    assert out == proc.stdout


def test_line_batches_answers_without_waiting_for_more_input():
    from attnmt.cli.translate import line_batches

    r, w = os.pipe()
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("line_batches waited for input that never came"))
    signal.alarm(10)
    try:
        with os.fdopen(r, "rb", buffering=0) as rf:
            batches = line_batches(rf, limit=3)
            os.write(w, b"eins\nzwei\n")
            assert next(batches) == ["eins", "zwei"]
            os.write(w, b"drei\n")
            assert next(batches) == ["drei"]
            os.write(w, b"a\nb\nc\nd\r\ne")
            assert next(batches) == ["a", "b", "c"]
            assert next(batches) == ["d"]
            u = "ü".encode()  # a character split across two reads
            os.write(w, u[:1])
            os.write(w, u[1:] + b"\n")
            assert next(batches) == ["eü"]
            os.close(w)
            w = None
            assert list(batches) == []
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        if w is not None:
            os.close(w)


def _load_workers(ckpt, workers: int, threads: int | None = None, **search):
    from attnmt.inference import load_generator

    cfg = SearchConfig(**{"max_len_b": 12, **search})
    return load_generator(ckpt, cfg, GenerationConfig(device="cpu", workers=workers, threads=threads or workers))


def test_workers_translate_as_one_process_does(ckpt):
    """--workers: the same hypotheses and scores, in input order, whichever process translated which batch."""
    bundle, one = _load(ckpt, beam=4, nbest=2)
    sources = bundle.encode_sources(SENTENCES * 3)
    expected = list(one.generate(sources, max_tokens=40))
    _, gen = _load_workers(ckpt, 2, beam=4, nbest=2)
    try:
        assert len(gen.pool) == 2 and gen.pool.threads == 1
        assert len(make_batches([len(s) for s in sources], 40, None)) > 4
        got = list(gen.generate(sources, max_tokens=40))
        assert [i for i, _ in got] == list(range(len(sources)))
        for (_, h), (_, e) in zip(got, expected):
            assert [x.tokens for x in h] == [x.tokens for x in e]
            assert [x.score for x in h] == [x.score for x in e]
        assert gen.stats.sentences == len(sources) and gen.stats.seconds > 0
        assert len(gen.pool.peak_rss_mb) == 2  # both workers took batches

        # a run abandoned half-way leaves results behind in the queue; the next run must not pick them up
        next(iter(gen.generate(sources, max_tokens=40)))
        again = list(gen.generate(sources[::-1], max_tokens=40))
        assert [x[1][0].tokens for x in again] == [x[1][0].tokens for x in expected[::-1]]
    finally:
        gen.close()
    assert gen.pool is None


def test_workers_report_a_dead_worker_and_refuse_gpus(ckpt):
    _, gen = _load_workers(ckpt, 2)
    try:
        victim = gen.pool.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(UserError, match=r"decoding worker attnmt-decoder-0 stopped \(exit code -9\).*fewer "
                                            r"--workers"):
            list(gen.generate(_bundle_sources(ckpt), max_tokens=20))
    finally:
        gen.close()
    # an error inside a worker's search comes back with its traceback; the busy workers are stopped at once
    gen.search_batch = lambda sources, ids, guide=None: 1 / 0
    gen.start_workers(2, 1)
    with pytest.raises(RuntimeError, match=r"(?s)decoding worker \d+ failed.*ZeroDivisionError"):
        list(gen.generate(_bundle_sources(ckpt), max_tokens=20))
    procs = gen.pool.procs
    gen.close()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(UserError, match="--workers runs several decoding processes on the CPU"):
        Generator(gen.model, gen.symbols, gen.search_cfg, backend_for("meta")).start_workers(2, 1)
    with pytest.raises(ValueError, match="--workers must be positive"):
        GenerationConfig(workers=0)


def test_workers_of_several_threads_load_their_own_model(ckpt, tmp_path):
    """Workers of 2 threads each are spawned (a forked child hangs in its first multi-threaded OpenMP region once
    the parent has run one), after the parent has run such regions itself."""
    from attnmt.generation.workers import WorkerPool
    from attnmt.inference import load_worker_generator

    torch.set_num_threads(2)
    torch.randn(512, 512).exp().sum()  # a multi-threaded OpenMP region in this process
    bundle, one = _load(ckpt, beam=4)
    sources = bundle.encode_sources(SENTENCES * 2)
    expected = [h[0].tokens for _, h in one.generate(sources, max_tokens=40)]
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("workers of several threads hung"))
    signal.alarm(300)
    try:
        bundle, gen = _load_workers(ckpt, 2, beam=4, threads=4)
        try:
            assert gen.pool.threads == 2
            assert [h[0].tokens for _, h in gen.generate(sources, max_tokens=40)] == expected
        finally:
            gen.close()
        missing = functools.partial(load_worker_generator, str(tmp_path / "missing.pt"), gen.search_cfg,
                                    GenerationConfig(device="cpu"), 2)
        with pytest.raises(UserError, match=r"could not load the model: .*no such checkpoint"):
            WorkerPool(gen.search_batch, 2, 2, missing)
        with pytest.raises(ValueError, match="load="):
            WorkerPool(gen.search_batch, 2, 2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _bundle_sources(ckpt) -> list[list[int]]:
    from attnmt.inference import load_for_inference

    return load_for_inference(ckpt).encode_sources(SENTENCES)


def test_cli_generate_and_translate_with_workers(ckpt):
    stdin = "\n".join(SENTENCES) + "\n"
    base = ["--path", str(ckpt), "--max-len-b", "12", "--max-tokens", "30", "--device", "cpu"]  # workers: CPU only
    plain, _ = run_cli(["generate", "--input", "-", *base], stdin)
    two, err = run_cli(["generate", "--input", "-", *base, "--workers", "2", "--threads", "2"], stdin)
    assert two == plain and "sentences/s" in err
    proc = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", *base, "--workers", "2", "--threads", "2",
                           "--buffer-size", "5"], input=stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain


def test_generator_refuses_overlong_sources_with_line_number(ckpt):
    bundle, gen = _load(ckpt)
    too_long = [5] * 100 + [bundle.symbols.eos]
    with pytest.raises(UserError, match="input:3:"):
        list(Generator(bundle.model, bundle.symbols, gen.search_cfg, max_source_positions=96).generate(
            [[5, 2], [6, 2], too_long]))


@pytest.mark.slow
def test_train_then_generate_translates_the_toy_task(tmp_path):
    """attnmt train on a learnable toy task, then attnmt generate on its valid split: high BLEU, also in int8."""
    from helpers import TINY_MODEL, make_data_bin

    from attnmt.cli import main
    from attnmt.scoring import corpus_bleu

    data = make_data_bin(tmp_path / "bin", n_train=2000)
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
          "--save-dir", str(ck), "--max-tokens", "512", "--max-update", "1500", "--lr", "5e-3",
          "--warmup-updates", "50", "--dropout", "0.0", "--progress", "lines", "--threads", "1"])
    scores = {}
    for name, extra in (("fp32", []), ("greedy", ["--beam", "1"]), ("int8", ["--quantize", "int8"])):
        out, _ = run_cli(["generate", str(data), "--path", str(ck / "checkpoint_best.pt"), "--gen-subset", "valid",
                          "--format", "fairseq", "--quiet", *extra])
        rows = [ln.split("\t") for ln in out.splitlines()]
        refs = [r[1] for r in rows if r[0].startswith("T-")]
        hyps = [r[2] for r in rows if r[0].startswith("D-")]
        assert len(refs) == len(hyps) == 24
        scores[name] = corpus_bleu(hyps, refs).score
    assert scores["fp32"] > 80, scores
    assert scores["fp32"] >= scores["greedy"] - 1, scores
    assert scores["int8"] > 80, scores  # per-tensor int8 weights cost a tiny d=32 model a few points


@pytest.mark.precision
def test_generate_bf16_without_native_bf16_is_a_one_line_error(ckpt, no_native_bf16):
    base = ["generate", "--path", str(ckpt), "--input", "-", "--max-len-b", "8"]
    with pytest.raises(UserError, match=r"--bf16: no native bf16 on this CPU \(ATTNMT_CPU_BF16=0 is set\)"):
        run_cli(base + ["--bf16"], SENTENCES[0] + "\n")
    out, _ = run_cli(base + ["--precision", "auto"], SENTENCES[0] + "\n")  # fp32 here
    assert len(out.splitlines()) == 1


SEARCH_PLUGIN = '''
import dataclasses
from dataclasses import dataclass, field

from attnmt.generation.beam import greedy_search
from attnmt.generation.search import SearchStrategy
from attnmt.registry import register


@dataclass
class FirstTokensConfig:
    first_tokens: int = field(default=1, metadata={"help": "how many tokens to keep"})


@register("search", "first_tokens", config=FirstTokensConfig)
class FirstTokens(SearchStrategy):
    """Greedy decoding of the first --first-tokens tokens only."""

    def __call__(self, model, src_tokens, src_lengths, sym, sample_ids=None, kernels=None):
        n = self.cfg.options.first_tokens
        cfg = dataclasses.replace(self.cfg, beam=1, max_len_a=0.0, max_len_b=n, options=None)
        return greedy_search(model, src_tokens, src_lengths, cfg, sym, kernels=kernels)
'''


def test_search_strategy_from_user_dir(ckpt, tmp_path):
    """A plugin registers a search strategy with its own option; --search picks it; options of other strategies
    are refused with the strategy they belong to."""
    plugin = tmp_path / "first_tokens.py"
    plugin.write_text(SEARCH_PLUGIN)
    stdin = "\n".join(SENTENCES[:6]) + "\n"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "--user-dir", str(plugin), "translate", "--path",
                        str(ckpt), "--search", "first_tokens", "--first-tokens", "2"], input=stdin,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == library_translations(ckpt, SENTENCES[:6], beam=1, max_len_a=0.0, max_len_b=2)
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "--user-dir", str(plugin), "translate", "--path",
                        str(ckpt), "--search", "first_tokens", "--early-stop", "beam"], input=stdin,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--early-stop is an option of --search beam or constrained, not of --search first_tokens" in r.stderr


STEP_PLUGIN = '''
import torch

from attnmt.generation.search import SearchStrategy
from attnmt.registry import register


@register("search", "step_greedy")
class StepGreedy(SearchStrategy):
    """Greedy decoding written as a step only: the two best tokens of each row."""

    def rows_per_unit(self):
        return 1

    def step(self, step, lprobs, scores):
        lp, tok = lprobs.topk(2, dim=1)
        return scores[:, None] + lp, lp, torch.zeros_like(tok), tok
'''


def test_a_search_plugin_with_a_step_function_only_runs_the_one_search_loop(ckpt, tmp_path):
    """A strategy that defines only ``step`` gets the loop's finishing, early stop and reordering: written as
    greedy decoding, it translates as --beam 1 does."""
    plugin = tmp_path / "step_greedy.py"
    plugin.write_text(STEP_PLUGIN)
    stdin = "\n".join(SENTENCES[:6]) + "\n"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "--user-dir", str(plugin), "translate", "--path",
                        str(ckpt), "--search", "step_greedy"], input=stdin, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    greedy = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt), "--beam", "1"],
                            input=stdin, capture_output=True, text=True)
    assert greedy.returncode == 0, greedy.stderr
    assert r.stdout.splitlines() == greedy.stdout.splitlines() and len(greedy.stdout.splitlines()) == 6


def test_generate_takes_fairseqs_results_path_and_language_options(ckpt, tmp_path):
    lines = _lines(5, 51)
    src = tmp_path / "in.en"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out, _ = run_cli(["generate", "--path", str(ckpt), "--input", str(src), "--max-len-b", "12", "-s", "en", "-t",
                      "de", "--results-path", str(tmp_path / "res"), "--quiet"])
    assert out == ""
    assert (tmp_path / "res" / "generate-input.txt").read_text(encoding="utf-8").splitlines() == \
        library_translations(ckpt, lines)
    with pytest.raises(UserError, match=r"-s de: .* translates en->de \(a model translates one direction\)"):
        run_cli(["generate", "--path", str(ckpt), "--input", str(src), "-s", "de"])
    with pytest.raises(UserError, match="--results-path .* and --output .* both say where to write"):
        run_cli(["generate", "--path", str(ckpt), "--input", str(src), "--results-path", str(tmp_path),
                 "--output", str(tmp_path / "x.txt")])
