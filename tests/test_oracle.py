"""The oracle toolkit: ``python -m pynorm check`` (grid, report, budgets, exit codes), its diagnoses -- each
proven on a deliberately broken implementation (``tests/oracle_targets.py``) -- and the golden vectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pynorm
from pynorm.__main__ import main
from pynorm.errors import ArgumentError, UnknownOpError
from pynorm.ops import SPECS
from pynorm.oracle import (
    Cell,
    check,
    default_grid,
    make_case,
    models_for,
    parse_budget,
    quick_grid,
    read_vectors,
    schema,
    verify_vectors,
    write_vectors,
)
from pynorm.oracle.grid import KINDS, make_oracle_input
from pynorm.oracle.report import REPORT_SCHEMA_VERSION

from . import oracle_targets as T

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"


def codes(report):
    return [d.code for d in report.diagnoses]


# --- the grid ---------------------------------------------------------------------------------------


def test_default_grid_covers_the_issue():
    cells = default_grid(SPECS["layer_norm"])
    hidden = {c.hidden for c in cells if len(c.norm_shape) == 1}
    assert hidden == {1, 2, 3, 7, 64, 1000, 4096, 65536}
    assert {len(c.norm_shape) for c in cells} == {1, 2, 3}
    assert {c.dtype for c in cells} == {"float16", "bfloat16", "float32", "float64"}
    assert {c.kind for c in cells} == set(KINDS)
    assert {c.eps for c in cells} == {1e-5, 0.0}
    assert sum(c.hidden == 65536 for c in cells) <= 4
    # eps = 0 only where the exact result is defined
    assert not [c for c in cells if c.eps == 0.0 and (c.kind == "constant" or c.hidden == 1)]
    # an op without eps (DyT) has one eps "value"; a scalar-only op (ScaleNorm) no multi-dim cells
    assert {c.eps for c in default_grid(SPECS["dyt"])} == {None}
    assert {len(c.norm_shape) for c in default_grid(SPECS["scale_norm"])} == {1}
    assert len(quick_grid(SPECS["layer_norm"])) < len(cells) / 2


def test_oracle_inputs():
    rng = np.random.default_rng(0)
    two = make_oracle_input("half_constant", 3, 8, np.float32, rng)
    for row in two:
        assert len(set(row[:4].tolist())) == 1 and np.all(row[4:] == row[0] + 1)
    case = make_case(SPECS["layer_norm"], Cell("float32", (7,), (4,), "noncontig", 1e-5))
    assert not case.x.flags.c_contiguous and case.x.shape == (4, 7)
    again = make_case(SPECS["layer_norm"], Cell("float32", (7,), (4,), "noncontig", 1e-5))
    np.testing.assert_array_equal(case.x, again.x)  # deterministic
    multi = make_case(SPECS["layer_norm"], Cell("float16", (2, 3, 5), (2, 2), "normal", 1e-5))
    assert multi.x.shape == (2, 2, 2, 3, 5) and multi.args[0].shape == (2, 3, 5) and multi.axis == -3


# --- correct implementations pass -------------------------------------------------------------------


def test_correct_layer_norm_passes_the_default_grid():
    report = check("layer_norm", T.layer_norm, T.layer_norm_backward)
    assert report.passed, report.table(only_failures=True)
    assert len(report.results) == len(default_grid(SPECS["layer_norm"]))
    assert report.diagnoses == []
    assert report.summary().startswith("PASSED: layer_norm")
    assert {"y", "dx", "dweight", "dbias"} <= set(report.output_names())


def test_correct_rms_norm_passes():
    report = check("rms_norm", T.rms_norm, grid="quick")
    assert report.passed and report.diagnoses == [], str(report)


def _pynorm_as_user(op):
    """pynorm's own numpy backend behind the documented calling convention (1-D normalized shapes)."""

    def forward(x, *args, **kw):
        return getattr(pynorm, op)(x, *args, backend="numpy", **kw)

    def backward(dy, x, *args, **kw):
        fwd = getattr(pynorm, f"{op}_forward")
        _, ctx = fwd(x, *args, backend="numpy", **kw)
        return getattr(pynorm, f"{op}_backward")(dy, ctx)

    return forward, backward


