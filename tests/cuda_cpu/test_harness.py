"""The CPU execution harness checked on its own: conversions, CUDA semantics, what it must report.

Runs where the harness runs (``tox -e cuda_cpu``, ``PYNORM_CUDA_CPU=1``); the probe kernels
are in ``probe_kernels.cu``. Bugs planted in copies of pynorm's own kernels are in
``test_planted_bugs.py``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from . import requested, unavailable_reason

if not requested():
    pytest.skip("the CPU execution harness runs in `tox -e cuda_cpu` (PYNORM_CUDA_CPU=1)", allow_module_level=True)
_REASON = unavailable_reason()
if _REASON is not None:
    pytest.skip(f"the CPU execution harness cannot run here: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402  (the harness's stand-in)
import ml_dtypes  # noqa: E402

from . import build, fakecupy  # noqa: E402

HarnessError = fakecupy.HarnessError
DriverError = fakecupy.CUDADriverError

PROBES = (Path(__file__).parent / "probe_kernels.cu").read_text()
NAMES = [
    "probe::rotate", "probe::rotate_racy", "probe::read_uninitialized_shared", "probe::partial_barrier",
    "probe::divergent_barriers", "probe::shuffles", "probe::shuffle_skipped_by_one_lane", "probe::deadlock",
    "probe::mask_names_missing_lanes", "probe::store_offset", "probe::dynamic_write", "probe::misaligned_vector_load",
    "probe::writes_const_input", "probe::spins", "probe::overflows_stack", "probe::indices", "probe::scalars",
    "probe::half_round_trip",
]  # fmt: skip


@pytest.fixture(scope="module")
def probes() -> fakecupy.RawModule:
    mod = cupy.RawModule(code=PROBES, options=("--std=c++17",), name_expressions=NAMES)
    mod.compile()
    return mod


def k(probes: fakecupy.RawModule, name: str) -> fakecupy.RawKernel:
    return probes.get_function(f"probe::{name}")


def f32(*shape: int, fill: float | None = None) -> cupy.ndarray:
    if fill is None:
        return cupy.empty(shape, dtype=np.float32)
    return cupy.full(shape, fill, dtype=np.float32)


# ---------------------------------------------------------------------------
# conversions: every 16-bit value, every float32, doubles at every rounding boundary


def _conv(fn: str, src: np.ndarray, out_dtype: type) -> np.ndarray:
    lib = build.runtime()
    src = np.ascontiguousarray(src)
    out = np.empty(src.shape, out_dtype)
    ct = {np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.uint16: ctypes.c_uint16}
    getattr(lib, fn)(
        src.ctypes.data_as(ctypes.POINTER(ct[src.dtype.type])),
        out.ctypes.data_as(ctypes.POINTER(ct[out_dtype])),
        src.size,
    )
    return out


def _same_or_both_nan(a_bits: np.ndarray, e_bits: np.ndarray, kind: str) -> np.ndarray:
    """Bitwise equal, or both NaN (NaN payloads are not specified)."""
    if kind == "f16":
        nan = lambda b: ((b & 0x7C00) == 0x7C00) & ((b & 0x3FF) != 0)  # noqa: E731
    else:
        nan = lambda b: ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)  # noqa: E731
    return (a_bits == e_bits) | (nan(a_bits) & nan(e_bits))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_every_16_bit_value_converts_to_float_exactly(kind):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _conv("pnc_f16_to_f32" if kind == "f16" else "pnc_bf16_to_f32", bits, np.float32)
    exp = bits.view(np.float16 if kind == "f16" else ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(exp)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), exp[~nan].view(np.uint32))


def _numpy_16(f: np.ndarray, kind: str) -> np.ndarray:
    """NumPy's / ml_dtypes' rounding of float32 values to 16-bit bits.

    NumPy's float32 -> float16 cast is ~20x slower where the result overflows or underflows
    (it raises the floating-point flags element by element), so there the IEEE answer is
    written out instead: |x| >= 65520 (NaN aside) rounds to infinity, |x| < 2**-25 to zero.
    Everything in between -- the half subnormals and the overflow boundary included -- is
    NumPy's own result.
    """
    if kind == "bf16":
        return f.astype(ml_dtypes.bfloat16).view(np.uint16)
    u = f.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    sign = ((u >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16)
    out = np.where(a < 0x33000000, sign, sign | np.uint16(0x7C00)).astype(np.uint16)
    mid = (a >= 0x33000000) & (a < 0x477FF000)
    nan = a > 0x7F800000
    if mid.any():
        out[mid] = f[mid].astype(np.float16).view(np.uint16)
    if nan.any():
        out[nan] = f[nan].astype(np.float16).view(np.uint16)
    return out


def _sweep_chunk(c: int, kind: str) -> tuple[int, tuple[int, int, int]]:
    chunk = 1 << 22
    bits = np.arange(chunk, dtype=np.uint32) + np.uint32(c * chunk)
    f = bits.view(np.float32)
    got = _conv("pnc_f32_to_f16" if kind == "f16" else "pnc_f32_to_bf16", f, np.uint16)
    with np.errstate(over="ignore"):
        exp = _numpy_16(f, kind)
    ok = _same_or_both_nan(got, exp, kind)
    if ok.all():
        return 0, (0, 0, 0)
    i = int(np.flatnonzero(~ok)[0])
    return int((~ok).sum()), (int(bits[i]), int(got[i]), int(exp[i]))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_float32_rounds_to_16_bits_as_numpy(kind):
    """float32 bit patterns against NumPy's / ml_dtypes' rounding, in chunks of 2**22 on every core: every 13th
    chunk of the 1024 (79 chunks, 331M values across the signs and exponents, NaNs and infinities among them;
    every value where a rounding decision is made: :func:`test_float32_rounds_to_16_bits_at_every_boundary`);
    ``PYNORM_CUDA_CPU_SWEEP=full``: all 2**32 (about a minute on 2 cores, which CI does not spend on it)."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = range(0, 1 << 10, 1 if os.environ.get("PYNORM_CUDA_CPU_SWEEP") == "full" else 13)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        results = list(ex.map(lambda c: _sweep_chunk(c, kind), chunks))
    bad = sum(r[0] for r in results)
    first = next((r[1] for r in results if r[0]), (0, 0, 0))
    assert bad == 0, (
        f"{bad} float32 values round differently; first: bits {first[0]:#010x} -> {first[1]:#06x}, "
        f"expected {first[2]:#06x}"
    )


