"""What the benchmark calls, read from the op specs (:data:`pynorm.ops.SPECS`).

A :class:`Case` is one op on a float32 ``x`` of ``(rows, hidden)``: the op's extra inputs and parameters are the
spec's example arguments (:meth:`~pynorm.ops.OpSpec.example_args`: residual streams, modality ids and tables,
conditioning vectors, a fused Linear's matrix), the first output's shape and dtype come from
:meth:`~pynorm.ops.OpSpec.output_shape` and :meth:`~pynorm.ops.OpSpec.dtypes_of_outputs`, and ``dy`` has
:meth:`~pynorm.ops.OpSpec.grad_dtype`. Every process of a run builds its cases from the same seed, so the
numba backend, the reference backend and PyTorch see the same numbers.

The calls timed:

* :func:`pynorm_calls`: the public ``<op>_forward`` / ``<op>_backward`` on a backend (``"numba"``, or
  ``"numpy"``: the reference backend, the op's math in NumPy, the NumPy baseline);
* :func:`torch_calls`: PyTorch CPU with autograd, for the ops :data:`TORCH_BASELINES` lists: ``F.layer_norm``
  and ``F.rms_norm`` themselves, or the op's formula written with PyTorch ops as model code writes it;
* :func:`op_bytes`: the bytes one call moves, from the case's arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import REQUIRED, SPECS, OpSpec

__all__ = [
    "QUANTIZED_OPS", "STATIC_SCALE", "TORCH_BASELINES", "Case", "TorchBaseline", "call_args", "make_case", "op_bytes",
    "pynorm_calls", "quantized_names", "x_shape_of",
]  # fmt: skip

#: the dtype of ``x`` in the throughput cases
DTYPE = np.dtype(np.float32)


@dataclass
class Case:
    """One op's arguments for a float32 ``x`` of ``shape`` (built by :func:`make_case`).

    Attributes
    ----------
    spec : the op's spec.
    shape : the shape of ``x``: ``(rows, hidden)``, or ``(N, C, S)`` for a channels-layout op
        (:func:`x_shape_of`).
    x : the input, ``N(0, 1) + 3`` (a mean far from 0, as activations have).
    args : the arguments after ``x``, in the spec's order (inputs, then parameters); None where absent.
    y : a buffer of the first output's shape and dtype (``out=``).
    dy : the upstream gradient of the first output, in the spec's gradient dtype.
    options : the op's options (its defaults: every case runs them).
    """

    spec: OpSpec
    shape: tuple[int, ...]
    x: np.ndarray
    args: list[Any]
    y: np.ndarray
    dy: np.ndarray
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def required(self) -> dict[str, Any]:
        """The options a call must pass (those without a default: GroupNorm's ``num_groups``; the ``quantize``
        spec of an ``op:format`` case)."""
        out = {k: self.options[k] for k, d in self.spec.defaults().items() if d is REQUIRED}
        if self.options.get("quantize") is not None:
            out["quantize"] = self.options["quantize"]
        return out

    @property
    def named(self) -> dict[str, Any]:
        """The arguments after ``x`` by name (inputs, then parameters)."""
        return dict(zip((*self.spec.input_names, *self.spec.param_names), self.args, strict=True))

    def output_shapes(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """``(shape, dtype)`` of every output: the first from the spec's rule, the others of ``x``'s shape."""
        dts = self.spec.dtypes_of_outputs(self.x.dtype, self.options)
        return [(tuple(self.y.shape), np.dtype(dts[0]))] + [(self.shape, np.dtype(d)) for d in dts[1:]]


#: the channels of a channels-layout op's ``x`` (``(rows / C, C, hidden)``), where they divide the rows
CHANNELS = 64


def x_shape_of(spec: OpSpec, shape: tuple[int, int]) -> tuple[int, ...]:
    """The shape of ``x`` for a case of ``shape`` ``(rows, hidden)``: ``shape`` itself for a rows-layout op; for a
    channels-layout op (GroupNorm, InstanceNorm, BatchNorm) ``(N, C, S)`` with ``N C = rows`` and ``S = hidden``
    (``C`` = :data:`CHANNELS` where it divides the rows, else the rows): the same elements, each of the ``N C``
    ``(n, c)`` slices of ``S`` contiguous as a row."""
    rows, hidden = int(shape[0]), int(shape[1])
    if spec.layout == "rows":
        return (rows, hidden)
    c = CHANNELS if rows % CHANNELS == 0 else rows
    return (rows // c, c, hidden)


#: the ops with a quantized output mode, benchmarked as ``op:format`` (``rms_norm:nvfp4``)
QUANTIZED_OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


#: the caller's per-tensor scale of an ``op:fp8_*:tensor`` case (static FP8: the codes of ``y / STATIC_SCALE``)
STATIC_SCALE = 1 / 64


def quantized_names() -> tuple[str, ...]:
    """Every ``op:format`` name: the ops of :data:`QUANTIZED_OPS` with each FP8 / FP4 format's output, and each FP8
    format's other scalings (``op:format:group``, ``op:format:tensor``: :func:`make_case`)."""
    from ..ops.fp_quant import FORMATS

    fmts = [*FORMATS, *(f"{f}:{s}" for f in FORMATS if FORMATS[f].kind == "scaled" for s in ("group", "tensor"))]
    return tuple(f"{op}:{fmt}" for op in QUANTIZED_OPS for fmt in fmts)


