"""Transformer blocks over pynorm's ops, each with a hand-written backward.

* sublayers: :class:`Linear`, :class:`FeedForward` (tanh GELU), :class:`MultiHeadAttention` (QK-norm,
  the ``ln_q``/``ln_kv``/``ln_out`` variant, causal and padding masks), :class:`Norm`, :class:`Embedding`;
* :class:`Block` in the ``pre``, ``post``, ``sandwich`` / ``peri``, ``deepnorm``, ``layer_norm_scaling`` and
  ``hybrid`` placements (a :class:`Stack` also ``mix``), :func:`deepnorm_constants`;
* :class:`Stack` (per-layer gradient norms and update sizes, the multimodal hybrid, gradient
  checkpointing);
* training: :class:`Adam`, :class:`AdamW`, :class:`SGD` (:mod:`pynorm.optim`),
  :class:`LossScaler` (dynamic loss scaling), :class:`SequenceModel`,
  :func:`cross_entropy`, :func:`train_step` (fp32 or float16/bfloat16 activations).

Formulas, gradients and the depth demo: ``docs/blocks.md``.
"""

from __future__ import annotations

from ..deepnorm import deepnorm_constants
from ._base import Module
from .block import PLACEMENTS, STACK_PLACEMENTS, Block
from .stack import Stack, StackCtx
from .sublayers import (
    IO_NORM_KINDS,
    NORM_KINDS,
    Embedding,
    FeedForward,
    Linear,
    MultiHeadAttention,
    Norm,
    gelu_tanh,
    gelu_tanh_grad,
    masked_softmax,
    masked_softmax_backward,
)
from .train import (
    SGD,
    Adam,
    AdamW,
    LossScaler,
    SequenceModel,
    StepResult,
    cross_entropy,
    limit_blas_threads,
    sort_task,
    train_step,
)

__all__ = [
    "IO_NORM_KINDS",
    "NORM_KINDS",
    "PLACEMENTS",
    "SGD",
    "STACK_PLACEMENTS",
    "Adam",
    "AdamW",
    "Block",
    "Embedding",
    "FeedForward",
    "Linear",
    "LossScaler",
    "Module",
    "MultiHeadAttention",
    "Norm",
    "SequenceModel",
    "Stack",
    "StackCtx",
    "StepResult",
    "cross_entropy",
    "deepnorm_constants",
    "gelu_tanh",
    "gelu_tanh_grad",
    "limit_blas_threads",
    "masked_softmax",
    "masked_softmax_backward",
    "sort_task",
    "train_step",
]
