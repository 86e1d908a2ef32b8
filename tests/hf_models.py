"""Small Hugging Face translation models built locally with ``transformers`` (random weights, trained for a few
dozen updates so that they end their sentences), with real SentencePiece tokenizers, saved with
``save_pretrained``: what the interop tests import and compare against."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import sentence_lines


def train_spm(lines: list[str], prefix: Path, vocab_size: int, controls: bool = False) -> Path:
    """A SentencePiece BPE model; ``controls``: with ``<s>`` and ``</s>`` as pieces 1 and 2 (NLLB's layout)."""
    import sentencepiece as spm

    ids = {"bos_id": 1, "eos_id": 2} if controls else {"bos_id": -1, "eos_id": -1}
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", unk_id=0, pad_id=-1, minloglevel=2, **ids)
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
        labels = batch.pop("labels")
        # the decoder's input, the targets shifted right behind the start token, given explicitly (FSMT would
        # otherwise shift the source)
        start = torch.full_like(labels[:, :1], model.config.decoder_start_token_id)
        batch["decoder_input_ids"] = torch.cat([start, labels[:, :-1]], dim=1)
        labels[labels == tokenizer.pad_token_id] = -100
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def toy_pairs() -> tuple[list[str], list[str]]:
    src_lines = sentence_lines(400, 1)
    return src_lines, [target_of(s) for s in src_lines]


def marian_dir(root: Path, separate: bool = False, activation: str = "swish", train_steps: int = 60,
               pairs: tuple[list[str], list[str]] | None = None, pieces: int = 120, d_model: int = 32) -> Path:
    """A MarianMT directory: 2+2 layers, d 32, swish, shared (or separate) SentencePiece vocabularies, trained on
    ``pairs`` (default: the toy pairs)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    root.mkdir(parents=True, exist_ok=True)
    src_lines, tgt_lines = pairs or toy_pairs()
    src_spm = train_spm(src_lines + ([] if separate else tgt_lines), root / "src", pieces)
    tgt_spm = train_spm(tgt_lines, root / "tgt", pieces) if separate else src_spm  # one padding id: same size

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
    config = MarianConfig(vocab_size=v, decoder_vocab_size=tv, d_model=d_model, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                          decoder_ffn_dim=2 * d_model, max_position_embeddings=256, activation_function=activation,
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


def m2m100_dir(root: Path, train_steps: int = 60, pairs: tuple[list[str], list[str]] | None = None,
               pieces: int = 120, d_model: int = 32) -> Path:
    """An M2M-100 directory: 2+2 pre-norm layers, d 32, one SentencePiece model, the 100 language tokens."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    root.mkdir(parents=True, exist_ok=True)
    src_lines, tgt_lines = pairs or toy_pairs()
    spm = train_spm(src_lines + tgt_lines, root / "spm", pieces)
    symbols = ["<s>", "<pad>", "</s>", "<unk>"] + spm_pieces(spm)[1:]
    (root / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(symbols)}), encoding="utf-8")
    tok = M2M100Tokenizer(str(root / "vocab.json"), str(spm), src_lang="en", tgt_lang="de")
    config = M2M100Config(vocab_size=len(symbols) + 100 + 8, d_model=d_model, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                          decoder_ffn_dim=2 * d_model, max_position_embeddings=256, dropout=0.0,
                          scale_embedding=True,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config)
    if train_steps:
        fit(model, tok, src_lines, tgt_lines, train_steps)
    out = root / "hf"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def nllb_dir(root: Path, train_steps: int = 60, pairs: tuple[list[str], list[str]] | None = None,
             pieces: int = 120, d_model: int = 32) -> Path:
    """An NLLB-200 directory: an M2M-100 model with ``NllbTokenizer`` (``tokenizer.json``: fairseq's four special
    symbols, the SentencePiece pieces, the 202 language codes, ``<mask>``) and ``sentencepiece.bpe.model`` beside
    it, as the hub's NLLB directories hold it."""
    import shutil

    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    root.mkdir(parents=True, exist_ok=True)
    src_lines, tgt_lines = pairs or toy_pairs()
    spm = train_spm(src_lines + tgt_lines, root / "spm", pieces, controls=True)
    (root / "tok").mkdir(exist_ok=True)
    shutil.copy(spm, root / "tok" / "sentencepiece.bpe.model")
    tok = NllbTokenizer.from_pretrained(str(root / "tok"), src_lang="eng_Latn", tgt_lang="deu_Latn",
                                        extra_special_tokens=list(FAIRSEQ_LANGUAGE_CODES))
    config = M2M100Config(vocab_size=len(tok) + 2, d_model=d_model, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
                          decoder_ffn_dim=2 * d_model, max_position_embeddings=256, dropout=0.0,
                          scale_embedding=True,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config)
    if train_steps:
        fit(model, tok, src_lines, tgt_lines, train_steps)
    out = root / "hf"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.copy(spm, out / "sentencepiece.bpe.model")
    return out


