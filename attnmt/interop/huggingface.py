"""Hugging Face ``transformers`` translation models <-> attnmt checkpoints.

A model directory as ``save_pretrained`` writes it (``config.json``; ``model.safetensors``, or ``pytorch_model.bin``
read with ``weights_only``; the tokenizer's files) becomes an attnmt checkpoint that carries its own text pipeline:

* ``marian`` (MarianMT, the OPUS-MT models): post-norm, sinusoids as all sines then all cosines from position 0
  (``sinusoid_style = halves``), the decoder started from ``<pad>``, ``vocab.json`` (and ``target_vocab.json`` where
  the sides have their own vocabularies) with ``source.spm`` and ``target.spm``.
* ``fsmt`` (fairseq's WMT'19 models): fairseq's transformer, post-norm, fairseq's sinusoids, separate
  vocabularies (``vocab-src.json``, ``vocab-tgt.json``), Moses (``moses_wmt19``) and BPE codes with an end-of-word
  marker (``merges.txt``, ``fastbpe``).
* ``m2m_100`` (M2M-100 and NLLB-200): pre-norm with a final LayerNorm per stack, fairseq's sinusoids numbered from
  2, the source starting with its language's token and the target's language token forced as the first one
  generated, ``sentencepiece.bpe.model`` with ``vocab.json`` (``M2M100Tokenizer``) or ``tokenizer.json``
  (``NllbTokenizer``).

The layers are fairseq's under ``model.`` (``interop/fairseq.py`` maps them); the vocabularies keep their ids
(``Dictionary.from_vocabulary``), so the ids attnmt reads and writes are the ones ``transformers`` does.
``interop/marian_export.py`` writes an attnmt Transformer as a MarianMT directory, ``interop/hub.py`` finds a hub
model in the Hugging Face cache. Reading safetensors needs the optional ``safetensors`` package (``pip install
'attnmt[hf]'``); ``transformers`` itself is never needed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from attnmt import checkpoint, registry
from attnmt.config import make_config, to_dict
from attnmt.data.dictionary import Dictionary
from attnmt.data.subword import FastBPE, SentencePieceBPE
from attnmt.errors import UserError
from attnmt.interop.fairseq import layer_names
from attnmt.models.interface import build_model
from attnmt.models.transformer import sinusoid_table

SUPPORTED = ("marian", "m2m_100", "fsmt")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


# --------------------------------------------------------------------------------------------- reading


def _json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: not found; {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({str(e)[:120]}); give the file save_pretrained wrote") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object; give the file save_pretrained wrote")
    return data


def read_config(model_dir: str | os.PathLike) -> dict:
    """The directory's ``config.json``, its model type checked against those attnmt imports."""
    d = Path(model_dir)
    if not d.is_dir():
        raise UserError(f"{d}: not a directory; give a Hugging Face model directory (config.json, "
                        f"model.safetensors, tokenizer files)")
    cfg = _json(d / "config.json", "a Hugging Face model directory holds config.json")
    kind = str(cfg.get("model_type") or "")
    if kind not in SUPPORTED:
        raise UserError(f"{d / 'config.json'}: a '{kind or 'unnamed'}' model; attnmt imports the encoder-decoder "
                        f"translation models of type {', '.join(SUPPORTED)} (MarianMT/OPUS-MT, M2M-100 and NLLB-200, FSMT)")
    return cfg


