"""Other toolkits' models and data: fairseq checkpoints in and out, CTranslate2 out, fairseq data-bins read."""

from __future__ import annotations

import argparse
import math
import struct

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import TINY_MODEL

from attnmt import checkpoint, registry
from attnmt.errors import UserError


def run(args: list[str]) -> tuple[int, str]:
    from attnmt.cli import cli

    registry.load_plugins()
    r = CliRunner().invoke(cli, args, catch_exceptions=True)
    if isinstance(r.exception, UserError):
        return 1, f"attnmt: error: {r.exception}"
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small model trained a few updates on the toy task (pre-norm, so the final LayerNorms travel too)."""
    from helpers import TINY_MODEL, make_data_bin

    root = tmp_path_factory.mktemp("interop")
    data = make_data_bin(root / "bin", n_train=300)
    code, err = run(["train", str(data), *TINY_MODEL, "--encoder-layers", "2", "--decoder-layers", "2",
                     "--encoder-normalize-before", "--decoder-normalize-before", "--save-dir", str(root / "ck"),
                     "--max-update", "20", "--lr", "5e-3", "--warmup-updates", "5", "--max-tokens", "512",
                     "--threads", "1", "--progress", "none"])
    assert code == 0, err
    return root, data, root / "ck" / "checkpoint_last.pt"


def _translate(path, sources, **search):
    from attnmt.generation.beam import beam_search
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(path)
    cfg = SearchConfig(**{"beam": 4, "max_len_a": 0, "max_len_b": 12, **search})
    out = []
    for s in sources:
        hyp = beam_search(bundle.model, torch.tensor([s]), torch.tensor([len(s)]), cfg, bundle.symbols)[0][0]
        out.append((hyp.tokens, hyp.positional_scores))
    return out


def _valid_sources(data, n: int = 12) -> list[list[int]]:
    from attnmt.data.indexed import IndexedDataset

    ds = IndexedDataset(data / "valid.en-de.en")
    return [ds[i].astype("int64").tolist() for i in range(n)]


def _as_fairseq_file(ckpt: dict, path) -> None:
    """What fairseq-train 0.12 writes for this model (options as a plain dict, fairseq's parameter names)."""
    from attnmt.interop.fairseq import SAME_FIELDS, convert_to_fairseq

    cfg = ckpt["model_config"]
    options = {k: cfg[k] for k in SAME_FIELDS} | {"arch": "transformer", "encoder_learned_pos": True,
                                                  "decoder_learned_pos": True, "activation_fn": "relu"}
    state = convert_to_fairseq(ckpt, pad=1)
    torch.save({"args": None, "cfg": {"model": options, "task": {"source_lang": "en", "target_lang": "de"}},
                "model": state}, path)


def test_fairseq_round_trip_translates_the_same(trained, tmp_path):
    root, data, ck = trained
    fs = tmp_path / "fairseq.pt"
    _as_fairseq_file(checkpoint.load(ck), fs)
    out = tmp_path / "imported.pt"
    code, err = run(["import-fairseq", str(fs), "--data", str(data), "--output", str(out)])
    assert code == 0, err
    assert "wrote" in err and "en->de" in err
    sources = _valid_sources(data)
    mine, theirs = _translate(ck, sources), _translate(out, sources)
    assert [t for t, _ in mine] == [t for t, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        assert a == pytest.approx(b, abs=1e-5)
    # the imported checkpoint generates on the data-bin (same dictionaries) and fine-tunes
    code, err = run(["generate", str(data), "--path", str(out), "--gen-subset", "valid", "--quiet",
                     "--max-len-b", "8"])
    assert code == 0, err
    from helpers import TINY_MODEL

    code, err = run(["train", str(data), *TINY_MODEL, "--encoder-layers", "2", "--decoder-layers", "2",
                     "--encoder-normalize-before", "--decoder-normalize-before", "--learned-pos",
                     "--finetune-from", str(out), "--save-dir", str(tmp_path / "ft"), "--max-update", "22",
                     "--threads", "1", "--progress", "none"])
    assert code == 0, err


def test_a_fairseq_checkpoint_given_where_an_attnmt_one_goes_names_import_fairseq(trained, tmp_path):
    root, data, ck = trained
    fs = tmp_path / "fairseq.pt"
    _as_fairseq_file(checkpoint.load(ck), fs)
    old = tmp_path / "old_fairseq.pt"  # older fairseq versions store their options as an argparse.Namespace
    state = torch.load(fs, weights_only=False)
    torch.save({"args": argparse.Namespace(arch="transformer"), "model": state["model"]}, old)
    for path in (fs, old):
        for args in (["generate", str(data), "--path", str(path), "--gen-subset", "valid"],
                     ["average-checkpoints", "--inputs", str(path), str(ck), "--output", str(tmp_path / "a.pt")]):
            code, err = run(args)
            assert code == 1, err
            assert err.splitlines()[-1] == (f"attnmt: error: {path}: a fairseq checkpoint, not an attnmt one; convert "
                                            f"it once with attnmt import-fairseq {path} --data DATA_BIN --output "
                                            f"model.pt (DATA_BIN: the fairseq data-bin with its dict.*.txt)")


def test_import_refuses_what_attnmt_cannot_run(trained, tmp_path):
    root, data, ck = trained
    fs = tmp_path / "fairseq.pt"
    _as_fairseq_file(checkpoint.load(ck), fs)
    state = torch.load(fs, weights_only=False)
    state["cfg"]["model"]["activation_fn"] = "gelu"
    torch.save(state, tmp_path / "gelu.pt")
    code, err = run(["import-fairseq", str(tmp_path / "gelu.pt"), "--data", str(data), "-o", str(tmp_path / "x.pt")])
    assert code == 1 and "--activation-fn gelu has no counterpart" in err
    state["cfg"]["model"].update(activation_fn="relu", arch="fconv_wmt_en_de")
    torch.save(state, tmp_path / "fconv.pt")
    code, err = run(["import-fairseq", str(tmp_path / "fconv.pt"), "--data", str(data), "-o", str(tmp_path / "x.pt")])
    assert code == 1 and "a fairseq 'fconv_wmt_en_de' model" in err
    code, err = run(["import-fairseq", str(fs), "--data", str(tmp_path), "-o", str(tmp_path / "x.pt")])
    assert code == 1 and "dict.en.txt: the source dictionary was not found" in err
    code, err = run(["import-fairseq", str(ck), "--data", str(data), "-o", str(tmp_path / "x.pt")])
    assert code == 1 and "already an attnmt checkpoint" in err
    assert not (tmp_path / "x.pt").exists()


def test_fairseq_sinusoids_layout():
    from attnmt.interop.fairseq import fairseq_sinusoids

    table = fairseq_sinusoids(10, 8, padding_idx=1)
    assert table[1].abs().sum() == 0  # the padding row
    p = 7  # sines first, then cosines; frequencies exp(-i * log(10000) / (d/2 - 1))
    assert table[p, 0] == pytest.approx(math.sin(p)) and table[p, 4] == pytest.approx(math.cos(p))
    assert table[p, 3] == pytest.approx(math.sin(p / 10000), abs=1e-6)


def test_ctranslate2_export_scores_as_attnmt(trained, tmp_path):
    pytest.importorskip("ctranslate2")
    root, data, ck = trained
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(ck)
    sources = _valid_sources(data)
    src = tmp_path / "src.txt"
    src.write_text("".join(bundle.source_pieces(s) + "\n" for s in sources))
    code, err = run(["export", "--path", str(ck), "--to", "ctranslate2", "--output-dir", str(tmp_path / "ct2"),
                     "--check", str(src)])
    assert code == 0, err
    assert "largest log-probability difference" in err
    import ctranslate2

    tr = ctranslate2.Translator(str(tmp_path / "ct2"), compute_type="float32")
    res = tr.translate_batch([bundle.source_pieces(s).split() for s in sources], beam_size=1, max_decoding_length=12)
    greedy = _translate(ck, sources, beam=1)
    for r, (tokens, _) in zip(res, greedy):  # the same greedy translations (CTranslate2 may stop at its limit)
        ours = bundle.target_pieces(tokens).split()
        assert r.hypotheses[0] == ours[:len(r.hypotheses[0])] and len(r.hypotheses[0]) >= min(len(ours), 11)
    code, err = run(["export", "--path", str(ck), "--to", "fairseq", "--output-dir", str(tmp_path / "fs"),
                     "--quantization", "int8"])
    assert code == 1 and "--quantization is a CTranslate2 option" in err


def _write_fairseq_index(prefix, seqs, dtype=np.uint16, code=8):
    """A fairseq-preprocess mmap dataset, written from fairseq's documented layout."""
    sizes = np.array([len(s) for s in seqs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(seqs)))
        f.write(sizes.tobytes() + pointers.tobytes())
    np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]).tofile(f"{prefix}.bin")


