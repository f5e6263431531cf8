"""Derf's own properties, on every backend (the generic suites cover it against the reference and by finite
differences from its spec)."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads


@pytest.fixture
def de_(backend):
    if "derf" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'derf'")
    return backend


def test_reference_erf_against_mpmath():
    """The reference's erf (NumPy has none): extended precision within a few of its ulps, float64 within 4 ulps,
    both branches and the cut between them, odd, the special values."""
    mpmath = pytest.importorskip("mpmath")
    from pynorm.ops.derf import erf

    mpmath.mp.dps = 40
    z = np.concatenate([np.linspace(0, 6.5, 401), [1e-300, 1e-8, 2.4999999, 2.5, 2.5000001, 10.0, 27.0]])
    exact = [mpmath.erf(mpmath.mpf(float(v))) for v in z]
    rel64 = [abs((mpmath.mpf(float(g)) - e) / e) for g, e in zip(erf(z), exact) if e]
    assert max(rel64) <= 2.0**-50
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:  # x86's 80-bit extended
        ld = erf(z.astype(np.longdouble))
        rel = [abs((mpmath.mpf(str(g)) - e) / e) for g, e in zip(ld, exact) if e]
        assert max(rel) <= 8 * float(np.finfo(np.longdouble).eps)
    assert (erf(-z) == -erf(z)).all()
    special = erf(np.array([0.0, -0.0, np.inf, -np.inf, np.nan]))
    assert special[0] == 0 and np.signbit(special[1]) and list(special[2:4]) == [1.0, -1.0] and np.isnan(special[4])


@pytest.mark.parametrize(("alpha", "shift"), [(1e-6, 0.0), (0.5, 0.0), (0.8, -0.3), (7.0, 2.0), (1e3, 0.1)])
def test_gradients_match_mpmath(de_, alpha, shift):
    """Saturated and linear regimes: y, dx, dalpha and dshift against mpmath in float64 (``e^{-z^2}`` carries
    the rounding of ``z`` times ``2 z^2``: 1.3e-13 relative at ``z = 23.7``, the largest here with e > 0)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    x = np.array([[-3.0, -0.5, 0.0, 0.25, 1.0, 2.0, 30.0]])
    y, ctx = pynorm.derf_forward(de_.asarray(x), de_.asarray(np.array([alpha])), de_.asarray(np.array([shift])),
                                 backend=de_.name)  # fmt: skip
    g = pynorm.derf_backward(de_.asarray(np.ones_like(x)), ctx)
    a, s = mpmath.mpf(alpha), mpmath.mpf(shift)
    zs = [a * mpmath.mpf(float(v)) + s for v in x[0]]
    es = [2 / mpmath.sqrt(mpmath.pi) * mpmath.exp(-z * z) for z in zs]
    np.testing.assert_allclose(de_.to_numpy(y)[0], [float(mpmath.erf(z)) for z in zs], rtol=1e-15, atol=1e-300)
    np.testing.assert_allclose(de_.to_numpy(g.dx)[0], [float(a * e) for e in es], rtol=3e-13, atol=0)
    np.testing.assert_allclose(
        de_.to_numpy(g.dalpha)[0], float(sum(mpmath.mpf(float(v)) * e for v, e in zip(x[0], es))), rtol=3e-13
    )
    np.testing.assert_allclose(de_.to_numpy(g.dshift)[0], float(sum(es)), rtol=3e-13)


def test_gradients_with_affine(de_):
    rng = np.random.default_rng(0)
    rep = check_grads(
        de_.forward(pynorm.derf_forward), de_.backward(pynorm.derf_backward),
        [rng.standard_normal((3, 5)), np.array(0.8), np.array(-0.4), rng.standard_normal(5), rng.standard_normal(5)],
    )  # fmt: skip
    assert rep.passed, str(rep)


def test_shift_moves_the_argument(de_):
    """erf(alpha x + s) = erf(alpha (x + s / alpha)): the shift is a shift of the input by s / alpha."""
    x = np.linspace(-2, 2, 9).reshape(1, -1)
    a = np.array([0.5])
    y1 = pynorm.derf(de_.asarray(x), de_.asarray(a), de_.asarray(np.array([0.25])), backend=de_.name)
    y2 = pynorm.derf(de_.asarray(x + 0.5), de_.asarray(a), de_.asarray(np.array([0.0])), backend=de_.name)
    np.testing.assert_allclose(de_.to_numpy(y1), de_.to_numpy(y2), rtol=1e-15, atol=1e-16)


@pytest.mark.parametrize("name", ["alpha", "shift"])
def test_scalars_must_be_finite_required_and_scalar(de_, name):
    x = de_.asarray(np.ones((2, 3)))
    args = {"alpha": de_.asarray(np.array([0.5])), "shift": de_.asarray(np.array([0.0]))}
    with pytest.raises(ArgumentError, match=f"{name} must be finite"):
        pynorm.derf(x, **{**args, name: de_.asarray(np.array([np.nan]))}, backend=de_.name)
    with pytest.raises(ArgumentError, match=f"{name} is required"):
        pynorm.derf(x, **{**args, name: None}, backend=de_.name)
    with pytest.raises(ShapeError, match=f"{name} must be a scalar"):
        pynorm.derf(x, **{**args, name: de_.asarray(np.ones(3))}, backend=de_.name)


def test_layer():
    layer = pynorm.layers.Derf(8)
    assert layer.params["alpha"][0] == 0.5 and layer.params["shift"][0] == 0.0
    y, ctx = layer.forward(np.ones((2, 8), np.float32))
    layer.backward(np.ones_like(y), ctx)
    assert sorted(layer.grads) == ["alpha", "bias", "shift", "weight"] and layer.grads["shift"].shape == (1,)


def test_oracle_check_and_vectors(tmp_path):
    """``pynorm check`` covers derf through its spec: the numba backend behind the documented calling convention
    passes forward and backward; a target that drops the shift fails; the golden vectors round-trip."""
    from pynorm.oracle import check, verify_vectors, write_vectors

    backend = "numba" if pynorm._registry.unavailable_reason("numba") is None else "numpy"

    def forward(x, alpha, shift, weight, bias, **kw):
        return pynorm.derf(x, alpha, shift, weight, bias, axis=x.ndim - weight.ndim, backend=backend)

    def backward(dy, x, alpha, shift, weight, bias, **kw):
        _, ctx = pynorm.derf_forward(x, alpha, shift, weight, bias, axis=x.ndim - weight.ndim, backend=backend)
        return tuple(pynorm.derf_backward(dy, ctx))

    def no_shift(x, alpha, shift, weight, bias, **kw):
        return forward(x, alpha, np.zeros_like(shift), weight, bias)

    report = check("derf", forward, backward, grid="quick")
    assert report.passed, str(report)
    assert {"y", "dx", "dalpha", "dshift", "dweight", "dbias"} <= set(report.output_names())
    assert not check("derf", no_shift, grid="quick").passed
    write_vectors(tmp_path, ops=["derf"])
    assert verify_vectors(tmp_path, exact=True) == []
