"""Export an attnmt Transformer checkpoint to a fairseq 0.12 checkpoint (for speed comparisons on one model).

Run it with a Python that has fairseq 0.12.2 (and torch); attnmt itself is imported from this checkout::

    /work/fairseq-venv/bin/python benchmarks/export_fairseq.py --path checkpoints/checkpoint_best.pt \\
        --output-dir fairseq-model [--check FILE]

Writes ``checkpoint.pt`` (fairseq's ``transformer`` architecture) and ``dict.txt`` (the checkpoint's dictionary in
fairseq's format: the same symbols in the same order after fairseq's four specials, which attnmt's dictionary
shares). Binarize text with ``fairseq-preprocess --srcdict dict.txt --joined-dictionary``. The mapping: fused
Q/K/V and K/V projections are split into fairseq's separate ones; LayerNorms and feed-forward layers map one to
one; post-norm (the paper) or pre-norm; embeddings shared and scaled by sqrt(d_model). attnmt's sinusoids
interleave sin/cos (as the paper) while fairseq's concatenate them, so the table is stored as fairseq's learned
positional embedding (fairseq numbers positions from ``padding_idx + 1``, hence two leading unused rows).

``--check FILE`` decodes the first lines of FILE with attnmt and has fairseq score attnmt's translations token by
token; it fails when a log-probability differs by more than 1e-3.
"""

from __future__ import annotations

import argparse
import os
import sys

# fairseq 0.12 keeps its arguments as an argparse.Namespace in the checkpoint, which torch >= 2.6 refuses to
# unpickle by default; these checkpoints are the ones this script writes
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def fairseq_args(cfg: dict, src: str, tgt: str, data_dir: str):
    """A complete fairseq argument namespace for the ``transformer`` architecture with the checkpoint's sizes."""
    from fairseq import options

    if cfg["encoder_normalize_before"] != cfg["decoder_normalize_before"]:
        raise SystemExit("this export expects the same normalisation (pre- or post-norm) in encoder and decoder")
    flags = [data_dir, "--arch", "transformer", "--task", "translation", "-s", src, "-t", tgt,
             "--encoder-layers", str(cfg["encoder_layers"]), "--decoder-layers", str(cfg["decoder_layers"]),
             "--encoder-embed-dim", str(cfg["encoder_embed_dim"]), "--decoder-embed-dim", str(cfg["decoder_embed_dim"]),
             "--encoder-ffn-embed-dim", str(cfg["encoder_ffn_embed_dim"]),
             "--decoder-ffn-embed-dim", str(cfg["decoder_ffn_embed_dim"]),
             "--encoder-attention-heads", str(cfg["encoder_attention_heads"]),
             "--decoder-attention-heads", str(cfg["decoder_attention_heads"]),
             "--max-source-positions", str(cfg["max_source_positions"]),
             "--max-target-positions", str(cfg["max_target_positions"]),
             "--encoder-learned-pos", "--decoder-learned-pos", "--dropout", str(cfg["dropout"])]
    if cfg["share_all_embeddings"]:
        flags.append("--share-all-embeddings")
    elif cfg["share_decoder_input_output_embed"]:
        flags.append("--share-decoder-input-output-embed")
    if cfg["encoder_normalize_before"]:
        flags += ["--encoder-normalize-before", "--decoder-normalize-before"]
    if cfg.get("no_scale_embedding"):
        flags.append("--no-scale-embedding")
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, flags)


def convert_state(ckpt: dict, pad: int) -> dict:
    """attnmt parameter names and layouts -> fairseq's."""
    from attnmt.models.transformer import sinusoid_table

    cfg, state = ckpt["model_config"], ckpt["model"]
    out: dict[str, torch.Tensor] = {}

    def copy(dst: str, src: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{src}.{suffix}" in state:
                out[f"{dst}.{suffix}"] = state[f"{src}.{suffix}"].float()

    def split(dst: str, src: str, names: tuple[str, ...]) -> None:
        for suffix in ("weight", "bias"):
            for name, part in zip(names, state[f"{src}.{suffix}"].float().chunk(len(names), dim=0)):
                out[f"{dst}.{name}.{suffix}"] = part.contiguous()

    def positions(side: str, dim: int, count: int) -> torch.Tensor:
        table = state[f"{side}.embed.positions.weight"] if cfg.get("learned_pos") else sinusoid_table(count, dim)
        return torch.cat([torch.zeros(pad + 1, dim), table.float()[:count]])  # fairseq: position p at row p+pad+1

    out["encoder.embed_tokens.weight"] = state["encoder.embed.tokens.weight"].float()
    out["decoder.embed_tokens.weight"] = state["decoder.embed.tokens.weight"].float()
    out["decoder.output_projection.weight"] = state["decoder.output_projection.weight"].float()
    out["encoder.embed_positions.weight"] = positions("encoder", cfg["encoder_embed_dim"], cfg["max_source_positions"])
    out["decoder.embed_positions.weight"] = positions("decoder", cfg["decoder_embed_dim"], cfg["max_target_positions"])
    out["encoder.version"] = out["decoder.version"] = torch.tensor([3.0])

    def self_attention_and_ffn(layer: str) -> None:  # what encoder and decoder layers share (same prefix)
        split(f"{layer}.self_attn", f"{layer}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"))
        copy(f"{layer}.self_attn.out_proj", f"{layer}.self_attn.out_proj")
        copy(f"{layer}.self_attn_layer_norm", f"{layer}.self_attn_norm")
        copy(f"{layer}.fc1", f"{layer}.ffn.fc1")
        copy(f"{layer}.fc2", f"{layer}.ffn.fc2")
        copy(f"{layer}.final_layer_norm", f"{layer}.ffn_norm")

    for i in range(cfg["encoder_layers"]):
        self_attention_and_ffn(f"encoder.layers.{i}")
    for i in range(cfg["decoder_layers"]):
        layer = f"decoder.layers.{i}"
        self_attention_and_ffn(layer)
        copy(f"{layer}.encoder_attn.q_proj", f"{layer}.cross_attn.q_proj")
        split(f"{layer}.encoder_attn", f"{layer}.cross_attn.kv_proj", ("k_proj", "v_proj"))
        copy(f"{layer}.encoder_attn.out_proj", f"{layer}.cross_attn.out_proj")
        copy(f"{layer}.encoder_attn_layer_norm", f"{layer}.cross_attn_norm")
    if cfg["encoder_normalize_before"]:
        copy("encoder.layer_norm", "encoder.final_norm")
        copy("decoder.layer_norm", "decoder.final_norm")
    return out


