"""The CPU benchmark's parts (:mod:`pynorm.bench`): its cases come from the specs, its byte model, its PyTorch
baselines compute the ops, its worker processes, its command line's errors. Tiny shapes only; nothing here
asserts a speed (the figures of a shared machine are the benchmark's output, not a test's condition).

The full command runs in ``tests/test_cli.py`` (``bench --quick``, ``bench --ops``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm.bench import cases, report, runner
from pynorm.ops import REQUIRED, SPECS

ROOT = Path(__file__).resolve().parents[1]
HAS_NUMBA = pynorm._registry.unavailable_reason("numba") is None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed (the numba env runs these)")


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


@pytest.mark.parametrize("op", list(SPECS))
def test_case_is_the_specs_example(op: str) -> None:
    spec = SPECS[op]
    case = cases.make_case(op, (6, 16), seed=3)
    xs, axis = ((6, 16), -1) if spec.layout == "rows" else ((1, 6, 16), 1)  # (rows, H) or (N, C, S): 6 channels
    assert case.x.shape == xs
    rng = np.random.default_rng(3)
    rng.standard_normal(xs, dtype=np.float32)  # x comes first from the same generator
    expected = spec.example_args(xs, axis, np.float32, rng, options=case.options)
    assert len(case.args) == len(expected)
    for a, e in zip(case.args, expected, strict=True):
        assert (a is None and e is None) or np.array_equal(a, e)
    assert case.y.shape == spec.output_shape(xs, axis, case.named)
    assert case.y.dtype == spec.dtypes_of_outputs(np.dtype(np.float32), case.options)[0]
    assert set(case.required) == {k for k, d in spec.defaults().items() if d is REQUIRED}
    assert case.dy.shape == case.y.shape and case.dy.dtype == spec.grad_dtype(np.dtype(np.float32))
    again = cases.make_case(op, (6, 16), seed=3)  # every process builds the same numbers
    assert np.array_equal(again.x, case.x) and np.array_equal(again.dy, case.dy)


def test_byte_model_of_layer_norm_and_rms_norm() -> None:
    """The documented counts: forward 2N, backward 3N, forward + backward 5N elements of 4 bytes, plus each
    parameter read once per pass and each parameter gradient written once."""
    r, h = 8, 24
    n, p = 4 * r * h, 4 * h
    ln = cases.op_bytes(cases.make_case("layer_norm", (r, h)))
    assert ln == {"fwd": 2 * n + 2 * p, "bwd": 3 * n + 4 * p, "fwd+bwd": 5 * n + 6 * p}
    rms = cases.op_bytes(cases.make_case("rms_norm", (r, h)))
    assert rms == {"fwd": 2 * n + p, "bwd": 3 * n + 2 * p, "fwd+bwd": 5 * n + 3 * p}


def test_byte_model_counts_every_array_of_the_spec() -> None:
    r, h = 8, 24
    n = 4 * r * h
    add = cases.op_bytes(cases.make_case("add_layer_norm", (r, h)))  # x, residual -> y, h; dy, h -> dx, dresidual
    assert add["fwd"] == 4 * n + 2 * 4 * h and add["bwd"] == 4 * n + 4 * 4 * h
    case = cases.make_case("layer_norm_linear", (r, h))
    w = case.named["W"]
    out = r * w.shape[0] * 4  # the Linear's output, (R, N), and the norm's n, (R, H)
    params = 4 * (2 * h + w.size + w.shape[0])
    lin = cases.op_bytes(case)
    assert lin["fwd"] == n + params + out + n
    assert lin["bwd"] == out + n + params + n + params
    mod = cases.make_case("modality_layer_norm", (r, h))
    ids = mod.named["modality_ids"]
    assert cases.op_bytes(mod)["fwd"] == 2 * n + ids.nbytes + 2 * 4 * 3 * h


@pytest.mark.parametrize("op", [n for n, s in SPECS.items() if s.layout == "rows"])
def test_call_args_split_keyword_inputs(op: str) -> None:
    spec = SPECS[op]
    case = cases.make_case(op, (4, 8))
    pos, kw = cases.call_args(spec, case.args)
    assert all(spec.inputs[[i.name for i in spec.inputs].index(k)].keyword for k in kw)
    assert len(pos) + len(kw) + sum(1 for i, a in zip(spec.inputs, case.args) if i.keyword and a is None) == len(
        case.args
    )
    y, _ = getattr(pynorm, f"{op}_forward")(case.x, *pos, **kw, backend="numpy")
    ref, _ = spec.generic_forward()(case.x, *case.args, backend="numpy")
    assert np.array_equal(y[0] if isinstance(y, tuple) else y, ref[0] if isinstance(ref, tuple) else ref)


def test_channels_case_reads_rows_as_n_c_s() -> None:
    """A channels-layout op's case has the rows-layout case's elements: ``(rows / 64, 64, hidden)`` where 64
    channels divide the rows, its required options from the spec's first test case, and its calls run."""
    case = cases.make_case("group_norm", (128, 32))
    assert case.x.shape == (2, 64, 32) and case.required == {"num_groups": SPECS["group_norm"].cases[0]["num_groups"]}
    assert cases.x_shape_of(SPECS["batch_norm"], (6, 16)) == (1, 6, 16)
    calls = cases.pynorm_calls(case, "numpy", buffers=True)
    y, _ = calls["fwd"]()
    ref = pynorm.group_norm(case.x, *case.args, **case.required, backend="numpy")
    assert np.array_equal(y, ref) and y is case.y
    assert cases.op_bytes(case)["fwd"] == 2 * case.x.nbytes + 2 * 4 * 64