SMALL = [Cell(dt, (7,), (4,), kind, None) for dt in ("float16", "float32") for kind in ("normal", "offset")]


@pytest.mark.parametrize("op", sorted(o for o in pynorm.list_ops() if SPECS[o].layout == "rows"))
def test_every_op_can_be_checked(op):
    spec = SPECS[op]
    eps = spec.defaults().get("eps")
    cells = [Cell(c.dtype, c.norm_shape, c.lead, c.kind, eps) for c in SMALL]
    fwd, bwd = _pynorm_as_user(op)
    report = check(op, fwd, bwd, grid=cells)
    assert report.passed, str(report)
    assert set(spec.grad_names) <= set(report.output_names()) | {f"d{i.name}" for i in spec.inputs}
    assert "y" in report.output_names()

    def off(x, *args, **kw):  # one part in 1e3 off: every op must notice
        res = fwd(x, *args, **kw)
        if isinstance(res, tuple):
            return (res[0] * (1 + 1e-3)).astype(res[0].dtype), *res[1:]
        return (res * (1 + 1e-3)).astype(res.dtype)

    bad = check(op, off, grid=cells)
    assert not bad.passed
    assert all("y" in r.failed_outputs for r in bad.results if r.cell.dtype == "float32" and r.cell.kind == "normal")


def test_quantized_output_is_compared_in_levels():
    fwd, _ = _pynorm_as_user("quant_layer_norm")
    cells = [Cell(c.dtype, c.norm_shape, c.lead, c.kind, 1e-5) for c in SMALL]
    report = check("quant_layer_norm", fwd, grid=cells, conventions={"quantize": "row"})
    assert report.passed and report.output_names() == ["y", "out1"], str(report)  # (q, s)

    def one_level_off(x, *args, **kw):
        q, scale = fwd(x, *args, **kw)
        q = q.copy()
        q.flat[0] = 126 if q.flat[0] == 127 else q.flat[0] + 1
        return q, scale

    bad = check("quant_layer_norm", one_level_off, grid=cells, conventions={"quantize": "row"}, budget="y=0")
    assert not bad.passed and all(r.errors["y"] == 1.0 for r in bad.results)


# --- the models and the diagnoses (each proven both ways in tests/test_oracle_diagnoses.py) -------------


def test_every_casting_policy_but_the_one_in_use_is_a_model():
    """The rounding-order models are the reference's own ``casting=`` policies: every policy but the one the
    implementation is told."""
    from pynorm.oracle.models import CASTINGS

    keys = {m.key for m in models_for(SPECS["rms_norm"], SPECS["rms_norm"].validate({})) if m.agreement}
    assert keys == {f"casting/{p}" for p in CASTINGS}
    assert all(
        m.reference == {"casting": m.key.split("/")[1]} for m in models_for(SPECS["rms_norm"], {}) if m.agreement
    )
    # the statistics models refine each other: one_pass -> mean_in_precision -> a correct algorithm in p
    by_key = {m.key: m for m in models_for(SPECS["layer_norm"], SPECS["layer_norm"].validate({}))}
    assert by_key["one_pass/float32"].baseline == "mean_in_precision/float32"
    assert by_key["mean_in_precision/float32"].baseline == "correct/float32"
    assert by_key["correct/float64"].named_in == ()  # a baseline only


def test_no_import_cycle_in_the_oracle():
    """No module of pynorm.oracle imports one that imports it (architecture, issue 22)."""
    import ast

    pkg = ROOT / "pynorm" / "oracle"
    graph: dict[str, set[str]] = {}
    for f in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps.add(node.module.split(".")[0] if node.module else "")
        graph[f.stem] = deps - {""}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph.get(a, ()))

    assert not [m for m in graph if m != "__init__" and reaches(m, m)]


