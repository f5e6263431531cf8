#!/usr/bin/env bash
# The one prepared GPU check of pynorm's CuPy backend (about 3 minutes on an H200; at most 12: each stage under its own limit).
#
#   bash bench/gpu_check.sh            # from anywhere; writes logs + JSON to $OUT (or /tmp/pynorm_gpu_check)
#
# Stages, each under its own time limit so that one hang cannot eat the budget:
#   1. versions and the device (nvidia-smi, python, cupy, torch);
#   2. the GPU tests: tests/test_cupy_backend.py (every op, dtype, convention and launch
#      path against the reference; compiles every kernel module first, in parallel), then
#      the cross-backend suite tests/test_backends.py on the cupy backend;
#   3. bench/bench_gpu.py: forward, backward, forward+backward vs the device-to-device copy
#      bandwidth and vs torch (and Liger if importable);
#   4. compute-sanitizer memcheck over every op's forward + backward (bench/gpu_sanitize.py --quick);
#   5. pynorm check of the cupy backend: every op over the oracle's full grid (bench/gpu_oracle.py).
#
# It installs nothing from the network. The lent H200 image already has cupy-cuda13x,
# torch, triton, ml_dtypes, pytest and hypothesis. On a machine without them, carry wheels:
# here, in the repo root:  echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#     cupy-cuda13x==14.2.0 ml_dtypes==0.6.0 liger-kernel   # (cupy's wheel is ~70 MB: over the
#                                                            # 64 MiB carry limit, so only where needed)
# then name `.whl` in the run's carry list: this script installs .whl/*.whl into /tmp/site
# (no index, no deps) before anything else.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/pynorm_gpu_check}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing carried wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUTDIR/gpu.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUTDIR/gpu.txt"
import sys
print("python", sys.version.split()[0])
for m in ("numpy", "cupy", "ml_dtypes", "torch", "triton", "liger_kernel", "cuda.bindings"):
    try:
        mod = __import__(m, fromlist=["_"])
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(m, "absent:", exc)
import cupy
print("cupy.is_available:", cupy.is_available())
EOF

echo "== GPU tests (tests/test_cupy_backend.py)"
timeout 200 $PY -m pytest tests/test_cupy_backend.py -q -rfE --tb=short --maxfail=40 -p no:cacheprovider \
  >"$OUTDIR/tests_cupy_backend.log" 2>&1
rc_tests=$?
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUTDIR/tests_cupy_backend.log" | tail -45

echo "== cross-backend suites on cupy (tests/test_backends.py, tests/test_channel_norms.py)"
PYNORM_TEST_BACKENDS=cupy timeout 100 $PY -m pytest -n 4 tests/test_backends.py tests/test_channel_norms.py -q -rfE \
  --tb=short --maxfail=30 -p no:cacheprovider >"$OUTDIR/tests_backends_cupy.log" 2>&1
rc_cross=$?
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUTDIR/tests_backends_cupy.log" | tail -15

echo "== benchmark (bench/bench_gpu.py)"
timeout 150 $PY bench/bench_gpu.py --json "$OUTDIR/bench_gpu.json" >"$OUTDIR/bench.log" 2>&1
rc_bench=$?
grep -v '^{' "$OUTDIR/bench.log" | tail -60

echo "== compute-sanitizer memcheck: every op's forward + backward (bench/gpu_sanitize.py --quick)"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  timeout 110 "$SAN" --tool memcheck --error-exitcode 9 --print-limit 20 $PY bench/gpu_sanitize.py --quick \
    >"$OUTDIR/sanitize.log" 2>&1
  rc_san=$?
  grep -E "=====|FAILED|failed calls|Error" "$OUTDIR/sanitize.log" | head -40
else
  echo "compute-sanitizer not found"; rc_san=0
fi

echo "== pynorm check of the cupy backend: every op over the oracle's full grid (bench/gpu_oracle.py)"
timeout 150 $PY bench/gpu_oracle.py >"$OUTDIR/oracle.log" 2>&1
rc_oracle=$?
grep -E "passed:|FAILED|ERROR|done:" "$OUTDIR/oracle.log" | head -40

echo "== exit codes: gpu tests $rc_tests, cross-backend $rc_cross, bench $rc_bench, sanitizer $rc_san," \
  "oracle $rc_oracle (logs in $OUTDIR)"
[ "$rc_tests" -eq 0 ] && [ "$rc_cross" -eq 0 ] && [ "$rc_bench" -eq 0 ] && [ "$rc_san" -eq 0 ] && [ "$rc_oracle" -eq 0 ]
