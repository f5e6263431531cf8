"""The numba backend's vectorizable float32 math (:mod:`pynorm.backends.numba._vmath`) against mpmath.

Every float32 exponent is sampled (random mantissas, both signs), plus the edge cases; the error is in ulps
of the float32 result (the spacing of float32 values at the exact result, at least the smallest subnormal).
The bounds asserted are the ones the module's docstring states.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("numba", reason="numba is not installed: the numba backend is unavailable")
mpmath = pytest.importorskip("mpmath")

from pynorm.backends.numba import _vmath as vm  # noqa: E402

from .helpers import mpmath_ulps  # noqa: E402

F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149


def _every_exponent(per: int, lo: int = 0, hi: int = 255, seed: int = 0) -> np.ndarray:
    """Positive float32 values: ``per`` random mantissas for every biased exponent in ``[lo, hi)`` (0: the
    subnormals), and the exponent's smallest and largest value."""
    rng = np.random.default_rng(seed)
    e = np.repeat(np.arange(lo, hi, dtype=np.uint32), per + 2)
    m = rng.integers(0, 1 << 23, e.size, dtype=np.uint32)
    m[:: per + 2] = 0
    m[1 :: per + 2] = (1 << 23) - 1
    bits = (e << np.uint32(23)) | m
    x = bits.view(np.float32)
    return x[x > 0]


@pytest.fixture(autouse=True)
def _precision():
    old = mpmath.mp.dps
    mpmath.mp.dps = 40
    yield
    mpmath.mp.dps = old


def _tanh(z, zlo=None):
    return vm.tanh_sech2_array(z, np.zeros_like(z) if zlo is None else zlo)[0]


def _tanh_fwd(z, zlo=None):
    return vm.tanh_f32_array(z, np.zeros_like(z) if zlo is None else zlo)


#: the backward's tanh (beside sech^2) and the forward's (tanh alone)
TANHS = pytest.mark.parametrize("tanh", [_tanh, _tanh_fwd], ids=["tanh_sech2", "tanh_f32"])


def _sech2(z, zlo=None):
    return vm.tanh_sech2_array(z, np.zeros_like(z) if zlo is None else zlo)[1]


@TANHS
def test_tanh_within_2_ulps_everywhere(tanh):
    x = _every_exponent(24)
    edges = [0.625, np.nextafter(np.float32(0.625), np.float32(0)), 9.01, 9.02, 16.0, 16.5]
    x = np.concatenate([x, -x, np.float32(edges), np.random.default_rng(3).uniform(-12, 12, 4000).astype(np.float32)])
    got = tanh(x)
    err = mpmath_ulps(got, [mpmath.tanh(mpmath.mpf(float(v))) for v in x])
    assert err.max() <= 2.0, (err.max(), x[err.argmax()])


@TANHS
def test_tanh_special_values(tanh):
    x = np.float32([0.0, -0.0, TINY, -TINY, 2.0**-126, np.inf, -np.inf, np.nan, 1e30, -1e30])
    got = tanh(x)
    want = np.float32([0.0, -0.0, TINY, -TINY, 2.0**-126, 1.0, -1.0, np.nan, 1.0, -1.0])
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[1]) and not np.signbit(got[0])


def test_exp2_within_1_ulp_over_the_whole_range():
    t = _every_exponent(24, hi=127 + 8)  # |t| < 256
    t = np.concatenate([t, -t])
    t = t[(t > -160) & (t < 130)]
    t = np.concatenate([t, np.float32([-149.0, -149.5, -150.0, -126.0, -126.5, 127.0, 127.99, 128.0])])
    err = mpmath_ulps(vm.exp2_f32_array(t), [mpmath.power(2, mpmath.mpf(float(v))) for v in t])
    assert err.max() <= 1.0, (err.max(), t[err.argmax()])


def test_exp2_special_values():
    got = vm.exp2_f32_array(np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -300.0, 300.0, 1.0, -149.0]))
    np.testing.assert_array_equal(got, np.float32([1.0, 1.0, np.inf, 0.0, np.nan, 0.0, np.inf, 2.0, TINY]))


def test_log2_within_1_ulp_and_special_values():
    x = _every_exponent(24)
    err = mpmath_ulps(vm.log2_f32_array(x), [mpmath.log(mpmath.mpf(float(v)), 2) for v in x])
    assert err.max() <= 1.0, (err.max(), x[err.argmax()])
    got = vm.log2_f32_array(np.float32([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1.0, TINY]))
    np.testing.assert_array_equal(got, np.float32([-np.inf, -np.inf, np.nan, np.inf, np.nan, np.nan, 0.0, -149.0]))