def read_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict of ``model.safetensors`` or ``pytorch_model.bin`` (no code is run to read either)."""
    d = Path(model_dir)
    st, pt = d / "model.safetensors", d / "pytorch_model.bin"
    if st.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise UserError(f"{st}: reading safetensors needs the safetensors package: pip install "
                            f"'attnmt[hf]'") from None
        try:
            return load_file(str(st))
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file, said in one line
            raise UserError(f"{st}: cannot be read as safetensors ({str(e).splitlines()[0][:160]}); give the "
                            f"file save_pretrained wrote") from None
    if pt.is_file():
        try:
            state = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a pickle with a payload is refused, not run
            raise UserError(f"{pt}: cannot be read with weights_only ({str(e).splitlines()[0][:160]}); it may "
                            f"hold code: convert it to safetensors with the tool that wrote it") from None
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise UserError(f"{pt}: not a state dict of tensors; give the file save_pretrained wrote")
        return state
    raise UserError(f"{d}: holds neither model.safetensors nor pytorch_model.bin; give the directory "
                    f"save_pretrained wrote")


def _vocabulary(path: Path, size: int, what: str) -> list[str]:
    """The symbols of a ``vocab.json`` ({symbol: id}) by id, checked to be the ids 0..size-1."""
    vocab = _json(path, f"the {what} vocabulary")
    by_id: dict[int, str] = {}
    for sym, i in vocab.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i:
            raise UserError(f"{path}: {sym!r} has id {i!r}; ids must be non-negative integers")
        by_id.setdefault(i, sym)
    n = max(by_id) + 1 if by_id else 0
    missing = [i for i in range(min(n, size)) if i not in by_id]
    if missing:
        raise UserError(f"{path}: no symbol has id {missing[0]}; give the model's own vocabulary file")
    if n != size:
        raise UserError(f"{path}: {n} symbols, but config.json says the {what} vocabulary has {size}; give the "
                        f"tokenizer files saved with this model")
    return [by_id[i] for i in range(n)]


def _spm_bytes(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise UserError(f"{path}: not found; the {what} SentencePiece model is one of the tokenizer files")
    data = path.read_bytes()
    SentencePieceBPE.from_bytes(data, what=str(path))  # a clear error for a file that is not one
    return data


def _tensor(state: dict, key: str, shape: tuple, path: Path) -> torch.Tensor:
    if key not in state:
        raise UserError(f"{path}: the weights have no {key}; give the weights saved with config.json")
    t = state[key]
    if tuple(t.shape) != shape:
        raise UserError(f"{path}: {key} has shape {tuple(t.shape)}, config.json implies {shape}; the weights and "
                        f"config.json do not belong together")
    return t.float()


def _first(state: dict, *keys: str):
    return next((k for k in keys if k in state), keys[0])


# --------------------------------------------------------------------------------------------- families


def _common_fields(cfg: dict, path: Path) -> dict:
    act = str(cfg.get("activation_function") or "relu")
    if act not in ACTIVATIONS:
        raise UserError(f"{path}: activation_function {act!r} has no counterpart in attnmt's Transformer "
                        f"(relu, gelu, swish); this model cannot be imported")
    d = int(cfg["d_model"])
    fields = {
        "encoder_layers": int(cfg["encoder_layers"]), "decoder_layers": int(cfg["decoder_layers"]),
        "encoder_embed_dim": d, "decoder_embed_dim": d,
        "encoder_ffn_embed_dim": int(cfg["encoder_ffn_dim"]), "decoder_ffn_embed_dim": int(cfg["decoder_ffn_dim"]),
        "encoder_attention_heads": int(cfg["encoder_attention_heads"]),
        "decoder_attention_heads": int(cfg["decoder_attention_heads"]),
        "dropout": float(cfg.get("dropout") or 0.0), "attention_dropout": float(cfg.get("attention_dropout") or 0.0),
        "activation_dropout": float(cfg.get("activation_dropout") or 0.0),
        "no_scale_embedding": not bool(cfg.get("scale_embedding", False)),
        "activation_fn": ACTIVATIONS[act],
        "max_source_positions": int(cfg.get("max_position_embeddings") or 1024),
        "max_target_positions": int(cfg.get("max_position_embeddings") or 1024),
    }
    return fields


def _layers(state: dict, fields: dict, path: Path) -> dict[str, torch.Tensor]:
    """The layers' weights, HF (fairseq under ``model.``) names -> attnmt's, shapes checked by the caller's load."""
    out = {}
    for ours, theirs, parts in layer_names(fields):
        for suffix in ("weight", "bias"):
            pieces = [f"model.{theirs}.{n}.{suffix}" for n in parts] or [f"model.{theirs}.{suffix}"]
            missing = [k for k in pieces if k not in state]
            if missing:
                raise UserError(f"{path}: the weights have no {missing[0]}; give the weights saved with "
                                f"config.json")
            out[f"{ours}.{suffix}"] = torch.cat([state[k].float() for k in pieces], dim=0)
    return out


def _stored_positions(state: dict, fields: dict, weights: dict, path: Path) -> None:
    """Where the weights hold position tables (FSMT's are parameters) that are not the sinusoids they started as,
    they are what the model was trained with: the model takes them as learned positions (fairseq's rows from
    index 2 on)."""
    tables = {side: state.get(f"model.{side}.embed_positions.weight") for side in ("encoder", "decoder")}
    if any(t is None for t in tables.values()):
        return
    n = fields["max_source_positions"]
    rows = {side: t.float()[2:2 + n] for side, t in tables.items()}
    if any(r.size(0) < n for r in rows.values()):
        raise UserError(f"{path}: the position tables hold fewer than max_position_embeddings {n} positions")
    if all(torch.allclose(r, sinusoid_table(n, r.size(1), "fairseq"), atol=1e-5) for r in rows.values()):
        return
    fields["learned_pos"] = True
    for side, r in rows.items():
        weights[f"{side}.embed.positions.weight"] = r.clone()


