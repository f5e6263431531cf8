"""The diagnoses of ``python -m pynorm check``, each proven both ways on stand-ins (``tests/oracle_targets.py``):
a deliberately broken implementation per model is named -- in the dtypes where it is broken, also when another
dtype fails for another reason -- with its evidence, and correct-but-different implementations are not given
the name of a bug they do not have. Small grids keep it quick."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pynorm.__main__ import main
from pynorm.errors import ArgumentError
from pynorm.oracle import Cell, check
from pynorm.oracle.diagnose import render_advice

from . import oracle_targets as T

pytestmark = pytest.mark.skipif(
    "numpy" not in os.environ.get("PYNORM_TEST_BACKENDS", "numpy").split(","),
    reason="the oracle checks NumPy functions against the reference whatever backend is under test: the numpy "
    "environment runs these tests",
)

ALL = ("float16", "bfloat16", "float32", "float64")


def grid(dtypes=ALL, kinds=("normal",), hidden=(7, 64), eps=(1e-5, 0.0), lead=(4,)):
    """Cells of the default grid's shapes, for the dtypes, kinds, hidden sizes and eps given."""
    return [
        Cell(dt, (h,), lead, k, e)
        for dt in dtypes
        for k in kinds
        for h in hidden
        for e in eps
        if not (e == 0.0 and (k == "constant" or h == 1))
    ]


def named(report) -> dict[str, set[str]]:
    """Diagnosis code -> the dtypes it is named in."""
    out: dict[str, set[str]] = {}
    for d in report.diagnoses:
        dts = set(d.dtypes) or {label.split()[0] for label in d.cells}
        out.setdefault(d.code, set()).update(dts)
    return out


def diagnosis(report, code):
    return next(d for d in report.diagnoses if d.code == code)


def failing(report, **where):
    return [r for r in report.results if r.verdict == "fail" and all(getattr(r.cell, k) == v for k, v in where.items())]


# --- convention models ------------------------------------------------------------------------------


def test_eps_on_std_and_unbiased_are_named_in_every_dtype():
    for fwd, code in ((T.eps_on_std, "eps_on_std"), (T.unbiased, "unbiased_variance")):
        cells = grid(hidden=(7,), eps=(0.05,))  # an eps large enough to matter in 16-bit
        report = check("layer_norm", fwd, grid=cells)
        assert named(report) == {code: set(ALL)}, str(report)
        assert report.unexplained == 0 and report.explained == len(report.failing) == report.count("fail")
        d = diagnosis(report, code)
        assert "matches it to" in d.message and "failing float32 cells" in d.message
        # the advice was run before it was given: as reference options, every cell passes
        (advice,) = report.advice
        assert advice.reference == d.advice["reference"] and advice.tiers["fail"] == 0, str(report)
        assert check("layer_norm", fwd, grid=cells, reference=advice.reference).passed
        # and where the function takes the option, it can be a convention of both sides
        ok = check("layer_norm", T.layer_norm_conventions, grid=cells, conventions=advice.reference)
        assert ok.passed, str(ok)


def test_eps_rounded_to_float32_is_named_and_its_advice_passes():
    cells = grid(dtypes=("float32", "float64"), hidden=(7, 64), eps=(1e-5,))
    report = check("layer_norm", T.eps_rounded_to_float32, grid=cells)
    assert named(report) == {"eps_float32": {"float64"}}, str(report)
    d = diagnosis(report, "eps_float32")
    assert d.advice == {"reference": {"eps": 9.999999747378752e-06}}
    (advice,) = report.advice
    assert advice.reference == {"eps": 9.999999747378752e-06} and advice.tiers["fail"] == 0
    assert "--reference eps=9.999999747378752e-06" in advice.render(cli=True)
    assert "reference={'eps': 9.999999747378752e-06}" in advice.render(cli=False)
    # the eps column shows the eps the implementation received, exactly
    assert "1e-05" in report.table() and report.results[0].eps == 1e-5
    again = check("layer_norm", T.eps_rounded_to_float32, grid="quick", dtypes=["float64"], reference=advice.reference)
    assert again.passed and again.count("fail") == 0, str(again)
    # beyond what a backward-stable float64 algorithm may lose where eps is not 0 (and invisible on tiny rows, whose
    # y is b to the last bit): the default check fails those cells, not the others
    more = check("layer_norm", T.eps_rounded_to_float32, grid=grid(dtypes=("float64",), kinds=("normal", "tiny")))
    assert {(r.cell.kind, r.cell.eps) for r in more.failing} == {("normal", 1e-5)}, str(more)
    assert all(r.tier == "exact" for r in more.results if r.cell.kind == "tiny" or r.cell.eps == 0.0)