def test_every_op_has_a_pytorch_baseline_entry_or_is_documented_without() -> None:
    assert set(cases.TORCH_BASELINES) <= set(SPECS)
    for op, b in cases.TORCH_BASELINES.items():
        assert b.expr and (b.native or b.why), op


@pytest.mark.parametrize("op", list(cases.TORCH_BASELINES))
def test_pytorch_baseline_computes_the_op(op: str) -> None:
    """Each PyTorch baseline's output and gradients are the op's (the reference's) to float32 rounding."""
    torch = pytest.importorskip("torch")
    case = cases.make_case(op, (6, 16))
    y, ctx = cases.pynorm_calls(case, "numpy", buffers=False)["fwd"]()
    grads = getattr(pynorm, f"{op}_backward")(case.dy, ctx)
    t = cases.torch_tensors(case)
    out = cases.TORCH_BASELINES[op].build(t, case.options, 16)()
    out.backward(torch.from_numpy(case.dy))
    assert _rel(out.detach().numpy(), y[0] if isinstance(y, tuple) else y) < 1e-5
    spec = case.spec
    names = ["x", *(i.name for i in spec.inputs if i.differentiable), *spec.param_names]
    for name, g in zip(names, grads, strict=True):
        if g is not None:
            assert _rel(t[name].grad.numpy(), g) < 1e-4, (op, name)


@needs_numba
def test_pynorm_calls_with_buffers_run_on_numba() -> None:
    case = cases.make_case("add_rms_norm", (4, 8))
    calls = cases.pynorm_calls(case, "numba", buffers=True)
    assert set(calls) == {"fwd", "fwd_alloc", "bwd", "fwd+bwd"}
    y, _ = calls["fwd"]()
    assert np.shares_memory(y[0], case.y)
    y2, _ = calls["fwd_alloc"]()
    assert not np.shares_memory(y2[0], case.y) and np.array_equal(y2[0], y[0])
    calls["fwd+bwd"]()


def test_rounds_are_spread() -> None:
    assert runner._rounds(21, 5) == {0, 5, 10, 15, 20}
    assert runner._rounds(3, 5) == {0, 1, 2}
    assert runner._rounds(7, 1) == {3}
    assert len(runner._rounds(11, 2)) == 2


