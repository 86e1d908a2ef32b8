"""Hugging Face models in (``attnmt import-hf``) and out (``export --to huggingface``): small MarianMT, M2M-100 and
FSMT models built with ``transformers`` from a config, trained for a few updates, saved with ``save_pretrained``,
imported, and compared output for output with ``transformers``' tokenizers and ``generate``.

The searches agree where both are defined alike (``hf_models.compare``): no length penalty (``lenpen 0`` /
``length_penalty=0``), no minimum length (``--min-len 0``: transformers lets EOS come first), the stop of fairseq
and transformers' ``early_stopping=True`` (``--early-stop beam``: a sentence ends once ``beam`` hypotheses ending
in EOS ranked among the ``beam`` best extensions of a step; greedy is beam 1) and EOS forced at the length limit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import sentence_lines

transformers = pytest.importorskip("transformers")

from hf_models import compare, fsmt_dir, m2m100_dir, marian_dir, nllb_dir  # noqa: E402

from attnmt import checkpoint  # noqa: E402
from attnmt.errors import UserError  # noqa: E402
from attnmt.generation.search import SearchConfig, search  # noqa: E402
from attnmt.inference import load_for_inference  # noqa: E402
from attnmt.interop.huggingface import import_model  # noqa: E402


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    root = tmp_path_factory.mktemp("marian")
    hf = marian_dir(root)
    checkpoint.save(import_model(hf), root / "model.pt")
    return hf, root / "model.pt"


@pytest.fixture(scope="module")
def marian_separate(tmp_path_factory):
    root = tmp_path_factory.mktemp("marian_separate")
    hf = marian_dir(root, separate=True, activation="gelu")
    checkpoint.save(import_model(hf), root / "model.pt")
    return hf, root / "model.pt"


@pytest.fixture(scope="module")
def fsmt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsmt")
    hf = fsmt_dir(root)
    checkpoint.save(import_model(hf), root / "model.pt")
    return hf, root / "model.pt"


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2m100")
    hf = m2m100_dir(root)
    checkpoint.save(import_model(hf, "en", "de"), root / "model.pt")
    return hf, root / "model.pt"


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    root = tmp_path_factory.mktemp("nllb")
    hf = nllb_dir(root)
    checkpoint.save(import_model(hf, "eng_Latn", "deu_Latn"), root / "model.pt")
    return hf, root / "model.pt"


LANGS = {"m2m100": ("en", "de"), "nllb": ("eng_Latn", "deu_Latn")}


@pytest.mark.parametrize("which", ["marian", pytest.param("marian_separate", marks=pytest.mark.slow),
                                   pytest.param("m2m100", marks=pytest.mark.slow), "nllb",
                                   pytest.param("fsmt", marks=pytest.mark.slow)])
def test_imported_model_translates_as_transformers_does(which, request):
    hf, ckpt = request.getfixturevalue(which)
    lines = sentence_lines(40, 3)
    same_ids, results = compare(hf, ckpt, lines, LANGS.get(which))
    assert same_ids == len(lines)
    for beam, (same, worst, _) in results.items():
        assert same == len(lines), f"beam {beam}: {same}/{len(lines)} identical"
        assert worst < 1e-4


@pytest.mark.slow
def test_tokenizers_give_transformers_ids(marian_separate, m2m100, nllb, fsmt):
    lines = sentence_lines(300, 11) + ["", "  Two   spaces  ", "Ünïcode – “quotes” … «x» 1/2 ‘a’", "x" * 300,
                                       "A-B-C 'quoted' & <tag> \u200b zero\u00a0width", "Ｆｕｌｌ，ｗｉｄｔｈ。"]
    for (hf, ckpt), langs in ((marian_separate, None), (m2m100, ("en", "fr")), (nllb, ("fra_Latn", "eng_Latn")),
                              (fsmt, None)):
        tok = transformers.AutoTokenizer.from_pretrained(str(hf))
        bundle = load_for_inference(ckpt)
        if langs:
            tok.src_lang = langs[0]
            bundle.set_languages(*langs)
        for line in lines:
            if line.strip():
                theirs = tok(line)["input_ids"]
                if hf == nllb[0] and line != line.rstrip():
                    # NLLB's tokenizer.json keeps a trailing space as a piece of its own; SentencePiece, which
                    # the model was trained with and attnmt runs, drops it
                    assert theirs[-2] == tok.convert_tokens_to_ids("\u2581")
                    theirs = theirs[:-2] + theirs[-1:]
                assert bundle.encode_source(line) == theirs, line
        # target side: ids -> text as transformers decodes them (special and language tokens skipped)
        if langs:
            tok.tgt_lang = langs[1]
        languages = set(getattr(tok, "lang_token_to_id", {}).values())  # not text (attnmt drops them always)
        for ids in tok(text_target=lines[:50])["input_ids"]:
            text = tok.decode([i for i in ids if i not in languages], skip_special_tokens=True)
            assert bundle.target_text(ids) == text


@pytest.mark.slow
def test_translate_cli_on_imported_models(marian, m2m100, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(sentence_lines(5, 4)) + "\n\n", encoding="utf-8")
    for ckpt, extra in ((marian[1], []), (m2m100[1], ["--tgt-lang", "fr"]), (marian[1], ["--quantize", "int8"])):
        out = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt), "--quiet",
                              *extra], stdin=src.open(), capture_output=True, text=True, check=True).stdout
        lines = out.split("\n")
        assert len(lines) == 7 and lines[5] == ""  # five translations, the blank line blank
        assert "__" not in out  # language tokens are not text
    bad = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(m2m100[1]), "--tgt-lang",
                          "xx"], stdin=src.open(), capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "--tgt-lang xx: not a language" in bad.stderr


def test_import_refuses_what_it_cannot_run(marian, tmp_path):
    import shutil

    hf = marian[0]

    def copy(name):
        d = tmp_path / name
        shutil.copytree(hf, d)
        return d

    t5 = copy("t5")
    cfg = json.loads((t5 / "config.json").read_text())
    (t5 / "config.json").write_text(json.dumps({**cfg, "model_type": "t5"}))
    with pytest.raises(UserError, match="a 't5' model; attnmt imports .*marian, m2m_100"):
        import_model(t5)

    shapes = copy("shapes")
    (shapes / "config.json").write_text(json.dumps({**cfg, "d_model": 64}))
    with pytest.raises(UserError, match="shape"):
        import_model(shapes)

    no_spm = copy("no_spm")
    (no_spm / "target.spm").unlink()
    with pytest.raises(UserError, match="target.spm: not found"):
        import_model(no_spm)

    vocab = copy("vocab")
    v = json.loads((vocab / "vocab.json").read_text())
    v.pop(next(iter(v)))
    (vocab / "vocab.json").write_text(json.dumps(v))
    with pytest.raises(UserError, match="vocab.json"):
        import_model(vocab)

    payload = copy("payload")
    (payload / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (print, ("payload ran",))

    torch.save({"x": Payload()}, payload / "pytorch_model.bin")
    with pytest.raises(UserError, match="weights_only"):
        import_model(payload)


def test_import_refuses_nllb_tokenizers_it_cannot_read(nllb, tmp_path):
    import shutil

    def copy(name):
        d = tmp_path / name
        shutil.copytree(nllb[0], d)
        return d

    legacy = copy("legacy")
    cfg = json.loads((legacy / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({**cfg, "legacy_behaviour": True}))
    with pytest.raises(UserError, match="legacy_behaviour puts the language token after"):
        import_model(legacy, "eng_Latn", "deu_Latn")

    no_spm = copy("no_spm")
    (no_spm / "sentencepiece.bpe.model").unlink()
    with pytest.raises(UserError, match="sentencepiece.bpe.model: not found"):
        import_model(no_spm, "eng_Latn", "deu_Latn")

    no_tok = copy("no_tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="neither vocab.json .* nor tokenizer.json"):
        import_model(no_tok, "eng_Latn", "deu_Latn")

    ids = copy("ids")
    spec = json.loads((ids / "tokenizer.json").read_text())
    spec["added_tokens"][-1]["id"] = 0
    (ids / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="tokenizer.json: .* has id"):
        import_model(ids, "eng_Latn", "deu_Latn")

    with pytest.raises(UserError, match="--target-lang xx_Latn: not a language"):
        import_model(nllb[0], "eng_Latn", "xx_Latn")


def test_import_hf_command_writes_nothing_on_error(tmp_path):
    out = tmp_path / "model.pt"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "import-hf", str(tmp_path), "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "config.json: not found" in r.stderr and r.stderr.count("\n") == 1
    assert not out.exists()


def test_export_to_huggingface_translates_identically_and_round_trips(tmp_path):
    """An attnmt model (the paper's interleaved sinusoids, EOS start, fairseq's dictionary layout) as a MarianMT
    directory: transformers' tokenizer and generate give attnmt's ids; importing it back and exporting again gives
    the same tensors, and the imported model translates as the original does."""
    from helpers import make_checkpoint
    from safetensors.torch import load_file

    ckpt = checkpoint.load(make_checkpoint(tmp_path))
    ckpt["data"]["tokenizer"] = "none"  # MarianTokenizer runs SentencePiece on the raw text
    checkpoint.save(ckpt, tmp_path / "model.pt")
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "export", "--path", str(tmp_path / "model.pt"), "--to",
                        "huggingface", "--output-dir", str(tmp_path / "hf"), "--check", str(tmp_path / "corpus.txt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "largest log-probability difference" in r.stderr
    lines = sentence_lines(30, 5)
    same_ids, results = compare(tmp_path / "hf", tmp_path / "model.pt", lines)
    assert same_ids == len(lines)
    for beam, (same, worst, _) in results.items():
        assert same == len(lines), f"beam {beam}: {same}/{len(lines)}"
        assert worst < 1e-4
    back = import_model(tmp_path / "hf")
    checkpoint.save(back, tmp_path / "back.pt")
    from attnmt.interop.marian_export import export_marian

    export_marian(back, tmp_path / "hf2")
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = SearchConfig(beam=4)
    first, second = load_for_inference(tmp_path / "model.pt"), load_for_inference(tmp_path / "back.pt")
    for line in lines:
        src = first.encode_source(line)
        assert second.encode_source(line) == src
        h1 = search(first.model, torch.tensor([src]), torch.tensor([len(src)]), cfg, first.symbols)[0][0]
        h2 = search(second.model, torch.tensor([src]), torch.tensor([len(src)]), cfg, second.symbols)[0][0]
        assert h1.tokens == h2.tokens and abs(h1.score - h2.score) < 1e-4


@pytest.mark.slow
def test_export_to_huggingface_refuses_what_marian_cannot_hold(m2m100, tmp_path):
    with pytest.raises(UserError, match="cannot be written as a MarianMT model: it is pre-norm.*multilingual"):
        from attnmt.interop.marian_export import export_marian

        export_marian(checkpoint.load(m2m100[1]), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _text_pairs(d, splits=(("train", 300, 21), ("valid", 40, 22))):
    from hf_models import target_of

    for split, n, seed in splits:
        src = sentence_lines(n, seed)
        (d / f"{split}.en").write_text("\n".join(src) + "\n", encoding="utf-8")
        (d / f"{split}.de").write_text("\n".join(target_of(s) for s in src) + "\n", encoding="utf-8")


@pytest.mark.parametrize("which", ["marian", pytest.param("m2m100", marks=pytest.mark.slow)])
def test_finetune_an_imported_model(which, request, tmp_path):
    """preprocess --from-model binarizes with the model's own pipeline (its start token and language tokens):
    attnmt's teacher-forced loss of the imported model on those batches is transformers' on the raw text; a few
    updates of train --finetune-from (no --arch: the checkpoint's) lower the valid loss."""
    from attnmt.tasks.translation import TranslationConfig, TranslationTask

    hf, ckpt = request.getfixturevalue(which)
    _text_pairs(tmp_path)
    run = [sys.executable, "-m", "attnmt.cli"]
    subprocess.run([*run, "preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"),
                    "--validpref", str(tmp_path / "valid"), "--destdir", str(tmp_path / "bin"), "--from-model",
                    str(ckpt)], check=True, capture_output=True)
    task = TranslationTask(TranslationConfig(source_lang="en", target_lang="de"), tmp_path / "bin")
    data = task.dataset("valid")
    batch = data.collate(list(range(len(data))))
    bundle = load_for_inference(ckpt)
    assert int(batch["net_input"]["prev_output_tokens"][0, 0]) == bundle.symbols.first
    net, target = batch["net_input"], batch["target"]
    with torch.no_grad():
        logits = bundle.model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, target[..., None])[..., 0]
        ours = float(-lp[target.ne(bundle.symbols.pad)].mean())
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    if which == "m2m100":
        tok.src_lang, tok.tgt_lang = "en", "de"
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf)).eval()
    src = (tmp_path / "valid.en").read_text(encoding="utf-8").splitlines()
    tgt = (tmp_path / "valid.de").read_text(encoding="utf-8").splitlines()
    order = batch["id"].tolist()
    enc = tok([src[i] for i in order], text_target=[tgt[i] for i in order], return_tensors="pt", padding=True)
    enc["labels"][enc["labels"] == tok.pad_token_id] = -100
    with torch.no_grad():
        theirs = float(model(**enc).loss)
    assert abs(ours - theirs) < 1e-4
    subprocess.run([*run, "train", str(tmp_path / "bin"), "--finetune-from", str(ckpt), "--save-dir",
                    str(tmp_path / "ck"), "--max-update", "20", "--lr", "1e-3", "--warmup-updates", "5",
                    "--max-tokens", "2000", "--progress", "none", "--no-epoch-checkpoints"], check=True,
                   capture_output=True)
    tuned = load_for_inference(tmp_path / "ck" / "checkpoint_last.pt")
    assert tuned.data.decoder_start == bundle.data.decoder_start
    assert tuned.data.language_tokens == bundle.data.language_tokens
    with torch.no_grad():
        logits = tuned.model(net["src_tokens"], net["src_lengths"], net["prev_output_tokens"])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, target[..., None])[..., 0]
        after = float(-lp[target.ne(bundle.symbols.pad)].mean())
    assert after < ours - 0.05
    assert tuned.encode_source(src[0]) == bundle.encode_source(src[0])


