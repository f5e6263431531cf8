"""The figures of the norm pages: ``python docs/figures.py [OUT_DIR] [--only NAME ...]``.

Each figure is computed with pynorm's ``numpy`` reference backend on small inputs (a few seconds in
all) and written as ``docs/figures/<name>.png`` (or into ``OUT_DIR``). The PNGs are committed, so the
docs build needs neither matplotlib nor this script; ``tests/test_docs.py`` runs it into a temporary
directory (when matplotlib is installed) so that it cannot rot. Needs matplotlib (``pynorm[demo]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import pynorm

OUT = Path(__file__).resolve().parent / "figures"
RNG_SEED = 0
BACKEND = "numpy"


def _rows(rng: np.random.Generator, h: int = 4096) -> list[tuple[str, np.ndarray]]:
    """Three rows with different distributions: the input side of the LayerNorm / RMSNorm figures."""
    return [
        ("N(3, 2²)", 3 + 2 * rng.standard_normal(h)),
        ("N(-1, 0.5²)", -1 + 0.5 * rng.standard_normal(h)),
        ("Exp(1) (skewed)", rng.exponential(1.0, h)),
    ]


def _hist_pair(plt: Any, rows: list[tuple[str, np.ndarray]], outs: list[np.ndarray], title: str) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    bins = np.linspace(-6, 10, 120)
    for (label, x), y in zip(rows, outs):
        a.hist(x, bins=bins, histtype="step", label=label)
        stats = f"{label}: mean {y.mean():.2f}, std {y.std():.2f}"
        b.hist(y, bins=np.linspace(-4, 6, 120), histtype="step", label=stats)
    a.set_title("input rows (H = 4096)")
    b.set_title(title)
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_layer_norm(plt: Any, rng: np.random.Generator) -> Any:
    rows = _rows(rng)
    outs = [pynorm.layer_norm(x[None], backend=BACKEND)[0] for _, x in rows]
    return _hist_pair(plt, rows, outs, "layer_norm: each row to mean 0, std 1")


def fig_rms_norm(plt: Any, rng: np.random.Generator) -> Any:
    rows = _rows(rng)
    outs = [pynorm.rms_norm(x[None], backend=BACKEND)[0] for _, x in rows]
    return _hist_pair(plt, rows, outs, "rms_norm: mean square 1, not centred")


def fig_scale_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    pts = rng.standard_normal((300, 2)) * np.array([2.0, 0.6])
    y = pynorm.scale_norm(pts, np.array(1.5), backend=BACKEND)
    a.scatter(pts[:, 0], pts[:, 1], s=4, label="x (rows of H = 2)")
    a.scatter(y[:, 0], y[:, 1], s=4, label="scale_norm(x, g=1.5)")
    a.set_aspect("equal")
    a.set_title("every row onto the sphere of radius g")
    a.legend(fontsize=7, loc="lower right")
    norms = np.logspace(-8, -2, 200)
    x = np.stack([norms, np.zeros_like(norms)], axis=1)
    for mode in ("floor", "root"):
        out = pynorm.scale_norm(x, eps=1e-5, eps_mode=mode, backend=BACKEND)
        b.loglog(norms, np.linalg.norm(out, axis=1), label=f'eps_mode="{mode}"')
    b.axvline(1e-5, color="gray", ls=":", lw=0.8)
    b.set_xlabel("‖x‖₂")
    b.set_ylabel("‖y‖₂ (g = 1)")
    b.set_title("small rows: the floor (default) is linear below eps")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_power_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    x = np.linspace(-3, 3, 601)
    for p in (0.25, 0.5, 1.0, 2.0):
        y, ctx = pynorm.power_norm_forward(x[None], p=p, backend=BACKEND)
        dx = pynorm.power_norm_backward(np.ones_like(y), ctx).dx
        a.plot(x, y[0], label=f"p = {p}")
        b.plot(x, dx[0], label=f"p = {p}")
    a.set_title("y = sign(x) |x|^p  (w = 1, b = 0)")
    b.set_title("dx for dy = 1 (0 at x = 0 for p < 1)")
    b.set_ylim(-0.2, 6.5)
    a.legend(fontsize=7)
    b.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def fig_dyt(plt: Any, rng: np.random.Generator) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    x = 4 * rng.standard_normal(20000)
    for alpha in (0.1, 0.5, 2.0):
        y = pynorm.dyt(x[None], np.array(alpha), backend=BACKEND)[0]
        a.hist(y, bins=np.linspace(-1, 1, 101), histtype="step", label=f"alpha = {alpha}")
    a.set_title("dyt of N(0, 4²) input: saturation at ±1 as alpha grows")
    a.legend(fontsize=7, loc="upper center")
    z = np.linspace(0, 30, 301)
    _, ctx = pynorm.dyt_forward(z[None], np.array(1.0), backend=BACKEND)
    exact = pynorm.dyt_backward(np.ones((1, z.size)), ctx).dx[0]
    naive = 1 - np.tanh(z) ** 2
    b.semilogy(z, exact, label="pynorm dx = sech²(z) (4s/(1+s)², s = e^{-2|z|})")
    b.semilogy(z, np.where(naive > 0, naive, np.nan), "--", label="naive 1 - tanh(z)² (float64)")
    b.set_xlabel("z = alpha x")
    b.set_title("gradient where tanh saturates")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_add_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    steps, shape = 64, (16, 256)
    updates = [(0.1 * rng.standard_normal(shape)).astype(np.float16) for _ in range(steps)]
    exact = rng.standard_normal(shape).astype(np.float16)
    exact64 = exact.astype(np.float64)
    for rdt in ("float16", "float32"):
        h = exact.astype(rdt)
        errs = []
        ref = exact64.copy()
        for u in updates:
            _, h = pynorm.add_layer_norm(u, h, residual_dtype=rdt, backend=BACKEND)
            ref = ref + u.astype(np.float64)
            errs.append(np.abs(h.astype(np.float64) - ref).mean())
        ax.semilogy(range(1, steps + 1), errs, label=f'residual_dtype="{rdt}"')
    ax.set_xlabel("residual adds (float16 sublayer outputs)")
    ax.set_ylabel("mean |h - exact sum|")
    ax.set_title("the residual stream h = x + residual, 64 blocks deep")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_modality_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    h, names = 64, ("text", "image", "audio")
    ids = np.repeat(np.arange(3), 200)
    scale, shift = np.array([1.0, 3.0, 0.3])[ids, None], np.array([0.0, 2.0, -1.0])[ids, None]
    x = rng.standard_normal((ids.size, h)) * scale + shift
    weight = np.array([[1.0], [0.5], [2.0]]) * np.ones((3, h))
    bias = np.array([[0.0], [1.0], [-1.0]]) * np.ones((3, h))
    y = pynorm.modality_layer_norm(x, ids, weight, bias, backend=BACKEND)
    for m, name in enumerate(names):
        a.hist(x[ids == m].ravel(), bins=100, histtype="step", label=name)
        b.hist(y[ids == m].ravel(), bins=100, histtype="step", label=f"{name}: w = {weight[m, 0]}, b = {bias[m, 0]}")
    a.set_title("tokens of three modalities")
    b.set_title("modality_layer_norm: one (w, b) row per modality")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_conditional_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    b_, t, h, c = 4, 256, 32, 8
    x = rng.standard_normal((b_, t, h))
    cond = rng.standard_normal((b_, c))
    w = 0.3 * rng.standard_normal((2 * h, c))
    y = pynorm.conditional_layer_norm(x, cond, w, zero_centered=True, backend=BACKEND)
    for i in range(b_):
        stats = f"sample {i}: mean {y[i].mean():.2f}, std {y[i].std():.2f}"
        ax.hist(y[i].ravel(), bins=100, histtype="step", label=stats)
    ax.set_title("conditional_layer_norm: scale, shift from each cond")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _nbytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the arrays a ctx holds (dataclasses and tuples walked; an array counted once)."""
    seen = set() if seen is None else seen
    if isinstance(obj, np.ndarray):
        base = obj if obj.base is None else obj.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o, seen) for o in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_nbytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    if hasattr(obj, "inner"):
        return _nbytes(obj.inner, seen)
    return 0


