"""Decoding a translator can steer, on a real (tiny, random) Transformer: forced target prefixes, lexical
constraints (every hypothesis holds every phrase), suppressed sequences, --disable-unk, --repetition-penalty and
CTranslate2-style alternatives; each through the API and the command lines, with their one-line errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, sentence_lines

from attnmt.errors import UserError
from attnmt.generation.constrained import Automaton
from attnmt.generation.search import Guidance, SearchConfig, Symbols, step_log_probs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("steer"))


@pytest.fixture(scope="module")
def translator(ckpt):
    from attnmt import Translator

    with Translator(str(ckpt), max_len_b=16, threads=1, beam=4) as t:
        yield t


LINES = sentence_lines(8, 3)
WORDS = ["dog", "red", "a man", "house", "the"]


def ids_of(t, text: str) -> list[int]:
    return t.bundle.tgt_dict.encode_line(t.bundle.tgt_pipeline.encode(text), append_eos=False)


def holds(tokens: list[int], phrase: list[int]) -> bool:
    n = len(phrase)
    return any(tokens[i:i + n] == phrase for i in range(len(tokens) - n + 1))


def test_a_prefix_comes_out_verbatim_with_the_models_log_probabilities(translator):
    t = translator
    prefixes = ["the dog", None, "a", "", "red house", "the", "a man", "dog"]
    got = t.translate(LINES, prefix=prefixes, details=True)
    for line, p, r in zip(LINES, prefixes, got):
        ids = ids_of(t, p) if p else []
        toks = [t.bundle.tgt_dict.index(x) for x in r.tokens]
        assert toks[:len(ids)] == ids
        if ids:  # each forced token keeps the log-probability the model gives it (fairseq's --prefix-size)
            ref = t.score([line], [p])[0].positional_scores[:len(ids)]
            assert r.positional_scores[:len(ids)] == pytest.approx(ref, abs=1e-4)
    free = t.translate(LINES)
    assert got[1].text == free[1] and got[3].text == free[3]  # no prefix: the free translation


def test_every_hypothesis_holds_every_constraint_and_a_batch_changes_nothing(translator):
    t = translator
    cons = [[WORDS[i % 5]] + ([WORDS[(i + 2) % 5]] if i % 2 else []) for i in range(len(LINES))]
    for order in ("unordered", "ordered"):
        got = t.translate(LINES, constraints=cons, constraint_order=order, nbest=2, details=True)
        for c, r in zip(cons, got):
            assert r.hypotheses, "a constrained sentence got no hypothesis"
            for h in r.hypotheses:
                toks = [t.bundle.tgt_dict.index(x) for x in h.tokens]
                assert all(holds(toks, ids_of(t, p)) for p in c), (c, h.tokens)
        alone = [t.translate(line, constraints=c, constraint_order=order) for line, c in zip(LINES, cons)]
        assert [r.text for r in got] == alone


def test_ordered_constraints_keep_their_order(translator):
    t = translator
    r = t.translate(LINES[0], constraints=["house", "dog"], constraint_order="ordered", details=True)
    toks = [t.bundle.tgt_dict.index(x) for x in r.tokens]
    first = next(i for i in range(len(toks)) if holds(toks[:i + 3], ids_of(t, "house")))
    assert holds(toks[first:], ids_of(t, "dog"))


def test_the_constrained_search_without_constraints_is_beam_search(translator):
    from attnmt.generation.search import search

    t = translator
    g = t.generator
    src = t.encode_batch(LINES)
    from attnmt.generation.generator import collate

    tokens, lengths = collate(src, g.symbols.pad, g.device)
    for stop in ("beam", "exact"):
        from attnmt.generation.options import search_config

        base = search_config({"beam": 4, "max_len_b": 16, "early_stop": stop, "nbest": 2})
        con = search_config({"beam": 4, "max_len_b": 16, "early_stop": stop, "nbest": 2, "search": "constrained"})
        with torch.inference_mode():
            a = search(g.model, tokens, lengths, base, g.symbols)
            b = search(g.model, tokens, lengths, con, g.symbols)
        assert [[h.tokens for h in x] for x in a] == [[h.tokens for h in x] for x in b]


def test_compiled_constraints_follow_fairseqs_meaning():
    # unordered: "1 2" and "3"; a phrase cut off by another token starts over
    m = Automaton.compile([[1, 2], [3]], "unordered")
    s, path = 0, []
    for tok in [1, 5, 1, 2, 3]:
        s = m.table[s][m.tokens.index(tok) if tok in m.tokens else len(m.tokens)]
        path.append((m.bank[s], m.finished[s]))
    assert path == [(1, False), (0, False), (1, False), (2, False), (3, True)]
    # ordered: "3" must come after "1 2"
    m = Automaton.compile([[1, 2], [3]], "ordered")
    s = 0
    for tok in [3, 1, 2]:
        s = m.table[s][m.tokens.index(tok)]
    assert (m.bank[s], m.finished[s]) == (2, False)
    assert m.advancing[s] == [1, 3]


def test_suppressed_sequences_never_appear_and_unk_can_be_disabled(translator):
    t = translator
    free = t.translate(LINES, details=True)
    # the most frequent pair of tokens of the free translations, suppressed as text
    seen: dict[tuple, int] = {}
    for r in free:
        for a, b in zip(r.tokens, r.tokens[1:]):
            seen[(a, b)] = seen.get((a, b), 0) + 1
    pair = max(seen, key=seen.get)
    text = t.bundle.detokenize(" ".join(pair))
    if not text.strip():
        pytest.skip("the most frequent pair is blank text")
    banned = ids_of(t, text)
    got = t.translate(LINES, suppress=[text], details=True)
    for r in got:
        assert not holds([t.bundle.tgt_dict.index(x) for x in r.tokens], banned)
    # the same sequence as token ids (transformers' bad_words_ids): the same translations
    assert [r.tokens for r in t.translate(LINES, suppress=[banned], details=True)] == [r.tokens for r in got]
    with pytest.raises(UserError, match="suppress: give texts or lists of token ids"):
        t.translate(LINES[0], suppress=[3.5])
    unk = t.bundle.tgt_dict.unk_word if hasattr(t.bundle.tgt_dict, "unk_word") else "<unk>"
    for r in t.translate(LINES, disable_unk=True, details=True):
        assert unk not in r.tokens


def test_repetition_penalty_is_ctrls_on_the_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.1, -3.0]])
    gen = torch.tensor([[0, 1]])
    sym = Symbols(eos=4, pad=3, unk=2)
    cfg = SearchConfig(repetition_penalty=2.0, min_len=0)
    got = step_log_probs(logits, 2, torch.tensor([10]), gen, cfg, sym)
    want = torch.log_softmax(torch.tensor([[1.0, -2.0, 0.5, 0.1, -3.0]]), dim=-1)
    want[0, 3] = -math.inf
    assert torch.allclose(got, want)


def test_alternatives_are_the_best_next_tokens_after_the_prefix(translator):
    t = translator
    alts = t.translate(LINES[0], prefix="the", return_alternatives=True, nbest=3, details=True)
    hyps = alts.hypotheses
    assert len(hyps) == 3
    p = ids_of(t, "the")
    toks = [[t.bundle.tgt_dict.index(x) for x in h.tokens] for h in hyps]
    assert all(x[:len(p)] == p for x in toks)
    nxt = [x[len(p)] for x in toks]
    assert len(set(nxt)) == 3
    # in the order of the next token's probability: its positional score
    lp = [h.positional_scores[len(p)] for h in hyps]
    assert lp == sorted(lp, reverse=True)
    # each alternative is the search's continuation of prefix + its token
    src = t.encode(LINES[0])
    for x in toks:
        guide = Guidance(prefixes=[x[:len(p) + 1]])
        assert [h[0].tokens for _, h in t.generator.generate([src], guide=guide)] == [x]


def test_bad_guidance_is_one_line_naming_the_item(translator):
    t = translator
    with pytest.raises(UserError, match=r"prefix\[0\]: 'qqqzzz' has pieces the model's target vocabulary does not"):
        t.translate(LINES[0], prefix="qqqzzz")
    with pytest.raises(UserError, match=r"sources:1: the constraints need 30 target tokens but at most 5 may be generated"):
        t.translate("A.", constraints=["dog house red the a man dog house"], max_len_b=1)
    with pytest.raises(UserError, match="expected a list of 2"):
        t.translate(LINES[:2], constraints=[["dog"]])
    with pytest.raises(UserError, match="constraint_order must be one of"):
        t.translate(LINES[0], constraints=["dog"], constraint_order="sideways")
    with pytest.raises(UserError, match="searched by beam search, not --search sampling"):
        t.translate(LINES[0], constraints=["dog"], sampling=True)
    with pytest.raises(UserError, match="--repetition-penalty must be a positive number"):
        t.translate(LINES[0], repetition_penalty=0.0)


def run(*args, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnmt.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_the_command_lines_read_fairseqs_tab_fields(ckpt, translator):
    t = translator
    lines = [f"{LINES[0]}\tdog\tred", f"{LINES[1]}\thouse"]
    r = run("interactive", "--path", str(ckpt), "--constraints", "--max-len-b", "16", "--quiet", "--beam", "4",
            stdin="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    hyps = [ln.split("\t")[2] for ln in r.stdout.splitlines() if ln.startswith("H-")]
    # a bare --constraints is ordered, as in fairseq
    want = t.translate(LINES[:2], constraints=[["dog", "red"], ["house"]], constraint_order="ordered", details=True)
    assert hyps == [" ".join(w.tokens[:-1]) for w in want]
    r = run("translate", "--path", str(ckpt), "--prefix", "--max-len-b", "16", "--quiet", "--beam", "4",
            stdin=f"{LINES[0]}\tthe dog\n{LINES[1]}\t\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == t.translate(LINES[:2], prefix=["the dog", None])
    r = run("translate", "--path", str(ckpt), "--prefix", "--quiet", stdin=f"{LINES[0]}\tqqqzzz\n")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["attnmt: error: stdin:1: the prefix 'qqqzzz' has pieces the model's "
                                             "target vocabulary does not hold (qqqzzz); rephrase it with words the "
                                             "model knows"]


def test_an_empty_guidance_changes_nothing(translator):
    g = translator.generator
    src = translator.encode_batch(LINES)
    a = [h[0].tokens for _, h in g.generate(src)]
    b = [h[0].tokens for _, h in g.generate(src, guide=Guidance(prefixes=[[]] * len(src)))]
    assert a == b
