"""The functional API: one thin entry point per op.

Every op ``name`` has three functions: ``name(...) -> y``,
``name_forward(...) -> (y, ctx)`` and ``name_backward(dy, ctx) -> grads``.
Each entry point validates its arguments (here, once, so every backend rejects
bad input the same way), picks a backend through :mod:`pynorm._registry`,
flattens the input to ``(rows, hidden)`` and calls that backend's ``forward`` or
``backward``. ``ctx`` is a :class:`Context` wrapping the backend's own ctx with
what is needed to restore shapes; ``backward`` runs on the backend that ran
``forward``.

Shapes follow ONNX's ``axis`` rule: dims ``axis .. ndim-1`` of ``x`` are
normalized together (``axis`` may be negative); parameters have shape
``x.shape[axis:]`` or any shape that broadcasts to it from the right (e.g.
``(H,)`` for a ``(..., 1, H)`` normalized block). Gradients come back in each
parameter's own shape and dtype.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _registry
from .errors import ArgumentError, ArrayTypeError, ContextError, DTypeError, ShapeError
from .reference.layer_norm import LayerNormGrads
from .reference.rms_norm import RMSNormGrads

__all__ = [
    "Context",
    "LayerNormGrads",
    "RMSNormGrads",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
]

Array = Any  # numpy.ndarray, cupy.ndarray, or another backend's array type

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True, eq=False)
class Context:
    """What a ``*_forward`` call hands to the matching ``*_backward``.

    Attributes
    ----------
    op : name of the op that made it.
    backend : name of the backend that ran forward (backward runs there too).
    x_shape, x_dtype : shape and dtype of the forward input.
    axis : first normalized axis (non-negative).
    param_shapes : shape of each parameter as given (None where absent).
    inner : the backend's ctx (e.g. :class:`pynorm.reference.layer_norm.LayerNormCtx`):
        the flattened input, parameters and per-row statistics.
    """

    op: str
    backend: str
    x_shape: tuple[int, ...]
    x_dtype: Any
    axis: int
    param_shapes: tuple[tuple[int, ...] | None, ...]
    inner: Any

    @property
    def rows(self) -> int:
        return math.prod(self.x_shape[: self.axis])

    @property
    def hidden(self) -> int:
        return math.prod(self.x_shape[self.axis :])


# ---------------------------------------------------------------------------
# validation helpers (shared by every op)


def _as_array(a: Any, name: str) -> Array:
    if isinstance(a, (list, tuple, numbers.Number, np.generic)) and not isinstance(a, bool):
        return np.asarray(a)
    if not (hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "reshape")):
        raise ArrayTypeError(f"{name} must be an array (numpy.ndarray, cupy.ndarray...), got {type(a).__name__}")
    return a


def _check_float_dtype(a: Array, name: str) -> None:
    dt = a.dtype
    if getattr(dt, "name", str(dt)) not in FLOAT_DTYPES:
        raise DTypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {dt}")


def _xp(a: Array) -> Any:
    return sys.modules[_registry.array_family(a)[0]]


def check_eps(eps: Any, name: str = "eps") -> float:
    """Validate a non-negative finite eps and return it as a Python float."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ArgumentError(f"{name} must be a real number >= 0, got {eps!r}")
    e = float(eps)
    if math.isnan(e) or math.isinf(e) or e < 0:
        raise ArgumentError(f"{name} must be a finite number >= 0, got {eps!r}")
    return e


def check_real(v: Any, name: str) -> float:
    """Validate a finite real scalar option and return it as a Python float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ArgumentError(f"{name} must be a finite real number, got {v!r}")
    return float(v)


def check_axis(axis: Any, ndim: int) -> int:
    """Validate ONNX-style ``axis`` for an ``ndim``-dim input; return it non-negative."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise ArgumentError(f"axis must be an int, got {axis!r}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise ArgumentError(f"axis={a} is out of range for x with {ndim} dims (expected {-ndim} <= axis < {ndim})")
    return a % ndim