def fig_norm_linear(plt: Any, rng: np.random.Generator) -> Any:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rows, n_out = 512, 64
    hs = [64, 128, 256, 512, 1024]
    fused, unfused = [], []
    for h in hs:
        x = rng.standard_normal((rows, h)).astype(np.float32)
        w = rng.standard_normal((n_out, h)).astype(np.float32)
        _, ctx = pynorm.layer_norm_linear_forward(x, None, None, w, backend=BACKEND)
        fused.append(_nbytes(ctx) / 2**20)
        n, ctx_ln = pynorm.layer_norm_forward(x, backend=BACKEND)
        unfused.append((_nbytes(ctx_ln) + n.nbytes + w.nbytes) / 2**20)  # the product's backward keeps n
    ax.plot(hs, unfused, "o-", label="layer_norm then n @ W.T (keeps n)")
    ax.plot(hs, fused, "s-", label="layer_norm_linear (recomputes n)")
    ax.set_xlabel("hidden size H (512 rows, 64 outputs, float32)")
    ax.set_ylabel("MiB held for backward")
    ax.set_title("memory the forward keeps for the backward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_quant_layer_norm(plt: Any, rng: np.random.Generator) -> Any:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    x = rng.integers(-127, 128, (64, 256)).astype(np.int8)
    w = np.where(np.arange(256) < 4, 8.0, 1.0).astype(np.float32)  # a few outlier channels
    y = pynorm.quant_layer_norm(x, w, x_scale=0.05, backend=BACKEND)
    for mode in ("tensor", "row"):
        q, s = pynorm.quant_layer_norm(x, w, x_scale=0.05, quantize=mode, backend=BACKEND)
        deq = q.astype(np.float64) * np.reshape(s, (-1, 1) if mode == "row" else ())
        err = np.abs(deq - y) / np.reshape(s, (-1, 1) if mode == "row" else ())
        a.hist(err.ravel(), bins=50, histtype="step", label=f'quantize="{mode}"')
    a.set_xlabel("|q s - y| / s")
    a.set_title("rounding error: at most half a step")
    a.legend(fontsize=7)
    xf = rng.standard_normal((64, 256))
    xf[:8, 0] = 60.0  # eight rows with one outlier each: after the norm their amax is ~16, the others' ~3.5
    yf = pynorm.quant_layer_norm(xf, backend=BACKEND)
    for mode in ("tensor", "row"):
        q, s = pynorm.quant_layer_norm(xf, quantize=mode, backend=BACKEND)
        deq = q.astype(np.float64) * np.reshape(s, (-1, 1) if mode == "row" else ())
        b.plot(np.arange(64), np.abs(deq - yf).mean(axis=1), label=f'quantize="{mode}"')
    b.set_xlabel("row (rows 0-7 hold an outlier)")
    b.set_ylabel("mean |q s - y|")
    b.set_title("float input: one scale per tensor or per row")
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig


FIGURES: dict[str, Callable[[Any, np.random.Generator], Any]] = {
    "layer_norm": fig_layer_norm,
    "rms_norm": fig_rms_norm,
    "scale_norm": fig_scale_norm,
    "power_norm": fig_power_norm,
    "dyt": fig_dyt,
    "add_norm": fig_add_norm,
    "modality_norm": fig_modality_norm,
    "conditional_norm": fig_conditional_norm,
    "norm_linear": fig_norm_linear,
    "quant_layer_norm": fig_quant_layer_norm,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=OUT, help="output directory (default docs/figures)")
    parser.add_argument("--only", nargs="*", choices=sorted(FIGURES), help="these figures only")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        fig = FIGURES[name](plt, np.random.default_rng(RNG_SEED))
        path = args.out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