def incremental_log_probs(model, source: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-probability of each of ``tokens`` (the end of sentence included) given the ones before,
    decoded one token at a time with its cache, as ``generate`` decodes (FSMT's teacher-forced pass over a whole
    target is not causal: its first positions see later tokens)."""
    prev = [model.config.decoder_start_token_id] + tokens[:-1]
    past, out = None, []
    with torch.no_grad():
        for t, tok in enumerate(prev):
            step = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([[tok]]),
                         past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(torch.log_softmax(step.logits[0, -1].float(), -1)[tokens[t]])
    return torch.stack(out)


def compare(hf_dir, ckpt, lines, langs=None, max_new: int = 40):
    """(tokenizer ids identical, {beam: (identical hypotheses, max |log-prob difference|, of the others those that
    ran to the length limit)}): ``lines`` tokenized
    by both, translated by transformers' ``generate`` and attnmt's search under the same rules (no length
    penalty, no minimum length, the stop of ``early_stopping=True``, the end of sentence forced at the length
    limit), greedy and beam 4."""
    import transformers

    from attnmt.generation.beam import BeamSearchConfig
    from attnmt.generation.search import SearchConfig, search
    from attnmt.inference import load_for_inference

    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
    bundle = load_for_inference(ckpt)
    extra = {}
    if langs:
        tok.src_lang = langs[0]
        bundle.set_languages(*langs)
        extra = {"forced_bos_token_id": tok.convert_tokens_to_ids(bundle.language_token(langs[1]))}
    ours = bundle.encode_sources(lines)
    theirs = [tok(line)["input_ids"] for line in lines]
    same_ids = sum(a == b for a, b in zip(ours, theirs))
    results = {}
    for beam in (1, 4):
        cfg = SearchConfig(beam=beam, lenpen=0.0, min_len=0, max_len_a=0, max_len_b=max_new,
                           options=BeamSearchConfig(early_stop="beam"))
        same, worst, at_limit = 0, 0.0, 0
        for src, hf_src in zip(ours, theirs):
            hyp = search(bundle.model, torch.tensor([src]), torch.tensor([len(src)]), cfg, bundle.symbols)[0][0]
            with torch.no_grad():
                out = model.generate(torch.tensor([hf_src]), num_beams=beam, do_sample=False, length_penalty=0.0,
                                     early_stopping=True, max_new_tokens=max_new + 1,
                                     forced_eos_token_id=model.config.eos_token_id, **extra)[0].tolist()
            lp = incremental_log_probs(model, hf_src, hyp.tokens)
            skip = 1 if bundle.forced_first is not None else 0  # the forced token: 0 in both searches
            worst = max(worst, float((lp[skip:] - torch.tensor(hyp.positional_scores[skip:])).abs().max()))
            same += out[1:] == hyp.tokens
            # a sentence that runs to the limit: transformers scores the forced EOS 0, attnmt by its probability
            at_limit += out[1:] != hyp.tokens and max(len(out) - 1, len(hyp.tokens)) > max_new
        results[beam] = (same, worst, at_limit)
    return same_ids, results


def learn_merges(lines: list[str], merges: int) -> list[tuple[str, str]]:
    """BPE merges with an end-of-word marker, learned on Moses-tokenized ``lines`` (fastBPE's kind)."""
    from collections import Counter

    from attnmt.data.subword import MosesWmt19Tokenizer

    tok = MosesWmt19Tokenizer("en")
    words = Counter(w for line in lines for w in tok.encode(line).split())
    segs = {w: tuple(w[:-1]) + (w[-1] + "</w>",) for w in words}
    out = []
    for _ in range(merges):
        pairs = Counter()
        for w, seg in segs.items():
            for a, b in zip(seg, seg[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        out.append((a, b))
        for w, seg in segs.items():
            merged, i = [], 0
            while i < len(seg):
                if i < len(seg) - 1 and seg[i] == a and seg[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seg[i])
                    i += 1
            segs[w] = tuple(merged)
    return out


def fsmt_dir(root: Path, train_steps: int = 60, pairs: tuple[list[str], list[str]] | None = None,
             merges: int = 150, d_model: int = 32) -> Path:
    """An FSMT directory (fairseq's WMT'19 kind): 2+2 post-norm layers, Moses + BPE codes with an end-of-word
    marker, one vocabulary for both sides."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration, FSMTTokenizer

    root.mkdir(parents=True, exist_ok=True)
    src_lines, tgt_lines = pairs or toy_pairs()
    codes = learn_merges(src_lines + tgt_lines, merges)
    (root / "merges.txt").write_text("".join(f"{a} {b} 1\n" for a, b in codes), encoding="utf-8")
    chars = sorted({c for line in src_lines + tgt_lines for c in line if not c.isspace()})
    symbols = ["<s>", "<pad>", "</s>", "<unk>"]
    symbols += sorted({p for c in chars for p in (c, c + "</w>")} | {a + b for a, b in codes} | {"&apos;", "&quot;"})
    vocab = {s: i for i, s in enumerate(dict.fromkeys(symbols))}
    for side in ("src", "tgt"):
        (root / f"vocab-{side}.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = FSMTTokenizer(langs=["en", "de"], src_vocab_file=str(root / "vocab-src.json"),
                        tgt_vocab_file=str(root / "vocab-tgt.json"), merges_file=str(root / "merges.txt"))
    config = FSMTConfig(langs=["en", "de"], src_vocab_size=len(vocab), tgt_vocab_size=len(vocab), d_model=d_model,
                        encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, max_position_embeddings=256,
                        dropout=0.0, scale_embedding=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = FSMTForConditionalGeneration(config)
    if train_steps:
        fit(model, tok, src_lines, tgt_lines, train_steps)
    out = root / "hf"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