def test_fairseq_data_bins_are_read_as_they_are(tmp_path):
    from attnmt.data.indexed import IndexedDataset

    seqs = [[5, 6, 2], [7, 2], [9, 10, 11, 12, 2]]
    _write_fairseq_index(tmp_path / "test.en-de.en", seqs)
    ds = IndexedDataset(tmp_path / "test.en-de.en")
    assert [d.tolist() for d in ds] == seqs
    _write_fairseq_index(tmp_path / "big", seqs, dtype=np.int32, code=4)
    assert IndexedDataset(tmp_path / "big")[2].tolist() == seqs[2]
    with open(tmp_path / "big.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError, match="big.bin: 10 bytes is not a whole number of int32 ids"):
        IndexedDataset(tmp_path / "big")


@pytest.mark.parametrize("vocab, dtype, code", [(200, np.uint8, 1), (8000, np.uint16, 8), (70000, np.int32, 4)])
def test_dataset_impl_mmap_writes_fairseqs_index(tmp_path, vocab, dtype, code):
    """--dataset-impl mmap: the .idx is byte for byte what fairseq's layout says (the writer above), the .bin is
    unchanged, and attnmt reads it back."""
    from attnmt.data.indexed import IndexedDataset, IndexedDatasetBuilder

    seqs = [[5, vocab - 1, 2], [7, 2], [], [9, 10, 11, 12, 2]]
    for fmt in ("attnmt", "mmap"):
        with IndexedDatasetBuilder(tmp_path / f"{fmt}.en", vocab, index_format=fmt) as b:
            for s in seqs:
                b.add(s)
    _write_fairseq_index(tmp_path / "theirs.en", seqs, dtype=dtype, code=code)
    assert (tmp_path / "mmap.en.idx").read_bytes() == (tmp_path / "theirs.en.idx").read_bytes()
    assert (tmp_path / "mmap.en.bin").read_bytes() == (tmp_path / "theirs.en.bin").read_bytes() == \
        (tmp_path / "attnmt.en.bin").read_bytes()
    assert [d.tolist() for d in IndexedDataset(tmp_path / "mmap.en")] == seqs


def test_preprocess_dataset_impl_mmap_trains_and_refuses_other_formats(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    for split, n in (("train", 40), ("valid", 4)):
        for lang in ("en", "de"):
            (text / f"{split}.{lang}").write_text("".join(f"the {lang} dog {i % 7}\n" for i in range(n)))
    args = ["preprocess", "-s", "en", "-t", "de", "--trainpref", str(text / "train"), "--validpref",
            str(text / "valid"), "--joined-dictionary"]
    code, err = run([*args, "--destdir", str(tmp_path / "bin"), "--dataset-impl", "mmap"])
    assert code == 0, err
    for name in ("train.en-de.en", "train.en-de.de", "valid.en-de.en", "valid.en-de.de"):
        assert (tmp_path / "bin" / f"{name}.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    code, err = run(["train", str(tmp_path / "bin"), *TINY_MODEL, "--save-dir", str(tmp_path / "ck"),
                     "--max-update", "2", "--max-tokens", "128", "--progress", "none"])
    assert code == 0, err
    code, err = run([*args, "--destdir", str(tmp_path / "lazy"), "--dataset-impl", "lazy"])
    assert code == 1 and "--dataset-impl lazy: attnmt writes memory-mapped data-bins" in err


def test_ensemble_averages_the_members_distributions(trained, tmp_path):
    """--path a.pt:b.pt: the ensemble's log-probabilities are log(mean(p_a, p_b)); an ensemble of one model twice
    translates as the model does."""
    from attnmt.inference import load_for_inference

    root, data, ck = trained
    other = root / "ck" / "checkpoint1.pt"  # the same run one epoch earlier: another model, same dictionaries
    if not other.exists():
        other = sorted((root / "ck").glob("checkpoint[0-9]*.pt"))[0]
    sources = _valid_sources(data, 6)
    twice = _translate(f"{ck}:{ck}", sources)
    assert [t for t, _ in twice] == [t for t, _ in _translate(ck, sources)]
    pair = load_for_inference(f"{ck}:{other}")
    a, b = load_for_inference(ck).model, load_for_inference(other).model
    src = torch.tensor([sources[0]])
    lengths = torch.tensor([len(sources[0])])
    prev = torch.tensor([[2, 5, 6]])
    want = torch.logsumexp(torch.stack([torch.log_softmax(m(src, lengths, prev), -1) for m in (a, b)]), 0) - math.log(2)
    with torch.no_grad():
        enc = pair.model.encode(src, lengths)
        got = torch.log_softmax(pair.model.decode(prev, enc), -1)
    assert got.numpy() == pytest.approx(want.detach().numpy(), abs=1e-5)
    code, err = run(["generate", str(data), "--path", f"{ck}:{other}", "--gen-subset", "valid", "--quiet",
                     "--max-len-b", "8", "--beam", "2"])
    assert code == 0, err


def test_training_on_a_fairseq_data_bin(tmp_path):
    """A data-bin as fairseq-preprocess writes it (MMIDIDX indexes, no preprocess.json; the pair de->en sorts
    backwards): attnmt trains on it, in the direction its file names give."""
    from helpers import TINY_MODEL, make_data_bin

    from attnmt.data.indexed import IndexedDataset

    ours = make_data_bin(tmp_path / "ours", n_train=60)
    theirs = tmp_path / "fairseq-bin"
    theirs.mkdir()
    names = {"en": "xx", "de": "aa"}  # source xx, target aa: alphabetical order would get the direction wrong
    for lang, new in names.items():
        (theirs / f"dict.{new}.txt").write_text((ours / f"dict.{lang}.txt").read_text())
        for split in ("train", "valid"):
            ds = IndexedDataset(ours / f"{split}.en-de.{lang}")
            _write_fairseq_index(theirs / f"{split}.xx-aa.{new}", [d.tolist() for d in ds])
    code, err = run(["train", str(theirs), *TINY_MODEL, "--save-dir", str(tmp_path / "ck"), "--max-update", "1",
                     "--max-tokens", "256", "--threads", "1", "--progress", "lines"])
    assert code == 0, err
    assert "xx->aa" in err


def test_generate_fairseq_gives_fairseq_generates_defaults_lines_and_bleu_line(trained):
    """--fairseq: fairseq-generate's search defaults (beam 5, length-normalised scores, beam stopping, at most 200
    tokens), its S/T/H/D/P lines and its closing BLEU4 line, computed over the T- and D- lines."""
    from click.testing import CliRunner

    from attnmt.cli import cli
    from attnmt.scoring import fairseq_generate_bleu

    root, data, ck = trained

    def out(*extra):
        r = CliRunner().invoke(cli, ["generate", str(data), "--path", str(ck), "--gen-subset", "valid", "--quiet",
                                     *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return r.stdout.splitlines()

    mode = out("--fairseq")
    explicit = out("--format", "fairseq", "--beam", "5", "--lenpen", "1", "--lenpen-style", "fairseq",
                   "--early-stop", "beam", "--max-len-a", "0", "--max-len-b", "200")
    assert mode[:-1] == explicit  # the same search and lines, then the BLEU line
    refs = [ln.split("\t", 1)[1] for ln in mode if ln.startswith("T-")]
    hyps = [ln.split("\t", 2)[2] for ln in mode if ln.startswith("D-")]
    assert len(refs) == len(hyps) == 24
    assert mode[-1] == f"Generate valid with beam=5: {fairseq_generate_bleu(hyps, refs)}"
    assert mode[-1].startswith("Generate valid with beam=5: BLEU4 = ")
    # an option given explicitly wins over the mode's default
    assert out("--fairseq", "--beam", "2")[-1].startswith("Generate valid with beam=2: BLEU4 = ")


def test_fairseq_generate_bleu_is_the_multi_bleu_formula_and_an_unknown_reference_word_never_matches():
    from attnmt.scoring import fairseq_generate_bleu

    assert fairseq_generate_bleu(["a b c d"], ["a b c d"]) == ("BLEU4 = 100.00, 100.0/100.0/100.0/100.0 (BP=1.000, "
                                                               "ratio=1.000, syslen=4, reflen=4)")
    assert fairseq_generate_bleu(["a <unk> c d"], ["a <unk> c d"]).startswith("BLEU4 = 0.00, 75.0/33.3/0.0/0.0")


@pytest.mark.parametrize("key_dim", [4, 16])
def test_a_model_with_keys_of_its_own_size_translates_as_it_scores_and_is_not_exported(key_dim, tmp_path):
    """--attention-key-dim (Table 3 row B): the beam's scores are the teacher-forced model's (the decoder cache
    holds padded heads), and no exporter writes a model its format cannot hold."""
    from helpers import TINY_MODEL, make_data_bin

    from attnmt.inference import load_for_inference

    data = make_data_bin(tmp_path / "bin", n_train=100)
    code, err = run(["train", str(data), *TINY_MODEL, "--attention-key-dim", str(key_dim), "--save-dir",
                     str(tmp_path / "ck"), "--max-update", "8", "--lr", "5e-3", "--warmup-updates", "4",
                     "--max-tokens", "512", "--threads", "1", "--progress", "none"])
    assert code == 0, err
    ck = tmp_path / "ck" / "checkpoint_last.pt"
    model = load_for_inference(ck).model
    assert model.encoder.layers[0].self_attn.qkv_proj.weight.shape == (2 * 2 * key_dim + 16, 16)
    for s in _valid_sources(data, 4):
        tokens, scores = _translate(ck, [s])[0]
        tokens, scores = torch.as_tensor(tokens), torch.as_tensor(scores)
        prev = torch.cat([tokens.new_tensor([2]), tokens[:-1]])[None]
        with torch.no_grad():
            lprobs = model(torch.tensor([s]), torch.tensor([len(s)]), prev).float().log_softmax(-1)[0]
        assert torch.allclose(lprobs.gather(1, tokens[:, None]).squeeze(1), scores, atol=1e-4)
    for target, what in (("ctranslate2", "CTranslate2 holds attention keys of d_model / heads only"),
                         ("fairseq", "fairseq's Transformer holds attention keys of d_model / heads only"),
                         ("huggingface", "its attention keys are --attention-key-dim")):
        out = tmp_path / target
        code, err = run(["export", "--path", str(ck), "--to", target, "--output-dir", str(out)])
        assert code == 1 and what in err and f"--attention-key-dim {key_dim}" in err, err
        assert not out.exists()