def write_dict(d: dict, path: str) -> None:
    symbols = list(d["symbols"])
    if tuple(symbols[:4]) != SPECIALS:
        raise SystemExit(f"the dictionary starts with {symbols[:4]}, not fairseq's {list(SPECIALS)}")
    counts = list(d.get("counts") or [1] * len(symbols))
    with open(path, "w", encoding="utf-8") as f:
        for sym, n in zip(symbols[4:], counts[4:]):
            f.write(f"{sym} {max(int(n), 1)}\n")


def export(path: str, output_dir: str) -> str:
    from attnmt.inference import resolve_checkpoint

    ckpt = torch.load(resolve_checkpoint(path), map_location="cpu", weights_only=False)
    if ckpt.get("model_name") != "transformer":
        raise SystemExit(f"only the 'transformer' model can be exported, not {ckpt.get('model_name')!r}")
    data = ckpt["data"]
    if not data.get("joint_dictionary"):
        raise SystemExit("this export handles joined dictionaries (attnmt preprocess --joined-dictionary) only")
    os.makedirs(output_dir, exist_ok=True)
    write_dict(data["src_dict"], os.path.join(output_dir, "dict.txt"))
    for lang in (data["source_lang"], data["target_lang"]):  # fairseq's translation task looks for these
        write_dict(data["src_dict"], os.path.join(output_dir, f"dict.{lang}.txt"))
    args = fairseq_args(ckpt["model_config"], data["source_lang"], data["target_lang"], output_dir)
    state = convert_state(ckpt, pad=list(data["src_dict"]["symbols"]).index("<pad>"))
    out = os.path.join(output_dir, "checkpoint.pt")
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam", "lr_scheduler_state": {},
                "num_updates": int((ckpt.get("train") or {}).get("num_updates") or 0)}]
    torch.save({"args": args, "model": state, "optimizer_history": history, "extra_state": {"epoch": 1},
                "last_optimizer_state": None}, out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def check(path: str, output_dir: str, lines: list[str]) -> float:
    """Largest difference between attnmt's and fairseq's log-probabilities of attnmt's translations of ``lines``."""
    from fairseq import checkpoint_utils

    from attnmt.generation.beam import beam_search
    from attnmt.generation.search import SearchConfig
    from attnmt.inference import load_for_inference

    bundle = load_for_inference(path)
    models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(output_dir, "checkpoint.pt")], arg_overrides={"data": output_dir})
    model = models[0].eval()
    cfg = SearchConfig(beam=4, max_len_a=0, max_len_b=50)
    worst, tokens = 0.0, 0
    for s in bundle.encode_sources(lines):
        hyp = beam_search(bundle.model, torch.tensor([s]), torch.tensor([len(s)]), cfg, bundle.symbols)[0][0]
        prev = torch.tensor([[bundle.symbols.eos] + hyp.tokens[:-1]])
        with torch.no_grad():
            out, _ = model(torch.tensor([s]), torch.tensor([len(s)]), prev)
            lp = torch.log_softmax(out.float(), -1)[0].gather(1, torch.tensor(hyp.tokens)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(hyp.positional_scores)).abs().max()))
        tokens += len(hyp.tokens)
    print(f"{len(lines)} sentences, {tokens} tokens: largest log-probability difference {worst:.2e}")
    return worst


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="attnmt checkpoint (or directory holding model.pt)")
    p.add_argument("--output-dir", required=True, help="directory for checkpoint.pt and dict.txt")
    p.add_argument("--check", metavar="FILE", help="score attnmt's translations of FILE's first 20 lines with fairseq")
    args = p.parse_args(argv)
    print(f"wrote {export(args.path, args.output_dir)}")
    if args.check:
        from attnmt.scoring import read_lines

        sys.exit(1 if check(args.path, args.output_dir, read_lines(args.check, "input")[:20]) > 1e-3 else 0)


if __name__ == "__main__":
    main()
