"""Forced decoding: how likely a model finds given target sentences (fairseq's ``--score-reference``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from attnmt.errors import UserError
from attnmt.generation.generator import collate, make_batches
from attnmt.generation.search import Hypothesis


def reference_log_probs(generator, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
    """Per-token natural-log probabilities of each target (ids, final ``</s>`` included) given its source (ids,
    final ``</s>`` included), in one batch, with ``generator``'s model, device and precision. An ensemble gives
    the log of its members' averaged probabilities, as its search does."""
    symbols = generator.symbols
    start, pad = symbols.first, symbols.pad
    src, src_lengths = collate(sources, pad, generator.device)
    prev, _ = collate([[start] + list(t[:-1]) for t in targets], pad, generator.device)
    gold, _ = collate(targets, pad, generator.device)
    with torch.inference_mode(), generator.autocast():
        model = generator.model
        logits = model.decode(prev, model.encode(src, src_lengths))
        lprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    return [lprobs[k, : len(t)].tolist() for k, t in enumerate(targets)]


def score_references(generator, sources: list[list[int]], targets: list[list[int]], max_tokens: int | None,
                     batch_size: int | None, where: str, progress: Callable[[int], None] | None = None
                     ) -> Iterator[tuple[int, list]]:
    """``(index, [Hypothesis])`` in input order, each target scored given its source, batched by length as the
    search batches (``max_tokens`` 0: the device's choice). The score is the mean log-probability per token and
    the positional scores are the per-token ones (fairseq's SequenceScorer)."""
    sources = [generator.check_length(list(s), i, where) for i, s in enumerate(sources)]
    limit = generator.model.max_positions()[1]
    for i, t in enumerate(targets):
        if len(t) > limit:
            raise UserError(f"{where}:{i + 1}: the reference has {len(t)} tokens but the model accepts at most "
                            f"{limit}; leave it out with --skip-invalid-size-inputs-valid-test")
    lengths = [max(len(s), len(t)) for s, t in zip(sources, targets)]
    done: dict[int, list[Hypothesis]] = {}
    for batch in make_batches(lengths, max_tokens or generator.backend.decoding_max_tokens(), batch_size):
        t0 = time.perf_counter()
        scores = reference_log_probs(generator, [sources[i] for i in batch], [targets[i] for i in batch])
        stats = generator.stats
        stats.seconds += time.perf_counter() - t0
        stats.sentences += len(batch)
        stats.source_tokens += sum(len(sources[i]) for i in batch)
        stats.target_tokens += sum(len(targets[i]) for i in batch)
        for i, lp in zip(batch, scores):
            done[i] = [Hypothesis(tokens=list(targets[i]), score=sum(lp) / len(lp), positional_scores=lp)]
        if progress is not None:
            progress(len(batch))
    return ((i, done[i]) for i in range(len(sources)))
