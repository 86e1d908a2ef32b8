"""Print a JSON digest of a checkpoint's tensors: sha256 of every model weight and every optimizer state tensor.

Two checkpoints with the same digest hold bitwise the same weights and optimizer state, whatever the file layout
(the same tensor stored once or several times). Used by benchmarks/same_results.sh to show that a change of the
code leaves training bitwise unchanged:

    python benchmarks/checkpoint_digest.py CKPT > digest.json
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch


def _sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _walk(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = _sha(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            _walk(f"{prefix}.{k}" if prefix else str(k), obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(f"{prefix}[{i}]", v, out)


def digest(path: str) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    out: dict = {}
    _walk("model", ckpt["model"], out)
    train = ckpt.get("train") or {}
    _walk("optimizer", train.get("optimizer", {}).get("state", {}), out)
    return out


if __name__ == "__main__":
    json.dump(digest(sys.argv[1]), sys.stdout, indent=1, sort_keys=True)
    print()