def _boundaries(kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every pair of adjacent finite 16-bit values (both signs): their midpoint as a double, and the two
    neighbours (bits), so rounding to nearest, ties to even, is known without another implementation."""
    t = np.float16 if kind == "f16" else ml_dtypes.bfloat16
    pos = np.arange(0, 0x7C00 if kind == "f16" else 0x7F80, dtype=np.uint16)  # +0 .. largest finite
    lo, hi = pos[:-1], pos[1:]
    vlo = lo.view(t).astype(np.float64)
    vhi = hi.view(t).astype(np.float64)
    mid = (vlo + vhi) / 2  # exact: both are short binary fractions
    return mid, lo, hi


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_float32_rounds_to_16_bits_at_every_boundary(kind):
    """float32 -> 16 bits at every rounding decision, the answer from the 16-bit grid alone (no other
    implementation): for every pair of adjacent finite values and both signs, the float32 midpoint (exact: 12
    and 9 significant bits) rounds to the even neighbour, the float32 values 1 and 2 ulps below it to the lower,
    above it to the upper, and both neighbours to themselves; the overflow edge, infinities and NaN payloads as
    IEEE says."""
    mid, lo, hi = _boundaries(kind)
    m = mid.astype(np.float32)
    assert np.array_equal(m.astype(np.float64), mid)
    below = np.nextafter(m, np.float32(-np.inf))
    above = np.nextafter(m, np.float32(np.inf))
    fn = "pnc_f32_to_f16" if kind == "f16" else "pnc_f32_to_bf16"
    t = np.float16 if kind == "f16" else ml_dtypes.bfloat16
    cases = (
        (below, lo),
        (np.nextafter(below, np.float32(-np.inf)), lo),
        (above, hi),
        (np.nextafter(above, np.float32(np.inf)), hi),
        (m, np.where(lo % 2 == 0, lo, hi)),
        (lo.view(t).astype(np.float32), lo),
        (hi.view(t).astype(np.float32), hi),
    )
    for sign in (np.float32(1.0), np.float32(-1.0)):
        sbit = np.uint16(0x8000 if sign < 0 else 0)
        for x, exp in cases:
            got = _conv(fn, sign * x, np.uint16)
            e = (exp | sbit).astype(np.uint16)
            assert np.array_equal(got, e), (kind, float(sign), np.flatnonzero(got != e)[:5])
    big = float(np.finfo(np.float16).max) if kind == "f16" else float(ml_dtypes.finfo(t).max)
    ulp_top = 2.0**120 if kind == "bf16" else 32.0  # spacing of the largest binade
    edge = np.float32(big + ulp_top / 2)  # the midpoint to the next (unrepresentable) value: ties to even -> inf
    fmax = np.finfo(np.float32).max
    x = np.array([np.nextafter(edge, np.float32(0)), edge, fmax, np.inf, -np.inf], np.float32)
    got = _conv(fn, x, np.uint16)
    inf = 0x7C00 if kind == "f16" else 0x7F80
    assert got[0] == (0x7BFF if kind == "f16" else 0x7F7F) and got[1] == inf and got[2] == inf and got[3] == inf
    assert got[4] == inf | 0x8000
    payloads = np.arange(1, 1 << 23, 997, dtype=np.uint32)
    nans = np.concatenate([payloads | np.uint32(0x7F800000), payloads | np.uint32(0xFF800000)]).view(np.float32)
    assert np.isnan(_conv(fn, nans, np.uint16).view(t).astype(np.float32)).all()


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_doubles_round_once_to_16_bits_at_every_boundary(kind):
    """double -> 16 bits in one rounding: just below a midpoint rounds down, just above rounds up, the
    midpoint itself to the even neighbour, for every pair of adjacent values and both signs; beyond the
    largest value to infinity as IEEE says. (Rounding through float32 first would fail just above and below
    the midpoints: ml_dtypes' own float64 -> bfloat16 does.)"""
    mid, lo, hi = _boundaries(kind)
    fn = "pnc_f64_to_f16" if kind == "f16" else "pnc_f64_to_bf16"
    below = np.nextafter(mid, -np.inf)
    above = np.nextafter(mid, np.inf)
    tiny = mid * (1 - 2.0**-40)
    for sign in (1.0, -1.0):
        sbit = np.uint16(0x8000 if sign < 0 else 0)
        for x, exp in ((below, lo), (tiny, lo), (above, hi), (mid, np.where(lo % 2 == 0, lo, hi))):
            got = _conv(fn, sign * x, np.uint16)
            e = exp | sbit
            assert np.array_equal(got, e.astype(np.uint16)), (kind, sign, np.flatnonzero(got != e)[:5])
    t = np.float16 if kind == "f16" else ml_dtypes.bfloat16
    big = float(np.finfo(np.float16).max) if kind == "f16" else float(ml_dtypes.finfo(t).max)
    ulp_top = 2.0**120 if kind == "bf16" else 32.0  # spacing of the largest binade
    edge = big + ulp_top / 2  # the midpoint to the next (unrepresentable) value: ties to even -> inf
    got = _conv(fn, np.array([np.nextafter(edge, 0.0), edge, 1e300, np.inf, -np.inf, np.nan]), np.uint16)
    inf = 0x7C00 if kind == "f16" else 0x7F80
    assert got[0] == (0x7BFF if kind == "f16" else 0x7F7F) and got[1] == inf and got[2] == inf and got[3] == inf
    assert got[4] == inf | 0x8000 and np.isnan(got[5:].view(t).astype(np.float32)).all()


# ---------------------------------------------------------------------------
# barriers, shared memory, schedules


def test_barrier_makes_neighbours_values_visible(probes):
    x = np.arange(512, dtype=np.float32)
    out = f32(512)
    k(probes, "rotate")((2,), (256,), (cupy.asarray(x), out))
    exp = np.concatenate([np.roll(x[:256], -1), np.roll(x[256:], -1)])
    np.testing.assert_array_equal(cupy.asnumpy(out), exp)


def test_missing_barrier_is_reported_as_a_race(probes):
    out = f32(512)
    with pytest.raises(HarnessError, match="race in probe::rotate_racy"):
        k(probes, "rotate_racy")((2,), (256,), (cupy.asarray(np.arange(512, dtype=np.float32)), out))


def test_shared_memory_is_nan_before_each_block(probes):
    out = f32(64, fill=0.0)
    k(probes, "read_uninitialized_shared")((3,), (64,), (out,))
    assert np.isnan(cupy.asnumpy(out)).all()


def test_barrier_reached_by_part_of_the_block(probes):
    with pytest.raises(HarnessError, match=r"__syncthreads reached by 40 of the block's 64 threads"):
        k(probes, "partial_barrier")((1,), (64,), (f32(64), np.int32(40)))
    k(probes, "partial_barrier")((1,), (64,), (f32(64), np.int32(64)))  # all of them: fine


def test_threads_at_different_barriers(probes):
    with pytest.raises(HarnessError, match="different __syncthreads calls"):
        k(probes, "divergent_barriers")((1,), (64,), (f32(64),))


def _shuffle_model(v: np.ndarray, width: int, arg: int) -> np.ndarray:
    n = v.size
    out = np.empty((4, n), v.dtype)
    for t in range(n):
        lane, base = t % 32, t - t % 32
        seg = lane & ~(width - 1)
        src = [
            seg + (arg & (width - 1)),
            lane - arg if lane - arg >= seg else lane,
            lane + arg if lane + arg < seg + width else lane,
            (lane ^ arg) if (lane ^ arg) < seg + width else lane,
        ]
        out[:, t] = [v[base + s] for s in src]
    return out


@pytest.mark.parametrize(("width", "arg"), [(32, 1), (32, 5), (32, 16), (16, 3), (8, 1), (8, 7), (4, 2), (2, 1)])
def test_shuffles_follow_cuda(probes, width, arg):
    v = np.arange(64, dtype=np.float32) * 1.5 + 1
    out = f32(4, 64)
    k(probes, "shuffles")((1,), (64,), (cupy.asarray(v), out, np.int32(width), np.int32(arg)))
    np.testing.assert_array_equal(cupy.asnumpy(out), _shuffle_model(v, width, arg))


def test_shuffle_skipped_by_one_lane_is_reported(probes):
    x = cupy.asarray(np.ones(32, np.float32))
    k(probes, "shuffle_skipped_by_one_lane")((1,), (32,), (x, f32(32), np.int32(-1)))  # nobody skips: fine
    with pytest.raises(HarnessError, match=r"(exited while the lanes|missing:.*lane 7)"):
        k(probes, "shuffle_skipped_by_one_lane")((1,), (32,), (x, f32(32), np.int32(7)))


def test_deadlock_is_reported(probes):
    with pytest.raises(HarnessError, match="deadlock"):
        k(probes, "deadlock")((1,), (32,), (f32(32),))


def test_mask_naming_lanes_of_a_partial_warp(probes):
    with pytest.raises(HarnessError, match="names lanes that do not exist"):
        k(probes, "mask_names_missing_lanes")((1,), (40,), (f32(40),))


def test_indices_of_3d_blocks_and_grids(probes):
    grid, block = (3, 2, 2), (4, 2, 3)
    nb, nt = 12, 24
    out = cupy.empty((nb * nt * 6,), dtype=np.int32)
    k(probes, "indices")(grid, block, (out,))
    got = cupy.asnumpy(out).reshape(nb, nt, 6)
    for b in range(nb):
        bx, by, bz = b % 3, (b // 3) % 2, b // 6
        for t in range(nt):
            tx, ty, tz = t % 4, (t // 4) % 2, t // 8
            assert tuple(got[b, t]) == (tx, ty, tz, bx, by, bz)


# ---------------------------------------------------------------------------
# memory


def test_device_memory_is_nan_at_allocation():
    a = cupy.empty((1000,), dtype=np.float32)
    assert np.isnan(cupy.asnumpy(a)).all()
    assert (cupy.asnumpy(cupy.empty((7,), dtype=np.uint8)) == 0xFF).all()


def test_store_past_the_end_of_a_buffer(probes):
    out = f32(100)
    k(probes, "store_offset")((1,), (128,), (out, np.int32(100), np.int32(0)))
    with pytest.raises(HarnessError, match="past the end of a 400-byte buffer"):
        k(probes, "store_offset")((1,), (128,), (f32(100), np.int32(100), np.int32(1)))
    with pytest.raises(HarnessError, match="invalid memory access"):  # far beyond: the guard page
        k(probes, "store_offset")((1,), (128,), (f32(100), np.int32(100), np.int32(4096)))


def test_store_before_the_start_of_a_buffer(probes):
    with pytest.raises(HarnessError, match="before the start"):
        k(probes, "store_offset")((1,), (128,), (f32(100), np.int32(100), np.int32(-3)))


@pytest.mark.parametrize("size", [4096, 49152 - 256, 100_000, 229_376])
def test_write_past_the_dynamic_shared_memory(probes, size):
    kern = k(probes, "dynamic_write")
    kern.max_dynamic_shared_size_bytes = max(size, kern.max_dynamic_shared_size_bytes)
    kern((2,), (64,), (f32(64), np.int32(size - 1)), shared_mem=size)
    for at in (size, size + 1, size + 5000):
        if at < build.MAX_DYNAMIC_SMEM:
            with pytest.raises(HarnessError, match="dynamic shared memory"):
                kern((2,), (64,), (f32(64), np.int32(at)), shared_mem=size)


def test_misaligned_vector_access_traps(probes):
    with pytest.raises(HarnessError, match="misaligned access"):
        k(probes, "misaligned_vector_load")((1,), (1,), (cupy.asarray(np.ones(8, np.float32)), f32(1)))


def test_write_through_a_const_pointer_is_reported(probes):
    with pytest.raises(HarnessError, match="changed a buffer it receives only through const pointers"):
        k(probes, "writes_const_input")((1,), (8,), (cupy.asarray(np.ones(8, np.float32)), f32(8)))


def test_a_kernel_that_never_finishes_is_stopped(probes, monkeypatch):
    monkeypatch.setattr(fakecupy, "LAUNCH_TIMEOUT", 1.0)
    with pytest.raises(HarnessError, match="time limit exceeded"):
        k(probes, "spins")((1,), (1,), (f32(1), np.int32(1)))


def test_stack_overflow_is_reported(probes):
    with pytest.raises(HarnessError, match="stack overflow"):
        k(probes, "overflows_stack")((1,), (2,), (cupy.empty((2,), dtype=np.int32), np.int32(100_000)))


def test_the_harness_recovers_after_an_error(probes):
    with pytest.raises(HarnessError):
        k(probes, "deadlock")((1,), (32,), (f32(32),))
    test_barrier_makes_neighbours_values_visible(probes)


# ---------------------------------------------------------------------------
# the driver's launch checks


def test_scalar_arguments_are_packed_at_their_own_width(probes):
    out = cupy.empty((5,), dtype=np.float64)
    k(probes, "scalars")((1,), (1,), (out, np.int32(-3), np.int64(2**40), np.float32(0.5), 2.25, np.uint32(7)))
    np.testing.assert_array_equal(cupy.asnumpy(out), [-3, 2**40, 0.5, 2.25, 7])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.int64(1), np.int64(2), np.float32(0), 1.0, np.uint32(0)), "8 bytes.*int parameter"),
        ((3, np.int64(2), np.float32(0), 1.0, np.uint32(0)), "int64 scalar"),  # a Python int is an int64
        ((np.int32(1), np.int64(2), 0.5, 1.0, np.uint32(0)), "float64 scalar.*float parameter"),
        ((np.int32(1), np.int64(2), np.int32(0), 1.0, np.uint32(0)), "int32 scalar passed for a float"),
        ((np.int32(1), np.int64(2), np.float32(0), 1.0), "4 arguments|5 arguments|parameters"),
    ],
)
def test_scalar_arguments_must_match_the_signature(probes, args, match):
    out = cupy.empty((5,), dtype=np.float64)
    with pytest.raises(HarnessError, match=match):
        k(probes, "scalars")((1,), (1,), (out, *args))


