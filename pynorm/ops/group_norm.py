"""The GroupNorm and InstanceNorm ops: their specs (math in :mod:`pynorm.reference.group_norm`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError, ShapeError
from ._spec import REQUIRED, Input, OpSpec, Option, Param, StatsVariant, check_bool, check_eps, check_positive_int


@dataclass(frozen=True, eq=False)
class GroupNormCtx:
    """What the backward needs: ``x`` as ``(N, C, S)``, the parameters, the ``(N G,)`` per-group ``mean`` and
    ``rstd``, the conventions."""

    x: Any
    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    num_groups: int
    eps: float


class GroupNormGrads(NamedTuple):
    """Gradients of GroupNorm; ``dweight``/``dbias`` are None when there was no weight/bias."""

    dx: Any
    dweight: Any
    dbias: Any


@dataclass(frozen=True, eq=False)
class InstanceNormCtx:
    """What the backward needs: ``x`` as ``(N, C, S)``, the parameters, the ``(N C,)`` per-instance ``mean`` and
    ``rstd`` (the running statistics' where ``use_input_stats`` is False), the conventions."""

    x: Any
    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    use_input_stats: bool
    eps: float


class InstanceNormGrads(NamedTuple):
    """Gradients of InstanceNorm (none for the running statistics)."""

    dx: Any
    dweight: Any
    dbias: Any


def check_channel_axis(v: Any, name: str) -> int:
    """``1`` (channels first: ``(N, C, *spatial)``, PyTorch's) or ``-1`` (channels last: ``(N, *spatial, C)``,
    Flax's and Keras')."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) not in (1, -1):
        raise ArgumentError(f"{name} must be 1 (channels first, PyTorch) or -1 (channels last, Flax/Keras), got {v!r}")
    return int(v)


def check_momentum(v: Any, name: str) -> float:
    """A real momentum in ``[0, 1]``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= float(v) <= 1.0:
        raise ArgumentError(f"{name} must be a real number in [0, 1], got {v!r}")
    return float(v)


CHANNEL_AXIS = Option(
    "channel_axis", 1, check_channel_axis, "where the channels are: 1 (``(N, C, *spatial)``, PyTorch) or -1 "
    "(``(N, *spatial, C)``, Flax, Keras; read as a channels-first copy)", to_backend=False,
)  # fmt: skip
EPS = Option("eps", 1e-5, check_eps, "added to the variance inside the root (>= 0; PyTorch's 1e-5)")
WEIGHT = Param("weight", "channel", 1.0, "per-channel scale, ``(C,)``")
#: the running statistics of InstanceNorm and BatchNorm (keyword inputs; the updated ones are returned)
RUNNING = (
    Input("running_mean", "running", "running mean per channel, ``(C,)``", required=False, keyword=True),
    Input("running_var", "running", "running variance per channel, ``(C,)``", required=False, keyword=True),
)
MOMENTUM_DOC = "the weight of the batch's statistics in the running ones"
BIAS = Param("bias", "channel", 0.0, "per-channel shift, ``(C,)``")


def channel_spec(options: tuple[Option, ...], **own: Any) -> OpSpec:
    """An op of the ``"channels"`` layout with a per-channel ``weight`` and ``bias``: its own ``options``, then
    ``eps`` and ``channel_axis``; ``own``: the rest of its spec."""
    return OpSpec(params=(WEIGHT, BIAS), options=(*options, EPS, CHANNEL_AXIS), layout="channels", **own)


def _groups(options: Mapping[str, Any], channels: int) -> None:
    g = options["num_groups"]
    if channels % g:
        raise ShapeError(f"num_groups={g} must divide the {channels} channels of x")


def column_term_scales(x3: np.ndarray, arrays: Mapping[str, Any], dy3: np.ndarray, options: Mapping[str, Any]) -> dict:
    """LayerNorm's term scales on each channel's ``N S`` values, with the batch's statistics (``options["training"]``)
    or the running ones (BatchNorm's; InstanceNorm's with ``use_input_stats=False``)."""
    n, c, s = x3.shape
    wide = np.longdouble  # (as LayerNorm's: float64 squares of huge float64 inputs overflow)
    cols = np.asarray(x3).astype(wide).transpose(1, 0, 2).reshape(c, -1)
    dyc = np.abs(np.asarray(dy3).astype(wide)).transpose(1, 0, 2).reshape(c, -1)
    if options["training"]:
        mean, var = cols.mean(axis=1, keepdims=True), cols.var(axis=1, keepdims=True)
    else:
        mean = np.asarray(arrays["running_mean"], np.float64)[:, None]
        var = np.asarray(arrays["running_var"], np.float64)[:, None]
    r = 1 / np.sqrt(var + options["eps"])
    xhat = np.abs((cols - mean) * r)
    sr = np.sqrt(var) * r + np.abs(mean) * r * (0 if options["training"] else 1)
    w = np.ones((c, 1)) if arrays.get("weight") is None else np.abs(np.asarray(arrays["weight"], np.float64))[:, None]
    b = 0 if arrays.get("bias") is None else np.abs(np.asarray(arrays["bias"], np.float64))[:, None]
    g = dyc * w
    if options["training"]:
        dx = r * (g + g.mean(axis=1, keepdims=True) + xhat * (g * xhat).mean(axis=1, keepdims=True))
    else:
        dx = r * g

    def back(a: np.ndarray) -> np.ndarray:
        return a.reshape(c, n, s).transpose(1, 0, 2)

    out = {
        "y": back((xhat + sr) * w + b),
        "dx": back(dx),
        "dweight": (dyc * (xhat + sr)).sum(axis=1),
        "dbias": dyc.sum(axis=1),
    }
    return {k: v.astype(np.float64) for k, v in out.items()}


def channel_term_scales(groups: Any) -> Any:
    """LayerNorm's term scales on the ``(N G, C/G S)`` rows (``groups(options, C)`` of them), each row with its
    channels' weights: ``y`` ``(|x̂| + s r)|w| + |b|``, ``dx`` ``r (|g| + mean|g| + |x̂| mean|g x̂|)``, the
    parameter gradients their column sums per channel. Normalized with running statistics (InstanceNorm's
    ``use_input_stats=False``): BatchNorm's evaluation terms, per channel."""

    def scales(x3: np.ndarray, arrays: Mapping[str, Any], dy3: np.ndarray, options: Mapping[str, Any]) -> dict:
        if not options.get("use_input_stats", True) and arrays.get("running_mean") is not None:
            # normalized with the running statistics (InstanceNorm's use_input_stats=False): BatchNorm's evaluation
            # terms, per channel (the input's own statistics, at eps = 0 on a constant input, gave dx a scale of 0)
            return column_term_scales(x3, arrays, dy3, {"training": False, "eps": options.get("eps", 1e-5)})
        n, c, s = x3.shape
        g = groups(options, c)
        # (in extended precision, as LayerNorm's: float64 squares of huge float64 inputs overflow, and an inf
        # times the r = 0 it gives made the scale NaN: any difference from the reference then read as inf ulps)
        rows = np.asarray(x3).astype(np.longdouble).reshape(n * g, -1)
        dyr = np.abs(np.asarray(dy3).astype(np.longdouble)).reshape(n * g, -1)
        d = rows - rows.mean(axis=1, keepdims=True)
        sd = np.sqrt((d * d).mean(axis=1, keepdims=True))
        r = 1 / np.sqrt(sd * sd + options.get("eps", 1e-5))
        # (a row without spread at eps = 0: r = inf, and its terms' magnitude is 0, not 0 * inf = NaN)
        xhat = np.where(d == 0, 0, np.abs(d * r))
        sr = np.where(sd == 0, 0, sd * r)

        def per_row(p: Any) -> Any:
            if p is None:
                return None
            a = np.abs(np.asarray(p, np.float64))
            return np.broadcast_to(np.repeat(a.reshape(g, c // g), s, axis=1)[None], (n, g, (c // g) * s)).reshape(
                n * g, -1
            )

        w = per_row(arrays.get("weight"))
        w = np.ones_like(rows) if w is None else w
        b = per_row(arrays.get("bias"))
        gg = dyr * w
        out = {
            "y": ((xhat + sr) * w + (0 if b is None else b)).reshape(n, c, s),
            "dx": (r * (gg + gg.mean(axis=1, keepdims=True) + xhat * (gg * xhat).mean(axis=1, keepdims=True))).reshape(
                n, c, s
            ),
            "dweight": (dyr * (xhat + sr)).reshape(n, c, -1).sum(axis=(0, 2)),
            "dbias": dyr.reshape(n, c, -1).sum(axis=(0, 2)),
        }
        return {k: v.astype(np.float64) for k, v in out.items()}

    return scales


_GROUP_NORM_DOC = r"""GroupNorm (Wu & He 2018, "Group Normalization"); returns ``(y, ctx)`` for
:func:`group_norm_backward`.

.. math::

    y_{ncs} = \frac{x_{ncs} - \mu_{ng}}{\sqrt{v_{ng} + \epsilon}}\, w_c + b_c

with :math:`\mu_{ng}`, :math:`v_{ng}` (biased) over the ``C / num_groups`` channels of group ``g`` and every
spatial position of sample ``n``: ``x`` of shape ``(N, C, *spatial)`` (``channel_axis=-1``: ``(N, *spatial,
C)``). PyTorch's ``F.group_norm(x, num_groups, weight, bias, eps)``; Flax's ``GroupNorm`` is channels-last
(``channel_axis=-1``), with ``epsilon=1e-6`` by default.
"""

_GROUP_NORM_BACKWARD_DOC = r"""GroupNorm backward: ``GroupNormGrads(dx, dweight, dbias)``.

LayerNorm's backward on each ``(sample, group)``'s values (:func:`layer_norm_backward`), the weight of each value
its channel's; :math:`dw_c = \sum_{n, s} dy\,\hat x`, :math:`db_c = \sum_{n, s} dy`.
"""

GROUP_NORM = channel_spec(
    name="group_norm",
    doc=_GROUP_NORM_DOC,
    backward_doc=_GROUP_NORM_BACKWARD_DOC,
    options=(
        Option(
            "num_groups", REQUIRED, check_positive_int, "G, the number of groups: it must divide C", annotation="int"
        ),
    ),
    grads=GroupNormGrads,
    ctx=GroupNormCtx,
    variant=StatsVariant("centered", affine="channel"),
    term_scales=channel_term_scales(lambda options, c: options["num_groups"]),
    check=_groups,
    cases=({"num_groups": 2}, {"num_groups": 1}, {"num_groups": 4, "eps": 0.1}),
    summary="y = (x - mean_group) / sqrt(var_group + eps) * w_c + b_c",
)


def running_result(outs: tuple[Any, ...], ctx: Any, options: Mapping[str, Any]) -> Any:
    """``y``, or ``(y, running_mean', running_var')`` where the running statistics were updated (InstanceNorm,
    BatchNorm)."""
    return outs if len(outs) > 1 else outs[0]


def running_pair(arrays: Mapping[str, Any]) -> Any:
    """``running_mean`` (None without running statistics), once checked to come with ``running_var``."""
    rm, rv = arrays.get("running_mean"), arrays.get("running_var")
    if (rm is None) != (rv is None):
        raise ArgumentError("running_mean and running_var go together: give both or neither")
    return rm


_INSTANCE_NORM_DOC = r"""InstanceNorm (Ulyanov et al. 2016, "Instance Normalization"); returns ``(y, ctx)`` for
:func:`instance_norm_backward`, or ``((y, running_mean', running_var'), ctx)`` with running statistics and
``use_input_stats``.

GroupNorm with one group per channel: each sample's channel is normalized over its spatial positions. Given
``running_mean``/``running_var``, the updated ones are returned (PyTorch's ``F.instance_norm`` writes them in
place; pynorm never mutates an input): the batch means over ``N`` of the instances' means and *unbiased*
variances, blended with ``momentum``. ``use_input_stats=False`` normalizes with the running statistics instead
(evaluation mode of PyTorch's ``InstanceNorm`` with ``track_running_stats=True``).
"""

_INSTANCE_NORM_BACKWARD_DOC = r"""InstanceNorm backward: ``InstanceNormGrads(dx, dweight, dbias)`` (GroupNorm's
with one group per channel; element-wise, ``dx = dy w / sqrt(running_var + eps)``, with the running statistics).
"""


def _instance_arrays(
    x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any], options: Mapping[str, Any]
) -> None:
    rm = running_pair(arrays)
    if not options["use_input_stats"] and rm is None:
        raise ArgumentError("use_input_stats=False normalizes with running_mean and running_var: give them")
    if rm is not None and options["use_input_stats"]:
        if x_shape[0] == 0:
            raise ShapeError("updating the running statistics needs at least one instance, got an empty batch (N = 0)")
        spatial = math.prod(x_shape[2:])
        if spatial < 2:
            raise ShapeError(
                "updating the running statistics needs at least 2 spatial positions per instance (the unbiased "
                f"variance), got {spatial}"
            )


INSTANCE_NORM = channel_spec(
    name="instance_norm",
    doc=_INSTANCE_NORM_DOC,
    backward_doc=_INSTANCE_NORM_BACKWARD_DOC,
    inputs=RUNNING,
    options=(
        Option(
            "use_input_stats",
            True,
            check_bool,
            "normalize with each instance's own statistics (True) or with the running ones (False)",
        ),
        Option("momentum", 0.1, check_momentum, MOMENTUM_DOC),
    ),
    grads=InstanceNormGrads,
    ctx=InstanceNormCtx,
    variant=StatsVariant("centered", affine="channel"),
    term_scales=channel_term_scales(lambda options, c: c),
    check_arrays=_instance_arrays,
    cases=({}, {"eps": 0.1}),
    summary="y = (x - mean_instance) / sqrt(var_instance + eps) * w_c + b_c",
    result=running_result,
    result_doc="``y``, or ``(y, running_mean', running_var')`` when running statistics are given and "
    "``use_input_stats``",
)
