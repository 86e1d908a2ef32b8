"""fairseq 0.12 ``transformer`` checkpoints <-> attnmt checkpoints.

The two Transformers compute the same function; only names and three layouts differ:

* attnmt fuses the Q/K/V projections of self-attention (``qkv_proj``) and the K/V projections of
  encoder-decoder attention (``kv_proj``); fairseq keeps ``q_proj``, ``k_proj``, ``v_proj``. Rows concatenate.
* Positions: fairseq numbers them from ``padding_idx + 1`` and its sinusoids put all sines before all cosines
  with frequencies ``exp(-i * log(10000) / (d/2 - 1))``; attnmt's interleave sin/cos with the paper's frequencies.
  A fairseq model therefore comes in with ``learned_pos`` and its exact table (computed, or its learned rows), and
  an attnmt model goes out with ``--encoder-learned-pos --decoder-learned-pos`` holding attnmt's table.
* fairseq's LayerNorms, feed-forward layers, embeddings (scaled by sqrt(d) unless ``no_scale_embedding``),
  output projection and final LayerNorms of pre-norm stacks map one to one.

Both start decoding from EOS and append EOS to the source; the dictionaries have the same format and the same four
special symbols first, so ``dict.LANG.txt`` files are shared as they are.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch

from attnmt import checkpoint, registry
from attnmt.checkpoint import verify_bytes
from attnmt.config import make_config, to_dict
from attnmt.data.dictionary import Dictionary
from attnmt.data.subword import SentencePieceBPE
from attnmt.errors import UserError
from attnmt.fileio import write_directory
from attnmt.generation.beam import beam_search
from attnmt.generation.search import SearchConfig
from attnmt.inference import load_for_inference
from attnmt.models.interface import build_model
from attnmt.models.transformer import sinusoid_table

# attnmt TransformerConfig field <- fairseq model option (same meaning)
SAME_FIELDS = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
               "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads", "dropout",
               "attention_dropout", "activation_dropout", "encoder_normalize_before", "decoder_normalize_before",
               "no_scale_embedding", "share_all_embeddings", "share_decoder_input_output_embed",
               "max_source_positions", "max_target_positions")
# fairseq options attnmt's Transformer does not have: the value that matches attnmt's model
MUST_BE = {"activation_fn": "relu", "layernorm_embedding": False, "no_token_positional_embeddings": False,
           "adaptive_softmax_cutoff": None, "cross_self_attention": False, "quant_noise_pq": 0,
           "adaptive_input": False, "tie_adaptive_weights": False, "checkpoint_activations": False,
           "encoder_layers_to_keep": None, "decoder_layers_to_keep": None, "no_decoder_final_norm": False}


# --------------------------------------------------------------------------------------------- reading


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    """(model options, state dict) of a fairseq checkpoint, without fairseq installed.

    fairseq 0.12 stores its options as a plain dict (``cfg``) or, from older versions, an ``argparse.Namespace``
    (``args``); both load with ``weights_only=True``. The file is trusted no more than an attnmt one: its
    checksums, its structure and its weights' types are checked, each fault a one-line UserError naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: not found; give a fairseq checkpoint (checkpoint_best.pt, model.pt)")
    verify_bytes(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means: not a checkpoint we can read safely
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"{path}: cannot be read as a fairseq checkpoint ({first}); give a checkpoint written by "
                        f"fairseq-train 0.x") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise UserError(f"{path}: not a fairseq checkpoint (no 'model' weights); give a file written by "
                        f"fairseq-train")
    if ckpt.get("format") == "attnmt-checkpoint":
        raise UserError(f"{path}: already an attnmt checkpoint; use it as it is")
    state = ckpt["model"]
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise UserError(f"{path}: the weight {str(key)[:80]!r} is a {type(value).__name__}, not a tensor; the file "
                            f"is damaged or not a fairseq checkpoint")

    def as_dict(value, what: str) -> dict:
        if isinstance(value, argparse.Namespace):
            return dict(vars(value))
        if isinstance(value, dict):
            return dict(value)
        raise UserError(f"{path}: its {what} is a {type(value).__name__}, not fairseq's options; the file is damaged "
                        f"or not a fairseq checkpoint")

    cfg = ckpt.get("cfg")
    if cfg is not None and not isinstance(cfg, dict):
        raise UserError(f"{path}: its 'cfg' is a {type(cfg).__name__}, not fairseq's options; the file is damaged "
                        f"or not a fairseq checkpoint")
    if cfg and cfg.get("model") is not None:
        options = as_dict(cfg["model"], "'cfg.model'")
        task = as_dict(cfg.get("task") or {}, "'cfg.task'")
        for key in ("source_lang", "target_lang", "data"):  # the task's, for the defaults of import-fairseq
            if isinstance(task.get(key), str):
                options.setdefault(key, task[key])
    elif ckpt.get("args") is not None:
        options = as_dict(ckpt["args"], "'args'")
    else:
        raise UserError(f"{path}: holds no model options (neither 'cfg' nor 'args'); give a checkpoint written by "
                        f"fairseq-train")
    return options, state


