"""attnmt average-checkpoints: element-wise means, selection by number, refusal of incompatible inputs."""

from __future__ import annotations

import os

import pytest
import torch

from attnmt.checkpoint.averaging import average_checkpoints, average_to_file, resolve_inputs, select_checkpoints
from attnmt.cli import main
from attnmt.errors import UserError


def fake_checkpoint(seed: int, *, d_model: int = 8, src_sha: str = "s" * 64, tgt_sha: str = "t" * 64,
                    extra_key: str | None = None, steps: int = 0) -> dict:
    """A checkpoint following the contract, with random parameters (no real model needed)."""
    g = torch.Generator().manual_seed(seed)
    model = {
        "encoder.embed_tokens.weight": torch.randn(11, d_model, generator=g),
        "encoder.layers.0.fc1.weight": torch.randn(2 * d_model, d_model, generator=g),
        "encoder.layers.0.fc1.bias": torch.randn(2 * d_model, generator=g),
        "decoder.output_projection.weight": torch.randn(13, d_model, generator=g).half(),
        "decoder.version": torch.tensor([steps], dtype=torch.long),
    }
    if extra_key:
        model[extra_key] = torch.zeros(3)
    return {
        "format": "attnmt-checkpoint", "version": 1, "model_name": "transformer", "arch": "transformer_small",
        "model_config": {"encoder_embed_dim": d_model, "encoder_layers": 1, "adam_betas": [0.9, 0.98]},
        "model": model,
        "data": {
            "source_lang": "en", "target_lang": "de", "joint_dictionary": False,
            "src_dict": {"symbols": ["<s>", "<pad>", "</s>", "<unk>", "a"], "counts": [1, 1, 1, 1, 5]},
            "tgt_dict": {"symbols": ["<s>", "<pad>", "</s>", "<unk>", "b"], "counts": [1, 1, 1, 1, 7]},
            "src_dict_sha256": src_sha, "tgt_dict_sha256": tgt_sha,
            "bpe": "sentencepiece", "bpe_model": torch.arange(16, dtype=torch.uint8), "tokenizer": "moses",
            "lowercase": False,
        },
        "train": {"num_updates": steps, "epoch": 1, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}}},
    }


def save(ck: dict, path) -> str:
    torch.save(ck, path)
    return str(path)


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_two_checkpoints_average_elementwise(tmp_path):
    a, b = fake_checkpoint(1, steps=100), fake_checkpoint(2, steps=200)
    pa, pb = save(a, tmp_path / "a.pt"), save(b, tmp_path / "b.pt")
    out = average_to_file([pa, pb], tmp_path / "avg.pt")
    for k in ("encoder.embed_tokens.weight", "encoder.layers.0.fc1.weight", "encoder.layers.0.fc1.bias"):
        expected = (a["model"][k].double() + b["model"][k].double()) / 2
        assert out["model"][k].dtype == torch.float32
        torch.testing.assert_close(out["model"][k], expected.float(), rtol=0, atol=0)
    half = "decoder.output_projection.weight"
    assert out["model"][half].dtype == torch.float16  # cast back to the input dtype
    torch.testing.assert_close(out["model"][half], ((a["model"][half].double() + b["model"][half].double()) / 2).half())
    # integer buffer differs: taken from the last input
    assert out["model"]["decoder.version"].tolist() == [200]
    assert list(out["model"]) == list(b["model"])


def test_output_is_inference_checkpoint(tmp_path):
    paths = [save(fake_checkpoint(i, steps=i), tmp_path / f"c{i}.pt") for i in range(3)]
    average_to_file(paths, tmp_path / "avg.pt")
    ck = torch.load(tmp_path / "avg.pt", map_location="cpu", weights_only=True)
    assert "train" not in ck
    assert ck["format"] == "attnmt-checkpoint" and ck["version"] == 1
    assert ck["model_name"] == "transformer" and ck["arch"] == "transformer_small"
    assert ck["model_config"] == fake_checkpoint(0)["model_config"]
    assert ck["averaged_from"] == paths
    assert ck["data"]["src_dict"] == fake_checkpoint(0)["data"]["src_dict"]
    assert torch.equal(ck["data"]["bpe_model"], torch.arange(16, dtype=torch.uint8))
    mean = sum(fake_checkpoint(i)["model"]["encoder.layers.0.fc1.bias"].double() for i in range(3)) / 3
    torch.testing.assert_close(ck["model"]["encoder.layers.0.fc1.bias"], mean.float())
    assert not list(tmp_path.glob(".avg.pt.*"))  # no temp file left behind