def test_from_pretrained_reads_the_hub_cache_and_model_dirs(marian, tmp_path, monkeypatch):
    """``Translator.from_pretrained`` and ``--path`` take a hub name, resolved offline through a Hugging Face cache
    laid out as huggingface_hub lays it out, and a model directory; both translate as the imported checkpoint
    (imported once into attnmt's cache)."""
    import shutil

    huggingface_hub = pytest.importorskip("huggingface_hub")
    from attnmt import Translator

    hf, ckpt = marian
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-marian"
    shutil.copytree(hf, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ATTNMT_CACHE_DIR", str(tmp_path / "cache"))  # where the imported checkpoint is kept
    lines = sentence_lines(8, 6)
    with Translator(ckpt) as t:
        want = t.translate(lines)
    for name in ("someone/tiny-marian", str(hf)):
        with Translator.from_pretrained(name) as t:
            assert t.translate(lines) == want
    assert len(list((tmp_path / "cache" / "imported").glob("*.pt"))) == 2  # imported once each, then loaded
    with pytest.raises(UserError, match="someone/missing: not in the Hugging Face cache"):
        Translator.from_pretrained("someone/missing")
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", "someone/tiny-marian", "--quiet"],
                       input="\n".join(lines) + "\n", capture_output=True, text=True,
                       env={**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == want