def test_array_arguments_must_match_the_pointee_type(probes):
    with pytest.raises(HarnessError, match="float64 array passed for a const float"):
        k(probes, "rotate")((1,), (256,), (cupy.empty((256,), dtype=np.float64), f32(256)))
    with pytest.raises(HarnessError, match="pointer parameter"):
        k(probes, "rotate")((1,), (256,), (np.float32(1), f32(256)))


def test_block_size_beyond_launch_bounds(probes):
    with pytest.raises(DriverError, match="too many resources requested for launch"):
        k(probes, "rotate")((1,), (512,), (cupy.asarray(np.ones(512, np.float32)), f32(512)))


@pytest.mark.parametrize(("grid", "block"), [((1,), (0,)), ((0,), (32,)), ((1,), (1025,)), ((1, 70000), (32,))])
def test_invalid_geometry(probes, grid, block):
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        k(probes, "read_uninitialized_shared")(grid, block, (f32(64),))


def test_48_KiB_rule_counts_static_and_dynamic_shared_memory(probes):
    """dynamic_write has 256 bytes of static shared memory: 48 KiB of dynamic memory on top needs the
    opt-in attribute (the driver's rule), and the attribute is capped at the opt-in limit minus static."""
    fresh = cupy.RawModule(code=PROBES, options=("--std=c++17",), name_expressions=NAMES)
    kern = fresh.get_function("probe::dynamic_write")
    assert kern.shared_size_bytes == 256
    assert kern.max_dynamic_shared_size_bytes == 49152 - 256
    kern((1,), (64,), (f32(64), np.int32(0)), shared_mem=49152 - 256)
    with pytest.raises(DriverError, match="needs the max_dynamic_shared_size_bytes attribute raised"):
        kern((1,), (64,), (f32(64), np.int32(0)), shared_mem=49152)
    kern.max_dynamic_shared_size_bytes = 49152
    kern((1,), (64,), (f32(64), np.int32(0)), shared_mem=49152)
    # the attribute lives with the module's function: a new handle of the same kernel keeps it
    assert fresh.get_function("probe::dynamic_write").max_dynamic_shared_size_bytes == 49152
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        kern.max_dynamic_shared_size_bytes = fakecupy.PROPS["sharedMemPerBlockOptin"]  # + 256 static: too much