def test_last_n_by_number_not_mtime(tmp_path):
    names = {(1, 900): "checkpoint_1_900.pt", (2, 1000): "checkpoint_2_1000.pt", (2, 1100): "checkpoint_2_1100.pt",
             (9, 9000): "checkpoint_9_9000.pt", (10, 10000): "checkpoint_10_10000.pt"}
    for i, name in enumerate(names.values()):
        save(fake_checkpoint(i), tmp_path / name)
        # newest by number gets the OLDEST mtime
        t = 1_000_000 - 1000 * i
        os.utime(tmp_path / name, (t, t))
    for other in ("checkpoint_best.pt", "checkpoint_last.pt", "checkpoint3.pt", "notes.txt"):
        (tmp_path / other).write_text("x")
    picked = select_checkpoints(tmp_path, num_update_checkpoints=3)
    assert [p.name for p in picked] == ["checkpoint_2_1100.pt", "checkpoint_9_9000.pt", "checkpoint_10_10000.pt"]

    for epoch in (1, 2, 10, 11):
        save(fake_checkpoint(epoch), tmp_path / f"checkpoint{epoch}.pt")
        os.utime(tmp_path / f"checkpoint{epoch}.pt", (10_000 - epoch, 10_000 - epoch))
    picked = resolve_inputs([str(tmp_path)], num_epoch_checkpoints=2)
    assert [p.name for p in picked] == ["checkpoint10.pt", "checkpoint11.pt"]
    # fairseq's --checkpoint-upper-bound: the last N up to that epoch (or update)
    picked = resolve_inputs([str(tmp_path)], num_epoch_checkpoints=2, upper_bound=10)
    assert [p.name for p in picked] == ["checkpoint3.pt", "checkpoint10.pt"]
    picked = select_checkpoints(tmp_path, num_update_checkpoints=2, upper_bound=9000)
    assert [p.name for p in picked] == ["checkpoint_2_1100.pt", "checkpoint_9_9000.pt"]
    with pytest.raises(UserError, match="up to --checkpoint-upper-bound 1, need 2"):
        select_checkpoints(tmp_path, num_epoch_checkpoints=2, upper_bound=1)


def test_too_few_and_option_errors(tmp_path):
    save(fake_checkpoint(0), tmp_path / "checkpoint_1_100.pt")
    with pytest.raises(UserError, match=r"found 1 checkpoint\(s\) matching checkpoint_\{epoch\}_\{updates\}\.pt, "
                                        r"need 5 \(checkpoint_1_100\.pt\)"):
        select_checkpoints(tmp_path, num_update_checkpoints=5)
    with pytest.raises(UserError, match=r"found 0 checkpoint\(s\) matching checkpoint\{epoch\}\.pt, need 2"):
        select_checkpoints(tmp_path, num_epoch_checkpoints=2)
    with pytest.raises(UserError, match="--num-update-checkpoints N or --num-epoch-checkpoints N"):
        resolve_inputs([str(tmp_path)])
    with pytest.raises(UserError, match="not both"):
        resolve_inputs([str(tmp_path)], 1, 1)
    with pytest.raises(UserError, match="with explicit files every file given is averaged"):
        resolve_inputs([str(tmp_path / "checkpoint_1_100.pt")], num_update_checkpoints=1)
    with pytest.raises(UserError, match="given twice"):
        resolve_inputs([str(tmp_path / "checkpoint_1_100.pt")] * 2)


def test_key_set_mismatch_refused(tmp_path):
    pa = save(fake_checkpoint(0), tmp_path / "a.pt")
    pb = save(fake_checkpoint(1, extra_key="decoder.extra.weight"), tmp_path / "b.pt")
    with pytest.raises(UserError, match=r"cannot average .*a\.pt and .*b\.pt: different parameter sets "
                                        r"\(only in b\.pt: decoder\.extra\.weight\)"):
        average_checkpoints([pa, pb])


def test_dictionary_checksum_mismatch_refused(tmp_path):
    pa = save(fake_checkpoint(0), tmp_path / "a.pt")
    pb = save(fake_checkpoint(1, tgt_sha="u" * 64), tmp_path / "b.pt")
    with pytest.raises(UserError, match=r"cannot average .*a\.pt and .*b\.pt: different dictionaries .*"
                                        r"data\.tgt_dict_sha256: 'tttttttttttt\.\.\.' vs 'uuuuuuuuuuuu\.\.\.'"):
        average_checkpoints([pa, pb])
    assert not (tmp_path / "avg.pt").exists()