@needs_numba
def test_workers_interleave_in_their_processes() -> None:
    """pynorm and the reference in two processes: every round times pynorm and the copy, the baseline its
    rounds; the byte model arrives from the pynorm process; an unknown library is reported, not started."""
    with runner.Workers(1, ["numpy"]) as w:
        assert list(w.procs) == ["pynorm", "numpy"]
        pids = {p.p.pid for p in w.procs.values()}
        assert len(pids) == 2 and os.getpid() not in pids
        res = runner.interleave(w, (4, 8), ["layer_norm", "dyt"], runner.LIB_PHASES, repeat=3, base_repeat=2,
                                budget_s=10.0, copies=("copy", "copyto"))  # fmt: skip
    t = res["times"]
    assert sorted(t["pynorm"]) == sorted(["copy", "copyto"] + [f"{op}:{ph}" for op in ("layer_norm", "dyt")
                                          for ph in ("fwd", "bwd", "fwd+bwd")])  # fmt: skip
    assert all(len(v) == 3 and min(v) > 0 for v in t["pynorm"].values())
    assert sorted(t["numpy"]) == ["dyt:bwd", "dyt:fwd", "layer_norm:bwd", "layer_norm:fwd"]
    assert all(len(v) == 2 for v in t["numpy"].values()) and res["rounds"] == {"pynorm": 3, "numpy": 2}
    assert res["bytes"]["layer_norm"] == cases.op_bytes(cases.make_case("layer_norm", (4, 8)))
    assert not res["errors"]


def test_worker_answers_errors_and_ends_with_its_input() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmds = [{"cmd": "hello"}, {"cmd": "nonsense"}, {"cmd": "prepare", "shape": [4, 8], "ops": ["layer_norm"],
            "phases": ["fwd"], "seed": 0}, {"cmd": "time", "keys": ["layer_norm:fwd"]}]  # fmt: skip
    lines = "\n".join(json.dumps(c) for c in cmds) + "\n"
    proc = subprocess.run([sys.executable, "-m", "pynorm.bench.worker", "numpy", "1"], cwd=ROOT, env=env, text=True,
                          input=lines, capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(replies) == 4
    assert replies[0]["lib"] == "numpy" and "unknown command 'nonsense'" in replies[1]["error"]
    assert replies[2]["bytes"]["layer_norm"]["fwd"] > 0 and replies[3]["layer_norm:fwd"] > 0
    bad = subprocess.run([sys.executable, "-m", "pynorm.bench.worker", "jax", "1"], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "usage" in bad.stderr


@needs_numba
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops-shape", "4x"], "argument --ops-shape: must be ROWSxHIDDEN"),
        (["--small-shape", "0x8"], "argument --small-shape: must be ROWSxHIDDEN"),
        (["--repeat", "0"], "argument --repeat: must be a positive integer"),
        (["--threads", "x"], "argument --threads: must be a positive integer"),
        (["--only", "layer_nrom"], "--only: unknown op(s) layer_nrom"),
        (["--compile", "--compile-ops", "dyt,nope"], "--compile-ops: unknown op(s) nope"),
        (["--compile", "--compile-dtypes", "float8"], "--compile-dtypes: must name some of"),
        (["--compile", "--ops"], "--compile runs alone"),
        (["--threads", "4096"], "--threads: at most"),
        (["--sizes", "--peers", "torch,mxnet"], "--peers: unknown mxnet"),
        (["--sizes", "--rows", "0,4"], "--rows: expected comma-separated positive integers"),
        (["--sizes", "--hidden", "100"], "--hidden: multiples of 32"),
        (["--sizes", "--only", "dyt"], "--only with --sizes: unknown dyt"),
        (["--sizes", "--ops"], "--sizes runs alone"),
    ],
)
def test_bad_options_are_argparse_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:  # fmt: skip
    from pynorm.bench import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "b")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@needs_numba
def test_small_calls_table(tmp_path: Path) -> None:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pynorm", "bench", "--small", "--small-shape", "2x8", "--repeat", "1",
                           "--only", "layer_norm,conditional_rms_norm", "--no-torch", "--out", "s"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "s" / "small_calls.json").read_text())
    assert [r["op"] for r in data["rows"]] == ["layer_norm", "conditional_rms_norm"]
    for r in data["rows"]:
        assert set(r) == {"op", "pynorm", "numpy", "ratio"}
        assert all(v > 0 for lib in ("pynorm", "numpy") for v in r[lib].values())
        assert math.isclose(r["ratio"]["numpy"]["fwd"], r["numpy"]["fwd"] / r["pynorm"]["fwd"])
    assert data["shape"] == [2, 8] and data["copyto_us"] > 0 and data["meta"]["loadavg_start"]
    assert "conditional_rms_norm" in proc.stdout and "microseconds per call" in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "s" / "small_calls.png").stat().st_size > 5000


