"""Every command-line entry point, run as a user runs it: ``python -m pynorm ...`` (and the ``pynorm`` script) in a
fresh process, in a temporary directory, checking its exit status and what it prints and writes.

The numba backend's commands (``bench``) run in the numba env; elsewhere they must say what they need.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pynorm

ROOT = Path(__file__).resolve().parents[1]
HAS_NUMBA = pynorm._registry.unavailable_reason("numba") is None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed (the numba env runs these)")


def _run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pynorm", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return proc


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def test_help_describes_every_command(tmp_path: Path) -> None:
    out = _ok(_run(["--help"], tmp_path))
    for cmd in ("demo", "selftest", "backends", "bench", "check", "vectors", "warmup"):
        assert f"    {cmd} " in out, out
    for cmd in ("demo", "selftest", "bench", "check", "vectors", "warmup"):
        assert "usage: python -m pynorm" in _ok(_run([cmd, "--help"], tmp_path)), cmd


def test_backends(tmp_path: Path) -> None:
    out = _ok(_run(["backends"], tmp_path))
    assert "numpy: numpy.ndarray" in out and "available=True" in out
    assert "numba:" in out and "cupy:" in out


def test_console_script(tmp_path: Path) -> None:
    """The ``pynorm`` script the package installs (where it is on PATH: an installed, not a source, checkout)."""
    script = shutil.which("pynorm") or (str(Path(sys.executable).parent / "pynorm"))
    if not Path(script).exists():
        pytest.skip("the pynorm console script is not installed next to this Python (a source checkout)")
    proc = subprocess.run([script, "backends"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "numpy:" in proc.stdout, proc.stderr[-2000:]


def test_selftest_every_op(tmp_path: Path) -> None:
    """Every op (the quantize family's optional x_scale included) on the reference and, where installed, numba:
    float32 and float64, the float64 gradient checks passing."""
    backends = "numpy,numba" if HAS_NUMBA else "numpy"
    out = _ok(_run(["selftest", "--backends", backends, "--dtypes", "float32,float64", "--rows", "8", "--hidden",
                    "24"], tmp_path))  # fmt: skip
    runs = [(op, b) for op, offered in pynorm.list_ops().items() for b in backends.split(",") if b in offered]
    for op, b in runs:
        assert f"{op:19s} {b:8s} float64" in out, (op, b, out[-2000:])
    assert set(pynorm.ops.SPECS) == {op for op, _ in runs}
    assert out.count("PASSED") == len(runs) and "FAILED" not in out


def test_selftest_rejects_unknown_names(tmp_path: Path) -> None:
    proc = _run(["selftest", "--ops", "layer_nrom"], tmp_path)
    assert proc.returncode != 0 and "unknown op(s) layer_nrom" in proc.stderr


def test_demo_quick(tmp_path: Path) -> None:
    out = _ok(_run(["demo", "--quick", "--no-progress", "--out", "d"], tmp_path))
    assert "claim" in out
    data = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert data["claims"] and all(c["source"] for c in data["claims"])
    if _has_matplotlib():
        assert (tmp_path / "d" / "demo.png").stat().st_size > 10_000
    else:  # the test envs: the demo says how to get its figure
        assert "no figure: pip install matplotlib" in out


@needs_numba
def test_bench_quick(tmp_path: Path) -> None:
    out = _ok(_run(["bench", "--quick", "--no-torch", "--no-cold", "--repeat", "2", "--out", "b"], tmp_path))
    assert "layer_norm" in out and "rms_norm" in out
    assert json.loads((tmp_path / "b" / "bench_results.json").read_text())
    assert (tmp_path / "b" / "bench_results.png").exists() == _has_matplotlib()


@needs_numba
def test_bench_ops_covers_every_op(tmp_path: Path) -> None:
    out = _ok(_run(["bench", "--ops", "--ops-shape", "32x64", "--repeat", "1", "--out", "b"], tmp_path))
    rows = json.loads((tmp_path / "b" / "op_table.json").read_text())["rows"]
    assert sorted(r["op"] for r in rows) == sorted(pynorm._registry.backend_ops("numba"))  # every op, channels too
    assert all(r["fwd_s"] > 0 and r["fwd+bwd_s"] > 0 for r in rows)
    assert "conditional_layer_norm" in out and "layer_norm_linear" in out and "batch_norm" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed: no charts" in out
    else:
        assert (tmp_path / "b" / "op_table.png").stat().st_size > 5000


def test_bench_without_numba_says_what_it_needs(tmp_path: Path) -> None:
    if HAS_NUMBA:
        pytest.skip("numba is installed here (the numpy env checks the message)")
    proc = _run(["bench", "--quick"], tmp_path)
    assert proc.returncode == 2 and "needs numba" in proc.stderr


def test_check(tmp_path: Path) -> None:
    """``check`` on an implementation written here (correct: passes, exit 0) and a broken one (eps added to the
    std: fails, exit 1)."""
    (tmp_path / "mine.py").write_text(
        "import numpy as np\n"
        "def good(x, weight, bias, eps=1e-5):\n"
        "    from pynorm import layer_norm\n"
        "    return layer_norm(x, weight, bias, eps=eps, axis=x.ndim - weight.ndim, backend='numpy')\n"
        "def bad(x, weight, bias, eps=1e-5):\n"
        "    xf = x.astype(np.float64)\n"
        "    ax = tuple(range(x.ndim - weight.ndim, x.ndim))\n"
        "    y = (xf - xf.mean(ax, keepdims=True)) / (xf.std(ax, keepdims=True) + eps)\n"
        "    return (y * weight + bias).astype(x.dtype)\n"
    )
    out = _ok(_run(["check", "mine:good", "--op", "layer_norm", "--quick", "--no-progress"], tmp_path))
    assert "PASSED" in out
    bad = _run(["check", "mine:bad", "--op", "layer_norm", "--quick", "--no-progress"], tmp_path)
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout[-2000:] + bad.stderr[-2000:]


def test_vectors_write_and_verify(tmp_path: Path) -> None:
    _ok(_run(["vectors", "--out", "v", "--ops", "layer_norm", "rms_norm"], tmp_path))
    assert (tmp_path / "v" / "index.json").exists()
    _ok(_run(["vectors", "--verify", "v"], tmp_path))


_FIRST_CALLS = r"""
import logging, sys
import numpy as np
import pynorm
quiet = False
for dt in sys.argv[1:]:
    if dt == "quiet":  # (then one forward compiles: enough to show it says nothing)
        logging.getLogger("pynorm.compile").setLevel(logging.ERROR)
        quiet = True
        continue
    # (float32, what warmup compiled: the fused and the rows backward; another dtype's first call: one shape)
    for shape in ((4, 64), (64, 1 << 14)) if dt == "float32" else ((4, 64),):
        x = np.random.default_rng(0).standard_normal(shape).astype(dt)
        y, ctx = pynorm.rms_norm_forward(x, np.ones(shape[1], dt), backend="numba")
        if quiet:
            continue
        pynorm.rms_norm_backward(y, ctx)
        if dt == "float32":  # (warmup --quantize ran nvfp4: the same kernels serve every format)
            pynorm.rms_norm(x, np.ones(shape[1], dt), backend="numba", quantize="mxfp4")
print("ran", *sys.argv[1:])
"""


@needs_numba
def test_warmup_compiles_ahead_and_first_compilations_say_so(tmp_path: Path) -> None:
    """``warmup`` fills an empty cache with progress lines; a process then running what it compiled (two shapes
    that take different launch paths, a quantized output of another format than warmup's) compiles nothing and
    says nothing, while a dtype it did not compile is announced once per direction on stderr -- and not at all once
    the ``pynorm.compile`` logger is silenced."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    warm = subprocess.run(
        [sys.executable, "-m", "pynorm", "warmup", "--ops", "rms_norm", "--dtypes", "float32", "--quantize"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert "1/1  rms_norm float32:" in warm.stdout and "done in" in warm.stdout, warm.stdout

    def first_calls(*dtypes: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", _FIRST_CALLS, *dtypes], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    after = first_calls("float32")
    assert after.returncode == 0 and "ran float32" in after.stdout, after.stderr
    assert "compiling" not in after.stderr, after.stderr
    cold = first_calls("float32", "float16")
    lines = [ln for ln in cold.stderr.splitlines() if "compiling" in ln]
    assert lines == [
        f"pynorm: compiling rms_norm {d} float16 kernels for this CPU (first use; cached for later runs)"
        for d in ("forward", "backward")
    ], cold.stderr
    quiet = first_calls("quiet", "float64")
    assert quiet.returncode == 0 and "compiling" not in quiet.stderr, quiet.stderr


def test_warmup_errors(tmp_path: Path) -> None:
    bad = _run(["warmup", "--ops", "layer_nrom"], tmp_path)
    assert bad.returncode == 2
    assert ("unknown op(s) layer_nrom" in bad.stderr) if HAS_NUMBA else ("needs the numba backend" in bad.stderr)
    if HAS_NUMBA:
        assert "--dtypes must name" in _run(["warmup", "--dtypes", "float8"], tmp_path).stderr
        assert "none of dyt offers quantize=" in _run(["warmup", "--ops", "dyt", "--quantize"], tmp_path).stderr
