"""The statistics family on the ``numba`` backend: every op of :data:`pynorm.ops.SPECS` whose family is ``"stats"``.

:data:`OP_IMPLS` maps each such op (LayerNorm, RMSNorm, ScaleNorm, the fused residual add + norm, the
modality norms) to a :class:`StatsOp`: ``forward(x2d, *inputs, *params, out=None, **options) -> (y, ctx)``
(``((y, h), ctx)`` with the residual prologue) and ``backward(dy2d, ctx, dx_out=None, dh=None) -> grads``,
with the reference module's contract (same arguments, options, ctx dataclass and grads tuple,
``spec.ctx``/``spec.grads``). Nothing here is specific to one op: the spec's variant picks

* the statistic's kernel pieces (:mod:`._rowstats`; ``"l2"`` is ScaleNorm's sum of squares with the
  ``floor`` eps mode, its floor flag the per-row ``aux`` value);
* the prologue (``"residual"``: ``h = x + alpha * residual`` computed, rounded once to ``residual_dtype``
  and stored by the forward kernel before the row's statistics; the backward adds ``dh`` and writes
  ``dx`` and ``dresidual = alpha * dx``, :mod:`._io`);
* the affine source (:data:`AFFINE_SOURCES`): a per-feature vector, a scalar (broadcast to a vector; its
  gradient the sum of the vector's) or a table of rows selected by the row index input.

Forward: one pass over the rows, split across threads by rows (:func:`._stats_kernels.fwd`); ``ctx`` keeps
``x`` (``h``) as given and float64 per-row statistics. Math type: float32, or float64 when ``x`` or ``h`` is
float64 (a narrower ``h`` of a float64 ``x`` is normalized from its exact float64 copy).

Backward: ``dx`` row by row; parameter gradients from per-block partial sums (blocks of
:data:`._layout.ROW_BLOCK` rows, accumulated during the ``dx`` rows' first pass, or -- for few rows
of many elements, :func:`._layout.use_fused` -- by column tiles afterwards) added in float64 in
block order, so results do not depend on the thread count. Rows the fast path cannot take are
finished by the slow-path kernels, compiled on first need. Outputs not passed as
``out=``/``dx_out=`` come from a recycling pool (:class:`._common._BufferPool`).

Few wide rows (fewer row tasks than threads, :func:`split_rows`): the forward and the backward's ``dx`` run on
the split kernels (:mod:`._split_kernels`), rows cut into segments across threads, with the same results.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import numpy as np

from ..._dtypes import round_to
from ...ops import SPECS, OpSpec
from . import _common as cm
from . import _stats_kernels as k
from ._layout import CHUNK, ROW_BLOCK, SPLIT_SEG, blocks, tiles, use_fused, use_stream
from ._rowstats import FLOOR, INSIDE, OUTSIDE
from ._threads import launch, threads_for
from ._variant import Tag, statistic

__all__ = ["AFFINE_SOURCES", "OP_IMPLS", "StatsOp", "backward_rows", "forward_rows", "split_rows"]

#: the kernels' eps mode of each ``eps_mode`` option value (ops without the option: eps inside the root)
EPS_MODES = {"var": INSIDE, "root": INSIDE, "std": OUTSIDE, "floor": FLOOR}


class _Vector:
    """Affine source ``"vector"``: ``(H,)`` weight (plus the offset) and bias; gradients by column."""

    def prepare(self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int) -> tuple[Any, Any, Any]:
        return cm.effective_weight(w, offset, mdt), cm.param(b, mdt), None

    def partials(self, rows: int, h: int, mdt: Any, param: Any) -> np.ndarray | None:
        return cm.block_partials(rows, h, mdt, param is not None)

    def reduce(self, part: np.ndarray, param: Any) -> np.ndarray:
        return cm.reduce_blocks(part, param.dtype)


class _Scalar(_Vector):
    """Affine source ``"scalar"``: a ``(1,)`` scale broadcast to every feature (the kernels see the vector);
    its gradient is the float64 sum of the vector's column gradients, rounded once."""

    def prepare(self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int) -> tuple[Any, Any, Any]:
        vec = None if w is None else np.full(h, np.asarray(w).reshape(-1)[0], dtype=mdt)
        return vec, None if b is None else np.full(h, np.asarray(b).reshape(-1)[0], dtype=mdt), None

    def reduce(self, part: np.ndarray, param: Any) -> np.ndarray:
        cols = cm.reduce_blocks(part, np.float64)
        return round_to(np.asarray([math.fsum(cols.tolist())]), param.dtype)


