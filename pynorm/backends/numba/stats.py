"""The statistics family on the ``numba`` backend: LayerNorm, RMSNorm and every op of that family.

:data:`OP_IMPLS` maps each op of :data:`pynorm.ops.SPECS` whose ``family`` is ``"stats"`` (and whose
variant this backend has kernels for, :data:`pynorm.backends.numba.STATS_VARIANTS`) to a
:class:`StatsOp`: ``forward(x2d, *params, out=None, **options) -> (y, ctx)`` and
``backward(dy2d, ctx, dx_out=None) -> grads``, with the reference module's contract (same
arguments, options, ctx dataclass and grads tuple; ``spec.reference``). A new spec of the family
needs nothing here: its statistic picks the kernels' pieces (:mod:`._rowstats`).

Forward: one parallel pass over the rows (:func:`._stats_kernels.fwd`); ``ctx`` keeps ``x`` as
given and float64 per-row statistics (``mean`` where the statistic has one, ``rstd``).

Backward: ``dx`` row by row; parameter gradients from per-block partial sums (blocks of
:data:`._layout.ROW_BLOCK` rows, accumulated during the ``dx`` rows' first pass, or -- for few rows
of many elements, :func:`._layout.use_fused` -- by column tiles afterwards) added in float64 in
block order, so results do not depend on the thread count. Rows the fast path cannot take are
finished by the slow-path kernels, compiled on first need. Outputs not passed as
``out=``/``dx_out=`` come from a recycling pool (:class:`._common._BufferPool`).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any

import numpy as np

from ...ops import SPECS, OpSpec
from . import _common as cm
from . import _stats_kernels as k
from ._layout import use_fused, use_stream
from ._threads import launch
from ._variant import Tag, statistic

__all__ = ["OP_IMPLS", "StatsOp", "backward_rows", "forward_rows"]

#: the options of the family's kernels and their values where an op does not have them
_OPTION_DEFAULTS = {"eps": 0.0, "correction": 0, "eps_mode": "var", "weight_offset": 0.0}
#: the parameters of the "vector" affine source: a per-feature weight (with the offset) and a bias
_AFFINE = ("weight", "bias")


def _ctx_class(spec: OpSpec) -> type:
    ref = importlib.import_module(spec.reference)
    ret = typing.get_type_hints(ref.forward)["return"]
    return typing.get_args(ret)[1]  # type: ignore[no-any-return]


class StatsOp:
    """One op of the statistics family on this backend (see the module doc)."""

    def __init__(self, spec: OpSpec) -> None:
        unknown = [n for n in spec.param_names if n not in _AFFINE]
        if unknown:
            raise ValueError(f"{spec.name}: parameters {unknown} are not those of the vector affine source")
        self.spec = spec
        self.name = spec.name
        self.statistic = spec.variant.statistic
        self.centered = self.statistic == "centered"
        self.stat = statistic(self.statistic)
        self.ctx_type = _ctx_class(spec)
        self.grads = spec.grads
        self._fields = tuple(f.name for f in dataclasses.fields(self.ctx_type))
        self._options = {o.name: o.default for o in spec.options}

    def __repr__(self) -> str:
        return f"<numba stats op {self.name!r} (statistic {self.statistic!r})>"

    def _opts(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{self.name} forward() got unexpected keyword argument(s) {sorted(unknown)}")
        return {**_OPTION_DEFAULTS, **self._options, **options}

    def forward(self, x: np.ndarray, *params: Any, out: np.ndarray | None = None, **options: Any) -> tuple[Any, Any]:
        """Forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (``y`` is ``out`` if given)."""
        if len(params) != len(self.spec.param_names):
            raise TypeError(f"{self.name} forward() takes x and {len(self.spec.param_names)} parameter(s)")
        p = dict(zip(self.spec.param_names, params, strict=True))
        o = self._opts(options)
        rows = x.shape[0]
        mdt = cm.math_dtype(x.dtype)
        y = cm.output(out, x.shape, x.dtype)
        mean = np.empty(rows) if self.centered else None
        rstd = np.empty(rows)
        if rows:
            w = cm.effective_weight(p.get("weight"), float(o["weight_offset"]), mdt)
            ys = cm.storage(y)
            forward_rows(
                self.stat, cm.storage(x), w, cm.param(p.get("bias"), mdt), float(o["eps"]), int(o["correction"]),
                o["eps_mode"] == "std", ys, mean, rstd, use_stream(ys),
            )  # fmt: skip
        values = {**o, **p, "x": x, "mean": mean, "rstd": rstd}
        values["eps"] = float(values["eps"])
        values["weight_offset"] = float(values["weight_offset"])
        return y, self.ctx_type(**{f: values[f] for f in self._fields})

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
        x = ctx.x
        weight = getattr(ctx, "weight", None)
        bias = getattr(ctx, "bias", None)
        rows, h = x.shape
        mdt = cm.math_dtype(x.dtype)
        dx = cm.output(dx_out, x.shape, x.dtype)
        pw = cm.block_partials(rows, h, mdt, weight is not None)
        pb = cm.block_partials(rows, h, mdt, bias is not None)
        if rows:
            dxs = cm.storage(dx)
            backward_rows(
                self.stat,
                "fused" if use_fused(rows, h) else "rows",
                cm.storage(x),
                cm.storage(dy),
                cm.effective_weight(weight, float(getattr(ctx, "weight_offset", 0.0)), mdt),
                cm.stats(ctx.mean) if self.centered else None,
                cm.stats(ctx.rstd),
                int(getattr(ctx, "correction", 0)),
                getattr(ctx, "eps_mode", "var") == "std",
                dxs,
                pw,
                pb,
                use_stream(dxs),
            )
        partials = {"weight": (pw, weight), "bias": (pb, bias)}
        grads = []
        for n in self.spec.param_names:
            part, param = partials[n]
            grads.append(None if part is None or param is None else cm.reduce_blocks(part, param.dtype))
        return self.grads(dx, *grads)


def forward_rows(
    stat: Tag,
    x: Any,
    w: Any,
    b: Any,
    eps: float,
    corr: int,
    std_mode: bool,
    y: Any,
    mean: Any,
    rstd: Any,
    stream: bool,
) -> None:
    """The forward's kernels on storage arrays: :func:`._stats_kernels.fwd`, then the slow path for the rows it
    left (``stream``: streaming stores for ``y``)."""
    args = (stat, x, w, b, eps, corr, std_mode, y, mean, rstd, True if stream else None)
    if launch(k.fwd, x.shape[0] * x.shape[1], *args):
        k.fwd_slow(*args)


def backward_rows(
    stat: Tag,
    path: str,
    x: Any,
    dy: Any,
    w: Any,
    mean: Any,
    rstd: Any,
    corr: int,
    std_mode: bool,
    dx: Any,
    pw: Any,
    pb: Any,
    stream: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The backward's kernels on storage arrays along ``path`` (``"fused"`` or ``"rows"``, see
    :func:`._layout.use_fused`): ``dx`` and the block partials ``pw``/``pb`` (or None). Returns the rows'
    ``scale`` (:data:`._stats_kernels.FAST` or the slow path's exponent) and, on the rows path of a
    centred statistic, their ``c``."""
    rows, h = x.shape
    st = True if stream else None
    scale = np.empty(rows, np.int64)
    cs = None
    if path == "fused":
        if launch(k.bwd_fused, rows * h, stat, x, dy, w, mean, rstd, corr, std_mode, dx, pw, pb, scale, st):
            k.bwd_slow(stat, x, dy, w, mean, rstd, corr, std_mode, dx, scale, None)
            if pw is not None or pb is not None:
                k.redo_blocks(stat, x, dy, mean, rstd, scale, pw, pb)
        return scale, cs
    if path != "rows":
        raise ValueError(f"unknown backward path {path!r}")
    cs = np.empty(rows) if mean is not None else None
    slow = launch(k.bwd_rows, rows * h, stat, x, dy, w, mean, rstd, corr, std_mode, dx, scale, cs, st)
    if slow:
        k.bwd_slow(stat, x, dy, w, mean, rstd, corr, std_mode, dx, scale, cs)
    if pw is not None or pb is not None:
        launch(k.params_by_cols, rows * h, stat, x, dy, mean, rstd, scale if slow else None, cs, pw, pb)
    return scale, cs


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return spec.name in OPS and OPS[spec.name] == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: dict[str, StatsOp] = {name: StatsOp(spec) for name, spec in SPECS.items() if _serves(spec)}