# stored options checked before a model is built from them: (smallest, largest) for counts and sizes
LIMITS = {"encoder_layers": (1, 1000), "decoder_layers": (1, 1000), "encoder_embed_dim": (2, 65536),
          "decoder_embed_dim": (2, 65536), "encoder_ffn_embed_dim": (1, 1 << 20), "decoder_ffn_embed_dim": (1, 1 << 20),
          "encoder_attention_heads": (1, 4096), "decoder_attention_heads": (1, 4096),
          "max_source_positions": (1, 1 << 20), "max_target_positions": (1, 1 << 20)}


def _check_options(cfg: dict, state: dict, path: str | os.PathLike) -> None:
    """The stored options as numbers in range and as the weights have them (layer counts, widths), so that a
    damaged or hostile file is named, in its own terms, before anything is built from it."""
    def bad(key: str, why: str) -> UserError:
        return UserError(f"{path}: its stored option {key} = {str(cfg.get(key))[:40]!r} {why}; the file is damaged "
                         f"or was not written by fairseq-train")

    for key, (lo, hi) in LIMITS.items():
        if key not in cfg:
            continue
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad(key, f"is not an integer from {lo} to {hi}")
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1):
            raise bad(key, "is not a probability below 1")
    for side in ("encoder", "decoder"):
        emb = state.get(f"{side}.embed_tokens.weight")
        if emb is None or emb.dim() != 2:
            raise UserError(f"{path}: lacks the weights {side}.embed_tokens.weight (a matrix); the file is incomplete "
                            f"or not a fairseq transformer")
        layers = {int(k.split(".")[2]) for k in state if k.startswith(f"{side}.layers.") and k.split(".")[2].isdigit()}
        dim, heads = cfg.get(f"{side}_embed_dim", emb.size(1)), cfg.get(f"{side}_attention_heads", 1)
        if cfg.get(f"{side}_layers") is not None and len(layers) != cfg[f"{side}_layers"]:
            raise bad(f"{side}_layers", f"but the file holds the weights of {len(layers)} {side} layers")
        if dim != emb.size(1):
            raise bad(f"{side}_embed_dim", f"but its embeddings are {emb.size(1)} wide")
        if dim % heads:
            raise bad(f"{side}_attention_heads", f"does not divide {side}_embed_dim {dim}")
        fc1 = state.get(f"{side}.layers.0.fc1.weight")
        ffn = cfg.get(f"{side}_ffn_embed_dim")
        if fc1 is not None and ffn is not None and fc1.size(0) != ffn:
            raise bad(f"{side}_ffn_embed_dim", f"but its feed-forward layers are {fc1.size(0)} wide")


