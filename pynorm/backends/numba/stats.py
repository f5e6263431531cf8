"""The statistics family on the ``numba`` backend: every op of :data:`pynorm.ops.SPECS` whose family is ``"stats"``.

:data:`OP_IMPLS` maps each such op (LayerNorm, RMSNorm, ScaleNorm, the fused residual add + norm, the
modality norms) to a :class:`StatsOp`: ``forward(x2d, *inputs, *params, out=None, **options) -> (y, ctx)``
(``((y, h), ctx)`` with the residual prologue) and ``backward(dy2d, ctx, dx_out=None, dh=None) -> grads``,
with the reference module's contract (same arguments, options, ctx dataclass and grads tuple,
``spec.ctx``/``spec.grads``). Nothing here is specific to one op: the spec's variant picks, through its
records (:mod:`pynorm.ops.families`: which ctx fields each choice fills, which options it takes, read once by
:func:`pynorm.ops.families.kernel_args`)

* the statistic's kernel pieces (:mod:`._rowstats`, named by its record; its per-row aux value: the mean of a
  centred statistic, ScaleNorm's floor flag);
* the prologue (``"residual"``: ``h = x + alpha * residual`` computed, rounded once to ``residual_dtype``
  and stored by the forward kernel before the row's statistics; the backward adds ``dh`` and writes
  ``dx`` and ``dresidual = alpha * dx``, :mod:`._io`);
* the affine source (:data:`AFFINE_SOURCES`): a per-feature vector, a scalar (broadcast to a vector; its
  gradient the sum of the vector's) or a table of rows selected by the row index input.

Non-default ``casting`` policies are not this module's: the registry composes them above the backend
(:mod:`pynorm.composite.casting`, from this backend's :mod:`.intype`).

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
the split kernels (:mod:`._split_kernels`), rows cut into segments across threads, with the same results. Fewer
than 4 such rows take the fused path's partials there (in the sums pass, not in a pass of their own: the column
tiles add fewer than 4 rows row by row, in order, so the bits are the same), one read of ``x`` and ``dy`` less.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np

from ..._dtypes import round_to
from ...ops import OpSpec, Served
from ...ops._spec import filled
from ...ops.families import AFFINES, affine_of, kernel_args, prologue_of, statistic_of
from .._spec import param_names, prologue_input_names
from . import _common as common
from . import _paths, _threads, fp_quant
from . import _stats_kernels as kernels
from ._args import Affine, Conventions, Grad, Partials, RowStats, plain
from ._layout import CHUNK, SPLIT_SEG, blocks, tiles, use_fused, use_stream
from ._reduce import sum_slots, table_slots
from ._threads import EntryMemo, launch, threads_for
from ._variant import Tag, record_of, statistic

__all__ = ["AFFINE_SOURCES", "OP_IMPLS", "ChannelOp", "StatsOp", "backward_rows", "forward_rows", "split_rows"]


class _Vector:
    """Affine source ``"vector"``: ``(H,)`` weight (plus the offset) and bias; gradients by column.

    An affine source's backward: :meth:`layout` gives the kernels' table and the partials' layout (here the
    rows: one partials row per row block), :meth:`partials` the scratch, :meth:`reduce` the gradient."""

    def prepare(
        self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int, narrow: bool = False
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        """``(w, b, tab)`` as the kernels take them: ``w + offset`` and ``b`` in the math type ``mdt``. ``narrow``
        (the forward of a 16-bit ``x``): a 16-bit parameter (without an offset, for ``w``) is passed in its storage
        form, read exactly (``ld``) -- half the bytes in cache beside the rows, and the rows' loop then reads
        ``w`` and ``b`` at the rows' own width."""
        wk: Any
        if narrow and w is not None and offset == 0.0 and w.dtype.itemsize == 2:
            wk = common.storage(w)
        else:
            wk = common.effective_weight(w, offset, mdt)
        bk = common.storage(b) if narrow and b is not None and b.dtype.itemsize == 2 else common.param(b, mdt)
        return wk, bk, None

    def layout(self, tab: Any, rows: int) -> tuple[Any, Any]:
        return tab, rows

    def partials(self, layout: Any, h: int, pdt: Any, param: Any) -> np.ndarray | None:
        return common.block_partials(layout, h, pdt, param is not None)

    def reduce(self, part: np.ndarray, param: Any, layout: Any) -> np.ndarray:
        return common.reduce_blocks(part, param.dtype)


