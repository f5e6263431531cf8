"""Golden vectors: inputs, outputs and gradients of pynorm's reference, for implementations in any language.

:func:`write_vectors` writes one file per op (``<op>.json`` or ``<op>.npz``), an ``index.json`` and a copy
of the JSON Schema (``vectors.schema.json``, also :func:`schema`) into a directory; :func:`read_vectors`
reads them back; :func:`verify_vectors` recomputes every vector with the reference and reports differences
in representable steps of the dtype and in ulps at the terms' magnitude.

Each vector holds the input ``x``, the op's extra inputs and parameters, a fixed upstream gradient ``dy``,
the op's conventions (every option, resolved), the outputs and gradients, the per-row statistics a correct
implementation saves for its backward (``mean``, ``rstd``), the term scales of each output and the tolerance
in ulps that applies: an implementation passes a vector when, for every output,
``|actual - expected| <= ulps * ulp(max(|expected|, scale))`` elementwise (``docs/oracle.md``). Each file
carries the constants of that ulp rule per dtype (``dtypes``: mantissa bits, smallest normal...), so no
floating-point library is needed to apply it.

Arrays (JSON): ``{"dtype": ..., "shape": [...], "data": [...]}``, data in C order; floats as the exact
decimal value of the element (every float16/bfloat16/float32 value is a float64, and the shortest
round-trip float64 repr parses back exactly), ``"inf"``, ``"-inf"`` and ``"nan"`` as strings; integer
arrays as integers. NPZ: the same record as a JSON string under ``__meta__``, each array under the key its
``npz_key`` names, bfloat16 as its uint16 bit patterns (``"encoding": "bits"``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from .._measure import max_ulp_error
from ..errors import ArgumentError, PynormError, PynormWarning
from ..ops import SPECS, OpSpec, get
from ..ops.fp_quant import QUANTIZE
from ._dtypes import DTYPE_NAMES, constants, have_bfloat16, steps_apart
from ._dtypes import dtype_of as _dtype
from .evaluate import DEFAULT_BUDGETS, Budgets, reference, run_reference, scales_of
from .grid import Case, Cell, make_case

__all__ = [
    "LARGE_HIDDEN",
    "SCHEMA_VERSION",
    "default_cells",
    "read_vectors",
    "schema",
    "verify_vectors",
    "write_vectors",
]

#: the hidden size of the large-H vectors (one offset row per dtype): long enough that a sum loses digits
LARGE_HIDDEN = 1024
#: the input kinds of the vectors in every dtype
VECTOR_KINDS = ("normal", "offset", "huge", "tiny", "constant", "half_constant")
BFLOAT16_SKIPPED = "bfloat16 vectors left out: ml_dtypes is not installed (pip install ml_dtypes)"

#: version of the vector format; bumped when a field changes meaning (readers check it)
SCHEMA_VERSION = 1
SCHEMA_NAME = "pynorm-golden-vectors"
ULP_RULE = (
    "ulp(v) = 2 ** (max(floor(log2 |v|), log2(smallest_normal)) - mantissa_bits), in the dtype of the expected "
    "array (dtypes[...] gives its constants); an element passes when |actual - expected| <= ulps[name] * "
    "ulp(max(|expected|, scale))"
)
CALLING_CONVENTION = (
    "y = op(x, *inputs, *params, **conventions) normalizing the trailing len(normalized_shape) axes of x; "
    "grads = d(sum(y * dy)) / d(x, differentiable inputs, params); tolerance: |actual - expected| <= "
    "ulps * ulp(max(|expected|, scale)) in the output's dtype"
)

CHANNELS_CALLING_CONVENTION = (
    "y = op(x, *params, running_mean=..., running_var=..., **conventions) with x of shape (N, C, *spatial) "
    "(channel_axis=-1: (N, *spatial, C)) and per-channel parameters of (C,); where running statistics are updated, "
    "the result is (y, running_mean', running_var'); grads = d(sum(y * dy)) / d(x, params); tolerance: "
    "|actual - expected| <= ulps * ulp(max(|expected|, scale)) in the output's dtype"
)


def schema() -> dict[str, Any]:
    """The JSON Schema of a vector file (``pynorm/oracle/vectors.schema.json``)."""
    text = resources.files("pynorm.oracle").joinpath("vectors.schema.json").read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def default_cells(spec: OpSpec, large_hidden: int = LARGE_HIDDEN) -> list[tuple[Cell, dict[str, Any]]]:
    """The vectors of an op, with the default conventions in every dtype (bfloat16 where ``ml_dtypes`` is
    installed): each input kind of :data:`VECTOR_KINDS` (``normal``, ``offset``, ``huge``, ``tiny``,
    ``constant``, ``half_constant``; 2 rows of H = 8), H = 1, eps = 0 (for an op with an eps), and one offset row
    of H = ``large_hidden`` (0 leaves it out); then each of the op's convention sets (``spec.cases``) in float32,
    and two normalized dims where the op has a per-feature parameter."""
    if spec.layout == "channels":
        return channel_cells(spec)
    has_eps = "eps" in {o.name for o in spec.options}
    eps = spec.defaults().get("eps") if has_eps else None
    out: list[tuple[Cell, dict[str, Any]]] = []
    for dt in DTYPE_NAMES:
        if dt == "bfloat16" and not have_bfloat16():
            continue
        for kind in VECTOR_KINDS:
            out.append((Cell(dt, (8,), (2,), kind, eps), {}))
        out.append((Cell(dt, (1,), (2,), "normal", eps), {}))
        if has_eps:
            out.append((Cell(dt, (8,), (2,), "normal", 0.0), {}))
        if large_hidden:
            out.append((Cell(dt, (int(large_hidden),), (1,), "offset", eps), {}))
    for conv in spec.cases:
        if conv:
            e = conv.get("eps", eps)
            out.append((Cell("float32", (5,), (3,), "normal", e), dict(conv)))
    if any(p.kind in ("feature", "table") for p in spec.params):
        out.append((Cell("float32", (2, 3), (2,), "normal", eps), {}))
    return out


#: per channel op: (N, C, spatial) and options of its vectors in every dtype and kind, then those in float32
_CHANNEL_VECTORS: dict[str, tuple[tuple[tuple[int, int, tuple[int, ...]], dict[str, Any], bool], ...]] = {
    "group_norm": (
        ((2, 4, (3,)), {"num_groups": 2}, False),
        ((2, 4, (1,)), {"num_groups": 4}, False),  # one value per statistic
        ((2, 6, (5,)), {"num_groups": 1}, False),
        ((2, 3, (5,)), {"num_groups": 3}, False),
        ((2, 4, (2, 3)), {"num_groups": 2, "channel_axis": -1}, False),
    ),
    "instance_norm": (
        ((2, 3, (4,)), {}, False),
        ((2, 3, (4,)), {}, True),  # running statistics updated
        ((2, 3, (4,)), {"use_input_stats": False}, True),
        ((2, 3, (4,)), {"momentum": 0.3}, True),
        ((2, 3, (2, 3)), {"channel_axis": -1}, True),
    ),
    "batch_norm": (
        ((3, 3, (2,)), {"training": True}, False),
        ((3, 3, (2,)), {"training": True}, True),
        ((3, 3, (2,)), {"training": True, "momentum": None, "num_batches_tracked": 3}, True),
        ((3, 3, (2,)), {"training": False}, True),
        ((4, 3, ()), {"training": True}, True),  # x of (N, C)
        ((2, 3, (2, 3)), {"training": True, "channel_axis": -1}, True),
    ),
}


def channel_cells(spec: OpSpec) -> list[tuple[Cell, dict[str, Any]]]:
    """The vectors of an op of the channels layout: its first configuration in every dtype and kind of
    :data:`VECTOR_KINDS` (and eps = 0), each other configuration in every dtype on normal input (running statistics
    where it has them, normal and offset input)."""
    eps = spec.defaults()["eps"]
    out: list[tuple[Cell, dict[str, Any]]] = []
    configs = _CHANNEL_VECTORS[spec.name]
    for dt in DTYPE_NAMES:
        if dt == "bfloat16" and not have_bfloat16():
            continue
        for j, ((n, c, sp), opts, running) in enumerate(configs):
            kinds = VECTOR_KINDS if j == 0 else ("normal", "offset") if running else ("normal",)
            for kind in kinds:
                options = tuple(sorted(opts.items()))
                out.append((Cell(dt, (c, *sp), (n,), kind, eps, options, running, "channels"), {}))
            if j == 0:
                out.append(
                    (Cell(dt, (c, *sp), (n,), "normal", 0.0, tuple(sorted(opts.items())), running, "channels"), {})
                )
    return out


def _encode_json(a: np.ndarray | None) -> dict[str, Any] | None:
    if a is None:
        return None
    a = np.asarray(a)
    dt = _dtype(a.dtype).name
    if a.dtype.kind in "iub":
        data: list[Any] = [int(v) for v in a.ravel()]
    else:
        data = [
            float(v) if math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")
            for v in a.astype(np.float64).ravel()
        ]
    return {"dtype": dt, "shape": list(a.shape), "data": data}


def _decode_json(d: dict[str, Any] | None) -> np.ndarray | None:
    if d is None:
        return None
    dt = _dtype(d["dtype"])
    vals = [float(v) if isinstance(v, str) else v for v in d["data"]]
    if dt.kind in "iub":
        return np.asarray(vals, dtype=dt).reshape(d["shape"])
    return np.asarray(vals, dtype=np.float64).astype(dt).reshape(d["shape"])


def _vector(spec: OpSpec, cell: Cell, conv: dict[str, Any], seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One vector: (metadata, arrays by group and name)."""
    case = make_case(spec, cell, conv, seed)
    case.x = np.ascontiguousarray(case.x)
    options = spec.validate({**conv, **dict(cell.options), **case.options}, cell.hidden)
    case.options = options
    with np.errstate(all="ignore"):
        run = run_reference(spec, case)
        outs, grads = run.outputs, run.grads
        scales = scales_of(spec, case, outs)
    budgets = Budgets()
    n_in = len(spec.inputs)
    arrays: dict[str, dict[str, Any]] = {
        "inputs": {"x": case.x, **dict(zip(spec.input_names, case.args[:n_in], strict=True))},
        "params": dict(zip(spec.param_names, case.args[n_in:], strict=True)),
        "upstream": {"dy": case.dy},
        "outputs": dict(outs),
        "grads": dict(grads),
        "scales": {},
        "statistics": _statistics(run.ctx, case, spec.layout == "channels"),
    }
    for name, ref in {**outs, **grads}.items():
        sc = scales.get(name)
        if sc is not None and np.size(sc) == np.size(ref):
            arrays["scales"][name] = np.asarray(sc, dtype=np.float64).reshape(np.shape(ref))
    named = {**dict(cell.options), **conv}
    conv_id = ",".join(f"{k}={v}" for k, v in sorted(named.items())) or "default"
    if cell.running:
        conv_id += ",running"
    if spec.layout == "channels" and cell.eps == 0.0:
        conv_id += ",eps=0"
    meta = {
        "id": f"{spec.name}/{cell.dtype}/{cell.kind}/{'x'.join(map(str, cell.shape))}/{conv_id}",
        "dtype": cell.dtype,
        "kind": cell.kind,
        "normalized_shape": list(cell.norm_shape),
        "axis": case.axis,
        **({"layout": "channels"} if spec.layout == "channels" else {}),
        "conventions": {k: v for k, v in options.items() if not (k == QUANTIZE.name and QUANTIZE in spec.options)},
        "tolerance": {
            "unit": "ulp",
            "measured_at": "max(|expected|, scale)",
            "ulps": {name: budgets.get(cell.dtype, name) for name in (*outs, *grads)},
        },
    }
    return meta, arrays


