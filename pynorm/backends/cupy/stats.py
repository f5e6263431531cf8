"""The statistics family on the GPU: host launchers of ``kernels/stats.cu`` for every op of the family.

:data:`OP_IMPLS` maps each op of :data:`pynorm.ops.SPECS` whose family is ``"stats"`` to a
:class:`StatsOp`: ``forward(x2d, *inputs, *params, out=None, **options) -> (y, ctx)`` (``((y, h), ctx)``
for the fused residual add) and ``backward(dy2d, ctx, dx_out=None, dh=None) -> grads``, with the ctx
dataclass and gradient tuple of the op's spec (the reference's) holding CuPy arrays. The op's
variant picks the kernels' policy template arguments (:func:`._loader.variant_args`, from the choices'
records in :mod:`pynorm.ops.families`): the statistic (centred / mean square / sum of squares), the affine
source (vector / scalar / table) and the prologue (plain x / residual add); the records also say which per-row
ctx fields the statistic fills, and :func:`pynorm.ops.families.kernel_args` reads the conventions. Nothing here
is specific to one op. Non-default ``casting`` policies are composed above the backend by the registry
(:mod:`pynorm.composite.casting`, from :mod:`.intype`).

The kernels' parameter lists are mirrored by the dataclasses of :mod:`._args`; launches pass their
fields positionally (null pointers where an op has no such operand). Differences from the
reference, by design:

* statistics are accumulated in float32 (float64 when x, a parameter, the pre-norm sum or the
  residual is float64), with exact power-of-two row scaling; ``ctx.mean``/``ctx.rstd`` have that
  accumulation dtype;
* ``ctx.x`` (``ctx.h``) is the C-contiguous row the kernels read (the input itself when it already was);
* parameter gradients are summed per block (per row chunk), then across blocks in a fixed order:
  results are bitwise reproducible run to run on the same device and launch configuration;
* the fused residual add stores ``h`` in x's dtype, in float32 or in the accumulation dtype (a
  float32 residual stream for float16/bfloat16 or float64 x); another ``residual_dtype`` (bfloat16
  beside float16 x, e.g.) is a DTypeError here;
* parameter tables (modality norms): the backward copies the ``(R,)`` ids to the host once, to
  order the rows by modality (a stable sort) so that each row chunk of the split backward holds
  one modality; the per-modality sums are then reduced on the device.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import cupy
import numpy as np

from ...errors import ContextError, DTypeError
from ...ops import OpSpec, Served, StatsVariant
from ...ops.families import AFFINES, affine_of, kernel_args, prologue_of, statistic_of
from .._spec import param_names, prologue_input_names
from . import _host, _launch
from ._args import BwdApplyArgs, BwdArgs, BwdStatsArgs, FwdArgs
from ._loader import FAMILY_FILES, get_kernel, supports, variant_args

__all__ = ["OP_IMPLS", "ChannelOp", "StatsOp"]

_FILE = FAMILY_FILES["stats"]
_DTYPES = {"__half": "float16", "__nv_bfloat16": "bfloat16", "float": "float32", "double": "float64"}


def _dtype(a: Any) -> Any:
    return None if a is None else a.dtype


#: (op, dtypes) -> the call's _Types
_TYPES: dict[tuple[Any, ...], _Types] = {}


def _name(dt: Any) -> str:
    return str(np.dtype(dt).name) if not isinstance(dt, str) else dt


def _exact(src: str, dst: str) -> bool:
    """Whether every value of CUDA type ``src`` is a value of ``dst``."""
    return src == dst or dst == "double" or (dst == "float" and src in ("__half", "__nv_bfloat16"))


def _types(op: StatsOp, x_dtype: Any, weight: Any, bias: Any, h_dtype: Any, res_dtype: Any) -> _Types:
    """The :class:`_Types` of a call (cached per op and dtypes: a call's fixed cost)."""
    key = (op, x_dtype, _dtype(weight), _dtype(bias), h_dtype, res_dtype)
    ty = _TYPES.get(key)
    if ty is None:
        ty = _TYPES[key] = _Types(op, x_dtype, key[2], key[3], h_dtype, res_dtype)
    return ty


class _Types:
    """Template arguments of one call: the type plan and, with a residual prologue, ``Hd``/``Rs``."""

    def __init__(self, op: StatsOp, x_dtype: Any, w_dtype: Any, b_dtype: Any, h_dtype: Any, res_dtype: Any) -> None:
        extra = () if h_dtype is None else (h_dtype, res_dtype)
        self.plan = plan = _launch.type_plan(x_dtype, w_dtype, b_dtype, extra=extra)
        self.h = self.r = None
        if h_dtype is not None:
            hd = _launch.cuda_type(h_dtype)
            if hd not in (plan.T, plan.acc, "float"):
                raise DTypeError(
                    f"the cupy backend's {op.spec.name} stores h in x's dtype ({_name(x_dtype)}), in float32 or "
                    f"in the accumulation dtype ({plan.acc_dtype}); residual_dtype={_name(h_dtype)} is not supported"
                )
            rs = _launch.cuda_type(res_dtype)
            self.h = hd
            # the residual is read (and dresidual written) in its own type where the kernels have it, so
            # dresidual = alpha * g is rounded once; else (bfloat16 beside float16 x) in the accumulation
            # type and cast after: two roundings, in that one combination
            self.r = rs if rs in (plan.T, hd, plan.acc) else plan.acc
        self.args = (plan.T, plan.W, *variant_args(op.spec, self.h, self.r))

    @property
    def h_dtype(self) -> str | None:
        return None if self.h is None else _DTYPES[self.h]

    @property
    def r_dtype(self) -> str | None:
        return None if self.r is None else _DTYPES[self.r]


class StatsOp:
    """Forward and backward of one op of the statistics family (see the module docstring)."""

    def __init__(self, spec: OpSpec) -> None:
        v = spec.variant
        if not isinstance(v, StatsVariant):
            raise TypeError(f"op {spec.name!r} is not of the statistics family")
        self.spec = spec
        self.statistic = statistic_of(spec)
        self.prologue = prologue_of(spec)
        affine = affine_of(spec)
        self.residual = self.prologue.residual
        self.table = affine.index
        self.scalar = affine.broadcast  # one scalar weight: its gradient is the sum over every column
        self.weight_name, self.bias_name = param_names(spec)
        self.residual_name, self.ids_name = prologue_input_names(spec, self.prologue)
        self.ctx_fields = {f.name for f in fields(spec.ctx)}

    def _split(self, args: tuple[Any, ...]) -> tuple[dict[str, Any], Any, Any]:
        n = len(self.spec.inputs)
        inputs = dict(zip(self.spec.input_names, args[:n], strict=True))
        named = dict(zip(self.spec.param_names, args[n:], strict=True))
        return inputs, named.get(self.weight_name), named.get(self.bias_name)

    def forward(
        self, x: cupy.ndarray, *args: Any, out: cupy.ndarray | None = None, ids: Any = None, **options: Any
    ) -> Any:
        """Forward of the ``(R, H)`` array ``x`` (then the op's inputs and parameters); see the reference. ``ids``:
        the rows' table rows where the spec has no row index input (the channel source, :class:`ChannelOp`)."""
        rows, hidden = _launch.check_input(x)
        inputs, weight, bias = self._split(args)
        options = {**self.spec.defaults(), **options}
        kargs = kernel_args(self.spec, options)  # the conventions: eps, correction, r rule, offset, alpha
        residual = inputs.get(self.residual_name)
        h_dtype = self.prologue.h_dtype(x.dtype, options)
        ty = _types(self, x.dtype, weight, bias, h_dtype, _dtype(residual))
        plan = ty.plan
        x = _host.contiguous(x)
        w = _host.prepare_param(weight, plan.acc if plan.casts[0] else None)
        b = _host.prepare_param(bias, plan.acc if plan.casts[1] else None)
        res = _host.cast(residual, ty.r_dtype) if residual is not None else None
        ids = _ids(inputs[self.ids_name] if ids is None else ids) if self.table else None
        y = out if out is not None else _host.empty((rows, hidden), x.dtype)
        h = _host.empty((rows, hidden), ty.h_dtype) if self.residual else None
        mean = cupy.empty(rows, dtype=plan.acc_dtype) if self.statistic.mean else None
        rstd = cupy.empty(rows, dtype=plan.acc_dtype)
        floor = cupy.zeros(rows, dtype=bool) if self.statistic.floor else None
        if rows:
            k = get_kernel(_FILE, "stats_fwd", ty.args)
            itemsize = x.dtype.itemsize
            ptrs = tuple(a.data.ptr for a in (x, y, res, h) if a is not None)
            cfg = _launch.forward_config(
                rows,
                hidden,
                itemsize,
                plan.acc_itemsize,
                _launch.can_vectorize(hidden, itemsize, ptrs),
                _host.device_limits(),
                k.num_regs,
                k.shared_size_bytes,
                _host.forced("OVERFLOW"),
                row_itemsize=None if h is None else h.dtype.itemsize,
            )
            args_ = FwdArgs(
                x=x, residual=res, weight=w, bias=b, ids=ids, y=y, h_out=h, mean_out=mean, rstd_out=rstd,
                floor_out=floor, rows=rows, hidden=hidden, eps=kargs.eps, correction=kargs.correction,
                eps_mode=kargs.mode, weight_offset=kargs.weight_offset, alpha=kargs.alpha, log2g=cfg.log2g, vec=cfg.vec,
                over_smem=cfg.over_smem > 0,
            )  # fmt: skip
            _host.launch(k, cfg.grid, cfg.block, args_.pack(), cfg.over_smem)
        values = {
            self.weight_name: weight, self.bias_name: bias, self.ids_name: ids, **options,
            self.prologue.row: h if self.residual else x,
            **self.statistic.ctx_values(rstd, mean=mean, floor=floor),
            **self.prologue.ctx_values(x.dtype, _dtype(residual)),
        }  # fmt: skip
        ctx = self.spec.ctx(**{n: values[n] for n in self.ctx_fields})
        return ((y, h), ctx) if self.residual else (y, ctx)

    def backward(
        self, dy: cupy.ndarray, ctx: Any, *, dx_out: cupy.ndarray | None = None, dh: cupy.ndarray | None = None,
        ids: Any = None,
    ) -> Any:  # fmt: skip
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (and ``dh = dL/dh``); see the reference."""
        if not issubclass(type(ctx), self.spec.ctx):  # (no isinstance: mypy would narrow ctx to object)
            raise ContextError(
                f"ctx must be the {self.spec.ctx.__name__} returned by forward, got {type(ctx).__name__}"
            )
        kargs = kernel_args(self.spec, ctx)
        x = getattr(ctx, self.prologue.row)
        weight = getattr(ctx, self.weight_name)
        bias = getattr(ctx, self.bias_name) if self.bias_name else None
        mean = ctx.mean if self.statistic.mean else None
        res_dtype = ctx.residual_in_dtype if self.residual else None
        ty = _types(self, ctx.x_dtype if self.residual else x.dtype, weight, bias, x.dtype if self.residual else None,
                    res_dtype)  # fmt: skip
        plan = ty.plan
        if ctx.rstd.dtype != np.dtype(plan.acc_dtype):
            raise ContextError(f"ctx was not produced by the cupy backend's {self.spec.name} forward")
        x = _host.contiguous(x)
        dy = _host.contiguous(dy)
        dh = _host.contiguous(dh) if dh is not None else None
        rows, hidden = (int(d) for d in x.shape)
        correction, eps_mode, alpha, offset = kargs.correction, kargs.mode, kargs.alpha, kargs.weight_offset
        floors = ctx.floor if self.statistic.floor else None
        if ids is None:
            ids = getattr(ctx, self.ids_name) if self.ids_name else None
        w = _host.prepare_param(weight, plan.acc if plan.casts[0] else None)
        dx = dx_out if dx_out is not None else _host.empty((rows, hidden), dy.dtype)
        dres = _host.empty((rows, hidden), ty.r_dtype) if self.residual else None
        itemsize = dy.dtype.itemsize
        ptrs = tuple(a.data.ptr for a in (x, dy, dx, dh, dres) if a is not None)
        vec = _launch.can_vectorize(hidden, itemsize, ptrs)
        limits = _host.device_limits()
        partials = 0
        part_w = part_b = segs = None
        n_seg = weight.shape[0] if self.table and weight is not None else 1

        def make_partials(n: int) -> tuple[Any, Any]:
            def make(p: Any) -> Any:
                return cupy.empty((n, hidden), dtype=plan.acc_dtype) if p is not None else None

            return make(weight), make(bias)

        if self.table:
            segs = cupy.zeros(n_seg + 1, dtype=np.int64)
        if rows:
            # the fused kernel's __launch_bounds__ (its Pro policy's kBwdThreads)
            bwd_threads = _launch.DEFS["BWD_RESIDUAL_THREADS" if self.residual else "BWD_THREADS"]
            kind = "split" if self.table else _launch.backward_kind(
                hidden, itemsize, plan.acc_itemsize, _host.forced("BACKWARD"), bwd_threads
            )  # fmt: skip
            if kind == "fused":
                k = get_kernel(_FILE, "stats_bwd", ty.args)
                cfg = _launch.backward_config(
                    rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, k.num_regs, k.shared_size_bytes,
                    bwd_threads,
                )  # fmt: skip
                partials = cfg.partials
                part_w, part_b = make_partials(partials)
                rc = cfg.rows
                args_ = BwdArgs(
                    dy=dy, x=x, dh=dh, weight=w, mean=mean, rstd=ctx.rstd, floors=floors, dx=dx, dres=dres,
                    part_w=part_w, part_b=part_b, rows=rows, hidden=hidden, correction=correction, eps_mode=eps_mode,
                    weight_offset=offset, alpha=alpha, log2g=rc.log2g, vec=rc.vec,
                )  # fmt: skip
                _host.launch(k, rc.grid, rc.block, args_.pack())
            else:
                k_stats = get_kernel(_FILE, "stats_bwd_stats", ty.args)
                k_apply = get_kernel(_FILE, "stats_bwd_apply", ty.args)
                cfg = _launch.backward_config(
                    rows,
                    hidden,
                    itemsize,
                    plan.acc_itemsize,
                    vec,
                    limits,
                    "split",
                    k_stats.num_regs,
                    k_stats.shared_size_bytes,
                )
                coefs = cupy.empty((rows, 3), dtype=plan.acc_dtype)
                rc = cfg.rows
                sargs = BwdStatsArgs(
                    dy=dy, x=x, weight=w, ids=ids, mean=mean, rstd=ctx.rstd, floors=floors, coefs=coefs, rows=rows,
                    hidden=hidden, correction=correction, eps_mode=eps_mode, weight_offset=offset, log2g=rc.log2g,
                    vec=rc.vec,
                )  # fmt: skip
                _host.launch(k_stats, rc.grid, rc.block, sargs.pack())
                order = chunk_rows = None
                partials = cfg.chunks
                if self.table:
                    order, chunk_rows, segs, partials = _modality_chunks(ids, n_seg, cfg.rows_per_chunk)
                part_w, part_b = make_partials(partials)
                aargs = BwdApplyArgs(
                    dy=dy, x=x, dh=dh, weight=w, ids=ids, mean=mean, rstd=ctx.rstd, coefs=coefs, order=order,
                    chunk_rows=chunk_rows, dx=dx, dres=dres, part_w=part_w, part_b=part_b, rows=rows, hidden=hidden,
                    rows_per_chunk=cfg.rows_per_chunk, weight_offset=offset, alpha=alpha, vec=rc.vec,
                )  # fmt: skip
                _host.launch(k_apply, (partials, cfg.tiles), cfg.apply_block, aargs.pack())
        grads: dict[str, Any] = {}
        for name, part, p in ((self.weight_name, part_w, weight), (self.bias_name, part_b, bias)):
            if name not in self.spec.param_names:
                continue
            if p is None:
                grads[name] = None
            elif self.scalar:
                grads[name] = _host.reduce_scalar(part, partials, hidden, p.dtype, plan.acc)
            elif self.table:
                grads[name] = _host.reduce_partials(part, partials, hidden, p.dtype, plan.acc, segs, n_seg)
            else:
                grads[name] = _host.reduce_partials(part, partials, hidden, p.dtype, plan.acc)
        d_inputs: tuple[Any, ...] = ()
        if self.residual:
            d_inputs = (_host.cast(dres, res_dtype),)
        return self.spec.grads(dx, *d_inputs, *(grads[n] for n in self.spec.param_names))


def _ids(ids: cupy.ndarray) -> cupy.ndarray:
    """The row ids as the kernels read them: C-contiguous int64."""
    ids = _host.contiguous(ids)
    return ids if ids.dtype == np.int64 else ids.astype(np.int64)


def _modality_chunks(ids: cupy.ndarray, m: int, rows_per_chunk: int) -> tuple[Any, Any, Any, int]:
    """The split backward's rows ordered by modality (a stable sort of the ids, on the host), chunks of at
    most ``rows_per_chunk`` rows that never cross a modality, and each modality's range of chunks:
    ``(order, chunk_rows, segs, chunks)`` (device int64 arrays, and the number of chunks)."""
    ids_h = cupy.asnumpy(ids).astype(np.int64)
    order = np.argsort(ids_h, kind="stable")
    counts = np.bincount(ids_h, minlength=m)
    starts = np.concatenate(([0], np.cumsum(counts)))
    bounds: list[int] = []
    segs = [0]
    for i in range(m):
        bounds.extend(range(int(starts[i]), int(starts[i + 1]), rows_per_chunk))
        segs.append(len(bounds))
    bounds.append(int(starts[-1]))
    return (
        cupy.asarray(order.astype(np.int64)),
        cupy.asarray(np.asarray(bounds, dtype=np.int64)),
        cupy.asarray(np.asarray(segs, dtype=np.int64)),
        len(bounds) - 1,
    )


# ---------------------------------------------------------------------------
# the channel affine source (GroupNorm, InstanceNorm: the channels layout)

#: the channel source's options (its record's): the groups (absent: one per channel), whether a spec with running
#: statistics normalizes with the rows' own, the running update's weight
_GROUPS, _USE_STATS, _MOMENTUM = "num_groups", "use_input_stats", "momentum"
assert {_GROUPS, _USE_STATS, _MOMENTUM} <= set(AFFINES["channel"].options)


class ChannelOp:
    """An op with the channel affine source: ``x`` is ``(N, C, S)``, a row is one sample's group (``C/G`` channels
    by ``S`` positions, contiguous). The kernels are the family's with the ``Channel<bias>`` policy: each group's
    parameters are a row of the ``(G, H)`` tables the host makes (every channel's value over its ``S`` positions,
    in the accumulation type), ``ids[row] = row % G``; the backward is the table source's split backward (row
    chunks of one group), and each channel's gradient is the float64 sum of its ``S`` columns of the table's,
    rounded once.

    Running statistics: ``use_input_stats`` updates them from the kernels' per-row mean and ``r`` (``v = 1/r^2 -
    eps``, unbiased by ``S/(S-1)``; float64 on the device, rounded once); without it the rows are normalized by
    them, element-wise on the device in the math type (``dx = dy w r``)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.rows = StatsOp(spec)
        self.rows.table = True  # the rows select their group's parameter row (ids given by this host)
        self.running = tuple(i.name for i in spec.inputs if i.kind in affine_of(spec).inputs)
        self.ctx_fields = tuple(f.name for f in fields(spec.ctx))

    @staticmethod
    def _table(p: Any, groups: int, s: int, dt: Any) -> Any:
        c = int(p.shape[0])
        per = p.astype(dt).reshape(groups, c // groups, 1)
        return cupy.ascontiguousarray(cupy.broadcast_to(per, (groups, c // groups, s))).reshape(groups, -1)

    @staticmethod
    def _math(*dts: Any) -> Any:
        wide = any(d is not None and np.dtype(d) == np.float64 for d in dts)
        return np.dtype(np.float64) if wide else np.dtype(np.float32)

    def forward(self, x: cupy.ndarray, *args: Any, out: cupy.ndarray | None = None, **options: Any) -> Any:
        """Forward of the ``(N, C, S)`` array ``x`` (then the running statistics, if any, and the parameters)."""
        spec = self.spec
        n_in = len(spec.inputs)
        o = {**spec.defaults(), **options}
        kargs = kernel_args(spec, o)
        inputs = dict(zip(spec.input_names, args[:n_in], strict=True))
        weight, bias = args[n_in:]
        run = [inputs.get(k) for k in self.running]
        given = bool(run) and run[0] is not None and not o.get(_USE_STATS, True)
        n, c, s = (int(d) for d in x.shape)
        groups = int(o.get(_GROUPS, c))
        rows, h = n * groups, (c // groups) * s
        x = _host.contiguous(x)
        if given:
            y, mean, rstd = self._given_forward(x, run, weight, bias, kargs.eps, out)
        else:
            dt = self._math(x.dtype, _dtype(weight), _dtype(bias))
            w = self._table(weight if weight is not None else cupy.ones(c, dt), groups, s, dt)
            b = self._table(bias, groups, s, dt) if bias is not None else None
            ids = cupy.arange(rows, dtype=np.int64) % groups
            y2, inner = self.rows.forward(x.reshape(rows, h), *inputs.values(), w, b,
                                          out=None if out is None else out.reshape(rows, h), ids=ids, **o)  # fmt: skip
            y, mean, rstd = y2.reshape(n, c, s), inner.mean, inner.rstd
        values = {**o, self.rows.weight_name: weight, self.rows.bias_name: bias, self.rows.prologue.row: x,
                  **self.rows.statistic.ctx_values(rstd, mean=mean)}  # fmt: skip
        ctx = spec.ctx(**{f: values[f] for f in self.ctx_fields})
        if not run or run[0] is None or given:
            return y, ctx
        return (y, *self._running(run, mean, rstd, n, c, s, kargs.eps, float(o[_MOMENTUM]))), ctx

    def _given_forward(self, x: Any, run: list[Any], weight: Any, bias: Any, eps: float, out: Any) -> Any:
        n = int(x.shape[0])
        dt = self._math(x.dtype, run[0].dtype, _dtype(weight), _dtype(bias))
        rm = run[0].astype(dt)
        r = 1 / np.sqrt(run[1].astype(dt) + dt.type(eps))
        v = (_host.cast(x, dt.name) - rm[None, :, None]) * r[None, :, None]
        if weight is not None:
            v = v * weight.astype(dt)[None, :, None]
        if bias is not None:
            v = v + bias.astype(dt)[None, :, None]
        y = _host.cast(v, x.dtype)
        if out is not None:
            out[...] = y
            y = out
        return y, _rows_of(rm, n), _rows_of(r, n)

    @staticmethod
    def _running(
        run: list[Any], mean: Any, rstd: Any, n: int, c: int, s: int, eps: float, momentum: float
    ) -> tuple[Any, Any]:
        r = rstd.astype(np.float64)
        v = 1.0 / (r * r) - eps
        var = cupy.where(v > 0, v, 0.0) * (s / (s - 1))
        batch = (mean.astype(np.float64).reshape(n, c).mean(axis=0), var.reshape(n, c).mean(axis=0))
        return tuple(  # type: ignore[return-value]
            _host.cast((1 - momentum) * old.astype(np.float64) + momentum * new, old.dtype)
            for old, new in zip(run, batch, strict=True)
        )

    def backward(self, dy: cupy.ndarray, ctx: Any, *, dx_out: cupy.ndarray | None = None) -> Any:
        """Backward: ``(dx, dweight, dbias)`` given ``dy`` (``(N, C, S)``)."""
        x = getattr(ctx, self.rows.prologue.row)
        weight, bias = getattr(ctx, self.rows.weight_name), getattr(ctx, self.rows.bias_name)
        n, c, s = (int(d) for d in x.shape)
        dy = _host.contiguous(dy)
        if not getattr(ctx, _USE_STATS, True):
            return self._given_backward(dy, ctx, dx_out)
        groups = int(getattr(ctx, _GROUPS, c))
        rows, h = n * groups, (c // groups) * s
        dt = self._math(x.dtype, _dtype(weight), _dtype(bias))
        w = self._table(weight if weight is not None else cupy.ones(c, dt), groups, s, dt)
        b = self._table(bias, groups, s, dt) if bias is not None else None
        inner = replace(ctx, **{self.rows.prologue.row: x.reshape(rows, h), self.rows.weight_name: w,
                                self.rows.bias_name: b})  # fmt: skip
        ids = cupy.arange(rows, dtype=np.int64) % groups
        g = self.rows.backward(dy.reshape(rows, h), inner, dx_out=None if dx_out is None else dx_out.reshape(rows, h),
                               ids=ids)  # fmt: skip
        grads: list[Any] = []
        for part, p in zip(g[1:], (weight, bias), strict=True):
            if p is None or part is None:
                grads.append(None)
                continue
            sums = part.astype(np.float64).reshape(groups, c // groups, s).sum(axis=2).reshape(c)
            grads.append(_host.cast(sums, p.dtype))
        return self.spec.grads(g[0].reshape(n, c, s), *grads)

    def _given_backward(self, dy: Any, ctx: Any, dx_out: Any) -> Any:
        x, weight, bias = ctx.x, ctx.weight, ctx.bias
        n, c = (int(d) for d in x.shape[:2])
        dt = self._math(x.dtype, ctx.rstd.dtype, _dtype(weight))
        m = ctx.mean.astype(dt).reshape(n, c, 1)
        r = ctx.rstd.astype(dt).reshape(n, c, 1)
        d = _host.cast(dy, dt.name)
        g = d * weight.astype(dt)[None, :, None] if weight is not None else d
        dx = _host.cast(g * r, x.dtype)
        if dx_out is not None:
            dx_out[...] = dx
            dx = dx_out
        xh = (_host.cast(x, dt.name) - m) * r
        dw = None if weight is None else _host.cast((d * xh).astype(np.float64).sum(axis=(0, 2)), weight.dtype)
        db = None if bias is None else _host.cast(d.astype(np.float64).sum(axis=(0, 2)), bias.dtype)
        return self.spec.grads(dx, dw, db)


def _rows_of(a: Any, n: int) -> Any:
    """The ``(C,)`` array ``a`` repeated for ``n`` samples: ``(n C,)``."""
    return cupy.ascontiguousarray(cupy.broadcast_to(a[None], (n, int(a.shape[0])))).reshape(-1)


#: op name -> its implementation, for every op of the statistics family
OP_IMPLS: Served[StatsOp | ChannelOp] = Served(
    lambda spec: spec.family == "stats" and supports(spec),
    lambda spec: (ChannelOp if affine_of(spec).name == "channel" else StatsOp)(spec),
)