def make_case(op: str, shape: tuple[int, int], seed: int = 0, dtype: Any = DTYPE) -> Case:
    """The case of op ``op`` (a name of :data:`pynorm.ops.SPECS`) on float32 ``x`` of ``shape``.

    Parameters
    ----------
    op : the op's name; ``op:format`` (``rms_norm:mxfp4``, :func:`quantized_names`): the op with its output
        quantized (``quantize=QuantSpec(format)``, FP8 per row); ``op:format:scaling`` an FP8 format's other scalings
        (``rms_norm:fp8_e4m3:group``: groups of 128; ``:tensor``: the static per-tensor scale :data:`STATIC_SCALE`).
    shape : ``(rows, hidden)``; a rows-layout op normalizes the last axis, a channels-layout op reads ``x`` as
        :func:`x_shape_of` says.
    seed : the random generator's seed; equal seeds give equal arrays in every process.
    dtype : the dtype of ``x`` (float32: the throughput tables; the compile-time table times every dtype).

    Returns
    -------
    Case
        ``x``, the spec's example arguments, an output buffer and ``dy``; the options are the op's defaults, a
        required option (GroupNorm's ``num_groups``, BatchNorm's ``training``) taken from the spec's first test
        case.
    """
    name, _, fmt = op.partition(":")
    spec = SPECS[name]
    xs = x_shape_of(spec, shape)
    axis = -1 if spec.layout == "rows" else 1
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    x = (rng.standard_normal(xs, dtype=np.float32) + 3).astype(dt)
    defaults = spec.defaults()
    first = spec.cases[0] if spec.cases else {}
    options = {**defaults, **{k: v for k, v in first.items() if defaults[k] is REQUIRED}}
    if fmt:
        from ..ops.fp_quant import QuantSpec

        if name not in QUANTIZED_OPS:
            raise KeyError(f"{name} has no quantized output mode")
        fmt, _, scaling = fmt.partition(":")
        if scaling not in ("", "row", "group", "tensor"):
            raise KeyError(f"{op}: the scaling is row, group or tensor")
        scale = STATIC_SCALE if scaling == "tensor" else None
        options["quantize"] = QuantSpec(fmt, scaling=scaling or "row", scale=scale)
    args = spec.example_args(xs, axis, dt, rng, options=options)
    yshape = spec.output_shape(xs, axis, dict(zip((*spec.input_names, *spec.param_names), args, strict=True)))
    ydt = spec.dtypes_of_outputs(dt, options)[0]
    dy = rng.standard_normal(yshape, dtype=np.float32).astype(spec.grad_dtype(dt))
    return Case(spec, xs, x, args, np.empty(yshape, ydt), dy, options)


