"""Evaluating one cell: call the user's functions, run the reference, measure every output.

The pieces :func:`pynorm.oracle.check` and the diagnoses share: the budgets (:class:`Budgets`), the reference's
results for a cell (:func:`reference`), the term scales (:func:`scales_of`), the yardsticks (:func:`measure`:
ulps at the terms' magnitude, the absolute error, non-finite values, dtype and shape), the calling convention of
the user's functions (:func:`call_forward`, :func:`call_backward`), and the records of a cell
(:class:`OutputCheck`, :class:`CellResult`, :class:`Evaluated`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._measure import flat_arrays, term_scales, ulp_error
from ..errors import ArgumentError
from ..ops import OpSpec
from ._dtypes import constants, dtype_name, dtype_of
from .grid import Case, Cell

__all__ = [
    "DEFAULT_BUDGETS",
    "RUNNING_OUTPUTS",
    "TIERS",
    "Budgets",
    "CellResult",
    "Evaluated",
    "OutputCheck",
    "RefRun",
    "as_numpy",
    "call_backward",
    "call_forward",
    "error_ulps",
    "measure",
    "parse_budget",
    "reference",
    "run_reference",
    "scales_of",
]

#: the tiers of a cell's verdict, best first (:attr:`CellResult.tier`)
TIERS = ("exact", "stable", "fail", "error", "skip")

#: default budgets in ulps of each output's dtype at the terms' magnitude: ``y`` (and the other forward
#: outputs), ``dx``, and ``dparam`` for every other gradient. Half dtypes: what one rounding of a float32
#: computation gives (a second rounding -- Llama's order -- exceeds it); float32: a float32 computation;
#: float64: a float64 one.
DEFAULT_BUDGETS: dict[str, dict[str, float]] = {
    "float16": {"y": 1.0, "dx": 2.0, "dparam": 2.0},
    "bfloat16": {"y": 1.0, "dx": 2.0, "dparam": 2.0},
    "float32": {"y": 8.0, "dx": 32.0, "dparam": 64.0},
    "float64": {"y": 8.0, "dx": 32.0, "dparam": 64.0},
}


@dataclass
class Budgets:
    """Ulp budgets per dtype and output: defaults, overridden by ``overrides[(dtype or None, name)]``.

    ``name`` is an output (``y``, ``h``...), ``dx``, a gradient name (``dweight``) or ``dparam`` (every
    gradient but ``dx``); a ``None`` dtype applies to every dtype.
    """

    overrides: dict[tuple[str | None, str], float] = field(default_factory=dict)

    def get(self, dtype: str, name: str) -> float:
        """The budget of output ``name`` in cells of ``dtype`` (a dtype name)."""
        table = DEFAULT_BUDGETS.get(dtype, DEFAULT_BUDGETS["float64"])
        group = name if name in ("y", "dx") else ("dparam" if name.startswith("d") else "y")
        for key in ((dtype, name), (None, name), (dtype, group), (None, group)):
            if key in self.overrides:
                return self.overrides[key]
        return table[group]

    def to_json(self) -> dict[str, Any]:
        return {
            "defaults": DEFAULT_BUDGETS,
            "overrides": {f"{d}:{n}" if d else n: v for (d, n), v in self.overrides.items()},
        }


def parse_budget(text: str | Mapping[str, float] | None) -> Budgets:
    """``"y=4,dx=16"`` or ``"float16:y=2,dweight=8"`` (or a dict of the same keys) as :class:`Budgets`.

    Raises :class:`pynorm.errors.ArgumentError` naming ``budget`` for bad syntax or a negative value.
    """
    out: dict[tuple[str | None, str], float] = {}
    if text is None:
        return Budgets(out)
    items: list[tuple[str, Any]]
    if isinstance(text, Mapping):
        items = list(text.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ArgumentError(f"budget: expected name=ulps (e.g. y=4,dx=16), got {part!r}")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    for k, v in items:
        dt, _, name = str(k).rpartition(":")
        if dt and dt not in DEFAULT_BUDGETS:
            raise ArgumentError(f"budget: unknown dtype {dt!r} in {k!r} (dtypes: {', '.join(DEFAULT_BUDGETS)})")
        if not name.isidentifier():
            raise ArgumentError(f"budget: {k!r} is not an output name (y, dx, dweight, dparam...)")
        try:
            ulps = float(v)
        except (TypeError, ValueError):
            raise ArgumentError(f"budget: {k}={v!r} is not a number of ulps") from None
        if not ulps >= 0:
            raise ArgumentError(f"budget: {k}={v!r} must be >= 0 ulps")
        out[(dt or None, name)] = ulps
    return Budgets(out)


# ---------------------------------------------------------------------------
# the reference


@dataclass
class RefRun:
    """The reference's results for a case: outputs and gradients by name, and the forward's ctx."""

    outputs: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    ctx: Any


def run_reference(spec: OpSpec, case: Case) -> RefRun:
    """pynorm's reference (the ``numpy`` backend) on ``case`` with ``case.options``."""
    import pynorm

    fwd = spec.generic_forward()
    bwd = getattr(pynorm, f"{spec.name}_backward")
    where = {} if spec.layout == "channels" else {"axis": case.axis}  # channels: channel_axis is an option
    with np.errstate(all="ignore"):
        res, ctx = fwd(np.ascontiguousarray(case.x), *case.args, **where, backend="numpy", **case.options)
        outs = res if isinstance(res, tuple) else (res,)
        grads = bwd(case.dy, ctx)
    # outputs beyond the spec's names (quant_layer_norm's (q, s) when quantizing) are named by position; the
    # updated running statistics of InstanceNorm and BatchNorm by their inputs' names
    extra = RUNNING_OUTPUTS if spec.layout == "channels" else ()
    names = [*spec.outputs, *extra, *(f"out{i}" for i in range(len(spec.outputs) + len(extra), len(outs)))]
    return RefRun(
        dict(zip(names, outs, strict=False)),
        {k: g for k, g in zip(grads._fields, grads, strict=True) if g is not None},
        ctx,
    )


