"""The checkpoint format: what a checkpoint file holds, its names, and how it is written and read.

Training, checkpoint averaging and inference all go through this module; it depends on nothing above the
model and data layers. A checkpoint is a ``torch.save``d dict of tensors and plain containers only, read with
``torch.load(path, map_location="cpu", weights_only=True)``::

    {"format": "attnmt-checkpoint", "version": 1,
     "model_name", "arch", "model_config", "model",         # the model: registered name, preset, config, weights
     "data": DataSection.to_dict(),                          # what translation needs without DATA_BIN
     "train": {...},                                         # training state (training/state.py); absent after
     "averaged_from": [...]}                                 #   averaging, which records its inputs instead

Weights are float32 on the CPU, and a matrix that several parameters share (the tied embeddings and output
projection of paper 3.4) is stored once: ``torch.save`` writes a storage once however many entries use it.

Names in ``--save-dir`` (as fairseq): ``checkpoint_last.pt`` (every save), ``checkpoint_best.pt`` (best validation
so far), ``checkpoint{epoch}.pt`` (end of an epoch), ``checkpoint_{epoch}_{updates}.pt`` (every
``--save-interval-updates`` / ``--save-interval-minutes``). One file is written atomically (temp file + rename) and
the other names are copies of it, themselves written atomically: no two names share a file, so replacing or truncating one (``cp other.pt checkpoint_last.pt``) never
changes another.

Format versions: a file of an earlier ``version`` is brought to today's by the upgrade steps registered with
:func:`upgrade_from` as it is read (:func:`load`); a newer one is refused with a one-line error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmt.data.dictionary import Dictionary
from attnmt.data.subword import TextPipeline, build_tokenizer
from attnmt.errors import UserError
from attnmt.fileio import atomic_open, atomic_torch_save, pid_alive
from attnmt.registry import get

FORMAT = "attnmt-checkpoint"
VERSION = 1
LAST = "checkpoint_last.pt"
BEST = "checkpoint_best.pt"
EPOCH_PATTERN = re.compile(r"^checkpoint(\d+)\.pt$")  # checkpoint{epoch}.pt
UPDATE_PATTERN = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")  # checkpoint_{epoch}_{updates}.pt
BEST_N_PATTERN = re.compile(r"^checkpoint\.best_([a-z_]+)_(-?[\d.]+)(?:_(\d+))?\.pt$")  # --keep-best-checkpoints
BUNDLE_FILE = "model.pt"  # a model directory's checkpoint (``--path DIR``)


def epoch_name(epoch: int) -> str:
    return f"checkpoint{epoch}.pt"


def best_n_name(metric: str, value: float, num_updates: int) -> str:
    """The name of one of the ``--keep-best-checkpoints`` N best: fairseq's ``checkpoint.best_METRIC_VALUE.pt``
    with the value to 6 decimals and the update count after it, so that a later checkpoint whose value rounds
    alike never replaces an earlier, better one."""
    return f"checkpoint.best_{metric}_{value:.6f}_{num_updates}.pt"


def interval_name(epoch: int, num_updates: int) -> str:
    return f"checkpoint_{epoch}_{num_updates}.pt"


# ------------------------------------------------------------------------------------------------ the data section


@dataclass
class DataSection:
    """The languages, dictionaries and text pipeline a model was trained with (the checkpoint's ``data``)."""

    source_lang: str
    target_lang: str
    joint_dictionary: bool
    src_dict: dict  # Dictionary.to_state()
    tgt_dict: dict
    src_dict_sha256: str
    tgt_dict_sha256: str
    bpe: str = "none"  # registered subword model name
    bpe_model: torch.Tensor | None = None  # its model file's bytes (uint8)
    tokenizer: str = "none"
    lowercase: bool = False
    # an imported model's own conventions (attnmt's are the defaults)
    tgt_bpe_model: torch.Tensor | None = None  # the target side's subword model, where the sides have their own
    decoder_start: str = ""  # the symbol the decoder starts from ("": the end of sentence)
    language_tokens: dict | None = None  # language code -> its token: the source's starts the source, the
    # target's is forced as the first token generated (M2M-100, NLLB)

    # what must agree between checkpoints of one run (averaging) and between a checkpoint and DATA_BIN (resume)
    IDENTITY = ("source_lang", "target_lang", "joint_dictionary", "src_dict_sha256", "tgt_dict_sha256", "bpe",
                "tokenizer", "lowercase")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data, path: str | os.PathLike) -> DataSection:
        need = ("source_lang", "target_lang", "src_dict", "tgt_dict")
        if not isinstance(data, dict) or any(k not in data for k in need):
            raise UserError(f"{path}: the checkpoint has no complete 'data' section (languages and dictionaries); "
                            f"it cannot translate on its own: use a checkpoint written by attnmt train")
        return cls(source_lang=str(data["source_lang"]), target_lang=str(data["target_lang"]),
                   joint_dictionary=bool(data.get("joint_dictionary", False)), src_dict=data["src_dict"],
                   tgt_dict=data["tgt_dict"], src_dict_sha256=str(data.get("src_dict_sha256") or ""),
                   tgt_dict_sha256=str(data.get("tgt_dict_sha256") or ""), bpe=str(data.get("bpe") or "none"),
                   bpe_model=data.get("bpe_model"), tokenizer=str(data.get("tokenizer") or "none"),
                   lowercase=bool(data.get("lowercase", False)), tgt_bpe_model=data.get("tgt_bpe_model"),
                   decoder_start=str(data.get("decoder_start") or ""),
                   language_tokens=dict(data["language_tokens"]) if data.get("language_tokens") else None)

    def bpe_model_bytes(self, side: str = "src") -> bytes | None:
        """The stored subword model of ``side`` ("src"; "tgt": the target's own, else the shared one)."""
        raw = self.bpe_model
        if side == "tgt" and self.tgt_bpe_model is not None and torch.is_tensor(self.tgt_bpe_model):
            raw = self.tgt_bpe_model
        if raw is None or not torch.is_tensor(raw) or not raw.numel():
            return None
        return bytes(raw.to(torch.uint8).numpy().tobytes())

    def dictionaries(self, path: str | os.PathLike):
        """(source, target) Dictionary, checked against their stored checksums."""
        try:
            dicts = Dictionary.from_state(self.src_dict), Dictionary.from_state(self.tgt_dict)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        for side, d, want in (("src", dicts[0], self.src_dict_sha256), ("tgt", dicts[1], self.tgt_dict_sha256)):
            if want and d.checksum() != want:
                raise UserError(f"{path}: the stored {side} dictionary does not match its checksum; the file is "
                                f"corrupt")
        return dicts

    def pipelines(self, path: str | os.PathLike):
        """(source, target) TextPipeline: raw text <-> the pieces the model was trained on."""
        bpe_cls = get("bpe", self.bpe).obj

        def subword_model(side: str):
            raw = self.bpe_model_bytes(side)
            if raw is not None:
                return bpe_cls.from_bytes(raw, what=f"{path} (stored subword model)")
            if self.bpe != "none":
                raise UserError(f"{path}: the checkpoint says bpe '{self.bpe}' but holds no subword model; use a "
                                f"checkpoint written by attnmt train from a preprocessed directory with its model")
            return bpe_cls.load()

        src_bpe = subword_model("src")
        tgt_bpe = subword_model("tgt") if self.tgt_bpe_model is not None else src_bpe
        return tuple(TextPipeline(build_tokenizer(self.tokenizer, lang), bpe, lowercase=self.lowercase)
                     for lang, bpe in ((self.source_lang, src_bpe), (self.target_lang, tgt_bpe)))

    def dictionary_differences(self, other: DataSection) -> list[str]:
        """How the dictionaries and languages of ``other`` (now) differ from these (the checkpoint's)."""
        problems = []
        for side, name in (("src", "source"), ("tgt", "target")):
            a, b = getattr(self, f"{side}_dict_sha256"), getattr(other, f"{side}_dict_sha256")
            if a != b:
                na = len(getattr(self, f"{side}_dict").get("symbols", []))
                nb = len(getattr(other, f"{side}_dict").get("symbols", []))
                problems.append(f"{name} dictionary: checkpoint sha256 {a[:12]} ({na} symbols), now {b[:12]} "
                                f"({nb} symbols)")
        for key in ("source_lang", "target_lang"):
            if getattr(self, key) != getattr(other, key):
                problems.append(f"{key.replace('_', ' ')}: checkpoint {getattr(self, key)!r}, now "
                                f"{getattr(other, key)!r}")
        return problems


