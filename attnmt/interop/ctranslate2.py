"""attnmt Transformer checkpoints -> CTranslate2 model directories (``attnmt export --to ctranslate2``).

The mapping, layer by layer: fused Q/K/V (self-attention) and fused K/V (encoder-decoder attention) go to
CTranslate2's fused linear layers unchanged; post-norm (the paper) or pre-norm; ReLU (or the imported model's GELU or swish); embeddings scaled by
sqrt(d_model); the positional table is stored explicitly, because attnmt interleaves sin/cos (as the paper) while
CTranslate2's built-in sinusoids concatenate them; the source gets its EOS appended and decoding starts from EOS,
as in attnmt (from the model's own start symbol for an imported one: ``<pad>`` for Marian). ``<pad>`` is renamed ``<blank>`` (CTranslate2's padding symbol). Needs the optional ``ctranslate2``
package (``pip install 'attnmt[ctranslate2]'``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from attnmt.errors import UserError
from attnmt.fileio import write_directory
from attnmt.generation.beam import beam_search
from attnmt.generation.search import SearchConfig
from attnmt.inference import load_for_inference
from attnmt.models.transformer import sinusoid_table


def _ctranslate2():
    try:
        import ctranslate2
        import ctranslate2.converters.converter  # noqa: F401
    except ImportError:
        raise UserError("attnmt export --to ctranslate2 needs the ctranslate2 package: pip install "
                        "'attnmt[ctranslate2]' (or ctranslate2)") from None
    return ctranslate2


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _linear(spec, state: dict, prefix: str) -> None:
    spec.weight = _np(state[f"{prefix}.weight"])
    if f"{prefix}.bias" in state:
        spec.bias = _np(state[f"{prefix}.bias"])


def _norm(spec, state: dict, prefix: str) -> None:
    spec.gamma = _np(state[f"{prefix}.weight"])
    spec.beta = _np(state[f"{prefix}.bias"])


def _positions(cfg: dict, state: dict, side: str, dim: int, count: int) -> np.ndarray:
    if cfg.get("learned_pos"):
        return _np(state[f"{side}.embed.positions.weight"])

    return _np(sinusoid_table(count, dim, cfg.get("sinusoid_style", "paper")))


def build_spec(ckpt: dict):
    """The CTranslate2 ``TransformerSpec`` holding the checkpoint's weights and vocabularies."""
    if ckpt.get("model_config", {}).get("attention_key_dim"):
        raise UserError(f"CTranslate2 holds attention keys of d_model / heads only, and this model's are "
                        f"--attention-key-dim {ckpt['model_config']['attention_key_dim']}; translate it with attnmt")
    _ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, state, data = ckpt["model_config"], ckpt["model"], ckpt["data"]
    if ckpt.get("model_name") != "transformer":
        raise UserError(f"only the 'transformer' model can be exported, not {ckpt.get('model_name')!r}")
    if cfg["encoder_normalize_before"] != cfg["decoder_normalize_before"]:
        raise UserError("CTranslate2 needs the same normalisation (pre- or post-norm) in encoder and decoder")
    if cfg["encoder_attention_heads"] != cfg["decoder_attention_heads"]:
        raise UserError("CTranslate2 needs the same number of attention heads in encoder and decoder")
    pre_norm = bool(cfg["encoder_normalize_before"])
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "swish": common_spec.Activation.SWISH}[cfg.get("activation_fn", "relu")]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg["encoder_layers"], cfg["decoder_layers"]), cfg["encoder_attention_heads"], pre_norm=pre_norm,
        activation=activation)

    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = _np(state["encoder.embed.tokens.weight"])
    dec.embeddings.weight = _np(state["decoder.embed.tokens.weight"])
    enc.scale_embeddings = dec.scale_embeddings = not cfg.get("no_scale_embedding", False)
    enc.position_encodings.encodings = _positions(cfg, state, "encoder", cfg["encoder_embed_dim"],
                                                  cfg["max_source_positions"])
    dec.position_encodings.encodings = _positions(cfg, state, "decoder", cfg["decoder_embed_dim"],
                                                  cfg["max_target_positions"])
    for i, layer in enumerate(enc.layer):
        p = f"encoder.layers.{i}"
        _linear(layer.self_attention.linear[0], state, f"{p}.self_attn.qkv_proj")
        _linear(layer.self_attention.linear[1], state, f"{p}.self_attn.out_proj")
        _norm(layer.self_attention.layer_norm, state, f"{p}.self_attn_norm")
        _linear(layer.ffn.linear_0, state, f"{p}.ffn.fc1")
        _linear(layer.ffn.linear_1, state, f"{p}.ffn.fc2")
        _norm(layer.ffn.layer_norm, state, f"{p}.ffn_norm")
    for i, layer in enumerate(dec.layer):
        p = f"decoder.layers.{i}"
        _linear(layer.self_attention.linear[0], state, f"{p}.self_attn.qkv_proj")
        _linear(layer.self_attention.linear[1], state, f"{p}.self_attn.out_proj")
        _norm(layer.self_attention.layer_norm, state, f"{p}.self_attn_norm")
        _linear(layer.attention.linear[0], state, f"{p}.cross_attn.q_proj")
        _linear(layer.attention.linear[1], state, f"{p}.cross_attn.kv_proj")
        _linear(layer.attention.linear[2], state, f"{p}.cross_attn.out_proj")
        _norm(layer.attention.layer_norm, state, f"{p}.cross_attn_norm")
        _linear(layer.ffn.linear_0, state, f"{p}.ffn.fc1")
        _linear(layer.ffn.linear_1, state, f"{p}.ffn.fc2")
        _norm(layer.ffn.layer_norm, state, f"{p}.ffn_norm")
    if pre_norm:
        _norm(enc.layer_norm, state, "encoder.final_norm")
        _norm(dec.layer_norm, state, "decoder.final_norm")
    _linear(dec.projection, state, "decoder.output_projection")

    def vocab(side: str) -> list[str]:
        return ["<blank>" if s == "<pad>" else s for s in data[f"{side}_dict"]["symbols"]]

    spec.register_source_vocabulary(vocab("src"))
    spec.register_target_vocabulary(vocab("tgt"))
    start = data.get("decoder_start") or "</s>"
    spec.config.decoder_start_token = "<blank>" if start == "<pad>" else start
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    return spec


