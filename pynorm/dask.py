"""Every op of pynorm on :mod:`dask.array` inputs: lazy, chunked, and unchanged on a distributed cluster.

``pynorm.dask.forward(op, x, ...)`` and ``pynorm.dask.backward(dy, ctx)`` run any op of
:data:`pynorm.ops.SPECS` on a :class:`dask.array.Array` ``x``; ``pynorm.dask.<op>``,
``pynorm.dask.<op>_forward`` and ``pynorm.dask.<op>_backward`` are the same calls with the signatures of the
in-memory functions (``pynorm.<op>``...). Nothing is computed until ``.compute()`` (or :func:`dask.compute`,
or a distributed ``Client``'s ``compute``).

How it works (driven by the op's spec, no per-op code):

* **Chunking.** The normalized dims ``x.shape[axis:]`` must lie in one chunk per row block: ``x`` is rechunked so
  that they do (the leading dims keep their chunks, or are chunked ``"auto"`` when the merged blocks would exceed
  Dask's ``array.chunk-size``), and a :class:`~pynorm.errors.RechunkWarning` is issued when the arrays rechunked
  hold more than :data:`RECHUNK_WARN_BYTES` (a rechunk moves every byte of the array through the scheduler).
  The row inputs (a residual, ``modality_ids``, a per-row ``x_scale``, ``cond``) and ``dy`` are rechunked to
  ``x``'s row chunks.
* **Blocks.** Each block of rows runs the in-memory ``pynorm.<op>_forward`` on the chosen backend. Rows are
  independent, so every output (and ``dx``, and the gradient of a residual) equals the in-memory result on the
  whole array, block by block, bitwise on the same backend -- but for the ops with a matrix product (conditional
  norms, fused norm + Linear), whose BLAS may round a row's dot products differently for another number of
  rows per call (a few roundings of the terms).
* **Parameters** (weights, biases, scalars, tables, matrices) are small in-memory arrays of ``x``'s array
  library: each becomes one graph key that every block reads (shipped once per worker).
* **Backward reads the forward blocks' ctx.** Each forward task returns its block's outputs and its in-memory
  :class:`pynorm.Context` (the block's input, parameters and per-row statistics; a picklable dataclass, so the
  distributed scheduler can move or spill it like any chunk); each backward task runs ``pynorm.<op>_backward``
  on it. Computing the outputs and the gradients together (``dask.compute(y, *grads)``) runs every block's
  forward once. ``backward(..., recompute=True)`` recomputes the forward inside each backward task instead (the
  fused norm + Linear's pattern): no forward result is held for the backward, one more forward per block.
  The parameter gradients of every block
  (each rounded to its parameter's dtype by the backend) are packed into one float64 vector per block and summed
  by **one** Dask tree reduction (``sum(split_every=...)``), then rounded once to each parameter's dtype: they
  equal the in-memory gradients up to the rounding of the per-block partial sums and the order of the sum.
  A ``cond`` shared by several row blocks (``(B, C)`` for ``x`` of ``(B, T, H)`` chunked along ``T``) has its
  gradient reduced the same way.
* **Backend.** ``backend=`` as everywhere in pynorm; otherwise it is resolved once, on the calling machine, from
  ``use_backend``, ``PYNORM_BACKEND`` and the array type of ``x``'s blocks (``x._meta``: a CuPy-backed Dask
  array resolves to ``"cupy"``), and the name is sent to the workers, which must have it available.

Validation that needs only shapes, dtypes and options happens when the graph is built, with the in-memory
messages; the values of row inputs (``modality_ids`` in range, positive ``x_scale``) are checked by each block
when it runs, and raise at compute time.

The ops of the channels layout (GroupNorm, InstanceNorm, BatchNorm) are chunked along the batch axis instead; a
training BatchNorm's statistics are a fixed-order tree of Chan merges over the blocks (see the section below and
``docs/dask.md``).

Not supported: ``quant_layer_norm`` with ``quantize="tensor"`` and no ``out_scale`` (one scale from the whole
tensor's ``amax``: not row-wise; compute ``amax`` first and pass ``out_scale``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import dask
    import dask.array as da
    from dask.sizeof import sizeof
    from dask.utils import format_bytes, parse_bytes
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pynorm.dask needs dask[array]: pip install 'pynorm[dask]'") from exc

from . import _registry, _validate
from ._dispatch import Context
from .errors import ArgumentError, ArrayTypeError, ContextError, DTypeError, RechunkWarning, ShapeError
from .ops import SPECS, OpSpec
from .ops import get as _get_spec

__all__ = [
    "RECHUNK_WARN_BYTES",
    "SPLIT_EVERY",
    "DaskContext",
    "backward",
    "forward",
    "supported_ops",
]

#: a rechunk of more than this many bytes (all arrays of one call together) issues a :class:`RechunkWarning`
RECHUNK_WARN_BYTES = 256 * 2**20

#: default fan-in of the tree reduction of the parameter gradients (``split_every`` of :meth:`dask.array.sum`)
SPLIT_EVERY = 8


def supported_ops() -> tuple[str, ...]:
    """Names of the ops :func:`forward` runs: every op of :data:`pynorm.ops.SPECS` (``quant_layer_norm`` without
    its per-tensor ``amax`` mode)."""
    return tuple(SPECS)


# ---------------------------------------------------------------------------
# the context


@dataclass(frozen=True, eq=False)
class DaskContext:
    """What :func:`forward` hands to :func:`backward`: the (rechunked, lazy) arrays forward read, not results.

    Attributes
    ----------
    op : name of the op.
    backend : name of the backend every block runs on.
    x : ``x`` as the blocks read it (normalized dims in one chunk).
    inputs : the extra inputs in spec order: Dask arrays rechunked to ``x``'s rows (``cond`` with its size-1
        dims dropped), a scalar ``x_scale`` as given, or None.
    params : the parameters as given (in-memory arrays of ``x``'s array library, or None).
    options : the op's options, validated.
    axis : first normalized axis (non-negative).
    y_shape : shape of the first output.
    cond_shapes : the shape of each ``cond`` input as given (its gradient gets it back).
    split_every : fan-in of the tree reduction of the parameter gradients.
    flags : the ``return_<output>`` flags of ``pynorm.<op>_forward`` given (``return_norm``).
    results : the forward blocks (a Dask array over the row blocks whose chunks are tuples: the block's outputs,
        then its in-memory ctx), which the backward blocks read unless ``recompute=True``.
    rechunk_warn_bytes : the threshold of the :class:`~pynorm.errors.RechunkWarning` forward was given.
    """

    op: str
    backend: str
    x: Any
    inputs: tuple[Any, ...]
    params: tuple[Any, ...]
    options: dict[str, Any]
    axis: int
    y_shape: tuple[int, ...]
    cond_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    split_every: int = SPLIT_EVERY
    flags: dict[str, bool] = field(default_factory=dict)
    results: Any = None
    rechunk_warn_bytes: int | None = None

    @property
    def spec(self) -> OpSpec:
        return SPECS[self.op]


# ---------------------------------------------------------------------------
# block functions (module level: workers import them by name)


def _one(a: Any) -> Any:
    """The block ``blockwise`` passes as nested one-element lists for the dims a task contracts (``x``'s normalized
    dims, a parameter's): those dims have one chunk, so this is the whole array, taken without a copy."""
    while isinstance(a, list):
        assert len(a) == 1, "a contracted dim must have one chunk"
        a = a[0]
    return a


def _unpack(spec: OpSpec, arrays: tuple[Any, ...]) -> tuple[Any, list[Any], list[Any]]:
    n_in = len(spec.inputs)
    arrays = tuple(_one(a) for a in arrays)
    x, ins, ps = arrays[0], list(arrays[1 : 1 + n_in]), list(arrays[1 + n_in :])
    return x, ins, ps


def _call_forward(spec: OpSpec, backend: str, axis: int, options: Mapping[str, Any], arrays: tuple[Any, ...]) -> Any:
    x, ins, ps = _unpack(spec, arrays)
    return spec.generic_forward()(x, *ins, *ps, axis=axis, backend=backend, **options)


def _forward_block(*arrays: Any, op: str, backend: str, axis: int, options: Mapping[str, Any]) -> tuple[Any, ...]:
    """One row block's forward: the op's outputs as ``pynorm.<op>_forward`` returns them (``(q, s)`` for a
    quantizing ``quant_layer_norm``), then its ctx (a picklable :class:`pynorm.Context`: the block's input,
    parameters and per-row statistics) for the backward blocks."""
    outs, ctx = _call_forward(SPECS[op], backend, axis, options, arrays)
    return (*(outs if isinstance(outs, tuple) else (outs,)), ctx)


def _block_grads(op: str, dy: Any, ctx: Any, ups: Mapping[str, Any], axis: int) -> tuple[Any, ...]:
    """``pynorm.<op>_backward`` on one block: ``(dx, d<input>..., packed parameter gradients)``.

    The parameter gradients are packed into one float64 vector, shaped ``(1,) * L + (P,)`` (one entry per
    leading dim of ``x``) for the tree reduction."""
    import pynorm

    spec = SPECS[op]
    grads = getattr(pynorm, f"{op}_backward")(dy, ctx, **{k: v for k, v in ups.items() if v is not None})
    n_in = sum(1 for i in spec.inputs if i.differentiable)
    xp = _validate.xp_of(grads[0])
    pieces = [g.astype(xp.float64).reshape(-1) for g in grads[1 + n_in :] if g is not None]
    lead = (1,) * axis
    packed = xp.concatenate(pieces).reshape(*lead, -1) if pieces else xp.zeros((*lead, 0), dtype=xp.float64)
    return (grads[0], *grads[1 : 1 + n_in], packed)


def _backward_block(dy: Any, fwd: tuple[Any, ...], *ups: Any, op: str, axis: int, upstream: tuple[str, ...]) -> Any:
    """One row block's backward from the forward block's results (its ctx is their last item)."""
    return _block_grads(op, _one(dy), fwd[-1], dict(zip(upstream, (_one(u) for u in ups), strict=True)), axis)


def _recompute_backward_block(
    dy: Any, *arrays: Any, op: str, backend: str, axis: int, options: Mapping[str, Any], upstream: tuple[str, ...]
) -> tuple[Any, ...]:
    """One row block's forward, recomputed from the inputs, then its backward (``recompute=True``)."""
    ups = dict(zip(upstream, (_one(u) for u in arrays[: len(upstream)]), strict=True))
    _outs, ctx = _call_forward(SPECS[op], backend, axis, options, arrays[len(upstream) :])
    return _block_grads(op, _one(dy), ctx, ups, axis)


@sizeof.register(Context)
def _sizeof_context(ctx: Context) -> int:
    """Bytes a block's ctx holds (its input, parameters and statistics), so that the distributed scheduler's
    memory accounting and spilling see it (the default ``sys.getsizeof`` of a dataclass counts none of them)."""
    return 64 + _sizeof_fields(ctx.inner)


def _sizeof_fields(obj: Any) -> int:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_sizeof_fields(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return int(sizeof(obj)) if hasattr(obj, "nbytes") else 8


def _take(t: tuple[Any, ...], i: int) -> Any:
    """Item ``i`` of a block's tuple of results."""
    return t[i]


def _take_scale(t: tuple[Any, ...], i: int, lead: int) -> Any:
    """A block's quantization scale ``s`` as ``(rows of the block,)`` per-row values, or ``(1,) * lead`` for a
    per-tensor scale (the same in every block)."""
    s = t[i]
    return s.reshape((1,) * lead) if s.ndim == 0 else s


def _round(a: Any, dtype: Any) -> Any:
    """``a`` (float64) rounded once to ``dtype`` (NumPy: correctly, bfloat16 too; other libraries: ``astype``)."""
    if isinstance(a, np.ndarray):
        from .reference._common import round_to

        return round_to(a, dtype)
    return a.astype(dtype)


# ---------------------------------------------------------------------------
# validation and layout (on the calling machine, from shapes and dtypes only)


def _is_dask(a: Any) -> bool:
    return isinstance(a, da.Array)


def _meta_family(a: Any) -> tuple[str, str]:
    return _registry.array_family(a._meta)


def _xp(family: tuple[str, str]) -> Any:
    return sys.modules[family[0]]


def _standin(xp: Any, shape: tuple[int, ...], dtype: Any, fill: float = 0) -> Any:
    """A read-only, zero-stride array of ``shape`` in ``xp`` (no memory), for the in-memory shape checks."""
    return xp.broadcast_to(xp.asarray(fill, dtype=dtype), shape)


def _check_row_input(si: Any, a: Any, x: Any, axis: int) -> Any:
    """The checks of :func:`pynorm._validate.check_input` on a Dask row input (shapes and dtypes; the values of a
    per-row ``x_scale`` are checked by the blocks)."""
    name = si.name
    if not _is_dask(a):
        raise ArrayTypeError(
            f"{name} must be a dask.array.Array chunked like x's rows (got {type(a).__module__}.{type(a).__name__}); "
            f"wrap it with dask.array.from_array"
        )
    if _meta_family(a) != _meta_family(x):
        _registry.family_of((x._meta, a._meta), ("x", name))
    if si.kind == "row_scale":
        _validate.check_float_dtype(a, name)
        if tuple(a.shape) != tuple(x.shape[:axis]):
            raise ShapeError(
                f"{name} must be a scalar (0-d or (1,)) or one scale per row, of x.shape[:axis] = "
                f"{tuple(x.shape[:axis])}, got shape {tuple(a.shape)}"
            )
        return a
    return _validate.check_input(si, a, x, axis)


def _cond_lead(a: Any, x: Any, axis: int) -> int:
    """``k``: ``cond`` serves rows through ``x.shape[:k]`` (its leading dims after dropping trailing size-1 ones)."""
    k = a.ndim - 1
    while k > 0 and a.shape[k - 1] == 1:
        k -= 1
    return k


def _target_chunks(x: Any, axis: int) -> tuple[tuple[int, ...], ...] | None:
    """x's chunks with the normalized dims in one chunk (None: they already are)."""
    if all(len(c) == 1 for c in x.chunks[axis:]):
        return None
    target: dict[int, Any] = {d: -1 for d in range(axis, x.ndim)}
    h = math.prod(x.shape[axis:])
    block = x.dtype.itemsize * h * math.prod(max(c) if c else 0 for c in x.chunks[:axis])
    if block > parse_bytes(dask.config.get("array.chunk-size")):
        target.update({d: "auto" for d in range(axis)})
    return x.rechunk(target).chunks  # type: ignore[no-any-return]


class _Rechunker:
    """Rechunks the arrays of one call, adding up the bytes moved for one :class:`RechunkWarning`."""

    def __init__(self, threshold: int | None) -> None:
        self.threshold = RECHUNK_WARN_BYTES if threshold is None else int(threshold)
        self.moved: list[tuple[str, int, Any, Any]] = []

    def __call__(self, a: Any, chunks: tuple[tuple[int, ...], ...], name: str) -> Any:
        if tuple(a.chunks) == tuple(chunks):
            return a
        self.moved.append((name, int(a.nbytes), a.chunksize, tuple(max(c) if c else 0 for c in chunks)))
        return a.rechunk(chunks)

    def warn(self) -> None:
        total = sum(m[1] for m in self.moved)
        if self.moved and total > self.threshold:
            what = "; ".join(f"{n} ({format_bytes(b)}, chunks {old} -> {new})" for n, b, old, new in self.moved)
            warnings.warn(
                f"pynorm.dask rechunks {format_bytes(total)} so that the normalized dims form one chunk and the row "
                f"inputs follow x's row chunks: {what}. Create the arrays with those chunks to avoid moving them "
                f"(threshold: pynorm.dask.RECHUNK_WARN_BYTES = {format_bytes(self.threshold)})",
                RechunkWarning,
                stacklevel=4,
            )


def _split_args(spec: OpSpec, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The inputs and parameters from ``args`` (the non-keyword inputs then the parameters, in order) and ``kw``
    (any of them by name); what remains in ``kw`` are the options."""
    positional = [i.name for i in spec.inputs if not i.keyword] + list(spec.param_names)
    if len(args) > len(positional):
        raise TypeError(
            f"{spec.name}() takes at most {len(positional) + 1} positional arguments ({len(args) + 1} given)"
        )
    values: dict[str, Any] = dict(zip(positional, args))
    for name in (*spec.input_names, *spec.param_names):
        if name in kw:
            if name in values:
                raise TypeError(f"{spec.name}() got multiple values for argument {name!r}")
            values[name] = kw.pop(name)
    return [values.get(n) for n in spec.input_names], [values.get(n) for n in spec.param_names]


# ---------------------------------------------------------------------------
# forward


def _lead_index(axis: int) -> tuple[str, ...]:
    return tuple(f"l{i}" for i in range(axis))


def _x_index(x: Any, axis: int) -> tuple[str, ...]:
    return (*_lead_index(axis), *(f"f{i}" for i in range(x.ndim - axis)))


def forward(
    op: str,
    x: Any,
    *args: Any,
    axis: int = -1,
    backend: str | None = None,
    rechunk_warn_bytes: int | None = None,
    split_every: int | None = None,
    **kw: Any,
) -> tuple[Any, DaskContext | ChannelsContext]:
    """Forward of ``op`` on a Dask array: lazy outputs and the :class:`DaskContext` for :func:`backward`.

    Parameters
    ----------
    op : an op name of :data:`pynorm.ops.SPECS` (``"layer_norm"``, ``"add_rms_norm"``...).
    x : :class:`dask.array.Array` of the op's input dtypes (NumPy- or CuPy-backed).
    *args : the op's inputs after ``x`` then its parameters, in the order of ``pynorm.<op>`` (inputs that
        ``pynorm.<op>`` takes by keyword, ``x_scale``, by keyword here too). Row inputs (``residual``,
        ``modality_ids``, ``cond``, a per-row ``x_scale``) are Dask arrays; parameters are in-memory arrays of
        ``x``'s array library (NumPy for a NumPy-backed ``x``, CuPy for a CuPy-backed one).
    axis : first normalized axis (ONNX), as in ``pynorm.<op>``.
    backend : a backend name; None: resolved here from ``use_backend``, ``PYNORM_BACKEND`` and ``x``'s block type.
    rechunk_warn_bytes : threshold of the :class:`~pynorm.errors.RechunkWarning` (None: :data:`RECHUNK_WARN_BYTES`).
    split_every : fan-in of the tree reduction of the parameter gradients in :func:`backward` (None:
        :data:`SPLIT_EVERY`).
    **kw : the op's options (``eps=...``), and any input or parameter by name.

    Returns
    -------
    outputs : the first output as a Dask array (``y``), or a tuple of them as ``pynorm.<op>_forward`` returns
        (``(y, h)``; ``(q, s)`` for a quantizing ``quant_layer_norm``, ``s`` per row or 0-d).
    ctx : :class:`DaskContext`.

    Raises
    ------
    pynorm.errors.UnknownOpError, ArrayTypeError, ShapeError, DTypeError, ArgumentError
        As the in-memory op, naming the argument; ``ArrayTypeError`` for an ``x`` or row input that is not a
        Dask array.
    """
    spec = _get_spec(op)
    if not _is_dask(x):
        raise ArrayTypeError(
            f"x must be a dask.array.Array, got {type(x).__module__}.{type(x).__name__} "
            f"(use pynorm.{spec.name} for in-memory arrays, or wrap x with dask.array.from_array)"
        )
    _validate.check_float_dtype(x, "x", spec.x_dtypes)
    if spec.layout == "channels":
        return _channels_forward(spec, x, args, kw, backend, rechunk_warn_bytes, split_every)
    if x.ndim < 1:
        raise ShapeError("x must have at least 1 dimension, got a 0-d array")
    ax = _validate.check_axis(axis, x.ndim)
    norm_shape = tuple(x.shape[ax:])
    h = math.prod(norm_shape)
    if h == 0:
        raise ShapeError(f"the normalized dims x.shape[{ax}:] = {norm_shape} must not be empty")
    inputs, params = _split_args(spec, args, kw)
    flags = _check_flags(spec, kw)
    opts = spec.validate(kw, h)
    if opts.get("quantize") == "tensor" and opts.get("out_scale") is None:
        raise ArgumentError(
            f"{spec.name} with quantize='tensor' and no out_scale needs the whole tensor's amax, which is not "
            f"row-wise: pynorm.dask runs it with a given out_scale (compute amax / 127 first), or quantize='row'"
        )
    family = _meta_family(x)
    xp = _xp(family)
    xs = _standin(xp, tuple(x.shape), x.dtype)

    # inputs: Dask row inputs (a scalar x_scale stays as given)
    ins: list[Any] = []
    for si, a in zip(spec.inputs, inputs, strict=True):
        if a is None:
            ins.append(_validate.check_input(si, None, xs, ax))
        elif si.kind == "row_scale" and not _is_dask(a):
            ins.append(a)  # a scalar, checked here (a Python number as the in-memory op reads it: in x's library)
            real = isinstance(a, numbers.Real) and not isinstance(a, bool)
            _validate.check_input(si, xp.asarray(float(a), dtype=xp.float64) if real else a, xs, ax)
        else:
            ins.append(_check_row_input(si, a, x, ax))
    ids_standins = {si.name: xp.zeros((1,), dtype=xp.int64) for si in spec.inputs if si.kind == "row_index"}
    ps = [_validate.check_param(sp, p, xs, ax, ids_standins) for sp, p in zip(spec.params, params, strict=True)]
    _validate.check_tables(spec, ps)
    arrays = dict(zip((*spec.input_names, *spec.param_names), (*ins, *ps), strict=True))
    if spec.check_arrays is not None:
        spec.check_arrays(tuple(x.shape), ax, {"x": xs, **arrays}, opts)
    y_shape = spec.output_shape(tuple(x.shape), ax, arrays)
    present = tuple(p for p in (xs, *ps) if p is not None)
    names = tuple(n for n, p in zip(("x", *spec.param_names), (xs, *ps), strict=True) if p is not None)
    bname, _mod = _registry.resolve(spec.name, present, names, backend)

    # chunks: normalized dims in one chunk; row inputs on x's row chunks
    rechunk = _Rechunker(rechunk_warn_bytes)
    target = _target_chunks(x, ax)
    xr = x if target is None else rechunk(x, target, "x")
    rows = xr.chunks[:ax]
    cond_shapes: dict[str, tuple[int, ...]] = {}
    for i, (si, a) in enumerate(zip(spec.inputs, ins, strict=True)):
        if not _is_dask(a):
            continue
        if si.kind == "like_x":
            ins[i] = rechunk(a, xr.chunks, si.name)
        elif si.kind == "cond":
            cond_shapes[si.name] = tuple(a.shape)
            k = _cond_lead(a, x, ax)
            a2 = a.reshape((*a.shape[:k], a.shape[-1])) if a.ndim - 1 != k else a
            ins[i] = rechunk(a2, (*rows[:k], (a.shape[-1],)), si.name)
        else:
            ins[i] = rechunk(a, rows, si.name)
    rechunk.warn()
    ctx = DaskContext(
        spec.name, bname, xr, tuple(ins), tuple(ps), opts, ax, y_shape, cond_shapes,
        SPLIT_EVERY if split_every is None else int(split_every), flags, None, rechunk_warn_bytes,
    )  # fmt: skip
    results = _forward_results(ctx)
    ctx = dataclasses.replace(ctx, results=results)
    return _forward_outputs(ctx), ctx


def _block_args(ctx: DaskContext) -> list[Any]:
    """``x``, the inputs and the parameters as ``blockwise`` arguments: ``(array, index)`` pairs (in-memory
    parameters become single-chunk Dask arrays, one graph key each; a scalar or absent input a literal)."""
    spec = ctx.spec
    ax = ctx.axis
    lead = _lead_index(ax)
    out: list[Any] = [ctx.x, _x_index(ctx.x, ax)]
    for si, a in zip(spec.inputs, ctx.inputs, strict=True):
        if not _is_dask(a):
            out += [a, None]
        elif si.kind == "like_x":
            out += [a, _x_index(ctx.x, ax)]
        elif si.kind == "cond":
            out += [a, (*lead[: a.ndim - 1], f"{si.name}_c")]
        else:
            out += [a, lead]
    for sp, p in zip(spec.params, ctx.params, strict=True):
        if p is None:
            out += [None, None]
        else:
            out += [da.from_array(p, chunks=p.shape), tuple(f"{sp.name}_{j}" for j in range(p.ndim))]
    return out


def _meta(ctx: DaskContext, ndim: int, dtype: Any) -> Any:
    return da.utils.meta_from_array(ctx.x._meta, ndim=ndim, dtype=dtype)


def _flags(spec: OpSpec) -> tuple[str, ...]:
    """The ``return_*`` flags of ``pynorm.<op>_forward`` (``return_norm`` of the fused norm + Linear): keyword
    arguments outside the spec's options without which the public function returns the first output only."""
    import inspect

    import pynorm

    if len(spec.outputs) < 2:
        return ()
    params = inspect.signature(getattr(pynorm, f"{spec.name}_forward")).parameters
    return tuple(n for n in params if n.startswith("return_"))


def _check_flags(spec: OpSpec, kw: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for name in _flags(spec):
        if name in kw:
            v = kw.pop(name)
            if not isinstance(v, (bool, np.bool_)):
                raise ArgumentError(f"{name} must be True or False, got {v!r}")
            out[name] = bool(v)
    return out


def _forward_results(ctx: DaskContext) -> Any:
    """The forward blocks: a Dask array over the row blocks whose chunks are ``(*outputs, ctx)`` tuples."""
    spec = ctx.spec
    ax = ctx.axis
    kwargs = {"op": spec.name, "backend": ctx.backend, "axis": ax, "options": {**ctx.options, **ctx.flags}}
    return da.blockwise(
        _forward_block, _lead_index(ax), *_block_args(ctx), concatenate=False, meta=np.empty((0,) * ax, dtype=object),
        token=f"pynorm-{spec.name}-forward", **kwargs,
    )  # fmt: skip


def _forward_outputs(ctx: DaskContext) -> Any:
    """The lazy outputs, in the structure ``pynorm.<op>_forward`` returns them: the spec's outputs (those after
    the first only when a ``return_*`` flag of the public function, if it has one, is set), then a quantizing
    op's scale ``s``."""
    spec = ctx.spec
    ax = ctx.axis
    lead = _lead_index(ax)
    results = ctx.results
    dtypes = spec.dtypes_of_outputs(ctx.x.dtype, ctx.options)
    gated = bool(_flags(spec)) and not any(ctx.flags.values())
    outs: list[Any] = []
    for i, (oname, dt) in enumerate(zip(spec.outputs, dtypes, strict=True)):
        if i > 0 and gated:
            continue
        shape = ctx.y_shape if i == 0 else tuple(ctx.x.shape)
        outs.append(_output(ctx, results, len(outs), dt, shape, oname))
    if spec.family == "quantize" and (ctx.options["quantize"] is not None or ctx.options["out_scale"] is not None):
        per_tensor = ctx.options["out_scale"] is not None
        s = da.blockwise(
            _take_scale, lead, results, lead, i=len(outs), lead=ax, dtype=np.float32,
            adjust_chunks=dict.fromkeys(lead, 1) if per_tensor else None, meta=_meta(ctx, ax, np.float32),
            token=f"pynorm-{spec.name}-s",
        )  # fmt: skip
        outs.append(s[(0,) * ax] if per_tensor else s)
    return tuple(outs) if len(outs) > 1 else outs[0]


def _output(ctx: DaskContext, results: Any, i: int, dtype: Any, shape: tuple[int, ...], label: str) -> Any:
    """Output ``i`` of the blocks' result tuples as a Dask array of ``shape`` (``x``'s rows, one chunk of the
    rest)."""
    ax = ctx.axis
    lead = _lead_index(ax)
    trail = tuple(f"o{j}" for j in range(len(shape) - ax))
    return da.blockwise(
        _take, (*lead, *trail), results, lead, i=i, new_axes=dict(zip(trail, shape[ax:])), dtype=dtype,
        meta=_meta(ctx, len(shape), dtype), token=f"pynorm-{ctx.op}-{label}",
    )  # fmt: skip


# ---------------------------------------------------------------------------
# backward


def backward(dy: Any, ctx: DaskContext, *, recompute: bool = False, **upstream: Any) -> Any:
    """Backward of :func:`forward`: the op's Grads named tuple, every entry a lazy Dask array (or None).

    ``dx`` and the gradients of the row inputs come per block (equal to the in-memory ones on the same backend);
    each parameter gradient is the tree-reduced sum of the blocks' gradients (float64, each block's rounded to
    the parameter's dtype), rounded once to the parameter's dtype, in the parameter's shape. Compute them
    together (``dask.compute(*grads)``): computed one by one, each would recompute the blocks.

    Each backward block reads the forward block's in-memory ctx (the block's input, parameters and per-row
    statistics: a picklable :class:`pynorm.Context`), so computing the outputs and the gradients together runs
    each block's forward once. ``recompute=True`` recomputes the forward inside each backward block instead,
    from the inputs: nothing of the forward is kept between the two, at the cost of one more forward per block
    when the outputs are computed too.

    Parameters
    ----------
    dy : Dask array of the first output's shape, of the op's gradient dtype (``x``'s; float32 for an int8 ``x``).
    ctx : the :class:`DaskContext` from :func:`forward`.
    recompute : recompute the forward in the backward blocks (default: read the forward blocks' ctx).
    **upstream : gradients arriving at the other outputs (``dh=`` of the residual ops, ``dn=`` of the fused
        norm + Linear), Dask arrays of ``x``'s shape, or None.

    Returns
    -------
    The op's ``Grads`` named tuple (``LayerNormGrads(dx, dweight, dbias)``...).
    """
    if isinstance(ctx, ChannelsContext):
        if recompute or upstream:
            raise ArgumentError(f"{ctx.op} backward takes dy and ctx only (no recompute, no upstream gradients)")
        return _channels_backward(dy, ctx)
    if not isinstance(ctx, DaskContext):
        raise ContextError(f"ctx must be the DaskContext returned by pynorm.dask.forward, got {type(ctx).__name__}")
    spec = ctx.spec
    ax = ctx.axis
    xr = ctx.x
    allowed = tuple(f"d{o}" for o in spec.outputs[1:])
    unknown = set(upstream) - set(allowed)
    if unknown:
        raise TypeError(f"{spec.name} backward got unexpected keyword argument(s) {sorted(unknown)} (takes {allowed})")
    rechunk = _Rechunker(ctx.rechunk_warn_bytes)
    dy = _check_grad_array(dy, "dy", ctx, ctx.y_shape, spec.grad_dtype(xr.dtype))
    y_chunks = (*xr.chunks[:ax], *((d,) for d in ctx.y_shape[ax:]))
    dy = rechunk(dy, y_chunks, "dy")
    ups: list[Any] = []
    for oname, odt in zip(spec.outputs[1:], spec.dtypes_of_outputs(xr.dtype, ctx.options)[1:], strict=True):
        g = upstream.get(f"d{oname}")
        if g is not None:
            g = rechunk(_check_grad_array(g, f"d{oname}", ctx, tuple(xr.shape), odt), xr.chunks, f"d{oname}")
        ups.append(g)
    rechunk.warn()

    lead = _lead_index(ax)
    y_index = (*lead, *(f"o{j}" for j in range(len(ctx.y_shape) - ax)))
    up_args: list[Any] = []
    for g in ups:
        up_args += [g, None] if g is None else [g, _x_index(xr, ax)]
    names = tuple(f"d{o}" for o in spec.outputs[1:])
    token = f"pynorm-{spec.name}-backward"
    meta = np.empty((0,) * ax, dtype=object)
    if recompute:
        results = da.blockwise(
            _recompute_backward_block, lead, dy, y_index, *up_args, *_block_args(ctx), concatenate=False, meta=meta,
            token=token, op=spec.name, backend=ctx.backend, axis=ax, options=ctx.options, upstream=names,
        )  # fmt: skip
    else:
        results = da.blockwise(
            _backward_block, lead, dy, y_index, ctx.results, lead, *up_args, concatenate=False, meta=meta,
            token=token, op=spec.name, axis=ax, upstream=names,
        )  # fmt: skip

    dx = _output(ctx, results, 0, spec.grad_dtype(xr.dtype), tuple(xr.shape), "dx")
    d_inputs = []
    j = 1
    for si, a in zip(spec.inputs, ctx.inputs, strict=True):
        if not si.differentiable:
            continue
        if si.kind == "like_x":
            d_inputs.append(_output(ctx, results, j, a.dtype, tuple(xr.shape), f"d{si.name}"))
        else:  # cond
            d_inputs.append(_cond_grad(ctx, results, j, a, ctx.cond_shapes[si.name]))
        j += 1
    d_params = _param_grads(ctx, results, j)
    return spec.grads(dx, *d_inputs, *d_params)


def _check_grad_array(g: Any, name: str, ctx: DaskContext, shape: tuple[int, ...], dtype: Any) -> Any:
    if not _is_dask(g):
        raise ArrayTypeError(f"{name} must be a dask.array.Array, got {type(g).__module__}.{type(g).__name__}")
    if _meta_family(g) != _meta_family(ctx.x):
        _registry.family_of((ctx.x._meta, g._meta), ("x", name))
    if tuple(g.shape) != tuple(shape):
        raise ShapeError(f"{name} has shape {tuple(g.shape)}, expected {tuple(shape)}")
    if g.dtype != dtype:
        raise DTypeError(f"{name} has dtype {g.dtype}, expected {np.dtype(dtype)}")
    return g


def _cond_grad(ctx: DaskContext, results: Any, j: int, a: Any, shape: tuple[int, ...]) -> Any:
    """The gradient of a ``cond`` input: per block where each block has its own cond rows, else the blocks' partial
    gradients (float64) tree-reduced over the row blocks that share a cond row, rounded once to cond's dtype."""
    ax = ctx.axis
    lead = _lead_index(ax)
    k = a.ndim - 1
    c = a.shape[-1]
    if k == ax:
        g = da.blockwise(
            _take, (*lead, "c"), results, lead, i=j, new_axes={"c": c}, dtype=a.dtype, meta=_meta(ctx, ax + 1, a.dtype)
        )
    else:
        shared = lead[k:]
        parts = da.blockwise(
            _take_partial, (*lead, "c"), results, lead, i=j, k=k, ax=ax, new_axes={"c": c},
            adjust_chunks=dict.fromkeys(shared, 1), dtype=np.float64, meta=_meta(ctx, ax + 1, np.float64),
        )  # fmt: skip
        total = parts.sum(axis=tuple(range(k, ax)), split_every=ctx.split_every, dtype=np.float64)
        g = total.map_blocks(_round, a.dtype, dtype=a.dtype)
    return g.reshape(shape) if tuple(g.shape) != tuple(shape) else g


def _take_partial(t: tuple[Any, ...], i: int, k: int, ax: int) -> Any:
    """A block's partial cond gradient ``(rows of dims < k, C)`` as float64 ``(..., 1 per shared dim, C)``."""
    g = t[i]
    xp = _validate.xp_of(g)
    return g.astype(xp.float64).reshape((*g.shape[:-1], *((1,) * (ax - k)), g.shape[-1]))


def _param_grads(ctx: DaskContext, results: Any, j: int) -> list[Any]:
    """Each parameter's gradient: one tree reduction of the blocks' packed float64 gradients, then sliced."""
    spec = ctx.spec
    ax = ctx.axis
    lead = _lead_index(ax)
    present = [(sp, p) for sp, p in zip(spec.params, ctx.params, strict=True) if p is not None]
    size = sum(int(p.size) for _sp, p in present)
    if not present:
        return [None] * len(spec.params)
    packed = da.blockwise(
        _take, (*lead, "p"), results, lead, i=j, new_axes={"p": size}, adjust_chunks=dict.fromkeys(lead, 1),
        dtype=np.float64, meta=_meta(ctx, ax + 1, np.float64),
    )  # fmt: skip
    total = packed.sum(axis=tuple(range(ax)), split_every=ctx.split_every, dtype=np.float64) if ax else packed
    out: list[Any] = []
    off = 0
    for _sp, p in zip(spec.params, ctx.params, strict=True):
        if p is None:
            out.append(None)
            continue
        n = int(p.size)
        piece = total[off : off + n].map_blocks(_round, p.dtype, dtype=p.dtype)
        out.append(piece.reshape(p.shape))
        off += n
    return out


# ---------------------------------------------------------------------------
# the channels layout: GroupNorm, InstanceNorm, BatchNorm
#
# x is chunked along its batch axis 0 only (every other dim in one chunk). GroupNorm, InstanceNorm and BatchNorm in
# evaluation mode have statistics per sample (or none): each block runs the in-memory op, as the rows layout does.
# BatchNorm in training has statistics over the whole batch: each block's per-channel (count, mean, M2) in float64,
# merged in a fixed-order tree by Chan's formula; then each block runs the in-memory op in evaluation mode with the
# batch's statistics as its running ones. Its backward: the blocks' per-channel sums of dy and dy x̂, tree-summed,
# then each block's dx.


@dataclass(frozen=True, eq=False)
class ChannelsContext:
    """What :func:`forward` hands to :func:`backward` for an op of the channels layout.

    ``x``: the rechunked input (chunks along axis 0 only); ``blocks``: the forward blocks (``Delayed``, each a
    tuple of its outputs and its in-memory :class:`pynorm.Context`); ``moments``: BatchNorm in training, the
    ``Delayed`` ``(C, 3)`` float64 count, mean and M2 of the whole batch (None otherwise); ``axis``: the channel
    axis; ``params``: the in-memory parameters."""

    op: str
    backend: str
    x: Any
    params: tuple[Any, ...]
    options: dict[str, Any]
    axis: int
    blocks: tuple[Any, ...]
    moments: Any = None
    split_every: int = SPLIT_EVERY

    @property
    def spec(self) -> OpSpec:
        return SPECS[self.op]


def _to_ncs(a: Any, axis: int) -> Any:
    """A block as ``(n, C, S)`` (the channel axis moved to 1; a copy only where needed)."""
    xp = _validate.xp_of(a)
    a = xp.moveaxis(a, axis, 1) if axis != 1 else a
    return a.reshape(a.shape[0], a.shape[1], -1)


def _from_ncs(a3: Any, shape: tuple[int, ...], axis: int) -> Any:
    first = (shape[0], shape[axis], *(d for i, d in enumerate(shape) if i not in (0, axis)))
    a = a3.reshape(first)
    return a if axis == 1 else _validate.xp_of(a).moveaxis(a, 1, axis)


def _channels_block(x: Any, *arrays: Any, op: str, backend: str, options: Mapping[str, Any]) -> tuple[Any, ...]:
    """One batch block's in-memory forward: ``(*outputs, ctx)``."""
    outs, ctx = SPECS[op].generic_forward()(x, *arrays, backend=backend, **options)
    return (*(outs if isinstance(outs, tuple) else (outs,)), ctx)


def _moments(x: Any, axis: int) -> Any:
    """A block's per-channel ``(count, mean, M2)`` in float64, ``(C, 3)`` (the corrected two-pass mean)."""
    xp = _validate.xp_of(x)
    c = _to_ncs(x, axis).astype(xp.float64)
    n = c.shape[0] * c.shape[2]
    m = c.mean(axis=(0, 2))
    m = m + (c - m[:, None]).mean(axis=(0, 2))
    d = c - m[:, None]
    return xp.stack([xp.full_like(m, n), m, (d * d).sum(axis=(0, 2))], axis=1)


def _merge_moments(*parts: Any) -> Any:
    """Chan et al.'s merge of ``(count, mean, M2)`` rows, left to right (the blocks' order: deterministic)."""
    acc = parts[0]
    for b in parts[1:]:
        na, ma, qa = acc[:, 0], acc[:, 1], acc[:, 2]
        nb, mb, qb = b[:, 0], b[:, 1], b[:, 2]
        n = na + nb
        delta = mb - ma
        acc = _validate.xp_of(acc).stack([n, ma + delta * (nb / n), qa + qb + delta * delta * (na * nb / n)], axis=1)
    return acc


def _sum_parts(*parts: Any) -> Any:
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _tree(parts: list[Any], combine: Any, split_every: int, name: str) -> Any:
    """``combine`` over ``parts`` (``Delayed``) as a tree of fan-in ``split_every``, in their order."""
    level = 0
    while len(parts) > 1:
        parts = [
            dask.delayed(combine, pure=True)(*parts[i : i + split_every], dask_key_name=f"{name}-{level}-{i}")
            for i in range(0, len(parts), split_every)
        ]
        level += 1
    return parts[0]


def _bn_batch_block(x: Any, moments: Any, *arrays: Any, backend: str, options: Mapping[str, Any]) -> tuple[Any, ...]:
    """A block of training BatchNorm: the in-memory op in evaluation mode with the batch's statistics."""
    count = moments[:, 0]
    mean, var = moments[:, 1], moments[:, 2] / count
    w, b = arrays
    opts = {**options, "training": False}
    y, ctx = SPECS["batch_norm"].generic_forward()(x, mean, var, w, b, backend=backend, **opts)
    return (y, ctx)


def _bn_running(moments: Any, rm: Any, rv: Any, factor: float, which: int) -> Any:
    from .reference.batch_norm import running_update

    xp = _validate.xp_of(moments)
    host = moments if isinstance(moments, np.ndarray) else xp.asnumpy(moments)
    count = round(float(host[0, 0]))
    to_np = (lambda a: a) if isinstance(rm, np.ndarray) else xp.asnumpy
    out = running_update(to_np(rm), to_np(rv), host[:, 1], host[:, 2] / host[:, 0], count, factor)[which]
    return out if isinstance(rm, np.ndarray) else xp.asarray(out)


def _weighted_running(*parts: Any, dtype: Any) -> Any:
    """InstanceNorm's running statistics of the whole batch from the blocks' (``(n_b, value)`` pairs): the mean of
    the blocks' updates weighted by their sizes (the update is linear in the batch mean), rounded once."""
    xp = _validate.xp_of(parts[0][1])
    total = sum(n for n, _ in parts)
    acc = sum(
        (v.astype(xp.float64) * (n / total) for n, v in parts[1:]),
        parts[0][1].astype(xp.float64) * (parts[0][0] / total),
    )
    return _round(acc, dtype)


def _pick(t: tuple[Any, ...], i: int) -> Any:
    return t[i]


def _sized(t: tuple[Any, ...], i: int, n: int) -> tuple[int, Any]:
    return (n, t[i])


def _channels_forward(
    spec: OpSpec, x: Any, args: tuple[Any, ...], kw: dict[str, Any], backend: str | None,
    rechunk_warn_bytes: int | None, split_every: int | None,
) -> tuple[Any, ChannelsContext]:  # fmt: skip
    """:func:`forward` for an op of the channels layout (``x`` a Dask array of a float dtype, checked)."""
    if x.ndim < 2:
        raise ShapeError(f"x must have at least 2 dimensions, (N, C, *spatial), got shape {tuple(x.shape)}")
    inputs, params = _split_args(spec, args, kw)
    opts = spec.validate(kw)
    ax = opts["channel_axis"] % x.ndim  # 1 or the last (never the batch axis 0, along which x is chunked)
    c = int(x.shape[ax])
    if c == 0:
        raise ShapeError(f"x has no channels (shape {tuple(x.shape)}, channel axis {opts['channel_axis']})")
    if spec.check is not None:
        spec.check(opts, c)
    family = _meta_family(x)
    xp = _xp(family)
    xs = _standin(xp, tuple(x.shape), x.dtype)
    for a, name in zip((*inputs, *params), (*spec.input_names, *spec.param_names), strict=True):
        if _is_dask(a):
            raise ArrayTypeError(f"{name} must be an in-memory array of x's array library (one value per channel)")
    ins = [_validate.check_input(si, a, xs, ax) for si, a in zip(spec.inputs, inputs, strict=True)]
    ps = [_validate.check_param(sp, p, xs, ax, {}) for sp, p in zip(spec.params, params, strict=True)]
    arrays = dict(zip((*spec.input_names, *spec.param_names), (*ins, *ps), strict=True))
    first = (x.shape[0], c, *(d for i, d in enumerate(x.shape) if i not in (0, ax)))
    if spec.check_arrays is not None:
        spec.check_arrays(first, 1, {"x": xs, **arrays}, opts)
    present = tuple(a for a in (xs, *ins, *ps) if a is not None)
    names = tuple(n for n, a in zip(("x", *arrays), (xs, *ins, *ps), strict=True) if a is not None)
    bname, _mod = _registry.resolve(spec.name, present, names, backend)

    rechunk = _Rechunker(rechunk_warn_bytes)
    xr = rechunk(x, (x.chunks[0], *((d,) for d in x.shape[1:])), "x")
    rechunk.warn()
    fan = SPLIT_EVERY if split_every is None else int(split_every)
    blocks_in = list(xr.to_delayed().ravel())
    sizes = xr.chunks[0]
    batch = spec.name == "batch_norm" and opts["training"]
    moments = None
    if batch:
        parts = [dask.delayed(_moments, pure=True)(b, ax) for b in blocks_in]
        moments = _tree(parts, _merge_moments, fan, f"pynorm-batch_norm-moments-{xr.name}")
        opts_b = {k: v for k, v in opts.items() if k not in ("momentum", "num_batches_tracked")}
        blocks = tuple(
            dask.delayed(_bn_batch_block, pure=True)(b, moments, *ps, backend=bname, options=opts_b) for b in blocks_in
        )
    else:
        blocks = tuple(
            dask.delayed(_channels_block, pure=True)(b, *ins, *ps, op=spec.name, backend=bname, options=opts)
            for b in blocks_in
        )
    ctx = ChannelsContext(spec.name, bname, xr, tuple(ps), opts, ax, blocks, moments, fan)
    y = _channels_output(blocks, xr, 0, x.dtype)
    rm, rv = arrays.get("running_mean"), arrays.get("running_var")
    if rm is None or rv is None or (spec.name == "instance_norm" and not opts["use_input_stats"]):
        return y, ctx
    if batch:
        from .reference.batch_norm import momentum_factor

        m = momentum_factor(opts["momentum"], opts["num_batches_tracked"])
        new = [dask.delayed(_bn_running, pure=True)(moments, rm, rv, m, i) for i in (0, 1)]
    elif spec.name == "batch_norm":
        return y, ctx
    else:  # InstanceNorm: every block returned the update from its own samples
        new = [
            dask.delayed(_weighted_running, pure=True)(
                *[dask.delayed(_sized)(b, i, n) for b, n in zip(blocks, sizes, strict=True)], dtype=a.dtype
            )
            for i, a in ((1, rm), (2, rv))
        ]
    outs = [
        da.from_delayed(d, shape=(c,), dtype=a.dtype, meta=_standin(xp, (0,), a.dtype))
        for d, a in zip(new, (rm, rv), strict=True)
    ]
    return (y, *outs), ctx


def _channels_output(blocks: tuple[Any, ...], xr: Any, i: int | None, dtype: Any) -> Any:
    """Item ``i`` of the blocks' results (None: the blocks themselves) as one Dask array of x's shape and chunks."""
    meta = da.utils.meta_from_array(xr._meta, ndim=xr.ndim, dtype=dtype)
    parts = [
        da.from_delayed(
            b if i is None else dask.delayed(_pick, pure=True)(b, i), shape=(n, *xr.shape[1:]), dtype=dtype, meta=meta
        )
        for b, n in zip(blocks, xr.chunks[0], strict=True)
    ]
    return da.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _block_backward(dy: Any, block: tuple[Any, ...], op: str) -> tuple[Any, Any]:
    """A block's in-memory backward: ``(dx, packed float64 parameter gradients)``."""
    import pynorm

    grads = getattr(pynorm, f"{op}_backward")(dy, block[-1])
    xp = _validate.xp_of(grads[0])
    pieces = [g.astype(xp.float64).reshape(-1) for g in grads[1:] if g is not None]
    return grads[0], (xp.concatenate(pieces) if pieces else xp.zeros((0,), dtype=xp.float64))


def _bn_sums(dy: Any, block: tuple[Any, ...], axis: int) -> Any:
    """A training BatchNorm block's per-channel ``sum dy`` and ``sum dy x̂`` (float64, ``(C, 2)``)."""
    inner = block[-1].inner
    xp = _validate.xp_of(dy)
    g = _to_ncs(dy, axis).astype(xp.float64)
    xhat = (inner.x.astype(xp.float64) - inner.mean.astype(xp.float64)[:, None]) * inner.rstd.astype(xp.float64)[
        :, None
    ]
    return xp.stack([g.sum(axis=(0, 2)), (g * xhat).sum(axis=(0, 2))], axis=1)


def _bn_dx(dy: Any, block: tuple[Any, ...], sums: Any, count: Any, weight: Any, axis: int) -> Any:
    """A training BatchNorm block's ``dx = r w (dy - sum(dy)/k - x̂ sum(dy x̂)/k)`` (LayerNorm's backward on each
    channel's values, the sums over the whole batch), rounded once to x's dtype."""
    inner = block[-1].inner
    xp = _validate.xp_of(dy)
    g = _to_ncs(dy, axis).astype(xp.float64)
    r = inner.rstd.astype(xp.float64)[:, None]
    xhat = (inner.x.astype(xp.float64) - inner.mean.astype(xp.float64)[:, None]) * r
    k = count[:, 0][:, None]
    dx = r * (g - sums[:, 0][:, None] / k - xhat * (sums[:, 1][:, None] / k))
    if weight is not None:
        dx = dx * weight.astype(xp.float64)[:, None]
    return _round(_from_ncs(dx, dy.shape, axis), dy.dtype)


def _channels_backward(dy: Any, ctx: ChannelsContext) -> Any:
    spec = ctx.spec
    xr = ctx.x
    dy = _check_grad_array(dy, "dy", ctx, tuple(xr.shape), spec.grad_dtype(xr.dtype))  # type: ignore[arg-type]
    rechunk = _Rechunker(None)
    dy = rechunk(dy, xr.chunks, "dy")
    rechunk.warn()
    dys = list(dy.to_delayed().ravel())
    if ctx.moments is not None:  # training BatchNorm: the batch's sums, then each block's dx
        parts = [dask.delayed(_bn_sums, pure=True)(g, b, ctx.axis) for g, b in zip(dys, ctx.blocks, strict=True)]
        sums = _tree(parts, _sum_parts, ctx.split_every, f"pynorm-batch_norm-sums-{dy.name}")
        w = ctx.params[0]
        dx_blocks = [
            dask.delayed(_bn_dx, pure=True)(g, b, sums, ctx.moments, w, ctx.axis)
            for g, b in zip(dys, ctx.blocks, strict=True)
        ]
        dx = _channels_output(tuple(dx_blocks), xr, None, dy.dtype)
        packed = dask.delayed(_bn_param_sums, pure=True)(sums, tuple(p is not None for p in ctx.params))
    else:
        res = [dask.delayed(_block_backward, pure=True)(g, b, ctx.op) for g, b in zip(dys, ctx.blocks, strict=True)]
        dx = _channels_output(tuple(res), xr, 0, dy.dtype)
        packed = _tree(
            [dask.delayed(_pick, pure=True)(r, 1) for r in res],
            _sum_parts,
            ctx.split_every,
            f"pynorm-{ctx.op}-dparams-{dy.name}",
        )
    d_params: list[Any] = []
    off = 0
    for p in ctx.params:
        if p is None:
            d_params.append(None)
            continue
        n = int(p.size)
        piece = dask.delayed(_slice_round, pure=True)(packed, off, n, p.dtype)
        d_params.append(
            da.from_delayed(
                piece, shape=tuple(p.shape), dtype=p.dtype, meta=_standin(_validate.xp_of(p), (0,), p.dtype)
            ).reshape(p.shape)
        )
        off += n
    return spec.grads(dx, *d_params)


def _bn_param_sums(sums: Any, present: tuple[bool, ...]) -> Any:
    """``dweight = sum dy x̂``, ``dbias = sum dy`` packed as the blocks' parameter gradients are (float64)."""
    xp = _validate.xp_of(sums)
    pieces = [s for s, p in zip((sums[:, 1], sums[:, 0]), present, strict=True) if p]
    return xp.concatenate(pieces) if pieces else xp.zeros((0,), dtype=xp.float64)


def _slice_round(packed: Any, off: int, n: int, dtype: Any) -> Any:
    return _round(packed[off : off + n], dtype)


# ---------------------------------------------------------------------------
# pynorm.dask.<op>, <op>_forward, <op>_backward for every op


def _backward_of(name: str, dy: Any, ctx: DaskContext, recompute: bool, upstream: dict[str, Any]) -> Any:
    if isinstance(ctx, (DaskContext, ChannelsContext)) and ctx.op != name:
        raise ContextError(f"ctx was produced by {ctx.op} and cannot be used by {name}_backward")
    return backward(dy, ctx, recompute=recompute, **{k: v for k, v in upstream.items() if v is not None})


def _install() -> None:
    """``pynorm.dask.<op>``, ``<op>_forward``, ``<op>_backward`` for every op, made by :mod:`pynorm._api` from the
    spec (the in-memory signatures, ``out`` replaced by the Dask keywords)."""
    from . import _api

    mod = sys.modules[__name__]
    for spec in SPECS.values():
        for f in _api.build(spec, __name__, (forward, _backward_of)):
            setattr(mod, f.__name__, f)
            __all__.append(f.__name__)


_install()


def __getattr__(name: str) -> Any:  # for mypy: the generated functions are module attributes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
