"""BatchNorm on the fast backends' column-statistics kernels (numba ``column.py``, cupy ``kernels/column.cu``).

The backend-parametrized tests of ``tests/test_channel_norms.py`` cover gradients, running statistics and layers;
here: the family's registration, hard inputs against the reference in ulps at the terms' magnitude (large common
offsets, constant channels, one value per row), bitwise determinism across thread counts and calls (numba), and
the CUDA kernels' 64-bit element indexing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm.ops import get
from pynorm.testing import max_ulp_error

ROOT = Path(__file__).resolve().parents[1]
CU = ROOT / "pynorm" / "backends" / "cupy" / "kernels" / "column.cu"

#: ulps allowed at the terms' magnitude, per dtype (measured: float32 <= 2, float64 <= 3, float16 <= 1)
BUDGET = {"float16": 2.0, "bfloat16": 2.0, "float32": 4.0, "float64": 8.0}


def test_batch_norm_is_served_by_the_fast_backends() -> None:
    ops = pynorm.list_ops()["batch_norm"]
    assert "numba" in ops and "cupy" in ops


def _inputs(kind: str, shape: tuple[int, ...], dt: Any, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(shape)
    big = 1e2 if np.dtype(dt).itemsize == 2 else (1e4 if dt == np.float32 else 1e8)
    if kind == "offset":
        x = big + x
    elif kind == "constant":  # channel 0 constant, channel 1 offset, the others ordinary
        x[:, 0] = 3.25
        x[:, 1] += big
    return x.astype(dt)


def _both(backend: Any, x: np.ndarray, training: bool, rng: np.random.Generator) -> tuple[dict, dict, dict]:
    dt, c = x.dtype, x.shape[1]
    w = (1 + 0.5 * rng.standard_normal(c)).astype(dt)
    b = rng.standard_normal(c).astype(dt)
    rm = (x.astype(np.float64).mean(axis=(0, 2)) + 0.1).astype(dt)
    rv = (0.5 + rng.random(c)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    out = {}
    for name, to, back in (("numpy", np.asarray, np.asarray), (backend.name, backend.asarray, backend.to_numpy)):
        res, ctx = pynorm.batch_norm_forward(
            to(x), to(w), to(b), running_mean=to(rm), running_var=to(rv), training=training, backend=name
        )
        g = pynorm.batch_norm_backward(to(dy), ctx)
        y = res[0] if isinstance(res, tuple) else res
        got = {"y": y, "dx": g.dx, "dweight": g.dweight, "dbias": g.dbias}
        if training:
            got.update(running_mean=res[1], running_var=res[2])
        out[name] = {k: np.asarray(back(v)) for k, v in got.items()}
    arrays = {"weight": w, "bias": b, "running_mean": rm, "running_var": rv}
    scales = get("batch_norm").term_scales(x, arrays, dy, {"training": training, "eps": 1e-5})
    return out[backend.name], out["numpy"], scales


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kind", ["normal", "offset", "constant"])
@pytest.mark.parametrize(
    "shape", [(8, 3, 37), (40, 4, 64), (5, 3, 1), (20, 2, 1700)], ids=["s37", "s64", "s1", "chunks"]
)  # chunks: 34000 values per channel, three of the cupy reductions' chunks (the last partial)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_hard_inputs_match_the_reference_in_ulps(
    backend: Any, dt: Any, kind: str, shape: tuple, training: bool
) -> None:
    if "batch_norm" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'batch_norm'")
    rng = np.random.default_rng([len(kind), *shape])
    mine, ref, scales = _both(backend, _inputs(kind, shape, dt, rng), training, rng)
    worst = {k: max_ulp_error(mine[k], ref[k], dt, scale=scales.get(k)) for k in ref}
    assert max(worst.values()) <= BUDGET[np.dtype(dt).name], worst


def test_a_constant_channel_normalizes_to_exactly_the_bias(backend: Any) -> None:
    if "batch_norm" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'batch_norm'")
    x = np.full((6, 2, 33), 1e4 + 0.25, np.float32)
    x[:, 1] = np.random.default_rng(0).standard_normal((6, 33))
    w, b = np.array([2.0, 1.0], np.float32), np.array([0.5, 0.0], np.float32)
    y, _ = pynorm.batch_norm_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b), training=True,
                                     backend=backend.name)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(backend.to_numpy(y))[:, 0], 0.5)


def _run_numba(x: np.ndarray, dy: np.ndarray, training: bool) -> list[np.ndarray]:
    c = x.shape[1]
    rng = np.random.default_rng(1)
    w, b = (1 + rng.standard_normal(c)).astype(x.dtype), rng.standard_normal(c).astype(x.dtype)
    rm, rv = np.zeros(c, x.dtype), np.ones(c, x.dtype)
    res, ctx = pynorm.batch_norm_forward(x, w, b, running_mean=rm, running_var=rv, training=training, backend="numba")
    g = pynorm.batch_norm_backward(dy, ctx)
    outs = list(res) if isinstance(res, tuple) else [res]
    return [np.array(a) for a in (*outs, g.dx, g.dweight, g.dbias)]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(64, 8, 512), (4096, 16, 1), (3, 5, 70000)], ids=["s512", "s1", "few_samples"])
def test_numba_is_bitwise_deterministic_across_threads_and_calls(dt: Any, shape: tuple) -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(2)
    x = (3 + rng.standard_normal(shape)).astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    runs = []
    try:
        for n in (1, 2, 1, 2):
            pynorm.set_num_threads(n)
            runs.append(_run_numba(x, dy, True) + _run_numba(x, dy, False))
    finally:
        pynorm.set_num_threads(None)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------
# 64-bit indexing of kernels/column.cu


def _kernels(src: str) -> dict[str, str]:
    """Each ``__global__`` kernel's parameter list and body (up to the next kernel)."""
    parts = re.split(r"template <typename T, typename A>\s*\n__global__", src)
    out = {}
    for p in parts[1:]:
        m = re.search(r"(\w+)\(([^)]*)\)\s*\{", p, re.S)
        assert m is not None
        out[m.group(1)] = m.group(2) + "\n" + p[m.end() :]
    return out


