"""Forced decoding: how likely a model finds given target sentences (fairseq's ``--score-reference``)."""

from __future__ import annotations

import torch


def reference_log_probs(generator, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
    """Per-token natural-log probabilities of each target (ids, final ``</s>`` included) given its source (ids,
    final ``</s>`` included), in one batch, with ``generator``'s model, device and precision. An ensemble gives
    the log of its members' averaged probabilities, as its search does."""
    from attnmt.generation.generator import collate

    symbols = generator.symbols
    eos, pad = symbols.eos, symbols.pad
    src, src_lengths = collate(sources, pad, generator.device)
    prev, _ = collate([[eos] + list(t[:-1]) for t in targets], pad, generator.device)
    gold, _ = collate(targets, pad, generator.device)
    with torch.inference_mode(), generator._autocast():
        model = generator.model
        logits = model.decode(prev, model.encode(src, src_lengths))
        lprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    return [lprobs[k, : len(t)].tolist() for k, t in enumerate(targets)]
