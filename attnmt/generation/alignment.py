"""fairseq-generate's ``--print-alignment``: the ``A-`` line of a hypothesis from the encoder-decoder attention.

The weights are the last decoder layer's attention averaged over its heads (fairseq's ``alignment_layer``),
computed by feeding the hypothesis back to the model: row ``t`` is the attention with which the decoder predicts
target token ``t``, the same numbers the search saw at that step.

* ``hard``: for every target token but the final ``</s>``, ``SRC-TGT`` with SRC the source token it attends to most
  (the final ``</s>`` of the source never counts), both counted from 0.
* ``soft``: for every target token, ``</s>`` included, its weights over all source tokens, ``</s>`` included, as
  comma-separated numbers with 6 decimals.
"""

from __future__ import annotations

import torch

from attnmt.models.attention_maps import attention_maps_of

STYLES = ("hard", "soft")


def attention_rows(model, source_ids: list[int], hypotheses: list[list[int]], pad: int, start: int,
                   device: torch.device) -> list[torch.Tensor]:
    """(T_i, S) last-layer, head-averaged attention of each hypothesis (ids, final ``</s>`` included) of one
    source (ids, final ``</s>`` included), in one batch; ``start``: the decoder's first token (``Symbols.first``)."""
    from attnmt.generation.generator import collate

    if not hypotheses:
        return []
    src, lengths = collate([source_ids] * len(hypotheses), pad, device)
    prev, _ = collate([[start] + list(h[:-1]) for h in hypotheses], pad, device)
    weights = attention_maps_of(model)(src, lengths, prev)[:, -1].float().mean(1).cpu()  # (B, T, S)
    return [weights[k, : len(h)] for k, h in enumerate(hypotheses)]


def alignment_line(weights: torch.Tensor, style: str) -> str:
    """The text after ``A-i<TAB>`` for one hypothesis' (T, S) weights (its final ``</s>`` is row T - 1, the
    source's is column S - 1)."""
    if style == "soft":
        return " ".join(",".join(f"{p:.6f}" for p in row) for row in weights.tolist())
    rows = weights[:-1, :-1]
    if rows.numel() == 0:
        return ""
    return " ".join(f"{s}-{t}" for t, s in enumerate(rows.argmax(dim=1).tolist()))


def alignment_lines(bundle, generator, source_ids: list[int], hyps, style: str) -> list[str]:
    """The ``A-`` line text of each hypothesis of one sentence, with the generator's device and precision."""
    with torch.inference_mode(), generator.autocast():
        rows = attention_rows(bundle.model, list(source_ids), [list(h.tokens) for h in hyps], bundle.symbols.pad,
                              bundle.symbols.first, generator.device)
    return [alignment_line(w, style) for w in rows]