def model_config(options: dict, path: str | os.PathLike, state: dict | None = None) -> dict:
    """attnmt TransformerConfig fields for a fairseq transformer's options (refusing what attnmt cannot run, and,
    given its weights ``state``, options that do not fit them)."""
    arch = str(options.get("arch") or options.get("_name") or "")
    if not arch.startswith("transformer") or arch.startswith(("transformer_lm", "transformer_align")) \
            or arch.endswith("_align"):
        raise UserError(f"{path}: a fairseq '{arch[:60]}' model; attnmt imports fairseq's transformer translation "
                        f"models (transformer, transformer_wmt_en_de, transformer_vaswani_wmt_en_de_big, ...)")
    for key, want in MUST_BE.items():
        got = options.get(key)
        if got is None or got == want or (not want and not got):
            continue
        raise UserError(f"{path}: --{key.replace('_', '-')} {str(got)[:40]} has no counterpart in attnmt's Transformer "
                        f"(it needs {want}); this model cannot be imported")
    cfg = {k: options[k] for k in SAME_FIELDS if options.get(k) is not None}
    if state is not None:
        _check_options(cfg, state, path)
    cfg["learned_pos"] = True  # fairseq's positions, as a table (its sinusoids or its learned rows)
    return cfg


def fairseq_sinusoids(num_embeddings: int, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's SinusoidalPositionalEmbedding table: row ``p`` holds position ``p`` (rows up to ``padding_idx``
    unused), sines then cosines."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_embeddings, dtype=torch.float64)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_embeddings, 1, dtype=torch.float64)], dim=1)
    table[padding_idx] = 0
    return table.float()


def layer_names(cfg: dict) -> list[tuple[str, str, tuple[str, ...]]]:
    """Every layer's linear and LayerNorm modules as ``(attnmt name, fairseq name, fused parts)``: ``parts`` names
    fairseq's separate projections whose rows attnmt's one module concatenates (empty: the same module)."""
    rows: list[tuple[str, str, tuple[str, ...]]] = []

    def self_attention_and_ffn(layer: str) -> None:  # what encoder and decoder layers share (same prefix)
        rows.extend([(f"{layer}.self_attn.qkv_proj", f"{layer}.self_attn", ("q_proj", "k_proj", "v_proj")),
                     (f"{layer}.self_attn.out_proj", f"{layer}.self_attn.out_proj", ()),
                     (f"{layer}.self_attn_norm", f"{layer}.self_attn_layer_norm", ()),
                     (f"{layer}.ffn.fc1", f"{layer}.fc1", ()),
                     (f"{layer}.ffn.fc2", f"{layer}.fc2", ()),
                     (f"{layer}.ffn_norm", f"{layer}.final_layer_norm", ())])

    for i in range(cfg["encoder_layers"]):
        self_attention_and_ffn(f"encoder.layers.{i}")
    for i in range(cfg["decoder_layers"]):
        layer = f"decoder.layers.{i}"
        self_attention_and_ffn(layer)
        rows.extend([(f"{layer}.cross_attn.q_proj", f"{layer}.encoder_attn.q_proj", ()),
                     (f"{layer}.cross_attn.kv_proj", f"{layer}.encoder_attn", ("k_proj", "v_proj")),
                     (f"{layer}.cross_attn.out_proj", f"{layer}.encoder_attn.out_proj", ()),
                     (f"{layer}.cross_attn_norm", f"{layer}.encoder_attn_layer_norm", ())])
    for side in ("encoder", "decoder"):
        if cfg.get(f"{side}_normalize_before"):
            rows.append((f"{side}.final_norm", f"{side}.layer_norm", ()))
    return rows


