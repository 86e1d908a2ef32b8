"""Hugging Face model directories and hub names where attnmt takes a checkpoint: ``resolve`` imports them once
into attnmt's cache (``attnmt.interop.huggingface``) and gives the checkpoint to load; a hub name is read from the
Hugging Face cache through ``huggingface_hub`` (downloaded into it first where a network is reachable).
"""

from __future__ import annotations

import os
from pathlib import Path

from attnmt import settings
from attnmt.errors import UserError
from attnmt.interop.huggingface import import_model


def is_model_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model directory (it holds a config.json)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def looks_like_hub_name(name: str) -> bool:
    """``owner/model`` (a hub repository id), not a path on this machine: nothing of that name here, no directory
    ``owner`` here, not a checkpoint's file name."""
    import re

    text = str(name)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", text):
        return False
    owner = text.split("/")[0]
    return not (Path(text).exists() or Path(owner).exists()
                or text.endswith((".pt", ".pth", ".bin", ".safetensors")))


def hub_snapshot(name: str) -> Path:
    """The local directory of the hub model ``name``: from the Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``),
    downloaded first where a network is reachable and ``HF_HUB_OFFLINE`` is not set."""
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"{name}: loading a hub model by name needs huggingface_hub: pip install 'attnmt[hf]' (or "
                        f"give the local directory save_pretrained wrote)") from None
    files = ["config.json", "*.json", "*.spm", "*.model", "model.safetensors", "pytorch_model.bin"]
    try:
        return Path(huggingface_hub.snapshot_download(name, allow_patterns=files, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: try the network below
        pass
    try:
        return Path(huggingface_hub.snapshot_download(name, allow_patterns=files))
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, no access: one line
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(f"{name}: not in the Hugging Face cache and not downloadable here ({first}); download it "
                        f"where there is a network (huggingface-cli download {name}) or give its directory") \
            from None


def resolve(path: str | os.PathLike) -> str:
    """The attnmt checkpoint to load for ``path``: ``path`` itself, unless it is a Hugging Face model directory or
    hub name; those are imported once into attnmt's cache (``$ATTNMT_CACHE_DIR``, else ``~/.cache/attnmt``,
    ``imported/``), keyed by the files they hold (their names, sizes and modification times), and the cached
    checkpoint's path is returned."""
    import hashlib

    text = str(path)
    if is_model_dir(text):
        d = Path(text).resolve()
    elif looks_like_hub_name(text):
        d = hub_snapshot(text).resolve()
    else:
        return text
    key = hashlib.sha256(str(d).encode())
    for f in sorted(d.iterdir()):
        if f.is_file():
            st = f.stat()
            key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    out = settings.current().cache / "imported" / f"{d.name}-{key.hexdigest()[:16]}.pt"
    if not out.is_file():
        from attnmt import checkpoint

        ckpt = import_model(d)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.save(ckpt, out)
        except OSError as e:
            raise UserError(f"{out}: the imported model cannot be cached here ({e.strerror or e}); set "
                            f"ATTNMT_CACHE_DIR to a writable directory, or run attnmt import-hf {text} -o FILE") \
                from None
    return str(out)
