"""--required-seq-len-multiple (the device's choice by default): batch lengths padded to a multiple, same losses."""

import torch
from helpers import TINY_MODEL, make_data_bin

from attnmt.cli import main
from attnmt.tasks.translation import TranslationConfig, TranslationTask
from attnmt.training.config import TrainConfig
from attnmt.training.data import make_train_iterator


def test_batches_are_padded_to_the_multiple_and_the_loss_does_not_change(tmp_path):
    from attnmt.criterions import LabelSmoothedCrossEntropy, LabelSmoothedCrossEntropyConfig

    data = make_data_bin(tmp_path / "bin")
    task = TranslationTask(TranslationConfig(), data)
    cfg = TrainConfig(max_tokens=256, seed=1)
    plain, _ = make_train_iterator(task, cfg, (1024, 1024))
    padded, _ = make_train_iterator(task, cfg, (1024, 1024), pad_to_multiple=8)
    torch.manual_seed(0)
    name, model_cfg, _ = task.model_config("transformer_small", {
        "encoder_layers": 1, "decoder_layers": 1, "encoder_embed_dim": 16, "decoder_embed_dim": 16,
        "encoder_ffn_embed_dim": 32, "decoder_ffn_embed_dim": 32, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2})
    model = task.build_model(name, model_cfg).eval()
    crit = LabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyConfig(0.1), 1)
    lengths = set()
    for a, b in zip(plain, padded):
        for key in ("src_tokens", "prev_output_tokens"):
            assert b["net_input"][key].size(1) % 8 == 0
            lengths.add(a["net_input"][key].size(1))
        assert b["ntokens"] == a["ntokens"] and torch.equal(b["id"], a["id"])
        with torch.no_grad():
            la, lb = crit(model, a)[1], crit(model, b)[1]
        assert torch.allclose(la["loss"], lb["loss"], rtol=1e-5), (la["loss"], lb["loss"])
    assert any(n % 8 for n in lengths)  # the unpadded batches had other lengths: the test compares something


def test_train_option_is_checked(tmp_path, capsys):
    data = make_data_bin(tmp_path / "bin")
    try:
        main(["train", str(data), *TINY_MODEL, "--save-dir", str(tmp_path / "c"), "--required-seq-len-multiple", "-1",
              "--max-update", "1", "--progress", "none"])
    except SystemExit as e:
        assert e.code != 0
    assert "--required-seq-len-multiple must be >= 0" in capsys.readouterr().err
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(tmp_path / "c"), "--required-seq-len-multiple", "8",
          "--max-update", "2", "--progress", "none"])
