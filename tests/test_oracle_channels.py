"""The oracle on the ops of the channels layout: GroupNorm, InstanceNorm, BatchNorm (``docs/oracle.md``).

The grid (shapes ``(N, C, *spatial)``, running statistics, channels last, one value per statistic), correct
implementations that pass (pynorm's own, PyTorch's), planted mistakes the diagnoses must name
(``tests/oracle_channel_targets.py``), the CLI and the golden vectors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pynorm
from pynorm.ops import SPECS
from pynorm.oracle import Cell, check, default_grid, make_case, quick_grid, read_vectors, verify_vectors, write_vectors
from pynorm.oracle.grid import statistic_size
from pynorm.oracle.vectors import schema
from tests import oracle_channel_targets as T

OPS = ("group_norm", "instance_norm", "batch_norm")
ROOT = Path(__file__).resolve().parent.parent


def _codes(report):
    return {d.code for d in report.diagnoses}


# --- the grid ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_grid_covers_the_channel_settings(op):
    cells = default_grid(SPECS[op])
    assert {c.layout for c in cells} == {"channels"}
    assert {c.dtype for c in cells} == {"float16", "bfloat16", "float32", "float64"}
    assert {"normal", "offset", "huge", "tiny", "constant", "half_constant", "noncontig"} <= {c.kind for c in cells}
    assert any(c.channel_axis == -1 for c in cells)
    assert {1, 2} <= {len(c.shape) - 2 for c in cells}  # spatial dims (BatchNorm: 0 too)
    assert {0.0, 1e-5} <= {c.eps for c in cells}
    if op != "group_norm":
        assert any(c.running for c in cells)
    if op == "group_norm":  # C/G = 1 and spatial 1: one value per statistic
        assert any(c.norm_shape[1:] == (1,) and dict(c.options)["num_groups"] == c.norm_shape[0] for c in cells)
        assert {1, 2} <= {c.norm_shape[0] // dict(c.options)["num_groups"] for c in cells}
    if op == "batch_norm":
        modes = {(dict(c.options)["training"], dict(c.options).get("momentum", 0.1), c.running) for c in cells}
        assert {(True, 0.1, False), (True, 0.1, True), (True, None, True), (False, 0.1, True)} <= modes
        assert any(len(c.shape) == 2 for c in cells)  # x of (N, C)
        for c in cells:  # training BatchNorm needs N S >= 2
            assert c.lead[0] * int(np.prod(c.norm_shape[1:])) >= 2
    assert len(quick_grid(SPECS[op])) < len(cells)


def test_channels_last_case_is_the_moved_channels_first_one():
    spec = SPECS["batch_norm"]
    opts = (("channel_axis", -1), ("training", True))
    cell = Cell("float32", (4, 3, 5), (2,), "normal", 1e-5, opts, True, "channels")
    case = make_case(spec, cell)
    assert case.x.shape == (2, 3, 5, 4) == cell.shape and case.axis == -1
    assert case.args[0].shape == (4,) and case.options["channel_axis"] == -1


@pytest.mark.parametrize("op", OPS)
def test_one_ulp_from_the_reference_passes_on_huge_float64_inputs(op):
    """A float64 ``y`` one ulp from the reference's is within budget on every cell, the ``huge`` ones (|x| ~ 1e306)
    included: their term scales are computed in extended precision (in float64 the squares overflowed, the scale
    was NaN and the one ulp read as inf ulps, an unexplained failure of a correct implementation)."""
    fn = getattr(pynorm, op)
    seen = []

    def one_ulp_off(x, *args, **kwargs):
        res = fn(x, *args, backend="numpy", **kwargs)
        y = res[0] if isinstance(res, tuple) else res  # (with running statistics: y and the updated statistics)
        if y.dtype != np.float64:
            return res
        seen.append(float(np.abs(x).max()))
        y = np.nextafter(y, np.inf)
        return (y, *res[1:]) if isinstance(res, tuple) else y

    report = check(op, one_ulp_off, grid="quick")
    assert max(seen) > 1e300  # the grid holds huge float64 cells, and they were checked
    assert report.passed, str(report)


def test_a_num_groups_convention_regroups_the_grid():
    cells = default_grid(SPECS["group_norm"], {"num_groups": 3})
    assert cells and all(dict(c.options)["num_groups"] == 3 and c.norm_shape[0] % 3 == 0 for c in cells)
    report = check("group_norm", pynorm.group_norm, conventions={"num_groups": 3}, grid="quick")
    assert report.passed, str(report)


def test_a_training_convention_keeps_that_mode():
    report = check("batch_norm", pynorm.batch_norm, conventions={"training": False}, grid="quick")
    assert report.passed, str(report)
    assert report.results and all(dict(r.cell.options)["training"] is False for r in report.results)


# --- correct implementations pass ----------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_pynorm_itself_passes_the_full_grid(op):
    report = check(op, getattr(pynorm, op), T.pynorm_backward(op))
    assert report.passed, str(report)
    assert report.diagnoses == []
    names = set(report.output_names())
    assert {"y", "dx", "dweight", "dbias"} <= names
    if op != "group_norm":
        assert {"running_mean", "running_var"} <= names


def _easy(op):
    """Cells a correct float32 implementation passes: no large offset, no magnitudes near the dtype's max, no
    squares below float32's range (tiny at eps = 0), two-valued statistics only in 16-bit (in float32 the mean's
    rounding shows), statistics of more than 2 values (PyTorch's instance_norm refuses 1 spatial position; its
    group_norm with one value per group leaves x - mean ~1e-5 off 0 in float32, which the oracle flags)."""
    spec = SPECS[op]

    def size(c):  # the values of each statistic
        return statistic_size(spec, c.lead[0], c.norm_shape[0], int(np.prod(c.norm_shape[1:])), dict(c.options))

    return [
        c
        for c in default_grid(spec, dtypes=("float16", "bfloat16", "float32"))
        if (c.kind in ("normal", "noncontig") or (c.kind == "tiny" and c.eps != 0.0)
            or (c.kind == "half_constant" and c.dtype != "float32"))
        and (size(c) == 0 or size(c) > 2)
    ]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
def test_a_correct_numpy_float32_implementation_passes_and_is_not_diagnosed(op):
    report = check(op, T.planted(op, None), grid=_easy(op))
    assert report.passed, str(report)
    full = check(op, T.planted(op, None))  # it fails the offset and huge cells (the exact oracle) ...
    assert not full.passed
    assert _codes(full) == set(), [d.render() for d in full.diagnoses]  # ... and is not given a bug's name


@pytest.mark.parametrize("op", OPS)
def test_torch_passes_within_budgets(op):
    pytest.importorskip("torch", reason="the PyTorch comparison needs torch (an optional test dependency)")
    cells = [c for c in _easy(op) if c.eps != 0.0]  # PyTorch's batch_norm refuses eps = 0 in training
    report = check(op, T.torch_forward(op), T.torch_backward(op), grid=cells)
    assert report.passed, str(report)
    assert report.diagnoses == []


# --- planted mistakes are named ------------------------------------------------------------------------


PLANTED = [
    ("group_norm", "unbiased", "unbiased_variance"),
    ("instance_norm", "unbiased", "unbiased_variance"),
    ("batch_norm", "unbiased", "unbiased_variance"),
    ("instance_norm", "biased_running", "running_var_biased"),
    ("batch_norm", "biased_running", "running_var_biased"),
    ("group_norm", "eps_on_std", "eps_on_std"),
    ("batch_norm", "eps_on_std", "eps_on_std"),
    ("instance_norm", "keras_momentum", "momentum_convention"),
    ("batch_norm", "keras_momentum", "momentum_convention"),
    ("group_norm", "per_channel", "group_stats_per_channel"),
    ("group_norm", "one_pass", "one_pass"),
    ("batch_norm", "one_pass", "one_pass"),
    ("group_norm", "half", "low_precision_math"),
    ("batch_norm", "half", "low_precision_math"),
]


@pytest.mark.parametrize(("op", "bug", "code"), PLANTED)
def test_a_planted_mistake_is_named(op, bug, code):
    report = check(op, T.planted(op, bug))
    assert not report.passed
    assert code in _codes(report), [d.render() for d in report.diagnoses]
    per_code: dict[str, int] = {}
    for d in report.diagnoses:  # one diagnosis per model (one_pass/float32, one_pass/float64...)
        per_code[d.code] = per_code.get(d.code, 0) + d.explained
    assert per_code[code] > 0
    # the mistake's name is the main one: it explains more failing cells than any other diagnosis
    assert per_code[code] == max(per_code.values()), per_code


def test_the_one_pass_diagnosis_is_on_the_offset_cells():
    report = check("batch_norm", T.planted("batch_norm", "one_pass"), dtypes=["float32"])
    d = next(d for d in report.diagnoses if d.code == "one_pass")
    offset = [r for r in report.results if r.cell.kind == "offset" and r.verdict == "fail"]
    assert sum(r.outputs["y"].explained_by == "one_pass" for r in offset) > len(offset) / 2
    assert sum("offset" in c for c in d.cells) > len(d.cells) / 2


def test_a_wrong_momentum_is_explained_on_the_running_statistics():
    report = check("batch_norm", T.planted("batch_norm", "keras_momentum"), dtypes=["float64"])
    hit = [r for r in report.results if r.verdict == "fail" and r.cell.kind == "normal"]
    assert hit and all(r.cell.running for r in hit)
    assert all(r.outputs["running_mean"].explained_by == "momentum_convention" for r in hit)
    assert all(not r.outputs["y"].failed for r in hit)


# --- the CLI and the vectors ---------------------------------------------------------------------------


def test_cli_check_names_the_planted_bug():
    out = subprocess.run(
        [sys.executable, "-m", "pynorm", "check", "tests/oracle_channel_targets.py:group_norm_per_channel",
         "--op", "group_norm", "--quick", "--no-progress", "--dtypes", "float32,float64"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "diagnosis: the statistics are per channel" in out.stdout


def test_vectors_of_the_channel_ops_validate_and_verify(tmp_path):
    files = write_vectors(tmp_path, list(OPS), fmt="json", large_hidden=0)
    assert [Path(f).name for f in files] == [f"{op}.json" for op in OPS]
    sch = schema()
    for f in files:
        with open(f) as fh:
            doc = json.load(fh)
        recs = doc["vectors"]
        assert len({r["id"] for r in recs}) == len(recs)
        assert all(r["layout"] == "channels" for r in recs)
        assert any(r["conventions"]["channel_axis"] == -1 for r in recs)
        if doc["op"] != "group_norm":
            assert any("running_var" in r["outputs"] and r["inputs"]["running_var"] is not None for r in recs)
        try:
            import jsonschema
        except ImportError:
            continue
        jsonschema.validate(doc, sch)
    docs = read_vectors(tmp_path)
    assert verify_vectors(docs, exact=True) == []
    bn = docs[2]
    rec = next(r for r in bn["vectors"] if "running" in r["id"] and r["dtype"] == "float16")
    rec["outputs"]["running_var"] = (rec["outputs"]["running_var"].astype(np.float64) * 1.01).astype(np.float16)
    assert any("running_var" in p for p in verify_vectors([bn]))
    write_vectors(tmp_path / "npz", ["batch_norm"], fmt="npz", large_hidden=0)
    assert verify_vectors(tmp_path / "npz", exact=True) == []


def test_default_vectors_cover_every_op(tmp_path):
    files = write_vectors(tmp_path, fmt="npz", large_hidden=0)
    assert {Path(f).stem for f in files} == set(SPECS)
