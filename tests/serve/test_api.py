"""The Python API (``from attnmt import Translator``): the command's translations, raw strings in, scores against
an independent teacher-forced computation, and the command's one-line errors as exceptions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, sentence_lines

from attnmt.errors import UserError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def translator(ckpt):
    from attnmt import Translator

    with Translator(str(ckpt), max_len_b=12, threads=1) as t:
        yield t


def cli_translate(ckpt: Path, lines: list[str], *options: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt), "--quiet",
                           "--threads", "1", *options], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")[:-1]


def test_translate_gives_the_commands_translations(translator, ckpt):
    lines = sentence_lines(40, 7)
    assert translator.translate(lines) == cli_translate(ckpt, lines, "--max-len-b", "12")
    # one string in, one string out
    assert translator.translate(lines[3]) == translator.translate(lines)[3]


def test_blank_lines_translate_to_blank_lines(translator, ckpt):
    lines = sentence_lines(2, 9)
    mixed = ["", lines[0], "   ", lines[1], ""]
    want = ["", translator.translate(lines[0]), "", translator.translate(lines[1]), ""]
    assert translator.translate(mixed) == want
    assert cli_translate(ckpt, mixed, "--max-len-b", "12") == want
    t = translator.translate("  ", details=True)
    assert (t.text, t.score, t.positional_scores, [h.text for h in t.hypotheses]) == ("", 0.0, [0.0], [""])
    assert translator.translate("", nbest=3) == ["", "", ""]


def test_search_options_per_call_equal_options_at_load(translator, ckpt):
    from attnmt import Translator

    lines = sentence_lines(12, 8)
    with Translator(str(ckpt), max_len_b=12, beam=2, lenpen=1.0, threads=1) as other:
        expected = other.translate(lines)
    assert translator.translate(lines, beam=2, lenpen=1.0) == expected
    assert translator.translate(lines, beam=2, lenpen=1.0) == cli_translate(ckpt, lines, "--max-len-b", "12",
                                                                              "--beam", "2", "--lenpen", "1.0")
    # the loaded options are untouched by a call's
    assert translator.search_cfg.beam == 4


def test_nbest_and_details(translator):
    from attnmt.generation.search import length_penalty

    lines = sentence_lines(6, 9)
    nbest = translator.translate(lines, nbest=3)
    assert all(isinstance(n, list) and len(n) == 3 for n in nbest)
    details = translator.translate(lines, nbest=3, details=True)
    for plain, d in zip(nbest, details):
        assert [h.text for h in d.hypotheses] == plain
        assert d.text == plain[0]
        scores = [h.score for h in d.hypotheses]
        assert scores == sorted(scores, reverse=True)
        for h in d.hypotheses:
            assert h.tokens[-1] == "</s>" and len(h.tokens) == len(h.positional_scores)
            # the search's score is the log-probability over the paper's length penalty (alpha 0.6)
            assert h.score == pytest.approx(sum(h.positional_scores) / length_penalty(len(h.tokens), 0.6),
                                            rel=1e-5)


def teacher_forced(ckpt: Path, source: str, reference: str) -> list[float]:
    """Per-token log-probabilities of ``reference``, computed from the model's training forward pass."""
    from attnmt.inference import load_for_inference

    b = load_for_inference(ckpt)
    src = torch.tensor([b.encode_source(source)])
    tgt = b.tgt_dict.encode_line(b.tgt_pipeline.encode(reference))
    prev = torch.tensor([[b.symbols.eos] + tgt[:-1]])
    with torch.no_grad():
        logits = b.model(src, torch.tensor([src.shape[1]]), prev)
    lp = torch.log_softmax(logits.float(), -1)[0]
    return [float(lp[t, k]) for t, k in enumerate(tgt)]


def test_score_equals_the_training_forward_pass(translator, ckpt):
    sources = sentence_lines(5, 10)
    references = sentence_lines(5, 11)
    scored = translator.score(sources, references)
    for s, r, got in zip(sources, references, scored):
        expected = teacher_forced(ckpt, s, r)
        assert got.positional_scores == pytest.approx(expected, abs=1e-4)
        assert got.logprob == pytest.approx(sum(expected), abs=1e-3)
        assert got.score == pytest.approx(sum(expected) / len(expected), abs=1e-4)


def test_forced_scores_of_the_models_own_translations_equal_the_search_scores(translator):
    lines = sentence_lines(8, 12)
    hyps = translator.translate(lines, details=True)
    tgt = translator.bundle.tgt_dict
    scored = translator.score_encoded(translator.encode_batch(lines), [[tgt.index(p) for p in h.tokens] for h in hyps])
    for h, s in zip(hyps, scored):
        assert s == pytest.approx(h.positional_scores, abs=1e-4)


def test_alignment_rows_are_attention_distributions(translator):
    line = sentence_lines(1, 13)[0]
    t = translator.translate(line, alignment=True)
    a = t.alignment
    assert a.target_tokens == t.tokens
    assert a.source_tokens[-1] == "</s>" and len(a.source_tokens) == len(translator.encode(line))
    assert len(a.weights) == len(a.target_tokens) and all(len(r) == len(a.source_tokens) for r in a.weights)
    assert all(sum(r) == pytest.approx(1.0, abs=1e-4) for r in a.weights)


