"""``python -m pynorm check`` and ``python -m pynorm vectors`` (the command-line glue of :mod:`pynorm.oracle`).

Exit status of ``check``: 0 when no cell fails (tier ``fail``; with ``--strict`` also ``stable``) nor raises and
the rows are batch-invariant, 1 otherwise, 2 for a usage error (an unimportable target, an unknown op, a bad
``--budget`` or ``--convention``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import shlex
import sys
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError, PynormError, PynormWarning

__all__ = ["check_main", "load_target", "parse_conventions", "vectors_main"]


class UsageError(Exception):
    """A command-line mistake: printed, exit status 2."""


def load_target(spec: str, what: str = "target") -> Callable[..., Any]:
    """The callable named by ``MODULE:FUNCTION`` (``pkg.mod:f``, or ``path/to/file.py:f``; ``f`` may be
    dotted, ``mod:Class.method``). The current directory is importable, as with ``python -m``."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"{what} must be MODULE:FUNCTION (e.g. mykernels.ln:forward), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if mod_name.endswith(".py") or os.sep in mod_name:
            path = os.path.abspath(mod_name)
            loader_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            if loader_spec is None or loader_spec.loader is None or not os.path.exists(path):
                raise ImportError(f"no file {path}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:  # anything the import raises is the user's target not importing
        raise UsageError(f"{what} {spec!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what} {spec!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{what} {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def parse_conventions(items: list[str] | None, flag: str = "--convention") -> dict[str, Any]:
    """``["eps=1e-6", "eps_mode=std", "residual_dtype=None"]`` as a dict (values as Python literals where they
    parse as one, else strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        for part in filter(None, (p.strip() for p in item.split(","))):
            if "=" not in part:
                raise UsageError(f"{flag} expects key=value, got {part!r}")
            k, v = (s.strip() for s in part.split("=", 1))
            try:
                out[k] = ast.literal_eval(v)
            except (ValueError, SyntaxError):
                out[k] = v
    return out


def _check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pynorm check",
        description="Check your implementation of an op against pynorm's reference over the conformance grid "
        "(docs/oracle.md). Each cell is exact, stable (within what a backward-stable algorithm may lose) or FAIL. "
        "Exit status 0: no cell fails (--strict: every cell exact) and the rows are batch-invariant; 1: otherwise; "
        "2: usage error.",
    )
    p.add_argument("target", help="your forward, MODULE:FUNCTION: f(x, *inputs, *params, **conventions) -> y")
    p.add_argument("--op", help="the op it implements (python -m pynorm backends lists them)")
    p.add_argument(
        "--quant",
        metavar="FORMAT",
        help="check an FP8/FP4 quantizer instead, f(y) -> (codes, scales[, global_scale]) (with --op: a fused norm + "
        "quantize, f(x, *inputs, *params, **conventions)): fp8_e4m3, fp8_e5m2, mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4 "
        "(docs/norms/quantized_outputs.md)",
    )
    p.add_argument(
        "--quant-option",
        action="append",
        metavar="KEY=VALUE",
        help="a QuantSpec option of --quant (repeatable): scale_rule=ceil, scaling=group, group_size=128",
    )
    p.add_argument(
        "--backward", metavar="MODULE:FUNCTION", help="your backward: b(dy, x, *inputs, *params, **conventions)"
    )
    p.add_argument(
        "--convention",
        action="append",
        metavar="KEY=VALUE",
        help="an option of the op, passed to your functions and to the reference (repeatable): eps=1e-6",
    )
    p.add_argument(
        "--reference",
        action="append",
        metavar="KEY=VALUE",
        help="an option for the reference only, not passed to your functions (repeatable): casting=llama",
    )
    p.add_argument("--budget", metavar="NAME=ULPS,...", help="budgets in ulps, e.g. y=4,dx=16 or float16:y=2")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    p.add_argument("--quick", action="store_true", help="the small grid (seconds)")
    p.add_argument("--dtypes", help="comma-separated dtypes to check (default all four)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="cells of tier 'stable' (beyond the exact budget, within what a backward-stable algorithm may lose) "
        "fail too",
    )
    p.add_argument(
        "--no-batch-invariance",
        action="store_true",
        help="skip the batch invariance check (each row's outputs bitwise the same in batches of other sizes)",
    )
    p.add_argument("--failures-only", action="store_true", help="print only the cells that are not exact")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0)
    return p


def check_main(argv: list[str]) -> int:
    """``python -m pynorm check ...``; returns the exit status."""
    from ..ops import SPECS
    from .evaluate import parse_budget
    from .runner import check, validate_options

    parser = _check_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if args.quant is not None:
        return _quant_main(args)
    try:
        if args.op is None:
            raise UsageError("--op (or --quant) is required")
        if args.op not in SPECS:
            raise UsageError(f"--op: no op named {args.op!r} (ops: {', '.join(SPECS)})")
        budgets = parse_budget(args.budget)
        conv = parse_conventions(args.convention)
        ref = parse_conventions(args.reference, "--reference")
        spec = SPECS[args.op]
        try:
            validate_options(spec, conv, "--convention")
            validate_options(spec, ref, "--reference")
            validate_options(spec, {**conv, **ref}, "--reference")
        except ArgumentError as e:
            raise UsageError(str(e)) from None
        dtypes = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else None
        if dtypes:
            bad = [d for d in dtypes if d not in ("float16", "bfloat16", "float32", "float64")]
            if bad:
                raise UsageError(f"--dtypes: unknown dtype(s) {', '.join(bad)} (float16, bfloat16, float32, float64)")
        forward = load_target(args.target)
        backward = load_target(args.backward, "--backward") if args.backward else None
    except (UsageError, PynormError, TypeError) as e:
        print(f"python -m pynorm check: error: {e}", file=sys.stderr)
        return 2
    report = check(
        args.op,
        forward,
        backward,
        conventions=conv,
        reference=ref,
        budget=budgets,
        grid="quick" if args.quick else "default",
        dtypes=dtypes,
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
        target=args.target + (f", backward {args.backward}" if args.backward else ""),
        strict=args.strict,
        batch_invariance=False if args.no_batch_invariance else None,
    )
    command = "python -m pynorm check " + shlex.join(a for a in argv if a != "--no-progress")
    for advice in report.advice:
        advice.command = command
    print("\n".join(report.lines(cli=True, only_failures=args.failures_only)))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0 if report.passed else 1


def _quant_main(args: argparse.Namespace) -> int:
    """``python -m pynorm check MODULE:FUNCTION --quant FORMAT [--quant-option K=V ...] [--op OP]``: a quantizer of
    ``y``, or with ``--op`` a fused norm + quantize of ``x`` (``--convention``: the norm's options)."""
    from ..ops.fp_quant import QuantSpec
    from .quant_check import check_quantizer

    try:
        spec = QuantSpec(args.quant, **parse_conventions(args.quant_option, "--quant-option"))
        fn = load_target(args.target)
        conv = parse_conventions(args.convention)
    except (UsageError, PynormError, TypeError) as e:
        print(f"python -m pynorm check: error: {e}", file=sys.stderr)
        return 2
    try:
        report = check_quantizer(fn, spec, op=args.op, conventions=conv, seed=args.seed)
    except ArgumentError as e:
        print(f"python -m pynorm check: error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.passed else 1


def vectors_main(argv: list[str]) -> int:
    """``python -m pynorm vectors --out DIR [--format npz|json] [--ops ...]`` (or ``--verify DIR``)."""
    from .vectors import LARGE_HIDDEN, verify_vectors, write_vectors

    p = argparse.ArgumentParser(
        prog="python -m pynorm vectors",
        description="Write versioned golden vectors of pynorm's reference (inputs, outputs, gradients, conventions, "
        "tolerances; schema: vectors.schema.json), or --verify a directory of them against the reference.",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", metavar="DIR", help="directory to write to")
    g.add_argument("--verify", metavar="DIR", help="recompute the vectors of DIR (or one file) with the reference")
    p.add_argument("--format", choices=["json", "npz"], default="json")
    p.add_argument("--ops", nargs="*", help="ops to write (default: every op); fp_quant: the FP8 / FP4 quantizer's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--large-hidden",
        type=int,
        default=LARGE_HIDDEN,
        metavar="H",
        help=f"H of the large-H vectors, one offset row per dtype (default {LARGE_HIDDEN}; 0: none)",
    )
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.verify:
            problems = verify_vectors(args.verify, exact=True)
            for line in problems:
                print(line)
            print(f"{'OK' if not problems else 'DIFFERENT'}: {len(problems)} differences from the reference")
            return 1 if problems else 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PynormWarning)
            files = write_vectors(args.out, args.ops, fmt=args.format, seed=args.seed, large_hidden=args.large_hidden)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    except (PynormError, OSError, ArgumentError) as e:
        print(f"python -m pynorm vectors: error: {e}", file=sys.stderr)
        return 2
    total = sum(os.path.getsize(f) for f in files)
    print(f"wrote {len(files)} files ({total / 1024:.0f} KiB) and index.json, vectors.schema.json to {args.out}")
    return 0