# ------------------------------------------------------------------------------------------------ weights


def same_tensor(t: torch.Tensor) -> tuple:
    """A key equal for two tensors exactly when they are the same data in the same layout (tied weights)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def portable_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict as float32 CPU tensors, entries that share a tensor still sharing one (stored once)."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state.items():
        key = same_tensor(v)
        if key not in done:
            v = v.detach()
            done[key] = v.float().cpu() if v.is_floating_point() else v.cpu()
        out[k] = done[key]
    return out


def tie_like(weights: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with the entries that are one tensor in ``like`` made one tensor again (the first's)."""
    first: dict[tuple, str] = {}
    out = {}
    for k, v in weights.items():
        key = same_tensor(like[k])
        out[k] = out[first[key]] if key in first else v
        first.setdefault(key, k)
    return out


# ------------------------------------------------------------------------------------------------ files


def resolve(path: str | os.PathLike) -> Path:
    """``path`` itself, or ``path/model.pt`` for a model directory."""
    p = Path(path)
    if p.is_dir():
        if (p / BUNDLE_FILE).is_file():
            return p / BUNDLE_FILE
        raise UserError(f"{p}: is a directory without {BUNDLE_FILE}; pass a checkpoint file (e.g. "
                        f"{p}/checkpoint_best.pt) or a directory holding {BUNDLE_FILE}")
    if not p.exists():
        raise UserError(f"{p}: no such checkpoint file; pass a checkpoint written by attnmt train")
    return p


