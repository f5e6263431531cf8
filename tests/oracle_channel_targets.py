"""Implementations of GroupNorm, InstanceNorm and BatchNorm for the oracle's tests (``tests/test_oracle_channels.py``).

Correct ones -- pynorm's own (:func:`pynorm_backward`), PyTorch's ``F.group_norm`` / ``F.instance_norm`` /
``F.batch_norm`` computing in float32 (float64 for float64 input) -- and a NumPy implementation of all three,
:func:`numpy_channel_norm`, with one planted mistake each (``bug=``), wrapped per op and bug by :func:`planted`.
Each follows the oracle's calling convention: ``forward(x, weight, bias, *, running_mean=..., running_var=...,
**options)``, like ``pynorm.<op>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import pynorm


def pynorm_backward(op: str) -> Callable[..., tuple[Any, ...]]:
    """``backward(dy, x, *args, **options)`` by ``pynorm.<op>_forward`` and ``_backward``."""
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")

    def backward(dy: np.ndarray, x: np.ndarray, *args: Any, **kw: Any) -> tuple[Any, ...]:
        _, ctx = fwd(x, *args, **kw)
        return tuple(bwd(dy, ctx))

    return backward


# --- PyTorch ---------------------------------------------------------------------------------------------


def _wide(a: np.ndarray) -> np.dtype:
    return np.dtype(np.float64) if a.dtype == np.float64 else np.dtype(np.float32)


def _t(a: Any, wide: np.dtype, grad: bool = False) -> Any:
    import torch

    if a is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(a).astype(wide)))
    return t.requires_grad_(True) if grad else t


def _torch_call(op: str, x: np.ndarray, weight: Any, bias: Any, rm: Any, rv: Any, kw: dict[str, Any], grad: bool):
    import torch.nn.functional as F

    wide = _wide(x)
    ca = int(kw.get("channel_axis", 1))
    xt = _t(np.moveaxis(x, ca, 1), wide, grad)
    wt, bt = _t(weight, wide, grad), _t(bias, wide, grad)
    rmt, rvt = _t(rm, wide), _t(rv, wide)
    eps = float(kw.get("eps", 1e-5))
    if op == "group_norm":
        y = F.group_norm(xt, int(kw["num_groups"]), wt, bt, eps)
    elif op == "instance_norm":
        y = F.instance_norm(
            xt, rmt, rvt, wt, bt, use_input_stats=kw.get("use_input_stats", True), momentum=kw.get("momentum", 0.1),
            eps=eps,
        )  # fmt: skip
    else:
        m = kw.get("momentum", 0.1)
        m = 1.0 / (int(kw.get("num_batches_tracked", 0)) + 1) if m is None else m
        y = F.batch_norm(xt, rmt, rvt, wt, bt, training=bool(kw["training"]), momentum=m, eps=eps)
    return xt, wt, bt, rmt, rvt, y


def torch_forward(op: str) -> Callable[..., Any]:
    """PyTorch's ``F.<op>`` in float32 (float64 for float64 input), rounded once; the running statistics (which
    PyTorch updates in place) returned after ``y`` where they are updated, as ``pynorm.<op>`` does."""

    def forward(x: np.ndarray, weight: Any, bias: Any, *, running_mean: Any = None, running_var: Any = None, **kw: Any):
        import torch

        with torch.no_grad():
            _, _, _, rmt, rvt, y = _torch_call(op, x, weight, bias, running_mean, running_var, kw, False)
        ca = int(kw.get("channel_axis", 1))
        yn = np.moveaxis(y.numpy(), 1, ca).astype(x.dtype)
        updates = running_mean is not None and (
            (op == "batch_norm" and kw["training"]) or (op == "instance_norm" and kw.get("use_input_stats", True))
        )
        if updates:
            return yn, rmt.numpy().astype(running_mean.dtype), rvt.numpy().astype(running_var.dtype)
        return yn

    return forward


def torch_backward(op: str) -> Callable[..., Any]:
    """The gradients of :func:`torch_forward` by autograd, rounded to the inputs' dtypes."""

    def backward(dy: np.ndarray, x: np.ndarray, weight: Any, bias: Any, *, running_mean: Any = None,
                 running_var: Any = None, **kw: Any):  # fmt: skip
        ca = int(kw.get("channel_axis", 1))
        rm = None if running_mean is None else running_mean.copy()
        rv = None if running_var is None else running_var.copy()
        xt, wt, bt, _, _, y = _torch_call(op, x, weight, bias, rm, rv, kw, True)
        y.backward(_t(np.moveaxis(dy, ca, 1), _wide(x)))
        return (
            np.moveaxis(xt.grad.numpy(), 1, ca).astype(x.dtype),
            wt.grad.numpy().astype(weight.dtype),
            bt.grad.numpy().astype(bias.dtype),
        )

    return backward


# --- NumPy, with planted mistakes ------------------------------------------------------------------------


