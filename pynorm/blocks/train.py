r"""Training over the blocks: Adam, dynamic loss scaling for 16-bit activations, a small sequence model.

**Mixed precision** (``train_step(..., act_dtype=float16 or bfloat16, scaler=LossScaler())``):
activations between sublayers are 16-bit; products, element-wise math and the norms' statistics run
in fp32 (the norm ops' own promise); parameters are fp32 *master* copies and their gradients are
accumulated in fp32. The loss gradient is multiplied by the scale :math:`S` before it is rounded to the
activation dtype (so small gradients survive float16's range); parameter gradients are divided by
:math:`S` inside the optimizer step. When any gradient is inf or NaN the step is **skipped** and
:math:`S` is halved; after ``growth_interval`` good steps in a row :math:`S` doubles.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ArgumentError, PynormWarning
from ..optim import SGD, Adam, AdamW, Optimizer, cosine_schedule
from ._base import InitKw, Module, as_rng, compute_dtype, keyword_options, positive_int, to_dtype
from .stack import Stack, StackKw
from .sublayers import Embedding, Linear, _cast

#: the BLAS threads :func:`train_step` runs with by default (:func:`limit_blas_threads`)
BLAS_THREADS = 1
_controller: list[Any] = []
_warned: list[bool] = []


def limit_blas_threads(n: int | None) -> Any:
    """A context manager capping the BLAS library's threads (OpenBLAS, MKL, BLIS...) at ``n`` while it is open,
    through ``threadpoolctl`` (``pip install threadpoolctl``; None: BLAS left as it is). Without threadpoolctl it
    changes nothing and warns once (:class:`pynorm.errors.PynormWarning`) unless ``OPENBLAS_NUM_THREADS``,
    ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS`` is set.

    Why: the blocks' matrix products are small, and a BLAS that starts a thread per core for each of them, on cores
    pynorm's numba kernels also use, oversubscribes the machine (measured: 253 ms per :func:`train_step` against 14 ms
    with one BLAS thread, a 2-core machine)."""
    if n is None:
        return contextlib.nullcontext()
    n = positive_int(n, "blas_threads")
    if not _controller:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            capped = any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"))
            if not (_warned or capped or (os.cpu_count() or 1) <= n):
                _warned.append(True)
                warnings.warn(
                    f"pynorm.blocks: cannot cap the BLAS threads at {n} (threadpoolctl is not installed): a BLAS "
                    f"using every core beside pynorm's kernels can make training many times slower; pip install "
                    f"threadpoolctl, or set OPENBLAS_NUM_THREADS={n}",
                    PynormWarning,
                    stacklevel=3,
                )
            return contextlib.nullcontext()
        _controller.append(ThreadpoolController())
    return _controller[0].limit(limits=n, user_api="blas")


if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "LossScaler",
    "Optimizer",
    "SequenceModel",
    "StepResult",
    "cosine_schedule",
    "cross_entropy",
    "limit_blas_threads",
    "sort_task",
    "train_step",
]


def _positive_real(v: Any, name: str) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float, np.integer, np.floating))
        or not math.isfinite(v)
        or v <= 0
    ):
        raise ArgumentError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


@dataclass
class LossScaler:
    """Dynamic loss scaling: skip the step and multiply ``scale`` by ``backoff_factor`` (0.5) on an
    overflow; multiply it by ``growth_factor`` (2) after ``growth_interval`` good steps in a row
    (PyTorch's ``GradScaler`` defaults: ``init_scale`` 2**16, interval 2000; smaller here for short runs)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 200
    min_scale: float = 2.0**-24
    scale: float = field(init=False)
    good_steps: int = field(init=False, default=0)
    skipped: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        _positive_real(self.init_scale, "init_scale")
        if not self.growth_factor > 1.0:
            raise ArgumentError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ArgumentError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        positive_int(self.growth_interval, "growth_interval")
        self.scale = float(self.init_scale)

    @staticmethod
    def grads_finite(model: Module) -> bool:
        """True when every accumulated gradient of ``model`` is finite (no overflow to inf, no NaN)."""
        return all(bool(o.xp.isfinite(o.grads[k]).all()) for _, o, k in model.named_parameters())

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that overflowed (``found_inf``) or not."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0


def cross_entropy(logits: Any, targets: Any, xp: Any = np) -> tuple[float, Any]:
    r"""Mean cross-entropy over rows and its gradient: :math:`L = -\frac1N \sum_i \log \mathrm{softmax}(z_i)_{t_i}`,
    :math:`dz = (\mathrm{softmax}(z) - \mathrm{onehot}(t)) / N` (stable log-softmax, fp32 or better)."""
    v = logits.shape[-1]
    z = logits.reshape(-1, v).astype(compute_dtype(logits.dtype), copy=False)
    t = xp.asarray(targets).reshape(-1)
    n = z.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        zm = z - z.max(axis=1, keepdims=True)
        lse = xp.log(xp.exp(zm).sum(axis=1, keepdims=True))
        logp = zm - lse
        loss = -float(logp[xp.arange(n), t].mean())
        d = xp.exp(logp)
    d[xp.arange(n), t] -= 1.0
    return loss, (d / n).reshape(logits.shape)


def sort_task(rng: np.random.Generator, batch: int, seq_len: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the *sort* task: random tokens in ``[0, vocab)``; the target at position ``i`` is the
    ``i``-th smallest token of the sequence (chance level: ``log(vocab)`` nats)."""
    tokens = rng.integers(0, vocab, size=(batch, seq_len))
    return tokens, np.sort(tokens, axis=1)


class SequenceModel(Module):
    """Token + position :class:`Embedding`, a :class:`Stack`, and a :class:`Linear` head to ``vocab`` logits.

    ``forward(tokens, act_dtype=None, padding_mask=None, modality_ids=None, checkpoint=None) -> (logits, ctx)``
    runs the stack in ``act_dtype`` (default: the parameters' dtype; ``checkpoint=True`` keeps only the
    blocks' inputs, also the cheap way to run inference); ``backward(dlogits, ctx)``.
    ``stack_kw`` are :class:`Stack`'s options (``placement``, ``norm``, ``checkpoint``...). ``rng`` (None,
    an int seed, a ``SeedSequence`` or a Generator) initialises the embedding, then the stack (from one
    int drawn from it), then the head. Parameter names: ``embed.E``, ``embed.P``, ``stack.<Stack's names>``,
    ``head.W``, ``head.b``.
    """

    @keyword_options(InitKw, rest="stack_kw")
    def __init__(
        self,
        vocab: int,
        seq_len: int,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        **kw: Unpack[StackKw],
    ) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        rng = as_rng(kw["rng"])
        array = {"dtype": kw["dtype"], "backend": kw["backend"], "xp": self.xp}
        self.embed = Embedding(vocab, d_model, seq_len, rng=rng, **array)
        self.stack = Stack(n_layers, d_model, n_heads, d_ff, **{**kw, **array, "rng": int(rng.integers(2**31))})
        self.head = Linear(d_model, vocab, rng=rng, **array)
        self.children = {"embed": self.embed, "stack": self.stack, "head": self.head}

    def forward(
        self,
        tokens: Any,
        act_dtype: Any = None,
        padding_mask: Any = None,
        modality_ids: Any = None,
        checkpoint: bool | None = None,
    ) -> tuple[Any, Any]:
        adt = self.dtype if act_dtype is None else to_dtype(act_dtype, "act_dtype")
        e, ce = self.embed.forward(tokens, adt)
        h, cs = self.stack.forward(e, padding_mask, modality_ids, checkpoint)
        logits, ch = self.head.forward(h)
        return logits, (ce, cs, ch)

    def backward(self, dlogits: Any, ctx: Any) -> None:
        ce, cs, ch = ctx
        self.embed.backward(self.stack.backward(self.head.backward(dlogits, ch), cs), ce)


@dataclass
class StepResult:
    """What one :func:`train_step` did.

    Attributes
    ----------
    loss : float
        The mean cross-entropy of the batch, before the update.
    skipped : bool
        True when a gradient overflowed (inf or NaN) under loss scaling: nothing was updated and the
        :class:`LossScaler` halved its scale.
    scale : float
        The loss scale the step used (1.0 without a scaler).
    grad_norms : list of float
        Each block's gradient L2 norm, unscaled (by block, input to output; empty when the stack does not
        ``record``).
    update_norms : list of float
        Each block's update L2 norm (empty when skipped or not recorded).
    """

    loss: float
    skipped: bool
    scale: float
    grad_norms: list[float]
    update_norms: list[float]


def train_step(
    model: SequenceModel,
    tokens: Any,
    targets: Any,
    opt: Optimizer,
    scaler: LossScaler | None = None,
    act_dtype: Any = None,
    *,
    blas_threads: int | None = BLAS_THREADS,
    **forward_kw: Any,
) -> StepResult:
    """Forward, cross-entropy, backward (loss-scaled when ``scaler``), overflow check, optimizer step (``opt``: any
    :class:`pynorm.optim.Optimizer`); a :class:`StepResult`. ``blas_threads``: the BLAS threads during the step
    (default 1, :func:`limit_blas_threads`; None leaves BLAS as it is)."""
    with limit_blas_threads(blas_threads):
        logits, ctx = model.forward(tokens, act_dtype, **forward_kw)
        loss, dl = cross_entropy(logits, model.xp.asarray(targets), model.xp)
        s = scaler.scale if scaler is not None else 1.0
        model.zero_grad()
        with np.errstate(all="ignore"):  # an overflow is detected below, not warned about
            model.backward(_cast(dl * s, logits.dtype), ctx)
        gn = [g / s for g in model.stack.history["grad_norm"][-1]] if model.stack.record else []
        if model.stack.record:
            model.stack.history["grad_norm"][-1] = gn
        if scaler is not None:
            finite = scaler.grads_finite(model)
            scaler.update(not finite)
            if not finite:
                return StepResult(loss, True, s, gn, [])
        upd = opt.step(model, grad_scale=s)
        un = model.stack.record_updates(upd)
        return StepResult(loss, False, s, gn, un)