def test_an_eps_of_its_own_is_named_at_eps_0():
    report = check("layer_norm", T.eps_fixed, grid=grid(dtypes=("float32", "float64")))
    assert set(named(report)) == {"eps_ignored"}, str(report)
    assert {r.cell.eps for r in failing(report)} == {0.0}
    assert "eps = 1e-05" in diagnosis(report, "eps_ignored").message


# --- statistics models (LayerNorm) ------------------------------------------------------------------


OFFSET = grid(dtypes=("float32", "float64"), kinds=("offset",), hidden=(7, 64), eps=(1e-5,))


@pytest.mark.parametrize("fwd", [T.one_pass, T.keras_one_pass, T.flax_one_pass])
def test_one_pass_variance_is_named(fwd):
    report = check("layer_norm", fwd, grid=OFFSET)
    codes = named(report)
    assert "float32" in codes.get("one_pass", set()), str(report)
    d = next(d for d in report.diagnoses if d.key == "one_pass/float32")
    info = d.dtypes["float32"]
    assert info["explained"] == info["failing"] == len(failing(report, dtype="float32"))
    assert "E[x^2] - E[x]^2 can be off by" in d.message and "a two-pass variance is off by at most" in d.message
    assert "Welford" in d.message
    assert not codes.keys() & {"xr_minus_mean_r", "strides", "float32_math"}
    # a one-pass variance is not backward stable: the stability column says so
    assert all(r.stable is False for r in failing(report, dtype="float32"))


def test_a_two_pass_float32_mean_is_not_one_pass():
    """tinygrad's LayerNorm: two passes, the float32 mean off by a few ulps of the offset. Named for its mean (within
    backward-stable error), never as the one-pass variance, nor as x r - mean r."""
    cells = OFFSET + grid(dtypes=("float32",), kinds=("constant",))
    assert check("layer_norm", T.two_pass_f32_mean, grid=cells).passed  # backward stable: every cell is stable
    report = check("layer_norm", T.two_pass_f32_mean, grid=cells, strict=True)
    codes = named(report)
    assert codes == {"mean_in_precision": {"float32", "float64"}}, str(report)
    assert report.unexplained == 0
    assert all(r.stable for r in failing(report, kind="offset"))
    assert "its mean is off by up to" in diagnosis(report, "mean_in_precision").message
    # constant rows: the inexact mean leaves x - mean != 0 -- the same model explains them
    assert all(r.explained for r in failing(report, kind="constant"))


def test_welford_is_not_one_pass():
    report = check("layer_norm", T.welford_f32, grid=OFFSET, strict=True)
    assert "one_pass" not in named(report), str(report)


def test_x_r_minus_mean_r_is_named():
    report = check("layer_norm", T.xr_minus_mr, grid=OFFSET, strict=True)  # stable: named under --strict
    codes = named(report)
    assert "float32" in codes.get("xr_minus_mean_r", set()), str(report)
    assert "one_pass" not in codes
    # the statistics of this stand-in are exact: nothing else claims the offset rows
    d = next(d for d in report.diagnoses if d.key == "xr_minus_mean_r/float32")
    assert d.dtypes["float32"]["explained"] == len(failing(report, dtype="float32"))


