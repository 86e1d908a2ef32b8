"""Export an attnmt Transformer checkpoint to a CTranslate2 model directory (for speed comparisons on one model).

Run it with a Python that has ``ctranslate2`` and ``torch`` (e.g. the peer virtualenv of
``/work/shared/peers/install_fairseq.sh``); attnmt itself is imported from this checkout::

    /tmp/peer-venv/bin/python benchmarks/export_ct2.py --path checkpoints/checkpoint_best.pt --output-dir ct2-model \\
        [--quantization int8] [--check]

The mapping, layer by layer: fused Q/K/V (self-attention) and fused K/V (encoder-decoder attention) go to
CTranslate2's fused linear layers unchanged; post-norm (the paper) or pre-norm; ReLU; embeddings scaled by
sqrt(d_model); the positional table is stored explicitly, because attnmt interleaves sin/cos (as the paper) while
CTranslate2's built-in sinusoids concatenate them; the source gets its EOS appended and decoding starts from EOS,
as in attnmt. ``<pad>`` is renamed ``<blank>`` (CTranslate2's padding symbol).

``--check FILE`` translates FILE's first lines with attnmt and has both toolkits score those translations token by
token (CTranslate2 in float32); it fails when a log-probability differs by more than 1e-3.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    from attnmt.models.transformer import sinusoid_table

    return _np(sinusoid_table(count, dim))


def build_spec(ckpt: dict):
    """The CTranslate2 ``TransformerSpec`` holding the checkpoint's weights and vocabularies."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg, state, data = ckpt["model_config"], ckpt["model"], ckpt["data"]
    if ckpt.get("model_name") != "transformer":
        raise SystemExit(f"only the 'transformer' model can be exported, not {ckpt.get('model_name')!r}")
    if cfg["encoder_normalize_before"] != cfg["decoder_normalize_before"]:
        raise SystemExit("CTranslate2 needs the same normalisation (pre- or post-norm) in encoder and decoder")
    if cfg["encoder_attention_heads"] != cfg["decoder_attention_heads"]:
        raise SystemExit("CTranslate2 needs the same number of attention heads in encoder and decoder")
    pre_norm = bool(cfg["encoder_normalize_before"])
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg["encoder_layers"], cfg["decoder_layers"]), cfg["encoder_attention_heads"], pre_norm=pre_norm,
        activation=common_spec.Activation.RELU)

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
    spec.config.decoder_start_token = "</s>"
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = 1e-5  # torch.nn.LayerNorm's
    return spec


def export(path: str, output_dir: str, quantization: str | None = None, force: bool = False) -> str:
    from ctranslate2.converters.converter import Converter

    from attnmt.inference import resolve_checkpoint

    ckpt = torch.load(resolve_checkpoint(path), map_location="cpu", weights_only=True)

    class AttnmtConverter(Converter):
        def _load(self):
            return build_spec(ckpt)

    return AttnmtConverter().convert(output_dir, quantization=quantization, force=force)


def check(path: str, output_dir: str, lines: list[str]) -> float:
    """Largest difference between the two toolkits' log-probabilities of attnmt's translations of ``lines``.

    Both score the same (source, translation) pairs token by token (CTranslate2 in float32), which isolates the
    conversion from the search (attnmt's beam-1 search keeps an early EOS that greedy argmax decoding would skip).
    """
    import ctranslate2

    from attnmt.generation.beam import beam_search
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(path)
    sources = bundle.encode_sources(lines)
    cfg = SearchConfig(beam=4, max_len_a=0, max_len_b=50)
    ours = []
    for s in sources:
        ours.append(beam_search(bundle.model, torch.tensor([s]), torch.tensor([len(s)]), cfg, bundle.symbols)[0][0])
    tr = ctranslate2.Translator(output_dir, device="cpu", compute_type="float32")
    scored = tr.score_batch([bundle.source_pieces(s).split() for s in sources],
                            [bundle.target_pieces(h.tokens).split() for h in ours])
    worst = max(float(np.max(np.abs(np.array(r.log_probs) - np.array(h.positional_scores))))
                for r, h in zip(scored, ours))
    tokens = sum(len(h.tokens) for h in ours)
    print(f"{len(lines)} sentences, {tokens} tokens: largest log-probability difference {worst:.2e}")
    return worst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="attnmt checkpoint (or directory holding model.pt)")
    p.add_argument("--output-dir", required=True, help="CTranslate2 model directory to write")
    p.add_argument("--quantization", default=None, help="weights stored as int8, int16, float16, ... (default float32)")
    p.add_argument("--force", action="store_true", help="replace --output-dir if it exists")
    p.add_argument("--check", metavar="FILE",
                   help="score attnmt's translations of FILE's first 20 lines with both toolkits and compare")
    args = p.parse_args(argv)
    out = export(args.path, args.output_dir, args.quantization, args.force)
    print(f"wrote {out}")
    if args.check:
        from attnmt.scoring import read_lines

        sys.exit(1 if check(args.path, out, read_lines(args.check, "input")[:20]) > 1e-3 else 0)


if __name__ == "__main__":
    main()