Upgrade = Callable[[dict], dict]
UPGRADES: dict[int, Upgrade] = {}  # version v -> what turns a version-v checkpoint into a version v + 1 one


def upgrade_from(version: int) -> Callable[[Upgrade], Upgrade]:
    """Register the function that turns a checkpoint of format ``version`` into one of ``version + 1`` (fairseq's
    ``_upgrade_state_dict``). A change of the format raises :data:`VERSION` by one and adds one such function
    (renamed keys, new sections with their defaults, converted tensors); :func:`load` runs every step from a
    file's version up to :data:`VERSION`, so checkpoints of every earlier format keep loading."""

    def register(fn: Upgrade) -> Upgrade:
        UPGRADES[version] = fn
        return fn

    return register


def upgrade(ckpt: dict, path: str | os.PathLike) -> dict:
    """``ckpt`` (of any version up to :data:`VERSION`) in today's format."""
    version = ckpt["version"]
    while version < VERSION:
        step = UPGRADES.get(version)
        if step is None:
            raise UserError(f"{path}: checkpoint version {version} has no upgrade to version {version + 1} in this "
                            f"attnmt; load it with the attnmt that wrote it and save it again, or use a newer attnmt")
        ckpt = step(dict(ckpt))
        version += 1
        ckpt["version"] = version
    return ckpt


FAIRSEQ_HINT = ("{path}: a fairseq checkpoint, not an attnmt one; convert it once with attnmt import-fairseq {path} "
                "--data DATA_BIN --output model.pt (DATA_BIN: the fairseq data-bin with its dict.*.txt)")


