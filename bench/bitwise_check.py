"""Record a backend's outputs bitwise, and compare a later version of the code against the record.

    python bench/bitwise_check.py save FILE [--backend numba] [--threads N] [--quick]
    python bench/bitwise_check.py compare FILE [--backend numba] [--threads N] [--quick] [--split]

Runs the kernel families' rows-layout ops of :data:`pynorm.ops.SPECS` (or those of ``--ops``; GroupNorm, InstanceNorm
and BatchNorm, of the channels layout, are not recorded yet) through the public API
(``pynorm.<op>_forward(..., backend=...)`` / ``<op>_backward``) over a fixed table of cases and records ``y``,
the ctx's per-row statistics (``mean``/``rstd``), ``dx`` and every parameter gradient:

* the benchmark shapes (8192x1024, 4096x4096, 2048x8192, 65536x128, 16x65536) in float32 with the
  default conventions, at full size (large float32 outputs take the streaming stores);
* reduced row counts of the same hidden sizes in every dtype, every convention of the op's spec and
  every subset of the parameters, on both backward paths (fused by row blocks; by rows then by
  column tiles for few rows of many elements), plus a 16 MiB float32 case per convention (streamed);
* hard inputs in every dtype: rows offset by 1e4 (100 for half types), huge (near the dtype's max),
  tiny, constant rows, H = 1 and 3, rows of NaN/Inf beside normal ones, and float64 extreme rows
  (+-max, offsets near the max, offsets 1e10 times the spread, 1e-200 rows);
* the quantize family (``quant_layer_norm``): every output mode (float, per-tensor and per-row int8, a given
  ``out_scale``, clipping) in every convention, for float inputs of every dtype and int8 inputs (per-row and
  scalar ``x_scale``, scales far from 1), on the reduced shapes and the hard inputs (and, for int8, constant,
  saturated and all-zero rows); its records also hold the output scale ``s`` and the clip mask;
* the casting policies of the ops that have them (``casting=``: ``gemma``, ``llama``, ``t5``, ``apex``, ``none``;
  LayerNorm, RMSNorm): every convention on three shapes (the fused backward's row blocks, a few rows of 4096 and
  of 9000) in every dtype, with the weight and bias in ``x``'s dtype and in the other width (a float32 ``x``
  with float16 and bfloat16 parameters: ``t5``'s rounding to the weight's dtype), and the hard inputs.

``save`` writes, per output, a digest of its bits, its dtype and shape, and the output itself when it is at most
:data:`FULL_BYTES`, else an evenly strided sample of about :data:`SAMPLE` of its elements (a ``.npz`` archive;
the quick table's 49746 outputs took 19 GB whole). ``compare`` recomputes them and reports, per output, whether
it is bitwise identical (its digest) and otherwise the largest difference in ulps of the output dtype (at the
element's own magnitude) and how many elements differ -- of the sample, for a sampled output (one whose sample
is identical is reported as differing outside it). A record of the older layout (every output whole) is still
read. Exit status 1 when anything differs. ``--threads`` caps the backend's threads (``pynorm.set_num_threads``), so the
same record checks independence of the thread count. ``--split`` sends every numba call that can take the
split kernels (few wide rows, :mod:`pynorm.backends.numba._split_kernels`) to them, so the record of the plain
kernels checks that they give the same bits.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pynorm
from pynorm.ops import SPECS

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

DTYPES = [np.dtype(np.float16), *([BF16] if BF16 is not None else []), np.dtype(np.float32), np.dtype(np.float64)]
BENCH_SHAPES = [(8192, 1024), (4096, 4096), (2048, 8192), (65536, 128), (16, 65536)]
# reduced rows, same hidden sizes: fused backward (>= 128 rows) and the column-tile path (few rows)
SMALL_SHAPES = [(256, 1024), (40, 4096), (130, 8192), (2048, 128), (16, 65536), (5, 9000), (300, 257)]
STREAM_SHAPE = (1024, 4096)  # 16 MiB of float32: streamed y and dx
HARD_KINDS = ("offset", "huge", "tiny", "constant", "mixed")
HARD_SHAPES = [(300, 257), (9, 4000), (4, 1), (7, 3), (16, 65536), (130, 1024)]
F64_EXTREME = ("near_max", "max_offset", "huge_offset", "very_tiny")
#: the families recorded (every op of these, or those of ``--ops``)
FAMILIES = ("stats", "elementwise", "quantize")
#: the quantize family's output modes (options beside the convention)
QUANT_MODES: list[dict[str, Any]] = [
    {},
    {"quantize": "tensor"},
    {"quantize": "row"},
    {"out_scale": 0.02},  # clips where |y| > 127.5 * 0.02
    {"quantize": "tensor", "out_scale": 0.05},
]
INT8 = np.dtype(np.int8)
#: int8 inputs: random codes, then rows the int8 path treats apart (constant, saturated at +-127, all zero)
INT8_KINDS = ("bench", "int8_constant", "int8_saturated", "int8_zero")
#: the int8 inputs' scales: one per row near 0.01, one scalar, per-row scales far from 1 (the float32 dequantize
#: and the float64 fallback of the backward)
INT8_SCALES = ("row", "scalar", "wide")


def _name(dt: Any) -> str:
    return np.dtype(dt).name


def _data(shape: tuple[int, int], dt: Any, seed: int, kind: str = "bench") -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    rows, h = shape
    if dt == INT8:
        return _int8_data(shape, rng, kind)
    if kind == "bench":
        x = rng.standard_normal(shape) + 3
    elif kind in ("offset", "huge", "tiny", "constant"):
        x = pynorm.testing.make_input(kind, shape, dt, rng).astype(np.float64)
    elif kind == "mixed":  # hard rows among normal ones, in one array
        x = rng.standard_normal(shape) * 2 + 1
        big = float(np.finfo(np.float16).max if dt == np.float16 else 1e38 if dt.itemsize <= 4 else 1e307)
        off = 1e4 if dt.itemsize >= 4 else 100.0
        for i in range(rows):
            k = i % 7
            if k == 1:
                x[i] = off + rng.standard_normal(h)
            elif k == 2:
                x[i] = np.clip(rng.standard_normal(h), -1, 1) * big * 0.9
            elif k == 3:
                x[i] = 2.5
            elif k == 4:
                x[i] *= 1e-30 if dt.itemsize >= 4 and dt != np.float16 else 1e-4
            elif k == 5 and h > 2:
                x[i, ::3] = big * 0.5
        if rows > 6 and h > 5:
            x[6, 5] = np.nan
        if rows > 13 and h > 2:
            x[13, 2] = np.inf
    elif kind == "near_max":
        x = np.clip(rng.standard_normal(shape), -1.0, 1.0) * float(np.finfo(np.float64).max)
    elif kind == "max_offset":
        x = 1e308 + np.clip(rng.standard_normal(shape), -1.0, 1.0) * 5e307
    elif kind == "huge_offset":
        x = 1e300 + rng.standard_normal(shape) * 1e290
    elif kind == "very_tiny":
        x = rng.standard_normal(shape) * 1e-200
    else:
        raise KeyError(kind)
    dy = rng.standard_normal(shape)
    w = 1 + 0.5 * rng.standard_normal(h)
    b = 0.5 * rng.standard_normal(h)
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dt), dy.astype(dt), w.astype(dt), b.astype(dt)


def _int8_data(shape: tuple[int, int], rng: Any, kind: str) -> tuple[np.ndarray, ...]:
    rows, h = shape
    x = rng.integers(-127, 128, shape)
    if kind == "int8_constant":
        x[:] = rng.integers(-127, 128, (rows, 1))
    elif kind == "int8_saturated":
        x = np.where(rng.random(shape) < 0.5, -127, 127)
    elif kind == "int8_zero":
        x[::2] = 0
    elif kind != "bench":
        raise KeyError(kind)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(h)).astype(np.float32)
    b = (0.5 * rng.standard_normal(h)).astype(np.float32)
    return x.astype(np.int8), dy, w, b


def _x_scale(rows: int, how: str, rng: Any) -> Any:
    if how == "row":
        return rng.uniform(0.005, 0.02, rows)
    if how == "scalar":
        return 0.0125
    return np.exp2(rng.integers(-80, 80, rows).astype(np.float64)) * rng.uniform(0.5, 1.0, rows)


#: the casting policies recorded (beside the default, ``"fp32"``, which every other case takes) and their shapes
CASTINGS = ("gemma", "llama", "t5", "apex", "none")
CAST_SHAPES = [(300, 257), (40, 4096), (5, 9000)]
#: a data kind's suffix giving the parameters' dtype (the casting cases' mixed widths)
_WDT = "#w="


def _param_subsets(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [names]
    for n in names:
        out.append((n,))
    out.append(())
    return list(dict.fromkeys(out))


Case = tuple[str, str, tuple[int, int], Any, str, dict[str, Any], tuple[str, ...]]


def cases(quick: bool = False, ops: tuple[str, ...] = ()) -> Iterator[Case]:
    """``(key, op, shape, dtype, data kind, options, parameters given)`` of every recorded case (of ``ops``, or of
    every op of :data:`FAMILIES`). The quantize family's data kind of an int8 ``x`` ends in ``@<x_scale kind>``
    (:data:`INT8_SCALES`)."""
    for op, spec in SPECS.items():
        if (op not in ops) if ops else (spec.family not in FAMILIES or spec.layout != "rows"):
            continue  # (the channels-layout ops read (N, C, *spatial): their record is not written yet)
        if spec.family == "quantize":
            yield from _quant_cases(op, spec)
        else:
            yield from _norm_cases(op, spec, quick)


def _norm_cases(op: str, spec: Any, quick: bool) -> Iterator[Case]:
    f32 = np.dtype(np.float32)
    full = spec.param_names
    for shape in BENCH_SHAPES if not quick else []:
        yield f"{op}/bench/{shape[0]}x{shape[1]}", op, shape, f32, "bench", {}, full
    for dt in DTYPES:
        for shape in SMALL_SHAPES:
            for ci, conv in enumerate(spec.cases):
                if conv.get("correction", 0) >= shape[1]:
                    continue
                subsets = _param_subsets(full) if ci == 0 else [full]
                for ps in subsets:
                    key = f"{op}/small/{_name(dt)}/{shape[0]}x{shape[1]}/c{ci}/{'+'.join(ps) or 'none'}"
                    yield key, op, shape, dt, "bench", conv, ps
        for kind in HARD_KINDS:
            for shape in HARD_SHAPES:
                for ci, conv in enumerate(spec.cases):
                    if conv.get("correction", 0) >= shape[1]:
                        continue
                    key = f"{op}/hard/{_name(dt)}/{kind}/{shape[0]}x{shape[1]}/c{ci}"
                    yield key, op, shape, dt, kind, conv, full
    for ci, conv in enumerate(spec.cases):
        if not quick:
            key = f"{op}/stream/{STREAM_SHAPE[0]}x{STREAM_SHAPE[1]}/c{ci}"
            yield key, op, STREAM_SHAPE, f32, "bench", conv, full
    f64 = np.dtype(np.float64)
    for kind in F64_EXTREME:
        for shape in [(4, 1), (4, 3), (131, 257), (9, 4096), (4, 65536)]:
            for ci, conv in enumerate(spec.cases):
                if conv.get("correction", 0) >= shape[1]:
                    continue
                yield f"{op}/f64x/{kind}/{shape[0]}x{shape[1]}/c{ci}", op, shape, f64, kind, conv, full
    if any(o.name == "casting" for o in spec.options):
        yield from _casting_cases(op, spec)


def _casting_cases(op: str, spec: Any) -> Iterator[Case]:
    full = spec.param_names
    for pol in CASTINGS:
        for dt in DTYPES:
            others = [np.dtype(np.float16), *([BF16] if BF16 is not None else [])] if dt.itemsize == 4 else []
            for wdt in [dt, *others, *([np.dtype(np.float32)] if dt.itemsize == 2 else [])]:
                for shape in CAST_SHAPES:
                    for ci, conv in enumerate(spec.cases):
                        key = f"{op}/cast/{pol}/{_name(dt)}/w{_name(wdt)}/{shape[0]}x{shape[1]}/c{ci}"
                        yield key, op, shape, dt, f"bench{_WDT}{_name(wdt)}", {**conv, "casting": pol}, full
            for kind in HARD_KINDS:
                for shape in HARD_SHAPES[:4]:
                    key = f"{op}/cast/{pol}/hard/{_name(dt)}/{kind}/{shape[0]}x{shape[1]}"
                    yield key, op, shape, dt, kind, {"casting": pol}, full


def _quant_cases(op: str, spec: Any) -> Iterator[Case]:
    full = spec.param_names
    for dt in [*DTYPES, INT8]:
        for shape in SMALL_SHAPES:
            for ci, conv in enumerate(spec.cases):
                if conv.get("correction", 0) >= shape[1]:
                    continue
                for qi, qm in enumerate(QUANT_MODES if ci == 0 else QUANT_MODES[:3]):
                    subsets = _param_subsets(full) if ci == 0 and qi == 2 else [full]
                    for ps in subsets:
                        tag = "+".join(ps) or "none"
                        kinds = [f"bench@{how}" for how in INT8_SCALES] if dt == INT8 else ["bench"]
                        for kind in kinds if (ci == 0 and ps == full) else kinds[:1]:
                            key = f"{op}/small/{_name(dt)}/{shape[0]}x{shape[1]}/c{ci}/q{qi}/{tag}/{kind}"
                            yield key, op, shape, dt, kind, {**conv, **qm}, ps
        hard = [f"{k}@row" for k in INT8_KINDS[1:]] if dt == INT8 else list(HARD_KINDS)
        for kind in hard:
            for shape in HARD_SHAPES:
                for ci, conv in enumerate(spec.cases):
                    if conv.get("correction", 0) >= shape[1]:
                        continue
                    for qi in (0, 1, 2, 3) if ci == 0 else (2,):
                        key = f"{op}/hard/{_name(dt)}/{kind}/{shape[0]}x{shape[1]}/c{ci}/q{qi}"
                        yield key, op, shape, dt, kind, {**conv, **QUANT_MODES[qi]}, full


def run_case(
    backend: str, op: str, shape: tuple[int, int], dt: Any, kind: str, conv: dict[str, Any], ps: tuple[str, ...]
) -> dict[str, np.ndarray]:
    spec = SPECS[op]
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(f"{op}{shape}{_name(dt)}{kind}")) % (1 << 31)
    kind, _, wname = kind.partition(_WDT)
    kind, _, scale_kind = kind.partition("@")
    x, dy, w, b = _data(shape, dt, seed, kind)
    if wname:  # the parameters in another dtype (their values rounded from x's dtype's)
        w, b = (a.astype(BF16 if wname == "bfloat16" else np.dtype(wname)) for a in (w, b))
    rng = np.random.default_rng(seed + 1)
    pdt = np.dtype(np.float32) if dt == INT8 else dt
    inputs = spec.example_inputs(shape, 1, pdt, rng, options=conv)
    if scale_kind:  # an int8 x: its row_scale input
        inputs = [_x_scale(shape[0], scale_kind, rng) if i.kind == "row_scale" else a
                  for i, a in zip(spec.inputs, inputs, strict=True)]  # fmt: skip
    others = dict(zip(spec.param_names, spec.example_params(shape[1:], pdt, rng, options=conv), strict=True))
    pool = {**others, **{p.name: {"weight": w, "bias": b}[p.name] for p in spec.params
                         if p.kind == "feature" and p.name in ("weight", "bias")}}  # fmt: skip
    params = [pool[p.name] if (p.name in ps or p.required) else None for p in spec.params]
    fwd = spec.generic_forward()
    bwd = getattr(pynorm, f"{op}_backward")
    with np.errstate(all="ignore"):
        y, ctx = fwd(x, *inputs, *params, backend=backend, **conv)
        ys = y if isinstance(y, tuple) else (y,)
        gdt = spec.grad_dtype(x.dtype)
        if ys[0].shape != x.shape or gdt != x.dtype:
            dy = rng.standard_normal(ys[0].shape).astype(gdt)
        grads = bwd(dy, ctx)
    out = {("y" if i == 0 else spec.outputs[i] if i < len(spec.outputs) else f"out{i}"): np.asarray(a)
           for i, a in enumerate(ys)}  # fmt: skip
    inner = ctx.inner
    for st in ("mean", "rstd", "scale", "keep"):
        if getattr(inner, st, None) is not None:
            out[st] = np.asarray(getattr(inner, st))
    for gname, g in zip(spec.grad_names, grads, strict=True):
        if g is not None:
            out[gname] = np.asarray(g)
    return out


#: outputs up to this many bytes are recorded whole; larger ones as a digest and a strided sample
FULL_BYTES = 1 << 16
#: about how many elements a sampled output's record keeps
SAMPLE = 1 << 13


def _digest(a: np.ndarray) -> str:
    """A digest of ``a``'s dtype, shape and value bits (:func:`_bits`)."""
    h = hashlib.blake2b(f"{_name(a.dtype)}{a.shape}".encode(), digest_size=20)
    h.update(np.ascontiguousarray(_bits(a)).tobytes())
    return h.hexdigest()


