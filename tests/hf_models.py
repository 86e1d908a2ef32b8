"""Small Hugging Face translation models built locally with ``transformers`` (random weights, trained for a few
dozen updates so that they end their sentences), with real SentencePiece tokenizers, saved with
``save_pretrained``: what the interop tests import and compare against."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import sentence_lines


def train_spm(lines: list[str], prefix: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, minloglevel=2)
    return prefix.with_suffix(".model")


def spm_pieces(model: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def target_of(line: str) -> str:
    """The toy 'translation' the models are trained on: the words reversed."""
    return " ".join(reversed(line.rstrip(".").split())) + "."


def fit(model, tokenizer, sources: list[str], targets: list[str], steps: int = 60, lr: float = 3e-3) -> None:
    """A few updates of teacher forcing, enough for the model to learn where sentences end."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        i = (step * 32) % len(sources)
        batch = tokenizer(sources[i:i + 32], text_target=targets[i:i + 32], return_tensors="pt", padding=True)
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def marian_dir(root: Path, separate: bool = False, activation: str = "swish", train_steps: int = 60) -> Path:
    """A MarianMT directory: 2+2 layers, d 32, swish, shared (or separate) SentencePiece vocabularies."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    root.mkdir(parents=True, exist_ok=True)
    src_lines = sentence_lines(400, 1)
    tgt_lines = [target_of(s) for s in src_lines]
    src_spm = train_spm(src_lines + ([] if separate else tgt_lines), root / "src", 120)
    tgt_spm = train_spm(tgt_lines, root / "tgt", 120) if separate else src_spm  # one padding id: same size

    def vocab(model: Path) -> dict:
        pieces = ["</s>", "<unk>"] + spm_pieces(model)[1:] + ["<pad>"]
        return {p: i for i, p in enumerate(pieces)}

    src_vocab = vocab(src_spm)
    (root / "vocab.json").write_text(json.dumps(src_vocab), encoding="utf-8")
    kw = {}
    if separate:
        tgt_vocab = vocab(tgt_spm)
        (root / "target_vocab.json").write_text(json.dumps(tgt_vocab), encoding="utf-8")
        kw = {"target_vocab_file": str(root / "target_vocab.json"), "separate_vocabs": True}
    tok = MarianTokenizer(str(src_spm), str(tgt_spm), str(root / "vocab.json"), **kw)
    out = root / "hf"
    v = len(src_vocab)
    tv = len(tgt_vocab) if separate else v
    config = MarianConfig(vocab_size=v, decoder_vocab_size=tv, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=128, activation_function=activation,
                          scale_embedding=True, pad_token_id=v - 1, decoder_start_token_id=tv - 1, eos_token_id=0,
                          forced_eos_token_id=0, share_encoder_decoder_embeddings=not separate,
                          dropout=0.0, bad_words_ids=[[tv - 1]])
    torch.manual_seed(0)
    model = MarianMTModel(config)
    if train_steps:
        fit(model, tok, src_lines, tgt_lines, train_steps)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def m2m100_dir(root: Path, train_steps: int = 60) -> Path:
    """An M2M-100 directory: 2+2 pre-norm layers, d 32, one SentencePiece model, the 100 language tokens."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    src_lines = sentence_lines(400, 1)
    tgt_lines = [target_of(s) for s in src_lines]
    spm = train_spm(src_lines + tgt_lines, root / "spm", 120)
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + spm_pieces(spm)[1:]
    (root / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}), encoding="utf-8")
    tok = M2M100Tokenizer(str(root / "vocab.json"), str(spm), src_lang="en", tgt_lang="de")
    config = M2M100Config(vocab_size=len(pieces) + 100 + 8, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=128, dropout=0.0, scale_embedding=True,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config)
    if train_steps:
        fit(model, tok, src_lines, tgt_lines, train_steps)
    out = root / "hf"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