class _Table(_Vector):
    """Affine source ``"table"``: ``(M, H)`` weight (plus the offset) and bias tables, row ``ids[i]`` serving
    row ``i``; partials have ``M`` rows per row block (:mod:`._io`), gradients are ``(M, H)`` tables."""

    def prepare(self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int) -> tuple[Any, Any, Any]:
        m = (w if w is not None else b).shape[0]
        tab = (np.ascontiguousarray(ids, dtype=np.int64), int(m))
        return cm.effective_weight(w, offset, mdt), cm.param(b, mdt), tab

    def partials(self, rows: int, h: int, mdt: Any, param: Any) -> np.ndarray | None:
        if param is None:
            return None
        return np.empty((-(-rows // ROW_BLOCK) * param.shape[0], h), mdt)

    def reduce(self, part: np.ndarray, param: Any) -> np.ndarray:
        m, h = param.shape
        return cm.reduce_blocks(part.reshape(-1, m * h), param.dtype).reshape(m, h)


#: the affine sources of :class:`pynorm.ops.StatsVariant` (``variant.affine``) this backend has
AFFINE_SOURCES = {"vector": _Vector(), "scalar": _Scalar(), "table": _Table()}


def _h_dtype(x_dtype: Any, residual_dtype: Any) -> np.dtype[Any]:
    from ...ops.add_norm import h_dtype

    return h_dtype(x_dtype, residual_dtype)


class StatsOp:
    """One op of the statistics family on this backend (see the module doc)."""

    def __init__(self, spec: OpSpec) -> None:
        v = spec.variant
        self.spec = spec
        self.name = spec.name
        self.statistic = v.statistic  # type: ignore[union-attr]
        self.centered = self.statistic == "centered"
        self.floors = self.statistic == "l2"
        self.stat = statistic(self.statistic)
        self.residual = v.prologue == "residual"  # type: ignore[union-attr]
        self.affine = AFFINE_SOURCES[v.affine]  # type: ignore[union-attr]
        self.weight_name = next((p for p in spec.param_names if p != "bias"), "")
        self.ctx_type = spec.ctx
        self.grads = spec.grads
        self._fields = tuple(f.name for f in fields(spec.ctx))
        self._options = spec.defaults()
        self._cast: Any = None

    def __repr__(self) -> str:
        return f"<numba stats op {self.name!r} (variant {self.spec.variant})>"

    def _policies(self) -> Any:
        """The non-default ``casting`` policies of this op (:mod:`pynorm.composite.casting`)."""
        if self._cast is None:
            from ...composite.casting import Casting, numpy_ops
            from .elementwise import OP_IMPLS as EW
            from .intype import InType

            self._cast = Casting(self, EW["power_norm"], *numpy_ops(), InType(self.centered))
        return self._cast

    def _math(self, x_dtype: Any, h_dtype: Any) -> tuple[np.dtype[Any], bool]:
        """``(math dtype, widen)``: float64 when x or h is float64; ``widen``: h is narrower than that."""
        wide = np.dtype(x_dtype) == np.float64 or (h_dtype is not None and np.dtype(h_dtype) == np.float64)
        mdt = np.dtype(np.float64) if wide else np.dtype(np.float32)
        return mdt, h_dtype is not None and cm.math_dtype(h_dtype) != mdt

    def forward(self, x: np.ndarray, *args: Any, out: np.ndarray | None = None, **options: Any) -> tuple[Any, Any]:
        """Forward of the ``(R, H)`` array ``x`` (then the op's inputs and parameters); returns ``(y, ctx)``
        (``((y, h), ctx)`` with the residual prologue; ``y`` is ``out`` if given)."""
        n_in = len(self.spec.inputs)
        if len(args) != n_in + len(self.spec.params):
            raise TypeError(f"{self.name} forward() takes x, {n_in} input(s) and {len(self.spec.params)} parameter(s)")
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{self.name} forward() got unexpected keyword argument(s) {sorted(unknown)}")
        o = {**self._options, **options}
        inputs = dict(zip(self.spec.input_names, args[:n_in], strict=True))
        p = dict(zip(self.spec.param_names, args[n_in:], strict=True))
        if o.get("casting", "fp32") != "fp32":
            return self._policies().forward(x, p, out, o)  # type: ignore[no-any-return]
        rows, hidden = x.shape
        residual = inputs.get("residual")
        hd = _h_dtype(x.dtype, o["residual_dtype"]) if self.residual else None
        mdt, widen = self._math(x.dtype, hd)
        y = cm.output(out, x.shape, x.dtype)
        h = cm.output(None, x.shape, hd) if hd is not None else None
        aux = np.empty(rows) if self.centered or self.floors else None
        rstd = np.empty(rows)
        alpha = float(o.get("alpha", 1.0))
        if rows:
            w, b, tab = self.affine.prepare(
                p.get(self.weight_name), p.get("bias"), inputs.get("modality_ids"), float(o.get("weight_offset", 0.0)),
                mdt, hidden,
            )  # fmt: skip
            src = cm.storage(x)
            pro = None
            if h is not None and residual is not None:
                pro = (cm.storage(residual), alpha, cm.storage(h))
                if widen:  # h first, then its exact float64 copy is normalized
                    launch(k.prologue_rows, rows * hidden, rows, pro, src)
                    src, pro = h.astype(np.float64), None
            ys = cm.storage(y)
            forward_rows(
                self.stat, src, pro, w, b, tab, float(o["eps"]), int(o.get("correction", 0)),
                EPS_MODES[o.get("eps_mode", "var")], ys, aux, rstd, use_stream(ys),
            )  # fmt: skip
        values = {
            **o, **p, **inputs, "x": x, "h": h, "mean": aux, "rstd": rstd, "x_dtype": x.dtype,
            "floor": None if aux is None or not self.floors else aux != 0.0,
            "residual_in_dtype": None if residual is None else residual.dtype,
        }  # fmt: skip
        for f in ("eps", "weight_offset", "alpha"):
            if f in values:
                values[f] = float(values[f])
        ctx = self.ctx_type(**{f: values[f] for f in self._fields})
        return ((y, h), ctx) if self.residual else (y, ctx)

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None, dh: np.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``) and, with the residual
        prologue, ``dh = dL/dh`` from later layers (None: none)."""
        if getattr(ctx, "casting", "fp32") != "fp32":
            return self._policies().backward(dy, ctx, dx_out)
        x = ctx.h if self.residual else ctx.x
        weight = getattr(ctx, self.weight_name, None)
        bias = getattr(ctx, "bias", None)
        rows, hidden = x.shape
        x_dtype = ctx.x_dtype if self.residual else x.dtype
        mdt, widen = self._math(x_dtype, x.dtype if self.residual else None)
        dx = cm.output(dx_out, x.shape, x_dtype)
        dres = cm.output(None, x.shape, ctx.residual_in_dtype) if self.residual else None
        pw = self.affine.partials(rows, hidden, mdt, weight)
        pb = self.affine.partials(rows, hidden, mdt, bias)
        if rows:
            w, _, tab = self.affine.prepare(
                weight, None, getattr(ctx, "modality_ids", None), float(getattr(ctx, "weight_offset", 0.0)), mdt,
                hidden,
            )  # fmt: skip
            aux = None
            if self.centered:
                aux = cm.stats(ctx.mean)
            elif self.floors:
                aux = np.ascontiguousarray(ctx.floor, dtype=np.float64)
            src = x.astype(np.float64) if widen else cm.storage(x)
            ep = None
            if dres is not None:
                ep = (None if dh is None else cm.storage(dh), float(ctx.alpha), cm.storage(dres))
            dxs = cm.storage(dx)
            backward_rows(
                self.stat, "fused" if use_fused(rows, hidden) else "rows", src, cm.storage(dy), w, tab, aux,
                cm.stats(ctx.rstd), int(getattr(ctx, "correction", 0)), EPS_MODES[getattr(ctx, "eps_mode", "var")],
                ep, dxs, pw, pb, ep is None and use_stream(dxs),
            )  # fmt: skip
        partials = {self.weight_name: (pw, weight), "bias": (pb, bias)}
        grads = []
        for n in self.spec.param_names:
            part, param = partials[n]
            grads.append(None if part is None or param is None else self.affine.reduce(part, param))
        return self.grads(dx, *([dres] if self.residual else []), *grads)


#: tests set this True: every call takes the split kernels (:func:`split_rows`), whatever its shape
FORCE_SPLIT = False
#: smaller calls keep whole rows: the split's three launches cost two more hand-offs to the pool threads, and
#: reading a row twice from the last-level cache leaves little for a second thread to win below about 1M
#: elements (one float32 row on 2 threads, split against whole: 0.65-0.95x at 256K elements, 0.9-1.75x at 512K,
#: 1.03-1.65x at 1M, 1.3-1.8x at 4M)
SPLIT_MIN_WORK = 1 << 20


def split_rows(tasks: int, x: np.ndarray) -> bool:
    """Whether a kernel of ``tasks`` whole-row tasks over ``x`` (storage form) runs on the split kernels
    (:mod:`._split_kernels`): when it has fewer tasks than threads, at least :data:`SPLIT_MIN_WORK` elements and
    rows of at least two segments of :data:`._layout.SPLIT_SEG`. The split kernels' results are bitwise the
    plain kernels', so the choice may depend on the threads.

    Float64 rows are never split: with the kernels' fastmath flags LLVM may merge a float64 row's chunk sums
    into one reduction over the row, so the plain kernels' float64 sums are not the chunk sums in chunk order
    that the split kernels add (float32 chunk sums are converted to float64 before they are added, which
    keeps them apart)."""
    rows, hidden = x.shape
    if x.dtype == np.float64 or rows == 0 or hidden == 0:
        return False
    if FORCE_SPLIT:
        return True
    work = rows * hidden
    return hidden >= 2 * SPLIT_SEG and work >= SPLIT_MIN_WORK and tasks < threads_for(work)


def _segments(rows: int, hidden: int) -> int:
    return rows * -(-hidden // SPLIT_SEG)


def forward_rows(
    stat: Tag,
    x: Any,
    pro: Any,
    w: Any,
    b: Any,
    tab: Any,
    eps: float,
    corr: int,
    mode: int,
    y: Any,
    aux: Any,
    rstd: Any,
    stream: bool,
) -> None:
    """The forward's kernels on storage arrays: :func:`._stats_kernels.fwd`, then the slow path for the rows it
    left (``stream``: streaming stores for ``y``; ``pro``/``tab``: prologue and affine source, :mod:`._io`)."""
    rows, h = x.shape
    if split_rows(rows, x if pro is None else pro[2]):  # (the rows normalized are h's with a prologue)
        from . import _split_kernels as sk

        tasks = _segments(rows, h)
        if pro is not None:  # h first, then the rows of h are normalized
            launch(sk.prologue, rows * h, tasks, pro, x)
            x, pro = pro[2], None
        kk, c = np.empty(rows), np.empty(rows)
        s1, s2 = np.zeros((2, rows, -(-h // CHUNK)))
        launch(sk.fwd_sums, rows * h, tasks, stat, x, kk, s1, s2)
        pending = sk.fwd_finish_rows(stat, x, kk, s1, s2, eps, corr, mode, c, aux, rstd)
        launch(sk.fwd_write, rows * h, tasks, stat, x, w, b, tab, kk, c, rstd, y, True if stream else None)
    else:
        pending = launch(k.fwd, rows * h, rows, stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd,
                         True if stream else None)  # fmt: skip
    if pending:
        k.fwd_slow(stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd, None)


def backward_rows(
    stat: Tag,
    path: str,
    x: Any,
    dy: Any,
    w: Any,
    tab: Any,
    aux: Any,
    rstd: Any,
    corr: int,
    mode: int,
    ep: Any,
    dx: Any,
    pw: Any,
    pb: Any,
    stream: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The backward's kernels on storage arrays along ``path`` (``"fused"`` or ``"rows"``, see
    :func:`._layout.use_fused`): ``dx`` (through the epilogue ``ep``) and the block partials ``pw``/``pb`` (or
    None). Returns the rows' ``scale`` (:data:`._stats_kernels.FAST` or the slow path's exponent) and, on the rows
    path of a centred statistic, their ``c``."""
    if path not in ("fused", "rows"):
        raise ValueError(f"unknown backward path {path!r}")
    rows, h = x.shape
    fused = path == "fused"
    st = True if stream else None
    scale = np.empty(rows, np.int64)
    cs = np.empty(rows) if not fused and stat.choice == "centered" else None
    params = pw is not None or pb is not None
    if split_rows(blocks(rows) if fused else rows, x):
        slow = _backward_split(stat, x, dy, w, tab, aux, rstd, corr, mode, ep, dx,
                               pw if fused else None, pb if fused else None, scale, cs, st)  # fmt: skip
    elif fused:
        slow = launch(k.bwd_fused, rows * h, blocks(rows), stat, x, dy, w, tab, aux, rstd, corr, mode, ep, dx, pw, pb,
                      scale, st)  # fmt: skip
    else:
        slow = launch(k.bwd_rows, rows * h, rows, stat, x, dy, w, tab, aux, rstd, corr, mode, ep, dx, scale, cs, st)
    if slow:
        k.bwd_slow(stat, x, dy, w, tab, aux, rstd, corr, mode, ep, dx, scale, cs)
        if fused and params:
            k.redo_blocks(stat, x, dy, tab, aux, rstd, scale, pw, pb)
    if not fused and params:
        launch(k.params_by_cols, rows * h, tiles(h), stat, x, dy, tab, aux, rstd, scale if slow else None, cs, pw, pb)
    return scale, cs


def _backward_split(
    stat: Tag, x: Any, dy: Any, w: Any, tab: Any, aux: Any, rstd: Any, corr: int, mode: int, ep: Any, dx: Any,
    pw: Any, pb: Any, scale: np.ndarray, cs: np.ndarray | None, st: Any,
) -> int:  # fmt: skip
    """The backward's ``dx`` (and, with ``pw``/``pb``, the fused path's partials) on the split kernels; fills
    ``scale`` and ``cs`` (or None) as :func:`._stats_kernels.bwd_fused` / ``bwd_rows`` do and returns how many
    rows are left for the slow path."""
    from . import _split_kernels as sk

    rows, h = x.shape
    kk, c, ok = np.empty(rows), np.empty(rows), np.empty(rows, np.bool_)
    sk.bwd_prep(stat, x, aux, rstd, kk, c, ok)
    sums = np.zeros((rows, -(-h // CHUNK), 3))
    launch(sk.bwd_sums, rows * h, _segments(blocks(rows), h), stat, x, dy, w, tab, kk, c, rstd, ok, mode, pw, pb,
           sums)  # fmt: skip
    gbar, coef = np.empty(rows), np.empty(rows)
    slow = sk.bwd_finish_rows(stat, x, kk, c, rstd, ok, corr, mode, aux, sums, gbar, coef, scale)
    launch(sk.bwd_write, rows * h, _segments(rows, h), stat, x, dy, w, tab, kk, c, rstd, gbar, coef, scale, ep, dx,
           st)  # fmt: skip
    if cs is not None:
        cs[:] = c
    return int(slow)


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return spec.name in OPS and OPS[spec.name] == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: dict[str, StatsOp] = {name: StatsOp(spec) for name, spec in SPECS.items() if _serves(spec)}
