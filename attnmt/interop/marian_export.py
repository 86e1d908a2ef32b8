"""attnmt Transformer checkpoints -> MarianMT model directories (``attnmt export --to huggingface``), which
``transformers``' ``MarianMTModel``/``MarianTokenizer`` load and CTranslate2's transformers converter converts;
``check`` has transformers score attnmt's translations. Writing safetensors needs the optional ``safetensors``
package (``pip install 'attnmt[hf]'``).
"""

from __future__ import annotations

import json
import os

import torch

from attnmt.checkpoint import DataSection
from attnmt.data.dictionary import Dictionary
from attnmt.errors import UserError
from attnmt.fileio import write_directory
from attnmt.generation.beam import beam_search
from attnmt.generation.search import SearchConfig
from attnmt.inference import load_for_inference
from attnmt.interop.fairseq import layer_names
from attnmt.models.transformer import sinusoid_table


def _residual_order(cfg: dict) -> torch.Tensor:
    """The model width's order in the MarianMT model: Marian's sinusoids put all sines before all cosines, attnmt's
    (the paper's) interleave them with the same frequencies, so the MarianMT model is the attnmt model with its
    residual stream's coordinates reordered (every layer's weights along the width alike, LayerNorm included):
    the same function, exactly."""
    d = cfg["encoder_embed_dim"]
    if cfg.get("sinusoid_style", "paper") == "halves":
        return torch.arange(d)
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


# what an export writes (and, from before output markers, what --force recognises as an earlier export's)
FILES = {"config.json", "generation_config.json", "tokenizer_config.json", "vocab.json", "target_vocab.json",
         "source.spm", "target.spm", "model.safetensors"}


