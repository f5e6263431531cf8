"""The FP8 / FP4 quantizer's oracle: :func:`pynorm.oracle.check_quantizer` names each planted bug of stand-in user
kernels (written apart from the reference: ml_dtypes' conversions) and passes the correct ones; the quantizer's
golden vectors. (Backend-independent: the numpy and docs envs run the oracle's tests.)"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from pynorm.ops.fp_quant import FORMATS, QuantSpec
from pynorm.reference import fp_quant as ref

_ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


# ---------------------------------------------------------------------------- the quantizer check


def _user_quantizer(fmt: str, bug: str = "") -> Any:
    """A stand-in user kernel written apart from the reference (ml_dtypes' conversions, NumPy's log2), with one
    planted ``bug``: the check must pass the correct one and name each bug."""
    spec = QuantSpec(fmt)
    el = spec.fmt.element
    t = _ML[el.name]
    fmax = np.float32(el.fmax)

    def conv(v: np.ndarray) -> np.ndarray:
        if bug != "overflow_nan":
            v = np.clip(v, -fmax, fmax)
        c = v.astype(t).view(np.uint8) & ((1 << el.nbits) - 1)
        if bug == "truncation":  # one code toward zero where rounding went away from zero
            back = c.view(t).astype(np.float32) if el.nbits == 8 else ref.decode(c, el)
            c = np.where(np.abs(back) > np.abs(v), c - 1, c).astype(np.uint8)
        return np.where(np.isnan(v), 0 if el.nan_code is None else el.nan_code, c).astype(np.uint8)

    def quant(y: np.ndarray) -> Any:
        if bug == "y_bfloat16":
            y = y.astype(ml_dtypes.bfloat16).astype(np.float32)
        r, h = y.shape
        a = np.where(np.isnan(y), 0, np.abs(y)).astype(np.float32)
        if spec.fmt.kind == "scaled":
            s = np.max(a, axis=1, keepdims=True) / fmax
            s = np.where((s > 0) & np.isfinite(s), s, np.float32(1)).astype(np.float32)
            return conv((y / s).astype(np.float32)), s.reshape(r)
        b = spec.fmt.block
        nb = -(-h // b)
        pad = np.zeros((r, nb * b), np.float32)
        pad[:, :h] = a
        blocks = pad.reshape(r, nb, b)
        am = (blocks[:, :, : b // 2] if bug == "amax_half_block" else blocks).max(axis=2)
        full = np.repeat(np.arange(nb), b)[:h]
        if spec.fmt.kind == "mx":
            with np.errstate(divide="ignore"):
                lg = np.log2(am.astype(np.float64))
                e = np.ceil(np.log2(am / fmax)) if bug == "scale_rule_ceil" else np.floor(lg) - el.emax
            e = np.clip(np.where(am > 0, e, -127), -127, 127).astype(np.int64)
            sc = np.where(np.isinf(am), 255, e + 127).astype(np.uint8)
            v = (y.astype(np.float64) * np.exp2(-e[:, full].astype(np.float64))).astype(np.float32)
            codes = np.where(sc[:, full] == 255, 0, conv(v)).astype(np.uint8)
        else:
            tot = np.float32(np.max(a)) / np.float32(2688)
            g = np.float32(1) if bug == "global_scale_missing" or not (0 < tot < np.inf) else tot
            sbv = np.clip((am / np.float32(6)) / g, 0, 448).astype(ml_dtypes.float8_e4m3fn)
            sc = sbv.view(np.uint8)
            big = (sbv.astype(np.float32) * g)[:, full]
            with np.errstate(all="ignore"):
                codes = np.where(big > 0, conv((y / big).astype(np.float32)), 0).astype(np.uint8)
        if el.nbits == 4:
            cc = np.zeros((r, h + (h & 1)), np.uint8)
            cc[:, :h] = codes
            lo, hi = (cc[:, 1::2], cc[:, 0::2]) if bug == "nibble_high_first" else (cc[:, 0::2], cc[:, 1::2])
            codes = lo | (hi << 4)
        if bug == "swizzled":
            sc = ref.swizzle(sc)
        return (codes, sc, g) if spec.fmt.kind == "nvfp4" else (codes, sc)

    return quant


@pytest.mark.parametrize(
    ("fmt", "bug"),
    [
        ("fp8_e4m3", ""), ("fp8_e5m2", ""), ("mxfp8_e4m3", ""), ("mxfp8_e5m2", ""), ("mxfp4", ""), ("nvfp4", ""),
        ("mxfp4", "scale_rule_ceil"), ("mxfp8_e4m3", "overflow_nan"), ("nvfp4", "nibble_high_first"),
        ("mxfp4", "swizzled"), ("fp8_e4m3", "truncation"), ("mxfp8_e5m2", "amax_half_block"),
        ("nvfp4", "global_scale_missing"), ("fp8_e5m2", "y_bfloat16"),
    ],
)  # fmt: skip
def test_check_quantizer_names_the_bug(fmt: str, bug: str) -> None:
    from pynorm.oracle import check_quantizer

    report = check_quantizer(_user_quantizer(fmt, bug), fmt)
    assert report.passed == (not bug), str(report)
    assert report.codes == ([bug] if bug else []), str(report)
    if bug in ("scale_rule_ceil", "overflow_nan", "nibble_high_first", "swizzled"):
        assert "verified" in report.advice
        assert "PASS" in str(check_quantizer(_user_quantizer(fmt, bug), report.diagnosis[0].spec_for(QuantSpec(fmt))))


def test_check_quantizer_cli(tmp_path: Any, capsys: Any) -> None:
    from pynorm.oracle.cli import check_main

    mod = tmp_path / "userq.py"
    mod.write_text(
        "import numpy as np\nimport pynorm\n"
        "def good(y):\n    q = pynorm.quantize(y, pynorm.QuantSpec('mxfp4', scale_rule='ceil'))\n"
        "    return q.codes, q.scales\n"
    )
    assert check_main([f"{mod}:good", "--quant", "mxfp4"]) == 1
    assert "[scale_rule_ceil]" in capsys.readouterr().out
    assert check_main([f"{mod}:good", "--quant", "mxfp4", "--quant-option", "scale_rule=ceil"]) == 0
    assert check_main([f"{mod}:good", "--quant", "fp5"]) == 2
    assert check_main([f"{mod}:good", "--quant", "mxfp4", "--op", "dyt"]) == 2


def test_quantizer_golden_vectors(tmp_path: Any) -> None:
    import json

    from pynorm.oracle import read_vectors, schema, verify_vectors, write_vectors
    from pynorm.oracle.cli import vectors_main

    assert vectors_main(["--out", str(tmp_path), "--ops", "fp_quant"]) == 0
    doc = json.loads((tmp_path / "fp_quant.json").read_text())
    assert {r["format"] for r in doc["vectors"]} == set(FORMATS)
    assert len({r["id"] for r in doc["vectors"]}) == len(doc["vectors"])
    try:
        import jsonschema
    except ImportError:
        pass
    else:  # one record per format (validating all 96 takes seconds)
        firsts = {r["format"]: r for r in reversed(doc["vectors"])}
        jsonschema.validate({**doc, "vectors": list(firsts.values())}, schema())
    docs = read_vectors(tmp_path)
    assert verify_vectors(docs) == []
    rec = next(r for r in docs[0]["vectors"] if r["format"] == "mxfp4" and r["kind"] == "ties")
    rec["outputs"]["codes"][0, 1] ^= 0x10  # one nibble changed
    assert verify_vectors(docs) == [f"{rec['id']}: codes differs from the vector"]
    files = write_vectors(tmp_path / "npz", ["fp_quant"], fmt="npz")
    assert verify_vectors(read_vectors(files[0])) == []


def _fused_rms_norm(fmt: str, bug: str = "") -> Any:
    """A stand-in fused RMSNorm + quantize kernel: the norm in float32 arithmetic (a few ulps from the reference's
    y), then :func:`_user_quantizer`; ``stats_bfloat16``: the statistics of ``x`` rounded to bfloat16."""
    quant = _user_quantizer(fmt, "" if bug == "stats_bfloat16" else bug)

    def fused(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6) -> Any:
        xs = x.astype(ml_dtypes.bfloat16).astype(np.float32) if bug == "stats_bfloat16" else x
        r = np.float32(1) / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
        return quant((xs * r * weight).astype(np.float32))

    return fused


@pytest.mark.parametrize(
    ("fmt", "bug"),
    [("fp8_e4m3", ""), ("nvfp4", ""), ("nvfp4", "nibble_high_first"), ("fp8_e5m2", "y_bfloat16"),
     ("fp8_e4m3", "stats_bfloat16")],
)  # fmt: skip
def test_check_quantizer_of_a_fused_norm(fmt: str, bug: str) -> None:
    from pynorm.oracle import check_quantizer

    report = check_quantizer(_fused_rms_norm(fmt, bug), fmt, op="rms_norm", conventions={"eps": 1e-6})
    assert report.passed == (not bug), str(report)
    assert report.codes == ([bug] if bug else []), str(report)