def _marian(d: Path, cfg: dict, state: dict) -> tuple[dict, dict, dict]:
    """(model config fields, attnmt weights, data section fields) of a MarianMT directory."""
    fields = _common_fields(cfg, d / "config.json")
    if cfg.get("normalize_before") or cfg.get("add_final_layer_norm") or cfg.get("normalize_embedding"):
        raise UserError(f"{d / 'config.json'}: a Marian model with extra LayerNorms (normalize_before, "
                        f"normalize_embedding) has no counterpart in attnmt's Transformer")
    fields["sinusoid_style"] = "halves"
    src_v = int(cfg["vocab_size"])
    tgt_v = int(cfg.get("decoder_vocab_size") or src_v)
    shared = bool(cfg.get("share_encoder_decoder_embeddings", True))
    tok_cfg = _json(d / "tokenizer_config.json", "the tokenizer files") if (d / "tokenizer_config.json").is_file() \
        else {}
    separate = bool(tok_cfg.get("separate_vocabs")) or (d / "target_vocab.json").is_file()
    src_syms = _vocabulary(d / "vocab.json", src_v, "source")
    tgt_syms = _vocabulary(d / "target_vocab.json", tgt_v, "target") if separate else src_syms
    if not separate and tgt_v != src_v:
        raise UserError(f"{d}: config.json has decoder_vocab_size {tgt_v} but there is no target_vocab.json; give "
                        f"the tokenizer files saved with this model")
    pad_id, eos_id = int(cfg["pad_token_id"]), int(cfg["eos_token_id"])
    start_id = int(cfg.get("decoder_start_token_id", pad_id))
    specials = {"pad": str(tok_cfg.get("pad_token") or "<pad>"), "eos": str(tok_cfg.get("eos_token") or "</s>"),
                "unk": str(tok_cfg.get("unk_token") or "<unk>")}
    dicts = []
    for side, syms in (("source", src_syms), ("target", tgt_syms)):
        try:
            dicts.append(Dictionary.from_vocabulary(syms, **specials))
        except UserError as e:
            raise UserError(f"{d}: the {side} vocabulary: {e}") from None
    src_dict, tgt_dict = dicts
    if tgt_dict.pad() != pad_id or tgt_dict.eos() != eos_id:
        raise UserError(f"{d / 'config.json'}: pad_token_id {pad_id} / eos_token_id {eos_id} are not the ids of "
                        f"{specials['pad']!r} / {specials['eos']!r} in the vocabulary ({tgt_dict.pad()} / "
                        f"{tgt_dict.eos()}); give the tokenizer files saved with this model")
    if src_dict.pad() != tgt_dict.pad():
        raise UserError(f"{d}: the padding symbol has id {src_dict.pad()} in the source vocabulary and "
                        f"{tgt_dict.pad()} in the target one; attnmt's Transformer needs one padding id")
    bias = state.get("final_logits_bias")
    if bias is not None and bool(bias.float().abs().max() > 0):
        raise UserError(f"{d}: the model has a non-zero final_logits_bias, which attnmt's Transformer does not "
                        f"carry; this model cannot be imported")
    d_model = fields["encoder_embed_dim"]
    path = d / "model.safetensors"
    enc_key = _first(state, "model.encoder.embed_tokens.weight", "model.shared.weight")
    dec_key = _first(state, "model.decoder.embed_tokens.weight", "model.shared.weight")
    weights = _layers(state, fields, path)
    weights["encoder.embed.tokens.weight"] = _tensor(state, enc_key, (src_v, d_model), path)
    weights["decoder.embed.tokens.weight"] = _tensor(state, dec_key, (tgt_v, d_model), path)
    tied = bool(cfg.get("tie_word_embeddings", True))
    if tied:
        weights["decoder.output_projection.weight"] = weights["decoder.embed.tokens.weight"]
    else:
        weights["decoder.output_projection.weight"] = _tensor(state, "lm_head.weight", (tgt_v, d_model), path)
    joint = shared and not separate and src_v == tgt_v
    fields["share_all_embeddings"] = joint and tied
    fields["share_decoder_input_output_embed"] = tied and not fields["share_all_embeddings"]
    src_spm = _spm_bytes(d / "source.spm", "source")
    tgt_spm = _spm_bytes(d / "target.spm", "target")
    data = {"src_dict": src_dict, "tgt_dict": tgt_dict, "joint": joint, "bpe_model": src_spm,
            "tgt_bpe_model": None if tgt_spm == src_spm else tgt_spm, "decoder_start": tgt_dict[start_id],
            "source_lang": tok_cfg.get("source_lang"), "target_lang": tok_cfg.get("target_lang"),
            "language_tokens": None}
    return fields, weights, data