def _statistics(ctx: Any, case: Case, channels: bool = False) -> dict[str, np.ndarray]:
    """The per-row statistics the reference's forward keeps for its backward (``mean``, ``rstd``), as float64
    arrays of the row shape ``x.shape[:axis]`` (what a correct implementation saves, for debugging); for an op of the
    channels layout, flat: one per (sample, group), (sample, channel) or channel."""
    inner = getattr(ctx, "inner", ctx)
    if channels:
        return {
            name: np.asarray(getattr(inner, name)).astype(np.float64).ravel()
            for name in ("mean", "rstd")
            if getattr(inner, name, None) is not None
        }
    x = np.asarray(case.x)
    lead = x.shape[: case.axis % x.ndim]
    out: dict[str, np.ndarray] = {}
    for name in ("mean", "rstd"):
        v = getattr(inner, name, None)
        if v is not None and np.size(v) == int(np.prod(lead)):
            out[name] = np.asarray(v).astype(np.float64).reshape(lead)
    return out


def write_vectors(
    out_dir: str | os.PathLike[str],
    ops: Sequence[str] | None = None,
    *,
    fmt: str = "json",
    seed: int = 0,
    cells: dict[str, list[tuple[Cell, dict[str, Any]]]] | None = None,
    large_hidden: int = LARGE_HIDDEN,
) -> list[str]:
    """Write golden vectors of ``ops`` (default: every op) to ``out_dir``; returns the files written.

    Parameters
    ----------
    out_dir : the directory (created if needed).
    ops : op names (:class:`pynorm.errors.UnknownOpError` for an unknown one); ``"fp_quant"`` adds the FP8 / FP4
        quantizer's vectors (every format and scaling over the hard cases of :mod:`.quant_check`).
    fmt : ``"json"`` or ``"npz"``.
    seed : seed of the inputs.
    cells : per op, the ``(cell, conventions)`` pairs to write (default :func:`default_cells`).
    large_hidden : H of the large-H vectors of :func:`default_cells` (0: none).

    Without ``ml_dtypes`` the bfloat16 vectors are left out, with a :class:`pynorm.errors.PynormWarning`; the
    index and every file say so (``notes``). Vectors the reference rejects for an op (a convention set that
    needs H > 1...) are left out and listed in the file's ``notes``.
    """
    if fmt not in ("json", "npz"):
        raise ArgumentError(f"fmt must be 'json' or 'npz', got {fmt!r}")
    if isinstance(large_hidden, bool) or not isinstance(large_hidden, int) or large_hidden < 0:
        raise ArgumentError(f"large_hidden must be an integer >= 0 (0: no large-H vectors), got {large_hidden!r}")
    from .. import __version__

    names = list(SPECS) if not ops else list(ops)
    quant = QUANT_VECTORS in names
    specs = [get(n) for n in names if n != QUANT_VECTORS]
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    notes: list[str] = []
    if not have_bfloat16():
        notes.append(BFLOAT16_SKIPPED)
        warnings.warn(BFLOAT16_SKIPPED, PynormWarning, stacklevel=2)
    for spec in specs:
        records: list[dict[str, Any]] = []
        npz: dict[str, np.ndarray] = {}
        file_notes = list(notes)
        todo = (cells or {}).get(spec.name) or default_cells(spec, large_hidden)
        for i, (cell, conv) in enumerate(todo):
            try:
                meta, arrays = _vector(spec, cell, conv, seed)
            except PynormError as e:
                file_notes.append(f"left out {cell.label} {conv or ''}: {e}")
                continue
            records.append(_encoded(meta, arrays, fmt, i, npz))
        doc = {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "pynorm_version": __version__,
            "op": spec.name,
            "summary": spec.summary,
            "outputs": list(spec.outputs),
            "grad_names": list(spec.grad_names),
            "calling_convention": CHANNELS_CALLING_CONVENTION if spec.layout == "channels" else CALLING_CONVENTION,
            "ulp_rule": ULP_RULE,
            "dtypes": {dt: constants(dt) for dt in sorted({r["dtype"] for r in records}, key=DTYPE_NAMES.index)},
            "notes": file_notes,
            "vectors": records,
        }
        written.append(_write_doc(out_dir, spec.name, fmt, doc, npz))
    if quant:
        from .quant_vectors import quant_records

        npz = {}
        recs = [_encoded(meta, arrays, fmt, i, npz) for i, (meta, arrays) in enumerate(quant_records(seed))]
        doc = {
            "schema": SCHEMA_NAME, "schema_version": SCHEMA_VERSION, "pynorm_version": __version__,
            "op": QUANT_VECTORS, "summary": QUANT_SUMMARY, "outputs": ["codes", "scales", "global_scale", "decoded"],
            "grad_names": [], "notes": [], "vectors": recs,
        }  # fmt: skip
        written.append(_write_doc(out_dir, QUANT_VECTORS, fmt, doc, npz))
    index = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "format": fmt,
        "files": [os.path.basename(p) for p in written],
        "notes": notes,
    }
    with open(os.path.join(out_dir, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "vectors.schema.json"), "w", encoding="utf-8") as f:
        json.dump(schema(), f, indent=1)
        f.write("\n")
    return written