def test_architecture_mismatch_refused(tmp_path):
    pa = save(fake_checkpoint(0), tmp_path / "a.pt")
    pb = save(fake_checkpoint(1, d_model=16), tmp_path / "b.pt")
    with pytest.raises(UserError, match=r"different architectures \(model_config\.encoder_embed_dim: 8 vs 16\)"):
        average_checkpoints([pa, pb])
    other = fake_checkpoint(1)
    other["arch"] = "transformer_big"
    pc = save(other, tmp_path / "c.pt")
    with pytest.raises(UserError, match=r"arch: 'transformer_small' vs 'transformer_big'"):
        average_checkpoints([pa, pc])


def test_cli_end_to_end_and_errors(tmp_path, capsys):
    paths = [save(fake_checkpoint(i, steps=100 * (i + 1)), tmp_path / f"checkpoint_1_{100 * (i + 1)}.pt")
             for i in range(3)]
    out = tmp_path / "avg.pt"
    # fairseq-style: --inputs followed by several files
    code, stdout, err = run(["average-checkpoints", "--inputs", paths[1], paths[2], "--output", str(out)], capsys)
    assert code == 0, err
    assert paths[1] in err and paths[2] in err and paths[0] not in err and "wrote" in err
    ck = torch.load(out, weights_only=True)
    assert ck["averaged_from"] == paths[1:]

    code, _, err = run(["average-checkpoints", "--inputs", str(tmp_path), "--num-update-checkpoints", "2",
                        "--output", str(tmp_path / "avg2.pt")], capsys)
    assert code == 0, err
    torch.testing.assert_close(torch.load(tmp_path / "avg2.pt", weights_only=True)["model"], ck["model"])

    code, _, err = run(["average-checkpoints", "--inputs", str(tmp_path), "--num-update-checkpoints", "7",
                        "--output", str(out)], capsys)
    assert code == 1 and "found 3 checkpoint(s)" in err and "need 7" in err and "Traceback" not in err

    code, _, err = run(["average-checkpoints", "--inputs", str(tmp_path / "nope.pt"), "--output", str(out)], capsys)
    assert code == 1 and "nope.pt: no such checkpoint file" in err

    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint\n")
    code, _, err = run(["average-checkpoints", "--inputs", str(junk), "--output", str(out)], capsys)
    assert code == 1 and "junk.pt: not an attnmt checkpoint" in err and "Traceback" not in err

    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "foreign.pt")
    code, _, err = run(["average-checkpoints", "--inputs", str(tmp_path / "foreign.pt"), "--output", str(out)],
                       capsys)
    assert code == 1 and "foreign.pt: not an attnmt checkpoint" in err

    code, _, err = run(["average-checkpoints", "--inputs", paths[0], "--output", paths[0]], capsys)
    assert code == 1 and "is also an input" in err


def test_real_transformer_state_dicts_average_and_load(tmp_path):
    from attnmt.config import make_config, to_dict
    from attnmt.models.transformer import TransformerConfig, TransformerModel

    cfg = make_config(TransformerConfig, dict(encoder_layers=1, decoder_layers=1, encoder_embed_dim=16,
                                              decoder_embed_dim=16, encoder_ffn_embed_dim=32,
                                              decoder_ffn_embed_dim=32, encoder_attention_heads=2,
                                              decoder_attention_heads=2))
    models, paths = [], []
    for seed in range(2):
        torch.manual_seed(seed)
        model = TransformerModel.build(cfg, 20, 20, 1, joint_vocab=True)
        ck = fake_checkpoint(seed)
        ck["model"], ck["model_config"] = model.state_dict(), to_dict(cfg)
        models.append(model)
        paths.append(save(ck, tmp_path / f"checkpoint_1_{seed + 1}.pt"))
    avg = average_to_file(paths, tmp_path / "avg.pt")
    fresh = TransformerModel.build(cfg, 20, 20, 1, joint_vocab=True)
    fresh.load_state_dict(torch.load(tmp_path / "avg.pt", weights_only=True)["model"], strict=True)
    for name, p in fresh.named_parameters():
        mean = (dict(models[0].named_parameters())[name].double() + dict(models[1].named_parameters())[name].double()) / 2
        torch.testing.assert_close(p.detach(), mean.float(), rtol=0, atol=0)
    assert avg["model_config"] == to_dict(cfg)