def call_args(spec: OpSpec, args: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` (inputs then parameters) split as ``pynorm.<op>_forward`` takes them: positional, then the
    inputs its signature takes by keyword (``Input.keyword``), those that are None left out (their default)."""
    n = len(spec.inputs)
    pos = [a for i, a in zip(spec.inputs, args[:n], strict=True) if not i.keyword] + list(args[n:])
    kw = {i.name: a for i, a in zip(spec.inputs, args[:n], strict=True) if i.keyword and a is not None}
    return pos, kw


def op_bytes(case: Case) -> dict[str, int]:
    """The bytes one call of ``case`` moves: every array of the call read or written once.

    * forward: reads ``x``, every extra input and every parameter; writes every output
      (:meth:`Case.output_shapes`);
    * backward: reads ``dy``, the saved ``x`` (or the pre-norm sum ``h``, the same size), every parameter and
      every extra input except ``like_x`` ones (a residual is not read again: ``h`` is); writes ``dx`` and one
      gradient per differentiable input and per parameter, of that array's size;
    * forward + backward: the sum.

    Per-row statistics (``R`` values) and write-allocate reads are not counted, for the copy nor the ops.

    Returns
    -------
    dict
        ``{"fwd": bytes, "bwd": bytes, "fwd+bwd": bytes}``.
    """
    spec = case.spec
    n_in = len(spec.inputs)
    inputs = [(i, a) for i, a in zip(spec.inputs, case.args[:n_in], strict=True) if a is not None]
    params = [a for a in case.args[n_in:] if a is not None]
    fwd = case.x.nbytes + sum(a.nbytes for _, a in inputs) + sum(a.nbytes for a in params)
    outs = [math.prod(s) * d.itemsize for s, d in case.output_shapes()]
    q = case.options.get("quantize")
    if q is not None:  # the first output is the codes and scales (what a fused kernel writes), not y
        outs[0] = q.output_nbytes(case.shape[0], case.shape[1])
    fwd += sum(outs)
    gdt = np.dtype(spec.grad_dtype(case.x.dtype))
    bwd = case.dy.nbytes + case.x.nbytes + sum(a.nbytes for a in params)
    bwd += sum(a.nbytes for i, a in inputs if i.kind != "like_x")
    bwd += case.x.size * gdt.itemsize  # dx
    bwd += sum(a.nbytes for i, a in inputs if i.differentiable) + sum(a.nbytes for a in params)
    return {"fwd": int(fwd), "bwd": int(bwd), "fwd+bwd": int(fwd + bwd)}


def pynorm_calls(case: Case, backend: str, buffers: bool) -> dict[str, Callable[[], Any]]:
    """The case's calls through the public functional API on ``backend``.

    Parameters
    ----------
    case : the case.
    backend : ``"numba"`` or ``"numpy"`` (the reference).
    buffers : pass the output buffers (``out=``, ``dx_out=``; no ``out=`` for a quantized output, which has no
        buffer: ``out=`` would receive ``y`` besides the codes); the allocating forward is then ``fwd_alloc``.

    Returns
    -------
    dict
        ``fwd``, ``bwd`` (on the context of a forward run here), ``fwd+bwd`` and, with ``buffers``,
        ``fwd_alloc``.
    """
    import pynorm

    name = case.spec.name
    fwd_fn = getattr(pynorm, f"{name}_forward")
    bwd_fn = getattr(pynorm, f"{name}_backward")
    x, dy = case.x, case.dy
    pos, kw = call_args(case.spec, case.args)
    fkw: dict[str, Any] = {**kw, **case.required, "backend": backend}
    if buffers and case.options.get("quantize") is None:  # (out= of a quantized output would also keep y: written)
        fkw["out"] = case.y
    bkw: dict[str, Any] = {"dx_out": np.empty(case.shape, case.spec.grad_dtype(case.x.dtype))} if buffers else {}
    ctx = fwd_fn(x, *pos, **fkw)[1]

    def fwdbwd() -> None:
        bwd_fn(dy, fwd_fn(x, *pos, **fkw)[1], **bkw)

    calls: dict[str, Callable[[], Any]] = {
        "fwd": lambda: fwd_fn(x, *pos, **fkw),
        "bwd": lambda: bwd_fn(dy, ctx, **bkw),
        "fwd+bwd": fwdbwd,
    }
    if buffers:
        akw = {k: v for k, v in fkw.items() if k != "out"}
        calls["fwd_alloc"] = lambda: fwd_fn(x, *pos, **akw)
    return calls


# ---------------------------------------------------------------------------
# PyTorch baselines


@dataclass(frozen=True)
class TorchBaseline:
    """How PyTorch computes an op's first output.

    Attributes
    ----------
    expr : the PyTorch code, for the report (``H``: the hidden size; names are the spec's).
    native : True where the op is one PyTorch function; False for the op's formula in PyTorch ops.
    why : where a composition comes from (the model code it stands for).
    build : ``build(t, options, hidden) -> forward``: ``t`` maps ``x`` and the spec's argument names to tensors;
        ``forward()`` returns the first output.
    """

    expr: str
    native: bool
    why: str
    build: Callable[[Mapping[str, Any], Mapping[str, Any], int], Callable[[], Any]]


def _torch_f() -> Any:
    import torch.nn.functional as F

    return F


def _ln(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    return lambda: F.layer_norm(t["x"], (h,), t["weight"], t["bias"], o["eps"])


def _rms(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    return lambda: F.rms_norm(t["x"], (h,), t["weight"], o["eps"])


def _scale(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    return lambda: F.normalize(t["x"], p=2.0, dim=-1, eps=o["eps"]) * t["g"]


def _power(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    import torch

    x, w, b, p = t["x"], t["weight"], t["bias"], o["p"]
    return lambda: torch.sign(x) * x.abs().pow(p) * w + b


def _dyt(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    import torch

    x, a, w, b = t["x"], t["alpha"], t["weight"], t["bias"]
    return lambda: w * torch.tanh(a * x) + b


def _add_ln(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    x, r, a = t["x"], t["residual"], o["alpha"]
    return lambda: F.layer_norm(x + a * r, (h,), t["weight"], t["bias"], o["eps"])


def _add_rms(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    x, r, a = t["x"], t["residual"], o["alpha"]
    return lambda: F.rms_norm(x + a * r, (h,), t["weight"], o["eps"])


def _mod_ln(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    x, ids, w, b = t["x"], t["modality_ids"], t["weight"], t["bias"]
    return lambda: F.layer_norm(x, (h,), eps=o["eps"]) * w[ids] + b[ids]


def _mod_rms(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    x, ids, w = t["x"], t["modality_ids"], t["weight"]
    return lambda: F.rms_norm(x, (h,), eps=o["eps"]) * w[ids]


def _cond(norm: str) -> Callable[[Mapping[str, Any], Mapping[str, Any], int], Callable[[], Any]]:
    def build(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
        F = _torch_f()
        x, cond, W, c = t["x"], t["cond"], t["W"], t["c"]
        one = 1.0 if o["zero_centered"] else 0.0
        shift = o.get("shift", True)

        def fwd() -> Any:
            p = F.linear(cond, W, c)
            n = F.layer_norm(x, (h,), eps=o["eps"]) if norm == "ln" else F.rms_norm(x, (h,), eps=o["eps"])
            y = n * (p[:, :h] + one)
            return y + p[:, h:] if shift else y

        return fwd

    return build


def _lin(norm: Callable[[Mapping[str, Any], Mapping[str, Any], int], Callable[[], Any]]) -> Any:
    def build(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
        F = _torch_f()
        n = norm(t, o, h)
        return lambda: F.linear(n(), t["W"], t["c"])

    return build


def _group(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    return lambda: F.group_norm(t["x"], o["num_groups"], t["weight"], t["bias"], o["eps"])


def _instance(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    rm, rv = t["running_mean"], t["running_var"]
    return lambda: F.instance_norm(
        t["x"], rm, rv, t["weight"], t["bias"], o["use_input_stats"], o["momentum"], o["eps"]
    )


def _batch(t: Mapping[str, Any], o: Mapping[str, Any], h: int) -> Callable[[], Any]:
    F = _torch_f()
    rm, rv = t["running_mean"], t["running_var"]
    return lambda: F.batch_norm(t["x"], rm, rv, t["weight"], t["bias"], o["training"], o["momentum"], o["eps"])


#: the ops PyTorch computes, and how (the benchmark's options are each op's defaults, which these match)
TORCH_BASELINES: dict[str, TorchBaseline] = {
    "layer_norm": TorchBaseline("F.layer_norm(x, (H,), weight, bias, eps)", True, "", _ln),
    "rms_norm": TorchBaseline("F.rms_norm(x, (H,), weight, eps)", True, "", _rms),
    "scale_norm": TorchBaseline(
        "F.normalize(x, dim=-1, eps=eps) * g", True, "F.normalize is x / max(||x||, eps), the op's floor", _scale
    ),
    "power_norm": TorchBaseline(
        "torch.sign(x) * x.abs().pow(p) * weight + bias", False, "the op's formula in element-wise ops", _power
    ),
    "dyt": TorchBaseline(
        "weight * torch.tanh(alpha * x) + bias", False, "the DyT paper's PyTorch module (Zhu et al., 2025)", _dyt
    ),
    "add_layer_norm": TorchBaseline(
        "F.layer_norm(x + alpha * residual, (H,), weight, bias, eps)",
        False,
        "a pre-norm block's residual add, then its norm",
        _add_ln,
    ),
    "add_rms_norm": TorchBaseline(
        "F.rms_norm(x + alpha * residual, (H,), weight, eps)",
        False,
        "a pre-norm block's residual add, then its norm",
        _add_rms,
    ),
    "modality_layer_norm": TorchBaseline(
        "F.layer_norm(x, (H,), eps=eps) * weight[ids] + bias[ids]",
        False,
        "the norm, then each row's parameters gathered from the tables",
        _mod_ln,
    ),
    "modality_rms_norm": TorchBaseline(
        "F.rms_norm(x, (H,), eps=eps) * weight[ids]",
        False,
        "the norm, then each row's parameters gathered from the tables",
        _mod_rms,
    ),
    "conditional_layer_norm": TorchBaseline(
        "p = F.linear(cond, W, c); F.layer_norm(x, (H,), eps=eps) * p[:, :H] + p[:, H:]",
        False,
        "adaLN as DiT writes it: a projection of cond, then the modulated norm",
        _cond("ln"),
    ),
    "conditional_rms_norm": TorchBaseline(
        "p = F.linear(cond, W, c); F.rms_norm(x, (H,), eps=eps) * p[:, :H] + p[:, H:]",
        False,
        "adaLN as DiT writes it: a projection of cond, then the modulated norm",
        _cond("rms"),
    ),
    "quant_layer_norm": TorchBaseline(
        "F.layer_norm(x, (H,), weight, bias, eps)",
        True,
        "with its default options (a float x, quantize=None) the op is LayerNorm",
        _ln,
    ),
    "layer_norm_linear": TorchBaseline(
        "F.linear(F.layer_norm(x, (H,), weight, bias, eps), W, c)",
        False,
        "nn.Sequential(nn.LayerNorm(H), nn.Linear(H, N))",
        _lin(_ln),
    ),
    "rms_norm_linear": TorchBaseline(
        "F.linear(F.rms_norm(x, (H,), weight, eps), W, c)",
        False,
        "nn.Sequential(nn.RMSNorm(H), nn.Linear(H, N))",
        _lin(_rms),
    ),
    "group_norm": TorchBaseline("F.group_norm(x, G, weight, bias, eps)", True, "", _group),
    "instance_norm": TorchBaseline(
        "F.instance_norm(x, None, None, weight, bias, True, momentum, eps)", True, "", _instance
    ),
    "batch_norm": TorchBaseline(
        "F.batch_norm(x, None, None, weight, bias, True, momentum, eps)",
        True,
        "training mode, the batch's statistics",
        _batch,
    ),
}


def torch_tensors(case: Case) -> dict[str, Any]:
    """The case's arrays as CPU tensors sharing their memory: ``x`` and the spec's arguments by name, the float
    ones requiring gradients (ids do not; absent ones are None)."""
    import torch

    out: dict[str, Any] = {}
    for name, a in {"x": case.x, **case.named}.items():
        if a is None:
            out[name] = None
            continue
        t = torch.from_numpy(a)
        out[name] = t.requires_grad_(True) if t.is_floating_point() else t
    return out


def torch_calls(case: Case) -> dict[str, Callable[[], Any]]:
    """PyTorch's forward (with autograd recording, as in training) and forward + backward of ``case``.

    Raises
    ------
    KeyError
        PyTorch has no baseline for the op (not in :data:`TORCH_BASELINES`).
    """
    import torch

    if case.options.get("quantize") is not None:
        raise KeyError(f"PyTorch has no baseline for {case.spec.name} with a quantized output")
    base = TORCH_BASELINES[case.spec.name]
    t = torch_tensors(case)
    fwd = base.build(t, case.options, case.shape[1])
    leaves = [v for v in t.values() if v is not None and v.requires_grad]
    dy = torch.from_numpy(case.dy)

    def fwdbwd() -> None:
        for v in leaves:
            v.grad = None
        fwd().backward(dy)

    return {"fwd": fwd, "fwd+bwd": fwdbwd}