def test_user_exceptions_are_recorded():
    def broken(x, weight, bias, eps=1e-5):
        if x.shape[-1] == 7:
            raise RuntimeError("no kernel for H = 7")
        return T.layer_norm(x, weight, bias, eps)

    report = check("layer_norm", broken, grid="quick")
    errors = [r for r in report.results if r.verdict == "error"]
    assert errors and all(r.cell.hidden == 7 for r in errors)
    assert "RuntimeError: no kernel for H = 7" in errors[0].note
    assert codes(report) == ["raised"] and not report.passed


# --- report, budgets, JSON --------------------------------------------------------------------------


def test_report_table_summary_and_json(tmp_path):
    report = check("layer_norm", T.eps_on_std, grid="quick", target="tests.oracle_targets:eps_on_std")
    table = report.table()
    lines = table.splitlines()
    assert len(lines) == len(report.results) + 3
    assert all(w in lines[1] for w in ("dtype", "y ulps", "y abs", "verdict"))
    fail = next(r for r in report.results if r.tier == "fail")
    assert any(ln.startswith(fail.cell.dtype) and "FAIL" in ln and "*" in ln for ln in lines)
    assert report.summary().startswith("FAILED: layer_norm (tests.oracle_targets:eps_on_std")
    tiers = report.tiers()
    assert sum(tiers.values()) == len(report.results) and tiers["fail"] == len(report.failing) > 0
    assert (
        f"{tiers['exact']} exact, {tiers['stable']} stable, {tiers['fail']} FAIL ({report.explained} explained, "
        f"{report.unexplained} unexplained)" in report.summary()
    )
    assert any(ln.startswith("diagnosis: eps is added to the std") for ln in str(report).splitlines())
    assert any(ln.startswith("explanation: float32: eps on the std reproduces") for ln in str(report).splitlines())
    path = tmp_path / "r.json"
    report.write_json(str(path))
    data = json.loads(path.read_text())
    assert data["passed"] is False and data["op"] == "layer_norm"
    assert len(data["cells"]) == len(report.results)
    c0 = data["cells"][0]
    assert {"dtype", "shape", "kind", "eps", "verdict", "tier", "errors_ulps", "budgets_ulps"} <= set(c0)
    assert data["schema"] == "pynorm-check-report" and data["schema_version"] == REPORT_SCHEMA_VERSION == 2
    assert data["tiers"] == tiers and data["strict"] is False
    assert data["diagnoses"][0]["code"] == "eps_on_std"
    joint = {j["dtype"]: j for j in data["joint_diagnoses"]}
    assert set(joint) == {r.cell.dtype for r in report.failing}
    assert joint["float32"]["causes"] == ["eps_on_std"] and joint["float32"]["explained"] >= 1
    assert data["advice"][0]["reference"] == {"eps_mode": "std"} and data["advice"][0]["tiers"]["fail"] == 0
    assert data["batch_invariance"]["passed"] is True and data["batch_invariance"]["calls"] > 0
    assert data["budgets"]["defaults"]["float32"]["y"] == 8.0


def test_parse_budget():
    b = parse_budget("y=4,dx=16,float16:dweight=3")
    assert b.get("float32", "y") == 4 and b.get("float16", "y") == 4
    assert b.get("float64", "dx") == 16
    assert b.get("float16", "dweight") == 3 and b.get("float32", "dweight") == 64  # dparam default
    assert parse_budget({"dparam": 5}).get("bfloat16", "dbias") == 5
    for bad in ("y", "y=abc", "y=-1", "bogus:y=1", "1y=2"):
        with pytest.raises(ArgumentError, match="budget"):
            parse_budget(bad)


def test_budget_changes_the_verdict():
    loose = check("layer_norm", T.eps_on_std, grid="quick", dtypes=["float16"], budget="y=1e6")
    assert loose.passed
    tight = check("layer_norm", T.eps_on_std, grid="quick", dtypes=["float16"])
    assert not tight.passed


def test_unknown_op_and_bad_convention():
    with pytest.raises(UnknownOpError):
        check("no_such_norm", T.layer_norm)
    with pytest.raises(ArgumentError, match="eps_mode"):
        check("layer_norm", T.layer_norm, conventions={"eps_mode": "sqrt"})