def test_float32_math_for_float64_is_named_and_a_float64_bug_is_not_taken_for_it():
    cells = grid(dtypes=("float32", "float64"), kinds=("normal", "offset"), hidden=(7, 64), eps=(1e-5,))
    report = check("layer_norm", T.float32_for_float64, grid=cells)
    assert set(named(report)) == {"float32_math"} and named(report)["float32_math"] == {"float64"}, str(report)
    assert report.unexplained == 0 and all(r.cell.dtype == "float64" for r in failing(report))
    assert min(r.outputs["y"].ulps for r in failing(report, kind="normal")) > 1e6  # 1e8-1e9 ulps on ordinary rows
    # a float64 implementation with an error of its own is not float32 math
    other = check("layer_norm", T.nearly_correct_float64, grid=cells)
    assert other.failing and "float32_math" not in named(other) and other.unexplained == len(other.failing)
    # float32 returned for float64 input: the dtype is named as such, and the values' error by its model
    f32 = check("layer_norm", T.float32_for_float64_returns_float32, grid=cells)
    assert set(named(f32)) == {"float32_math", "wrong_dtype"}, str(f32)
    assert "y is float32, float64 expected" in f32.table()


def test_causes_are_named_per_dtype():
    """float64 computed in float32, float32 by Flax's one-pass variance, 16-bit correct: each dtype's cause is
    named for that dtype, whatever the other dtypes do."""
    cells = grid(kinds=("normal", "offset"), hidden=(7, 64), eps=(1e-5,))
    report = check("layer_norm", T.mixed_causes, grid=cells)
    codes = named(report)
    assert codes["float32_math"] == {"float64"} and codes["one_pass"] == {"float32"}, str(report)
    assert not any(dt in dts for dts in codes.values() for dt in ("float16", "bfloat16"))


# --- restatements -------------------------------------------------------------------------------------


def test_overflow_and_underflow_of_the_squares():
    cells = grid(dtypes=("float32",), kinds=("normal", "huge", "tiny"), hidden=(7, 64))
    report = check("layer_norm", T.squares_in_dtype, grid=cells)
    codes = named(report)
    assert codes == {"overflow": {"float32"}, "underflow": {"float32"}}, str(report)
    assert {r.cell.kind for r in failing(report)} == {"huge", "tiny"}
    assert {r.cell.kind for r in report.results if r.outputs["y"].explained_by == "overflow"} == {"huge"}
    assert "nonfin" in report.table()  # the non-finite values show as such


def test_16bit_saved_statistics_in_the_backward():
    cells = grid(dtypes=("float16", "bfloat16", "float32"), kinds=("normal", "offset"), hidden=(64,), eps=(1e-5,))
    report = check("layer_norm", T.layer_norm, T.saved_stats_16bit_backward, grid=cells)
    assert named(report) == {"saved_stats_16bit": {"float16", "bfloat16"}}, str(report)
    assert all("dx" in r.failed_outputs for r in failing(report))
    # a correct backward is not given the name
    ok = check("layer_norm", T.layer_norm, T.layer_norm_backward, grid=cells)
    assert ok.passed


@pytest.mark.parametrize(
    ("backward", "code"),
    [(T.no_variance_term_backward, "dx_missing_variance_term"), (T.no_mean_term_backward, "dx_missing_mean_term")],
)
def test_missing_dx_terms(backward, code):
    report = check("layer_norm", T.layer_norm, backward, grid=grid(dtypes=("float16", "float64"), hidden=(7,)))
    assert named(report) == {code: {"float16", "float64"}}, str(report)
    assert report.unexplained == 0


def test_strides_only_when_the_contiguous_rerun_passes():
    cells = grid(dtypes=("float32", "float64"), kinds=("normal", "noncontig"), hidden=(7,))
    report = check("layer_norm", T.strided, grid=cells)
    assert named(report) == {"strides": {"float32", "float64"}}, str(report)
    d = diagnosis(report, "strides")
    assert "passes on a contiguous copy" in d.message and "C order" in d.message
    assert {r.cell.kind for r in failing(report)} == {"noncontig"}
    # a strided x read correctly, failing for another reason: not strides; the other reason is named there too
    other = check("layer_norm", T.strided_eps_on_std, grid=cells)
    assert named(other) == {"eps_on_std": {"float32", "float64"}}, str(other)
    assert all(r.outputs["y"].explained_by == "eps_on_std" for r in failing(other, kind="noncontig"))


