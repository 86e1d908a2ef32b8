"""The model a checkpoint describes: built from its stored config, its weights checked against that config before
they are loaded (a damaged or hostile file is a one-line error, never a crash or an exhausted memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from attnmt import registry
from attnmt.config import config_from_dict
from attnmt.errors import UserError
from attnmt.models.interface import EncoderDecoderModel, build_model


def model_from_checkpoint(ckpt: dict, src_dict, tgt_dict, path: Path) -> EncoderDecoderModel:
    """The registered model of the checkpoint with its weights, in eval mode."""
    name = ckpt.get("model_name")
    if not name or "model" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{path}: the checkpoint lacks model_name/model_config/model; use a file written by "
                        f"attnmt train or attnmt average-checkpoints")
    if not isinstance(ckpt["model_config"], dict):
        raise UserError(f"{path}: the checkpoint's model_config is not a table of options; the file is damaged")
    try:
        cfg = config_from_dict(registry.get("model", name).config, ckpt["model_config"])
    except UserError as e:
        raise UserError(f"{path}: the stored model config is invalid ({e}); the file is damaged or not from "
                        f"attnmt") from None
    joint = bool(ckpt["data"].get("joint_dictionary", False))
    with torch.device("meta"):  # the shapes first, allocating nothing: a hostile config cannot exhaust memory
        shapes = {k: tuple(v.shape) for k, v in build_model(name, cfg, len(src_dict), len(tgt_dict), src_dict.pad(),
                                                             joint_vocab=joint).state_dict().items()}
    weights = ckpt["model"]
    wrong = [k for k, shape in shapes.items()
             if not torch.is_tensor(weights.get(k)) or tuple(weights[k].shape) != shape] + [
        k for k in weights if k not in shapes]
    if wrong:
        k = wrong[0]
        have = tuple(weights[k].shape) if torch.is_tensor(weights.get(k)) else "missing" if k not in weights else \
            type(weights[k]).__name__
        raise UserError(f"{path}: the weights do not fit the model its config describes ({len(wrong)} entries, e.g. "
                        f"{k}: stored {have}, config {shapes.get(k, 'none')}); the file is inconsistent, re-save it "
                        f"with attnmt train")
    model = build_model(name, cfg, len(src_dict), len(tgt_dict), src_dict.pad(), joint_vocab=joint)
    try:
        model.load_state_dict(ckpt["model"], strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = " ".join(s.strip() for s in first[:3])
        raise UserError(f"{path}: the weights do not fit the model described in the checkpoint ({detail[:300]}); "
                        f"the file is inconsistent, re-save it with attnmt train") from None
    return model.eval()
