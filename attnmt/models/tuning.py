"""The three places where a backend (``attnmt/backends``) may tune the model, as explicit contracts.

* :class:`~attnmt.models.linear.Linear` (``models/linear.py``): ``nn.Linear`` whose forward can also apply the
  ReLU that follows it; a backend may swap it, once, for a module with the same contract that runs faster on its
  hardware.
* :class:`AttentionKernel`: attention modules choose between ``scaled_dot_product_attention`` and the plain
  matmul-softmax-matmul by the sequence length; the backend sets the length up to which the plain form runs
  (:func:`set_plain_attention_max_len`), and may give a kernel that computes the plain form, forward and backward,
  in one call each (:func:`set_fused_attention`, a :class:`~attnmt.models.kernels.TrainingAttention`).
* :class:`DropoutKernel`: modules that drop activations in training draw their masks either with
  ``torch.nn.functional.dropout`` (the default: a GPU's fused kernel) or from raw random bits
  (``models/dropout.py``: several times cheaper on the CPU); the backend chooses (:func:`set_random_bit_dropout`),
  and may give a kernel that computes the same masks from a seed and the element's index inside the pass that
  applies them (:func:`set_dropout_masks`, a :class:`~attnmt.models.kernels.DropoutMasks`).

The model never asks which device it runs on.
"""

from __future__ import annotations

from torch import nn

from attnmt.models.kernels import DropoutMasks, TrainingAttention
from attnmt.models.paths import AttentionPath, RowsPath


class AttentionKernel:
    """Mixin of attention modules: run the plain matmul-softmax-matmul when queries and keys are at most
    ``plain_attention_max_len`` long (0: never; fused SDPA kernels otherwise)."""

    plain_attention_max_len: int = 0
    fused_attention: TrainingAttention | None = None  # computes the plain form where it supports the operands
    default_path: AttentionPath | None = None  # how calls without a path of their own run (the kernel's)

    def use_plain_attention(self, queries: int, keys: int) -> bool:
        return max(queries, keys) <= self.plain_attention_max_len


def set_plain_attention_max_len(model: nn.Module, n: int) -> None:
    """Set the plain-attention length limit of every attention module of ``model``."""
    for m in model.modules():
        if isinstance(m, AttentionKernel):
            m.plain_attention_max_len = n


def set_fused_attention(model: nn.Module, kernel: TrainingAttention | None) -> None:
    """Give every attention module of ``model`` the kernel for its plain form (None: PyTorch's operations)."""
    for m in model.modules():
        if isinstance(m, AttentionKernel):
            m.fused_attention = kernel
            m.default_path = None if kernel is None else RowsPath()


class DropoutKernel:
    """Mixin of modules with dropout: with ``random_bit_dropout`` (the backend's choice) their masks come from raw
    random bits (:func:`attnmt.models.dropout.keep_mask`), else from ``torch.nn.functional.dropout``."""

    random_bit_dropout: bool = False
    dropout_masks: DropoutMasks | None = None  # computes the masks in the pass that applies them, where it can


def set_random_bit_dropout(model: nn.Module, on: bool) -> None:
    """Choose the dropout masks of every module of ``model`` that has dropout."""
    for m in model.modules():
        if isinstance(m, DropoutKernel):
            m.random_bit_dropout = on


def set_dropout_masks(model: nn.Module, kernel: DropoutMasks | None) -> None:
    """Give every module of ``model`` that has dropout the kernel for its masks (None: tensor operations)."""
    for m in model.modules():
        if isinstance(m, DropoutKernel):
            m.dropout_masks = kernel