_GROUPS = ("inputs", "params", "upstream", "outputs", "grads", "scales", "statistics")

#: the name of the FP8 / FP4 quantizer's vector file (``--ops fp_quant``; :mod:`.quant_vectors`)
QUANT_VECTORS = "fp_quant"
QUANT_SUMMARY = (
    "FP8 / MXFP8 / MXFP4 / NVFP4 codes and scales of y (pynorm.quantize; docs/norms/quantized_outputs.md): "
    "an implementation passes a vector when its codes, scales and global scale equal the vector's bit for bit"
)


def _encoded(meta: dict[str, Any], arrays: dict[str, Any], fmt: str, i: int, npz: dict[str, np.ndarray]) -> Any:
    """``meta`` with each group of ``arrays`` encoded for ``fmt`` (NPZ: the arrays into ``npz`` under keys
    ``i/group/name``)."""
    for group, items in arrays.items():
        enc: dict[str, Any] = {}
        for name, a in items.items():
            if a is None:
                enc[name] = None
            elif fmt == "json":
                enc[name] = _encode_json(a)
            else:
                key = f"{i}/{group}/{name}"
                a = np.asarray(a)
                bits = _dtype(a.dtype).name == "bfloat16"
                npz[key] = a.view(np.uint16) if bits else a
                enc[name] = {
                    "dtype": _dtype(a.dtype).name,
                    "shape": list(a.shape),
                    "npz_key": key,
                    "encoding": "bits" if bits else "native",
                }
        meta[group] = enc
    return meta