def reference(spec: OpSpec, case: Case) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """pynorm's reference outputs and gradients for ``case``, by name."""
    run = run_reference(spec, case)
    return run.outputs, run.grads


#: the names of the updated running statistics a channel op returns after ``y``
RUNNING_OUTPUTS = ("running_mean", "running_var")


def to_ncs(a: np.ndarray, axis: int) -> np.ndarray:
    """An array of ``x``'s layout as ``(N, C, S)`` float64 (the channel axis ``axis`` moved to 1)."""
    a = np.moveaxis(np.asarray(a, np.float64), axis % np.ndim(a), 1)
    return a.reshape(a.shape[0], a.shape[1], -1)


def from_ncs(a: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The inverse of :func:`to_ncs` for ``x`` of ``shape``."""
    ax = axis % len(shape)
    moved = (shape[0], shape[ax], *(d for i, d in enumerate(shape) if i not in (0, ax)))
    return np.moveaxis(np.asarray(a).reshape(moved), 1, ax)


def _channel_scales(spec: OpSpec, case: Case, ref_out: Mapping[str, np.ndarray]) -> dict[str, Any]:
    x3, dy3 = to_ncs(case.x, case.axis), to_ncs(case.dy, case.axis)
    arrays = dict(zip((*spec.input_names, *spec.param_names), case.args, strict=True))
    out = dict(term_scales(spec.name, x3, arrays, dy3, case.options))
    for k in ("y", "dx"):
        if k in out:
            out[k] = from_ncs(out[k], np.shape(case.x), case.axis)
    if "running_mean" in ref_out and arrays.get("running_mean") is not None:
        from ..reference.batch_norm import momentum_factor

        m = momentum_factor(case.options.get("momentum"), int(case.options.get("num_batches_tracked", 0)))
        if spec.name == "instance_norm":
            mean = np.abs(x3.mean(axis=2)).mean(axis=0)
        else:
            mean = np.abs(x3.mean(axis=(0, 2)))
        rm, rv = (np.abs(np.asarray(arrays[k], np.float64)) for k in RUNNING_OUTPUTS)
        var = np.abs(np.asarray(ref_out["running_var"], np.float64) - (1 - m) * rv) if "running_var" in ref_out else 0
        out["running_mean"] = (1 - m) * rm + m * mean
        out["running_var"] = (1 - m) * rv + var
    return out


def scales_of(spec: OpSpec, case: Case, ref_out: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The term scales of every output of ``case`` (:func:`pynorm.testing.term_scales`; for an op of the channels
    layout its spec's on the ``(N, C, S)`` view, back in ``x``'s layout, and the running statistics' terms
    ``(1 - m)|old| + m |batch statistic|``)."""
    if spec.layout == "channels":
        with np.errstate(all="ignore"):
            return _channel_scales(spec, case, ref_out)
    x = np.ascontiguousarray(case.x)
    ax = case.axis % x.ndim
    rows = int(np.prod(x.shape[:ax]))
    arrays = flat_arrays(spec, x.shape, ax, case.args)
    if "h" in ref_out:
        arrays["h"] = np.asarray(ref_out["h"]).astype(np.float64).reshape(rows, -1)
    x2 = x.reshape(rows, -1).astype(np.float64)
    dy2 = case.dy.reshape(rows, -1).astype(np.float64)
    return term_scales(spec.name, x2, arrays, dy2, case.options)


# ---------------------------------------------------------------------------
# the yardsticks


def as_numpy(a: Any) -> np.ndarray:
    """A NumPy array of any array-like a user's function returns: NumPy, a (CPU) PyTorch tensor -- bfloat16 too --,
    a JAX array, anything ``np.asarray`` or DLPack takes."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor
        t = a.detach().cpu()
        if dtype_name(t.dtype) == "bfloat16":  # torch's .numpy() refuses bfloat16; float32 holds it exactly
            return np.asarray(t.float().numpy()).astype(dtype_of("bfloat16"))
        return np.asarray(t.numpy())
    try:
        return np.asarray(a)
    except (TypeError, ValueError, RuntimeError):
        if hasattr(a, "__dlpack__"):
            return np.from_dlpack(a)
        raise


def error_ulps(actual: np.ndarray, expected: np.ndarray, dtype: Any, scale: Any = None) -> float:
    """The largest error in ulps of ``dtype`` at ``max(|expected|, scale)``; for an integer dtype (an int8
    output), the largest difference in levels."""
    err = _ulp_errors(actual, expected, dtype, scale)
    return float(err.max()) if err.size else 0.0


def _ulp_errors(actual: Any, expected: Any, dtype: Any, scale: Any = None) -> np.ndarray:
    if dtype_of(dtype).kind in "iu":
        with np.errstate(invalid="ignore"):
            d = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
        return np.where(np.isnan(d), np.inf, d)
    return ulp_error(actual, expected, dtype, scale=scale)


def scale_like(scale: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """A term scale as float64 of ``shape`` (or a single value, kept as it is); None where there is none, or where
    its size fits neither."""
    if scale is None:
        return None
    s = np.asarray(scale, dtype=np.float64)
    if s.size == int(np.prod(shape)):
        return s.reshape(shape)
    return s if s.size == 1 else None


@dataclass
class OutputCheck:
    """The measure of one output or gradient of one cell.

    Attributes
    ----------
    ulps : largest error in ulps of the output's dtype at ``max(|reference|, scale)`` (``inf`` where a value is
        non-finite and the reference's is not, or the shapes cannot be compared).
    abs_error : largest ``|yours - reference|`` over the elements where both are finite (NaN: not comparable).
    budget : the budget the error is judged against.
    nonfinite : elements non-finite where the reference's are finite.
    at_zero : the largest ulp error sits where the exact value and the terms' magnitude are 0 (a row without
        spread): an ulp count there is the subnormal spacing, read the absolute error instead.
    shape, dtype : what the user returned, where it differs from the shape / dtype the op promises.
    stable : whether the error is within what a backward-stable algorithm in the cell's working precision may
        lose (:mod:`pynorm.oracle.stability`), None where not computed.
    explained_by : the diagnosis code that explains this failing output (set by the diagnoses).
    """

    ulps: float
    abs_error: float
    budget: float
    nonfinite: int = 0
    at_zero: bool = False
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    stable: bool | None = None
    explained_by: str | None = None

    @property
    def failed(self) -> bool:
        """Over budget, or of the wrong dtype or shape."""
        return self.shape is not None or self.dtype is not None or not self.ulps <= self.budget

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ulps": _num(self.ulps),
            "abs_error": _num(self.abs_error),
            "budget_ulps": self.budget,
            "failed": self.failed,
        }
        if self.nonfinite:
            out["nonfinite"] = self.nonfinite
        if self.at_zero:
            out["at_zero"] = True
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.stable is not None:
            out["stable"] = self.stable
        if self.explained_by is not None:
            out["explained_by"] = self.explained_by
        return out


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else ("inf" if v > 0 else "nan" if math.isnan(v) else "-inf")


def measure(user: Any, ref: np.ndarray, dtype: Any, scale: Any, budget: float) -> tuple[OutputCheck, np.ndarray | None]:
    """Measure ``user`` against ``ref`` (both of the output's promised ``dtype``); the check and the user's values
    as float64 in ``ref``'s shape (None when the sizes differ)."""
    u = as_numpy(user)
    ref = np.asarray(ref)
    got_dtype = dtype_name(u.dtype)
    want_dtype = dtype_name(dtype_of(dtype))
    bad_dtype = got_dtype if got_dtype != want_dtype else None
    bad_shape = tuple(u.shape) if u.shape != ref.shape else None
    if u.size != ref.size:
        return OutputCheck(math.inf, math.nan, budget, shape=bad_shape, dtype=bad_dtype), None
    with np.errstate(all="ignore"):
        u64 = u.reshape(ref.shape).astype(np.float64)
    r64 = ref.astype(np.float64)
    # the grid's inputs are finite: a NaN in the reference is 0/0 (eps = 0 on a row without spread, e.g. a
    # "huge" row clipped to one value), where the exact result is undefined and any value is accepted
    undefined = np.isnan(r64)
    cmp = np.where(undefined, r64, u64) if undefined.any() else u64
    sc = scale_like(scale, ref.shape)
    err = _ulp_errors(cmp, r64, dtype, sc)
    ulps = float(err.max()) if err.size else 0.0
    both = np.isfinite(cmp) & np.isfinite(r64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(cmp - r64)
    abs_error = float(diff[both].max()) if both.any() else 0.0
    nonfinite = int(np.sum(~np.isfinite(cmp) & np.isfinite(r64)))
    at_zero = False
    if err.size and math.isfinite(ulps) and ulps > 0 and dtype_of(dtype).kind == "f":
        i = int(np.argmax(err))
        mag = abs(float(r64.flat[i]))
        if sc is not None:
            mag = max(mag, abs(float(np.broadcast_to(sc, ref.shape).flat[i])))
        at_zero = mag < constants(dtype)["smallest_normal"]
    check = OutputCheck(ulps, abs_error, budget, nonfinite, at_zero, bad_shape, bad_dtype)
    return check, u64


# ---------------------------------------------------------------------------
# the cells


@dataclass
class CellResult:
    """The outcome of one cell.

    Attributes
    ----------
    cell : the :class:`~pynorm.oracle.grid.Cell`.
    outputs : one :class:`OutputCheck` per output and gradient measured.
    verdict : ``"pass"``, ``"fail"`` (some output over budget or of the wrong dtype or shape), ``"error"`` (the
        user's function raised or returned the wrong number of results) or ``"skip"`` (the reference rejects the
        cell).
    forward_verdict : ``"pass"`` or ``"fail"`` for the forward outputs alone (kept when the backward raised).
    note : the exception or mismatch.
    eps : the eps the user's functions received (None for an op without one).
    explained : for a failing cell, whether the diagnoses explain every failing output (None before they run).
    """

    cell: Cell
    outputs: dict[str, OutputCheck] = field(default_factory=dict)
    verdict: str = "pass"
    forward_verdict: str | None = None
    note: str = ""
    eps: float | None = None
    explained: bool | None = None

    @property
    def errors(self) -> dict[str, float]:
        """Largest error in ulps per output."""
        return {k: o.ulps for k, o in self.outputs.items()}

    @property
    def budgets(self) -> dict[str, float]:
        return {k: o.budget for k, o in self.outputs.items()}

    @property
    def nonfinite(self) -> dict[str, int]:
        return {k: o.nonfinite for k, o in self.outputs.items() if o.nonfinite}

    @property
    def failed_outputs(self) -> list[str]:
        return [k for k, o in self.outputs.items() if o.failed]

    @property
    def stable(self) -> bool | None:
        """For a failing cell: every failing output within the backward-stable allowance (None: not computed)."""
        flags = [self.outputs[k].stable for k in self.failed_outputs]
        if not flags or any(f is None for f in flags):
            return None
        return all(bool(f) for f in flags)

    @property
    def tier(self) -> str:
        """The cell's verdict in tiers (:data:`TIERS`): ``"exact"`` (every output within its budget of the exact
        result), ``"stable"`` (beyond it, but every failing output within what a backward-stable algorithm in the
        working precision may lose), ``"fail"``; ``"error"`` and ``"skip"`` as :attr:`verdict`."""
        if self.verdict == "pass":
            return "exact"
        if self.verdict == "fail":
            return "stable" if self.stable is True else "fail"
        return self.verdict

    def fails(self, strict: bool = False) -> bool:
        """Whether the cell fails the check: its tier is ``"fail"`` (with ``strict``, ``"stable"`` too)."""
        return self.tier == "fail" or (strict and self.tier == "stable")

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text

    def to_json(self) -> dict[str, Any]:
        out = {
            **self.cell.to_json(),
            "eps_received": self.eps,
            "verdict": self.verdict,
            "tier": self.tier,
            "outputs": {k: o.to_json() for k, o in self.outputs.items()},
            "errors_ulps": {k: _num(o.ulps) for k, o in self.outputs.items()},
            "budgets_ulps": self.budgets,
            "nonfinite": self.nonfinite,
            "note": self.note,
        }
        if self.forward_verdict is not None and self.forward_verdict != self.verdict:
            out["forward_verdict"] = self.forward_verdict
        if self.verdict == "fail":
            out["explained"] = self.explained
            out["stable"] = self.stable
        return out


@dataclass
class Evaluated:
    """What the diagnoses need of a cell: its arrays, what the user returned, the reference's results.

    ``case.options`` are the reference's options; ``call`` the options the user's functions received (they differ
    by the reference-only conventions). ``user`` holds the user's results as float64 in the reference's shapes,
    ``dtypes`` the dtype each output promises.
    """

    case: Case
    call: dict[str, Any]
    user: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]
    scales: dict[str, Any]
    dtypes: dict[str, np.dtype[Any]]
    result: CellResult
    ctx: Any = None

    @property
    def dtype(self) -> str:
        return self.result.cell.dtype


# ---------------------------------------------------------------------------
# calling the user's functions


def split_args(spec: OpSpec, args: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments after ``x`` as the user's functions take them: positional, and the keyword inputs."""
    n = len(spec.inputs)
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for inp, a in zip(spec.inputs, args[:n], strict=True):
        if inp.keyword:
            if a is not None:
                kw[inp.name] = a
        else:
            pos.append(a)
    return [*pos, *args[n:]], kw


def fresh_x(x: np.ndarray) -> np.ndarray:
    """A copy of ``x`` with the same layout: C-contiguous, or every other element of a wider buffer."""
    if x.flags.c_contiguous:
        return x.copy()
    wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def call_forward(
    spec: OpSpec, forward: Callable[..., Any], case: Case, conventions: Mapping[str, Any], *, contiguous: bool = False
) -> Any:
    """Call a user's ``forward`` on ``case`` by the documented convention (copies of every array; ``x`` keeps its
    layout unless ``contiguous``)."""
    pos, kw = split_args(spec, [None if a is None else a.copy() for a in case.args])
    x = np.ascontiguousarray(case.x).copy() if contiguous else fresh_x(case.x)
    return forward(x, *pos, **kw, **conventions)


def call_backward(
    spec: OpSpec, backward: Callable[..., Any], case: Case, conventions: Mapping[str, Any], *, contiguous: bool = False
) -> Any:
    """Call a user's ``backward`` on ``case``: ``backward(dy, x, *inputs, *params, **kw, **conventions)``."""
    pos, kw = split_args(spec, [None if a is None else a.copy() for a in case.args])
    x = np.ascontiguousarray(case.x).copy() if contiguous else fresh_x(case.x)
    return backward(case.dy.copy(), x, *pos, **kw, **conventions)
