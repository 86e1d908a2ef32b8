"""Tiny data-bins and tiny-model options for the training tests (written into a test's tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from attnmt.cli import load_components
from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDatasetBuilder
from attnmt.models.transformer import TransformerConfig, TransformerModel

WORDS = [f"w{i}" for i in range(24)]

# a 1+1 layer, d=16 model: seconds per hundred updates on one CPU core
TINY_MODEL = ["--arch", "transformer_small", "--encoder-layers", "1", "--decoder-layers", "1",
              "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
              "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]


def _translate(words: list[str]) -> list[str]:
    """The toy 'translation': each word maps to its upper-case twin, in reverse order (learnable, not a copy)."""
    return [w.upper() for w in reversed(words)]


def make_pairs(n: int, seed: int, min_len: int = 2, max_len: int = 12) -> list[tuple[list[str], list[str]]]:
    rng = np.random.RandomState(seed)
    pairs = []
    for _ in range(n):
        k = int(rng.randint(min_len, max_len + 1))
        src = [WORDS[int(i)] for i in rng.randint(0, len(WORDS), size=k)]
        pairs.append((src, _translate(src)))
    return pairs


def make_data_bin(root: Path, n_train: int = 200, n_valid: int = 24, joined: bool = True, seed: int = 0,
                  long_pairs: int = 0, extra_symbol: str | None = None) -> Path:
    """A DATA_BIN as attnmt preprocess writes it: dictionaries, preprocess.json, train/valid .bin/.idx.

    ``long_pairs`` appends that many 40-token train pairs (longer than a model with 32 positions takes);
    ``extra_symbol`` adds a symbol to the dictionaries (to make a 'different dictionary').
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    train = make_pairs(n_train, seed)
    train += [([WORDS[0]] * 40, [WORDS[0].upper()] * 40) for _ in range(long_pairs)]
    valid = make_pairs(n_valid, seed + 1)
    src_d, tgt_d = Dictionary(), Dictionary()
    for s, t in train:
        for w in s:
            src_d.add_symbol(w)
        for w in t:
            (src_d if joined else tgt_d).add_symbol(w)
    if extra_symbol:
        src_d.add_symbol(extra_symbol)
        tgt_d.add_symbol(extra_symbol)
    src_d.finalize(padding_factor=8)
    tgt_d.finalize(padding_factor=8)
    if joined:
        tgt_d = src_d
    src_d.save(root / "dict.en.txt")
    tgt_d.save(root / "dict.de.txt")
    for split, pairs in (("train", train), ("valid", valid)):
        for lang, d, side in (("en", src_d, 0), ("de", tgt_d, 1)):
            b = IndexedDatasetBuilder(str(root / f"{split}.en-de.{lang}"), len(d))
            for p in pairs:
                b.add(d.encode_line(" ".join(p[side])))
            b.finalize()
    meta = {"format_version": 1, "source_lang": "en", "target_lang": "de", "joined_dictionary": joined,
            "bpe": "none", "tokenizer": "none", "lowercase": False}
    (root / "preprocess.json").write_text(json.dumps(meta), encoding="utf-8")
    return root


# ------------------------------------------------------------------ a small Transformer and one batch for it

PAD = 1


def small_model(dropout: float = 0.0) -> TransformerModel:
    torch.manual_seed(0)
    cfg = TransformerConfig(encoder_layers=2, decoder_layers=2, encoder_embed_dim=32, decoder_embed_dim=32,
                            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=4,
                            decoder_attention_heads=4, dropout=dropout, share_all_embeddings=True)
    return TransformerModel.build(cfg, 50, 50, PAD, joint_vocab=True)


def small_batch():
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD], [11, 12, 13, 2, PAD]])
    target = torch.tensor([[20, 21, 22, 2], [23, 2, PAD, PAD], [24, 25, 2, PAD]])
    prev = torch.tensor([[2, 20, 21, 22], [2, 23, PAD, PAD], [2, 24, 25, PAD]])
    lengths = src.ne(PAD).sum(1)
    return {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
            "target": target, "ntokens": int(target.ne(PAD).sum()), "nsentences": 3}


SENTENCE_WORDS = ("a man woman dog runs jumps over the red blue ball child plays in park with water green house "
                  "two girls sit on bench near street").split()


def sentence_lines(n: int, seed: int) -> list[str]:
    """``n`` English-looking raw sentences (capitalised, a final full stop)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(SENTENCE_WORDS) for _ in range(rng.randint(1, 14))).capitalize() + "."
            for _ in range(n)]


def make_checkpoint(d: Path) -> Path:
    """A self-contained checkpoint in ``d``: random tiny Transformer, SentencePiece model and joined dictionary."""
    from attnmt.config import to_dict
    from attnmt.data.subword import SentencePieceBPE, TextPipeline
    from attnmt.fileio import atomic_torch_save

    load_components()
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(sentence_lines(300, 0)) + "\n", encoding="utf-8")
    bpe = SentencePieceBPE.train([str(corpus)], 60, str(d / "spm"))
    pipe = TextPipeline(None, bpe)
    vocab = Dictionary()
    for line in sentence_lines(300, 0):
        for p in pipe.encode(line).split():
            vocab.add_symbol(p)
    vocab.finalize(padding_factor=8)
    cfg = TransformerConfig(encoder_layers=2, decoder_layers=2, encoder_embed_dim=16, decoder_embed_dim=16,
                            encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=2,
                            decoder_attention_heads=2, share_all_embeddings=True, max_source_positions=96,
                            max_target_positions=96)
    torch.manual_seed(0)
    model = TransformerModel.build(cfg, len(vocab), len(vocab), vocab.pad(), joint_vocab=True)
    with torch.no_grad():  # make EOS likely enough that hypotheses end at different lengths
        model.decoder.output_projection.weight[vocab.eos()] *= 4
    data = {
        "source_lang": "en", "target_lang": "de", "joint_dictionary": True,
        "src_dict": vocab.to_state(), "tgt_dict": vocab.to_state(),
        "src_dict_sha256": vocab.checksum(), "tgt_dict_sha256": vocab.checksum(),
        "bpe": "sentencepiece",
        "bpe_model": torch.frombuffer(bytearray(bpe.model_bytes()), dtype=torch.uint8).clone(),
        "tokenizer": "moses", "lowercase": False,
    }
    state = {"format": "attnmt-checkpoint", "version": 1, "model_name": "transformer", "arch": "transformer_small",
             "model_config": to_dict(cfg), "model": model.state_dict(), "data": data}
    atomic_torch_save(state, d / "checkpoint_best.pt")
    return d / "checkpoint_best.pt"
