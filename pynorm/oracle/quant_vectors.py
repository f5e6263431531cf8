"""Golden vectors of the FP8 / FP4 quantizer (``python -m pynorm vectors --ops fp_quant``).

One record per quantizer spec and case: the spec (every :class:`~pynorm.ops.fp_quant.QuantSpec` field), the
input ``y`` (float32), the codes, the scales, NVFP4's global scale and the float32 values the codes decode to.
The specs cover every format and scaling and each convention's non-default value; the cases are the quantizer
check's (:func:`pynorm.oracle.quant_check.quant_cases`: ordinary rows, zeros, one huge value among tiny ones,
ties, the max and beyond, subnormal codes, NaN and infinity, a partial block).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import numpy as np

from ..ops.fp_quant import QuantSpec
from ..reference import fp_quant as ref
from .quant_check import quant_cases

__all__ = ["VECTOR_SPECS", "quant_records", "verify_quant"]

#: the specs of the vectors
VECTOR_SPECS = (
    QuantSpec("fp8_e4m3", scaling="tensor"),
    QuantSpec("fp8_e4m3", scaling="row"),
    QuantSpec("fp8_e4m3", scaling="group", group_size=32),
    QuantSpec("fp8_e4m3", scaling="tensor", scale=0.0625, overflow="nan"),
    QuantSpec("fp8_e5m2", scaling="row"),
    QuantSpec("mxfp8_e4m3"),
    QuantSpec("mxfp8_e4m3", scale_rule="ceil", scale_layout="swizzled"),
    QuantSpec("mxfp8_e5m2"),
    QuantSpec("mxfp4"),
    QuantSpec("mxfp4", scale_rule="ceil", nibble_order="high_first"),
    QuantSpec("nvfp4"),
    QuantSpec("nvfp4", global_scale=0.5, scale_dtype="float32", scale_layout="swizzled"),
)


def _spec_fields(spec: QuantSpec) -> dict[str, Any]:
    return {k: v for k, v in asdict(spec).items() if k != "keep_y"}


def quant_records(seed: int = 0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(metadata, arrays by group)`` of every vector."""
    out = []
    for spec in VECTOR_SPECS:
        for kind, y in quant_cases(spec, seed):
            q = ref.quantize(y, spec)
            label = "-".join(f"{k}={v}" for k, v in _spec_fields(spec).items() if v != getattr(QuantSpec, k, None))
            meta = {
                "id": f"{spec.format}[{label}]/{kind}",
                "format": spec.format,
                "kind": kind,
                "spec": _spec_fields(spec),
                "tolerance": {"unit": "bits", "measured_at": "bit for bit", "ulps": {}},
            }
            arrays = {
                "inputs": {"y": y},
                "outputs": {
                    "codes": q.codes,
                    "scales": np.asarray(q.scales),
                    "global_scale": None if q.global_scale is None else np.asarray(q.global_scale),
                    "decoded": ref.dequantize(q),
                },
            }
            out.append((meta, arrays))
    return out


def verify_quant(doc: dict[str, Any]) -> list[str]:
    """Every vector of a quantizer vector file recomputed by the reference: the differences (bit for bit)."""
    problems = []
    names = {f.name for f in fields(QuantSpec)}
    for rec in doc["vectors"]:
        spec = QuantSpec(**{k: v for k, v in rec["spec"].items() if k in names})
        q = ref.quantize(np.asarray(rec["inputs"]["y"], dtype=np.float32), spec)
        now = {"codes": q.codes, "scales": np.asarray(q.scales), "global_scale": q.global_scale,
               "decoded": ref.dequantize(q)}  # fmt: skip
        for name, want in rec["outputs"].items():
            got = now[name]
            if want is None or got is None:
                if (want is None) != (got is None):
                    problems.append(f"{rec['id']}: {name} is {'absent' if got is None else 'present'} now")
                continue
            a, w = np.asarray(got), np.asarray(want)
            same = a.shape == w.shape and a.dtype == w.dtype
            if same and a.dtype.kind == "f":
                same = bool(np.all((a.view(np.uint32) == w.view(np.uint32)) | (np.isnan(a) & np.isnan(w))))
            elif same:
                same = bool(np.array_equal(a, w))
            if not same:
                problems.append(f"{rec['id']}: {name} differs from the vector")
    return problems