def test_kernel_attributes_come_from_nvrtc(probes):
    kern = k(probes, "rotate")
    assert kern.num_regs > 0 and kern.shared_size_bytes == 1024  # float s[256]
    assert kern.launch_bound == 256


def test_half_conversions_in_device_code(probes):
    x = np.array([0.1, 65504, 65520, 1e-8, -2.5, 6e-8], np.float32)
    h = cupy.empty((6,), dtype=np.float16)
    back = f32(6)
    k(probes, "half_round_trip")((1,), (32,), (cupy.asarray(x), h, back, np.int32(6)))
    with np.errstate(over="ignore"):
        exp = x.astype(np.float16)
    np.testing.assert_array_equal(cupy.asnumpy(h).view(np.uint16), exp.view(np.uint16))
    np.testing.assert_array_equal(cupy.asnumpy(back), exp.astype(np.float32))


# ---------------------------------------------------------------------------
# the CuPy stand-in


def test_no_implicit_conversion_to_numpy():
    a = cupy.asarray(np.ones(3))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError):
        a + np.ones(3)
    assert type(a).__module__ == "cupy" and type(a).__name__ == "ndarray"


def test_array_operations_stay_in_device_memory():
    a = cupy.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    for b in (a.T, a[:, ::2], a.reshape(12), a.astype(np.float64), a.sum(axis=0), a * 2, a.copy()):
        assert fakecupy._on_device(b._a)
    np.testing.assert_array_equal(cupy.asnumpy((a * 2).sum(axis=0)), np.arange(12).reshape(3, 4).sum(0) * 2)
    c = cupy.zeros((3, 4), dtype=np.float32)
    c += a
    np.testing.assert_array_equal(cupy.asnumpy(c), cupy.asnumpy(a))