def test_last_axis_only():
    cells = [Cell(dt, (2, 3, 5), (2, 2), "normal", 1e-5) for dt in ("float16", "float64")] + grid(hidden=(7,))
    report = check("layer_norm", T.last_axis_only, grid=cells)
    assert named(report)["normalized_dims"] == {"float16", "float64"}, str(report)
    assert report.unexplained == 0
    # this stand-in also rounds x̂ to x's dtype before the affine: Llama's order, which is named where it shows
    assert set(named(report)) <= {"normalized_dims", "rounding_order"}


# --- RMSNorm: rounding orders, float32 math, math in the input dtype ---------------------------------------


def test_llama_rounding_order_is_named_per_dtype_and_the_advice_passes(capsys):
    cells = grid(dtypes=("float16", "bfloat16", "float32"), hidden=(64,))
    report = check("rms_norm", T.llama_in_float16_only, grid=cells)
    assert named(report) == {"rounding_order": {"float16"}}, str(report)
    d = diagnosis(report, "rounding_order")
    assert "casting='llama'" in d.message and "bit-identical to it in" in d.message
    assert render_advice(d.advice, cli=True) == "--reference casting=llama"
    both = check("rms_norm", T.llama_rms_norm, grid=cells)
    assert named(both) == {"rounding_order": {"float16", "bfloat16"}}
    assert "casting='t5'" in diagnosis(both, "rounding_order").message  # equally explained (same outputs here)
    # a one-rounding implementation is not taken for Llama's, even with a zero budget
    assert "rounding_order" not in named(check("rms_norm", T.rms_norm, grid=cells, budget="y=0"))
    # --reference casting=llama: the reference rounds like Llama, the function is not passed casting=
    strict = check("rms_norm", T.llama_rms_norm, grid=cells, budget="y=0")
    assert not strict.passed
    ok = check("rms_norm", T.llama_rms_norm, grid=cells, reference=d.advice["reference"])
    assert ok.passed and ok.diagnoses == [], str(ok)
    argv = ["check", "tests.oracle_targets:llama_rms_norm", "--op", "rms_norm", "--quick", "--no-progress"]
    assert main([*argv, "--dtypes", "float16", "--reference", "casting=llama"]) == 0
    out = main([*argv, "--dtypes", "float16", "--budget", "y=0"])
    printed = capsys.readouterr().out
    assert out == 1 and "--reference casting=llama" in printed and "reference={" not in printed


def test_rms_float32_math_and_math_in_the_input_dtype():
    cells = grid(hidden=(7, 64), eps=(1e-6,))
    f32 = check("rms_norm", T.rms_float32_for_float64, grid=cells)
    assert named(f32) == {"float32_math": {"float64"}}, str(f32)
    low = check("rms_norm", T.rms_all_in_dtype, grid=cells + grid(dtypes=("float16",), kinds=("huge",), hidden=(64,)))
    assert named(low) == {"low_precision_math": {"float16", "bfloat16"}}, str(low)


# --- facts: dtype, shape, arity -----------------------------------------------------------------------


def test_wrong_dtype_and_shape_are_shown_as_such():
    cells = grid(dtypes=("float16", "float32"), hidden=(7,), eps=(1e-5,))
    report = check("layer_norm", T.correct_but_float32_out, grid=cells)
    assert named(report) == {"wrong_dtype": {"float16"}}, str(report)
    assert "y is float32, float16 expected" in report.table()
    assert report.explained == report.count("fail") == 1
    flat = check("layer_norm", T.flattened, grid=cells)
    assert set(named(flat)) == {"wrong_shape"} and "y has shape (28,), (4, 7) expected" in flat.table()


def test_a_backward_of_the_wrong_arity_keeps_the_forward_verdict():
    cells = grid(dtypes=("float32",), hidden=(7,), eps=(1e-5,))
    report = check("layer_norm", T.eps_on_std, T.backward_two_of_three, grid=cells)
    r = report.results[0]
    assert r.verdict == "error" and r.forward_verdict == "fail" and "y" in r.outputs
    assert "backward returned 2 gradients, expected 3 (dx, dweight, dbias)" in r.note
    line = next(ln for ln in report.table().splitlines() if ln.startswith("float32"))
    assert "ERROR (forward FAIL)" in line and "*" in line
    assert "raised" in named(report)