@pytest.mark.parametrize("p", [0.01, 0.25, math.pi / 4, 1.5, 3.0, 7.25])
def test_signed_power_within_1_ulp(p):
    x = _every_exponent(8, seed=int(p * 100))
    x = np.concatenate([x, -x])
    pm = mpmath.mpf(p)
    exact = [mpmath.sign(mpmath.mpf(float(v))) * abs(mpmath.mpf(float(v))) ** pm for v in x]
    err = mpmath_ulps(vm.spow_f32_array(x, p), exact)
    assert err.max() <= 1.0, (err.max(), x[err.argmax()])


@pytest.mark.parametrize("p", [0.5, 0.01, 2.0])
def test_signed_power_special_values(p):
    x = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0])
    got = vm.spow_f32_array(x, p)
    np.testing.assert_array_equal(got, np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0]))
    assert np.signbit(got[1])


def test_sech2_keeps_relative_accuracy_below_float32_range():
    """sech^2 z = v 2^k: within 8 ulps (relative) of mpmath up to |z| = 128, where sech^2 is 2^-369."""
    rng = np.random.default_rng(1)
    z = np.concatenate([rng.uniform(0, 2, 3000), rng.uniform(2, 128, 3000), [0.0, 43.0, 44.0, 87.0, 127.9]])
    z = np.concatenate([z, -z]).astype(np.float32)
    got = _sech2(z)
    rel = [abs(mpmath.mpf(g) / mpmath.sech(mpmath.mpf(float(v))) ** 2 - 1) for g, v in zip(got.tolist(), z)]
    assert float(max(rel)) <= 8 * 2.0**-24
    assert _sech2(np.float32([np.inf, -np.inf, 400.0])).tolist() == [0.0, 0.0, 0.0]
    assert np.isnan(_sech2(np.float32([np.nan]))).all()
    assert np.isnan(_tanh(np.float32([np.nan]))).all()


@pytest.mark.parametrize("seed", [6, 7])
def test_forward_tanh_of_a_float32_pair(seed):
    """The forward's tanh of ``z + zlo`` within 2 ulps of the pair's exact value, as the backward's (below)."""
    rng = np.random.default_rng(seed)
    z = np.concatenate([rng.uniform(0, 0.7, 3000), rng.uniform(0.55, 12, 3000), rng.uniform(12, 120, 1000)])
    z = np.concatenate([z, -z]).astype(np.float32)
    zlo = (rng.uniform(-0.5, 0.5, z.size) * np.spacing(z).astype(np.float64)).astype(np.float32)
    exact = [mpmath.tanh(mpmath.mpf(float(a)) + mpmath.mpf(float(b))) for a, b in zip(z, zlo)]
    err = mpmath_ulps(_tanh_fwd(z, zlo), exact)
    assert err.max() <= 2.0, (err.max(), z[err.argmax()])


def test_tanh_and_sech2_of_a_float32_pair():
    """z + zlo (zlo up to half an ulp of z, as alpha x's rounding error): tanh within 2 ulps and sech^2 within
    8 ulps (relative) of the pair's exact value, on both sides of the polynomial's 0.625 and into saturation."""
    rng = np.random.default_rng(6)
    z = np.concatenate([rng.uniform(0, 0.7, 3000), rng.uniform(0.55, 12, 3000), rng.uniform(12, 120, 1000)])
    z = np.concatenate([z, -z]).astype(np.float32)
    zlo = (rng.uniform(-0.5, 0.5, z.size) * np.spacing(z).astype(np.float64)).astype(np.float32)
    exact = [mpmath.mpf(float(a)) + mpmath.mpf(float(b)) for a, b in zip(z, zlo)]
    err = mpmath_ulps(_tanh(z, zlo), [mpmath.tanh(e) for e in exact])
    assert err.max() <= 2.0, (err.max(), z[err.argmax()])
    rel = [abs(mpmath.mpf(g) / mpmath.sech(e) ** 2 - 1) for g, e in zip(_sech2(z, zlo).tolist(), exact)]
    assert float(max(rel)) <= 8 * 2.0**-24


# the kernels on float32 storage: the pieces as the ops see them


def test_dyt_float32_forward_and_saturated_gradient_accuracy():
    import pynorm

    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(500) * 4, rng.uniform(30, 80, 200), [0.0, -0.0, 1e-40, 3e38]])
    x = x.astype(np.float32).reshape(1, -1)
    alpha = np.array([0.7], np.float64)  # not a float32: z = alpha x to float64 accuracy
    y, ctx = pynorm.dyt_forward(x, alpha, backend="numba")
    dy = np.full_like(x, 1e30)  # a large gradient times sech^2 far below float32's range
    g = pynorm.dyt_backward(dy, ctx)
    am = mpmath.mpf(0.7)
    zs = [am * mpmath.mpf(float(v)) for v in x[0]]
    err = mpmath_ulps(y[0], [mpmath.tanh(z) for z in zs])
    assert err.max() <= 2.0, (err.max(), x[0, err.argmax()])
    err = mpmath_ulps(g.dx[0], [am * mpmath.sech(z) ** 2 * mpmath.mpf(1e30) for z in zs])
    assert err.max() <= 8.0, (err.max(), x[0, err.argmax()])