def _check_param(p: Any, name: str, x: Array, axis: int) -> Array | None:
    if p is None:
        return None
    p = _as_array(p, name)
    if _registry.array_family(p) != _registry.array_family(x):
        _registry._family_of((x, p), ("x", name))  # raises ArrayTypeError with both types
    _check_float_dtype(p, name)
    norm_shape = tuple(x.shape[axis:])
    ok = p.ndim <= len(norm_shape) and all(
        d == n or d == 1 for d, n in zip(p.shape[::-1], norm_shape[::-1], strict=False)
    )
    if not ok:
        raise ShapeError(
            f"{name} has shape {tuple(p.shape)}, expected x.shape[axis:] = {norm_shape} "
            f"(or a shape broadcastable to it from the right)"
        )
    return p


def _flat_param(p: Array | None, norm_shape: tuple[int, ...]) -> Array | None:
    if p is None:
        return None
    h = math.prod(norm_shape)
    if tuple(p.shape) == norm_shape:
        return p.reshape(h)
    return _xp(p).broadcast_to(p, norm_shape).reshape(h)


def _unflat_grad(g: Array | None, shape: tuple[int, ...] | None, norm_shape: tuple[int, ...], xp: Any) -> Array | None:
    """Reduce a ``(H,)`` gradient to a parameter of ``shape`` that was broadcast to ``norm_shape``."""
    if g is None or shape is None:
        return None
    if tuple(shape) == norm_shape:
        return g.reshape(shape)
    full = g.reshape(norm_shape)
    lead = len(norm_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and norm_shape[lead + i] != 1)
    summed = full.astype(xp.float64).sum(axis=axes).reshape(shape)
    if xp is np:
        from .reference._common import round_to

        return round_to(summed, g.dtype)
    return summed.astype(g.dtype)


def _check_out(out: Any, name: str, like: Array, inputs: tuple[Array | None, ...]) -> Array | None:
    if out is None:
        return None
    if _registry.array_family(out) != _registry.array_family(like):
        _registry._family_of((like, out), ("x", name))
    if tuple(out.shape) != tuple(like.shape) or out.dtype != like.dtype:
        raise ShapeError(
            f"{name} must have shape {tuple(like.shape)} and dtype {like.dtype}, "
            f"got shape {tuple(out.shape)} and dtype {out.dtype}"
        )
    if not out.flags.c_contiguous:
        raise ArgumentError(f"{name} must be C-contiguous")
    xp = _xp(out)
    for a in inputs:
        if a is not None and xp.may_share_memory(out, a):
            raise ArgumentError(f"{name} must not overlap an input array")
    return out


def _prepare(
    op: str,
    x: Any,
    params: tuple[Any, ...],
    names: tuple[str, ...],
    axis: Any,
    backend: str | None,
) -> tuple[Array, int, tuple[Array | None, ...], str, Any]:
    x = _as_array(x, "x")
    _check_float_dtype(x, "x")
    if x.ndim < 1:
        raise ShapeError("x must have at least 1 dimension, got a 0-d array")
    ax = check_axis(axis, x.ndim)
    if math.prod(x.shape[ax:]) == 0:
        raise ShapeError(f"the normalized dims x.shape[{ax}:] = {tuple(x.shape[ax:])} must not be empty")
    ps = tuple(_check_param(p, n, x, ax) for p, n in zip(params, names, strict=True))
    name, mod = _registry.resolve(op, (x, *ps), ("x", *names), backend)
    return x, ax, ps, name, mod


def _forward(
    op: str,
    x: Any,
    params: tuple[Any, ...],
    names: tuple[str, ...],
    axis: Any,
    backend: str | None,
    out: Any,
    conventions: dict[str, Any],
) -> tuple[Array, Context]:
    x, ax, ps, name, mod = _prepare(op, x, params, names, axis, backend)
    out = _check_out(out, "out", x, (x, *ps))
    norm_shape = tuple(x.shape[ax:])
    rows, h = math.prod(x.shape[:ax]), math.prod(norm_shape)
    x2 = x.reshape(rows, h)
    flat = tuple(_flat_param(p, norm_shape) for p in ps)
    y2, inner = mod.forward(x2, *flat, out=None if out is None else out.reshape(rows, h), **conventions)
    y = out if out is not None else y2.reshape(x.shape)
    shapes = tuple(None if p is None else tuple(p.shape) for p in ps)
    return y, Context(op, name, tuple(x.shape), x.dtype, ax, shapes, inner)