@pytest.mark.parametrize("call, message", [
    (lambda t: t.translate(42), "sources: expected a list of strings, got int"),
    (lambda t: t.translate(["ok", 3]), r"sources\[1\]: expected a string, got int"),
    (lambda t: t.translate([b"bytes"]), r"sources\[0\]: expected a string, got bytes; decode bytes to str first"),
    (lambda t: t.translate(["two\nlines"]), r"sources\[0\]: a sentence spans several lines"),
    (lambda t: t.translate(["x"], bem=2), "translate: unknown option bem; valid: beam,"),
    (lambda t: t.translate(["x"], nbest=9), r"--nbest must be between 1 and --beam \(4\)"),
    (lambda t: t.translate(["x"], beam=0), "--beam"),
    (lambda t: t.translate(["word " * 120]), r"sources\[0\]: the source has \d+ tokens but the model accepts at most 96"),
    (lambda t: t.score(["a"], ["b", "c"]), "score: 1 sources but 2 references"),
])
def test_bad_input_raises_the_commands_message(translator, call, message):
    with pytest.raises(UserError, match=message):
        call(translator)


def test_bad_options_and_paths_at_load(ckpt, tmp_path):
    from attnmt import Translator

    with pytest.raises(UserError, match="Translator: unknown option beem"):
        Translator(str(ckpt), beem=3)
    with pytest.raises(UserError, match="no such checkpoint file"):
        Translator(str(tmp_path / "missing.pt"))
    with pytest.raises(UserError, match="--quantize int8 runs on the CPU only"):
        Translator(str(ckpt), quantize="int8", device="cuda")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=str(bad)):
        Translator(str(bad))


def test_a_closed_translator_refuses_work(ckpt):
    from attnmt import Translator

    t = Translator(str(ckpt), max_len_b=12, threads=1)
    assert t.translate("A dog.")
    t.close()
    with pytest.raises(UserError, match="this Translator was closed"):
        t.translate("A dog.")


def test_the_package_exports_the_api_without_loading_torch():
    code = ("import sys, attnmt; assert 'torch' not in sys.modules; from attnmt import Translator, UserError; "
            "print(Translator.__module__, UserError.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["attnmt.api", "UserError"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_api_and_the_service_give_the_commands_translations(ckpt):
    from service import Service

    from attnmt import Translator

    lines = sentence_lines(24, 41)
    with Translator(str(ckpt), max_len_b=12, device="cuda") as t:
        assert t.device.type == "cuda"
        got = t.translate(lines)
        scored = t.score(lines[:4], sentence_lines(4, 42))
    assert got == cli_translate(ckpt, lines, "--max-len-b", "12", "--device", "cuda")
    assert all(s.logprob <= 0 for s in scored)
    s = Service(ckpt, "--max-len-b", "12", "--device", "cuda")
    try:
        status, body, _ = s.request("/translate", {"q": lines[:8], "source": "en", "target": "de"})
        assert (status, body) == (200, {"translatedText": got[:8]})
        assert s.request("/metrics?format=json")[1]["service"]["device"].startswith("cuda")
    finally:
        assert s.stop() == 0


def continuous_translate(translator, lines: list[str], joining: int = 3) -> list[object]:
    """Translate ``lines`` through one continuous search, ``joining`` sentences joining at each step."""
    ids = translator.encode_batch(lines)
    stream = translator.continuous_search(nbest=2)
    got: dict[int, object] = {}
    for i in range(0, len(ids), joining):
        stream.add(ids[i:i + joining], range(i, min(i + joining, len(ids))))
        for k, hyps in stream.step():
            got[k] = translator.finish(ids[k], hyps, details=True, nbest=2)
    while stream.size:
        for k, hyps in stream.step():
            got[k] = translator.finish(ids[k], hyps, details=True, nbest=2)
    return [got[i] for i in range(len(lines))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_a_continuous_search_gives_translates_results(ckpt):
    """The pool of places, per-sentence positions and the fused attention on CUDA tensors: the static search's
    hypotheses and scores (fp32; bf16 rounds with the rows around it, as on the CPU)."""
    from attnmt import Translator

    lines = sentence_lines(30, 43)
    with Translator(str(ckpt), max_len_b=12, device="cuda", precision="fp32") as t:
        got = continuous_translate(t, lines)
        want = t.translate(lines, nbest=2, details=True)
    assert [[h.text for h in g.hypotheses] for g in got] == [[h.text for h in w.hypotheses] for w in want]
    assert [g.score for g in got] == pytest.approx([w.score for w in want], abs=1e-4)


def test_a_continuous_search_gives_translates_results(translator):
    lines = sentence_lines(20, 31)
    got = continuous_translate(translator, lines)  # three sentences join at each step
    want = translator.translate(lines, nbest=2, details=True)
    assert [[h.text for h in g.hypotheses] for g in got] == [[h.text for h in w.hypotheses] for w in want]
    assert [g.score for g in got] == pytest.approx([w.score for w in want], abs=1e-5)
    with pytest.raises(UserError, match="continuous batching does not take the sampling search"):
        translator.continuous_search(sampling=True)