# what a conversion writes (and, from before output markers, what --force recognises as an earlier export's)
FILES = {"model.bin", "config.json", "vmap.txt", *(f"{side}_vocabulary.{ext}" for side in ("shared", "source", "target")
                                                  for ext in ("json", "txt"))}


def export_model(ckpt: dict, output_dir: str | os.PathLike, quantization: str | None = None,
                 force: bool = False, vmap: str | os.PathLike | None = None) -> str:
    """Write the CTranslate2 model directory ``output_dir`` for the attnmt checkpoint ``ckpt``; ``vmap``: a
    vocabulary shortlist file, copied in as the model's ``vmap.txt``."""
    Converter = _ctranslate2().converters.converter.Converter

    class AttnmtConverter(Converter):
        def _load(self):
            return build_spec(ckpt)

    def convert(tmp: Path) -> None:
        try:
            AttnmtConverter().convert(str(tmp), vmap=None if vmap is None else str(vmap), quantization=quantization,
                                      force=True)
        except RuntimeError as e:
            raise UserError(f"{output_dir}: the conversion failed ({e})") from None

    return write_directory(output_dir, force, convert, known=FILES.__contains__)


def check(path: str | os.PathLike, output_dir: str | os.PathLike, lines: list[str]) -> float:
    """Largest difference between the two toolkits' log-probabilities of attnmt's translations of ``lines``.

    Both score the same (source, translation) pairs token by token (CTranslate2 in float32), which isolates the
    conversion from the search (attnmt's beam-1 search keeps an early EOS that greedy argmax decoding would skip).
    """
    ctranslate2 = _ctranslate2()

    bundle = load_for_inference(path)
    sources = bundle.encode_sources(lines)
    cfg = SearchConfig(beam=4, max_len_a=0, max_len_b=50)
    ours = []
    for s in sources:
        ours.append(beam_search(bundle.model, torch.tensor([s]), torch.tensor([len(s)]), cfg, bundle.symbols)[0][0])
    tr = ctranslate2.Translator(str(output_dir), device="cpu", compute_type="float32")
    # the pieces as the model has them (a forced language token included), scored after it where there is one
    scored = tr.score_batch([bundle.source_pieces(s).split() for s in sources],
                            [bundle.tgt_dict.string(h.tokens).split() for h in ours])
    skip = 0 if bundle.forced_first is None else 1
    worst = max(float(np.max(np.abs(np.array(r.log_probs[skip:]) - np.array(h.positional_scores[skip:])),
                             initial=0.0)) for r, h in zip(scored, ours))
    return worst