M2M100_LANGUAGES = (
    "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr ht hu hy "
    "id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa pl ps pt ro ru "
    "sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu").split()  # the tokenizer's order
WMT21_LANGUAGES = "en ha is ja cs ru zh de".split()


def _m2m100_symbols(d: Path, tok_cfg: dict) -> tuple[list[str], dict[str, str], Path]:
    """(the symbols by id, {language code: its token}, the file they came from) of an M2M-100 model's tokenizer:
    ``M2M100Tokenizer``'s ``vocab.json`` followed by its fixed list of language tokens, or a ``tokenizer.json``
    (NLLB-200's ``NllbTokenizer``: fairseq's four special symbols, the SentencePiece pieces, then the language codes
    and ``<mask>`` as added special tokens)."""
    if (d / "vocab.json").is_file():
        path = d / "vocab.json"
        vocab = _json(path, "the vocabulary")
        syms = [None] * len(vocab)
        for sym, i in vocab.items():
            if not isinstance(i, int) or not 0 <= i < len(vocab) or syms[i] is not None:
                raise UserError(f"{path}: {sym!r} has id {i!r}; ids must be 0..{len(vocab) - 1}, once each")
            syms[i] = sym
        codes = M2M100_LANGUAGES if str(tok_cfg.get("language_codes") or "m2m100") == "m2m100" else WMT21_LANGUAGES
        languages = {c: f"__{c}__" for c in codes}
        return syms + [languages[c] for c in codes], languages, path
    path = d / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{d}: neither vocab.json (M2M100Tokenizer) nor tokenizer.json (NllbTokenizer); give the "
                        f"tokenizer files saved with this model")
    if tok_cfg.get("legacy_behaviour"):
        raise UserError(f"{d / 'tokenizer_config.json'}: legacy_behaviour puts the language token after </s>; "
                        f"attnmt reads NLLB's default layout (the language token first): save the tokenizer with "
                        f"legacy_behaviour=False")
    spec = _json(path, "the tokenizer")
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    added = spec.get("added_tokens") if isinstance(spec.get("added_tokens"), list) else []
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UserError(f"{path}: a {model.get('type')!r} tokenizer; attnmt reads the BPE tokenizer.json of "
                        f"NLLB-200 (NllbTokenizer)")
    table = dict(model["vocab"])
    for token in added:
        if not isinstance(token, dict) or not isinstance(token.get("content"), str):
            raise UserError(f"{path}: an added token that is not {{\"id\": ..., \"content\": ...}}")
        table[token["content"]] = token.get("id")
    syms = [None] * len(table)
    for sym, i in table.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(table) or syms[i] is not None:
            raise UserError(f"{path}: {sym!r} has id {i!r}; ids must be 0..{len(table) - 1}, once each")
        syms[i] = sym
    specials = {str(tok_cfg.get(k) or default) for k, default in
                (("bos_token", "<s>"), ("pad_token", "<pad>"), ("eos_token", "</s>"), ("unk_token", "<unk>"),
                 ("mask_token", "<mask>"))}
    languages = {}
    for token in added:
        sym = token["content"]
        if token.get("special") and sym not in specials:
            languages[sym[2:-2] if sym.startswith("__") and sym.endswith("__") else sym] = sym
    if not languages:
        raise UserError(f"{path}: no language tokens among the added tokens; give the tokenizer files saved "
                        f"with this model")
    return syms, languages, path


