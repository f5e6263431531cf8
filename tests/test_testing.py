"""pynorm.testing: the gradient checker catches broken gradients; ulp measures are right."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pynorm
from pynorm.reference import _common as ref_common
from pynorm.testing import (
    assert_ulp_close,
    check_conformance,
    check_grads,
    max_ulp_error,
    term_scales,
    ulp,
    ulp_error,
)


def _broken_ln_backward(which):
    def backward(dy, ctx):
        g = pynorm.layer_norm_backward(dy, ctx)
        inner = ctx.inner
        x = np.asarray(inner.x, dtype=np.float64)
        xhat = (x - inner.mean[:, None].astype(np.float64)) * inner.rstd[:, None].astype(np.float64)
        dyw = dy.reshape(x.shape) * inner.weight
        if which == "drop_variance_term":  # forget d(rstd)/dx
            c = (dyw * xhat).sum(1, keepdims=True) / x.shape[1]
            dx = g.dx + (inner.rstd[:, None] * xhat * c).reshape(dy.shape).astype(np.float64)
            return dx, g.dweight, g.dbias
        if which == "drop_mean_term":  # forget d(mean)/dx
            dx = g.dx + (inner.rstd[:, None] * dyw.mean(1, keepdims=True)).astype(np.float64)
            return dx, g.dweight, g.dbias
        if which == "dweight_off_by_factor":
            return g.dx, g.dweight * (1 + 1e-4), g.dbias
        raise KeyError(which)

    return backward


@pytest.mark.parametrize("which", ["drop_variance_term", "drop_mean_term", "dweight_off_by_factor"])
def test_check_grads_catches_broken_terms(which):
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5)

    def fwd(x, w, b):
        return pynorm.layer_norm_forward(x, w, b, backend="numpy")

    good = check_grads(fwd, pynorm.layer_norm_backward, [x, w, b])
    assert good.passed, str(good)
    bad = check_grads(fwd, _broken_ln_backward(which), [x, w, b])
    assert not bad.passed
    assert bad.max_directional_error > 1e-5 and bad.jacobian_error > 1e-5
    with pytest.raises(AssertionError, match="FAILED"):
        check_grads(fwd, _broken_ln_backward(which), [x, w, b], raise_on_failure=True)


def test_check_grads_on_a_user_function():
    # the tool is generic: y = sin(x) * a, with a hand-written backward
    def fwd(x, a):
        return np.sin(x) * a, (x, a)

    def bwd(dy, ctx):
        x, a = ctx
        return dy * np.cos(x) * a, np.sum(dy * np.sin(x))

    x = np.linspace(-1, 1, 7)
    assert check_grads(fwd, bwd, [x, np.array(2.0)]).passed
    assert not check_grads(fwd, lambda dy, c: (dy * np.cos(c[0]), np.sum(dy * np.sin(c[0]))), [x, np.array(2.0)]).passed


def test_ulp():
    assert ulp(1.0, np.float32) == 2.0**-23
    assert ulp(1.5, np.float16) == 2.0**-10
    assert ulp(1.0, ml_dtypes.bfloat16) == 2.0**-7
    assert ulp(0.0, np.float32) == 2.0**-149  # subnormal spacing
    assert ulp(-4.0, np.float64) == 2.0**-50


def test_ulp_error_and_assert():
    e = np.array([1.0, 2.0, np.inf, np.nan])
    a = np.array([1.0 + 2.0**-23, 2.0, np.inf, np.nan], dtype=np.float32)
    np.testing.assert_array_equal(ulp_error(a, e), [1.0, 0.0, 0.0, 0.0])
    assert max_ulp_error(np.float32([1e-8]), [0.0], scale=[1.0]) == pytest.approx(1e-8 / 2.0**-23)
    assert_ulp_close(a, e, 1)
    with pytest.raises(AssertionError, match="max error 1 ulps > 0.5"):
        assert_ulp_close(a, e, 0.5)
    assert np.isinf(ulp_error(np.float32([np.nan]), [1.0])[0])


def test_reference_rounds_bfloat16_once():
    # 1 + 2^-8 + 2^-40 lies just above a bfloat16 tie: correct rounding goes up, float32-first rounding does not
    v = np.array([1.0 + 2.0**-8 + 2.0**-40])
    assert ref_common.round_to(v, ml_dtypes.bfloat16).astype(np.float64)[0] == 1.0 + 2.0**-7
    with np.errstate(over="ignore", invalid="ignore"):  # (the ops' bodies round with rounded, under their _ieee)
        assert ref_common.rounded(v, ml_dtypes.bfloat16).astype(np.float64)[0] == 1.0 + 2.0**-7
    # ml_dtypes before 0.7 rounded float64 -> bfloat16 through float32 (giving 1.0 here); the reference
    # must not depend on which one is installed
    assert v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)[0] == 1.0  # the double rounding


def _naive_layer_norm(x, w, b, eps=1e-5, one_pass=False):
    xf, w, b = x.astype(np.float32), w.astype(np.float32), b.astype(np.float32)
    m = xf.mean(-1, keepdims=True)
    v = (xf * xf).mean(-1, keepdims=True) - m * m if one_pass else ((xf - m) ** 2).mean(-1, keepdims=True)
    return (xf - m) / np.sqrt(np.maximum(v, 0) + np.float32(eps)) * w + b


def test_conformance_finds_the_one_pass_variance_bug():
    with np.errstate(all="ignore"):
        good = check_conformance("layer_norm", _naive_layer_norm, dtypes=["float32"], kinds=["normal"])
        bad = check_conformance(
            "layer_norm", lambda *a: _naive_layer_norm(*a, one_pass=True), dtypes=["float32"], kinds=["offset"]
        )
    assert good.passed(16) and good.max_ulps()["y"] > 0  # float32 math: a few ulps, not 0
    assert not bad.passed(1e6)
    assert "offset" in bad.table()


def test_conformance_of_the_reference_itself():
    def fwd(x, w, b, **kw):
        return pynorm.layer_norm(x, w, b, backend="numpy", **kw)

    def bwd(dy, x, w, b, **kw):
        return pynorm.layer_norm_backward(dy, pynorm.layer_norm_forward(x, w, b, backend="numpy", **kw)[1])

    report = check_conformance("layer_norm", fwd, bwd, hidden_sizes=(1, 5), conventions={"eps_mode": "std"})
    assert report.passed(0) and set(report.max_ulps()) == {"y", "dx", "dweight", "dbias"}


def _float32_layer_norm_dweight(x, dy, eps=1e-5):
    """A correct, plain float32 LayerNorm dweight (mean, deviations and rstd in float32)."""
    x, dy = x.astype(np.float32), dy.astype(np.float32)
    d = x - x.mean(-1, keepdims=True, dtype=np.float32)
    r = np.float32(1) / np.sqrt((d * d).mean(-1, keepdims=True) + np.float32(eps))
    return (dy * (d * r)).sum(0)


def test_dweight_term_scale_is_at_the_rows_unit():
    """A column whose x̂ is ~0 in every row: dweight's terms dy·x̂ carry x̂'s error, which is at the
    row's unit (as y's), so measuring at |dy x̂| alone judged a correct float32 dweight on the rounding
    of a cancelled difference (here > 50 "ulps"); term_scales adds |dy| s r per row."""
    rng = np.random.default_rng(0)
    worst_new = worst_old = 0.0
    for _ in range(100):
        x = rng.standard_normal((1, 7)).astype(np.float32)
        x[0, 3] = np.float32(x.astype(np.float64).mean())  # this column's x̂ is ~0
        dy = rng.standard_normal((1, 7)).astype(np.float32)
        w, b = np.ones(7, np.float32), np.zeros(7, np.float32)
        _, ctx = pynorm.layer_norm_forward(x, w, b, backend="numpy")
        ref = pynorm.layer_norm_backward(dy, ctx).dweight
        got = _float32_layer_norm_dweight(x, dy)
        sc = term_scales("layer_norm", x, {"weight": w, "bias": b}, dy, {})
        xhat = (x.astype(np.float64) - x.astype(np.float64).mean()) * ctx.inner.rstd.astype(np.float64)[:, None]
        worst_new = max(worst_new, max_ulp_error(got, ref, np.float32, scale=sc["dweight"]))
        worst_old = max(worst_old, max_ulp_error(got, ref, np.float32, scale=np.abs(dy * xhat).sum(0)))
    assert worst_new <= 4, worst_new
    assert worst_old > 50, worst_old  # what the old yardstick reported for the same correct results