@needs_numba
def test_size_sweep_runs_every_cell_in_its_own_process(tmp_path: Path) -> None:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pynorm", "bench", "--sizes", "--rows", "1,3", "--hidden", "64",
                           "--repeat", "2", "--peers", "", "--out", "z"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "z" / "sizes.json").read_text())
    from pynorm.bench import sizes

    assert [(c["op"], c["rows"], c["hidden"]) for c in data["cells"]] == [
        (op, r, 64) for op in sizes.OPS for r in (1, 3)
    ]
    for c in data["cells"]:
        assert not c["errors"], c["errors"]
        assert set(c["t"]) == {"copy", "pynorm:fwd", "pynorm:fwdbwd", "pynorm:plan_fwd", "pynorm:plan_fwdbwd"}
        assert all(v > 0 for v in c["t"].values())
        assert c["bytes"] == 4 * c["rows"] * 64
    assert data["meta"]["rounds"] == 2 and data["meta"]["threads"] == 2 and data["summary"] == {}
    assert "group_norm" in proc.stdout and "fwdbwd (us;" in proc.stdout


def test_size_sweep_summary_is_the_geometric_mean_of_the_best_peer() -> None:
    from pynorm.bench import sizes

    cells = [
        {"op": "layer_norm", "rows": 1, "hidden": 64, "bytes": 256,
         "t": {"pynorm:fwd": 2.0, "torch:fwd": 4.0, "ort:fwd": 1.0, "pynorm:fwdbwd": 1.0, "torch:fwdbwd": 3.0}},
        {"op": "layer_norm", "rows": 2, "hidden": 64, "bytes": 512,
         "t": {"pynorm:fwd": 1.0, "jax:fwd": 4.0, "pynorm:fwdbwd": 2.0, "jax:fwdbwd": 8.0}},
    ]  # fmt: skip
    s = sizes.summary(cells)
    assert math.isclose(s["fwd"]["geomean_best_peer_over_pynorm"], math.sqrt(0.5 * 4.0))
    assert s["fwd"]["pynorm_at_least_as_fast_as_best_peer"] == 1 and s["fwd"]["cells"] == 2
    assert s["fwd"]["pynorm_at_least_as_fast_as_torch"] == 1 and s["fwd"]["cells_with_torch"] == 1
    assert math.isclose(s["fwdbwd"]["geomean_best_peer_over_pynorm"], math.sqrt(3.0 * 4.0))
    assert "plan_fwd" not in s  # (no plan times in these cells)
    cells[0]["t"]["pynorm:plan_fwd"] = 0.5  # the plan's call against the same peers
    s2 = sizes.summary(cells)
    assert s2["plan_fwd"]["cells"] == 1 and math.isclose(s2["plan_fwd"]["geomean_best_peer_over_pynorm"], 2.0)
    assert "1.41" in sizes.text({"meta": {"threads": 2, "cpu": "x", "rounds": 1, "loadavg_before": [0.0],
                                          "loadavg_after": [0.0], "unavailable": {}}, "cells": cells,
                                 "summary": s})  # fmt: skip


def test_report_tables_read_the_results() -> None:
    """The text and Markdown tables and the load line of a made-up result (no timing)."""
    row = {"op": "dyt", "shape": [4, 8], "copy_gbs": 10.0, "run_copy_gbs": 10.0, "bytes": {}, "errors": {},
           "fwd_s": 0.002, "fwd_gbs": 5.0, "fwd_frac_copy": 0.5, "fwd_frac_run_copy": 0.5,
           "fwd+bwd_s": 0.004, "fwd+bwd_gbs": 6.0, "fwd+bwd_frac_copy": 0.6, "fwd+bwd_frac_run_copy": 0.6,
           "speedup": {"torch": {"fwd": 2.0, "fwd+bwd": 3.0}}}  # fmt: skip
    text = report.ops_text([row], {"dyt": False})
    assert "dyt" in text and "2.0*" in text and "3.0*" in text and " 50%" in text
    md = report.markdown_ops({"rows": [row], "torch_baselines": {"dyt": {"native": False}}})
    assert md.splitlines()[-1] == "| `dyt` | 2.0 | 50% | 4.0 | 60% | - | 2.0 / 3.0 | composition |"
    meta = {"loadavg_start": [1.0, 2.0, 3.0], "loadavg_end": [0.5, 0.25, 0.125], "threads": 2, "cpu_count": 2,
            "cpu_others": {"others_cores": 0.25, "steal_cores": 0.0, "seconds": 61.0}}  # fmt: skip
    line = report.load_line(meta)
    assert line.startswith("other processes kept 0.25 of the 2 cores busy on average (steal 0.00) over the 61 s")
    assert "load average (1, 5, 15 min) 1.00, 2.00, 3.00 at the start, 0.50" in line


