"""``python -m pynorm``: the depth demo, the per-op self-test, the registry, the CPU benchmark.

Subcommands:

* (none) or ``demo`` -- the depth demo (:mod:`pynorm.demo`): Post-LN, Pre-LN, Sandwich and
  DeepNorm stacks of depths 6 to 384, gradient norms per layer at initialisation, a few hundred
  Adam steps on a synthetic sort task, a figure, a JSON and a table (``demo --help``);
* ``selftest`` -- for each op, backend and dtype: forward and backward on a
  random input, the largest error against the ``numpy`` reference (relative to
  the largest reference value of that tensor), and a float64 gradient check of
  the backend's backward against finite differences;
* ``backends`` -- the registry: every backend, its availability and its ops;
* ``bench`` -- the CPU benchmark (:mod:`pynorm.bench`; ``bench --help``);
* ``check MODULE:FUNCTION --op OP`` -- check your implementation of an op against the reference over the
  conformance grid, with diagnoses (:mod:`pynorm.oracle`; ``check --help``, ``docs/oracle.md``);
* ``vectors --out DIR`` -- write golden vectors (``vectors --help``);
* ``warmup [--ops ...] [--dtypes ...] [--jobs N]`` -- compile the numba kernels ahead of time, with progress
  (:mod:`pynorm.warmup`; ``warmup --help``).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import pynorm
from pynorm.ops import SPECS
from pynorm.testing import check_grads


def _converters(name: str) -> tuple[Any, Any]:
    info = pynorm._registry.get_backend(name)
    if info.array_module == "cupy":
        import cupy

        to_dev, to_host = cupy.asarray, cupy.asnumpy
    else:
        to_dev, to_host = np.asarray, np.asarray
    # None (an absent optional input: a float x's x_scale) stays None
    return (lambda a: None if a is None else to_dev(a)), (lambda a: None if a is None else to_host(a))


def _dtypes() -> list[Any]:
    out: list[Any] = [np.float16, np.float32, np.float64]
    try:
        import ml_dtypes

        out.insert(1, ml_dtypes.bfloat16)
    except ImportError:
        pass
    return out


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def selftest(
    rows: int = 64,
    hidden: int = 384,
    backends: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    op_names: tuple[str, ...] | None = None,
) -> int:
    """Every op (or ``op_names``) on every available backend (or ``backends``) and dtype (or ``dtypes``) against
    the reference; a float64 gradient check of each backend's backward. Returns 1 if a gradient check fails."""
    known = {b.name for b in pynorm.list_backends()}
    for what, given, allowed in (("backend", backends, known), ("op", op_names, set(SPECS))):
        bad = sorted(set(given or ()) - allowed)
        if bad:
            raise SystemExit(f"selftest: unknown {what}(s) {', '.join(bad)} (known: {', '.join(sorted(allowed))})")
    all_dtypes = _dtypes()
    chosen = [d for d in all_dtypes if dtypes is None or np.dtype(d).name in dtypes]
    if dtypes is not None and len(chosen) != len(set(dtypes)):
        names = ", ".join(np.dtype(d).name for d in all_dtypes)
        raise SystemExit(f"selftest: --dtypes must name some of {names}, got {', '.join(dtypes)}")
    print(f"pynorm {pynorm.__version__}: every op on every available backend vs the numpy reference")
    for info in pynorm.list_backends():
        state = "available" if info.available else f"unavailable: {info.reason}"
        print(f"  backend {info.name:6s} ({info.array_type}, priority {info.priority}): {state}")
    print(f"\ninput {rows}x{hidden}, N(0,1) + 3; errors are max|a - ref| / max|ref| per tensor;")
    print("ms = one forward + backward, including JIT compilation on a backend's first call of a dtype")
    if len(all_dtypes) < 4:
        print("(bfloat16 rows need ml_dtypes: pip install ml_dtypes)")
    header = (
        f"{'op':19s} {'backend':8s} {'dtype':9s} {'y':>9s} {'dx':>9s} {'dparams':>9s} {'ms':>7s}  gradcheck(float64)"
    )
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    failures = 0
    for op, spec in SPECS.items():
        if op_names is not None and op not in op_names:
            continue
        fwd, bwd = spec.generic_forward(), getattr(pynorm, f"{op}_backward")
        # which arguments after x a gradient check perturbs (not integer ids)
        diff = [i.differentiable for i in spec.inputs] + [True] * len(spec.params)
        multi = len(spec.outputs) > 1
        # the "channels" ops read x as (N, C, *spatial), with their first test case's options (num_groups...)
        channels = spec.layout == "channels"
        opts = dict(spec.cases[0]) if channels else {}
        shape = (max(rows // 8, 2), 8, max(hidden // 8, 2)) if channels else (rows, hidden)
        small_shape = (3, 4, 5) if channels else (3, 7)
        ax = 1 if channels else -1
        for info in pynorm.list_backends():
            if not info.available or op not in info.ops or (backends is not None and info.name not in backends):
                continue
            to_dev, to_host = _converters(info.name)
            for dt in chosen:
                x = (rng.standard_normal(shape) + 3).astype(dt)
                args = spec.example_args(x.shape, ax, dt, rng)
                yshape = spec.output_shape(x.shape, ax, dict(zip((*spec.input_names, *spec.param_names), args)))
                dy = rng.standard_normal(yshape).astype(dt)
                y_ref, c_ref = fwd(x, *args, backend="numpy", **opts)
                g_ref = bwd(dy, c_ref)
                t0 = time.perf_counter()
                y, c = fwd(to_dev(x), *map(to_dev, args), backend=info.name, **opts)
                g = bwd(to_dev(dy), c)
                ms = (time.perf_counter() - t0) * 1e3
                if multi and isinstance(y, tuple):  # (y, h, ...): y is compared, the others are checked by the tests
                    y, y_ref = y[0], y_ref[0]
                ey, edx = _rel(to_host(y), y_ref), _rel(to_host(g[0]), g_ref[0])
                pairs = [(a, b) for a, b in zip(g[1:], g_ref[1:], strict=True) if b is not None]
                ep = max((_rel(to_host(a), b) for a, b in pairs), default=0.0)
                grad = ""
                if np.dtype(dt) == np.float64:
                    xs = rng.standard_normal(small_shape)
                    small = spec.example_args(xs.shape, ax, np.float64, rng)
                    fixed = {i: a for i, (a, d) in enumerate(zip(small, diff, strict=True)) if not d}

                    def f(
                        x_: Any, *free: Any, _fwd: Any = fwd, _n: str = info.name, _d: Any = to_dev,
                        _h: Any = to_host, _fixed: dict = fixed, _k: int = len(small), _multi: bool = multi,
                        _o: dict = opts,
                    ) -> Any:  # fmt: skip
                        it = iter(free)
                        full = [_fixed[i] if i in _fixed else next(it) for i in range(_k)]
                        yy, cc = _fwd(_d(x_), *map(_d, full), backend=_n, **_o)
                        return _h(yy[0] if _multi and isinstance(yy, tuple) else yy), cc

                    def b(dyy: Any, cc: Any, _bwd: Any = bwd, _d: Any = to_dev, _h: Any = to_host) -> Any:
                        return [None if gg is None else _h(gg) for gg in _bwd(_d(dyy), cc)]

                    free = [a for a, d in zip(small, diff, strict=True) if d]
                    rep = check_grads(f, b, [xs, *free])
                    grad = f"{'PASSED' if rep.passed else 'FAILED'} (max rel err {rep.max_directional_error:.1e})"
                    failures += not rep.passed
                print(
                    f"{op:19s} {info.name:8s} {np.dtype(dt).name:9s} {ey:9.1e} {edx:9.1e} {ep:9.1e} {ms:7.2f}  {grad}"
                )
    print("\nops per backend:", ", ".join(f"{k}: {'/'.join(v)}" for k, v in pynorm.list_ops().items()))
    return 1 if failures else 0


#: the subcommands and what each does (``python -m pynorm --help``)
COMMANDS = {
    "demo": "the depth demo (the default): Post-LN, Pre-LN, Sandwich and DeepNorm stacks, gradient norms at "
    "initialisation and training (demo --help)",
    "selftest": "every op on every available backend and dtype against the numpy reference, with a float64 "
    "gradient check of each backward",
    "backends": "the backend registry: every backend, whether it runs here (and why not), its ops",
    "bench": "the CPU benchmark of the numba backend against copy bandwidth, PyTorch and NumPy (bench --help)",
    "check": "check your implementation of an op against the reference over the conformance grid, with "
    "diagnoses (check --help)",
    "vectors": "write golden vectors (inputs, outputs, gradients, a JSON Schema) for other languages (vectors --help)",
    "warmup": "compile the numba backend's kernels ahead of time (ops x dtypes, forward and backward), with "
    "progress (warmup --help)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pynorm",
        description="pynorm: LayerNorm, RMSNorm and their relatives with hand-written forward and backward. "
        "Without a command: the depth demo.",
    )
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        p = subs.add_parser(name, help=text, description=text, add_help=name in ("selftest", "backends"))
        if name == "selftest":
            p.add_argument("--rows", type=int, default=64, help="rows of each input (default 64)")
            p.add_argument("--hidden", type=int, default=384, help="hidden size of each input (default 384)")
            p.add_argument("--backends", default="", help="comma-separated backends (default: every available one)")
            p.add_argument("--dtypes", default="", help="comma-separated dtypes (default: the four float dtypes)")
            p.add_argument("--ops", default="", help="comma-separated ops (default: every op)")
    return parser


def _names(s: str) -> tuple[str, ...] | None:
    return tuple(v.strip() for v in s.split(",") if v.strip()) or None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # demo, bench, check, vectors and warmup parse their own options (``<command> --help``)
    if argv and argv[0] in ("check", "vectors"):
        from .oracle import cli

        return cli.check_main(argv[1:]) if argv[0] == "check" else cli.vectors_main(argv[1:])
    if argv and argv[0] == "warmup":
        from . import warmup

        return warmup.main(argv[1:])
    if argv and argv[0] == "bench":
        from . import bench

        return int(bench.main(argv[1:]) or 0)
    if not argv or argv[0] == "demo" or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        from . import demo

        return int(demo.main(argv[1:] if argv and argv[0] == "demo" else argv) or 0)
    args = _parser().parse_args(argv)
    if args.command == "backends":
        for info in pynorm.list_backends():
            print(f"{info.name}: {info.array_type}, priority {info.priority}, available={info.available}", end="")
            print(f" ({info.reason})" if info.reason else "", f"ops: {', '.join(info.ops) or '-'}")
        return 0
    if args.rows < 1 or args.hidden < 1:
        raise SystemExit("selftest: --rows and --hidden must be at least 1")
    return selftest(args.rows, args.hidden, _names(args.backends), _names(args.dtypes), _names(args.ops))


if __name__ == "__main__":
    sys.exit(main())