def _backward(op: str, dy: Any, ctx: Any, dx_out: Any) -> tuple[Array, ...]:
    if not isinstance(ctx, Context):
        raise ContextError(f"ctx must be the Context returned by {op}_forward, got {type(ctx).__name__}")
    if ctx.op != op:
        raise ContextError(f"ctx was produced by {ctx.op}_forward and cannot be used by {op}_backward")
    dy = _as_array(dy, "dy")
    _registry._family_of((ctx.inner.x, dy), ("x", "dy"))
    if tuple(dy.shape) != ctx.x_shape:
        raise ShapeError(f"dy has shape {tuple(dy.shape)}, expected the shape of x, {ctx.x_shape}")
    if dy.dtype != ctx.x_dtype:
        raise DTypeError(f"dy has dtype {dy.dtype}, expected the dtype of x, {ctx.x_dtype}")
    dx_out = _check_out(dx_out, "dx_out", dy, (dy, ctx.inner.x))
    rows, h = ctx.rows, ctx.hidden
    mod = _registry.op_module(ctx.backend, op)
    grads = mod.backward(dy.reshape(rows, h), ctx.inner, dx_out=None if dx_out is None else dx_out.reshape(rows, h))
    dx = dx_out if dx_out is not None else grads[0].reshape(ctx.x_shape)
    norm_shape = ctx.x_shape[ctx.axis :]
    xp = _xp(dy)
    rest = tuple(_unflat_grad(g, s, norm_shape, xp) for g, s in zip(grads[1:], ctx.param_shapes, strict=True))
    return (dx, *rest)


# ---------------------------------------------------------------------------
# LayerNorm


def _ln_conventions(eps: Any, correction: Any, eps_mode: Any, weight_offset: Any) -> dict[str, Any]:
    if isinstance(correction, bool) or correction not in (0, 1):
        raise ArgumentError(f"correction must be 0 (biased variance) or 1 (unbiased), got {correction!r}")
    if eps_mode not in ("var", "std"):
        raise ArgumentError(f"eps_mode must be 'var' (sqrt(var + eps)) or 'std' (std + eps), got {eps_mode!r}")
    return {
        "eps": check_eps(eps),
        "correction": int(correction),
        "eps_mode": eps_mode,
        "weight_offset": check_real(weight_offset, "weight_offset"),
    }