def _stored(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == BF16 else a


def record_entry(a: np.ndarray) -> dict[str, np.ndarray]:
    """The archive members of one output ``a`` (names relative to its key): the output or its sample, and its
    ``|dtype``, ``|shape``, ``|step`` (1: whole) and ``|digest``."""
    step = 1 if a.nbytes <= FULL_BYTES else -(-a.size // SAMPLE)
    flat = np.ascontiguousarray(a).reshape(-1)
    return {
        "": _stored(a if step == 1 else np.ascontiguousarray(flat[::step])),
        "|dtype": np.array(_name(a.dtype)),
        "|shape": np.array(a.shape, np.int64),
        "|step": np.array(step, np.int64),
        "|digest": np.array(_digest(a)),
    }


def compare_entry(a: np.ndarray, member: Any) -> str | None:
    """None when ``a`` is bitwise the recorded output, else what differs; ``member(suffix)`` reads the archive
    member of the output's key plus ``suffix`` (:func:`record_entry`'s names, or the older layout: the output
    and ``|dtype``)."""
    dtype = str(member("|dtype"))
    try:
        digest = str(member("|digest"))
    except KeyError:  # a record of the older layout: the output whole
        ref = member("")
        ref = ref.view(BF16) if dtype == "bfloat16" else ref
        if ref.dtype == a.dtype and ref.shape == a.shape and np.array_equal(_bits(a), _bits(ref)):
            return None
        if ref.shape != a.shape or ref.dtype != a.dtype:
            return f"shape/dtype {a.shape} {a.dtype} != {ref.shape} {ref.dtype}"
        u, cnt = ulp_diff(a, ref)
        return f"{cnt}/{a.size} elements differ, max {u:.3g} ulp"
    shape = tuple(int(v) for v in member("|shape"))
    if _name(a.dtype) != dtype or a.shape != shape:
        return f"shape/dtype {a.shape} {a.dtype} != {shape} {dtype}"
    if _digest(a) == digest:
        return None
    step = int(member("|step"))
    ref = member("")
    ref = ref.view(BF16) if dtype == "bfloat16" else ref
    mine = np.ascontiguousarray(a).reshape(-1)[::step].reshape(ref.shape)
    u, cnt = ulp_diff(mine, ref)
    if step == 1:
        return f"{cnt}/{a.size} elements differ, max {u:.3g} ulp"
    if cnt:
        return f"{cnt}/{mine.size} sampled elements (every {step}th of {a.size}) differ, max {u:.3g} ulp"
    if not np.array_equal(_bits(mine), _bits(ref)):
        return f"the sampled elements (every {step}th of {a.size}) differ in bits only (NaN payload or -0)"
    return f"differs outside its {mine.size} sampled elements (every {step}th of {a.size})"


def _put(zf: zipfile.ZipFile, name: str, a: np.ndarray) -> None:
    with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)


def _bits(a: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(a).view(np.uint8)
    if a.dtype == np.longdouble and _X87_PADDING:  # (the reference's float64 statistics: only 10 bytes are the value)
        return b.reshape(-1, a.dtype.itemsize)[:, :10]
    return b


#: numpy.longdouble is x87 80-bit extended stored in 12 or 16 bytes, the rest padding that NumPy leaves as it finds it
#: (a record of main compared with main itself differed there)
_X87_PADDING = np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize > 10


def ulp_diff(a: np.ndarray, ref: np.ndarray) -> tuple[float, int]:
    """Largest difference in ulps of ``ref``'s dtype at each element's magnitude; count of differing elements."""
    a64 = a.astype(np.float64)
    r64 = ref.astype(np.float64)
    diff = ~((a64 == r64) | (np.isnan(a64) & np.isnan(r64)))
    n = int(np.count_nonzero(diff))
    if not n:
        return 0.0, 0
    if ref.dtype == BF16:
        digits, tiny = 8, 2.0**-126
    else:
        fi = np.finfo(ref.dtype)
        digits, tiny = fi.nmant + 1, float(fi.tiny)
    mag = np.maximum(np.maximum(np.abs(a64), np.abs(r64)), tiny)
    ulp = np.exp2(np.floor(np.log2(mag)) - (digits - 1))
    with np.errstate(invalid="ignore"):
        d = np.abs(a64 - r64) / ulp
    d = np.where(np.isfinite(d), d, np.inf)
    return float(np.max(d[diff])), n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["save", "compare"])
    p.add_argument("file")
    p.add_argument("--backend", default="numba")
    p.add_argument("--threads", type=int, default=None, help="cap the backend's threads (pynorm.set_num_threads)")
    p.add_argument("--quick", action="store_true", help="skip the full-size benchmark shapes and streamed cases")
    p.add_argument(
        "--split",
        action="store_true",
        help="numba: every call whose rows may be split across threads takes the split kernels (compare them "
        "with a record of the plain kernels)",
    )
    p.add_argument("--only", default="", help="compare: only the cases whose key contains this string")
    p.add_argument("--ops", default="", help="comma-separated ops (default: the ops of the kernel families, FAMILIES)")
    args = p.parse_args(argv)
    if args.threads is not None:
        pynorm.set_num_threads(args.threads)
    if args.split:
        from pynorm.backends.numba import stats

        stats.FORCE_SPLIT = True
    print(f"pynorm from {pynorm.__file__}; backend {args.backend}; threads {pynorm.get_num_threads()}", flush=True)
    t0 = time.perf_counter()
    ops = tuple(o for o in args.ops.split(",") if o)
    unknown = [o for o in ops if o not in SPECS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; known: {', '.join(SPECS)}")
    unknown = [o for o in ops if SPECS[o].family not in FAMILIES or SPECS[o].layout != "rows"]
    if unknown:
        p.error(
            f"--ops: {', '.join(unknown)}: only the rows-layout ops of the kernel families ({', '.join(FAMILIES)}) "
            "are recorded"
        )
    if args.mode == "save":
        n = outputs = 0
        # written as it goes (the layout of numpy.savez: one .npy member per array), not held in memory
        with zipfile.ZipFile(args.file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for key, op, shape, dt, kind, conv, ps in cases(args.quick, ops):
                for out_name, a in run_case(args.backend, op, shape, dt, kind, conv, ps).items():
                    for suffix, m in record_entry(a).items():
                        _put(zf, f"{key}|{out_name}{suffix}", m)
                    outputs += 1
                n += 1
        print(f"saved {n} cases ({outputs} outputs) to {args.file} in {time.perf_counter() - t0:.0f} s")
        return 0
    rec = np.load(args.file)
    n = same = 0
    bad: list[str] = []
    missing = 0
    for key, op, shape, dt, kind, conv, ps in cases(args.quick, ops):
        if args.only not in key:
            continue
        res = run_case(args.backend, op, shape, dt, kind, conv, ps)
        for out_name, a in res.items():
            k = f"{key}|{out_name}"
            if k not in rec:
                missing += 1
                bad.append(f"{k}: not in the record")
                continue
            n += 1
            why = compare_entry(a, lambda suffix, k=k: rec[f"{k}{suffix}"])
            if why is None:
                same += 1
            else:
                bad.append(f"{k}: {why}")
    print(f"compared {n} outputs in {time.perf_counter() - t0:.0f} s: {same} bitwise identical, {n - same} differ")
    for line in bad:
        print("  DIFF", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
