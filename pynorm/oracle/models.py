r"""Models of implementations: what an implementation with a given bug, or a given convention, returns.

Each :class:`Model` *emulates* one cause: given a cell (its inputs and, where the model has unknowns, what your
implementation returned), it computes the outputs an implementation with that cause would return. The diagnoses
(:mod:`pynorm.oracle.diagnose`) name a model where its outputs reproduce yours on failing cells, per dtype.

Three kinds of model:

* **Convention models** -- pynorm's reference with one convention changed: ``eps_mode="std"``, ``correction=1``,
  eps rounded to float32, a fixed eps of the implementation's own, each ``casting`` policy. Deterministic: an
  implementation with that convention is within budget of it.
* **Restatements** -- a few lines computing a classic mistake exactly: ``dx`` without its mean or variance term,
  16-bit saved statistics in the backward, only the last axis normalized, a strided buffer read in C order, the
  sum of squares in the working precision without scaling (it overflows near the dtype's max, underflows at tiny
  magnitudes), float64 input computed in float32.
* **Statistics models** (LayerNorm) -- the row statistics computed a given way in a precision ``p``: the mean with
  the error of a ``p`` sum (``mean_in_precision``), the variance as ``E[x^2] - E[x]^2`` (``one_pass``),
  ``x̂ = x r - mean r`` (``xr_minus_mean_r``). The order of a sum is not knowable from outside, so these models
  have bounded unknowns: the mean and the variance an implementation of the model can produce lie within the
  worst-case rounding-error bounds of its formula in ``p`` (``γ_n = n u / (1 - n u)``: a sum of ``n`` terms in
  any order). The model reads your row's own statistics back from your output (a least-squares fit of
  ``(y - b) / w`` against ``x``), keeps them where the bounds allow, and computes the output from them; where
  the statistics are out of its bounds it computes with the nearest admissible ones and does not match.

A model names its *baseline*, the model it refines (``one_pass`` refines ``mean_in_precision``, which refines a
correct algorithm in ``p``): a model explains a cell only where its baseline does not, so that a correct-but-
different algorithm is not given the name of a bug whose bounds happen to contain it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._measure import ulp, ulp_error
from ..errors import PynormError
from ..ops import OpSpec
from ..reference.casting import CASTINGS
from ._dtypes import dtype_name, dtype_of, round_to, unit_roundoff, working_precision
from .channel_models import channel_models
from .evaluate import Evaluated, run_reference
from .grid import Case
from .model_types import Emulation, Emulator, Model

__all__ = ["CASTING_DOC", "Emulation", "Model", "models_for", "reference_with"]

#: what each ``casting`` policy of layer_norm / rms_norm reproduces (``pynorm.reference.casting``)
CASTING_DOC = {
    "fp32": "all math in float32 or wider, one rounding (PyTorch, TransformerEngine, flash-attention)",
    "gemma": "HF GemmaRMSNorm: (1 + w) and everything else in float32, one rounding",
    "llama": "HF LlamaRMSNorm / Liger casting_mode='llama': the normalized value rounded to the input dtype before "
    "the weight multiply",
    "t5": "HF T5LayerNorm: the normalized value cast to the weight's dtype, then multiplied",
    "apex": "NVIDIA Apex: the normalized value rounded to the output dtype, then gamma * . + beta (two roundings)",
    "none": "every operation in the input dtype (Liger casting_mode='none', a model run without upcasts)",
}

_WIDE = np.longdouble


# ---------------------------------------------------------------------------
# helpers


def _named(spec: OpSpec, case: Case) -> dict[str, Any]:
    return dict(zip((*spec.input_names, *spec.param_names), case.args, strict=True))


def _rows(a: np.ndarray, case: Case) -> np.ndarray:
    x = np.ascontiguousarray(a)
    ax = case.axis % x.ndim
    return x.reshape(int(np.prod(x.shape[:ax])), -1)


def _reference_with(spec: OpSpec, ev: Evaluated, case: Case | None = None, **change: Any) -> Emulation | None:
    """The reference on ``case`` (default the cell's) with the cell's conventions and ``change``. Where the change
    asks for an unbiased variance of a single value (``correction=1`` at H = 1, which the reference rejects), an
    implementation divides 0 by 0: every output but ``dbias`` is NaN."""
    base = ev.case if case is None else case
    try:
        options = spec.validate({**ev.call, **change}, ev.result.cell.hidden)  # channels: hidden is C
        run = run_reference(spec, dataclasses.replace(base, options=options))
    except PynormError:
        if spec.layout == "channels" or int(change.get("correction", 0)) < ev.result.cell.hidden:
            return None
        plain = _reference_with(spec, ev, case, **{k: v for k, v in change.items() if k != "correction"})
        if plain is None:
            return None
        plain.outputs = {k: v if k == "dbias" else np.full_like(v, np.nan) for k, v in plain.outputs.items()}
        return plain
    out = {**run.outputs, **run.grads}
    return Emulation({k: np.asarray(v).astype(np.float64) for k, v in out.items()})


def reference_with(spec: OpSpec, ev: Evaluated, change: dict[str, Any]) -> Emulation | None:
    """The reference on cell ``ev`` with its conventions and the options ``change`` (None where ``change`` is
    empty: that is the reference itself, or where the reference rejects the options)."""
    return _reference_with(spec, ev, **change) if change else None


def _lattice(center: np.ndarray, k: int) -> np.ndarray:
    """``center`` (an array of ``p`` values) and its ``k`` neighbours on each side in ``p``: shape (..., 2k+1)."""
    lo = [center]
    hi = [center]
    for _ in range(k):
        lo.append(np.nextafter(lo[-1], center.dtype.type(-np.inf)))
        hi.append(np.nextafter(hi[-1], center.dtype.type(np.inf)))
    return np.stack([*reversed(lo[1:]), center, *hi[1:]], axis=-1)


def _fused(x: np.ndarray, r: np.ndarray, c: np.ndarray, p: np.dtype[Any]) -> np.ndarray:
    """``round_p(x * r - c)`` with one rounding (a fused multiply-add) for ``p`` values ``x``, ``r``, ``c``
    (broadcasting): exact in float64 for float32; for float64 by Dekker's exact product ``x r = hi + lo``."""
    if p.itemsize < 8:
        return (x.astype(np.float64) * r.astype(np.float64) - c.astype(np.float64)).astype(p)
    x, r, c = (np.asarray(a, np.float64) for a in (x, r, c))
    split = 134217729.0  # 2^27 + 1 (Veltkamp)
    with np.errstate(all="ignore"):
        hi = x * r
        xa = split * x
        xh = xa - (xa - x)
        xl = x - xh
        ra = split * r
        rh = ra - (ra - r)
        rl = r - rh
        lo = ((xh * rh - hi) + xh * rl + xl * rh) + xl * rl
        return np.asarray((hi - c) + lo, np.float64)


def _nearest_first(lat: np.ndarray) -> np.ndarray:
    """The values of a ``_lattice`` row, the centre first, then its neighbours by distance (ties go to the centre)."""
    k = (lat.shape[-1] - 1) // 2
    order = [k] + [j for d in range(1, k + 1) for j in (k - d, k + d)]
    return lat[..., order]


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _measure_dtype(p: np.dtype[Any], out_dtype: Any) -> np.dtype[Any]:
    return p if p.itemsize < dtype_of(out_dtype).itemsize else dtype_of(out_dtype)


# ---------------------------------------------------------------------------
# convention models


def _convention_model(options: Callable[[Evaluated], dict[str, Any]]) -> Emulator:
    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        return reference_with(spec, ev, options(ev))

    return emulate


def _set(**change: Any) -> Callable[[Evaluated], dict[str, Any]]:
    """The options of a convention model that sets ``change`` (nothing where the cell has it already)."""

    def options(ev: Evaluated) -> dict[str, Any]:
        return {} if all(ev.call.get(k) == v for k, v in change.items()) else dict(change)

    return options


def _eps_model(value: float) -> Emulator:
    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        eps = ev.call.get("eps")
        if eps is None or float(eps) == value:
            return None
        return _reference_with(spec, ev, eps=value)

    return emulate


def _eps_float32(ev: Evaluated) -> dict[str, Any]:
    eps = ev.call.get("eps")
    if eps is None or float(np.float32(eps)) == float(eps):
        return {}
    return {"eps": float(np.float32(eps))}


def _casting(policy: str) -> Callable[[Evaluated], dict[str, Any]]:
    def options(ev: Evaluated) -> dict[str, Any]:
        if ev.call.get("casting") == policy or ev.dtype not in ("float16", "bfloat16"):
            return {}  # the policies differ in where 16-bit values are rounded
        return {"casting": policy}

    return options


# ---------------------------------------------------------------------------
# restatements


def _float32_math(spec: OpSpec, ev: Evaluated) -> Emulation | None:
    """float64 input computed by a correct algorithm in float32: the reference on the float32-rounded arrays."""
    if ev.dtype != "float64":
        return None
    f32 = np.dtype(np.float32)

    def r32(a: Any) -> Any:
        if a is None or not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            return a
        return a.astype(f32)

    case = dataclasses.replace(ev.case, x=r32(np.ascontiguousarray(ev.case.x)), args=[r32(a) for a in ev.case.args])
    case = dataclasses.replace(case, dy=r32(ev.case.dy))
    emu = _reference_with(spec, ev, case)
    if emu is None:
        return None
    emu.measure = {k: f32 for k in emu.outputs if k in ev.dtypes and dtype_of(ev.dtypes[k]).kind == "f"}
    emu.precision = "float32"
    return emu


def _c_order(spec: OpSpec, ev: Evaluated) -> Emulation | None:
    """A strided ``x`` read as if it were C-contiguous: the first ``x.size`` elements of its buffer."""
    x = ev.case.x
    if x.flags.c_contiguous:
        return None
    strides, acc = [], x.itemsize
    for n in reversed(x.shape):
        strides.append(acc)
        acc *= n
    read = np.lib.stride_tricks.as_strided(x, x.shape, tuple(reversed(strides)), writeable=False).copy()
    return _reference_with(spec, ev, dataclasses.replace(ev.case, x=read))


@dataclass
class _Rows:
    """A LayerNorm / RMSNorm cell as ``(R, H)`` rows in a precision: ``x``, ``dy``, the effective weight, the bias."""

    x: np.ndarray
    dy: np.ndarray
    we: np.ndarray
    b: np.ndarray | None
    eps: float
    n: int
    std: bool


def _norm_rows(spec: OpSpec, ev: Evaluated, p: np.dtype[Any] | None, wide: Any = _WIDE) -> _Rows:
    """The cell's arrays as rows, rounded to ``p`` first (None: as given), in ``wide`` arithmetic."""

    def cast(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        if p is not None and a.dtype.kind == "f" and a.dtype.itemsize > p.itemsize:
            a = a.astype(p)
        return a.astype(wide)

    case = ev.case
    x = cast(_rows(case.x, case))
    h = x.shape[1]
    named = _named(spec, case)
    w, b = named.get("weight"), named.get("bias")
    offset = float(ev.call.get("weight_offset", 0.0))
    we = (np.ones(h, wide) if w is None else cast(np.asarray(w).reshape(-1))) + wide(offset)
    bias = None if b is None else cast(np.asarray(b).reshape(-1))
    eps = float(ev.call.get("eps", 0.0))
    if p is not None and p.itemsize < 8:
        eps = float(np.float32(eps))
    n = h - int(ev.call.get("correction", 0))
    return _Rows(x, cast(_rows(case.dy, case)), we, bias, eps, n, ev.call.get("eps_mode", "var") == "std")


def _centre(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The corrected two-pass mean of each row and the re-centred deviations (working in ``x``'s dtype)."""
    m = x.mean(axis=1, keepdims=True)
    m = m + (x - m).mean(axis=1, keepdims=True)
    d = x - m
    return m, d - d.mean(axis=1, keepdims=True)


def _rstd(var: Any, eps: float, std: bool) -> Any:
    with np.errstate(all="ignore"):
        return 1 / (np.sqrt(var) + eps) if std else 1 / np.sqrt(var + eps)


def _dx_model(which: str) -> Emulator:
    """``dx`` of layer_norm / rms_norm with one term dropped, in extended precision, rounded once."""

    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        if "dx" not in ev.user:
            return None
        rows = _norm_rows(spec, ev, None)
        x = rows.x
        g = rows.dy * rows.we
        with np.errstate(all="ignore"):
            if spec.name == "rms_norm":
                if which != "var":
                    return None
                r = _rstd((x * x).mean(axis=1, keepdims=True), rows.eps, False)
                dx = r * g
            else:
                _, d = _centre(x)
                s = np.sqrt((d * d).sum(axis=1, keepdims=True) / rows.n)
                r = _rstd(s * s, rows.eps, rows.std)
                k = np.where(s > 0, 1 / (s * r), 0.0) if rows.std else 1.0
                xh = d * r
                var_term = xh * k * (g * xh).sum(axis=1, keepdims=True) / rows.n
                mean_term = g.mean(axis=1, keepdims=True)
                dx = r * (g - mean_term) if which == "var" else r * (g - var_term)
        out = round_to(dx.astype(np.float64), ev.dtypes["dx"]).astype(np.float64)
        return Emulation({"dx": out.reshape(ev.ref["dx"].shape)})

    return emulate


def _saved_stats_16bit(spec: OpSpec, ev: Evaluated) -> Emulation | None:
    """The backward computed from ``mean`` and ``rstd`` stored in the input's 16-bit dtype."""
    if ev.dtype not in ("float16", "bfloat16") or "dx" not in ev.user or ev.call.get("casting", "fp32") != "fp32":
        return None
    rows = _norm_rows(spec, ev, None, np.float64)
    x = rows.x
    half = dtype_of(ev.dtype)

    def q(a: np.ndarray) -> np.ndarray:
        return round_to(a, half).astype(np.float64)

    g = rows.dy * rows.we
    with np.errstate(all="ignore"):
        if spec.name == "layer_norm":
            if rows.std:
                return None
            m, d = _centre(x)
            r = q(_rstd((d * d).sum(axis=1, keepdims=True) / rows.n, rows.eps, False))
            xh = (x - q(m)) * r
            dx = r * (g - g.mean(axis=1, keepdims=True) - xh * (g * xh).sum(axis=1, keepdims=True) / rows.n)
        else:
            r = q(_rstd((x * x).mean(axis=1, keepdims=True), rows.eps, False))
            xh = x * r
            dx = r * (g - xh * (g * xh).mean(axis=1, keepdims=True))
    out = {"dx": round_to(dx, ev.dtypes["dx"]).astype(np.float64).reshape(ev.ref["dx"].shape)}
    if "dweight" in ev.ref:
        dw = (rows.dy * xh).sum(axis=0)
        out["dweight"] = round_to(dw, ev.dtypes["dweight"]).astype(np.float64).reshape(ev.ref["dweight"].shape)
    return Emulation(out)


def _backward_stats(p: np.dtype[Any]) -> Emulator:
    """The backward from statistics held in ``p``: ``mean`` and ``rstd`` within an ulp or two of the exact ones
    in ``p`` (the closest per row counts), then the formula in extended precision."""

    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        if "dx" not in ev.user or ev.call.get("casting", "fp32") != "fp32" or ev.call.get("eps_mode") == "std":
            return None
        if p.itemsize > working_precision(ev.dtype).itemsize:
            return None
        rows = _norm_rows(spec, ev, None)
        x, we, n = rows.x, rows.we, rows.n
        ln = spec.name == "layer_norm"
        R, H = x.shape
        with np.errstate(all="ignore"):
            if ln:
                m_ex, d = _centre(x)
                r_ex = _rstd((d * d).sum(axis=1, keepdims=True) / n, rows.eps, False)
            else:
                m_ex = np.zeros((R, 1), _WIDE)
                r_ex = _rstd((x * x).mean(axis=1, keepdims=True), rows.eps, False)
        ms = _lattice(m_ex[:, 0].astype(p), 2 if ln else 0).astype(_WIDE)  # (R, K)
        rs = _lattice(r_ex[:, 0].astype(p), 1).astype(_WIDE)
        g = rows.dy * we
        meas = _measure_dtype(p, ev.dtypes["dx"])
        ud = _rows(ev.user["dx"], ev.case).astype(np.float64)
        sc = ev.scales.get("dx")
        sc = None if sc is None or np.size(sc) != x.size else np.asarray(sc, np.float64).reshape(R, H)
        best_dx = np.full((R, H), np.nan)
        best_xh = np.zeros((R, H), _WIDE)
        for i in range(R):
            best = np.inf
            for m in ms[i]:
                for r in rs[i]:
                    with np.errstate(all="ignore"):
                        xh = (x[i] - m) * r
                        c = (g[i] * xh).sum() / (n if ln else H)
                        dx = r * (g[i] - (g[i].mean() if ln else 0) - xh * c)
                    q = round_to(np.asarray(dx, np.float64), meas).astype(np.float64)
                    e = float(ulp_error(ud[i], q, meas, scale=None if sc is None else sc[i]).max())
                    if e < best:
                        best, best_dx[i], best_xh[i] = e, q, xh
        out = {"dx": best_dx.reshape(ev.ref["dx"].shape)}
        if "dweight" in ev.ref:
            dw = np.asarray((rows.dy * best_xh).sum(axis=0), np.float64)
            out["dweight"] = round_to(dw, _measure_dtype(p, ev.dtypes["dweight"])).astype(np.float64)
            out["dweight"] = out["dweight"].reshape(ev.ref["dweight"].shape)
        narrower = p.itemsize < dtype_of(ev.dtypes["dx"]).itemsize
        measure = {k: _measure_dtype(p, ev.dtypes[k]) for k in out}
        return Emulation(out, measure, precision=dtype_name(p) if narrower else None)

    return emulate


def _last_axis(spec: OpSpec, ev: Evaluated) -> Emulation | None:
    """Only the last axis normalized (whatever the weight's shape says), then the full affine."""
    cell = ev.result.cell
    if len(cell.norm_shape) < 2:
        return None
    x = np.ascontiguousarray(ev.case.x).astype(_WIDE)
    last = x.reshape(-1, x.shape[-1])
    named = _named(spec, ev.case)
    w, b = named.get("weight"), named.get("bias")
    eps = float(ev.call.get("eps", 0.0))
    with np.errstate(all="ignore"):
        if spec.name == "layer_norm":
            _, d = _centre(last)
            n = last.shape[1] - int(ev.call.get("correction", 0))
            xh = d * _rstd((d * d).sum(axis=1, keepdims=True) / n, eps, ev.call.get("eps_mode", "var") == "std")
        else:
            xh = last * _rstd((last * last).mean(axis=1, keepdims=True), eps, False)
        y = xh.reshape(x.shape)
        offset = float(ev.call.get("weight_offset", 0.0))
        if w is not None:
            y = y * (np.asarray(w).astype(_WIDE) + _WIDE(offset))
        if b is not None:
            y = y + np.asarray(b).astype(_WIDE)
    return Emulation({"y": round_to(y.astype(np.float64), ev.dtypes["y"]).astype(np.float64)})


def _unscaled_squares(which: str) -> Emulator:
    """The statistics in the working precision without scaling the row first: the squares (and sums) overflow
    near the dtype's max, underflow at tiny magnitudes. Variants: the mean by NumPy's pairwise sum, by a
    sequential sum, or exact and rounded once."""

    def emulate(spec: OpSpec, ev: Evaluated) -> list[Emulation] | None:
        out: list[Emulation] = []
        for p in (working_precision(ev.dtype), *((np.dtype(np.float32),) if ev.dtype == "float64" else ())):
            out.extend(_unscaled_in(spec, ev, which, p))
        return out or None

    return emulate


def _unscaled_in(spec: OpSpec, ev: Evaluated, which: str, p: np.dtype[Any]) -> list[Emulation]:
    rows = _norm_rows(spec, ev, p, np.float64)
    xp = rows.x.astype(p)
    narrower = p.itemsize < dtype_of(ev.dtypes["y"]).itemsize
    out: list[Emulation] = []
    ln = spec.name == "layer_norm"
    with np.errstate(all="ignore"):
        if ln:
            _, d_ex = _centre(rows.x.astype(_WIDE))
            exact_sq = (d_ex * d_ex).sum(axis=1, keepdims=True)
            means = [
                xp.mean(axis=1, keepdims=True, dtype=p),
                (np.cumsum(xp, axis=1, dtype=p)[:, -1:] / p.type(xp.shape[1])).astype(p),
                rows.x.astype(_WIDE).mean(axis=1, keepdims=True).astype(p),
            ]
        else:
            exact_sq = (rows.x.astype(_WIDE) ** 2).sum(axis=1, keepdims=True)
            means = [np.zeros((xp.shape[0], 1), p)]
        # two passes (the squares of x - mean), and for LayerNorm one pass too (E[x^2] - E[x]^2: inf - inf is NaN)
        forms = [(m, False) for m in means] + ([(means[0], True)] if ln else [])
        for m, one_pass in forms:
            d = (xp - m).astype(p)
            sq = ((xp * xp) if one_pass else (d * d)).astype(p)
            ssum = sq.sum(axis=1, keepdims=True, dtype=p)
            var = (ssum / p.type(rows.n if ln else xp.shape[1])).astype(p)
            if one_pass:
                var = (var - (m * m).astype(p)).astype(p)
            overflow = bool(np.any(~np.isfinite(ssum)) or np.any(~np.isfinite(m)))
            lost = ssum.astype(_WIDE) < 0.5 * exact_sq
            underflow = bool(np.any(lost & (exact_sq > 0) & np.isfinite(ssum)))
            if (which == "overflow" and not overflow) or (which == "underflow" and not underflow):
                continue
            r = _rstd(var.astype(np.float64), rows.eps, rows.std).astype(p)
            y = d.astype(np.float64) * r.astype(np.float64) * rows.we.astype(np.float64)
            if rows.b is not None:
                y = y + rows.b.astype(np.float64)
            meas = p if narrower else dtype_of(ev.dtypes["y"])
            y = round_to(y, meas).astype(np.float64).reshape(ev.ref["y"].shape)
            evidence = {"in_float32": 1.0} if narrower else {}
            out.append(Emulation({"y": y}, {"y": meas}, evidence, precision=dtype_name(p) if narrower else None))
    return out


# ---------------------------------------------------------------------------
# statistics models (LayerNorm)


def _fit_rows(z: np.ndarray, d: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the least-squares ``r`` and shift ``delta`` of ``z = r (d - delta)`` over ``mask``; NaN where a row
    has fewer than two usable elements or no spread."""
    cnt = mask.sum(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        zm = np.where(mask, z, 0).sum(axis=1, keepdims=True) / cnt
        dm = np.where(mask, d, 0).sum(axis=1, keepdims=True) / cnt
        dc = np.where(mask, d - dm, 0)
        sdd = (dc * dc).sum(axis=1, keepdims=True)
        a = (dc * np.where(mask, z - zm, 0)).sum(axis=1, keepdims=True) / sdd
        c0 = zm - a * dm
        delta = -c0 / a
    bad = (cnt < 2) | ~(sdd > 0) | ~np.isfinite(a) | ~np.isfinite(delta) | (a == 0)
    return np.where(bad, np.nan, a), np.where(bad, np.nan, delta)


def _stats_model(kind: str, p: np.dtype[Any]) -> Emulator:
    """A LayerNorm computing its statistics the ``kind`` way in precision ``p`` (module docstring)."""

    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        if spec.name != "layer_norm" or "y" not in ev.user or ev.call.get("casting", "fp32") != "fp32":
            return None
        if p.itemsize > working_precision(ev.dtype).itemsize or (kind == "xr" and ev.result.cell.hidden > 4096):
            return None
        return _fit_stats(spec, ev, kind, p)

    return emulate


def _in_precision(
    code: str, p: np.dtype[Any], kind: str, says: str, fix: str, baseline: str, evidence: Any = None
) -> Model:
    """The model ``code/<p>`` of a LayerNorm computing its statistics the ``kind`` way in ``p``
    (:func:`_stats_model`), compared with the model ``baseline/<p>``."""
    pn = dtype_name(p)
    return Model(
        f"{code}/{pn}",
        code,
        says,
        fix,
        _stats_model(kind, p),
        baseline=f"{baseline}/{pn}",
        evidence=evidence,
        fitted=True,
    )


def _fit_stats(spec: OpSpec, ev: Evaluated, kind: str, p: np.dtype[Any]) -> Emulation | None:
    out_dt = dtype_of(ev.dtypes["y"])
    meas = _measure_dtype(p, out_dt)
    wide: Any = _WIDE if meas.itemsize >= 8 else np.float64
    rows = _norm_rows(spec, ev, p, wide)
    x, we, b, eps, n, std = rows.x, rows.we, rows.b, rows.eps, rows.n, rows.std
    if std and kind == "one_pass":
        return None
    R, H = x.shape
    u = unit_roundoff(p)
    m_ex, d = _centre(x)
    sdd = (d * d).sum(axis=1, keepdims=True)
    yu = _rows(ev.user["y"], ev.case).astype(wide)
    scale = ev.scales.get("y")
    sc = None
    if scale is not None and np.size(scale) == x.size:
        sc = np.asarray(scale, np.float64).reshape(R, H)
    bb = 0 if b is None else b
    with np.errstate(all="ignore"):
        z = (yu - bb) / we
    wmax = float(np.max(np.abs(we))) if we.size else 0.0
    mask = np.isfinite(z) & (np.abs(we) > 1e-3 * wmax)
    r_fit, delta = _fit_rows(z, d, mask)
    bsum = _gamma(H, u) * np.abs(x).mean(axis=1, keepdims=True) + u * np.abs(m_ex)
    # a stable variance (two passes, Welford, Chan) at the mean m: off by at most the two-pass bound plus what a
    # perturbation of x by gamma_H (any summation order) moves it
    g_h, g_v = _gamma(H, u), _gamma(H + 3, u)
    ax_mean = np.abs(x)

    def var_tol(i: int, m: Any, var_m: Any) -> Any:
        return g_v * var_m + 2 * g_h * float(np.mean(np.abs(x[i] - m) * ax_mean[i]))

    e2 = (x * x).mean(axis=1, keepdims=True)
    var_ex = sdd / n

    best_y = np.full((R, H), np.nan)
    best_m = np.full(R, np.nan)
    best_r = np.full(R, np.nan)
    best_xh = np.full((R, H), np.nan, dtype=wide)
    best_var = np.full(R, np.nan)
    best_dist = np.full(R, np.inf)
    distinct_rows = np.zeros(R, dtype=bool)
    for i in range(R):
        xi = x[i]
        fitted = bool(np.isfinite(r_fit[i, 0]))
        mc = float(m_ex[i, 0] + (np.clip(delta[i, 0], -bsum[i, 0], bsum[i, 0]) if fitted else 0.0))
        if kind == "correct":  # exact centring: the reference's structure, with the statistics' roundings in p
            ms = np.asarray([m_ex[i, 0]], dtype=wide)
        elif kind == "xr":
            ms = _nearest_first(_lattice(np.asarray([mc]).astype(p), 2)[0])
        else:
            ms = _nearest_first(_lattice(np.asarray([mc]).astype(p), 1 if fitted else 16 if kind == "mean" else 8)[0])
            ms = ms[np.abs(ms.astype(wide) - m_ex[i, 0]) <= bsum[i, 0]]
            if not ms.size:
                ms = np.asarray([m_ex[i, 0]]).astype(p)
        cand_m: list[float] = []
        cand_r: list[float] = []
        cand_v: list[float] = []
        cand_tv: list[bool] = []  # one_pass: the variance is out of a stable algorithm's reach
        cand_fma: list[bool] = []  # xr: the fused form
        for m in ms.astype(wide):
            dm = m - m_ex[i, 0]
            var_m = (sdd[i, 0] + H * dm * dm) / n
            r_m = _rstd(var_m, eps, std)
            tv = var_tol(i, m, var_m)
            if kind in ("correct", "mean"):
                r = r_fit[i, 0] if fitted else r_m
                r_lo, r_hi = _rstd(var_m + tv, eps, std), _rstd(max(var_m - tv, 0), eps, std)
                r = float(np.clip(r, r_lo, r_hi)) if np.isfinite(r) else float(r_m)
                cand_m.append(float(m))
                cand_r.append(r)
                cand_v.append(float(var_m))
            elif kind == "xr":
                for r in _nearest_first(_lattice(np.asarray([r_m]).astype(p), 8)[0]):
                    for form in (False, True):  # fl(x r) - fl(m r); or fused: fl(x r - fl(m r)) (PyTorch's CPU kernel)
                        cand_m.append(float(m))
                        cand_r.append(float(r))
                        cand_v.append(float(var_m))
                        cand_fma.append(form)
            else:  # one_pass: var = fl(fl(S2 / H) - fl(m^2)), S2 a p sum of the squares in any order
                g1 = _gamma(H + 1, u)
                lo = e2[i, 0] * (1 - g1) - m * m * (1 + u) - u * abs(e2[i, 0])
                hi = e2[i, 0] * (1 + g1) - m * m * (1 - u) + u * abs(e2[i, 0])
                if fitted:
                    with np.errstate(all="ignore"):
                        v_fit = 1 / (r_fit[i, 0] * r_fit[i, 0]) - eps
                    vs = [float(np.clip(v_fit, lo, hi))]
                else:
                    a2 = np.asarray([e2[i, 0]]).astype(p).astype(wide)
                    vs = [
                        float((a2 * (1 + j * 2 * u)).astype(p).astype(wide)[0] - wide(m * m).astype(p))
                        for j in range(-3, 4)
                    ]
                    vs = [v for v in vs if lo <= v <= hi]
                for v in vs:
                    variants = [v] if v >= 0 else [0.0, v]  # negative: clipped at 0 (Flax), or left (NaN)
                    for vv in variants:
                        cand_m.append(float(m))
                        cand_r.append(float(_rstd(wide(vv), eps, False)))
                        cand_v.append(vv)
                        cand_tv.append(abs(vv - float(var_m)) > tv)
        if not cand_m:
            continue
        M = np.asarray(cand_m, dtype=wide)[:, None]
        Rr = np.asarray(cand_r, dtype=wide)[:, None]
        with np.errstate(all="ignore"):
            if kind == "xr":
                xp = xi.astype(p)
                mr = (M.astype(p) * Rr.astype(p)).astype(p)
                sub = ((xp[None, :] * Rr.astype(p)).astype(p) - mr).astype(p)
                fused = _fused(xp[None, :], Rr.astype(p), mr, p)
                xh = np.where(np.asarray(cand_fma)[:, None], fused, sub).astype(wide)
            else:
                xh = (xi[None, :] - M) * Rr
            y = xh * we + bb
        yq = round_to(y, meas).astype(np.float64)
        if kind == "xr":  # the product roundings must matter: without them (exact (x - m) r) the row differs
            with np.errstate(all="ignore"):
                plain = round_to((xi[None, :] - M) * Rr * we + bb, meas).astype(np.float64)
            effect = ulp_error(yq, plain, meas, scale=None if sc is None else sc[i]).max(axis=1)
            budget = float(ev.result.outputs["y"].budget) if "y" in ev.result.outputs else 0.0
        err = ulp_error(
            np.broadcast_to(yu[i].astype(np.float64), yq.shape), yq, meas, scale=None if sc is None else sc[i]
        )
        worst = err.max(axis=1)
        k = int(np.argmin(worst))
        if kind == "one_pass":
            distinct_rows[i] = cand_tv[k]
        elif kind == "xr":
            distinct_rows[i] = bool(effect[k] > budget)
        best_dist[i] = worst[k]
        best_y[i] = yq[k]
        best_m[i] = cand_m[k]
        best_r[i] = cand_r[k]
        best_var[i] = cand_v[k]
        best_xh[i] = xh[k]
    if not np.isfinite(best_dist).any():
        return None

    outputs = {"y": best_y.reshape(ev.ref["y"].shape)}
    if "dx" in ev.user and not std:
        g = rows.dy * we
        r = best_r.astype(wide)[:, None]
        with np.errstate(all="ignore"):
            xh = best_xh
            dx = r * (g - g.mean(axis=1, keepdims=True) - xh * (g * xh).sum(axis=1, keepdims=True) / n)
        outputs["dx"] = round_to(np.asarray(dx, np.float64), _measure_dtype(p, ev.dtypes["dx"])).astype(np.float64)
        outputs["dx"] = outputs["dx"].reshape(ev.ref["dx"].shape)
        if "dweight" in ev.user:
            dwt = _measure_dtype(p, ev.dtypes["dweight"])
            dsc = ev.scales.get("dweight")
            dsc = None if dsc is None or np.size(dsc) != H else np.asarray(dsc, np.float64).reshape(-1)

            def dweight_of(xh: Any) -> np.ndarray:
                return round_to(np.asarray((rows.dy * xh).sum(axis=0), np.float64), dwt).astype(np.float64)

            dw = dweight_of(best_xh)
            if kind == "xr":  # the backward is code of its own: either form, whichever the forward used
                mb, rb = best_m.astype(wide)[:, None], best_r.astype(wide)[:, None]
                with np.errstate(all="ignore"):
                    mr = (mb.astype(p) * rb.astype(p)).astype(p)
                    forms = [
                        ((x.astype(p) * rb.astype(p)).astype(p) - mr).astype(p).astype(wide),
                        _fused(x.astype(p), rb.astype(p), mr, p).astype(wide),
                    ]
                ud = ev.user["dweight"].reshape(-1)
                dw = min((dweight_of(f) for f in forms), key=lambda a: float(ulp_error(ud, a, dwt, scale=dsc).max()))
                if not distinct_rows.any() and "dweight" in ev.result.outputs:
                    # the products' roundings may show in dweight alone (constant rows: the exact x̂ is 0)
                    with np.errstate(all="ignore"):
                        dwp = dweight_of((x - mb) * rb)
                    eff = float(ulp_error(dw, dwp, dwt, scale=dsc).max())
                    distinct_rows[:] = eff > ev.result.outputs["dweight"].budget
            outputs["dweight"] = dw.reshape(ev.ref["dweight"].shape)
    if kind in ("one_pass", "xr") and not distinct_rows.any():
        return None  # no row needs this model's own error: its baseline is the explanation
    ulp_m = ulp(m_ex[:, 0].astype(np.float64), p)
    off_m = np.abs(best_m - m_ex[:, 0].astype(np.float64))
    known = np.isfinite(off_m)
    evidence = {
        "mean_off_ulps": float(np.max(off_m[known] / ulp_m[known])) if known.any() else np.nan,
        "mean_off": float(np.max(off_m[known])) if known.any() else np.nan,
        "mean_bound": float(np.max(bsum)),
    }
    if kind == "one_pass":
        off = np.abs(best_var - var_ex[:, 0].astype(np.float64))
        j = int(np.nanargmax(off)) if np.isfinite(off).any() else 0
        evidence.update(
            var_off=float(off[j]),
            var_exact=float(var_ex[j, 0]),
            var_bound=float(_gamma(H + 1, u) * 2 * np.max(e2)),
            two_pass_bound=float(_gamma(H + 3, u) * np.max(var_ex)),
        )
    measure = {k: _measure_dtype(p, ev.dtypes[k]) for k in outputs}
    narrower = p.itemsize < out_dt.itemsize
    return Emulation(outputs, measure, evidence, dtype_name(p) if narrower else None)


# ---------------------------------------------------------------------------
# the list


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _mean_evidence(e: dict[str, float]) -> str:
    return (
        f"its mean is off by up to {e['mean_off_ulps']:.0f} ulps ({_fmt(e['mean_off'])}) there, within the "
        f"{_fmt(e['mean_bound'])} a sum in that precision can be off by"
    )


def _one_pass_evidence(e: dict[str, float]) -> str:
    return (
        f"its variance is off by up to {_fmt(e['var_off'])} (exact {_fmt(e['var_exact'])}), within the "
        f"±{_fmt(e['var_bound'])} E[x^2] - E[x]^2 can be off by; a two-pass variance is off by at most "
        f"{_fmt(e['two_pass_bound'])}"
    )


def _unscaled_evidence(e: dict[str, float]) -> str:
    return "in float32, to which the float64 input is rounded" if e.get("in_float32") else "in the working precision"


def _eps_candidates(spec: OpSpec) -> list[tuple[float, str]]:
    default = spec.defaults().get("eps")
    out: list[tuple[float, str]] = []
    for v, why in (
        (default, "pynorm's default"),
        (1e-5, "PyTorch's, ONNX's and Apex's default"),
        (1e-6, "the default of HF, Liger, Flax and flash-attention"),
        (float(np.finfo(np.float32).eps), "the float32 machine epsilon, PyTorch's F.rms_norm with eps=None"),
        (float(np.finfo(np.float64).eps), "the float64 machine epsilon"),
        (float(np.finfo(np.float16).eps), "the float16 machine epsilon"),
    ):
        if v is not None and all(v != o for o, _ in out):
            out.append((float(v), why))
    return out


def models_for(spec: OpSpec, conventions: dict[str, Any]) -> list[Model]:
    """The models that apply to ``spec`` when the user's functions receive ``conventions`` (validated, every
    option), in order of preference (the earlier of two models explaining the same cells is named)."""
    names = {o.name for o in spec.options}
    out: list[Model] = []
    if spec.layout == "channels":
        out.extend(channel_models(spec, conventions))
    ln, rms = spec.name == "layer_norm", spec.name == "rms_norm"
    if "eps_mode" in names and conventions.get("eps_mode", "var") != "std":
        out.append(
            Model(
                "eps_on_std",
                "eps_on_std",
                "eps is added to the std, not the variance: (x - mean) / (std + eps)",
                "add it inside the root, sqrt(var + eps), as PyTorch, ONNX, Apex and TransformerEngine do",
                _convention_model(_set(eps_mode="std")),
                options=_set(eps_mode="std"),
                axis="eps_mode",
                short="eps on the std",
            )
        )
    if "correction" in names and conventions.get("correction", 0) != 1:
        out.append(
            Model(
                "unbiased_variance",
                "unbiased_variance",
                "the variance is the unbiased estimator, divided by H - 1 (torch.Tensor.var/std's default)",
                "LayerNorm divides by H (biased)",
                _convention_model(_set(correction=1)),
                options=_set(correction=1),
                axis="correction",
                short="unbiased variance",
            )
        )
    if "eps" in names:
        eps = float(conventions.get("eps", spec.defaults()["eps"]))
        e32 = float(np.float32(eps))
        out.append(
            Model(
                "eps_float32",
                "eps_float32",
                f"eps is rounded to float32 before it is used (an ONNX FLOAT attribute, a float32 scalar): "
                f"{e32!r} instead of {eps!r}",
                "keep eps in the input's precision",
                _convention_model(_eps_float32),
                options=_eps_float32,
                axis="eps",
                short="eps rounded to float32",
            )
        )
        for value, why in _eps_candidates(spec):
            out.append(
                Model(
                    f"eps_ignored/{value!r}",
                    "eps_ignored",
                    f"the implementation uses eps = {value!r} ({why}) whatever eps it is given",
                    "use the eps argument it receives (the grid varies it: the op's default and 0)",
                    _eps_model(value),
                )
            )
    if ln or rms:
        for p in (np.dtype(np.float64), np.dtype(np.float32)):
            pn = dtype_name(p)
            out.append(
                Model(
                    f"backward_stats/{pn}",
                    "backward_stats_rounded",
                    f"the backward computes from mean and rstd rounded to {pn}: on rows with a large common offset "
                    f"the rounding of the mean shifts every x - mean by up to half an ulp of the mean",
                    "centre x exactly in the backward (recompute x - mean with the corrected two-pass mean, or keep "
                    "the forward's centred values' statistics in a wider type)",
                    _backward_stats(p),
                    fitted=True,
                )
            )
        for which, says in (
            ("overflow", "the sum of squares overflows near the dtype's max (the row is not scaled first)"),
            ("underflow", "the squares underflow at tiny magnitudes (the row is not scaled first)"),
        ):
            out.append(
                Model(
                    which,
                    which,
                    says,
                    "scale the row (e.g. by a power of two near max|x|) before squaring, or accumulate in a wider type",
                    _unscaled_squares(which),
                    evidence=_unscaled_evidence,
                )
            )
    out.append(
        Model(
            "float32_math",
            "float32_math",
            "float64 input is computed in float32 (x.float(), JAX without jax_enable_x64, a float32 dtype policy)",
            "compute float64 input in float64",
            _float32_math,
        )
    )
    out.append(
        Model(
            "strides",
            "strides",
            "the implementation reads a strided (non-contiguous) x as if it were C-contiguous",
            "honour the strides, or copy with np.ascontiguousarray first",
            _c_order,
        )
    )
    if ln or rms:
        out.append(
            Model(
                "normalized_dims",
                "normalized_dims",
                "only the last axis is normalized",
                "normalize all trailing len(normalized_shape) axes (the weight's shape) together",
                _last_axis,
            )
        )
        if ln:
            out.append(
                Model(
                    "dx_missing_variance_term",
                    "dx_missing_variance_term",
                    "dx is missing the variance term: r * (g - mean(g)) without - x̂ * mean(g * x̂) (g = dy * w; the "
                    "dependence of rstd on x is dropped)",
                    "differentiate rstd too",
                    _dx_model("var"),
                )
            )
            out.append(
                Model(
                    "dx_missing_mean_term",
                    "dx_missing_mean_term",
                    "dx is missing the mean term: r * (g - x̂ * mean(g * x̂)) without - mean(g) (the dependence of "
                    "the mean on x is dropped)",
                    "differentiate the mean too",
                    _dx_model("mean"),
                )
            )
        else:
            out.append(
                Model(
                    "dx_missing_variance_term",
                    "dx_missing_variance_term",
                    "dx is missing the rstd term: r * g without - r * x̂ * mean(g * x̂) (the dependence of rstd on x "
                    "is dropped)",
                    "differentiate rstd too",
                    _dx_model("var"),
                )
            )
        out.append(
            Model(
                "saved_stats_16bit",
                "saved_stats_16bit",
                "the backward uses statistics (mean, rstd) stored in the input's 16-bit dtype",
                "save the statistics in float32 (as PyTorch on CUDA, Apex and TransformerEngine do)",
                _saved_stats_16bit,
            )
        )
    if ln:
        for p in (np.dtype(np.float64), np.dtype(np.float32)):
            pn = dtype_name(p)
            out.append(
                Model(
                    f"correct/{pn}",
                    "float32_math" if pn == "float32" else "correct_float64",
                    "float64 input is computed in float32 (x.float(), JAX without jax_enable_x64, a float32 dtype "
                    "policy)",
                    "compute float64 input in float64",
                    _stats_model("correct", p),
                    named_in=(),  # a baseline: float64 input in float32 is named by the float32_math model
                    fitted=True,
                )
            )
            out.append(
                _in_precision(
                    "mean_in_precision",
                    p,
                    "mean",
                    f"the mean is computed in {pn} without a correction: on rows with a large common offset its "
                    f"error shifts every x - mean; on constant rows it leaves x - mean != 0 (the exact x̂ is 0)",
                    "centre with a corrected two-pass mean (m += mean(x - m)), or accumulate in a wider type",
                    "correct",
                    _mean_evidence,
                )
            )
            out.append(
                _in_precision(
                    "one_pass",
                    p,
                    "one_pass",
                    f"the variance is computed in one pass, E[x^2] - E[x]^2 ({pn}), which loses everything on rows "
                    f"with a large mean",
                    "compute it from the centred values (two passes) or by Welford/Chan",
                    "mean_in_precision",
                    _one_pass_evidence,
                )
            )
            out.append(
                _in_precision(
                    "xr_minus_mean_r",
                    p,
                    "xr",
                    f"x̂ is computed as x * rstd - mean * rstd ({pn}): two terms of size |x| rstd cancel on rows "
                    f"with a large mean",
                    "compute (x - mean) * rstd",
                    "mean_in_precision",
                )
            )
    if "casting" in names:
        for policy in CASTINGS:
            out.append(
                Model(
                    f"casting/{policy}",
                    "low_precision_math" if policy == "none" else "rounding_order",
                    f"the forward rounds like casting='{policy}' ({CASTING_DOC[policy]})",
                    "to check against that order",
                    _convention_model(_casting(policy)),
                    agreement=True,
                    reference={"casting": policy},
                    options=_casting(policy),
                    axis="casting",
                    short=f"casting='{policy}' rounding",
                )
            )
    return out