def test_conventions_reach_both_sides():
    conv = {"eps_mode": "std", "correction": 1, "eps": 1e-3}
    report = check("layer_norm", T.layer_norm_conventions, grid="quick", conventions=conv)
    assert report.passed, report.table(only_failures=True)
    assert report.count("skip") > 0  # correction=1 at H = 1: the reference rejects it, the cell is skipped
    assert {r.cell.eps for r in report.results} == {1e-3, 0.0}
    plain = check("layer_norm", T.eps_on_std, grid="quick")
    assert not plain.passed
    # a function that does not take a convention it is given raises: recorded per cell
    raised = check("layer_norm", T.eps_on_std, grid="quick", conventions={"eps_mode": "std"})
    assert raised.count("error") == len(raised.results) - raised.count("skip")


def test_without_ml_dtypes_bfloat16_is_left_out(monkeypatch):
    import pynorm.oracle.runner as oc

    monkeypatch.setattr(oc, "have_bfloat16", lambda: False)
    report = check("rms_norm", T.rms_norm, grid="quick")
    assert report.results and "bfloat16" not in {r.cell.dtype for r in report.results}
    assert "bfloat16 cells left out: pip install ml_dtypes" in report.summary()


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    cells = quick_grid(SPECS["rms_norm"])[:5]
    check("rms_norm", T.rms_norm, grid=cells, progress=True)
    assert "check rms_norm: 5/5 cells" in capsys.readouterr().err


# --- the command line -------------------------------------------------------------------------------