def convert_from_fairseq(options: dict, state: dict, cfg: dict, pad: int) -> dict[str, torch.Tensor]:
    """fairseq parameter names and layouts -> attnmt's."""
    out: dict[str, torch.Tensor] = {}

    def positions(side: str, dim: int, count: int) -> torch.Tensor:
        learned = options.get(f"{side}_learned_pos")
        if learned and f"{side}.embed_positions.weight" not in state:
            raise UserError(f"lacks the weights {side}.embed_positions.weight (its learned positions); the file is "
                            f"incomplete")
        table = state[f"{side}.embed_positions.weight"].float() if learned else \
            fairseq_sinusoids(pad + 1 + count, dim, pad)
        if table.size(0) < pad + 1 + count:
            raise UserError(f"the {side}'s learned positions hold {table.size(0) - pad - 1} positions, fewer than "
                            f"--max-{'source' if side == 'encoder' else 'target'}-positions {count}")
        return table[pad + 1: pad + 1 + count].clone()

    out["encoder.embed.tokens.weight"] = state["encoder.embed_tokens.weight"].float()
    out["decoder.embed.tokens.weight"] = state["decoder.embed_tokens.weight"].float()
    out["decoder.output_projection.weight"] = state.get("decoder.output_projection.weight",
                                                        state["decoder.embed_tokens.weight"]).float()
    out["encoder.embed.positions.weight"] = positions("encoder", cfg["encoder_embed_dim"], cfg["max_source_positions"])
    out["decoder.embed.positions.weight"] = positions("decoder", cfg["decoder_embed_dim"], cfg["max_target_positions"])

    for ours, theirs, parts in layer_names(cfg):
        for suffix in ("weight", "bias"):
            pieces = [f"{theirs}.{n}.{suffix}" for n in parts] or [f"{theirs}.{suffix}"]
            if all(k in state for k in pieces):
                out[f"{ours}.{suffix}"] = torch.cat([state[k].float() for k in pieces], dim=0)
    return out


def import_checkpoint(path: str | os.PathLike, src_dict_path: str | os.PathLike, tgt_dict_path: str | os.PathLike,
                      source_lang: str, target_lang: str, spm_model: str | os.PathLike | None = None,
                      tokenizer: str = "none") -> dict:
    """An attnmt checkpoint (inference and ``--finetune-from``/``--restore-file``-ready weights, no training state)
    holding the fairseq model at ``path`` with its dictionaries and, when given, the SentencePiece model its text
    was segmented with."""
    options, state = read_checkpoint(path)
    dicts = []
    for what, p in (("source", src_dict_path), ("target", tgt_dict_path)):
        if not Path(p).is_file():
            raise UserError(f"{p}: the {what} dictionary was not found; give the fairseq data-bin's dict.LANG.txt "
                            f"(--data DIR finds them)")
        dicts.append(Dictionary.load(p))
    src_dict, tgt_dict = dicts
    joint = src_dict.checksum() == tgt_dict.checksum()
    fields = model_config(options, path, state)
    if fields.get("share_all_embeddings") and not joint:
        raise UserError(f"{path}: the model shares all embeddings but {src_dict_path} and {tgt_dict_path} differ; "
                        f"give the dictionaries it was trained with")
    for side, d, key in (("encoder", src_dict, "encoder.embed_tokens.weight"),
                         ("decoder", tgt_dict, "decoder.embed_tokens.weight")):
        if state[key].size(0) != len(d):
            raise UserError(f"{path}: the {side} embeddings have {state[key].size(0)} rows but the dictionary has "
                            f"{len(d)} symbols; give the dictionaries the model was trained with")
    cfg = make_config(registry.get("model", "transformer").config, fields, what=f"{path} (fairseq options)")
    try:
        weights = convert_from_fairseq(options, state, to_dict(cfg), src_dict.pad())
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    checkpoint.check_finite(weights, path, fix="the fairseq run that wrote them diverged: import an earlier "
                            "checkpoint")
    model = build_model("transformer", cfg, len(src_dict), len(tgt_dict), src_dict.pad(), joint_vocab=joint)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).strip().splitlines()[:2])[:300]
        raise UserError(f"{path}: the weights do not fit a transformer of its options ({detail})") from None
    bpe, bpe_model = "none", None
    if spm_model is not None:
        SentencePieceBPE.load(spm_model)  # a clear error for a file that is not a SentencePiece model
        bpe = "sentencepiece"
        bpe_model = torch.frombuffer(bytearray(Path(spm_model).read_bytes()), dtype=torch.uint8).clone()
    data = checkpoint.DataSection(source_lang=source_lang, target_lang=target_lang, joint_dictionary=joint,
                                  src_dict=src_dict.to_state(), tgt_dict=tgt_dict.to_state(),
                                  src_dict_sha256=src_dict.checksum(), tgt_dict_sha256=tgt_dict.checksum(),
                                  bpe=bpe, bpe_model=bpe_model, tokenizer=tokenizer)
    return {"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "model_name": "transformer",
            "arch": str(options.get("arch") or "transformer"), "model_config": to_dict(cfg),
            "model": checkpoint.portable_weights(model.state_dict()), "data": data.to_dict(),
            "imported_from": {"toolkit": "fairseq", "path": str(path)}}


