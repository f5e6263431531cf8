"""Step time of a small MLP trained with ``pynorm.jax`` ops against the same model in pure JAX (docs/jax.md).

The model: ``depth`` blocks of ``tanh(h @ W)`` then a norm (LayerNorm with weight and bias, RMSNorm with a weight,
alternating), a linear head and a mean-squared loss; one step is ``jax.jit(jax.value_and_grad(loss))`` plus an SGD
update of every parameter, waited for (``block_until_ready``). The first step (trace, compile, and for pynorm the
first run of its kernels) is reported apart from the steady ones (the median of ``--steps``).

    python bench/bench_jax.py --batch 8 256 --width 256 --depth 4 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import pynorm
import pynorm.jax as pj


def _ln(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    m = x.mean(-1, keepdims=True)
    v = jnp.square(x - m).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * w + b


def _rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * w


NORMS = {
    "pynorm.jax": (lambda x, w, b: pj.layer_norm(x, w, b), lambda x, w: pj.rms_norm(x, w, eps=1e-6)),
    "pure JAX": (_ln, _rms),
}


def make(width: int, depth: int, batch: int, seed: int = 0) -> tuple[dict[str, Any], Any, Any]:
    keys = iter(jax.random.split(jax.random.key(seed), 3 * depth + 3))
    p: dict[str, Any] = {}
    for i in range(depth):
        p[f"W{i}"] = jax.random.normal(next(keys), (width, width)) / width**0.5
        p[f"g{i}"] = jnp.ones(width)
        if i % 2 == 0:
            p[f"b{i}"] = jnp.zeros(width)
    p["head"] = jax.random.normal(next(keys), (width, 8)) / width**0.5
    return p, jax.random.normal(next(keys), (batch, width)), jax.random.normal(next(keys), (batch, 8))


def step_fn(kind: str, depth: int) -> Any:
    ln, rms = NORMS[kind]

    def loss(p: dict[str, Any], x: Any, t: Any) -> Any:
        h = x
        for i in range(depth):
            h = jnp.tanh(h @ p[f"W{i}"])
            h = ln(h, p[f"g{i}"], p[f"b{i}"]) if i % 2 == 0 else rms(h, p[f"g{i}"])
        return jnp.mean(jnp.square(h @ p["head"] - t))

    grad = jax.value_and_grad(loss)

    @jax.jit
    def step(p: dict[str, Any], x: Any, t: Any) -> tuple[Any, dict[str, Any]]:
        value, g = grad(p, x, t)
        return value, jax.tree.map(lambda a, b: a - 0.05 * b, p, g)

    return step


def measure(kind: str, width: int, depth: int, batch: int, steps: int) -> dict[str, float]:
    p, x, t = make(width, depth, batch)
    step = step_fn(kind, depth)
    t0 = time.perf_counter()
    _, p = jax.block_until_ready(step(p, x, t))
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, p = jax.block_until_ready(step(p, x, t))
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "step_ms": 1e3 * statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    backend = pynorm._registry.resolve_family("layer_norm", ("numpy", "ndarray"), ("x",))[0]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; pynorm backend {backend}; width {a.width}, "
          f"depth {a.depth}")  # fmt: skip
    rows = []
    for batch in a.batch:
        for kind in NORMS:
            r = measure(kind, a.width, a.depth, batch, a.steps)
            rows.append({"batch": batch, "kind": kind, **r})
            print(f"batch {batch:5d}  {kind:11s}  step {r['step_ms']:8.3f} ms   first step {r['first_s']:6.2f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