def test_cli_exit_codes(tmp_path, capsys):
    ok = ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--quick", "--no-progress"]
    assert main([*ok, "--backward", "tests.oracle_targets:layer_norm_backward"]) == 0
    out = capsys.readouterr().out
    assert "PASSED: layer_norm" in out and "verdict" in out
    js = tmp_path / "out.json"
    assert main(["check", "tests.oracle_targets:eps_on_std", "--op", "layer_norm", "--quick", "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "diagnosis: eps is added to the std" in out and js.exists()
    by_path = f"{ROOT / 'tests' / 'oracle_targets.py'}:rms_norm"
    assert main(["check", by_path, "--op", "rms_norm", "--quick", "--dtypes", "float16,float64"]) == 0
    conv = ["check", "tests.oracle_targets:layer_norm_conventions", "--op", "layer_norm", "--quick"]
    assert main([*conv, "--convention", "eps_mode=std", "--convention", "correction=1"]) == 0
    capsys.readouterr()
    for argv in (
        ["check", "no_such_module_xyz:f", "--op", "layer_norm"],
        ["check", "tests.oracle_targets:no_such_function", "--op", "layer_norm"],
        ["check", "tests.oracle_targets", "--op", "layer_norm"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "no_such_norm"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--budget", "y=lots"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--convention", "eps=-1"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--convention", "colour=red"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--reference", "colour=red"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--reference", "casting"],
        ["check", "tests.oracle_targets:layer_norm", "--op", "layer_norm", "--dtypes", "float8"],
        ["check", "tests.oracle_targets:layer_norm"],
    ):
        assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "cannot import 'no_such_module_xyz'" in err and "no op named 'no_such_norm'" in err
    assert "--reference: layer_norm has no option 'colour'" in err and "--reference expects key=value" in err


def test_cli_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pynorm", "check", "tests.oracle_targets:unbiased", "--op", "layer_norm", "--quick"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "diagnosis: the variance is the unbiased estimator" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("FAILED: layer_norm")


@pytest.mark.parametrize("fmt", ["json", "npz"])
def test_cli_vectors(tmp_path, fmt, capsys):
    assert main(["vectors", "--out", str(tmp_path), "--format", fmt, "--ops", "rms_norm", "dyt"]) == 0
    assert (tmp_path / f"rms_norm.{fmt}").exists() and (tmp_path / "vectors.schema.json").exists()
    assert main(["vectors", "--verify", str(tmp_path)]) == 0
    assert main(["vectors", "--out", str(tmp_path), "--ops", "no_such_norm"]) == 2


# --- golden vectors ---------------------------------------------------------------------------------


def _validate(doc):
    """The schema's structure, checked by hand (and by jsonschema when it is installed)."""
    sch = schema()
    for key in sch["required"]:
        assert key in doc
    assert doc["schema"] == sch["properties"]["schema"]["const"]
    vec_req = sch["$defs"]["vector"]["required"]
    dtypes = sch["$defs"]["array"]["properties"]["dtype"]["enum"]
    for rec in doc["vectors"]:
        for key in vec_req:
            assert key in rec, key
        for group in ("inputs", "params", "upstream", "outputs", "grads", "scales"):
            for arr in rec[group].values():
                if arr is not None:
                    assert arr["dtype"] in dtypes and isinstance(arr["shape"], list)
                    assert ("data" in arr) != ("npz_key" in arr)
                    if "data" in arr:
                        assert len(arr["data"]) == int(np.prod(arr["shape"]))
                        assert all(isinstance(v, (int, float)) or v in ("inf", "-inf", "nan") for v in arr["data"])
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(doc, sch)


def test_vectors_round_trip_every_op(tmp_path):
    files = write_vectors(tmp_path, fmt="json", large_hidden=0)
    assert len(files) == len(SPECS)  # the channel ops too (tests/test_oracle_channels.py)
    for f in files:
        with open(f) as fh:
            _validate(json.load(fh))
    docs = read_vectors(tmp_path)
    assert [d["op"] for d in docs] == list(SPECS)
    assert verify_vectors(docs, exact=True) == []
    ln = docs[0]
    rec = ln["vectors"][0]
    assert rec["conventions"] == {
        "eps": 1e-5, "correction": 0, "eps_mode": "var", "weight_offset": 0.0, "casting": "fp32",
    }  # fmt: skip
    assert rec["tolerance"]["ulps"]["y"] == 1.0 and rec["dtype"] == "float16"
    assert rec["inputs"]["x"].dtype == np.float16 and rec["grads"]["dweight"].shape == (8,)
    assert {r["kind"] for r in ln["vectors"]} >= {"normal", "offset", "huge", "tiny", "constant", "half_constant"}
    # a changed value is noticed
    rec["outputs"]["y"] = rec["outputs"]["y"].copy()
    rec["outputs"]["y"].flat[3] = np.float16(float(rec["outputs"]["y"].flat[3]) + 0.01)
    assert any("y differs" in p for p in verify_vectors([ln], exact=True))
    assert any("y differs" in p for p in verify_vectors([ln]))


def test_vectors_npz_round_trip(tmp_path):
    write_vectors(tmp_path, ["layer_norm", "add_rms_norm"], fmt="npz")
    docs = read_vectors(tmp_path)
    bf = next(r for r in docs[0]["vectors"] if r["dtype"] == "bfloat16")
    assert bf["inputs"]["x"].dtype.name == "bfloat16"
    assert "h" in docs[1]["vectors"][0]["outputs"]
    assert verify_vectors(docs, exact=True) == []
    with pytest.raises(ArgumentError, match="fmt"):
        write_vectors(tmp_path, ["layer_norm"], fmt="csv")


def test_vectors_carry_the_hard_cases_in_every_dtype(tmp_path):
    write_vectors(tmp_path, ["layer_norm"], large_hidden=64)
    (doc,) = read_vectors(tmp_path)
    recs = doc["vectors"]
    for dt in ("float16", "bfloat16", "float32", "float64"):
        mine = [r for r in recs if r["dtype"] == dt]
        assert {r["kind"] for r in mine} >= {"normal", "offset", "huge", "tiny", "constant", "half_constant"}
        assert any(r["normalized_shape"] == [1] for r in mine)  # H = 1
        assert any(r["conventions"]["eps"] == 0.0 for r in mine)  # eps = 0
        assert any(r["normalized_shape"] == [64] and r["kind"] == "offset" for r in mine)  # large H
    # the constants of the ulp rule, per dtype, as the rule in the file says
    c = doc["dtypes"]["bfloat16"]
    assert c == {"mantissa_bits": 7, "smallest_normal": 2.0**-126, "smallest_subnormal": 2.0**-133,
                 "max": float(np.finfo(np.float32).max) * (1 - 2.0**-8) / (1 - 2.0**-24),
                 "unit_roundoff": 2.0**-8}  # fmt: skip
    assert doc["dtypes"]["float16"]["mantissa_bits"] == 10 and doc["dtypes"]["float64"]["mantissa_bits"] == 52
    assert "smallest_normal" in doc["ulp_rule"] and "mantissa_bits" in doc["ulp_rule"]
    # the statistics a correct implementation saves, per row
    rec = next(r for r in recs if r["dtype"] == "float32" and r["kind"] == "offset" and r["normalized_shape"] == [8])
    x = rec["inputs"]["x"].astype(np.float64)
    np.testing.assert_allclose(rec["statistics"]["mean"], x.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(rec["statistics"]["rstd"], 1 / np.sqrt(x.var(axis=1) + 1e-5), rtol=1e-9)


def test_vectors_without_ml_dtypes_warn(tmp_path, monkeypatch):
    import pynorm.oracle.vectors as V
    from pynorm.errors import PynormWarning

    monkeypatch.setattr(V, "have_bfloat16", lambda: False)
    with pytest.warns(PynormWarning, match="bfloat16 vectors left out"):
        write_vectors(tmp_path, ["rms_norm"], large_hidden=0)
    index = json.loads((tmp_path / "index.json").read_text())
    assert any("bfloat16" in n for n in index["notes"])
    (doc,) = read_vectors(tmp_path)
    assert "bfloat16" not in {r["dtype"] for r in doc["vectors"]} and doc["notes"]


def test_verify_reports_true_ulp_distances(tmp_path):
    write_vectors(tmp_path, ["layer_norm"], large_hidden=0)
    (doc,) = read_vectors(tmp_path)
    rec = next(r for r in doc["vectors"] if r["dtype"] == "float32" and r["kind"] == "normal")
    y = rec["outputs"]["y"].copy()
    y.flat[0] = np.float32(float(y.flat[0]) * (1 + 1e-3))  # ~8,000 float32 values away
    rec["outputs"]["y"] = y
    (problem,) = verify_vectors([doc], exact=True)
    steps = int(problem.split("by ")[1].split(" representable")[0].replace(",", ""))
    assert 4_000 < steps < 20_000 and "representable float32 values" in problem and "inf" not in problem
    assert "ulps at the terms' magnitude" in problem
    h = next(r for r in doc["vectors"] if r["dtype"] == "float16" and r["kind"] == "normal")
    dy = h["grads"]["dx"].copy()
    dy.flat[1] = np.nextafter(dy.flat[1], np.float16(np.inf))
    h["grads"]["dx"] = dy
    assert any("by 1 representable float16 values" in p for p in verify_vectors([doc], exact=True))


def test_committed_golden_vectors_still_hold():
    """tests/golden/ (``python -m pynorm vectors --out tests/golden --ops layer_norm rms_norm --large-hidden 128``):
    a change to the reference that alters any vector fails here. If the change is intended, regenerate and say
    why."""
    docs = read_vectors(GOLDEN)
    assert {d["op"] for d in docs} == {"layer_norm", "rms_norm"}
    for d in docs:
        with open(GOLDEN / f"{d['op']}.json") as fh:
            _validate(json.load(fh))
    assert verify_vectors(docs, exact=True) == []
    total = sum(f.stat().st_size for f in GOLDEN.iterdir())
    assert total < 500_000


# --- PyTorch -----------------------------------------------------------------------------------------


def test_torch_layer_norm_passes_within_budgets():
    pytest.importorskip("torch", reason="the PyTorch comparison needs torch (an optional test dependency)")
    cells = [
        Cell(dt, (h,), (4,), kind, 1e-5)
        for dt in ("float16", "bfloat16", "float32")
        for kind in ("normal", "noncontig", "tiny")
        for h in (2, 7, 64, 1000)
    ] + [Cell(dt, (4, 16), (2, 2), "normal", 1e-5) for dt in ("float16", "float32")]
    report = check("layer_norm", T.torch_layer_norm, T.torch_layer_norm_backward, grid=cells)
    assert report.passed, str(report)
    assert report.diagnoses == []
