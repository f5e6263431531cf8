"""The BatchNorm op: its spec (math in :mod:`pynorm.reference.batch_norm`)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError, ShapeError
from ._spec import REQUIRED, ColumnVariant, Option, check_bool
from .group_norm import (
    MOMENTUM_DOC,
    RUNNING,
    channel_spec,
    check_momentum,
    column_term_scales,
    running_pair,
    running_result,
)


@dataclass(frozen=True, eq=False)
class BatchNormCtx:
    """What the backward needs: ``x`` as ``(N, C, S)``, the parameters, the ``(C,)`` ``mean`` and ``rstd`` the
    forward normalized with (the batch's in training, the running ones otherwise), the conventions."""

    x: Any
    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    training: bool
    eps: float


class BatchNormGrads(NamedTuple):
    """Gradients of BatchNorm (none for the running statistics)."""

    dx: Any
    dweight: Any
    dbias: Any


def check_optional_momentum(v: Any, name: str) -> float | None:
    """None (the cumulative average) or a real in ``[0, 1]``."""
    return None if v is None else check_momentum(v, name)


def check_count(v: Any, name: str) -> int:
    """A count of batches: an int >= 0."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ArgumentError(f"{name} must be an int >= 0, got {v!r}")
    return int(v)


def _arrays(x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    rm = running_pair(arrays)
    if not options["training"]:
        if rm is None:
            raise ArgumentError("training=False normalizes with running_mean and running_var: give them")
        return
    values = int(np.prod(x_shape)) // x_shape[1] if len(x_shape) > 1 else 0
    if values < 2:
        raise ShapeError(f"training BatchNorm needs more than 1 value per channel, got x of shape {x_shape}")


_BATCH_NORM_DOC = r"""BatchNorm (Ioffe & Szegedy 2015, "Batch Normalization"); returns ``(y, ctx)`` for
:func:`batch_norm_backward`, or ``((y, running_mean', running_var'), ctx)`` in training with running statistics.

.. math::

    y_{ncs} = \frac{x_{ncs} - \mu_c}{\sqrt{v_c + \epsilon}}\, w_c + b_c

``training=True``: :math:`\mu_c`, :math:`v_c` (biased) of channel ``c``'s ``N x spatial`` values, and the running
statistics (if given) returned updated with the **unbiased** variance, as PyTorch updates them in place
(``momentum=None``: the cumulative average over ``num_batches_tracked + 1`` batches). ``training=False``: the
running statistics. ``x`` of shape ``(N, C, *spatial)`` (``channel_axis=-1``: ``(N, *spatial, C)``). PyTorch's
``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)``; Flax's ``BatchNorm``
names the blend the other way (``momentum=0.99`` is PyTorch's ``0.01``) and defaults to ``epsilon=1e-5``.
"""

_BATCH_NORM_BACKWARD_DOC = r"""BatchNorm backward: ``BatchNormGrads(dx, dweight, dbias)``.

Training: LayerNorm's backward on each channel's values (:math:`dx = r (g - \bar g - \hat x\,
\overline{g\hat x})`, :math:`g = dy\,w_c`, the means over ``(n, s)``); evaluation: :math:`dx = dy\,w_c /
\sqrt{v^{run}_c + \epsilon}`, element-wise. :math:`dw_c = \sum dy\,\hat x`, :math:`db_c = \sum dy`.
"""

SPEC = channel_spec(
    name="batch_norm",
    doc=_BATCH_NORM_DOC,
    backward_doc=_BATCH_NORM_BACKWARD_DOC,
    inputs=RUNNING,
    options=(
        Option(
            "training",
            REQUIRED,
            check_bool,
            "the batch's statistics (True) or the running ones (False)",
            annotation="bool",
        ),
        Option(
            "momentum",
            0.1,
            check_optional_momentum,
            f"{MOMENTUM_DOC}; None: the cumulative average",
            annotation="float | None",
        ),
        Option(
            "num_batches_tracked",
            0,
            check_count,
            "the batches the running statistics average already (only with momentum=None)",
        ),
    ),
    grads=BatchNormGrads,
    ctx=BatchNormCtx,
    variant=ColumnVariant("centered"),
    term_scales=column_term_scales,
    check_arrays=_arrays,
    cases=({"training": True}, {"training": False}, {"training": True, "momentum": None, "num_batches_tracked": 3}),
    summary="y = (x - mean_c) / sqrt(var_c + eps) * w_c + b_c, statistics over (N, *spatial)",
    result=running_result,
    result_doc="``y``, or ``(y, running_mean', running_var')`` in training with running statistics",
)