def _m2m100(d: Path, cfg: dict, state: dict) -> tuple[dict, dict, dict]:
    """(model config fields, attnmt weights, data section fields) of an M2M-100 or NLLB-200 directory."""
    fields = _common_fields(cfg, d / "config.json")
    fields.update(encoder_normalize_before=True, decoder_normalize_before=True, sinusoid_style="fairseq")
    v = int(cfg["vocab_size"])
    tok_cfg = _json(d / "tokenizer_config.json", "the tokenizer files") if (d / "tokenizer_config.json").is_file() \
        else {}
    syms, languages, vocab_path = _m2m100_symbols(d, tok_cfg)
    syms += [f"madeupword{i:04d}" for i in range(v - len(syms))]  # fairseq's padding of the vocabulary
    if len(syms) != v:
        raise UserError(f"{d}: {vocab_path.name} and the language tokens make {len(syms)} symbols, but config.json "
                        f"says {v}; give the tokenizer files saved with this model")
    try:
        vocabulary = Dictionary.from_vocabulary(syms, pad=str(tok_cfg.get("pad_token") or "<pad>"),
                                                eos=str(tok_cfg.get("eos_token") or "</s>"),
                                                unk=str(tok_cfg.get("unk_token") or "<unk>"),
                                                bos=str(tok_cfg.get("bos_token") or "<s>"))
    except UserError as e:
        raise UserError(f"{vocab_path}: {e}") from None
    if vocabulary.pad() != int(cfg["pad_token_id"]) or vocabulary.eos() != int(cfg["eos_token_id"]):
        raise UserError(f"{d / 'config.json'}: pad_token_id / eos_token_id are not the ids of <pad> / </s> in "
                        f"{vocab_path.name}; give the tokenizer files saved with this model")
    d_model = fields["encoder_embed_dim"]
    path = d / "model.safetensors"
    weights = _layers(state, fields, path)
    shared = _tensor(state, _first(state, "model.shared.weight", "model.encoder.embed_tokens.weight"), (v, d_model),
                     path)
    weights["encoder.embed.tokens.weight"] = weights["decoder.embed.tokens.weight"] = shared
    weights["decoder.output_projection.weight"] = shared
    for side in ("encoder", "decoder"):
        for suffix in ("weight", "bias"):
            weights[f"{side}.final_norm.{suffix}"] = _tensor(state, f"model.{side}.layer_norm.{suffix}", (d_model,),
                                                             path)
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"].float(), shared):
        raise UserError(f"{path}: lm_head.weight differs from the shared embeddings; attnmt imports M2M-100 "
                        f"models with tied output embeddings")
    fields["share_all_embeddings"] = True
    spm = _spm_bytes(d / "sentencepiece.bpe.model", "")
    data = {"src_dict": vocabulary, "tgt_dict": vocabulary, "joint": True, "bpe_model": spm, "tgt_bpe_model": None,
            "decoder_start": vocabulary[int(cfg.get("decoder_start_token_id", vocabulary.eos()))],
            "source_lang": tok_cfg.get("src_lang") or next((c for c in ("en", "eng_Latn") if c in languages), None),
            "target_lang": tok_cfg.get("tgt_lang"),
            "language_tokens": languages}
    return fields, weights, data


