"""The decoder cache a search gets, as the backend's :class:`~attnmt.models.kernels.DecodingKernels` choose it.

* :class:`~attnmt.models.incremental.SlotCache`: the default; keys/values written once per position and row,
  beams followed by moving ancestry, rows padded to the backend's ``row_bucket``;
* :class:`~attnmt.models.static_cache.StaticCache`: fixed buffers, each step run through the backend's recorder
  (``step_graphs``: CUDA graphs), for beam search;
* :class:`~attnmt.models.pool.PoolCache`: sentence places that sentences join and leave (continuous batching).
"""

from __future__ import annotations

import torch

from attnmt.models.incremental import SlotCache
from attnmt.models.interface import DecoderCache
from attnmt.models.kernels import DecodingKernels
from attnmt.models.pool import PoolCache
from attnmt.models.static_cache import StaticCache


def decoder_cache(layers: int, beam: int, max_positions: int, kernels: DecodingKernels) -> DecoderCache:
    """An empty cache for a decoder of ``layers`` layers and ``max_positions`` target positions, ``beam`` rows per
    sentence."""
    if kernels.step_graphs is not None and beam > 1:
        return StaticCache(layers, beam, max_positions, kernels.step_graphs())
    return SlotCache(layers, beam, kernels.row_bucket, kernels.fused_attention, kernels.step_attention)


def pool_cache(layers: int, beam: int, kernels: DecodingKernels, device: torch.device | str) -> PoolCache:
    """An empty pool of sentence places, ``beam`` rows each, on ``device``."""
    return PoolCache(layers, beam, kernels.row_bucket, kernels.fused_attention, kernels.step_attention, device)