def test_column_kernels_index_with_64_bit_integers() -> None:
    """Source pattern (real sizes of 2^31+ values per channel do not fit the CPU harness): every size and count
    a kernel takes is ``long long`` (C and the chunk count, bounded by the grid, may be ``int``), every loop over
    elements runs on a ``long long`` index, and no element offset is formed in ``int``."""
    src = CU.read_text()
    kernels = _kernels(src)
    assert set(kernels) == {"col_stats", "col_merge", "col_apply", "col_bwd_sums", "col_sum_chunks", "col_dx",
                            "col_scale"}  # fmt: skip
    for name, text in kernels.items():
        params = text.split("\n", 1)[0]
        for size in ("values", "total", "S"):
            if re.search(rf"\b{size}\b", params):
                assert re.search(rf"long long {size}\b", params), f"{name}: {size} is not long long"
        body = text.split("\n", 1)[1]
        for loop in re.findall(r"for \((\w+(?: \w+)?) (\w+) = ([^;]*);", body):
            typ, var, init = loop
            if "blockIdx" in init or "threadIdx" in init or var in ("e", "i"):
                assert typ == "long long", f"{name}: element loop over {var} is {typ}"
        # (the channel index c < C is an int; nothing else is formed from the grid or the sizes in int)
        assert not re.search(r"\bint (?!c\b)\w+ = [^;]*(blockIdx\.x \* |\* S|\* C)", body), name
    walk = src[src.index("struct ColumnWalk") : src.index("template <typename T, typename A>")]
    assert "long long n, s;" in walk and "long long S, CS, base;" in walk
    assert "static_cast<long long>(blockIdx.x) * PYNORM_COLUMN_CHUNK" in src


_PROBE = """
namespace pynorm {
__global__ void __launch_bounds__(PYNORM_COLUMN_THREADS)
walk_probe(long long e0, int c, long long C, long long S, int steps, long long* out, int* chan) {
  ColumnWalk w(e0 + threadIdx.x, c, C, S);
  for (int k = 0; k < steps; ++k) {
    out[k * PYNORM_COLUMN_THREADS + threadIdx.x] = w.offset();
    w.next();
  }
  chan[threadIdx.x] = channel_of(e0 * 3 + threadIdx.x, C, S, false);
}
}  // namespace pynorm
"""


@pytest.mark.parametrize("e0, c, C, S", [(3_000_000_017, 5, 7, 3), (2**33 + 11, 1, 3, 100_003), (2**31 - 100, 0, 2, 1)])
def test_column_walk_offsets_are_exact_beyond_2_to_the_31(e0: int, c: int, C: int, S: int) -> None:
    """The harness runs column.cu's element walk and channel index at fake sizes (no memory behind them): the
    offsets of values past 2^31 (of arrays past 2^32 elements) are the exact ``(n C + c) S + s``."""
    from tests.cuda_cpu import requested, unavailable_reason

    if not requested() or unavailable_reason() is not None:
        pytest.skip("runs on the CPU execution harness (PYNORM_CUDA_CPU=1)")
    import cupy

    from pynorm.backends.cupy import _loader

    code = _loader.assemble("column.cu") + _PROBE
    mod = _loader.Module(code, ["pynorm::walk_probe"])
    steps, threads = 5, 256
    out = cupy.zeros(steps * threads, dtype=cupy.int64)
    chan = cupy.zeros(threads, dtype=cupy.int32)
    mod.get_function("pynorm::walk_probe")(
        (1,), (threads,), (np.int64(e0), np.int32(c), np.int64(C), np.int64(S), np.int32(steps), out, chan)
    )
    got = cupy.asnumpy(out).reshape(steps, threads)
    for k in range(steps):
        for t in (0, 1, threads - 1):
            e = e0 + t + k * threads
            assert int(got[k, t]) == (e // S * C + c) * S + e % S
    want = [((e0 * 3 + t) // S) % C for t in range(threads)]
    assert cupy.asnumpy(chan).tolist() == want


def test_the_compile_check_covers_column_cu() -> None:
    """column.cu is a family file of the loader: its seven kernels for the seven ``(T, A)`` pairs (no float ``A``
    for double ``x``), what ``python -m pynorm.backends.cupy.compile_check`` and tests/test_cupy_kernels.py build."""
    from pynorm import ops
    from pynorm.backends.cupy import _launch, _loader

    assert _loader.FAMILY_FILES["column"] == "column.cu" and _loader.supports(ops.BATCH_NORM)
    names = _loader.instantiations("column.cu")
    assert len(names) == 7 * 7 and len(set(names)) == len(names)
    assert "pynorm::col_stats<__nv_bfloat16, float>" in names and "pynorm::col_dx<double, double>" in names
    assert not any(n.startswith("pynorm::col_apply<double, float") for n in names)
    assert sorted(n for g in _loader.instantiation_groups("column.cu") for n in g) == sorted(names)
    assert all(_launch.launch_bound(n) == _launch.DEFS["COLUMN_THREADS"] for n in names)
