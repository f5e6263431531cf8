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

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ArgumentError
from ._base import InitKw, Module, as_rng, compute_dtype, keyword_options, positive_int, to_dtype
from .stack import Stack, StackKw
from .sublayers import Embedding, Linear, _cast

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Adam", "LossScaler", "SequenceModel", "StepResult", "cross_entropy", "sort_task", "train_step"]


def _positive_real(v: Any, name: str) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float, np.integer, np.floating))
        or not math.isfinite(v)
        or v <= 0
    ):
        raise ArgumentError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


class Adam:
    r"""Adam (Kingma & Ba) over a module's parameters, in each parameter's dtype (fp32 masters).

    .. math::

        g = \nabla / S,\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        \theta \leftarrow \theta - \eta_t\, \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    with :math:`S` the loss scale passed to :meth:`step` and :math:`\eta_t = \eta \min(1, t/\mathrm{warmup})`.
    ``clip``: rescale the whole gradient to at most this global L2 norm first (None: no clipping).
    """

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        warmup: int = 0,
        clip: float | None = None,
    ) -> None:
        self.lr = _positive_real(lr, "lr")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ArgumentError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = _positive_real(eps, "eps")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self.clip = None if clip is None else _positive_real(clip, "clip")
        self.t = 0
        self.m: dict[str, Any] = {}
        self.v: dict[str, Any] = {}

    def step(self, model: Module, grad_scale: float = 1.0) -> dict[str, float]:
        """One update of every parameter of ``model``; returns ``{name: ||delta||_2}``."""
        self.t += 1
        b1, b2 = self.betas
        lr = self.lr * (min(1.0, self.t / self.warmup) if self.warmup else 1.0)
        named = list(model.named_parameters())
        inv = 1.0 / grad_scale
        if self.clip is not None:
            total = math.sqrt(sum(float((o.grads[k].astype(np.float64) ** 2).sum()) for _, o, k in named)) * inv
            if total > self.clip:
                inv *= self.clip / total
        c1, c2 = 1.0 - b1**self.t, 1.0 - b2**self.t
        step, rc2 = -lr / c1, 1.0 / math.sqrt(c2)
        out = {}
        for name, owner, key in named:
            p, g = owner.params[key], owner.grads[key] * inv
            if name not in self.m:
                self.m[name], self.v[name] = owner.xp.zeros_like(p), owner.xp.zeros_like(p)
            m, v = self.m[name], self.v[name]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * (g * g)
            delta = (step * m / (owner.xp.sqrt(v) * rc2 + self.eps)).astype(p.dtype, copy=False)
            owner.params[key] = p + delta
            out[name] = math.sqrt(float((delta * delta).sum()))
        return out


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
    """One :func:`train_step`: the loss (before the update), whether the step was skipped (overflow),
    the loss scale used, and per-block gradient norms (unscaled) and update sizes (empty if skipped)."""

    loss: float
    skipped: bool
    scale: float
    grad_norms: list[float]
    update_norms: list[float]


def train_step(
    model: SequenceModel,
    tokens: Any,
    targets: Any,
    opt: Adam,
    scaler: LossScaler | None = None,
    act_dtype: Any = None,
    **forward_kw: Any,
) -> StepResult:
    """Forward, cross-entropy, backward (loss-scaled when ``scaler``), overflow check, Adam step."""
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
