"""Tools to check gradients and compare results in ulps, for pynorm's tests and yours.

* :func:`check_grads` checks a hand-written backward against central finite
  differences in float64: vector-Jacobian products along random directions,
  plus the full Jacobian for small inputs. It takes any ``forward(*inputs) ->
  (y, ctx)`` / ``backward(dy, ctx) -> grads`` pair, pynorm's or your own.
* :func:`ulp`, :func:`ulp_error` and :func:`assert_ulp_close` measure errors in
  units in the last place of a dtype, optionally at the magnitude of the terms a
  result was computed from (``scale=``): the fair measure for results that are
  small differences of larger terms.
* :func:`assert_matches_reference` is ``python -m pynorm check`` as an assertion, for
  your own test suite (``docs/examples/test_my_layer_norm.py`` is one to copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._dtypes import dtype_of, finfo
from ._measure import (
    HARD_CASES,
    assert_ulp_close,
    flat_arrays,
    make_input,
    max_ulp_error,
    term_scales,
    ulp,
    ulp_error,
)

if TYPE_CHECKING:
    from .oracle.report import CheckReport

__all__ = [
    "HARD_CASES",
    "ConformanceReport",
    "GradCheckReport",
    "assert_matches_reference",
    "assert_ulp_close",
    "check_conformance",
    "check_grads",
    "finfo",
    "flat_arrays",
    "make_input",
    "max_ulp_error",
    "term_scales",
    "ulp",
    "ulp_error",
]


@dataclass
class GradCheckReport:
    """Result of :func:`check_grads`.

    Attributes
    ----------
    directional_errors : relative error of each random-direction check:
        ``|<v, J u> - <J^T v, u>| / sum(|J^T v| |u|)``.
    jacobian_error : for small inputs, ``max|J_fd - J_analytic| / max|J_analytic|``
        over all inputs (None when not computed).
    rtol : the tolerance both were compared with.
    worst_input : name of the input with the largest directional contribution error.
    """

    directional_errors: list[float] = field(default_factory=list)
    jacobian_error: float | None = None
    rtol: float = 1e-6
    details: dict[str, float] = field(default_factory=dict)

    @property
    def max_directional_error(self) -> float:
        return max(self.directional_errors, default=0.0)

    @property
    def passed(self) -> bool:
        ok = all(e <= self.rtol for e in self.directional_errors)
        return ok and (self.jacobian_error is None or self.jacobian_error <= self.rtol)

    def __str__(self) -> str:
        jac = "not computed" if self.jacobian_error is None else f"{self.jacobian_error:.2e}"
        det = ", ".join(f"{k} {v:.2e}" for k, v in self.details.items())
        return (
            f"GradCheckReport({'PASSED' if self.passed else 'FAILED'}: max directional error "
            f"{self.max_directional_error:.2e}, full-Jacobian error {jac}, rtol {self.rtol:.0e}; {det})"
        )


def _diff(f: Callable[[float], np.ndarray], h: float) -> np.ndarray:
    # central difference with one Richardson step: error O(h^4)
    d1 = (f(h) - f(-h)) / (2 * h)
    d2 = (f(h / 2) - f(-h / 2)) / h
    return (4 * d2 - d1) / 3


def check_grads(
    forward: Callable[..., Any],
    backward: Callable[[Any, Any], Sequence[Any]],
    inputs: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    n_directions: int = 6,
    step: float = 1e-3,
    rtol: float = 1e-6,
    full_jacobian: bool | None = None,
    max_jacobian_size: int = 256,
    seed: int = 0,
    raise_on_failure: bool = False,
) -> GradCheckReport:
    """Check ``backward`` against central finite differences of ``forward`` in float64.

    Parameters
    ----------
    forward : ``forward(*inputs) -> (y, ctx)`` (or just ``y`` if ``backward`` ignores ctx).
    backward : ``backward(dy, ctx) -> grads``, one gradient per input in order
        (extra leading/trailing entries are not allowed; None for an input that
        is None or not differentiated).
    inputs : the point to check at; arrays are converted to float64 copies, None kept.
    names : labels for the report (default ``x0, x1, ...``).
    n_directions : random (u, v) pairs for the vector-Jacobian check
        ``<v, J u>`` (finite differences) vs ``<J^T v, u>`` (backward).
    step : largest finite-difference step along ``u``; ``u`` is scaled per input
        to the input's RMS (at least 1e-3), so ``step`` is relative. Steps
        ``step``, ``step/8`` and ``step/64`` are tried and the best agreement
        counts (each error is min over steps): a correct backward agrees at some
        step even where the function curves fast, a wrong one at none.
    rtol : tolerance of both checks, relative to the magnitude of the terms
        (``sum |J^T v| |u|``, or ``max |J|`` for the Jacobian), floored at 1e-4 of
        the natural derivative size ``max|y| / rms(x)`` so that nearly flat
        functions are not judged on rounding noise.
    full_jacobian : also compare whole Jacobians (default: when the inputs and
        output together have at most ``max_jacobian_size`` elements).
    seed : seed of the random directions.
    raise_on_failure : raise AssertionError with the report if the check fails.
    """
    xs: list[Any] = [None if a is None else np.array(a, dtype=np.float64) for a in inputs]
    labels = list(names) if names is not None else [f"x{i}" for i in range(len(xs))]
    rng = np.random.default_rng(seed)

    def run(args: list[Any]) -> tuple[np.ndarray, Any]:
        res = forward(*args)
        y, ctx = res if isinstance(res, tuple) else (res, None)
        return np.asarray(y, dtype=np.float64), ctx

    y0, ctx0 = run(xs)
    active = [i for i, a in enumerate(xs) if a is not None]

    def grads_of(v: np.ndarray) -> list[Any]:
        g = list(backward(v.astype(y0.dtype), ctx0))
        if len(g) != len(xs):
            raise ValueError(f"backward returned {len(g)} gradients for {len(xs)} inputs")
        return [None if gi is None else np.asarray(gi, dtype=np.float64) for gi in g]

    def shifted(dirs: dict[int, np.ndarray]) -> Callable[[float], np.ndarray]:
        def f(t: float) -> np.ndarray:
            args = [a if i not in dirs else a + t * dirs[i] for i, a in enumerate(xs)]
            return run(args)[0]

        return f

    report = GradCheckReport(rtol=rtol)
    # a correct backward matches the differences at some step; a wrong one at none of them.
    # Several steps make the check robust to rows whose spread is much smaller than their RMS.
    steps = (step, step / 8, step / 64)
    # the natural size of a derivative is |y| / |x|: where the Jacobian is far smaller (LayerNorm
    # with H = 2 is flat up to eps), differences of y are all rounding, so errors are measured
    # against at least 1e-4 of that natural size
    ymax = float(np.max(np.abs(y0))) if y0.size else 0.0
    scales = {i: max(1e-3, float(np.sqrt(np.mean(xs[i] ** 2))) if xs[i].size else 1.0) for i in active}
    for _ in range(n_directions):
        v = rng.standard_normal(y0.shape)
        g = grads_of(v)
        us = {i: rng.standard_normal(xs[i].shape) * scales[i] for i in active if g[i] is not None}
        terms = [g[i] * us[i] for i in us]
        analytic = float(sum(np.sum(t) for t in terms))
        mag = float(sum(np.sum(np.abs(t)) for t in terms)) + 1e-4 * float(np.sum(np.abs(v))) * ymax + 1e-300
        f = shifted(us)
        err = min(abs(float(np.sum(v * _diff(f, h))) - analytic) / mag for h in steps)
        report.directional_errors.append(err)

    n_total = sum(xs[i].size for i in active) + y0.size
    if full_jacobian or (full_jacobian is None and n_total <= max_jacobian_size):
        rows = [grads_of(e.reshape(y0.shape)) for e in np.eye(y0.size)]
        worst = 0.0
        for i in active:
            if rows and rows[0][i] is None:
                continue
            ja = np.stack([r[i].ravel() for r in rows]) if rows else np.zeros((0, xs[i].size))
            jmax = (float(np.max(np.abs(ja))) if ja.size else 0.0) + 1e-4 * ymax / scales[i] + 1e-300
            col_err = np.full(xs[i].size, np.inf)
            for j in range(xs[i].size):
                e = np.zeros(xs[i].size)
                e[j] = scales[i]
                f = shifted({i: e.reshape(xs[i].shape)})
                for h in steps:
                    col = _diff(f, h).ravel() / scales[i]
                    col_err[j] = min(col_err[j], float(np.max(np.abs(col - ja[:, j]), initial=0.0)) / jmax)
            err = float(col_err.max(initial=0.0))
            report.details[f"jacobian[{labels[i]}]"] = err
            worst = max(worst, err)
        report.jacobian_error = worst
    if raise_on_failure and not report.passed:
        raise AssertionError(str(report))
    return report


@dataclass
class ConformanceReport:
    """Result of :func:`check_conformance`: one row per (dtype, kind, hidden size).

    Each row maps ``"y"``, ``"dx"``, ``"d<param>"`` to the largest error in ulps
    of the dtype, measured at the magnitude of the terms (see :func:`term_scales`).
    """

    op: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def max_ulps(self, dtype: Any = None) -> dict[str, float]:
        """Largest error per output over all rows (of one dtype, if given)."""
        out: dict[str, float] = {}
        name = None if dtype is None else dtype_of(dtype).name
        for r in self.rows:
            if name is None or r["dtype"] == name:
                for k, v in r.items():
                    if k not in ("dtype", "kind", "hidden"):
                        out[k] = max(out.get(k, 0.0), v)
        return out

    def passed(self, max_ulps: float | dict[str, float]) -> bool:
        """True if every error is within ``max_ulps`` (a number, or a limit per dtype name)."""
        for r in self.rows:
            limit = max_ulps if isinstance(max_ulps, (int, float)) else max_ulps[r["dtype"]]
            if any(v > limit for k, v in r.items() if k not in ("dtype", "kind", "hidden")):
                return False
        return True

    def table(self) -> str:
        keys = [k for k in self.rows[0] if k not in ("dtype", "kind", "hidden")] if self.rows else []
        lines = [f"{self.op}: max error in ulps at the terms' magnitude"]
        lines.append(f"{'dtype':9s} {'kind':9s} {'H':>5s} " + " ".join(f"{k:>8s}" for k in keys))
        for r in self.rows:
            cells = " ".join(f"{r[k]:8.2f}" for k in keys)
            lines.append(f"{r['dtype']:9s} {r['kind']:9s} {r['hidden']:5d} {cells}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def check_conformance(
    op: str,
    forward: Callable[..., Any],
    backward: Callable[..., Sequence[Any]] | None = None,
    *,
    dtypes: Sequence[Any] = ("float16", "bfloat16", "float32", "float64"),
    kinds: Sequence[str] = HARD_CASES,
    hidden_sizes: Sequence[int] = (1, 3, 64, 257),
    rows: int = 4,
    conventions: dict[str, Any] | None = None,
    seed: int = 0,
) -> ConformanceReport:
    """Compare your implementation of ``op`` with pynorm's reference on ordinary and hard inputs.

    Parameters
    ----------
    op : the name of an op of :data:`pynorm.ops.SPECS` (``"layer_norm"``, ``"rms_norm"``...).
    forward : ``forward(x, *params, **conventions) -> y`` on NumPy arrays of shape
        ``(rows, H)`` (``params`` in pynorm's order: weight, bias), normalizing
        the last axis. The result may be any array-like of ``x``'s shape.
    backward : optional ``backward(dy, x, *params, **conventions) -> (dx, *dparams)``.
    dtypes, kinds, hidden_sizes, rows : the grid of inputs (see :func:`make_input`).
    conventions : keyword options passed to both your functions and pynorm's
        (e.g. ``{"eps": 1e-6}``).

    Returns
    -------
    ConformanceReport with the largest ulp error of each output in each cell.
    A float32 implementation that computes in float32 typically shows a few ulps
    on ``y`` and tens on ``dx``; check ``report.passed({...})`` with the budget you
    promise, and print ``report`` for the table.
    """
    import pynorm

    from .ops import SPECS

    if op not in SPECS:
        raise ValueError(f"op must be one of {sorted(SPECS)}, got {op!r}")
    conv = dict(conventions or {})
    pnames = SPECS[op].param_names
    fwd_ref = getattr(pynorm, f"{op}_forward")
    bwd_ref = getattr(pynorm, f"{op}_backward")
    rng = np.random.default_rng(seed)
    report = ConformanceReport(op)
    for dt_ in dtypes:
        dt = dtype_of(dt_)
        for kind in kinds:
            for h in hidden_sizes:
                x = make_input(kind, (rows, h), dt, rng)
                params = [((1.0 if p == "weight" else 0.0) + 0.5 * rng.standard_normal(h)).astype(dt) for p in pnames]
                dy = rng.standard_normal((rows, h)).astype(dt)
                y_ref, ctx = fwd_ref(x, *params, backend="numpy", **conv)
                sc = term_scales(op, x, dict(zip(pnames, params, strict=True)), dy, conv)
                row: dict[str, Any] = {"dtype": dt.name, "kind": kind, "hidden": h}
                y = np.asarray(forward(x.copy(), *[p.copy() for p in params], **conv))
                row["y"] = max_ulp_error(y.astype(dt), y_ref, dt, scale=sc["y"])
                if backward is not None:
                    grads_ref = bwd_ref(dy, ctx)
                    grads = backward(dy.copy(), x.copy(), *[p.copy() for p in params], **conv)
                    for name, g, gr in zip(("x", *pnames), grads, grads_ref, strict=True):
                        ga = np.asarray(g).astype(dt)
                        row[f"d{name}"] = max_ulp_error(ga, gr, dt, scale=sc[f"d{name}"])
                report.rows.append(row)
    return report


def assert_matches_reference(
    fn: Callable[..., Any],
    *,
    op: str,
    backward: Callable[..., Any] | None = None,
    grid: Any = "quick",
    dtypes: Sequence[str] | None = None,
    strict: bool = False,
    reference: dict[str, Any] | None = None,
    conventions: dict[str, Any] | None = None,
    budget: Any = None,
    seed: int = 0,
) -> CheckReport:
    """Assert that your implementation of ``op`` matches pynorm's reference: :func:`pynorm.oracle.check` as an
    assertion for your test suite.

    Parameters
    ----------
    fn : your forward, called like ``pynorm.<op>(x, *inputs, *params, **conventions)`` (``docs/oracle.md``).
    op : the op it implements (``"layer_norm"``, ``"rms_norm"``...).
    backward : your backward, ``backward(dy, x, *inputs, *params, **conventions) -> (dx, *dinputs, *dparams)``.
    grid : ``"quick"`` (default, seconds), ``"default"`` (the full grid) or a list of
        :class:`pynorm.oracle.Cell`.
    dtypes : restrict the grid to these dtype names.
    strict : fail on cells of tier ``stable`` too (beyond the exact budget, within what a backward-stable algorithm
        in the working precision may lose).
    reference : options for the reference only (``{"casting": "llama"}``, ``{"correction": 1}``): your functions
        do not receive them.
    conventions : options passed to your functions and to the reference (``{"eps": 1e-6}``).
    budget : budgets in ulps (``"y=4,dx=16"``), as :func:`pynorm.oracle.check` takes them.
    seed : the seed of the inputs.

    Returns
    -------
    pynorm.oracle.CheckReport
        The report, when the check passes (no cell of tier ``fail``, no exception, batch-invariant rows on the
        named grids).

    Raises
    ------
    AssertionError
        The check fails: the message is the table of the cells that are not exact, the joint diagnoses per dtype,
        the diagnoses, the advice the checker verified and the summary.
    pynorm.errors.ArgumentTypeError
        ``fn`` or ``backward`` is not callable, ``strict`` is not a bool.
    pynorm.errors.UnknownOpError, pynorm.errors.ArgumentError
        an unknown ``op``, a bad ``grid``, ``dtypes``, ``budget``, ``conventions`` or ``reference``.
    """
    from .errors import ArgumentTypeError
    from .oracle import check

    if not isinstance(strict, bool):
        raise ArgumentTypeError(f"strict must be True or False, got {strict!r}")
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "fn"))
    report = check(
        op,
        fn,
        backward,
        conventions=conventions,
        reference=reference,
        budget=budget,
        grid=grid,
        dtypes=dtypes,
        seed=seed,
        strict=strict,
        target=name,
    )
    if not report.passed:
        raise AssertionError("\n".join(report.lines(cli=False, only_failures=True)))
    return report
