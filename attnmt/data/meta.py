"""``DATA_BIN/preprocess.json``: what ``attnmt preprocess`` records about a binarized directory, read in one place.

The fields the rest of attnmt relies on sit at the top level of the file: ``source_lang``, ``target_lang``,
``joined_dictionary``, ``bpe`` (registered subword model name), ``bpe_model`` (its file in DATA_BIN),
``tokenizer`` and ``lowercase``. The rest of the file (``splits``, ``dictionaries``, ``options``, ``fingerprint``)
describes the run for people and for the up-to-date check. A directory without the file (binarized by fairseq)
reads as unknown languages, no subword model and no tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from attnmt.errors import UserError

FILE = "preprocess.json"
SAMPLE_SPLIT = "train_sample"  # BPE-dropout segmentations of the training split: train_sample1, train_sample2, ...


@dataclass(frozen=True)
class DataBinInfo:
    source_lang: str | None = None
    target_lang: str | None = None
    joined_dictionary: bool | None = None  # None: not recorded
    bpe: str | None = None  # None: not recorded
    bpe_model: str | None = None
    tokenizer: str = "none"
    lowercase: bool = False
    model: dict | None = None  # preprocess --from-model: the conventions of the model to fine-tune

    @classmethod
    def read(cls, data_bin: str | os.PathLike, required: bool = False) -> DataBinInfo:
        path = Path(data_bin) / FILE
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            if required:
                raise UserError(f"{path}: not found; point to a directory written by attnmt preprocess") from None
            return cls()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}:{getattr(e, 'lineno', 1)}: not valid JSON ({e}); re-run attnmt preprocess") \
                from None
        if not isinstance(meta, dict):
            raise UserError(f"{path}: not a preprocess.json written by attnmt preprocess; re-run attnmt preprocess")
        joined = meta.get("joined_dictionary")
        return cls(source_lang=meta.get("source_lang"), target_lang=meta.get("target_lang"),
                   joined_dictionary=None if joined is None else bool(joined), bpe=meta.get("bpe"),
                   bpe_model=meta.get("bpe_model"), tokenizer=str(meta.get("tokenizer") or "none"),
                   lowercase=bool(meta.get("lowercase", False)),
                   model=meta["model"] if isinstance(meta.get("model"), dict) else None)
