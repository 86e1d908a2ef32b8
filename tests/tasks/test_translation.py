"""The translation task over a DATA_BIN: languages, dictionaries, splits, the checkpoint's data section, the model."""

from __future__ import annotations

import json

import pytest
from helpers import make_data_bin

from attnmt.checkpoint import DataSection
from attnmt.cli import load_components
from attnmt.errors import UserError
from attnmt.tasks.translation import TranslationConfig, TranslationTask


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return make_data_bin(tmp_path_factory.mktemp("bin"), n_train=40, n_valid=8)


def test_languages_and_dictionaries_come_from_preprocess_json(data_bin):
    task = TranslationTask(TranslationConfig(), data_bin)
    assert (task.src_lang, task.tgt_lang) == ("en", "de") and task.joint_dictionary
    assert len(task.dataset("train")) == 40 and len(task.dataset("valid")) == 8
    assert task.valid_subsets() == ["valid"]


def test_languages_from_the_dictionaries_without_preprocess_json(tmp_path):
    d = make_data_bin(tmp_path / "bin", n_train=10, n_valid=4, joined=False)
    (d / "preprocess.json").unlink()  # as fairseq-preprocess leaves it
    task = TranslationTask(TranslationConfig(source_lang="en"), d)
    assert (task.src_lang, task.tgt_lang) == ("en", "de") and not task.joint_dictionary


def test_bad_data_bins_are_one_line_errors(tmp_path, data_bin):
    with pytest.raises(UserError, match="no such data directory"):
        TranslationTask(TranslationConfig(), tmp_path / "nope")
    with pytest.raises(UserError, match=r"dict.fr.txt: dictionary not found; run attnmt preprocess -s en -t fr"):
        TranslationTask(TranslationConfig(target_lang="fr"), data_bin)
    with pytest.raises(UserError, match="split 'test' not found"):
        TranslationTask(TranslationConfig(), data_bin).dataset("test")
    broken = make_data_bin(tmp_path / "broken", n_train=4, n_valid=2)
    (broken / "preprocess.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match=r"preprocess.json:1: not valid JSON"):
        TranslationTask(TranslationConfig(), broken)


def test_data_section_round_trips_and_identifies_the_dictionaries(data_bin, tmp_path):
    task = TranslationTask(TranslationConfig(), data_bin)
    state = task.data_state()
    again = DataSection.from_dict(state.to_dict(), "ckpt.pt")
    assert again == state
    src, tgt = again.dictionaries("ckpt.pt")
    assert src.checksum() == task.src_dict.checksum() and tgt.checksum() == task.tgt_dict.checksum()
    other = TranslationTask(TranslationConfig(), make_data_bin(tmp_path / "o", n_train=10, n_valid=2,
                                                               extra_symbol="zz")).data_state()
    diffs = state.dictionary_differences(other)
    assert len(diffs) == 2 and diffs[0].startswith("source dictionary: checkpoint sha256")
    with pytest.raises(UserError, match="no complete 'data' section"):
        DataSection.from_dict({"source_lang": "en"}, "ckpt.pt")


def test_model_config_shares_embeddings_only_with_a_joined_dictionary(data_bin, tmp_path):
    load_components()
    joined = TranslationTask(TranslationConfig(), data_bin)
    name, cfg, notes = joined.model_config("transformer", {"encoder_layers": 1, "decoder_layers": 1})
    assert name == "transformer" and cfg.share_all_embeddings and notes[0].startswith("sharing all embeddings (joined dictionary")
    model = joined.build_model(name, cfg)
    assert model.encoder.embed.tokens.weight is model.output_projection_weight()
    split = TranslationTask(TranslationConfig(), make_data_bin(tmp_path / "s", n_train=10, n_valid=2, joined=False))
    meta = json.loads((split.data_bin / "preprocess.json").read_text())
    assert meta["joined_dictionary"] is False
    _, cfg, notes = split.model_config("transformer_small", {})
    assert not cfg.share_all_embeddings and notes == ["not sharing embeddings: the dictionaries are not joined"]


def test_a_data_bin_written_one_way_serves_the_reverse_direction(data_bin, tmp_path, capsys):
    """fairseq's -s en -t de on a data-bin binarized de-en (or the reverse): the pair's files are found either way
    round, and the sides swap."""
    from helpers import TINY_MODEL

    from attnmt.cli import main

    task = TranslationTask(TranslationConfig(source_lang="de", target_lang="en"), data_bin)
    forward = TranslationTask(TranslationConfig(), data_bin)
    back, ahead = task.dataset("valid"), forward.dataset("valid")
    assert len(back) == len(ahead) > 0
    assert back.src[3].tolist() == ahead.tgt[3].tolist() and back.tgt[3].tolist() == ahead.src[3].tolist()
    assert task.split_prefix("valid", "de").name == "valid.en-de.de"
    ck = tmp_path / "ck"
    main(["train", str(data_bin), *TINY_MODEL, "-s", "de", "-t", "en", "--save-dir", str(ck), "--max-update", "2",
          "--progress", "none", "--threads", "1"])
    from attnmt import checkpoint

    data = checkpoint.load(ck / "checkpoint_last.pt")["data"]
    assert (data["source_lang"], data["target_lang"]) == ("de", "en")
    main(["generate", str(data_bin), "--path", str(ck / "checkpoint_last.pt"), "--gen-subset", "valid", "--quiet",
          "--max-len-b", "4", "--threads", "1"])
    assert len(capsys.readouterr().out.splitlines()) == len(ahead)