def _write_doc(
    out_dir: str | os.PathLike[str], name: str, fmt: str, doc: dict[str, Any], npz: dict[str, np.ndarray]
) -> str:
    path = os.path.join(out_dir, f"{name}.{fmt}")
    if fmt == "json":
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
    else:
        np.savez_compressed(path, __meta__=np.asarray(json.dumps(doc)), **npz)  # type: ignore[arg-type]
    return path


def _read_one(path: str) -> dict[str, Any]:
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            doc = json.loads(str(z["__meta__"]))
            for rec in doc["vectors"]:
                for group in _GROUPS:
                    for name, d in rec.get(group, {}).items():
                        if d is None:
                            continue
                        a = z[d["npz_key"]]
                        rec[group][name] = a.view(_dtype("bfloat16")) if d.get("encoding") == "bits" else a
        return doc  # type: ignore[no-any-return]
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    for rec in doc["vectors"]:
        for group in _GROUPS:
            if group in rec:
                rec[group] = {k: _decode_json(v) for k, v in rec[group].items()}
    return doc  # type: ignore[no-any-return]


def read_vectors(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a vector file, or every file of a directory's ``index.json``: a list of documents (one per op),
    arrays decoded to NumPy arrays of their dtypes. Raises :class:`pynorm.errors.ArgumentError` for a file of
    another schema or a newer schema version."""
    p = os.fspath(path)
    if os.path.isdir(p):
        with open(os.path.join(p, "index.json"), encoding="utf-8") as f:
            index = json.load(f)
        files = [os.path.join(p, n) for n in index["files"]]
    else:
        files = [p]
    docs = []
    for fp in files:
        doc = _read_one(fp)
        if doc.get("schema") != SCHEMA_NAME or int(doc.get("schema_version", 0)) > SCHEMA_VERSION:
            raise ArgumentError(
                f"path: {fp} is not a pynorm golden vector file of schema version <= {SCHEMA_VERSION} "
                f"(schema {doc.get('schema')!r}, version {doc.get('schema_version')!r})"
            )
        docs.append(doc)
    return docs


def verify_vectors(docs: Iterable[dict[str, Any]] | str | os.PathLike[str], *, exact: bool = False) -> list[str]:
    """Recompute every vector with the reference; the differences found (an empty list: all agree).

    ``exact=False``: each output within the vector's own tolerance. ``exact=True`` (a change to the reference
    that alters a vector): 16- and 32-bit results bit for bit (each is one rounding of a wider computation),
    float64 results within 4 ulps at the scale (a float64 sum may differ in its last bits between platforms).
    Each difference says how far apart the values are: in representable values of the dtype (1: neighbours)
    and in ulps at the terms' magnitude (the tolerance's unit).
    """
    if isinstance(docs, (str, os.PathLike)):
        docs = read_vectors(docs)
    problems: list[str] = []
    for doc in docs:
        if doc["op"] == QUANT_VECTORS:
            from .quant_vectors import verify_quant

            problems += verify_quant(doc)
            continue
        spec = get(doc["op"])
        for rec in doc["vectors"]:
            x = rec["inputs"]["x"]
            args = [rec["inputs"].get(n) for n in spec.input_names] + [rec["params"].get(n) for n in spec.param_names]
            case = Case(
                x=x, args=args, dy=rec["upstream"]["dy"], axis=int(rec["axis"]), options=dict(rec["conventions"])
            )
            with np.errstate(all="ignore"):
                outs, grads = reference(spec, case)
            for group, got in (("outputs", outs), ("grads", grads)):
                for name, want in rec[group].items():
                    if want is None:
                        continue
                    if name not in got:
                        problems.append(f"{rec['id']}: the reference no longer returns {name}")
                        continue
                    a = np.asarray(got[name])
                    if a.shape != want.shape or _dtype(a.dtype) != _dtype(want.dtype):
                        problems.append(
                            f"{rec['id']}: {name} is {a.dtype}{a.shape}, the vector {want.dtype}{want.shape}"
                        )
                        continue
                    problem = _difference(a, want, rec["scales"].get(name), exact, rec["tolerance"]["ulps"], name)
                    if problem:
                        problems.append(f"{rec['id']}: {name} {problem}")
    return problems


def _difference(a: np.ndarray, want: np.ndarray, scale: Any, exact: bool, ulps: dict[str, float], name: str) -> str:
    """How ``a`` (the reference now) differs from ``want`` (the vector), or "" within the limit."""
    dt = _dtype(want.dtype)
    if dt.kind in "iu":
        levels = float(np.max(np.abs(a.astype(np.int64) - want.astype(np.int64)), initial=0))
        limit = 0.0 if exact else float(ulps.get(name, 0.0))
        return "" if levels <= limit else f"differs from the vector by {levels:g} levels (limit {limit:g})"
    at_scale = max_ulp_error(a, want, dt, scale=scale)
    steps = steps_apart(a, want, dt)
    if exact and dt.itemsize < 8:
        ok, limit_text = steps == 0, "limit: bit for bit"
    else:
        limit = 4.0 if exact else float(ulps.get(name, 0.0))
        ok, limit_text = at_scale <= limit, f"limit {limit:g} ulps at the terms' magnitude"
    if ok:
        return ""
    return (
        f"differs from the vector by {_count(steps)} representable {dt.name} values "
        f"({at_scale:.3g} ulps at the terms' magnitude; {limit_text})"
    )


def _count(v: float) -> str:
    return "inf" if not math.isfinite(v) else f"{int(v):,}"


def budgets_table() -> dict[str, dict[str, float]]:
    """The default budgets the vectors' tolerances come from (:data:`pynorm.oracle.runner.DEFAULT_BUDGETS`)."""
    return {k: dict(v) for k, v in DEFAULT_BUDGETS.items()}