# --------------------------------------------------------------------------------------------- writing


def convert_to_fairseq(ckpt: dict, pad: int) -> dict[str, torch.Tensor]:
    """attnmt parameter names and layouts -> fairseq's (positions as fairseq learned-position tables)."""
    cfg, state = ckpt["model_config"], ckpt["model"]
    out: dict[str, torch.Tensor] = {}

    def positions(side: str, dim: int, count: int) -> torch.Tensor:
        table = state[f"{side}.embed.positions.weight"] if cfg.get("learned_pos") else \
            sinusoid_table(count, dim, cfg.get("sinusoid_style", "paper"))
        return torch.cat([torch.zeros(pad + 1, dim), table.float()[:count]])  # fairseq: position p at row p+pad+1

    out["encoder.embed_tokens.weight"] = state["encoder.embed.tokens.weight"].float()
    out["decoder.embed_tokens.weight"] = state["decoder.embed.tokens.weight"].float()
    out["decoder.output_projection.weight"] = state["decoder.output_projection.weight"].float()
    out["encoder.embed_positions.weight"] = positions("encoder", cfg["encoder_embed_dim"], cfg["max_source_positions"])
    out["decoder.embed_positions.weight"] = positions("decoder", cfg["decoder_embed_dim"], cfg["max_target_positions"])
    out["encoder.version"] = out["decoder.version"] = torch.tensor([3.0])

    for ours, theirs, parts in layer_names(cfg):
        for suffix in ("weight", "bias"):
            if f"{ours}.{suffix}" not in state:
                continue
            tensor = state[f"{ours}.{suffix}"].float()
            if not parts:
                out[f"{theirs}.{suffix}"] = tensor
            for name, part in zip(parts, tensor.chunk(max(len(parts), 1), dim=0)):
                out[f"{theirs}.{name}.{suffix}"] = part.contiguous()
    return out


def fairseq_flags(cfg: dict) -> list[str]:
    """fairseq-train options describing an attnmt Transformer (learned positions: attnmt's table goes with it)."""
    flags = ["--arch", "transformer", "--encoder-learned-pos", "--decoder-learned-pos"]
    for name in ("encoder_layers", "decoder_layers", "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim",
                 "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads",
                 "max_source_positions", "max_target_positions", "dropout", "attention_dropout",
                 "activation_dropout"):
        flags += [f"--{name.replace('_', '-')}", str(cfg[name])]
    for name in ("share_all_embeddings", "share_decoder_input_output_embed", "encoder_normalize_before",
                 "decoder_normalize_before", "no_scale_embedding"):
        if cfg.get(name):
            flags.append(f"--{name.replace('_', '-')}")
    if cfg.get("share_all_embeddings") and "--share-decoder-input-output-embed" in flags:
        flags.remove("--share-decoder-input-output-embed")
    return flags


