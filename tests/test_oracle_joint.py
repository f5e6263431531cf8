"""``python -m pynorm check`` on LayerNorms as people write them: verdicts in tiers, joint diagnoses per dtype,
advice the checker ran before giving it, batch invariance, and ``pynorm.testing.assert_matches_reference``.

Every stand-in is in ``tests/oracle_targets.py``; each cause is named in the dtypes where it is and nowhere else,
and every advice a test prints is run by the test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pynorm
from pynorm.__main__ import main
from pynorm.errors import ArgumentError, ArgumentTypeError, UnknownOpError
from pynorm.oracle import check
from pynorm.testing import assert_matches_reference

from . import oracle_targets as T
from .test_oracle_diagnoses import ALL, grid, named

pytestmark = pytest.mark.skipif(
    "numpy" not in os.environ.get("PYNORM_TEST_BACKENDS", "numpy").split(","),
    reason="the oracle checks NumPy functions against the reference whatever backend is under test: the numpy "
    "environment runs these tests",
)

ROOT = Path(__file__).resolve().parent.parent


def joint(report) -> dict[str, list[str]]:
    """dtype -> the codes of its joint explanation."""
    return {j.dtype: j.causes for j in report.joint}


def run_advice(report, op, forward, backward=None, grid_="quick"):
    """Run every advice of ``report`` the way it says, and check that it gave what it printed."""
    for a in report.advice:
        again = check(
            op, forward, backward, reference={**report.reference, **a.reference}, grid=grid_, dtypes=a.dtypes,
            batch_invariance=False, strict=report.strict,
        )  # fmt: skip
        assert again.tiers() == a.tiers, (a.render(), again.summary())
        yield a, again


# --- the tutorial LayerNorm: two conventions and float32 math in one kernel ------------------------------------


def test_the_tutorial_layer_norm_is_explained_jointly_per_dtype():
    report = check("layer_norm", T.tutorial_layer_norm, grid="quick", batch_invariance=False)
    causes = joint(report)
    # the conventions in every dtype; float32 math where the input is float64; the unscaled squares where they
    # overflow (bfloat16's and float32's huge rows, and float64's once rounded to float32) or underflow
    assert causes["float16"] == ["eps_on_std", "unbiased_variance"], str(report)
    assert causes["bfloat16"] == ["eps_on_std", "unbiased_variance", "overflow"]
    assert causes["float32"][:2] == ["eps_on_std", "unbiased_variance"] and "float32_math" not in causes["float32"]
    assert {"eps_on_std", "unbiased_variance", "float32_math"} <= set(causes["float64"])
    assert "one_pass" not in named(report) and "xr_minus_mean_r" not in named(report)  # np.std is two-pass
    assert named(report)["float32_math"] == {"float64"}
    # each named cause is needed: without it, fewer cells are explained
    for j in report.joint:
        assert j.without and all(v < j.explained for v in j.without.values()), j.render()
    assert report.unexplained <= 2 and report.explained == len(report.failing) - report.unexplained
    # the advice: both conventions as reference options (never --convention: the function takes neither)
    (advice,) = report.advice
    assert advice.reference == {"eps_mode": "std", "correction": 1} and advice.dtypes is None
    assert "--convention" not in "\n".join(report.lines(cli=True))
    for _, again in run_advice(report, "layer_norm", T.tutorial_layer_norm):
        # what still fails is what the conventions do not explain: the unscaled squares (huge and tiny rows) and
        # float32 math (the float64 cells); float16, explained by the conventions alone, passes
        left = {c for j in again.joint for c in j.causes}
        assert left <= {"overflow", "underflow", "float32_math", "mean_in_precision"}, str(again)
        assert {r.cell.kind for r in again.failing if r.cell.dtype != "float64"} <= {"huge", "tiny"}
        assert again.failing and not any(r.cell.dtype == "float16" for r in again.failing)


def test_the_tutorial_layer_norm_in_float32_on_the_command_line(capsys):
    argv = ["check", "tests.oracle_targets:tutorial_layer_norm", "--op", "layer_norm", "--quick", "--no-progress"]
    assert main([*argv, "--dtypes", "float32"]) == 1
    out = capsys.readouterr().out
    assert "explanation: float32: eps on the std + unbiased variance" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("advice: "))
    command = (
        "python -m pynorm check tests.oracle_targets:tutorial_layer_norm --op layer_norm --quick --dtypes float32 "
        "--reference eps_mode=std --reference correction=1"
    )
    assert f"checked with {command}: " in line
    outcome = line.split(f"{command}: ")[1].split(" (without")[0]  # "14 exact, 7 stable, 6 FAIL, 7 skipped"
    # the printed command, run: it gives what the advice said
    status = main([*command.split()[3:], "--no-progress"])
    summary = capsys.readouterr().out.splitlines()[-1]
    counts = re.sub(r" \([^)]*\)", "", summary.split(" cells: ")[1]).split(", ")[:4]
    assert ", ".join(counts) == outcome, (line, summary)
    assert status == 1  # the unscaled squares still overflow: a real bug


def test_the_same_algorithm_gets_the_same_names_under_reference_options():
    """np.var in float32: biased by default, and the unbiased one checked with reference={'correction': 1}."""
    biased = check("layer_norm", T.np_var_layer_norm, grid="quick", strict=True, batch_invariance=False)
    unbiased = check(
        "layer_norm", T.np_var_unbiased_layer_norm, grid="quick", strict=True, batch_invariance=False,
        reference={"correction": 1},
    )  # fmt: skip
    assert named(biased) == named(unbiased), (str(biased), str(unbiased))
    assert "mean_in_precision" in named(biased) and "one_pass" not in named(biased)
    assert "unbiased_variance" not in named(unbiased)
    # by default their inexact cells are stable: only the unscaled squares (huge and tiny rows) fail
    plain = check("layer_norm", T.np_var_unbiased_layer_norm, grid="quick", reference={"correction": 1})
    assert {r.cell.kind for r in plain.failing} <= {"huge", "tiny"} and plain.tiers()["stable"] > 0


# --- tiers ---------------------------------------------------------------------------------------------------


def test_correct_float64_math_passes_by_default_and_fails_strict(capsys):
    report = check("layer_norm", T.float64_layer_norm, T.float64_layer_norm_backward, grid="quick")
    assert report.passed and report.tiers()["fail"] == 0 and report.tiers()["stable"] > 0, str(report)
    assert report.diagnoses == [] and report.joint == []  # no rounding described as a bug
    assert all(r.cell.dtype == "float64" for r in report.results if r.tier == "stable")
    strict = check("layer_norm", T.float64_layer_norm, T.float64_layer_norm_backward, grid="quick", strict=True)
    assert not strict.passed and len(strict.failing) == report.tiers()["stable"]
    argv = [
        "check", "tests.oracle_targets:float64_layer_norm", "--backward",
        "tests.oracle_targets:float64_layer_norm_backward", "--op", "layer_norm", "--quick", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out.splitlines()[-1] and "  stable" in out
    assert main([*argv, "--strict"]) == 1
    out = capsys.readouterr().out
    assert "FAIL (stable)" in out and "stable cells fail: --strict" in out.splitlines()[-1]


@pytest.mark.parametrize(
    ("forward", "backward", "kinds", "dtypes", "eps", "code"),
    [
        (T.one_pass, None, ("offset",), ("float32", "float64"), 1e-5, "one_pass"),
        (T.eps_on_std, None, ("normal",), ALL, 0.05, "eps_on_std"),  # an eps that shows in 16-bit
        (T.unbiased, None, ("normal",), ALL, 1e-5, "unbiased_variance"),
        (T.eps_rounded_to_float32, None, ("normal",), ("float64",), 1e-5, "eps_float32"),
        (T.layer_norm, T.no_mean_term_backward, ("normal",), ALL, 1e-5, "dx_missing_mean_term"),
        (T.layer_norm, T.no_variance_term_backward, ("normal",), ALL, 1e-5, "dx_missing_variance_term"),
    ],
)
def test_the_stable_allowance_still_fails_the_bugs(forward, backward, kinds, dtypes, eps, code):
    """On the cells where the mistake matters, it is beyond what a backward-stable algorithm may lose: FAIL by
    default, and named there."""
    cells = grid(dtypes=dtypes, kinds=kinds, eps=(eps,))
    report = check("layer_norm", forward, backward, grid=cells)
    assert report.failing and all(r.tier == "fail" for r in report.results if r.verdict == "fail"), str(report)
    assert {r.cell.dtype for r in report.failing} == set(dtypes)
    assert set(named(report)) == {code} and named(report)[code] == set(dtypes), str(report)
    assert all(j.causes == [code] for j in report.joint) and report.unexplained == 0


def test_llama_rounding_order_in_float16_only_and_its_advice():
    cells = grid(dtypes=("float16", "bfloat16", "float32"), hidden=(64,))
    report = check("rms_norm", T.llama_in_float16_only, grid=cells, budget="y=0")
    assert joint(report) == {"float16": ["rounding_order"]}, str(report)
    (advice,) = report.advice
    assert advice.reference == {"casting": "llama"} and advice.dtypes == ["float16"]
    assert advice.render(cli=True).startswith("rounding_order as your convention: checked with --reference casting")
    for a, again in run_advice(report, "rms_norm", T.llama_in_float16_only, grid_=cells):
        assert again.tiers()["fail"] == 0 and a.failing_before > 0
    # bfloat16 and float32 compute with one rounding: nothing is named there
    assert named(report)["rounding_order"] == {"float16"}


def test_every_cause_alone_in_the_quick_grid_is_named_only_where_it_is():
    """Each stand-in alone, over the quick grid: its cause in its dtypes, no convention named falsely."""
    conventions = {"eps_on_std", "unbiased_variance", "eps_float32", "rounding_order"}
    for fwd, bwd, code, dts in (
        (T.flax_one_pass, None, "one_pass", {"float32", "float64"}),
        (T.layer_norm, T.no_mean_term_backward, "dx_missing_mean_term", set(ALL)),
        (T.eps_rounded_to_float32, None, "eps_float32", {"float64"}),
    ):
        report = check("layer_norm", fwd, bwd, grid="quick", batch_invariance=False)
        assert named(report)[code] == dts, str(report)
        assert not (set(named(report)) - {code}) & conventions, str(report)
        for _, again in run_advice(report, "layer_norm", fwd, bwd):
            assert again.tiers()["fail"] < len(report.failing)


# --- batch invariance -----------------------------------------------------------------------------------------


def test_a_batch_dependent_kernel_is_caught_and_an_invariant_one_is_not(capsys):
    bad = check("layer_norm", T.batch_dependent_layer_norm, grid="quick", dtypes=["float32"])
    assert not bad.batch.passed and not bad.passed
    d = bad.batch.differences[0]
    assert d.output == "y" and d.dtype == "float32" and d.rows and d.batch in (1, 3, 8)
    assert any(ln.startswith("batch invariance: y of float32 rows") for ln in bad.lines())
    assert "batch-dependent rows" in bad.summary()
    ok = check("layer_norm", T.layer_norm, T.layer_norm_backward, grid="quick", dtypes=["float32"])
    assert ok.batch.passed and ok.batch.calls == 16 and ok.passed
    # pynorm's own ops (the reference backend) are batch-invariant
    for op, fwd in (("layer_norm", pynorm.layer_norm), ("rms_norm", pynorm.rms_norm)):
        own = check(op, lambda x, *a, _f=fwd, **k: _f(x, *a, backend="numpy", **k), grid=grid(dtypes=("float32",)))
        assert own.batch is None  # a list of cells: not checked unless asked
        own = check(op, lambda x, *a, _f=fwd, **k: _f(x, *a, backend="numpy", **k), grid="quick", dtypes=["float16"])
        assert own.batch.passed, str(own)
    argv = ["check", "tests.oracle_targets:batch_dependent_layer_norm", "--op", "layer_norm", "--quick"]
    assert main([*argv, "--dtypes", "float16", "--no-progress", "--no-batch-invariance"]) == 0
    assert main([*argv, "--dtypes", "float16", "--no-progress"]) == 1
    assert "differs between a batch of 32 rows and a batch of" in capsys.readouterr().out


def test_batch_invariance_of_the_channel_ops():
    from tests import oracle_channel_targets as C

    report = check("group_norm", C.planted("group_norm", None), grid="quick", dtypes=["float32"])
    assert report.batch.passed and report.batch.calls > 0
    bn = check("batch_norm", C.planted("batch_norm", None), grid="quick", dtypes=["float32"])
    assert bn.batch.calls == 0 and "not checked" in bn.batch.summary()


# --- the JSON, the Python entry point, bad input ------------------------------------------------------------------


def test_json_has_tiers_joint_diagnoses_and_advice(tmp_path):
    path = tmp_path / "r.json"
    argv = ["check", "tests.oracle_targets:tutorial_layer_norm", "--op", "layer_norm", "--quick", "--no-progress"]
    assert main([*argv, "--dtypes", "float16", "--json", str(path)]) == 1
    data = json.loads(path.read_text())
    assert data["schema"] == "pynorm-check-report" and data["schema_version"] == 2
    assert sum(data["tiers"].values()) == len(data["cells"]) and data["tiers"]["fail"] == data["failing_cells"]["total"]
    (j,) = data["joint_diagnoses"]
    assert j["dtype"] == "float16" and j["causes"] == ["eps_on_std", "unbiased_variance"]
    assert j["options"] == {"eps_mode": "std", "correction": 1} and j["explained"] == j["failing"]
    (a,) = data["advice"]
    assert a["command"].startswith("python -m pynorm check tests.oracle_targets:tutorial_layer_norm")
    assert a["tiers"]["fail"] == 0 and a["failing_before"] == data["tiers"]["fail"]
    assert {c["tier"] for c in data["cells"]} <= {"exact", "stable", "fail", "skip"}
    assert data["batch_invariance"]["passed"] is True


def test_assert_matches_reference():
    report = assert_matches_reference(T.layer_norm, op="layer_norm", backward=T.layer_norm_backward, dtypes=["float32"])
    assert report.passed and report.batch.passed
    assert_matches_reference(T.float64_layer_norm, op="layer_norm", dtypes=["float64"])  # stable: passes
    with pytest.raises(AssertionError, match=r"(?s)FAIL \(stable\).*--strict"):
        assert_matches_reference(T.float64_layer_norm, op="layer_norm", dtypes=["float64"], strict=True)
    with pytest.raises(AssertionError) as e:
        assert_matches_reference(T.tutorial_layer_norm, op="layer_norm", dtypes=["float16"])
    msg = str(e.value)
    assert "explanation: float16: eps on the std + unbiased variance" in msg and "verdict" in msg
    assert "reference={'eps_mode': 'std', 'correction': 1}: " in msg and "--reference" not in msg
    assert_matches_reference(
        T.tutorial_layer_norm, op="layer_norm", dtypes=["float16"], reference={"eps_mode": "std", "correction": 1}
    )
    with pytest.raises(ArgumentTypeError, match="forward must be callable"):
        assert_matches_reference(None, op="layer_norm")
    with pytest.raises(ArgumentTypeError, match="backward must be callable"):
        assert_matches_reference(T.layer_norm, op="layer_norm", backward=3)
    with pytest.raises(ArgumentTypeError, match="strict must be True or False"):
        assert_matches_reference(T.layer_norm, op="layer_norm", strict="yes")
    with pytest.raises(UnknownOpError):
        assert_matches_reference(T.layer_norm, op="layer_nrom")
    with pytest.raises(ArgumentError, match="grid must be"):
        assert_matches_reference(T.layer_norm, op="layer_norm", grid="huge")
    with pytest.raises(ArgumentError, match="reference: layer_norm has no option"):
        assert_matches_reference(T.layer_norm, op="layer_norm", reference={"colour": 1})


def test_the_example_test_file_runs(tmp_path):
    """docs/examples/test_my_layer_norm.py, copied elsewhere and run by pytest, passes; with a planted mistake it
    fails with the diagnosis."""
    src = (ROOT / "docs" / "examples" / "test_my_layer_norm.py").read_text()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])}
    (tmp_path / "test_copy.py").write_text(src)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_copy.py"]
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout[-3000:]
    (tmp_path / "test_copy.py").write_text(src + "\n\nfrom tests.oracle_targets import eps_on_std as my_layer_norm\n")
    bad = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "eps on the std" in bad.stdout and "AssertionError" in bad.stdout


def test_bad_targets_stay_usage_errors(capsys):
    assert main(["check", "tests.oracle_targets:nope", "--op", "layer_norm", "--no-progress"]) == 2
    assert "has no attribute" in capsys.readouterr().err
    with pytest.raises(ArgumentTypeError, match="forward must be callable"):
        check("layer_norm", np.zeros(3))