def _fsmt(d: Path, cfg: dict, state: dict) -> tuple[dict, dict, dict]:
    """(model config fields, attnmt weights, data section fields) of an FSMT directory (fairseq's WMT'19 models:
    post-norm, fairseq's sinusoids, separate vocabularies, Moses and BPE codes with an end-of-word marker)."""
    fields = _common_fields(cfg, d / "config.json")
    fields["sinusoid_style"] = "fairseq"
    src_v, tgt_v = int(cfg["src_vocab_size"]), int(cfg["tgt_vocab_size"])
    langs = cfg.get("langs") or ["src", "tgt"]
    tok_cfg = _json(d / "tokenizer_config.json", "the tokenizer files") if (d / "tokenizer_config.json").is_file() \
        else {}
    fields_lower = bool(tok_cfg.get("do_lower_case"))
    dicts = []
    for side, name, size in (("source", "vocab-src.json", src_v), ("target", "vocab-tgt.json", tgt_v)):
        syms = _vocabulary(d / name, size, side)
        try:
            dicts.append(Dictionary.from_vocabulary(syms, pad="<pad>", eos="</s>", unk="<unk>", bos="<s>"))
        except UserError as e:
            raise UserError(f"{d / name}: {e}") from None
    src_dict, tgt_dict = dicts
    if src_dict.pad() != tgt_dict.pad() or tgt_dict.pad() != int(cfg.get("pad_token_id", 1)):
        raise UserError(f"{d}: the vocabularies' padding ids differ from config.json's pad_token_id")
    d_model = fields["encoder_embed_dim"]
    path = d / "model.safetensors"
    weights = _layers(state, fields, path)
    weights["encoder.embed.tokens.weight"] = _tensor(state, "model.encoder.embed_tokens.weight", (src_v, d_model),
                                                     path)
    weights["decoder.embed.tokens.weight"] = _tensor(state, "model.decoder.embed_tokens.weight", (tgt_v, d_model),
                                                     path)
    tied = bool(cfg.get("tie_word_embeddings", False))
    key = _first(state, "model.decoder.output_projection.weight", "lm_head.weight")
    weights["decoder.output_projection.weight"] = weights["decoder.embed.tokens.weight"] if tied and key not in \
        state else _tensor(state, key, (tgt_v, d_model), path)
    fields["share_decoder_input_output_embed"] = tied
    _stored_positions(state, fields, weights, path)
    merges = d / "merges.txt"
    if not merges.is_file():
        raise UserError(f"{merges}: not found; the BPE merges are one of the tokenizer files")

    FastBPE(merges.read_bytes(), str(merges))  # a clear error for a file that is not one
    joint = src_dict.checksum() == tgt_dict.checksum()
    data = {"src_dict": src_dict, "tgt_dict": tgt_dict, "joint": joint, "bpe": "fastbpe",
            "bpe_model": merges.read_bytes(), "tgt_bpe_model": None,
            "decoder_start": tgt_dict[int(cfg.get("decoder_start_token_id", tgt_dict.eos()))],
            "source_lang": langs[0], "target_lang": langs[1], "language_tokens": None,
            "tokenizer": "moses_wmt19", "lowercase": fields_lower}
    return fields, weights, data


FAMILIES = {"marian": _marian, "m2m_100": _m2m100, "fsmt": _fsmt}


def import_model(model_dir: str | os.PathLike, source_lang: str | None = None,
                 target_lang: str | None = None) -> dict:
    """An attnmt checkpoint (inference- and ``--finetune-from``-ready) holding the Hugging Face model in
    ``model_dir`` with its vocabularies and SentencePiece models."""
    d = Path(model_dir)
    cfg = read_config(d)
    state = read_weights(d)
    fields, weights, data = FAMILIES[cfg["model_type"]](d, cfg, state)
    src = source_lang or data["source_lang"]
    tgt = target_lang or data["target_lang"]
    languages = data["language_tokens"]
    if languages:
        for given, what in ((src, "source"), (tgt, "target")):
            if not given:
                raise UserError(f"{d}: a multilingual model; give the {what} language (--{what}-lang, one of "
                                f"{', '.join(sorted(languages)[:10])}, ...)")
            if given not in languages:
                raise UserError(f"--{what}-lang {given}: not a language of {d.name} (one of "
                                f"{', '.join(sorted(languages)[:10])}, ...)")
    src, tgt = src or "src", tgt or "tgt"
    model_cfg = make_config(registry.get("model", "transformer").config, fields, what=f"{d / 'config.json'}")
    src_dict, tgt_dict = data["src_dict"], data["tgt_dict"]
    model = build_model("transformer", model_cfg, len(src_dict), len(tgt_dict), src_dict.pad(),
                        joint_vocab=data["joint"])
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).strip().splitlines()[:2])[:300]
        raise UserError(f"{d}: the weights do not fit the model config.json describes ({detail})") from None

    def as_tensor(raw: bytes | None):
        return None if raw is None else torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    section = checkpoint.DataSection(
        source_lang=src, target_lang=tgt, joint_dictionary=data["joint"], src_dict=src_dict.to_state(),
        tgt_dict=tgt_dict.to_state(), src_dict_sha256=src_dict.checksum(), tgt_dict_sha256=tgt_dict.checksum(),
        bpe=data.get("bpe", "sentencepiece"), bpe_model=as_tensor(data["bpe_model"]),
        tgt_bpe_model=as_tensor(data["tgt_bpe_model"]), tokenizer=data.get("tokenizer", "none"),
        lowercase=bool(data.get("lowercase", False)),
        decoder_start=data["decoder_start"] if data["decoder_start"] != tgt_dict.eos_word else "",
        language_tokens=languages)
    return {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "model_name": "transformer",
            "arch": f"hf_{cfg['model_type']}", "model_config": to_dict(model_cfg),
            "model": checkpoint.portable_weights(model.state_dict()), "data": section.to_dict(),
            "imported_from": {"toolkit": "transformers", "model_type": cfg["model_type"], "path": str(d)}}
