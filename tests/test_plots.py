"""Plots: explicit encoder-decoder attention weights, training curves and attention heat maps as PNG files."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from attnmt import checkpoint as ckpts
from attnmt.cli import main
from attnmt.config import make_config, to_dict
from attnmt.data.dictionary import Dictionary
from attnmt.errors import UserError
from attnmt.models.attention_maps import attention_weights, cross_attention_weights, decode_with_cross_attention
from attnmt.models.transformer import MultiHeadAttention, TransformerConfig, TransformerModel, key_padding_mask

mpimg = pytest.importorskip("matplotlib.image")

PAD, EOS, VOCAB = 1, 2, 40
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_model(seed: int = 0, vocab: int = VOCAB, joint: bool = True, **overrides) -> TransformerModel:
    torch.manual_seed(seed)
    base = dict(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                decoder_attention_heads=4)
    cfg = make_config(TransformerConfig, {**base, **overrides})
    return TransformerModel.build(cfg, vocab, vocab, PAD, joint_vocab=joint).eval()


def padded_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src_lens, tgt_lens = [7, 3, 5], [4, 6, 2]

    def pad(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])

    src = pad([torch.randint(4, VOCAB, (n - 1,), generator=g).tolist() + [EOS] for n in src_lens])
    prev = pad([[EOS] + torch.randint(4, VOCAB, (n - 1,), generator=g).tolist() for n in tgt_lens])
    return src, torch.tensor(src_lens), prev


def read_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5000  # a drawn figure, not an empty canvas
    return mpimg.imread(path)  # (height, width, channels)


# --------------------------------------------------------------------------------------- attention weights


@pytest.mark.parametrize("pre_norm", [False, True])
def test_cross_attention_weights_are_distributions_over_real_source_tokens(pre_norm):
    model = tiny_model(encoder_normalize_before=pre_norm, decoder_normalize_before=pre_norm)
    src, lengths, prev = padded_batch()
    w = cross_attention_weights(model, src, lengths, prev)
    B, S = src.shape
    assert w.shape == (B, 2, 4, prev.size(1), S)
    assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5)
    assert (w >= 0).all()
    for b, n in enumerate(lengths.tolist()):
        assert (w[b, ..., n:] == 0).all()  # padding gets exactly nothing
        assert (w[b, ..., :n] > 0).all()


def test_cross_attention_weights_run_in_eval_mode_and_restore_the_mode():
    model = tiny_model(dropout=0.5, attention_dropout=0.5)
    src, lengths, prev = padded_batch()
    expected = cross_attention_weights(model, src, lengths, prev)
    model.train()
    again = cross_attention_weights(model, src, lengths, prev)
    assert model.training
    assert torch.equal(expected, again)  # no dropout in the analysis path
    assert not again.requires_grad


def test_explicit_weights_recompute_the_fused_attention_output():
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, dropout=0.0, kv_dim=24).eval()
    h, memory = torch.randn(3, 5, 32), torch.randn(3, 7, 24)
    padding = torch.tensor([[False] * 7, [False] * 4 + [True] * 3, [False] * 2 + [True] * 5])
    mask = key_padding_mask(padding)
    q = mha.project_q(h)
    k, v = mha.project_kv(memory)
    fast = mha.combine_heads(mha.scaled_dot_product(q, k, v, mask=mask))
    w = attention_weights(q, k, mask)
    assert (fast - mha.combine_heads(torch.matmul(w, v))).abs().max() < 1e-5
    # and by hand: softmax(q k^T / sqrt(d_k)) over the real keys only
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(8)
    scores = scores.masked_fill(padding[:, None, None, :], -1e9)
    assert (w - scores.softmax(-1)).abs().max() < 1e-6


@pytest.mark.parametrize("pre_norm", [False, True])
def test_analysis_path_gives_the_fast_path_logits(pre_norm):
    model = tiny_model(seed=3, encoder_normalize_before=pre_norm, decoder_normalize_before=pre_norm)
    src, lengths, prev = padded_batch(seed=2)
    with torch.no_grad():
        enc = model.encode(src, lengths)
        fast = model.decode(prev, enc)
        logits, weights = decode_with_cross_attention(model, prev, enc)
    real = prev.ne(PAD)
    assert (fast - logits)[real].abs().max() < 1e-5
    assert torch.equal(weights, cross_attention_weights(model, src, lengths, prev))


def test_the_weights_follow_the_source():
    """Changing one source token changes how every layer attends (the maps are not input-independent)."""
    model = tiny_model(seed=4)
    src, lengths, prev = padded_batch()
    other = src.clone()
    other[0, 1] = 5 if int(src[0, 1]) != 5 else 6
    a = cross_attention_weights(model, src, lengths, prev)
    b = cross_attention_weights(model, other, lengths, prev)
    assert (a[0] - b[0]).abs().max() > 1e-4
    assert torch.allclose(a[1:], b[1:])  # other sentences of the batch are untouched


# ------------------------------------------------------------------------------------------ training curves


def write_log(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")


def synthetic_records(bleu: bool) -> list[dict]:
    recs = []
    for n in range(10, 210, 10):
        recs.append({"type": "train", "epoch": 1 + n // 100, "num_updates": n, "loss": 8.0 * math.exp(-n / 80) + 2,
                     "nll_loss": 7.0, "ppl": 128.0, "lr": 1e-4})
        if n % 50 == 0:
            v = {"type": "valid", "subset": "valid", "epoch": 1 + n // 100, "num_updates": n,
                 "loss": 8.5 * math.exp(-n / 90) + 2.3, "nll_loss": 2.0, "ppl": 4.0, "ntokens": 100}
            if bleu:
                v["bleu"] = 30 * (1 - math.exp(-n / 100))
            recs.append(v)
    recs.append({"type": "summary", "stop_reason": "max_update", "num_updates": 200})
    return recs


@pytest.mark.parametrize("bleu,height", [(False, 4.5), (True, 7.0)])
def test_curves_png_is_readable(tmp_path, capsys, bleu, height):
    log = tmp_path / "train.jsonl"
    write_log(log, synthetic_records(bleu))
    out = tmp_path / "plots" / "curves.png"
    main(["plot", "curves", "--log", str(log), "--out", str(out), "--dpi", "100"])
    img = read_png(out)
    assert img.shape[:2] == (round(height * 100), 800)
    assert "20 train points, valid points: valid 4" in capsys.readouterr().err
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temp file left behind


def test_train_log_series_resume_and_subsets(tmp_path):
    from attnmt.plots import read_train_log

    log = tmp_path / "train.jsonl"
    recs = [{"type": "train", "num_updates": n, "loss": float(n)} for n in (10, 20, 30, 40)]
    # a crash after update 40 with the last checkpoint at update 20: the resumed run logs 30 and 40 again
    recs += [{"type": "train", "num_updates": n, "loss": -float(n)} for n in (30, 40, 50)]
    recs += [{"type": "valid", "subset": "valid", "num_updates": 20, "loss": 3.0, "bleu": 11.0},
             {"type": "valid", "subset": "test", "num_updates": 20, "loss": 3.5},
             {"type": "valid", "subset": "valid", "num_updates": 50, "loss": float("nan"), "bleu": 12.0}]
    write_log(log, recs, tail='{"type": "train", "num_upd')  # a record still being written
    tl = read_train_log(log)
    assert tl.train_loss.updates == [10, 20, 30, 40, 50]
    assert tl.train_loss.values == [10.0, 20.0, -30.0, -40.0, -50.0]
    assert list(tl.valid_loss) == ["valid", "test"]
    assert tl.valid_loss["valid"].updates == [20, 50] and math.isnan(tl.valid_loss["valid"].values[1])
    assert tl.valid_bleu["valid"].values == [11.0, 12.0] and "test" not in tl.valid_bleu


def test_curves_with_training_records_only(tmp_path):
    log = tmp_path / "train.jsonl"
    write_log(log, [r for r in synthetic_records(False) if r["type"] == "train"])
    out = tmp_path / "c.png"
    main(["plot", "curves", "--log", str(log), "--out", str(out), "--dpi", "50"])
    assert read_png(out).shape[:2] == (225, 400)


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "is empty"),
    ("\n\n", "is empty"),
    (json.dumps({"type": "summary", "num_updates": 3}) + "\n", "no 'train' or 'valid' record"),
    ('{"type": "train", "num_updates": 1, "loss": 2}\nnot json\n{"type": "train"}\n', "train.jsonl:2: not a JSON"),
    ('{"type": "valid", "num_updates": 5}\n', "train.jsonl:1: a 'valid' record without a numeric 'loss'"),
    ('{"type": "train", "loss": 1.0}\n', "train.jsonl:1: a 'train' record without an integer 'num_updates'"),
    ("[1, 2]\n", "train.jsonl:1: expected a JSON object"),
])
def test_bad_logs_give_one_line_errors(tmp_path, capsys, content, message):
    log = tmp_path / "train.jsonl"
    if content is not None:
        log.write_text(content, encoding="utf-8")
    out = tmp_path / "c.png"
    with pytest.raises(SystemExit) as e:
        main(["plot", "curves", "--log", str(log), "--out", str(out)])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnmt: error: ") and message in err
    assert str(log) in err
    assert not out.exists()


def test_out_must_be_a_png_file(tmp_path, capsys):
    log = tmp_path / "train.jsonl"
    write_log(log, synthetic_records(False))
    with pytest.raises(SystemExit):
        main(["plot", "curves", "--log", str(log), "--out", str(tmp_path / "c.jpg")])
    assert "must end in .png" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ attention plots

WORDS = [f"w{i}" for i in range(12)] + [f"W{i}" for i in range(12)]


def tiny_checkpoint(path, **overrides):
    """A checkpoint as attnmt train writes it (format, model, data section), for a random 2+2-layer model."""
    d = Dictionary()
    for w in WORDS:
        d.add_symbol(w)
    d.finalize(padding_factor=8)
    torch.manual_seed(0)
    base = dict(encoder_layers=2, decoder_layers=2, encoder_embed_dim=16, decoder_embed_dim=16,
                encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2,
                decoder_attention_heads=2, share_all_embeddings=True, max_target_positions=64)
    cfg = make_config(TransformerConfig, {**base, **overrides})
    model = TransformerModel.build(cfg, len(d), len(d), d.pad(), joint_vocab=True)
    data = {"source_lang": "en", "target_lang": "de", "joint_dictionary": True, "src_dict": d.to_state(),
            "tgt_dict": d.to_state(), "src_dict_sha256": d.checksum(), "tgt_dict_sha256": d.checksum(),
            "bpe": "none", "bpe_model": None, "tokenizer": "none", "lowercase": False}
    torch.save({"format": ckpts.FORMAT, "version": ckpts.VERSION, "model_name": "transformer",
                "arch": "transformer", "model_config": to_dict(cfg), "model": model.state_dict(), "data": data},
               path)
    return path


def test_attention_dump_with_a_forced_reference(tmp_path):
    from attnmt.inference import load_for_inference
    from attnmt.plots import cross_attention_dump

    bundle = load_for_inference(tiny_checkpoint(tmp_path / "model.pt"), "cpu")
    dump = cross_attention_dump(bundle, "w1 w2 w3 w4", reference="W4 W3 zzz W2")
    assert dump.source_pieces == ["w1", "w2", "w3", "w4", "</s>"]
    assert dump.target_pieces == ["W4", "W3", "<unk>", "W2", "</s>"]
    assert dump.weights.shape == (2, 2, 5, 5)
    assert torch.allclose(dump.weights.sum(-1), torch.ones(2, 2, 5), atol=1e-5)
    assert dump.forced and dump.score is None


def test_attention_dump_of_the_models_translation(tmp_path):
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_for_inference
    from attnmt.plots import cross_attention_dump

    bundle = load_for_inference(tiny_checkpoint(tmp_path / "model.pt"), "cpu")
    cfg = make_config(SearchConfig, {"beam": 2, "max_len_b": 6})
    dump = cross_attention_dump(bundle, "w5 w6", search_cfg=cfg)
    hyp = dump.target_pieces
    assert hyp[-1] == "</s>" and 1 <= len(hyp) <= 3 + 6 + 1  # max_len = a * S + b (S counts the EOS), then EOS
    assert dump.weights.shape == (2, 2, len(hyp), 3)
    assert not dump.forced and dump.score is not None


@pytest.mark.parametrize("head", ["mean", "all"])
def test_the_attention_title_fits_a_narrow_figure(tmp_path, head):
    """A short sentence gives a narrow figure; its title wraps instead of running off both sides."""
    pytest.importorskip("matplotlib")
    from attnmt.inference import load_for_inference
    from attnmt.plots import cross_attention_dump, plot_attention

    bundle = load_for_inference(tiny_checkpoint(tmp_path / "model.pt"), "cpu")
    fig = plot_attention(cross_attention_dump(bundle, "w1 w2", reference="W2 W1"), head=head)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    width = fig.get_size_inches()[0] * fig.dpi
    assert 0 <= box.x0 and box.x1 <= width, (box, width)
    assert "mean of 2 heads" in fig._suptitle.get_text().replace("\n", " ") or head == "all"


@pytest.mark.parametrize("head,reference", [("mean", None), ("all", "W2 W1"), ("1", "W2 W1")])
def test_attention_png_is_written(tmp_path, capsys, head, reference):
    ckpt = tiny_checkpoint(tmp_path / "model.pt")
    out = tmp_path / f"attn_{head}.png"
    argv = ["plot", "attention", "--path", str(ckpt), "--input", "w1 w2 w3", "--out", str(out), "--head", head,
            "--device", "cpu", "--beam", "2", "--max-len-b", "5", "--dpi", "60"]
    main(argv + (["--reference", reference] if reference else []))
    img = read_png(out)
    assert img.shape[0] >= 3.5 * 60 and img.shape[1] >= 4.5 * 60
    err = capsys.readouterr().err
    assert f"wrote {out} ({img.shape[1]}x{img.shape[0]})" in err
    if reference:
        assert "target (reference): W2 W1" in err


@pytest.mark.parametrize("extra,message", [
    (["--layer", "2"], "--layer 2: the decoder has 2 layers; use 0..1"),
    (["--layer", "-3"], "--layer -3: the decoder has 2 layers"),
    (["--head", "5"], "--head 5: the model has 2 attention heads"),
    (["--head", "avg"], "--head 'avg': use mean"),
    (["--input", "   "], "--input is empty"),
    (["--reference", ""], "--reference is empty"),
])
def test_bad_attention_options_give_one_line_errors(tmp_path, capsys, extra, message):
    ckpt = tiny_checkpoint(tmp_path / "model.pt")
    out = tmp_path / "a.png"
    with pytest.raises(SystemExit) as e:
        main(["plot", "attention", "--path", str(ckpt), "--input", "w1 w2", "--out", str(out), "--device", "cpu",
              "--reference", "W1", *extra])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not out.exists()


def test_attention_needs_a_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plot", "attention", "--path", str(tmp_path / "none.pt"), "--input", "w1", "--out",
              str(tmp_path / "a.png")])
    assert "no such checkpoint" in capsys.readouterr().err


def test_plot_functions_reject_out_of_range_layers_directly():
    from attnmt.plots import AttentionDump, plot_attention

    dump = AttentionDump(torch.full((3, 2, 2, 4), 0.25), ["a", "b", "c", "</s>"], ["x", "</s>"])
    with pytest.raises(UserError, match="use 0..2"):
        plot_attention(dump, layer=3)
    fig = plot_attention(dump, layer=-3, head=0)
    assert fig.axes[0].get_xticklabels()[0].get_text() == "a"
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["x", "</s>"]


def test_missing_matplotlib_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    log = tmp_path / "train.jsonl"
    write_log(log, synthetic_records(False))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(SystemExit):
        main(["plot", "curves", "--log", str(log), "--out", str(tmp_path / "c.png")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'attnmt[plots]'" in err