def export_checkpoint(ckpt: dict, output_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write ``checkpoint.pt`` and ``dict.SRC.txt``/``dict.TGT.txt`` (and ``dict.txt`` when joint) for
    fairseq-generate/-interactive, as one directory made whole or not at all (``fileio.write_directory``).
    Needs fairseq 0.12 importable (its option namespace goes into the file)."""
    if ckpt.get("model_config", {}).get("attention_key_dim"):
        raise UserError(f"fairseq's Transformer holds attention keys of d_model / heads only, and this model's are "
                        f"--attention-key-dim {ckpt['model_config']['attention_key_dim']}; translate it with attnmt")
    try:
        from fairseq import options as fairseq_options
    except ImportError:
        raise UserError("attnmt export --to fairseq writes fairseq's own option namespace and needs fairseq 0.12 in "
                        "this Python: pip install fairseq==0.12.2") from None
    if ckpt.get("model_name") != "transformer":
        raise UserError(f"only the transformer model can be exported, not {ckpt.get('model_name')!r}")
    data = ckpt["data"]
    out = Path(output_dir)
    src_dict, tgt_dict = Dictionary.from_state(data["src_dict"]), Dictionary.from_state(data["tgt_dict"])
    files = [(src_dict, f"dict.{data['source_lang']}.txt"), (tgt_dict, f"dict.{data['target_lang']}.txt")]
    if data.get("joint_dictionary"):
        files.append((src_dict, "dict.txt"))
    flags = [str(out), "--task", "translation", "-s", data["source_lang"], "-t", data["target_lang"],
             *fairseq_flags(ckpt["model_config"])]
    args = fairseq_options.parse_args_and_arch(fairseq_options.get_training_parser(), flags)
    state = convert_to_fairseq(ckpt, pad=src_dict.pad())
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam", "lr_scheduler_state": {},
                "num_updates": int((ckpt.get("train") or {}).get("num_updates") or 0)}]

    def write(tmp: Path) -> None:
        for d, name in files:
            d.save(tmp / name)
        torch.save({"args": args, "model": state, "optimizer_history": history, "extra_state": {"epoch": 1},
                    "last_optimizer_state": None}, tmp / "checkpoint.pt")

    try:
        write_directory(out, force, write, known=lambda name: name == "checkpoint.pt" or (
            name.startswith("dict.") and name.endswith(".txt")))
    except RuntimeError as e:  # torch's zip writer reports a failed write (a full disk) as "unexpected pos"
        if "inline_container" not in str(e) and "unexpected pos" not in str(e):
            raise
        raise UserError(f"{out}: cannot write the checkpoint (the write failed: disk full or the file-size limit, "
                        f"ulimit -f); the directory is as it was. Free some space or choose another") from None
    return out / "checkpoint.pt"


def check(path: str | os.PathLike, output_dir: str | os.PathLike, lines: list[str]) -> float:
    """Largest difference between attnmt's and fairseq's log-probabilities of attnmt's translations of ``lines``
    (both toolkits score the same pairs token by token, which isolates the conversion from the searches)."""
    from fairseq import checkpoint_utils


    bundle = load_for_inference(path)
    models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task(
        [str(Path(output_dir) / "checkpoint.pt")], arg_overrides={"data": str(output_dir)})
    model = models[0].eval()
    cfg = SearchConfig(beam=4, max_len_a=0, max_len_b=50)
    worst = 0.0
    for s in bundle.encode_sources(lines):
        hyp = beam_search(bundle.model, torch.tensor([s]), torch.tensor([len(s)]), cfg, bundle.symbols)[0][0]
        prev = torch.tensor([[bundle.symbols.eos] + hyp.tokens[:-1]])
        with torch.no_grad():
            out, _ = model(torch.tensor([s]), torch.tensor([len(s)]), prev)
            lp = torch.log_softmax(out.float(), -1)[0].gather(1, torch.tensor(hyp.tokens)[:, None])[:, 0]
        worst = max(worst, float((lp - torch.tensor(hyp.positional_scores)).abs().max()))
    return worst