@pytest.mark.parametrize("p", [0.5, 0.3, 2.0])
def test_power_norm_float32_accuracy(p):
    import pynorm

    x = np.concatenate([_every_exponent(2, seed=3), -_every_exponent(2, seed=4)]).reshape(1, -1)
    y, ctx = pynorm.power_norm_forward(x, p=p, backend="numba")
    pm = mpmath.mpf(p)
    exact = [mpmath.sign(mpmath.mpf(float(v))) * abs(mpmath.mpf(float(v))) ** pm for v in x[0]]
    err = mpmath_ulps(y[0], exact)
    assert err.max() <= 1.0, (err.max(), x[0, err.argmax()])
    dx = pynorm.power_norm_backward(np.ones_like(x), ctx).dx[0]
    exact = [min(pm * abs(mpmath.mpf(float(v))) ** (pm - 1), F32_MAX) for v in x[0]]
    err = mpmath_ulps(dx, exact)
    assert err.max() <= 2.0, (err.max(), x[0, err.argmax()])


@pytest.mark.parametrize("isa, lanes", [("host", None), ("avx2", 8)])
def test_every_function_vectorizes_on_avx512_and_avx2(isa, lanes):
    """Each function's array loop compiles to float vectors on this CPU and on an AVX2 CPU without AVX-512 (numba
    told so by NUMBA_CPU_NAME and NUMBA_CPU_FEATURES, in a process of its own): no libm call or scalar step keeps
    a loop scalar on either instruction set. AVX2's full width is 8 float32 lanes; the tanh + sech^2 form writes
    float64 ``sech^2``, so its loop is as wide as the float64 vectors (4)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from pynorm.bench.isa import ISAS

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, **ISAS[isa], "NUMBA_CACHE_DIR": cache}
        run = subprocess.run(
            [sys.executable, "-m", "pynorm.bench.isa", "--widths"], env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    widths = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(widths) == {"_vmath.tanh_f32", "_vmath.tanh_sech2", "_vmath.exp2_f32", "_vmath.log2_f32",
                           "_vmath.spow_f32"}  # fmt: skip
    for name, width in widths.items():
        assert width >= 4, f"{name}: its loop is not vectorized on {isa} (widest float vector {width})"
        if lanes is not None and name != "_vmath.tanh_sech2":
            assert width == lanes, f"{name}: {width} float32 lanes on {isa}, expected {lanes}"


def test_erf_within_1_ulp_everywhere():
    """Derf's float32 erf (float64 arithmetic, no libm) within 1 ulp of mpmath on every exponent, both branches
    (|z| < 1, 1 <= |z| < 4) and the saturation at 4; odd, the special values."""
    x = _every_exponent(4, 0, 130)
    x = np.concatenate([x, np.linspace(0, 4.5, 2001, dtype=np.float32), np.float32([1.0, 4.0])])
    x = np.concatenate([x, -x])
    err = mpmath_ulps(vm.erf_f32_array(x), [mpmath.erf(mpmath.mpf(float(v))) for v in x])
    assert err.max() <= 1.0, x[np.argmax(err)]
    special = vm.erf_f32_array(np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, TINY]))
    assert special[0] == 0 and np.signbit(special[1]) and list(special[2:4]) == [1.0, -1.0]
    assert np.isnan(special[4]) and special[5] == 1.0 and special[6] == np.float32(TINY) * np.float32(1.1283791)


def test_erf_and_its_derivative_from_one_exponential():
    """Derf's backward pieces: erf within 1e-10 relative below |z| = 4 and +-1 from there (erfc(4) = 1.5e-8:
    :func:`erf_d`'s arithmetic, made for float32 results), erf' within 2^-30 relative of mpmath up to where e^(-z^2)
    leaves float64 (0 beyond), NaN for NaN."""
    z = np.concatenate([np.linspace(-27.0, 27.0, 1201), [0.0, 1e-300, np.inf, -np.inf, 30.0, np.nan]])
    f, e = vm.erf_and_prime_array(z)
    fin = np.abs(z) <= 26.0
    below = np.abs(z) < 4.0
    ef = [mpmath.erf(mpmath.mpf(float(v))) for v in z[below]]
    assert max(abs(float((mpmath.mpf(float(g)) - x) / x)) for g, x in zip(f[below], ef) if x) <= 1e-10
    assert (np.abs(f[~below & ~np.isnan(z)]) == 1.0).all()
    exact = [2 / mpmath.sqrt(mpmath.pi) * mpmath.exp(-(mpmath.mpf(float(v)) ** 2)) for v in z[fin]]
    rel = [abs(float((mpmath.mpf(float(g)) - x) / x)) for g, x in zip(e[fin], exact)]
    assert max(rel) <= 2.0**-30
    assert (e[-4:-1] == 0).all() and np.isnan(e[-1]) and np.isnan(f[-1])
