"""Build a MarianMT model directory locally, as ``save_pretrained`` writes one (config.json, model.safetensors,
vocab.json, source.spm, target.spm, tokenizer_config.json), from a config and random weights, with a SentencePiece
model learned on a text file: a stand-in for an OPUS-MT download where there is no network. Needs ``transformers``.

    python recipes/pretrained/build_marian.py --text ../shared/data/multi30k/train.en.gz --output opus-mt-local
    python recipes/pretrained/build_marian.py --text FILE --output DIR --shape opus-mt   # d 512, 6+6, 58,101 symbols

``--shape small`` (the default): d 64, 2+2 layers, the SentencePiece pieces only; ``opus-mt``: Helsinki-NLP/
opus-mt-en-de's shape (d 512, 6+6 layers, ffn 2048, 8 heads, swish), the vocabulary filled up to 58,101 symbols.
The weights are random: the model translates nonsense, but every tool that reads the format runs it.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

SHAPES = {
    "small": {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 256, "decoder_ffn_dim": 256, "vocab": 0,
              "pieces": 2000},
    "opus-mt": {"d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
                "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "vocab": 58101,
                "pieces": 4000},
}


def read_lines(path: str, n: int = 100_000) -> list[str]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f) if line.strip()]


def build(text: str, output: str | Path, shape: str = "small", seed: int = 0) -> Path:
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    s = SHAPES[shape]
    out = Path(output)
    work = out.parent / f".{out.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(read_lines(text)), model_prefix=str(work / "spm"),
                                   vocab_size=s["pieces"], model_type="unigram", unk_id=0, bos_id=-1, eos_id=-1,
                                   pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(work / "spm.model"))
    pieces = ["</s>", "<unk>"] + [sp.id_to_piece(i) for i in range(1, sp.get_piece_size())]
    pieces += [f"\u2581filler{i}" for i in range(max(0, s["vocab"] - 1 - len(pieces)))]
    pieces.append("<pad>")
    (work / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}), encoding="utf-8")
    v = len(pieces)
    config = MarianConfig(vocab_size=v, decoder_vocab_size=v, max_position_embeddings=512,
                          activation_function="swish", scale_embedding=True, pad_token_id=v - 1,
                          decoder_start_token_id=v - 1, eos_token_id=0, forced_eos_token_id=0,
                          bad_words_ids=[[v - 1]], num_beams=4, max_length=512,
                          **{k: x for k, x in s.items() if k not in ("vocab", "pieces")})
    torch.manual_seed(seed)
    MarianMTModel(config).save_pretrained(out)
    MarianTokenizer(str(work / "spm.model"), str(work / "spm.model"), str(work / "vocab.json")).save_pretrained(out)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", required=True, help="text (or .gz) to learn the SentencePiece model on")
    ap.add_argument("--output", required=True, help="the model directory to write")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build(args.text, args.output, args.shape, args.seed))


if __name__ == "__main__":
    main()