def verify_bytes(path: str | os.PathLike) -> None:
    """UserError unless every record of the checkpoint file ``path`` (a zip archive, as ``torch.save`` writes)
    matches the CRC-32 stored with it: a file damaged on disk or in a copy is refused instead of loading wrong
    weights. Files of torch's legacy (non-zip) format carry no checksums and pass."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        bad, detail = "?", str(e)[:120]
    else:
        detail = ""
    if bad is not None:
        what = f"its record {bad!r} does not match its checksum" if not detail else f"its archive is damaged: {detail}"
        raise UserError(f"{path}: the file is damaged ({what}); it was corrupted on disk or in a copy: use "
                        f"another copy or an earlier checkpoint")


def check_finite(weights: dict, path: str | os.PathLike, fix: str = "use an earlier checkpoint") -> None:
    """UserError naming the first parameter of ``weights`` that holds NaN or infinite values (a diverged run's
    weights translate to empty lines and train to nothing)."""
    for name, t in weights.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            count = int((~torch.isfinite(t)).sum())
            raise UserError(f"{path}: the weights hold NaN or infinite values ({count:,} of {t.numel():,} in {name}); "
                            f"the run that wrote them diverged: {fix}")


def load(path: str | os.PathLike, mmap: bool = False) -> dict:
    """Read a checkpoint safely (``weights_only=True``); anything but a complete attnmt checkpoint is a UserError.

    ``mmap``: map the file instead of reading it (zip-format files), so tensors never read are never paged in.
    The file's checksums (:func:`verify_bytes`) and the weights' finiteness (:func:`check_finite`) are checked.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a checkpoint file")
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file; check the path")
    verify_bytes(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as e:  # truncated file, foreign pickle, ...: the weights-only unpickler fails in many ways
        if "argparse.Namespace" in str(e):  # what older fairseq versions store their options as
            raise UserError(FAIRSEQ_HINT.format(path=path)) from None
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}: not an attnmt checkpoint (torch.load with weights_only=True failed: "
                        f"{type(e).__name__}: {first}); use a file written by attnmt train") from None
    if isinstance(ckpt, dict) and "model" in ckpt and ("cfg" in ckpt or "args" in ckpt) and "format" not in ckpt:
        raise UserError(FAIRSEQ_HINT.format(path=path))
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path}: not an attnmt checkpoint (no format '{FORMAT}'); use a file written by attnmt train")
    version = ckpt.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise UserError(f"{path}: checkpoint version {version!r} is not supported (this attnmt reads versions 1 "
                        f"to {VERSION}); upgrade attnmt")
    ckpt = upgrade(ckpt, path)
    for key in ("model", "model_name", "model_config", "data"):
        if key not in ckpt:
            raise UserError(f"{path}: attnmt checkpoint without {key!r}; the file is incomplete or damaged")
    if not isinstance(ckpt["model"], dict) or not ckpt["model"]:
        raise UserError(f"{path}: checkpoint has no model parameters")
    check_finite(ckpt["model"], path)
    return ckpt


def remove_partial_files(save_dir: str | os.PathLike) -> list[Path]:
    """Delete the temp files of checkpoint writes that were killed (``.checkpoint*.pt.PID.XXXX.tmp`` whose
    writer no longer runs, and those of older versions, whose names hold no pid)."""
    removed = []
    for p in Path(save_dir).glob(".checkpoint*.pt.*.tmp"):
        pid = p.name.split(".pt.", 1)[1].split(".", 1)[0]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def save(state: dict, path: str | os.PathLike) -> None:
    """Write a checkpoint atomically (a crash mid-write leaves the old file)."""
    atomic_torch_save(state, path)


def _copy(src: Path, dst: Path) -> None:
    """Make ``dst`` a copy of ``src``, written as every output is (``fileio.atomic_open``)."""
    with open(src, "rb") as f, atomic_open(dst, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)


def save_as(state: dict, save_dir: str | os.PathLike, names: list[str]) -> list[Path]:
    """Write ``state`` under ``names[0]`` in ``save_dir`` and copy it to the other names; returns the paths.

    ``checkpoint_last.pt``, where it is among the names, is written first: a run killed during a save leaves
    no other name of that save without it, so the next run resumes from the newest state.
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    paths = [save_dir / n for n in sorted(dict.fromkeys(names), key=lambda n: n != LAST)]
    save(state, paths[0])
    for p in paths[1:]:
        _copy(paths[0], p)
    return paths