class _Scalar(_Vector):
    """Affine source ``"scalar"``: a ``(1,)`` scale broadcast to every feature (the kernels see the vector);
    its gradient is the float64 sum of the vector's column gradients, rounded once."""

    def prepare(
        self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int, narrow: bool = False
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        vec = None if w is None else np.full(h, np.asarray(w).reshape(-1)[0], dtype=mdt)
        return vec, None if b is None else np.full(h, np.asarray(b).reshape(-1)[0], dtype=mdt), None

    def reduce(self, part: np.ndarray, param: Any, layout: Any) -> np.ndarray:
        cols = common.reduce_blocks(part, np.float64)
        return round_to(np.asarray([common.column_total(cols)]), param.dtype)


class _Table(_Vector):
    """Affine source ``"table"``: ``(M, H)`` weight (plus the offset) and bias tables, row ``ids[i]`` serving
    row ``i``; gradients are ``(M, H)`` tables. The partials have one row per (row block, id the block holds)
    (:func:`._reduce.table_slots`, :mod:`._io`): at most ``R`` rows, whatever ``M`` is."""

    def prepare(
        self, w: Any, b: Any, ids: Any, offset: float, mdt: Any, h: int, narrow: bool = False
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        m = (w if w is not None else b).shape[0]
        tab = (np.ascontiguousarray(ids, dtype=np.int64), int(m))
        return common.effective_weight(w, offset, mdt), common.param(b, mdt), tab

    def layout(self, tab: Any, rows: int) -> tuple[Any, Any]:
        ids, m = tab
        slot, starts = np.empty(rows, np.int64), np.empty(blocks(rows) + 1, np.int64)
        ptr, order = np.empty(m + 1, np.int64), np.empty(rows, np.int64)
        n = table_slots(ids, slot, starts, ptr, order)
        return (ids, m, slot, starts), (n, order, ptr)

    def partials(self, layout: Any, h: int, pdt: Any, param: Any) -> np.ndarray | None:
        return None if param is None else common.scratch((layout[0], h), pdt)

    def reduce(self, part: np.ndarray, param: Any, layout: Any, memo: EntryMemo | None = None) -> np.ndarray:
        """``memo``: :func:`._reduce.sum_slots`' :class:`._threads.EntryMemo` (a plan's), used by a serial call."""
        n, order, ptr = layout
        out = np.empty(param.shape, param.dtype)
        if n == 0 or out.size == 0:
            out[...] = 0
        else:
            h = out.shape[1]
            # (one add per element)
            launch(sum_slots, n * h // 4, tiles(h), part, order, ptr, common.storage(out), memo=memo)
        return out


#: the affine sources of :class:`pynorm.ops.StatsVariant` (``variant.affine``) this backend has
AFFINE_SOURCES = {"vector": _Vector(), "scalar": _Scalar(), "table": _Table()}


class _Setup(NamedTuple):
    """What one forward of a :class:`StatsOp` reads of its options and dtypes alone."""

    kargs: Any  # kernel_args of the options (the spec's defaults filled in)
    conventions: tuple[Any, ...]  # the Conventions bundle, plain (:func:`._args.plain`)
    h_dtype: Any  # the prologue's h dtype (None: no h)
    math_dtype: np.dtype[Any]
    widen: bool
    ctx_static: dict[str, Any]  # the ctx fields of the options, kernel arguments and prologue (dtypes)
    ctx_args: tuple[tuple[str, int], ...]  # the ctx fields that are inputs or parameters: (name, argument index)


class _Op:
    """What :class:`StatsOp` and :class:`ChannelOp` share: the spec's records, names and contract, and the
    checking of a forward's arguments."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.statistic = statistic_of(spec)
        self.stat = statistic(self.statistic.name)
        self.weight_name, self.bias_name = param_names(spec)
        self.ctx_type = spec.ctx
        self.grads = spec.grads
        self._fields = tuple(f.name for f in fields(spec.ctx))
        self._options = spec.defaults()

    def _partials_dtype(self, mdt: np.dtype[Any]) -> np.dtype[Any]:
        """The parameter-gradient partials' dtype: the math type, float64 where ``xhat`` is not O(1)."""
        return mdt if self.statistic.normalizes else np.dtype(np.float64)

    def __repr__(self) -> str:
        return f"<numba stats op {self.name!r} (variant {self.spec.variant})>"

    def _arguments(self, args: tuple[Any, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A forward's ``(inputs by name, parameters by name)`` from the arguments after ``x``; TypeError for a
        wrong count."""
        spec = self.spec
        n_in = len(spec.inputs)
        if len(args) != n_in + len(spec.params):
            raise TypeError(f"{self.name} forward() takes x, {n_in} input(s) and {len(spec.params)} parameter(s)")
        return dict(zip(spec.input_names, args[:n_in], strict=True)), dict(
            zip(spec.param_names, args[n_in:], strict=True)
        )

    def _options_of(self, options: dict[str, Any]) -> dict[str, Any]:
        """Every option of a forward (the spec's defaults filled in); TypeError for an unknown one."""
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{self.name} forward() got unexpected keyword argument(s) {sorted(unknown)}")
        return {**self._options, **options}

    def _bind(
        self, args: tuple[Any, ...], options: dict[str, Any]
    ) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, Any]]:
        """A forward's ``(options with the defaults, kernel_args, inputs by name, parameters by name)``."""
        inputs, p = self._arguments(args)
        o = self._options_of(options)
        return o, kernel_args(self.spec, o), inputs, p


class StatsOp(_Op):
    """One op of the statistics family on this backend (see the module doc).

    ``statistic``, ``prologue``: the records of the spec's statistic and prologue
    (:mod:`pynorm.ops.families`); ``stat``: the statistic's tag (:mod:`._variant`)."""

    def __init__(self, spec: OpSpec) -> None:
        super().__init__(spec)
        self.prologue = prologue_of(spec)
        self.residual = self.prologue.residual
        self.affine = AFFINE_SOURCES[affine_of(spec).name]
        self.residual_name, self.ids_name = prologue_input_names(spec, self.prologue)
        self._setups: dict[Any, _Setup] = {}  # by options and dtypes (:meth:`_setup`)
        self._backward_setups: dict[Any, tuple[Any, ...]] = {}  # by the ctx's options and dtypes
        self._ctx_options = common.ctx_options(spec)  # (:meth:`_backward_setup`'s key)
        #: the position of each input and parameter among a forward's arguments after ``x``
        self._index = {n: i for i, n in enumerate((*spec.input_names, *spec.param_names))}
        #: ``(weight, bias, ids, residual)`` of a forward's arguments after ``x`` with a None appended (None: absent)
        self._pick = operator.itemgetter(
            *(self._index.get(n, -1) for n in (self.weight_name, self.bias_name, self.ids_name, self.residual_name))
        )

    def _math(self, x_dtype: Any, h_dtype: Any) -> tuple[np.dtype[Any], bool]:
        """``(math dtype, widen)``: float64 when x or h is float64; ``widen``: h is narrower than that."""
        wide = np.dtype(x_dtype) == np.float64 or (h_dtype is not None and np.dtype(h_dtype) == np.float64)
        mdt = np.dtype(np.float64) if wide else np.dtype(np.float32)
        return mdt, h_dtype is not None and common.math_dtype(h_dtype) != mdt

    def _setup(self, options: dict[str, Any], x_dtype: Any, residual_dtype: Any) -> _Setup:
        """What a forward reads of its options and dtypes alone (kept for the next call with the same ones)."""
        key = (tuple(options), tuple(options.values()), x_dtype, residual_dtype)
        return common.cached(self._setups, key, lambda: self._make_setup(options, x_dtype, residual_dtype))  # type: ignore[no-any-return]

    def _make_setup(self, options: dict[str, Any], x_dtype: Any, residual_dtype: Any) -> _Setup:
        o = self._options_of(options)
        kargs = kernel_args(self.spec, o)
        hd = self.prologue.h_dtype(x_dtype, o)
        mdt, widen = self._math(x_dtype, hd)
        # each ctx field from its source: the prologue's dtypes, else the row or a statistic (per call), else a
        # kernel argument, else an input or parameter (per call: ctx_args), else an option
        pro = self.prologue.ctx_values(x_dtype, residual_dtype)
        per_call = {self.prologue.row, *self.statistic.fills}
        kv = dict(zip(kargs._fields, kargs))
        index = self._index
        static, ctx_args = {}, []
        for f in self._fields:
            if f in pro:
                static[f] = pro[f]
            elif f in per_call:
                continue
            elif f in kv:
                static[f] = kv[f]
            elif f in index:
                ctx_args.append((f, index[f]))
            else:
                static[f] = o[f]
        return _Setup(kargs, plain(Conventions.of(kargs)), hd, mdt, widen, static, tuple(ctx_args))

    def _backward_setup(self, ctx: Any, x_dtype: Any, row_dtype: Any) -> tuple[Any, ...]:
        """What a backward reads of the ctx's options and the dtypes alone: ``(kernel_args, the conventions bundle
        (plain), math dtype, widen, partials dtype)``, kept for the next ctx with the same ones (a small call's
        microseconds: :func:`kernel_args` of a ctx costs about 2 us)."""

        def compute() -> tuple[Any, ...]:
            kargs = kernel_args(self.spec, ctx)
            mdt, widen = self._math(x_dtype, row_dtype if self.residual else None)
            return kargs, plain(Conventions.of(kargs)), mdt, widen, self._partials_dtype(mdt)

        return common.cached(self._backward_setups, (self._ctx_options(ctx), x_dtype, row_dtype), compute)  # type: ignore[no-any-return]

    def forward_for(self, options: Any) -> common.PlanForward:
        """The forward a plan runs its calls through (:func:`pynorm._dispatch._target`): a
        :class:`._common.PlanForward` of its own."""
        return common.PlanForward(self, options)

    def forward(
        self, x: np.ndarray, *args: Any, out: np.ndarray | None = None, sink: tuple[Any, ...] | None = None,
        **options: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        """Forward of the ``(R, H)`` array ``x`` (then the op's inputs and parameters); returns ``(y, ctx)``
        (``((y, h), ctx)`` with the residual prologue; ``y`` is ``out`` if given).

        ``sink``: the quantize epilogue (:mod:`._io`; ``quant_layer_norm`` of a float input), which takes each
        row in place of ``y``: no ``y`` is written (``y`` is None) and the rows are whole-row tasks."""
        return self.forward_setup(x, args, out, sink, options)

    def forward_setup(
        self, x: np.ndarray, args: tuple[Any, ...], out: np.ndarray | None, sink: tuple[Any, ...] | None,
        options: dict[str, Any] | common.PlanForward,
    ) -> tuple[Any, Any]:  # fmt: skip
        """:meth:`forward` for ``options``, or a plan's calls (``options`` its :class:`._common.PlanForward`: the
        setup and the row kernel's entry point found once). With the ``quantize`` option (:meth:`serves_option`),
        ``y`` is a :class:`pynorm.Quantized` of the ``(R, H)`` rows (:func:`.fp_quant.quantize_norm`)."""
        spec = (options.options if isinstance(options, common.PlanForward) else options).get(_QUANTIZE)
        if spec is not None and sink is None:
            return self._quantized(x, args, out, spec, options)
        return self._forward(x, args, out, sink, options)

    def serves_option(self, name: str, options: Any) -> bool:
        """Whether this op serves the public-only option ``name`` of a call with ``options`` itself
        (:attr:`pynorm.ops.Option.offered`): the ``quantize`` option of the norms with a quantized output -- each
        row quantized in the forward's output pass (:mod:`._io`'s FP quantize sink), or, for few wide rows (the
        split kernels), ``y`` quantized after it."""
        return name == _QUANTIZE and _QUANTIZE in self._options and options.get(name) is not None

    def _quantized(
        self, x: np.ndarray, args: tuple[Any, ...], out: np.ndarray | None, spec: Any,
        options: dict[str, Any] | common.PlanForward,
    ) -> tuple[Any, Any]:  # fmt: skip
        """The forward with ``y`` quantized by ``spec``: in the rows' output pass where they take a sink
        (:meth:`takes_sink`), else the second pass over the stored ``y`` (paths ``"quantize"`` and ``"split"``)."""
        fuse = self.takes_sink(x)
        _paths.note("quantize" if fuse else "quantize_after")
        q, res, ctx = fp_quant.quantize_norm(
            lambda o, sink: self._forward(x, args, o, sink, options), x.shape, x.dtype, spec, out, fuse
        )
        return ((q, *res[1:]) if self.residual else q), ctx

    def _forward(
        self, x: np.ndarray, args: tuple[Any, ...], out: np.ndarray | None, sink: tuple[Any, ...] | None,
        options: dict[str, Any] | common.PlanForward,
    ) -> tuple[Any, Any]:  # fmt: skip
        if len(args) != len(self._index):
            self._arguments(args)  # (raises the TypeError)
        weight, bias, ids, residual = self._pick((*args, None))
        plan = None
        if not isinstance(options, common.PlanForward):
            st = self._setup(options, x.dtype, None if residual is None else residual.dtype)
        elif options.setup is not None:
            plan, st = options, options.setup
        else:
            plan = options
            st = plan.setup = self._setup(plan.options, x.dtype, None if residual is None else residual.dtype)
        kargs, hd, mdt = st.kargs, st.h_dtype, st.math_dtype
        rows, hidden = x.shape
        y = common.output(out, x.shape, x.dtype) if sink is None else None
        h = common.output(None, x.shape, hd) if hd is not None else None
        aux = np.empty(rows) if self.statistic.aux else None
        rstd = np.empty(rows)
        if rows:
            w, b, tab = self.affine.prepare(
                weight, bias, ids, kargs.weight_offset, mdt, hidden, narrow=x.dtype.itemsize == 2
            )
            src = common.storage(x)
            pro = None
            if h is not None and residual is not None:
                pro = (common.storage(residual), kargs.alpha, common.storage(h))
                if st.widen:  # h first, then its exact float64 copy is normalized
                    launch(kernels.prologue_rows, rows * hidden, rows, pro, src)
                    src, pro = h.astype(np.float64), None
            ys = common.storage(y) if y is not None else None
            entry = None
            if plan is not None:  # (an FP quantize sink, (keep, q, out, amax): its types fixed by the plan's spec)
                entry = (
                    plan.entry if sink is None else (plan.sink_entry(sink[3].shape[0] > 0) if len(sink) == 4 else None)
                )
            forward_rows(
                self.stat, (src, pro), (w, b, tab), st.conventions, sink if ys is None else ys, (aux, rstd),
                ys is not None and use_stream(ys), entry,
            )  # fmt: skip
        if plan is not None and not plan.ctx:
            return ((y, h), None) if self.residual else (y, None)
        ctx = self._ctx(st, args, h if self.residual else x, aux, rstd)
        return ((y, h), ctx) if self.residual else (y, ctx)

    def _ctx(self, st: _Setup, args: tuple[Any, ...], row: Any, aux: Any, rstd: np.ndarray) -> Any:
        """The ctx of a forward with setup ``st``: its static fields, the inputs and parameters it keeps (from
        ``args``), the normalized rows ``row`` (``x``, or ``h`` with the residual prologue), the statistics."""
        values = st.ctx_static.copy()
        for f, i in st.ctx_args:
            values[f] = args[i]
        values[self.prologue.row] = row
        values.update(self.statistic.ctx_values(rstd, mean=aux, floor=(aux != 0.0) if self.statistic.floor else None))
        return filled(self.ctx_type, values)

    def fast_forward(self, plan: common.PlanForward, shape: tuple[int, int], ctx: bool = False) -> Any:
        """A :class:`pynorm.Plan`'s shortest call for ``(R, H)`` arrays of ``shape``: ``run(x, *args, out=None)``
        -> ``y`` (``(y, h)`` with the residual prologue; no ctx; with ``ctx``, :meth:`forward`'s ``(result, ctx)``,
        the per-row statistics then new arrays the ctx keeps), or None where the plan's calls take more than
        :meth:`forward_setup`'s serial plain path (a prologue widened to float64 first, a call the thread pool
        takes, a test switch of :mod:`._paths` on). Made from
        ``plan``'s first call (its setup and the row kernel's entry point): the same kernel and arguments as
        :meth:`forward_setup` and :func:`forward_rows`, so the same bits; what it skips is re-deciding what the
        plan fixed (the setup's lookup, the path, the streaming stores, the ctx). It returns None for a call that
        must take the general path after all (a test switch turned on since).

        With the ``quantize`` option (no ctx): ``run`` -> the :class:`pynorm.Quantized` of the rows (``(q, h)``
        with the residual prologue), each row taken by the FP quantize sink through the plan's kept entry points
        of it (:attr:`._common.PlanForward.sinks`; the pass of the tensor's ``amax`` first where the spec needs
        it), as :func:`.fp_quant.quantize_norm` runs them."""
        rows, hidden = shape
        st, memo = plan.setup, plan.entry
        spec = plan.options.get(_QUANTIZE)
        if spec is not None:  # (the rows go to the sink: its entry points, per pass, found by a first call)
            sinks = plan.sinks
            needs = fp_quant.consts(spec, hidden).needs_amax
            passes = () if sinks is None or ctx else (sinks[1], sinks[0]) if needs else (sinks[0],)
            memo = passes[-1] if passes and all(m.entry is not None for m in passes) else EntryMemo()
        if (
            st is None or memo.entry is None or st.widen or (st.h_dtype is not None) != self.residual
            or rows * hidden >= _threads.serial_threshold() or not rows or _forcing()
        ):  # fmt: skip
            return None
        if spec is not None:
            return self._fast_quantized(plan, shape, spec)
        entry, stat, cv, pick, prepare = memo.entry, self.stat, st.conventions, self._pick, self.affine.prepare
        offset, mdt, aux_needed = st.kargs.weight_offset, st.math_dtype, self.statistic.aux
        output, storage, empty, pool = common.output, common.storage, np.empty, common.POOL
        hd, alpha = st.h_dtype, st.kargs.alpha
        small = 8 * rows * hidden  # (below the pool's least size whatever the dtype: a plain numpy.empty)
        # the per-row statistics no ctx keeps: scratch reused by the next call (one pair per call running at once)
        spare: list[tuple[Any, Any]] = []
        # the parameters as the kernel takes them are the arrays given (prepare returned them): the plan's key fixes
        # what decides that (their dtypes and contiguity, the offset), so it holds for every call once seen
        as_given: list[bool] = []
        residual_op = self.residual

        def run(x: np.ndarray, *args: Any, out: np.ndarray | None = None) -> Any:
            if _forcing() or (out is not None and not out.flags.aligned):  # (see PlanForward)
                return None
            weight, bias, ids, residual = pick((*args, None))
            if out is not None:
                y = out
            else:
                y = empty(shape, x.dtype) if small < pool.min_bytes else output(None, shape, x.dtype)
            if ctx:  # (the ctx keeps them)
                rs = (empty(rows) if aux_needed else None, empty(rows))
            else:
                rs = spare.pop() if spare else (empty(rows) if aux_needed else None, empty(rows))
            if as_given:
                aff = (weight, bias, None)
            else:
                aff = prepare(weight, bias, ids, offset, mdt, hidden, narrow=x.dtype.itemsize == 2)
                if aff[0] is weight and aff[1] is bias and aff[2] is None:
                    as_given.append(True)
            rw: tuple[Any, Any]
            if hd is None:
                h, rw = None, (storage(x), None)
            elif residual is None:
                return None
            else:  # the residual prologue: h = x + alpha residual, written in the row kernel's pass
                h = output(None, shape, hd)
                rw = (storage(x), (storage(residual), alpha, storage(h)))
            ys = storage(y)
            if entry(stat, rw, aff, cv, ys, rs, None, 0, rows):  # rows left for the slow path
                kernels.fwd_slow(stat, rw, aff, cv, ys, rs)
            if ctx:
                c = self._ctx(st, args, h if residual_op else x, rs[0], rs[1])
                return ((y, h), c) if residual_op else (y, c)
            spare.append(rs)
            return y if h is None else (y, h)

        return run

    def _fast_quantized(self, plan: common.PlanForward, shape: tuple[int, int], spec: Any) -> Any:
        """:meth:`fast_forward`'s call of a plan with the ``quantize`` option: the kernels, arguments and order of
        :func:`.fp_quant.quantize_norm`'s fused path and :func:`forward_rows`' serial plain path (so the same bits),
        without re-deciding what the plan fixed."""
        rows, hidden = shape
        st, sinks = plan.setup, plan.sinks
        assert sinks is not None
        stat, cv, pick, prepare = self.stat, st.conventions, self._pick, self.affine.prepare
        offset, mdt, aux_needed = st.kargs.weight_offset, st.math_dtype, self.statistic.aux
        hd, alpha = st.h_dtype, st.kargs.alpha
        output, storage, empty, fwd_slow = common.output, common.storage, np.empty, kernels.fwd_slow
        first: Any = sinks[1].entry  # (the amax pass's, where the spec has one)
        codes: Any = sinks[0].entry
        keep_y = spec.keep_y

        def run(x: np.ndarray, *args: Any, out: np.ndarray | None = None) -> Any:
            if out is not None or _forcing():
                return None
            weight, bias, ids, residual = pick((*args, None))
            rs = (empty(rows) if aux_needed else None, empty(rows))
            aff = prepare(weight, bias, ids, offset, mdt, hidden, narrow=x.dtype.itemsize == 2)
            rw: tuple[Any, Any]
            if hd is None:
                h, rw = None, (storage(x), None)
            elif residual is None:
                return None
            else:
                h = output(None, shape, hd)
                rw = (storage(x), (storage(residual), alpha, storage(h)))
            y = output(None, shape, x.dtype) if keep_y else None

            def rows_into(sink: tuple[Any, ...]) -> None:
                if (first if sink[3].shape[0] else codes)(stat, rw, aff, cv, sink, rs, None, 0, rows):
                    fwd_slow(stat, rw, aff, cv, sink, rs)  # (rows left for the slow path)

            p = fp_quant.QuantPlan(spec, rows, hidden)
            p.passes(storage(y) if y is not None else fp_quant.no_keep(x.dtype), rows_into)
            q = p.rows_result(y)
            return q if h is None else (q, h)

        return run

    def takes_sink(self, x: np.ndarray) -> bool:
        """Whether a forward of ``x`` with a ``sink`` runs as fast as without one: a sink takes whole rows, so not
        when the rows would be split across threads (few wide rows: :func:`split_rows`)."""
        return not split_rows(x.shape[0], common.storage(x))

    def takes_source(self, x: np.ndarray) -> bool:
        """Whether :meth:`backward_cast` serves ``x``: the fused backward's row blocks (:func:`._layout.use_fused`),
        never split across threads (:func:`split_rows`), and no prologue."""
        rows, hidden = x.shape
        fused = backward_path(self.statistic, rows, hidden) == "fused"
        return not self.residual and fused and not split_rows(blocks(rows), common.storage(x))

    def backward_cast(
        self, dy: np.ndarray, ctx: Any, source: tuple[Any, ...], partials: tuple[Any, Any],
        dx_out: np.ndarray | None = None,
    ) -> np.ndarray:  # fmt: skip
        """``dx`` of this norm *without* its affine (``ctx``'s weight and bias unused) under a casting policy that
        rounds ``xhat`` to ``x``'s dtype before an element-wise affine: the identity's backward ``source``
        (:meth:`.elementwise.ElementwiseOp.source`, filling ``partials``) of each row's ``q`` and ``dy`` is the
        norm's upstream gradient, all in one pass (:func:`._stats_kernels.bwd_cast`). For the ``x`` that
        :meth:`takes_source`; ``dy`` of ``x``'s dtype."""
        kargs = kernel_args(self.spec, ctx)
        x = ctx.x
        rows, hidden = x.shape
        dx = common.output(dx_out, x.shape, x.dtype)
        if rows:
            field = self.statistic.aux_field
            aux = common.stats(getattr(ctx, field)) if field else None
            dxs = common.storage(dx)
            launch(
                kernels.bwd_cast, rows * hidden, blocks(rows), self.stat, common.storage(x), common.storage(dy),
                source, (aux, common.stats(ctx.rstd)), plain(Conventions.of(kargs)), dxs, partials,
                True if use_stream(dxs) else None,
            )  # fmt: skip
        return dx

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None, dh: np.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``) and, with the residual
        prologue, ``dh = dL/dh`` from later layers (None: none)."""
        x = getattr(ctx, self.prologue.row)
        weight = getattr(ctx, self.weight_name, None)
        bias = getattr(ctx, self.bias_name, None) if self.bias_name else None
        rows, hidden = x.shape
        x_dtype = ctx.x_dtype if self.residual else x.dtype
        kargs, conventions, mdt, widen, pdt = self._backward_setup(ctx, x_dtype, x.dtype)
        dx = common.output(dx_out, x.shape, x_dtype)
        dres = common.output(None, x.shape, ctx.residual_in_dtype) if self.residual else None
        w, _, tab = self.affine.prepare(
            weight, None, getattr(ctx, self.ids_name, None) if self.ids_name else None, kargs.weight_offset, mdt,
            hidden,
        )  # fmt: skip
        tab, layout = self.affine.layout(tab, rows)
        pw = self.affine.partials(layout, hidden, pdt, weight)
        pb = self.affine.partials(layout, hidden, pdt, bias)
        if rows:
            field = self.statistic.aux_field
            aux = common.stats(getattr(ctx, field)) if field else None
            src = x.astype(np.float64) if widen else common.storage(x)
            ep = None
            if dres is not None:
                ep = (None if dh is None else common.storage(dh), kargs.alpha, common.storage(dres))
            dxs = common.storage(dx)
            backward_rows(
                self.stat, backward_path(self.statistic, rows, hidden), src, common.storage(dy),
                (w, None, tab), (aux, common.stats(ctx.rstd)), conventions, (dxs, ep), (pw, pb),
                ep is None and use_stream(dxs),
            )  # fmt: skip
        grads = []
        for n in self.spec.param_names:
            part, param = (pw, weight) if n == self.weight_name else (pb, bias)
            grads.append(None if part is None or param is None else self.affine.reduce(part, param, layout))
        return self.grads(dx, *([dres] if self.residual else []), *grads)

    def backward_for(self, options: Any) -> Callable[..., Any]:
        """The backward of the ctxs one dispatcher plan's calls make (:func:`pynorm._dispatch._short_backward`;
        ``options`` the plan's): ``run(dy, ctx, **upstream)`` is :meth:`backward`'s result. A serial call on the
        fused path (no upstream gradient, the vector affine source, no float64 widening, no test switch) runs the
        fused kernel with :meth:`backward`'s arguments, so the same bits, skipping the path's decisions that the
        shape answers: the setup is the first ctx's (the plan's ctxs share their options and dtypes), outputs and
        partials below the pool's least size are plain ``numpy.empty``, and the kernel's compiled entry point is
        kept per layout of ``dy`` and ``x`` (:class:`EntryMemo`: the plan's key fixes the types of every other
        argument -- the parameters from its call, the statistics and outputs made here); every other call runs
        :meth:`backward`. LayerNorm 1 x 1024 float32
        (one process, alternating rounds, loaded machine): the backend's backward 15.0 -> 7.7 us."""
        general = self.backward
        if self.ids_name or type(self.affine) is not _Vector:
            return general
        row, wname, bname, residual = self.prologue.row, self.weight_name, self.bias_name, self.residual
        field, stat, statistic, names = self.statistic.aux_field, self.stat, self.statistic, self.spec.param_names
        output, storage, stats, partials, prepare = (
            common.output, common.storage, common.stats, common.block_partials, self.affine.prepare,
        )  # fmt: skip
        memos: dict[tuple[int, int], EntryMemo] = {}  # by dy's and x's flags: the kernel's entry point for them
        kept: list[tuple[Any, ...]] = []  # the setup: the plan's ctxs share their options and dtypes
        pool, empty = common.POOL, np.empty
        slots = tuple(n == wname for n in names)  # each gradient's partials: the weight's (True) or the bias's

        def run(dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None, **upstream: Any) -> Any:
            x = getattr(ctx, row)
            rows, hidden = x.shape
            if (
                dx_out is not None or not rows or rows * hidden >= min(_threads.serial_threshold(), SPLIT_MIN_WORK)
                or (upstream and any(g is not None for g in upstream.values())) or _forcing()
            ):  # fmt: skip
                return general(dy, ctx, dx_out=dx_out, **upstream)
            if not kept:
                kept.append(self._backward_setup(ctx, ctx.x_dtype if residual else x.dtype, x.dtype))
            kargs, cv, mdt, widen, pdt = kept[0]
            if widen or backward_path(statistic, rows, hidden) != "fused":
                return general(dy, ctx, **upstream)
            weight = getattr(ctx, wname, None)
            bias = getattr(ctx, bname, None) if bname else None
            nb = blocks(rows)
            dx_dtype = ctx.x_dtype if residual else x.dtype
            if 8 * rows * hidden < pool.min_bytes and 8 * nb * hidden < pool.scratch_bytes:  # (below the pool)
                dx = empty(x.shape, dx_dtype)
                pw = empty((nb, hidden), pdt) if weight is not None else None
                pb = empty((nb, hidden), pdt) if bias is not None else None
            else:
                dx = output(None, x.shape, dx_dtype)
                pw, pb = partials(rows, hidden, pdt, weight is not None), partials(rows, hidden, pdt, bias is not None)
            dres = output(None, x.shape, ctx.residual_in_dtype) if residual else None
            w = prepare(weight, None, None, kargs.weight_offset, mdt, hidden)[0]
            rs = (stats(getattr(ctx, field)) if field else None, stats(ctx.rstd))
            gr = (storage(dx), None if dres is None else (None, kargs.alpha, storage(dres)))
            xs, dys, aff, parts = storage(x), storage(dy), (w, None, None), (pw, pb)
            key = (dy.flags.num, x.flags.num)  # (x's too: a ctx rebuilt around other arrays keeps its plan)
            memo = memos.get(key)
            if memo is None:
                memo = memos[key] = EntryMemo()
            fused_serial(memo, stat, xs, dys, aff, rs, cv, gr, parts, None, nb)
            grads = []
            for is_w in slots:
                part, param = (pw, weight) if is_w else (pb, bias)
                grads.append(None if part is None or param is None else common.reduce_blocks(part, param.dtype))
            return self.grads(dx, *([dres] if residual else []), *grads)

        return run


#: the public-only option a :class:`StatsOp` serves (:meth:`StatsOp.serves_option`)
_QUANTIZE = "quantize"

#: tests set this True: every call takes the split kernels (:func:`split_rows`), whatever its shape
FORCE_SPLIT = False
#: smaller calls keep whole rows: the split's three launches cost two more hand-offs to the pool threads, and
#: reading a row twice from the last-level cache leaves little for a second thread to win below about 1M
#: elements (one float32 row on 2 threads, split against whole: 0.65-0.95x at 256K elements, 0.9-1.75x at 512K,
#: 1.03-1.65x at 1M, 1.3-1.8x at 4M)
SPLIT_MIN_WORK = 1 << 20


def backward_path(statistic: Any, rows: int, hidden: int) -> str:
    """The backward's path for an ``(rows, hidden)`` input of ``statistic`` (its :class:`~pynorm.ops.families.Statistic`
    record): ``"rows"`` where :func:`._layout.use_fused` leaves the shape to it and the record claims the path
    (``rows_path``), else ``"fused"`` -- a function of the shape and the statistic only, never of the threads."""
    return "fused" if use_fused(rows, hidden) or not statistic.rows_path else "rows"


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
    work = rows * hidden
    if FORCE_SPLIT or _paths.FORCE_SPLIT:
        return work > 0 and x.dtype != np.float64
    if work < SPLIT_MIN_WORK or work == 0 or x.dtype == np.float64:  # (the size first: a small call's test)
        return False
    return hidden >= 2 * SPLIT_SEG and tasks < threads_for(work)


def _channel(table: Any) -> bool:
    """Whether an affine bundle's table is the channel source's ``(G, S, P)`` (:class:`ChannelOp`; its rows are never
    split: their partials are per row, and few rows are few samples' groups)."""
    return table is not None and len(table) == 3


def _segments(rows: int, hidden: int) -> int:
    return rows * -(-hidden // SPLIT_SEG)


def _forcing() -> bool:
    """Whether a test switch of :mod:`._paths` is on (or a test records the paths calls take)."""
    return FORCE_SPLIT or _paths.switched()


def forward_rows(
    stat: Tag, rows: tuple[Any, ...], aff: tuple[Any, ...], cv: tuple[Any, ...], y: Any, rs: tuple[Any, ...],
    stream: bool, memo: EntryMemo | None = None,
) -> None:  # fmt: skip
    """The forward's kernels on storage arrays: :func:`._stats_kernels.fwd` (or the split kernels), then the slow
    path for the rows it left. ``rows``, ``aff``, ``cv``, ``rs``: the :mod:`._args` bundles ``Rows``, ``Affine``,
    ``Conventions``, ``RowStats`` as plain tuples (:func:`._args.plain`: what the kernels take; a small call
    builds no named tuple); ``stream``: streaming stores for ``y``; ``memo``: the row kernel's
    :class:`._threads.EntryMemo` (a plan's, for arguments whose types it fixes). ``y`` a quantize sink
    (:mod:`._io`): whole rows, never split."""
    rows_ = rows
    x, pro = rows
    n, h = x.shape
    if stream:
        _paths.note("stream")
    if (
        memo is not None
        and memo.entry is not None
        and n * h < _threads.serial_threshold()
        and not (FORCE_SPLIT or _paths.FORCE_SPLIT)
    ):
        # a plan's serial call (what launch() would do, without its bookkeeping: a small call's microsecond)
        _paths.note("plain")
        pending = memo.entry(stat, rows_, aff, cv, y, rs, True if stream else None, 0, n)
    elif (
        not _channel(aff[2]) and not isinstance(y, tuple) and split_rows(n, x if pro is None else pro[2])
    ):  # (the rows normalized are h's with a prologue)
        from . import _split_kernels as split

        _paths.note("split")
        tasks = _segments(n, h)
        if pro is not None:  # h first, then the rows of h are normalized
            launch(split.prologue, n * h, tasks, pro, x)
            x = pro[2]
        shifts, c = np.empty(n), np.empty(n)
        s1, s2 = np.zeros((2, n, -(-h // CHUNK)))
        launch(split.fwd_sums, n * h, tasks, stat, x, shifts, s1, s2)
        pending = split.fwd_finish_rows(stat, x, shifts, s1, s2, cv, c, rs)
        launch(split.fwd_write, n * h, tasks, stat, x, aff, shifts, c, rs[1], y, True if stream else None)
        rows_ = (x, None)
    else:
        _paths.note("plain")
        pending = launch(kernels.fwd, n * h, n, stat, rows_, aff, cv, y, rs, True if stream else None, memo=memo)
    if _paths.FORCE_SLOW and n:
        rs[1][:], pending = kernels.FWD_PENDING, n
    if pending:
        _paths.note("slow")
        kernels.fwd_slow(stat, rows_, aff, cv, y, rs)


def backward_rows(
    stat: Tag,
    path: str,
    x: Any,
    dy: Any,
    aff: tuple[Any, ...],
    rs: tuple[Any, ...],
    cv: tuple[Any, ...],
    gr: tuple[Any, ...],
    parts: tuple[Any, ...],
    stream: bool,
    memo: EntryMemo | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The backward's kernels on storage arrays along ``path`` (``"fused"`` or ``"rows"``, see
    :func:`._layout.use_fused`): ``gr`` (the ``Grad`` bundle: ``dx``, through its epilogue) and the block partials
    ``parts`` (the ``Partials`` bundle, fields None where not wanted); ``aff`` (``Affine`` without bias), ``rs``
    (``RowStats``), ``cv`` (``Conventions``): every :mod:`._args` bundle as a plain tuple (:func:`._args.plain`), as
    :func:`forward_rows` takes them. Returns the rows' ``scale`` (:data:`._stats_kernels.FAST` or the slow path's
    exponent) and, on the rows path of a centred statistic, their centring residuals ``c``. ``memo``: the fused
    kernel's :class:`._threads.EntryMemo` (a plan's, for arguments whose types it fixes), used by a serial call."""
    if path not in ("fused", "rows"):
        raise ValueError(f"unknown backward path {path!r}")
    rows, h = x.shape
    fused = path == "fused"
    params = parts[0] is not None or parts[1] is not None
    if not fused and params and rows < 4 and not _channel(aff[2]) and split_rows(blocks(rows), x):
        # a few wide rows on the split kernels: their partials in the sums pass (the fused path's), not in a pass of
        # their own by column tiles -- bitwise the same, as fewer than 4 rows are added there row by row, in order
        fused = True
    streaming = True if stream else None
    _paths.note("fused" if fused else "rows")
    if stream:
        _paths.note("stream")
    scale = np.empty(rows, np.int64)
    cs = np.empty(rows) if not fused and record_of(stat).mean else None
    if not _channel(aff[2]) and split_rows(blocks(rows) if fused else rows, x):
        slow = _backward_split(stat, x, dy, aff, rs, cv, gr, parts if fused else (None, None), scale, cs, streaming)
    elif fused:
        slow = launch(
            kernels.bwd_fused, rows * h, blocks(rows), stat, x, dy, aff, rs, cv, gr, parts, scale, streaming, memo=memo
        )  # fmt: skip
    else:
        slow = launch(kernels.bwd_rows, rows * h, rows, stat, x, dy, aff, rs, cv, gr, scale, cs, streaming)
    slow = _slow_rows(stat, x, dy, aff, rs, cv, gr, parts if fused and params else None, scale, cs, slow)
    if not fused and params:
        launch(kernels.params_by_cols, rows * h, tiles(h), stat, x, dy, aff[2], rs, scale if slow else None, cs,
               parts)  # fmt: skip
    return scale, cs


def _slow_rows(
    stat: Tag, x: Any, dy: Any, aff: Any, rs: Any, cv: Any, gr: Any, parts: Any, scale: np.ndarray,
    cs: np.ndarray | None, slow: Any,
) -> Any:  # fmt: skip
    """After the backward's fast kernels left ``slow`` rows (their ``scale`` :data:`._stats_kernels.PENDING`; every
    row under the test switch ``_paths.FORCE_SLOW``): their ``dx`` on the slow path, and with ``parts`` (the fused
    path's block partials) their blocks' partials again. Returns the count of slow rows."""
    rows = x.shape[0]
    if _paths.FORCE_SLOW and rows:
        scale[:], slow = kernels.PENDING, rows
    if slow:
        _paths.note("slow")
        kernels.bwd_slow(stat, x, dy, aff, rs, cv, gr, scale, cs)
        if parts is not None:
            redo = kernels.redo_channel if _channel(aff[2]) else kernels.redo_blocks
            redo(stat, x, dy, aff[2], rs, scale, parts)
    return slow


def fused_serial(
    memo: EntryMemo, stat: Tag, x: Any, dy: Any, aff: Any, rs: Any, cv: Any, gr: Any, parts: Any, streaming: Any,
    nb: int,
) -> None:  # fmt: skip
    """:func:`backward_rows`' fused path for a serial call whose path the caller has decided (a plan's kept
    backward: :meth:`StatsOp.backward_for`, :meth:`ChannelOp.backward_for`): the fused kernel over the ``nb`` row
    blocks through the plan's kept entry point ``memo``, then the slow path for the rows it left -- the same
    kernels and arguments."""
    scale = np.empty(x.shape[0], np.int64)
    slow = memo.call(kernels.bwd_fused, (stat, x, dy, aff, rs, cv, gr, parts, scale, streaming, 0, nb))
    if slow or _paths.FORCE_SLOW:
        params = parts[0] is not None or parts[1] is not None
        _slow_rows(stat, x, dy, aff, rs, cv, gr, parts if params else None, scale, None, slow)


def _backward_split(
    stat: Tag, x: Any, dy: Any, aff: Any, rs: Any, cv: Any, gr: Any, parts: Any, scale: np.ndarray,
    cs: np.ndarray | None, streaming: Any,
) -> int:  # fmt: skip
    """The backward's ``dx`` (and, with ``parts``, the fused path's partials) on the split kernels; fills ``scale``
    and ``cs`` (or None) as :func:`._stats_kernels.bwd_fused` / ``bwd_rows`` do and returns how many rows are left
    for the slow path. Bundles as plain tuples (:func:`._args.plain`)."""
    from . import _split_kernels as split

    _paths.note("split")
    rows, h = x.shape
    shifts, c, ok = np.empty(rows), np.empty(rows), np.empty(rows, np.bool_)
    split.bwd_prep(stat, x, rs, shifts, c, ok)
    sums = np.zeros((rows, -(-h // CHUNK), 3))
    launch(split.bwd_sums, rows * h, _segments(blocks(rows), h), stat, x, dy, aff, shifts, c, rs[1], ok, cv[2],
           parts, sums)  # fmt: skip
    gbar, coef = np.empty(rows), np.empty(rows)
    slow = split.bwd_finish_rows(stat, x, shifts, c, rs, ok, cv, sums, gbar, coef, scale)
    launch(split.bwd_write, rows * h, _segments(rows, h), stat, x, dy, aff, shifts, c, rs[1], gbar, coef, scale, gr,
           streaming)  # fmt: skip
    if cs is not None:
        cs[:] = c
    return int(slow)


# ---------------------------------------------------------------------------
# the channel affine source (GroupNorm, InstanceNorm: the "channels" layout)

#: the channel source's options (its record's, :data:`pynorm.ops.families.AFFINES`): the groups (absent: one group
#: per channel), whether a spec with running statistics normalizes with the rows' own, the running update's weight
_GROUPS, _USE_STATS, _MOMENTUM = "num_groups", "use_input_stats", "momentum"
assert {_GROUPS, _USE_STATS, _MOMENTUM} <= set(AFFINES["channel"].options)

#: rows of fewer positions per channel (``S``) than this take the table source (:func:`_as_table`): the channel
#: kernels' per-channel loops cost some 40 ns a channel, which at ``S = 1`` -- GroupNorm of an ``(N, C)`` input --
#: made the backward 10-25x slower than LayerNorm's over the same rows. Measured (float32, G = 32, one run, loaded
#: 2-core AVX-512 machine), channel kernels -> table, forward / backward: (64, 256, 1) 167 -> 107 / 195 -> 244 us,
#: (16, 4096, 1) 186 -> 51 / 500 -> 113, (256, 1024, 1) 1083 -> 402 / 11930 -> 1009, (32, 256, 4) 108 -> 69 /
#: 143 -> 142, (16, 256, 8) 62 -> 49 / 83 -> 93, (8, 256, 16) 45 -> 37 / 58 -> 71.
TABLE_BELOW_S = 8


def _as_table(param: Any, groups: int, s: int, mdt: np.dtype[Any]) -> Any:
    """A channel parameter ``(C,)`` as the table source's ``(G, (C / G) S)`` table of the math type: each channel's
    value repeated for its ``S`` positions (a group's row is its ``C / G`` channels of ``S`` positions, contiguous),
    so that row ``i`` (sample ``i // G``'s group ``i % G``) is scaled by table row ``i % G``; None stays None."""
    vec = common.param(param, mdt)
    if vec is None:
        return None
    table = vec.reshape(groups, -1)
    return table if s == 1 else np.ascontiguousarray(np.repeat(table, s, axis=1))


def _zeroed(shape: tuple[int, int]) -> np.ndarray:
    """Float64 per-row partials set to zero, from the scratch pool (no fresh pages for a repeated call)."""
    a = common.scratch(shape, np.float64)
    a.fill(0.0)
    return a


def _group_ids(rows: int, groups: int) -> np.ndarray:
    """The table row of each row: ``i % G`` (int64)."""
    return np.ascontiguousarray(np.tile(np.arange(groups, dtype=np.int64), rows // groups))


class _ChannelSetup(NamedTuple):
    """What a :class:`ChannelOp` forward reads of its options, dtype and ``(N, C, S)`` alone."""

    options: dict[str, Any] | None  # a forward's every option, the defaults filled in (a backward's: None, no ctx kept)
    kargs: Any  # kernel_args(spec, options)
    conventions: tuple[Any, ...]  # the Conventions bundle, plain
    groups: int
    math_dtype: np.dtype[Any]
    table: bool  # the table source (fewer than TABLE_BELOW_S positions per channel)
    ids: tuple[np.ndarray, int] | None  # its (row -> table row, G), kept for up to _KEPT_IDS rows (else per call)
    layout: tuple[Any, Any] | None  # a backward's: the table source's layout(ids, rows), where ids is kept


#: the table source's row ids a channel op's setup keeps (:class:`_ChannelSetup`): up to this many rows (512 KiB)
_KEPT_IDS = 1 << 16


class ChannelOp(_Op):
    """An op of the statistics family with the channel affine source on this backend: ``x`` is ``(N, C, S)``
    (the dispatcher's channels layout), a row is one sample's group -- ``C / G`` channels by ``S`` positions,
    contiguous -- and the kernels take the table ``(G, S, C / G)`` (:mod:`._io`). The statistic and the kernels
    are the family's (:func:`forward_rows`, :func:`backward_rows`, fused path); ``dweight``/``dbias`` are the
    per-row, per-channel float64 partials summed over the samples in order, rounded once.

    With running statistics (the source's ``"running"`` inputs): ``use_input_stats`` updates them from the rows'
    mean and ``r`` (the biased variance ``1/r^2 - eps``, made unbiased by ``S / (S - 1)``; float64 on the host,
    rounded once); without it, the rows are normalized by them (:func:`._stats_kernels.fwd_given`,
    :func:`._stats_kernels.bwd_given`)."""

    def __init__(self, spec: OpSpec) -> None:
        super().__init__(spec)
        self.row = prologue_of(spec).row
        self.running = tuple(i.name for i in spec.inputs if i.kind in affine_of(spec).inputs)
        self._setups: dict[Any, _ChannelSetup] = {}  # by options, dtype and (N, C, S) (:meth:`_setup`)
        self._backward_setups: dict[Any, _ChannelSetup] = {}  # by the ctx's options, dtype and (N, C, S)
        self._ctx_options = common.ctx_options(spec)

    def _setup(self, options: dict[str, Any], dtype: Any, shape: tuple[int, int, int]) -> _ChannelSetup:
        """What a forward reads of its options, dtype and shape alone (kept for the next call with the same
        ones: a small call's microseconds -- the options' defaults, :func:`kernel_args`, the rows' table ids)."""
        key = (tuple(options), tuple(options.values()), dtype, shape)
        return common.cached(self._setups, key, lambda: self._make_setup(options, dtype, shape))  # type: ignore[no-any-return]

    def _backward_setup(self, ctx: Any, dtype: Any, shape: tuple[int, int, int]) -> _ChannelSetup:
        """:meth:`_setup` of a backward: what it reads of the ctx's options, the dtype and the shape alone."""
        key = (self._ctx_options(ctx), dtype, shape)
        return common.cached(self._backward_setups, key, lambda: self._make_setup(ctx, dtype, shape, True))  # type: ignore[no-any-return]

    def _make_setup(
        self, options: Any, dtype: Any, shape: tuple[int, int, int], backward: bool = False
    ) -> _ChannelSetup:  # fmt: skip
        """``options``: a forward's, or with ``backward`` the ctx."""
        o = options if backward else self._options_of(options)
        kargs = kernel_args(self.spec, o)
        n, c, s = shape
        groups = self._groups(o, c)
        rows = n * groups
        table = s < TABLE_BELOW_S
        ids = (_group_ids(rows, groups), groups) if table and rows <= _KEPT_IDS else None
        # (a backward's: the table source's partials layout of those rows too)
        layout = AFFINE_SOURCES["table"].layout(ids, rows) if ids is not None and backward else None
        return _ChannelSetup(None if backward else o, kargs, plain(Conventions.of(kargs)), groups,
                             common.math_dtype(dtype), table, ids, layout)  # fmt: skip

    def _groups(self, source: Any, c: int) -> int:
        get = source.get if isinstance(source, dict) else lambda k, d: getattr(source, k, d)
        return int(get(_GROUPS, c))

    def forward(self, x: np.ndarray, *args: Any, out: np.ndarray | None = None, **options: Any) -> tuple[Any, Any]:
        """Forward of the ``(N, C, S)`` array ``x`` (then the running statistics, if the spec has them, and the
        parameters): ``(y, ctx)``, or ``((y, running_mean', running_var'), ctx)`` (the reference's contract)."""
        return self._forward(x, args, out, options, True)

    def forward_lean(self, x: np.ndarray, *args: Any, out: np.ndarray | None = None, **options: Any) -> Any:
        """:meth:`forward`'s outputs alone, building no ctx: the call for the result (``pynorm.group_norm``, a
        call shape with a kept plan: :func:`pynorm._dispatch.call`); the same kernels and bits."""
        return self._forward(x, args, out, options, False)[0]

    def lean_for(self, options: dict[str, Any]) -> Callable[..., Any]:
        """The runner of a kept plan's calls for the outputs alone (:func:`pynorm._dispatch.call`, a
        :class:`pynorm.Plan`'s call): :meth:`forward_lean` with the plan's options, keeping the setup its first call
        finds and the row kernel's compiled entry point (:class:`._threads.EntryMemo`, called directly by a serial
        call) -- the plan's key fixes every argument's type. The same kernels and bits."""
        held = common.PlanForward(self, options, ctx=False)  # (its setup and entry point)

        def run(x: np.ndarray, *args: Any, out: np.ndarray | None = None) -> Any:
            kept = held if out is None or out.flags.aligned else None  # (see PlanForward)
            return self._forward(x, args, out, options, False, kept)[0]

        return run

    def forward_for(self, options: dict[str, Any]) -> Callable[..., Any]:
        """The forward a kept plan runs its calls with a ctx through (:func:`pynorm._dispatch._target`):
        :meth:`forward` with the plan's options, keeping the setup and the row kernel's entry point its first call
        finds, as :meth:`lean_for` does. The same kernels and bits."""
        held = common.PlanForward(self, options, ctx=True)

        def run(x: np.ndarray, *args: Any, out: np.ndarray | None = None) -> Any:
            kept = held if out is None or out.flags.aligned else None  # (see PlanForward)
            return self._forward(x, args, out, options, True, kept)

        return run

    def _forward(
        self, x: np.ndarray, args: tuple[Any, ...], out: np.ndarray | None, options: dict[str, Any], with_ctx: bool,
        held: common.PlanForward | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        inputs, p = self._arguments(args)
        if held is not None and held.setup is not None:
            st = held.setup
        else:
            st = self._setup(options, x.dtype, x.shape)
            if held is not None:
                held.setup = st
        o, kargs, groups, mdt = st.options, st.kargs, st.groups, st.math_dtype
        assert o is not None  # (a forward's setup)
        run = [inputs.get(k) for k in self.running]
        given = bool(run) and run[0] is not None and not o.get(_USE_STATS, True)
        n, c, s = x.shape
        rows, h = n * groups, (c // groups) * s
        y = common.output(out, x.shape, x.dtype)
        if given:
            rm, rv = run
            mean = np.tile(np.asarray(rm).astype(mdt), n).astype(np.float64)
            r = 1 / np.sqrt(np.asarray(rv).astype(mdt) + mdt.type(kargs.eps))
            rstd = np.tile(r, n).astype(np.float64)
        else:
            mean, rstd = np.empty(rows), np.empty(rows)
        if rows and h:
            xs, ys = common.storage(x).reshape(rows, h), common.storage(y).reshape(rows, h)
            stream = use_stream(ys)
            if st.table and not given:  # (few positions per channel: the table source, :data:`TABLE_BELOW_S`)
                ids = st.ids if st.ids is not None else (_group_ids(rows, groups), groups)
                aff = Affine(_as_table(p[self.weight_name], groups, s, mdt),
                             _as_table(p.get(self.bias_name), groups, s, mdt), ids)  # fmt: skip
            else:
                aff = Affine(common.param(p[self.weight_name], mdt), common.param(p.get(self.bias_name), mdt),
                             (groups, s, c // groups))  # fmt: skip
            if given:
                launch(kernels.fwd_given, rows * h, rows, self.stat, xs, plain(aff), (mean, rstd), ys,
                       True if stream else None)  # fmt: skip
            else:
                memo = None if held is None else held.entry
                forward_rows(self.stat, (xs, None), plain(aff), st.conventions, ys, (mean, rstd), stream, memo)
        ctx = None
        if with_ctx:
            values = {**o, **p, self.row: x, **self.statistic.ctx_values(rstd, mean=mean)}
            ctx = filled(self.ctx_type, {f: values[f] for f in self._fields})
        if not run or run[0] is None or given:
            return y, ctx
        return (y, *self._running(run, mean, rstd, n, c, s, kargs.eps, float(o[_MOMENTUM]))), ctx

    @staticmethod
    def _running(
        run: list[Any], mean: np.ndarray, rstd: np.ndarray, n: int, c: int, s: int, eps: float, momentum: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """The running statistics updated by the batch's (see the class doc)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            var = np.maximum(1.0 / (rstd * rstd) - eps, 0.0) * (s / (s - 1))
        batch = (mean.reshape(n, c).mean(axis=0), var.reshape(n, c).mean(axis=0))
        return tuple(  # type: ignore[return-value]
            round_to((1 - momentum) * np.asarray(old).astype(np.float64) + momentum * new, np.asarray(old).dtype)
            for old, new in zip(run, batch, strict=True)
        )

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None) -> Any:
        """Backward: ``(dx, dweight, dbias)`` given ``dy`` (``(N, C, S)``)."""
        return self._backward(dy, ctx, dx_out, None)

    def backward_for(self, options: Any) -> Callable[..., Any]:
        """The backward of the ctxs one dispatcher plan's calls make (:func:`pynorm._dispatch._short_backward`;
        ``options`` the plan's): ``run(dy, ctx, dx_out=None)`` is :meth:`backward`'s result, with what the plan
        fixes kept (:class:`_HeldBackward`): the setup its first ctx finds (the plan's ctxs share their options,
        dtype and shape) and, for a serial call, the compiled entry points of the fused kernel (per layout of
        ``dy`` and ``x``) and of the table source's reduction. A serial call on the table source's fused path (an
        ``(N, C)`` GroupNorm; no ``dx_out``, no test switch) then runs :func:`fused_serial` and the reduction with
        :meth:`backward`'s arguments, past the decisions the plan's shape answers (:meth:`_lean_table`); every
        other call :meth:`backward`'s code with the kept entry points. The same kernels and arguments, so the same
        bits. GroupNorm 1 x 1024, G = 32, float32 (one process): the backend's backward 22.7 -> 8.7 us."""
        held = _HeldBackward()
        back, stat, grads_of = self._backward, self.stat, self.grads
        row, wname, bname = self.row, self.weight_name, self.bias_name
        storage, stats, output, scratch = common.storage, common.stats, common.output, common.scratch
        lean: list[Any] = []  # the serial table path's fixed values (:meth:`_lean_table`), from the first call

        def run(dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None) -> Any:
            fixed = lean[0] if lean else None
            if dx_out is not None:  # (the general backward: the kept entry points were found for its own dx)
                return back(dy, ctx, dx_out, None)
            if fixed is None or fixed[0] >= _threads.serial_threshold() or _forcing():
                result = back(dy, ctx, dx_out, held)
                if not lean:
                    lean.append(self._lean_table(held.setup, ctx))
                return result
            _, rows, h, dims, tab, layout, pdt, st, nb = fixed
            x = getattr(ctx, row)
            weight = getattr(ctx, wname, None)
            bias = getattr(ctx, bname, None) if bname else None
            dx = output(None, x.shape, x.dtype)
            xs, dys, dxs = storage(x).reshape(rows, h), storage(dy).reshape(rows, h), storage(dx).reshape(rows, h)
            pw = None if weight is None else scratch((layout[0], h), pdt)
            pb = None if bias is None else scratch((layout[0], h), pdt)
            aff = (_as_table(weight, st.groups, dims[2], st.math_dtype), None, tab)
            fused_serial(
                held.entry((dys.flags.num, xs.flags.num)), stat, xs, dys, aff, (stats(ctx.mean), stats(ctx.rstd)),
                st.conventions, (dxs, None), (pw, pb), True if use_stream(dxs) else None, nb,
            )  # fmt: skip
            return grads_of(dx, *self._table_grads(pw, pb, weight, bias, layout, st.groups, h, dims, held))

        return run

    def _lean_table(self, st: _ChannelSetup | None, ctx: Any) -> tuple[Any, ...] | None:
        """What :meth:`backward_for`'s serial table path reads of a plan's fixed setup and shape: ``(work, rows, h,
        (N, C, S), tab, layout, partials dtype, setup, row blocks)``; None where the plan's calls take another path
        (the channel kernels, the given statistics, the rows path, the split kernels' sizes, row ids not kept)."""
        if st is None or not st.table or st.layout is None or not getattr(ctx, _USE_STATS, True):
            return None
        n, c, s = getattr(ctx, self.row).shape
        rows, h = n * st.groups, (c // st.groups) * s
        if not rows or not h or rows * h >= SPLIT_MIN_WORK or backward_path(self.statistic, rows, h) != "fused":
            return None
        tab, layout = st.layout
        return rows * h, rows, h, (n, c, s), tab, layout, self._partials_dtype(st.math_dtype), st, blocks(rows)

    def _backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None, held: _HeldBackward | None) -> Any:
        x = getattr(ctx, self.row)
        weight = getattr(ctx, self.weight_name, None)
        bias = getattr(ctx, self.bias_name, None) if self.bias_name else None
        if held is None or held.setup is None:
            st = self._backward_setup(ctx, x.dtype, x.shape)
            if held is not None:
                held.setup = st
        else:
            st = held.setup
        groups, mdt = st.groups, st.math_dtype
        n, c, s = x.shape
        rows, h, per = n * groups, (c // groups) * s, c // groups
        dx = common.output(dx_out, x.shape, x.dtype)
        use_stats, work = getattr(ctx, _USE_STATS, True), bool(rows and h)
        memo = None
        if work:
            xs, dys = common.storage(x).reshape(rows, h), common.storage(dy).reshape(rows, h)
            dxs = common.storage(dx).reshape(rows, h)
            rs = RowStats(common.stats(ctx.mean), common.stats(ctx.rstd))
            stream = use_stream(dxs)
            if held is not None:  # (the fused kernel's entry point for these layouts: a plan's key fixes the rest)
                memo = held.entry((dys.flags.num, xs.flags.num))
            if use_stats and st.table:
                return self._table_backward(xs, dys, weight, bias, rs, st, dx, dxs, (n, c, s), stream, memo, held)
        pw, pb = (_zeroed((rows, per)) if p is not None else None for p in (weight, bias))
        if work:
            aff = Affine(common.param(weight, mdt), None, (groups, s, per))
            if use_stats:
                backward_rows(self.stat, "fused", xs, dys, plain(aff), plain(rs), st.conventions, (dxs, None),
                              (pw, pb), stream, memo)  # fmt: skip
            else:
                launch(kernels.bwd_given, rows * h, rows, self.stat, xs, dys, plain(aff), plain(rs),
                       plain(Grad(dxs, None)), plain(Partials(pw, pb)), True if stream else None)  # fmt: skip
        grads = [
            None if part is None or param is None else round_to(part.reshape(n, c).sum(axis=0), param.dtype)
            for part, param in ((pw, weight), (pb, bias))
        ]
        return self.grads(dx, *grads)

    def _table_backward(
        self, xs: Any, dys: Any, weight: Any, bias: Any, rs: RowStats, st: _ChannelSetup, dx: np.ndarray, dxs: Any,
        dims: tuple[int, int, int], stream: bool, memo: EntryMemo | None, held: _HeldBackward | None,
    ) -> Any:  # fmt: skip
        """The backward of rows of fewer than :data:`TABLE_BELOW_S` positions per channel, on the table source (as
        :meth:`StatsOp.backward` runs it): ``dweight``/``dbias`` the float64 ``(G, (C / G) S)`` table gradients
        summed over each channel's ``S`` positions, rounded once. ``memo``, ``held``: a plan's kept entry points
        (:meth:`backward_for`)."""
        s = dims[2]
        groups, mdt = st.groups, st.math_dtype
        rows, h = xs.shape
        table = AFFINE_SOURCES["table"]
        tab, layout = st.layout if st.layout is not None else table.layout((_group_ids(rows, groups), groups), rows)
        pdt = self._partials_dtype(mdt)
        pw, pb = table.partials(layout, h, pdt, weight), table.partials(layout, h, pdt, bias)
        backward_rows(
            self.stat, backward_path(self.statistic, rows, h), xs, dys,
            (_as_table(weight, groups, s, mdt), None, tab), plain(rs), st.conventions, (dxs, None), (pw, pb), stream,
            memo,
        )  # fmt: skip
        return self.grads(dx, *self._table_grads(pw, pb, weight, bias, layout, groups, h, dims, held))

    @staticmethod
    def _table_grads(
        pw: Any, pb: Any, weight: Any, bias: Any, layout: Any, groups: int, h: int, dims: tuple[int, int, int],
        held: _HeldBackward | None,
    ) -> list[np.ndarray | None]:  # fmt: skip
        """The table source's ``dweight``, ``dbias`` from their partials (:meth:`_table_backward`)."""
        _, c, s = dims
        table = AFFINE_SOURCES["table"]
        assert isinstance(table, _Table)
        grads: list[np.ndarray | None] = []
        for part, param in ((pw, weight), (pb, bias)):
            if part is None or param is None:
                grads.append(None)
                continue
            # (a channel's one position: its table sum, rounded once by the reduction itself)
            dt = param.dtype if s == 1 else np.dtype(np.float64)
            summed = table.reduce(part, np.empty((groups, h), dt), layout, None if held is None else held.sums(dt))
            grads.append(summed.reshape(c) if s == 1 else round_to(summed.reshape(c, s).sum(axis=1), param.dtype))
        return grads


class _HeldBackward:
    """What a :meth:`ChannelOp.backward_for` keeps across its plan's calls: the setup of its first ctx and the
    compiled entry points (:class:`EntryMemo`) of the fused kernel, by the layouts of ``dy`` and ``x``, and of the
    table source's reduction, by the dtype it rounds to."""

    __slots__ = ("_entries", "_sums", "setup")

    def __init__(self) -> None:
        self.setup: _ChannelSetup | None = None
        self._entries: dict[Any, EntryMemo] = {}
        self._sums: dict[Any, EntryMemo] = {}

    def entry(self, key: Any) -> EntryMemo:
        memo = self._entries.get(key)
        if memo is None:
            memo = self._entries[key] = EntryMemo()
        return memo

    def sums(self, dtype: Any) -> EntryMemo:
        memo = self._sums.get(dtype)
        if memo is None:
            memo = self._sums[dtype] = EntryMemo()
        return memo


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return spec.name in OPS and OPS[spec.name] == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: Served[StatsOp | ChannelOp] = Served(
    _serves, lambda spec: (ChannelOp if affine_of(spec).name == "channel" else StatsOp)(spec)
)
