r"""Sublayers with hand-written backward passes: :class:`Linear`, :class:`FeedForward` (tanh GELU),
:class:`MultiHeadAttention` (optional QK-norm, and the ``ln_q``/``ln_kv``/``ln_out`` norms of its inputs and
output, causal and padding masks), :class:`Norm` (any of pynorm's norms, optionally fused with the residual
add) and :class:`Embedding`.

Every sublayer: ``forward(x, ...) -> (y, ctx)``, ``backward(dy, ctx) -> dx``, parameter gradients
added into ``.grads``. Products and element-wise math run in float32 (float64 when the input or a
parameter is float64); outputs are rounded once to the input's dtype, so float16/bfloat16
activations stay 16-bit between sublayers while the math and the parameters are fp32.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import functional as F
from .. import layers as L
from ..errors import ArgumentError, DTypeError, ShapeError
from ..ops import check_real
from ._base import ArrayKw, InitKw, Module, as_rng, choice, compute_dtype, keyword_options, positive_int, xavier_normal

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "IO_NORM_KINDS",
    "NORM_KINDS",
    "AttentionKw",
    "Embedding",
    "FeedForward",
    "Linear",
    "MultiHeadAttention",
    "MultiHeadAttentionKw",
    "Norm",
    "gelu_tanh",
    "gelu_tanh_grad",
    "masked_softmax",
    "masked_softmax_backward",
]

NORM_KINDS = ("layer", "rms", "scale", "dyt", "derf", "modality")
#: the kinds of the attention's ``ln_q``/``ln_kv``/``ln_out`` (the attention takes no modality ids)
IO_NORM_KINDS = ("layer", "rms", "scale", "dyt", "derf")


def _cast(a: Any, dtype: Any) -> Any:
    if a.dtype == dtype:
        return a
    # rounding to a 16-bit dtype may overflow to inf on purpose (loss scaling detects it): no warning
    with np.errstate(over="ignore", invalid="ignore"):
        return a.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Linear


class Linear(Module):
    r"""``y = x @ W.T + b`` over the last axis (``W`` of shape ``(out_features, in_features)``, as torch).

    Gradients: :math:`dx = dy\,W`, :math:`dW = \sum_{rows} dy^T x`, :math:`db = \sum_{rows} dy`.

    Parameters
    ----------
    in_features, out_features : sizes. bias : create ``b`` (zeros).
    gain : Xavier-normal gain of ``W`` (``std = gain * sqrt(2 / (in + out))``; DeepNorm's ``beta``).
    rng : the initialisation's randomness: None (fresh entropy), an int seed, a ``SeedSequence`` or a
        ``numpy.random.Generator`` (drawn from in place). The same argument on every block.
    dtype : parameter dtype (float32 master weights by default). backend, xp : array module.

    Notes
    -----
    The product uses the array module's ``@`` (BLAS / cuBLAS) in float32 (float64 if ``x`` or ``W`` is);
    for 16-bit ``x`` the weight is first rounded to ``x``'s dtype (as autocast does), the products
    accumulate in float32 and ``y`` is rounded once to ``x``'s dtype. ``ctx`` is ``(x, W)`` (references, no
    copies: backward uses the weight forward used, even if ``params["W"]`` was replaced in between).
    """

    @keyword_options(InitKw)
    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, gain: float = 1.0, **kw: Unpack[InitKw]
    ) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        gain = check_real(gain, "gain")
        rng = as_rng(kw["rng"])
        self.add_param("W", xavier_normal(rng, self.out_features, self.in_features, gain))
        if bias:
            self.add_param("b", np.zeros(self.out_features))

    @staticmethod
    def _weight(w: Any, xdt: Any, cdt: Any) -> Any:
        if np.dtype(xdt).itemsize == 2:
            w = _cast(w, xdt)
        return w.astype(cdt, copy=False)

    def forward(self, x: Any) -> tuple[Any, Any]:
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"x has shape {tuple(x.shape)}, expected last dim {self.in_features}")
        cdt = compute_dtype(x.dtype, self.dtype)
        x2 = x.reshape(-1, self.in_features).astype(cdt, copy=False)
        w = self.params["W"]
        y = x2 @ self._weight(w, x.dtype, cdt).T
        if "b" in self.params:
            y += self.params["b"].astype(cdt, copy=False)
        return _cast(y, x.dtype).reshape(*x.shape[:-1], self.out_features), (x, w)

    def backward(self, dy: Any, ctx: Any) -> Any:
        x, w = ctx
        cdt = compute_dtype(x.dtype, self.dtype)
        dy2 = dy.reshape(-1, self.out_features).astype(cdt, copy=False)
        x2 = x.reshape(-1, self.in_features).astype(cdt, copy=False)
        self.accumulate("W", dy2.T @ x2)
        if "b" in self.params:
            self.accumulate("b", dy2.sum(axis=0))
        return _cast(dy2 @ self._weight(w, x.dtype, cdt), x.dtype).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# GELU feed-forward

_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def gelu_tanh(u: Any, xp: Any = np) -> Any:
    r"""The tanh GELU (GPT-2, BERT; ``torch.nn.GELU(approximate="tanh")``):
    :math:`\tfrac12 u\,(1 + \tanh(c(u + k u^3)))`, :math:`c = \sqrt{2/\pi}`, :math:`k = 0.044715`."""
    return 0.5 * u * (1.0 + xp.tanh(_C * u * (1.0 + _K * u * u)))  # u*u, not u**3: float32 power is slow


def gelu_tanh_grad(u: Any, xp: Any = np) -> Any:
    r"""The exact derivative of :func:`gelu_tanh`:
    :math:`\tfrac12(1 + t) + \tfrac12 u\,(1 - t^2)\,c\,(1 + 3k u^2)`, :math:`t = \tanh(c(u + k u^3))`."""
    u2 = u * u
    t = xp.tanh(_C * u * (1.0 + _K * u2))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * u2)


class FeedForward(Module):
    r"""``y = fc2(gelu(fc1(x)))`` with the tanh GELU (:func:`gelu_tanh`; its exact derivative in backward).

    Gradient: :math:`du = dy_{fc2 \to a} \cdot \mathrm{gelu}'(u)` between the two :class:`Linear` backwards.
    ``d_ff`` defaults (None) to ``4 * d_model``; ``gain`` is the Xavier gain of both matrices (DeepNorm:
    ``beta``); ``rng`` as for :class:`Linear` (``fc1`` draws first). ``ctx`` holds ``x``, the pre-activation
    ``u`` and the activation ``a``.
    """

    @keyword_options(InitKw)
    def __init__(self, d_model: int, d_ff: int | None = None, *, gain: float = 1.0, **kw: Unpack[InitKw]) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        d_model = positive_int(d_model, "d_model")
        d_ff = 4 * d_model if d_ff is None else positive_int(d_ff, "d_ff")
        lin = {**kw, "gain": gain, "rng": as_rng(kw["rng"]), "xp": self.xp}
        self.fc1 = Linear(d_model, d_ff, **lin)
        self.fc2 = Linear(d_ff, d_model, **lin)
        self.children = {"fc1": self.fc1, "fc2": self.fc2}

    def forward(self, x: Any) -> tuple[Any, Any]:
        u, c1 = self.fc1.forward(x)
        cdt = compute_dtype(u.dtype)
        a = _cast(gelu_tanh(u.astype(cdt, copy=False), self.xp), u.dtype)
        y, c2 = self.fc2.forward(a)
        return y, (c1, u, c2)

    def backward(self, dy: Any, ctx: Any) -> Any:
        c1, u, c2 = ctx
        da = self.fc2.backward(dy, c2)
        cdt = compute_dtype(u.dtype)
        du = da.astype(cdt, copy=False) * gelu_tanh_grad(u.astype(cdt, copy=False), self.xp)
        return self.fc1.backward(_cast(du, u.dtype), c1)


# ---------------------------------------------------------------------------------------------
# Norms


class Norm(Module):
    r"""One of pynorm's norms over the last axis, by name, with a uniform interface.

    ``kind``: ``"layer"`` (:func:`pynorm.layer_norm`), ``"rms"`` (:func:`pynorm.rms_norm`),
    ``"scale"`` (:func:`pynorm.scale_norm`, ``g`` starting at ``sqrt(d)``), ``"dyt"``
    (:func:`pynorm.dyt`, ``alpha`` 0.5), ``"derf"`` (:func:`pynorm.derf`, ``alpha`` 0.5, ``shift`` 0),
    ``"modality"`` (per-modality parameter tables,
    :func:`pynorm.modality_layer_norm` / :func:`pynorm.modality_rms_norm` by ``modality_kind``).

    * ``forward(x, modality_ids=None) -> (norm(x), ctx)``; ``backward(dy, ctx) -> dx``.
    * ``forward_add(f, x, alpha, modality_ids=None) -> (norm(f + alpha * x), ctx)``;
      ``backward_add(dy, ctx) -> (df, dx)`` with :math:`df = dh`, :math:`dx = \alpha\, dh` (``dh`` the
      norm's input gradient). LayerNorm and RMSNorm use pynorm's fused
      :func:`pynorm.add_layer_norm` / :func:`pynorm.add_rms_norm`; the other kinds add, then normalize.

    The norm math is the ops' own (fp32 or better for 16-bit inputs, one rounding).
    """

    @keyword_options(ArrayKw)
    def __init__(
        self,
        d: int,
        kind: str = "layer",
        *,
        eps: float | None = None,
        modality_kind: str = "layer",
        n_modalities: int | None = None,
        **array: Unpack[ArrayKw],
    ) -> None:
        super().__init__(array["dtype"], array["xp"], array["backend"])
        self.kind = choice(kind, "norm", NORM_KINDS)
        self.d = positive_int(d, "d")
        kw = {**array, "xp": self.xp}
        e: dict[str, Any] = {} if eps is None else {"eps": eps}
        inner: Any
        if kind == "layer":
            inner = L.LayerNorm(d, **e, **kw)
        elif kind == "rms":
            inner = L.RMSNorm(d, **e, **kw)
        elif kind == "scale":
            inner = L.ScaleNorm(d, **e, **kw)
        elif kind == "dyt":
            inner = L.DyT(d, **kw)
        elif kind == "derf":
            inner = L.Derf(d, **kw)
        else:
            choice(modality_kind, "modality_kind", ("layer", "rms"))
            if n_modalities is None:
                raise ArgumentError("norm='modality' needs n_modalities (a positive int)")
            inner = L.ModalityNorm(d, positive_int(n_modalities, "n_modalities"), kind=modality_kind, **e, **kw)
        self.inner = inner
        self.children = {"norm": inner}

    @property
    def needs_ids(self) -> bool:
        return self.kind == "modality"

    def _ids(self, x: Any, ids: Any) -> Any:
        if self.needs_ids and ids is None:
            raise ArgumentError("a modality norm needs modality_ids (one integer id per row)")
        return ids

    def forward(self, x: Any, modality_ids: Any = None) -> tuple[Any, Any]:
        if self.kind == "modality":
            return self.inner.forward(x, self._ids(x, modality_ids))  # type: ignore[no-any-return]
        return self.inner.forward(x)  # type: ignore[no-any-return]

    def backward(self, dy: Any, ctx: Any) -> Any:
        return self.inner.backward(dy, ctx)

    def forward_add(self, f: Any, x: Any, alpha: float = 1.0, modality_ids: Any = None) -> tuple[Any, Any]:
        p = self.inner.params
        if self.kind == "layer":
            (y, _), c = F.add_layer_norm_forward(
                f, x, p.get("weight"), p.get("bias"), alpha=alpha, eps=self.inner.eps, backend=self.backend
            )
            return y, ("fused", c, alpha)
        if self.kind == "rms":
            (y, _), c = F.add_rms_norm_forward(
                f, x, p.get("weight"), alpha=alpha, eps=self.inner.eps, backend=self.backend
            )
            return y, ("fused", c, alpha)
        cdt = compute_dtype(f.dtype)
        h = _cast(f.astype(cdt) + alpha * x.astype(cdt), f.dtype)
        y, c = self.forward(h, modality_ids)
        return y, ("split", c, alpha)

    def backward_add(self, dy: Any, ctx: Any) -> tuple[Any, Any]:
        how, c, alpha = ctx
        if how == "fused":
            if self.kind == "layer":
                gl = F.add_layer_norm_backward(dy, c)
                self.inner.accumulate(gl)
                return gl.dx, gl.dresidual
            gr = F.add_rms_norm_backward(dy, c)
            self.inner.accumulate(gr)
            return gr.dx, gr.dresidual
        dh = self.backward(dy, c)
        cdt = compute_dtype(dh.dtype)
        return dh, _cast(alpha * dh.astype(cdt), dh.dtype)


# ---------------------------------------------------------------------------------------------
# attention


def masked_softmax(s: Any, mask: Any, xp: Any = np) -> Any:
    r"""Softmax over the last axis where ``mask`` is True (entries where it is False get weight 0).

    Stable: :math:`p_j = e^{s_j - m} / \sum_{k \in \mathrm{mask}} e^{s_k - m}` with :math:`m` the row's
    largest unmasked score. A row with no unmasked entry gives all zeros (never NaN).
    """
    if mask is None:
        m = s.max(axis=-1, keepdims=True)
        e = xp.exp(s - m)
        return e / e.sum(axis=-1, keepdims=True)
    neg = xp.where(mask, s, -xp.inf)
    m = neg.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    e = xp.exp(neg - m)  # exp(-inf) = 0 on masked entries
    z = e.sum(axis=-1, keepdims=True)
    return e / xp.where(z > 0, z, 1.0)


def masked_softmax_backward(dp: Any, p: Any) -> Any:
    r"""Gradient of :func:`masked_softmax`: :math:`ds = p \odot (dp - \sum_j dp_j p_j)` (0 where ``p`` is 0)."""
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


class AttentionKw(InitKw, total=False):
    """The attention's options that a :class:`~pynorm.blocks.Block` (and a stack, to each block) passes on."""

    qk_norm: str | None
    v_norm: bool
    io_norms: bool
    io_norm_kind: str | None
    causal: bool
    eps: float | None


class MultiHeadAttentionKw(AttentionKw, total=False):
    """:class:`MultiHeadAttention`'s keyword options: :class:`AttentionKw` and the projections' gains."""

    qk_gain: float
    v_gain: float
    o_gain: float


class MultiHeadAttention(Module):
    r"""Multi-head self-attention with optional QK-norm and optional input/output norms.

    .. math::

        q = x_q W_q^T + b_q,\; k = x_{kv} W_k^T + b_k,\; v = x_{kv} W_v^T + b_v \quad\text{(split into heads)}

        \tilde q = \mathrm{norm}_q(q),\; \tilde k = \mathrm{norm}_k(k) \quad\text{(QK-norm, per head over } d_k)
        \quad [\tilde v = \mathrm{norm}_v(v) \text{ with } v\_norm]

        p = \mathrm{softmax}_{mask}(\tilde q \tilde k^T / \sqrt{d_k}),\quad o = p\,v,\quad
        y = \mathrm{norm}_{out}(\mathrm{merge}(o))\, W_o^T + b_o

    with :math:`x_q = \mathrm{ln\_q}(x)`, :math:`x_{kv} = \mathrm{ln\_kv}(x)` when ``io_norms=True`` (``ln_q``,
    ``ln_kv`` -- one norm shared by keys and values -- and ``ln_out``, a variant of multimodal write-ups), else
    :math:`x_q = x_{kv} = x` and no :math:`\mathrm{norm}_{out}`.

    Backward: :math:`dv = p^T do`, :math:`dp = do\, v^T`, :math:`ds = p \odot (dp - \sum dp \odot p)/\sqrt{d_k}`,
    :math:`d\tilde q = ds\, \tilde k`, :math:`d\tilde k = ds^T \tilde q`, then each norm's and Linear's own
    backward; the gradients of ``x`` from the three projections add.

    Parameters
    ----------
    d_model, n_heads : ``d_model`` divisible by ``n_heads`` (``d_k = d_model / n_heads``).
    qk_norm : None, ``"layer"`` or ``"rms"``: a norm over each head's ``d_k`` features of queries and keys
        (one ``(d_k,)`` parameter set each for q and k, shared by the heads).
    v_norm : also normalize the values (``v_norm``, of kind ``qk_norm``, per head over ``d_k``): HybridNorm's
        QKV-norm (Zhuo et al. 2025, arXiv 2503.04598). Needs ``qk_norm``.
    io_norms : add ``ln_q``, ``ln_kv``, ``ln_out`` (norms over ``d_model`` of kind ``io_norm_kind``).
    io_norm_kind : ``"layer"``, ``"rms"``, ``"scale"``, ``"dyt"`` or ``"derf"``; None (default) means ``"layer"``.
        Only with ``io_norms=True`` (an ArgumentError otherwise: it would have no effect).
    causal : position ``i`` attends to ``j <= i`` only.
    qk_gain, v_gain, o_gain : Xavier gains of the projections (DeepNorm: ``beta`` for v and o, 1 for q, k).
    eps : every norm's eps (None: each norm's own default). rng : as for :class:`Linear` (q, k, v, o
        draw in that order). dtype, backend, xp : as for :class:`Linear`.

    Notes
    -----
    ``forward(x, padding_mask=None) -> (y, ctx)``: ``x`` of shape ``(B, T, d_model)``; ``padding_mask``
    (``(B, T)`` bool, True = a real token) hides padded *keys*; a mask of another dtype (0/1 ints) is a
    :class:`~pynorm.errors.DTypeError`, a wrong shape a :class:`~pynorm.errors.ShapeError`.

    A query whose every key is hidden (e.g. a sequence that is all padding, or a causal row whose
    visible keys are all padding) gets attention weights 0 and a zero merged context, never NaN. Its
    output is then the output path applied to zero: ``y = b_o`` without ``io_norms``; with them
    ``y = ln_out(0) W_o^T + b_o``, where ``ln_out(0)`` is ``ln_out``'s ``bias`` for LayerNorm and DyT
    and 0 for RMSNorm and ScaleNorm (a zero row normalizes to zero; eps keeps it finite). Such a query
    passes no gradient to ``x`` or to the q/k/v projections; the parameters that set its output
    (``b_o``; with ``io_norms``, ``ln_out``'s bias and ``W_o``) get their gradient from it as from any row.
    """

    @keyword_options(MultiHeadAttentionKw)
    def __init__(self, d_model: int, n_heads: int, **kw: Unpack[MultiHeadAttentionKw]) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        self.d_model = positive_int(d_model, "d_model")
        self.n_heads = positive_int(n_heads, "n_heads")
        if self.d_model % self.n_heads:
            raise ArgumentError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_k = self.d_model // self.n_heads
        self.qk_norm = choice(kw["qk_norm"], "qk_norm", (None, "layer", "rms"))
        self.io_norms = bool(kw["io_norms"])
        self.causal = bool(kw["causal"])
        array = {"dtype": kw["dtype"], "backend": kw["backend"], "xp": self.xp}
        lin = {**array, "rng": as_rng(kw["rng"])}
        d = self.d_model
        self.q = Linear(d, d, gain=kw["qk_gain"], **lin)
        self.k = Linear(d, d, gain=kw["qk_gain"], **lin)
        self.v = Linear(d, d, gain=kw["v_gain"], **lin)
        self.o = Linear(d, d, gain=kw["o_gain"], **lin)
        self.children = {"q": self.q, "k": self.k, "v": self.v, "o": self.o}
        nkw = {**array, "eps": kw["eps"]}
        self.q_norm = self.k_norm = self.v_norm = self.ln_q = self.ln_kv = self.ln_out = None
        if self.qk_norm is not None:
            self.q_norm = Norm(self.d_k, self.qk_norm, **nkw)
            self.k_norm = Norm(self.d_k, self.qk_norm, **nkw)
            self.children |= {"q_norm": self.q_norm, "k_norm": self.k_norm}
        if kw["v_norm"]:
            if self.qk_norm is None:
                raise ArgumentError("v_norm=True needs qk_norm ('layer' or 'rms': the kind of the values' norm)")
            self.v_norm = Norm(self.d_k, self.qk_norm, **nkw)
            self.children["v_norm"] = self.v_norm
        self.io_norm_kind = None
        io_norm_kind = kw["io_norm_kind"]
        if io_norm_kind is not None:
            choice(io_norm_kind, "io_norm_kind", IO_NORM_KINDS)
            if not self.io_norms:
                raise ArgumentError(
                    f"io_norm_kind={io_norm_kind!r} needs io_norms=True (it sets the kind of ln_q, ln_kv and ln_out)"
                )
        if self.io_norms:
            self.io_norm_kind = "layer" if io_norm_kind is None else io_norm_kind
            self.ln_q, self.ln_kv, self.ln_out = (Norm(d, self.io_norm_kind, **nkw) for _ in range(3))
            self.children |= {"ln_q": self.ln_q, "ln_kv": self.ln_kv, "ln_out": self.ln_out}

    def _split(self, a: Any) -> Any:
        b, t, _ = a.shape
        return self.xp.ascontiguousarray(a.reshape(b, t, self.n_heads, self.d_k).transpose(0, 2, 1, 3))

    def _merge(self, a: Any) -> Any:
        b, _, t, _ = a.shape
        return self.xp.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(b, t, self.d_model)

    def mask(self, t: int, padding_mask: Any = None, batch: int | None = None) -> Any:
        """The boolean ``(B|1, 1, T, T)`` mask of allowed (query, key) pairs, or None when nothing is masked."""
        xp = self.xp
        m = None
        if self.causal:
            m = xp.tril(xp.ones((t, t), dtype=bool))[None, None]
        if padding_mask is not None:
            pm = xp.asarray(padding_mask)
            if pm.dtype != bool:
                raise DTypeError(
                    f"padding_mask must be a bool array (True = a real token), got dtype {pm.dtype}; "
                    "convert a 0/1 mask with mask.astype(bool)"
                )
            if pm.ndim != 2 or pm.shape[1] != t or (batch is not None and pm.shape[0] != batch):
                want = f"({'B' if batch is None else batch}, {t})"
                raise ShapeError(f"padding_mask must have shape {want}, got {tuple(pm.shape)}")
            keys = pm[:, None, None, :]
            m = keys if m is None else (m & keys)
        return m

    def forward(self, x: Any, padding_mask: Any = None) -> tuple[Any, Any]:
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ShapeError(f"x must have shape (B, T, {self.d_model}), got {tuple(x.shape)}")
        b, t, _ = x.shape
        mask = self.mask(t, padding_mask, b)
        xq, xkv, cq, ckv = x, x, None, None
        if self.ln_q is not None and self.ln_kv is not None:
            xq, cq = self.ln_q.forward(x)
            xkv, ckv = self.ln_kv.forward(x)
        q, cqp = self.q.forward(xq)
        k, ckp = self.k.forward(xkv)
        v, cvp = self.v.forward(xkv)
        qh, kh, vh = self._split(q), self._split(k), self._split(v)
        cqn = ckn = cvn = None
        if self.q_norm is not None and self.k_norm is not None:
            qh, cqn = self.q_norm.forward(qh)
            kh, ckn = self.k_norm.forward(kh)
        if self.v_norm is not None:
            vh, cvn = self.v_norm.forward(vh)
        cdt = compute_dtype(x.dtype, self.dtype)
        scale = 1.0 / math.sqrt(self.d_k)
        qc, kc, vc = qh.astype(cdt, copy=False), kh.astype(cdt, copy=False), vh.astype(cdt, copy=False)
        s = (qc @ kc.transpose(0, 1, 3, 2)) * scale
        p = masked_softmax(s, mask, self.xp)
        o = _cast(self._merge(p @ vc), x.dtype)
        co = None
        if self.ln_out is not None:
            o, co = self.ln_out.forward(o)
        y, cop = self.o.forward(o)
        return y, (x.dtype, cq, ckv, cqp, ckp, cvp, (cqn, ckn, cvn), qh, kh, vh, p, co, cop)

    def backward(self, dy: Any, ctx: Any) -> Any:
        xdt, cq, ckv, cqp, ckp, cvp, (cqn, ckn, cvn), qh, kh, vh, p, co, cop = ctx
        cdt = p.dtype
        scale = 1.0 / math.sqrt(self.d_k)
        do = self.o.backward(dy, cop)
        if self.ln_out is not None:
            do = self.ln_out.backward(do, co)
        doh = self._split(do).astype(cdt, copy=False)
        dv = p.transpose(0, 1, 3, 2) @ doh
        dp = doh @ vh.astype(cdt, copy=False).transpose(0, 1, 3, 2)
        ds = masked_softmax_backward(dp, p) * scale
        dq = ds @ kh.astype(cdt, copy=False)
        dk = ds.transpose(0, 1, 3, 2) @ qh.astype(cdt, copy=False)
        dq, dk, dv = _cast(dq, xdt), _cast(dk, xdt), _cast(dv, xdt)
        if self.q_norm is not None and self.k_norm is not None:
            dq = self.q_norm.backward(dq, cqn)
            dk = self.k_norm.backward(dk, ckn)
        if self.v_norm is not None:
            dv = self.v_norm.backward(dv, cvn)
        dxq = self.q.backward(self._merge(dq), cqp)
        dxkv = self.k.backward(self._merge(dk), ckp).astype(cdt) + self.v.backward(self._merge(dv), cvp)
        if self.ln_q is not None and self.ln_kv is not None:
            return _cast(self.ln_q.backward(dxq, cq).astype(cdt) + self.ln_kv.backward(_cast(dxkv, xdt), ckv), xdt)
        return _cast(dxq.astype(cdt) + dxkv, xdt)


# ---------------------------------------------------------------------------------------------
# embedding


class Embedding(Module):
    r"""Token plus learned position embedding: ``y[b, t] = E[tokens[b, t]] + P[t]``.

    Gradients: :math:`dE = \mathrm{onehot}(tokens)^T dy` (one product, no scatter loop),
    :math:`dP = \sum_b dy[b]`. Both tables start at :math:`\mathcal N(0, 1)`. ``forward(tokens, dtype=None)``
    returns ``y`` in ``dtype`` (default: the parameters'); ``backward`` returns None (tokens have no gradient).
    """

    @keyword_options(InitKw)
    def __init__(self, vocab: int, d_model: int, max_len: int, **kw: Unpack[InitKw]) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        self.vocab, self.d_model = positive_int(vocab, "vocab"), positive_int(d_model, "d_model")
        self.max_len = positive_int(max_len, "max_len")
        rng = as_rng(kw["rng"])
        self.add_param("E", rng.standard_normal((self.vocab, self.d_model)))
        self.add_param("P", rng.standard_normal((self.max_len, self.d_model)))

    def forward(self, tokens: Any, dtype: Any = None) -> tuple[Any, Any]:
        tokens = self.xp.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] > self.max_len:
            raise ShapeError(f"tokens must have shape (B, T <= {self.max_len}), got {tuple(tokens.shape)}")
        y = self.params["E"][tokens] + self.params["P"][None, : tokens.shape[1]]
        return _cast(y, self.dtype if dtype is None else dtype), tokens

    def backward(self, dy: Any, ctx: Any) -> None:
        tokens = ctx
        cdt = compute_dtype(self.dtype)
        d2 = dy.reshape(-1, self.d_model).astype(cdt, copy=False)
        onehot = (tokens.reshape(-1)[:, None] == self.xp.arange(self.vocab)[None, :]).astype(cdt)
        self.accumulate("E", onehot.T @ d2)
        dp = self.xp.zeros((self.max_len, self.d_model), dtype=cdt)
        dp[: tokens.shape[1]] = dy.astype(cdt, copy=False).sum(axis=0)
        self.accumulate("P", dp)