def numpy_channel_norm(
    op: str, x: np.ndarray, weight: Any, bias: Any, running_mean: Any, running_var: Any, *, bug: str | None = None,
    num_groups: int | None = None, eps: float = 1e-5, channel_axis: int = 1, training: bool = True,
    momentum: float | None = 0.1, num_batches_tracked: int = 0, use_input_stats: bool = True,
) -> Any:  # fmt: skip
    """GroupNorm / InstanceNorm / BatchNorm in float32 (float64 for float64 input; ``bug="half"``: x's 16-bit dtype),
    two-pass statistics, one rounding, and the running statistics updated PyTorch's way -- except for ``bug``:
    ``unbiased`` (normalize with the unbiased variance), ``biased_running`` (update running_var with the biased one),
    ``eps_on_std``, ``keras_momentum`` (``new = m old + (1 - m) batch``), ``per_channel`` (GroupNorm's statistics per
    channel), ``one_pass`` (``E[x^2] - E[x]^2``), ``half`` (every operation in the 16-bit input dtype)."""
    with np.errstate(all="ignore"):  # huge and tiny cells overflow and underflow: the oracle measures it
        return _numpy_channel_norm(
            op, x, weight, bias, running_mean, running_var, bug, num_groups, eps, channel_axis, training, momentum,
            num_batches_tracked, use_input_stats,
        )  # fmt: skip


def _numpy_channel_norm(
    op: str, x: np.ndarray, weight: Any, bias: Any, running_mean: Any, running_var: Any, bug: str | None,
    num_groups: int | None, eps: float, channel_axis: int, training: bool, momentum: float | None,
    num_batches_tracked: int, use_input_stats: bool,
) -> Any:  # fmt: skip
    p = x.dtype if bug == "half" else (np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32))
    x3 = np.moveaxis(x, channel_axis, 1)
    shape = x3.shape
    n, c = shape[:2]
    x3 = x3.reshape(n, c, -1).astype(p)
    s = x3.shape[2]
    if op == "group_norm":
        g = c if bug == "per_channel" else int(num_groups or 1)
        rows = x3.reshape(n * g, -1)
        back = lambda a: a.reshape(n, c, s)  # noqa: E731
        batch = True
    elif op == "instance_norm":
        rows = x3.reshape(n * c, s)
        back = lambda a: a.reshape(n, c, s)  # noqa: E731
        batch = use_input_stats
    else:
        rows = np.ascontiguousarray(x3.transpose(1, 0, 2)).reshape(c, -1)
        back = lambda a: a.reshape(c, n, s).transpose(1, 0, 2)  # noqa: E731
        batch = training
    k = rows.shape[1]
    mean = rows.mean(axis=1, dtype=p)
    if bug == "one_pass":
        var = (rows * rows).mean(axis=1, dtype=p) - mean * mean
    else:
        d = rows - mean[:, None]
        var = (d * d).mean(axis=1, dtype=p)
    updated = None
    if running_mean is not None and batch and op != "group_norm":
        m = 1.0 / (num_batches_tracked + 1) if momentum is None else momentum
        m = 1 - m if bug == "keras_momentum" else m
        if op == "instance_norm":
            dd = x3 - x3.mean(axis=2, keepdims=True)
            vi = (dd * dd).sum(axis=2) / (s if bug == "biased_running" else s - 1)
            bm, bv = x3.mean(axis=2).mean(axis=0), vi.mean(axis=0)
        else:
            bm, bv = mean, var * (1 if bug == "biased_running" else k / (k - 1))
        rm = (1 - m) * running_mean.astype(p) + m * bm
        rv = (1 - m) * running_var.astype(p) + m * bv
        updated = (rm.astype(running_mean.dtype), rv.astype(running_var.dtype))
    if not batch:
        rep = n if op == "instance_norm" else 1
        mean = np.tile(running_mean.astype(p), rep)
        var = np.tile(running_var.astype(p), rep)
    if bug == "unbiased" and batch:
        var = var * p.type(k) / p.type(k - 1)
    r = 1 / (np.sqrt(var) + p.type(eps)) if bug == "eps_on_std" else 1 / np.sqrt(var + p.type(eps))
    xhat = back((rows - mean[:, None]) * r[:, None])
    y3 = xhat * weight.astype(p)[None, :, None] + bias.astype(p)[None, :, None]
    y = np.moveaxis(y3.reshape(shape), 1, channel_axis).astype(x.dtype)
    return y if updated is None else (y, *updated)


def planted(op: str, bug: str | None) -> Callable[..., Any]:
    """:func:`numpy_channel_norm` for ``op`` with ``bug``, by the oracle's calling convention."""

    def forward(x: np.ndarray, weight: Any, bias: Any, *, running_mean: Any = None, running_var: Any = None, **kw: Any):
        return numpy_channel_norm(op, x, weight, bias, running_mean, running_var, bug=bug, **kw)

    forward.__name__ = f"{op}_{bug or 'correct'}"
    return forward


# module-level targets for ``python -m pynorm check tests/oracle_channel_targets.py:NAME --op OP``
batch_norm_keras_momentum = planted("batch_norm", "keras_momentum")
batch_norm_unbiased = planted("batch_norm", "unbiased")
group_norm_per_channel = planted("group_norm", "per_channel")
group_norm_one_pass = planted("group_norm", "one_pass")