def export_marian(ckpt: dict, output_dir: str | os.PathLike, force: bool = False) -> str:
    """Write the attnmt Transformer checkpoint ``ckpt`` as a MarianMT model directory (config.json,
    generation_config.json, model.safetensors, vocab.json, source.spm/target.spm, tokenizer_config.json) that
    ``MarianMTModel``/``MarianTokenizer`` load and CTranslate2's transformers converter reads."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("attnmt export --to huggingface writes safetensors: pip install 'attnmt[hf]'") from None

    if ckpt.get("model_name") != "transformer":
        raise UserError(f"only the transformer model can be exported, not {ckpt.get('model_name')!r}")
    cfg, state = ckpt["model_config"], ckpt["model"]
    data = DataSection.from_dict(ckpt["data"], "the checkpoint")
    why = []
    if cfg.get("encoder_normalize_before") or cfg.get("decoder_normalize_before"):
        why.append("it is pre-norm (MarianMT is post-norm)")
    if cfg.get("learned_pos") or cfg.get("sinusoid_style", "paper") == "fairseq":
        why.append("its positions are not the paper's sinusoids")
    if cfg["encoder_embed_dim"] != cfg["decoder_embed_dim"] or cfg["encoder_attention_heads"] != \
            cfg["decoder_attention_heads"]:
        why.append("its encoder and decoder differ in width or heads")
    if cfg.get("attention_key_dim"):
        why.append(f"its attention keys are --attention-key-dim {cfg['attention_key_dim']} (MarianMT's are "
                   f"d_model / heads)")
    if data.bpe != "sentencepiece" or data.bpe_model_bytes() is None:
        why.append("its text is not segmented by a SentencePiece model it carries")
    if data.tokenizer != "none" or data.lowercase:
        why.append("it tokenizes or lowercases before SentencePiece")
    if data.language_tokens:
        why.append("it is multilingual")
    if why:
        raise UserError(f"this checkpoint cannot be written as a MarianMT model: {'; '.join(why)}")
    src_dict, tgt_dict = (Dictionary.from_state(data.src_dict), Dictionary.from_state(data.tgt_dict))
    if src_dict.pad() != tgt_dict.pad():
        raise UserError("the source and target padding ids differ; MarianMT has one padding id")
    order = _residual_order(cfg)
    joint = src_dict.checksum() == tgt_dict.checksum()
    shared_all = bool(cfg.get("share_all_embeddings"))
    tied = shared_all or bool(cfg.get("share_decoder_input_output_embed"))
    out: dict[str, torch.Tensor] = {}

    def cols(t):
        return t.float()[:, order].contiguous()

    def rows(t):
        return t.float()[order].contiguous()

    enc_emb, dec_emb = cols(state["encoder.embed.tokens.weight"]), cols(state["decoder.embed.tokens.weight"])
    if shared_all:
        out["model.shared.weight"] = enc_emb
    out["model.encoder.embed_tokens.weight"] = enc_emb.clone()
    out["model.decoder.embed_tokens.weight"] = dec_emb.clone()
    out["lm_head.weight"] = cols(state["decoder.output_projection.weight"])
    out["final_logits_bias"] = torch.zeros(1, len(tgt_dict))
    for ours, theirs, parts in layer_names(cfg):
        name = ours.rsplit(".", 1)[-1]
        for suffix in ("weight", "bias"):
            t = state[f"{ours}.{suffix}"].float()
            if name.endswith("norm") or name in ("out_proj", "fc2"):  # outputs on the residual stream
                t = rows(t)
            elif suffix == "weight":  # inputs from the residual stream
                t = cols(t)
            if not parts:
                out[f"model.{theirs}.{suffix}"] = t
            for part, piece in zip(parts, t.chunk(max(len(parts), 1), dim=0)):
                out[f"model.{theirs}.{part}.{suffix}"] = piece.contiguous()
    # the sinusoids (transformers computes them again on load)

    positions = max(cfg["max_source_positions"], cfg["max_target_positions"])
    table = sinusoid_table(positions, cfg["encoder_embed_dim"], "halves")
    out["model.encoder.embed_positions.weight"] = table
    out["model.decoder.embed_positions.weight"] = table.clone()
    sym = tgt_dict
    hf_cfg = {
        "architectures": ["MarianMTModel"], "model_type": "marian", "is_encoder_decoder": True,
        "d_model": cfg["encoder_embed_dim"], "encoder_layers": cfg["encoder_layers"],
        "decoder_layers": cfg["decoder_layers"], "encoder_attention_heads": cfg["encoder_attention_heads"],
        "decoder_attention_heads": cfg["decoder_attention_heads"], "encoder_ffn_dim": cfg["encoder_ffn_embed_dim"],
        "decoder_ffn_dim": cfg["decoder_ffn_embed_dim"], "activation_function": cfg.get("activation_fn", "relu"),
        "dropout": cfg["dropout"], "attention_dropout": cfg["attention_dropout"],
        "activation_dropout": cfg["activation_dropout"], "max_position_embeddings": positions,
        "scale_embedding": not cfg.get("no_scale_embedding", False), "vocab_size": len(src_dict),
        "decoder_vocab_size": len(tgt_dict), "share_encoder_decoder_embeddings": shared_all,
        "tie_word_embeddings": tied, "pad_token_id": sym.pad(), "eos_token_id": sym.eos(),
        "forced_eos_token_id": sym.eos(), "bos_token_id": None, "init_std": 0.02,
        "decoder_start_token_id": sym.index(data.decoder_start) if data.decoder_start else sym.eos(),
    }
    never = [[i] for i in (sym.pad(), sym.bos()) if i is not None]  # attnmt's search never writes them
    generation = {"decoder_start_token_id": hf_cfg["decoder_start_token_id"], "eos_token_id": sym.eos(),
                  "forced_eos_token_id": sym.eos(), "pad_token_id": sym.pad(), "bad_words_ids": never,
                  "max_length": positions, "num_beams": 4}
    tokenizer = {"tokenizer_class": "MarianTokenizer", "eos_token": sym.eos_word, "unk_token": sym.unk_word,
                 "pad_token": sym.pad_word, "model_max_length": cfg["max_source_positions"],
                 "separate_vocabs": not joint, "source_lang": data.source_lang, "target_lang": data.target_lang}

    def vocab_json(d: Dictionary) -> str:
        return json.dumps({s: i for i, s in enumerate(d.symbols)}, ensure_ascii=False, indent=1)

    files = {"config.json": json.dumps(hf_cfg, indent=2), "generation_config.json": json.dumps(generation, indent=2),
             "tokenizer_config.json": json.dumps(tokenizer, indent=2), "vocab.json": vocab_json(src_dict)}
    if not joint:
        files["target_vocab.json"] = vocab_json(tgt_dict)
    blobs = {"source.spm": data.bpe_model_bytes("src"), "target.spm": data.bpe_model_bytes("tgt")}
    return write_directory(output_dir, force, lambda tmp: (
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"}),
        [(tmp / k).write_text(v, encoding="utf-8") for k, v in files.items()],
        [(tmp / k).write_bytes(v) for k, v in blobs.items()]), known=FILES.__contains__)


def check(path: str | os.PathLike, output_dir: str | os.PathLike, lines: list[str]) -> float:
    """Largest difference between attnmt's log-probabilities of its translations of ``lines`` and those of the
    exported model, loaded by ``transformers`` (needed here only), for the same tokens."""
    try:
        from transformers import MarianMTModel, MarianTokenizer
    except ImportError:
        raise UserError("--check --to huggingface runs the exported model with transformers: pip install "
                        "transformers") from None

    bundle = load_for_inference(path)
    model = MarianMTModel.from_pretrained(str(output_dir)).eval()
    tok = MarianTokenizer.from_pretrained(str(output_dir))
    cfg = SearchConfig(beam=4, max_len_a=0, max_len_b=50)
    worst = 0.0
    for line in lines:
        src = bundle.encode_source(line)
        if tok(line)["input_ids"] != src:
            raise UserError(f"{output_dir}: MarianTokenizer segments {line[:60]!r} differently from attnmt")
        hyp = beam_search(bundle.model, torch.tensor([src]), torch.tensor([len(src)]), cfg, bundle.symbols)[0][0]
        prev = torch.tensor([[bundle.symbols.first] + hyp.tokens[:-1]])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([src]), decoder_input_ids=prev).logits[0]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(hyp.tokens)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(hyp.positional_scores)).abs().max()))
    return worst