def layer_norm_forward(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""LayerNorm forward; returns ``(y, ctx)`` for :func:`layer_norm_backward`.

    .. math::

        \mu = \mathrm{mean}(x), \quad v = \frac{\sum (x - \mu)^2}{H - c}, \quad
        y = \frac{x - \mu}{\sqrt{v + \epsilon}}\,(w + o) + b

    over the normalized dims ``x.shape[axis:]`` (``H`` elements per row).

    Parameters
    ----------
    x : array of dtype float16, bfloat16, float32 or float64, at least 1-D.
    weight, bias : optional arrays of shape ``x.shape[axis:]`` (or broadcastable
        to it from the right), any of the four float dtypes.
    axis : first normalized axis (ONNX semantics), may be negative. Default -1.
    eps : added to the variance inside the root (default 1e-5, PyTorch/ONNX); >= 0.
    backend : force a backend by name (see :func:`pynorm.list_backends`).
    correction : 0 (default) biased variance; 1 the unbiased ``x.std()`` of
        ``torch.Tensor.std`` that the second source document's code uses.
    eps_mode : ``"var"`` (default) ``1/sqrt(v + eps)``; ``"std"`` ``1/(sqrt(v) + eps)``
        as in both source documents' code.
    weight_offset : ``o`` above; 1.0 gives the zero-centred ``(1 + w)`` of Gemma
        and TransformerEngine's ``zero_centered_gamma``.
    out : optional C-contiguous array of ``x``'s shape and dtype to write ``y`` into.

    Returns
    -------
    y : array of ``x``'s shape and dtype (rounded once from the internal precision).
    ctx : :class:`Context` holding ``x``, the parameters and per-row mean and rstd.

    Notes
    -----
    The reference backend computes in float64 (extended precision for float64
    input) and rounds once; see ``docs/numerics.md`` for the accuracy promise.
    """
    conv = _ln_conventions(eps, correction, eps_mode, weight_offset)
    xa = _as_array(x, "x")
    if conv["correction"] == 1 and getattr(xa, "ndim", 0) >= 1:
        ax = check_axis(axis, xa.ndim)
        if math.prod(xa.shape[ax:]) == 1:
            raise ArgumentError("correction=1 needs more than one normalized element per row (got H = 1)")
    return _forward("layer_norm", xa, (weight, bias), ("weight", "bias"), axis, backend, out, conv)


def layer_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> LayerNormGrads:
    r"""LayerNorm backward: ``LayerNormGrads(dx, dweight, dbias)`` for upstream gradient ``dy``.

    With :math:`\hat x = (x - \mu) r`, :math:`g = dy\,(w + o)` and :math:`n = H - c`:

    .. math::

        dx = r\,\big(g - \bar g - \hat x\, \textstyle\sum g \hat x / n\big), \quad
        dw = \textstyle\sum_{rows} dy\, \hat x, \quad db = \textstyle\sum_{rows} dy

    (``eps_mode="std"`` divides the last term of ``dx`` by :math:`s r` instead;
    see :mod:`pynorm.reference.layer_norm`). ``dweight``/``dbias`` are None where
    forward had no weight/bias; they have the parameters' shapes and dtypes.
    ``dy`` must have ``x``'s shape and dtype. ``dx_out`` optionally receives ``dx``.
    """
    return LayerNormGrads(*_backward("layer_norm", dy, ctx, dx_out))


def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Array:
    """LayerNorm of ``x``; see :func:`layer_norm_forward` for the formula and options."""
    return layer_norm_forward(
        x,
        weight,
        bias,
        axis=axis,
        eps=eps,
        backend=backend,
        correction=correction,
        eps_mode=eps_mode,
        weight_offset=weight_offset,
        out=out,
    )[0]


# ---------------------------------------------------------------------------
# RMSNorm


def _rms_conventions(eps: Any, weight_offset: Any) -> dict[str, Any]:
    return {"eps": check_eps(eps), "weight_offset": check_real(weight_offset, "weight_offset")}


def rms_norm_forward(
    x: Array,
    weight: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""RMSNorm forward; returns ``(y, ctx)`` for :func:`rms_norm_backward`.

    .. math::

        r = \Big(\frac{1}{H}\sum x^2 + \epsilon\Big)^{-1/2}, \qquad y = x\, r\, (w + o)

    over the normalized dims ``x.shape[axis:]``.

    Parameters
    ----------
    x : array of dtype float16, bfloat16, float32 or float64, at least 1-D.
    weight : optional array of shape ``x.shape[axis:]`` (or broadcastable to it).
    axis : first normalized axis (ONNX semantics). Default -1.
    eps : inside the root; default 1e-6 (Hugging Face Llama, Liger). PyTorch's
        ``F.rms_norm(eps=None)`` uses ``finfo(float32).eps`` instead; pass it
        explicitly to match.
    backend : force a backend by name.
    weight_offset : ``o`` above; 1.0 gives Gemma's ``(1 + w)``, computed in the
        internal precision.
    out : optional C-contiguous array of ``x``'s shape and dtype to write ``y`` into.
    """
    conv = _rms_conventions(eps, weight_offset)
    return _forward("rms_norm", x, (weight,), ("weight",), axis, backend, out, conv)


def rms_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> RMSNormGrads:
    r"""RMSNorm backward: ``RMSNormGrads(dx, dweight)``.

    With :math:`\hat x = x r` and :math:`g = dy\,(w + o)`:

    .. math::

        dx = r\,\big(g - \hat x\, \tfrac{1}{H}\textstyle\sum g \hat x\big), \qquad
        dw = \textstyle\sum_{rows} dy\, \hat x
    """
    return RMSNormGrads(*_backward("rms_norm", dy, ctx, dx_out))


def rms_norm(
    x: Array,
    weight: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Array:
    """RMSNorm of ``x``; see :func:`rms_norm_forward` for the formula and options."""
    return rms_norm_forward(x, weight, axis=axis, eps=eps, backend=backend, weight_offset=weight_offset, out=out)[0]
