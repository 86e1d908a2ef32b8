"""What ``attnmt generate`` translates: a binarized split of a data directory (with its references where the split
has a target side) or raw text lines (with the guidance of their TAB fields), and which sentences are longer than
a model accepts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnmt.data.indexed import IndexedDataset, exists, pair_prefix
from attnmt.data.subword import remove_bpe
from attnmt.errors import UserError
from attnmt.generation.guidance import LineGuidance, suppressed
from attnmt.generation.search import Guidance
from attnmt.inference import InferenceBundle, check_data_dir
from attnmt.scoring import read_lines


@dataclass
class Inputs:
    """Sentences to translate, in input order: their source ids and texts, where they come from (for messages), the
    guidance of the search and, for a binarized split with a target side, the references (texts and ids)."""

    sources: list[list[int]]
    texts: list[str]
    where: str
    guide: Guidance
    refs: list[str] | None = None
    ref_ids: list[list[int]] | None = None


def fairseq_reference(bundle: InferenceBundle, ids) -> str:
    """fairseq-generate's ``T-`` string of a reference: its pieces, an unknown word as ``<<unk>>``, the subword
    markers removed (its ``--post-process`` for the model's subword model), not detokenized."""
    d = bundle.tgt_dict
    skip = {d.eos(), d.pad(), d.bos()}
    pieces = " ".join("<<unk>>" if i == d.unk() else d[i] for i in map(int, ids) if i not in skip)
    return remove_bpe(pieces, getattr(bundle.tgt_pipeline.bpe, "fairseq_post_process", "none"))


def read_split(bundle: InferenceBundle, data_bin: str, subset: str, suppress: Sequence[str] = (),
               fairseq_refs: bool = False) -> Inputs:
    """Split ``subset`` of ``data_bin`` (its dictionaries checked against the model's); ``suppress``: texts never
    to generate; ``fairseq_refs``: the references as fairseq-generate prints them (:func:`fairseq_reference`)."""
    check_data_dir(bundle, data_bin)
    src, tgt = bundle.source_lang, bundle.target_lang
    prefix = pair_prefix(data_bin, subset, src, tgt)
    if not exists(f"{prefix}.{src}"):
        raise UserError(f"{prefix}.{src}.bin/.idx: split '{subset}' not found in {data_bin}; choose another "
                        f"--gen-subset or binarize it with attnmt preprocess --testpref")
    src_ds = IndexedDataset(f"{prefix}.{src}")
    src_ds.check_ids(len(bundle.src_dict), f"the checkpoint's {src} dictionary")
    sources = [src_ds[i].tolist() for i in range(len(src_ds))]
    refs = ref_ids = None
    if exists(f"{prefix}.{tgt}"):
        tgt_ds = IndexedDataset(f"{prefix}.{tgt}")
        if len(tgt_ds) != len(src_ds):
            raise UserError(f"{prefix}.{tgt}.idx: {len(tgt_ds)} sentences but the source has {len(src_ds)}; "
                            f"re-run attnmt preprocess")
        tgt_ds.check_ids(len(bundle.tgt_dict), f"the checkpoint's {tgt} dictionary")
        ref_ids = [tgt_ds[i].tolist() for i in range(len(tgt_ds))]
        refs = [fairseq_reference(bundle, tgt_ds[i]) if fairseq_refs else
                bundle.detokenize(bundle.tgt_dict.string(tgt_ds[i])) for i in range(len(tgt_ds))]
    texts = [bundle.src_pipeline.decode(bundle.source_pieces(s)) for s in sources]
    return Inputs(sources, texts, f"{data_bin}/{subset}", Guidance(suppress=suppressed(bundle, suppress)), refs,
                  ref_ids)


def read_text(bundle: InferenceBundle, path: str, fields: LineGuidance, suppress: Sequence[str] = ()) -> Inputs:
    """The lines of ``path`` (``-``: stdin), their TAB fields read as ``fields`` says (prefixes, constraints)."""
    where = "stdin" if path == "-" else path
    lines = read_lines(path, "input")
    texts, guide = fields.split(lines, bundle, where, 0, suppressed(bundle, suppress))
    return Inputs(bundle.encode_sources(texts), texts, where, guide)


def too_long(bundle: InferenceBundle, inputs: Inputs, with_references: bool = False) -> list[int]:
    """The indices of the sentences longer than the model accepts (and of the references too, where
    ``with_references``)."""
    src_limit, tgt_limit = bundle.model.max_positions()
    return [i for i, s in enumerate(inputs.sources) if len(s) > src_limit
            or (with_references and len(inputs.ref_ids[i]) > tgt_limit)]