# --- the yardsticks: stability, absolute error, at 0 --------------------------------------------------


def test_stability_tells_a_bug_from_a_strict_oracle():
    cells = grid(dtypes=("float32",), kinds=("offset", "constant"), hidden=(7, 64), eps=(1e-5,))
    stable = check("layer_norm", T.two_pass_f32_mean, grid=cells)
    assert stable.count("fail") and stable.stable_failures == stable.count("fail"), str(stable)
    assert stable.passed and "4 stable, 0 FAIL" in stable.summary() and "  stable" in stable.table()
    assert not check("layer_norm", T.two_pass_f32_mean, grid=cells, strict=True).passed
    bug = check("layer_norm", T.eps_on_std, grid=grid(dtypes=("float32",), hidden=(7,)))
    assert bug.stable_failures == 0 and "  FAIL [eps_on_std]" in bug.table()


def test_noise_at_zero_shows_as_such():
    cells = [Cell("float32", (7,), (4,), "constant", 1e-5)]
    report = check("layer_norm", T.layer_norm, T.saved_stats_16bit_backward, grid=cells)
    assert report.passed  # float32: the stand-in keeps its statistics in float64
    noisy = check("layer_norm", T.two_pass_f32_mean, grid=cells)
    o = noisy.results[0].outputs["y"]
    assert o.failed and 0 < o.abs_error < 1e-3  # y = b + noise: measured at |b|
    assert f"{o.abs_error:.1e}" in noisy.table()


def test_at_zero_instead_of_subnormal_ulps():
    def noisy_dweight(dy, x, weight, bias, eps=1e-5):  # dweight 1e-6 off: 16 ulps on normal rows, noise where it is 0
        dx, dw, db = T.layer_norm_backward(dy, x, weight, bias, eps)
        return dx, (dw.astype(np.float64) + 1e-6).astype(dw.dtype), db

    cells = [Cell("float32", (7,), (4,), kind, 1e-5) for kind in ("normal", "constant")]
    report = check("layer_norm", T.layer_norm, noisy_dweight, grid=cells)
    normal, constant = report.results
    assert normal.verdict == "pass" and constant.verdict == "fail"
    o = constant.outputs["dweight"]
    assert o.at_zero and o.ulps > 1e30 and o.abs_error == pytest.approx(1e-6, rel=1e-3)
    line = report.table().splitlines()[-1]
    assert "at 0*" in line and "1.0e-06" in line and "e+3" not in line


def test_reference_only_conventions_are_checked():
    with pytest.raises(ArgumentError, match="reference: layer_norm has no option 'colour'"):
        check("layer_norm", T.layer_norm, reference={"colour": "red"})
    with pytest.raises(ArgumentError, match="reference: casting"):
        check("layer_norm", T.layer_norm, reference={"casting": "sideways"})
    with pytest.raises(ArgumentError, match="conventions: layer_norm has no option 'bogus'"):
        check("layer_norm", T.layer_norm, conventions={"bogus": 1})
    # a reference eps replaces the non-zero eps on the reference's side only
    cells = grid(dtypes=("float64",), hidden=(7,))
    report = check("layer_norm", T.eps_rounded_to_float32, grid=cells, reference={"eps": 9.999999747378752e-06})
    assert report.passed and {r.eps for r in report.results} == {1e-5, 0.0}


def test_evidence_is_in_the_json(tmp_path):
    report = check("layer_norm", T.keras_one_pass, grid=OFFSET)
    data = report.to_json()
    assert data["failing_cells"] == {
        "total": len(report.failing),
        "explained": report.explained,
        "unexplained": report.unexplained,
        "within_backward_stable_error": report.stable_failures,
    }
    d = next(d for d in data["diagnoses"] if d["model"] == "one_pass/float32")
    assert d["dtypes"]["float32"]["explained"] >= 1 and np.isfinite(d["dtypes"]["float32"]["max_distance_ulps"])
    cell = next(c for c in data["cells"] if c["verdict"] == "fail")
    assert {"ulps", "abs_error", "budget_ulps", "failed"} <= set(cell["outputs"]["y"])
    assert cell["outputs"]["y"].get("explained_by") and "stable" in cell