def test_cupys_own_float32_operations_flush_subnormals_as_on_a_gpu():
    """CuPy compiles its own kernels with -ftz=true: float32 subnormals produced or read by its ufuncs, reductions and
    float32/float64 conversions are flushed to zero on a GPU; the stand-in does the same (a BatchNorm scale of ~1e-38
    converted by ``astype`` was 0 on an H200 and not on the harness). 16-bit conversions and matmul keep them."""
    import cupy

    tiny = np.array([1e-39, -2e-40, 1e-30], dtype=np.float64)
    got = cupy.asnumpy(cupy.asarray(tiny).astype(np.float32))
    assert got[0] == 0 and got[1] == 0 and np.signbit(got[1]) and got[2] == np.float32(1e-30)
    sub32 = cupy.asarray(np.array([1e-39, 3e-39], dtype=np.float32))
    assert cupy.asnumpy(sub32.astype(np.float64)).tolist() == [0.0, 0.0]
    assert cupy.asnumpy(sub32 * np.float32(1)).tolist() == [0.0, 0.0]
    assert float(cupy.asnumpy(sub32.sum())) == 0.0
    kept = cupy.asnumpy(sub32.astype(np.float16))  # (16-bit: no flush; these underflow to 0 anyway)
    assert kept.dtype == np.float16
    m = cupy.asnumpy(cupy.asarray(np.array([[1e-39]], np.float32)) @ cupy.asarray(np.array([[1.0]], np.float32)))
    assert m[0, 0] == np.float32(1e-39)