def test_cpu_meter_subtracts_the_benchmarks_own_time() -> None:
    """A busy loop in this process is the benchmark's own time, not the others' (Linux; elsewhere None)."""
    meter = runner.CpuMeter()
    meter.start()
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    got = meter.read()
    if got is None:
        pytest.skip("no /proc/stat here")
    assert got["seconds"] >= 0.3 and got["ours_cores"] * got["seconds"] >= 0.28
    assert 0 <= got["others_cores"] <= (os.cpu_count() or 1)


@needs_numba
def test_a_baseline_that_dies_is_dropped_not_fatal() -> None:
    with runner.Workers(1, ["numpy"]) as w:
        w.procs["numpy"].p.kill()
        w.procs["numpy"].p.wait()
        res = runner.interleave(w, (4, 8), ["rms_norm"], runner.LIB_PHASES, repeat=2, base_repeat=2, budget_s=10.0)
        assert list(w.procs) == ["pynorm"] and "died" in w.unavailable["numpy"]
    assert list(res["times"]) == ["pynorm"] and len(res["times"]["pynorm"]["rms_norm:fwd"]) == 2


def _bench_script(name: str) -> Any:
    """The script ``bench/<name>.py`` as a module (``bench/`` is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"pynorm_bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_numba
def test_limits_rows_are_consistent(tmp_path: Path) -> None:
    """``bench/limits.py`` on a tiny shape: one row per op, variant and phase, each with its counted bytes (the op
    table's byte model) and fractions ordered as their definitions make them (``serial <= ceiling <= 1``)."""
    limits = _bench_script("limits")
    out = tmp_path / "limits.json"
    assert limits.main(["--shape", "256x64", "--cache-rows", "128", "--ops", "layer_norm,dyt", "--bare",
                        "--repeat", "1", "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["op"], r["phase"]) for r in rows] == [
        (op, ph)
        for base in ("layer_norm", "dyt")
        for op in (base, f"{base} (no optional params)")
        for ph in ("fwd", "bwd")
    ]
    for r in rows:
        case = cases.make_case(r["op"].split()[0], (256, 64))
        if "optional" in r["op"]:
            case = limits.bare_case(case)
        assert r["bytes"] == cases.op_bytes(case)[r["phase"]]
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("t_s", "mem_s", "comp_s", "ns_per_elem_1thread"))
        assert r["mem_s"] == pytest.approx(r["bytes"] / (r["copy_gbs"] * 1e9))
        assert 0 < r["serial"] <= r["ceiling"] <= 1
        assert r["measured"] == pytest.approx(r["mem_s"] / r["t_s"])


@needs_numba
def test_limits_bare_case_drops_only_optional_parameters() -> None:
    limits = _bench_script("limits")
    dyt = cases.make_case("dyt", (8, 16))
    bare = limits.bare_case(dyt)
    assert bare is not None
    named = dict(zip(SPECS["dyt"].param_names, bare.args, strict=True))
    assert named["alpha"] is not None and named["weight"] is None and named["bias"] is None
    assert limits.bare_case(bare) is None  # nothing left to drop


@needs_numba
def test_limits_refuses_ops_it_does_not_model() -> None:
    limits = _bench_script("limits")
    with pytest.raises(SystemExit):
        limits.main(["--ops", "group_norm", "--shape", "8x8"])
    assert "group_norm" not in limits.MODELED and "layer_norm_linear" not in limits.MODELED


def _member(entries: dict[str, Any]) -> Any:
    return lambda suffix: entries[suffix]  # a missing member raises KeyError, as numpy's archive does


def test_bitwise_record_of_a_small_output_is_whole() -> None:
    bw = _bench_script("bitwise_check")
    a = np.linspace(-3, 3, 1000, dtype=np.float32).reshape(10, 100)
    rec = bw.record_entry(a)
    assert int(rec["|step"]) == 1 and np.array_equal(rec[""], a)
    assert bw.compare_entry(a.copy(), _member(rec)) is None
    b = a.copy()
    b[3, 7] = np.nextafter(b[3, 7], np.float32(np.inf))
    assert bw.compare_entry(b, _member(rec)) == "1/1000 elements differ, max 1 ulp"
    assert bw.compare_entry(a[:5], _member(rec)).startswith("shape/dtype")
    assert bw.compare_entry(a.astype(np.float64), _member(rec)).startswith("shape/dtype")


def test_bitwise_record_of_a_large_output_is_a_digest_and_a_sample() -> None:
    bw = _bench_script("bitwise_check")
    a = np.random.default_rng(0).standard_normal((64, bw.FULL_BYTES // 64 // 4 + 1)).astype(np.float32)
    rec = bw.record_entry(a)
    step = int(rec["|step"])
    assert step > 1 and rec[""].size == -(-a.size // step) and rec[""].size <= bw.SAMPLE + 1
    assert bw.compare_entry(a.copy(), _member(rec)) is None
    b = a.copy()
    b.reshape(-1)[step] *= np.float32(1 + 2**-20)  # a sampled element
    assert "sampled elements" in bw.compare_entry(b, _member(rec)) and "differ, max" in bw.compare_entry(
        b, _member(rec)
    )
    c = a.copy()
    c.reshape(-1)[1] += 1  # between two samples: only the digest sees it
    assert bw.compare_entry(c, _member(rec)).startswith("differs outside its")
    d = a.copy()
    d.reshape(-1)[0] = np.float32(0.0)
    rec0 = bw.record_entry(d)
    d.reshape(-1)[0] = np.float32(-0.0)  # equal values, other bits
    assert "bits only" in bw.compare_entry(d, _member(rec0))


def test_bitwise_record_reads_the_older_layout_and_bfloat16() -> None:
    bw = _bench_script("bitwise_check")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    old = {"": a, "|dtype": np.array("float32")}
    assert bw.compare_entry(a.copy(), _member(old)) is None
    b = a.copy()
    b[0, 1] = 2.0
    assert bw.compare_entry(b, _member(old)) == "1/12 elements differ, max 4.19e+06 ulp"
    if bw.BF16 is not None:
        h = a.astype(bw.BF16)
        rec = bw.record_entry(h)
        assert rec[""].dtype == np.uint16
        assert bw.compare_entry(h.copy(), _member(rec)) is None


def test_compile_cost_charges_each_signature_to_the_tests_that_need_it(tmp_path: Path) -> None:
    """``bench/compile_cost.py``'s report from its two runs' records: top-level compilations only (a kernel's
    callees compile inside it), the slowest of a signature's compilations across workers, and a test function's
    unique cost made of the signatures no other test function launches."""
    cc = _bench_script("compile_cost")
    a, b, c = ("k.fwd", "(float32,)"), ("k.fwd", "(float64,)"), ("k.bwd", "(float32,)")
    recs = [
        {"kernel": a[0], "sig": a[1], "s": 2.0, "depth": 0, "test": "t.py::one[x]"},
        {"kernel": "k._inner", "sig": "()", "s": 1.5, "depth": 1, "test": "t.py::one[x]"},
        {"kernel": b[0], "sig": b[1], "s": 3.0, "depth": 0, "test": "t.py::one[y]"},
        {"kernel": c[0], "sig": c[1], "s": 5.0, "depth": 0, "test": "t.py::two"},
    ]
    (tmp_path / "compile-gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    again = {**recs[0], "s": 2.5}  # the other worker compiled it too: its slower time counts, once
    (tmp_path / "compile-gw1.jsonl").write_text(json.dumps(again) + "\n")
    needs = {"t.py::one[x]": [a, c], "t.py::one[y]": [b], "t.py::two": [c]}
    (tmp_path / "need-gw0.json").write_text(json.dumps(needs))
    out = cc.report(tmp_path)
    assert out.splitlines()[0].startswith("3 top-level signatures compiled (5 compilations with their callees): 10 s")
    unique = {ln.split()[1]: float(ln.split()[0]) for ln in out.split("unique compile cost)\n")[1].splitlines()}
    assert unique == {"t.py::one": 5.5}  # a (2.5) and b (3.0); c is needed by both test functions
