"""The reference's shortcuts for small calls give the bits of the plain path.

The dispatcher runs a plan through the op module's ``forward_for`` (the conventions bound, passed by position);
rounding under an op's IEEE error state skips ``round_to``'s own (``_dtypes.rounded``); ``finite_rows`` checks the
sum of its sums before it builds the mask. Each must agree bit for bit with what it replaces, in every dtype,
casting policy and convention, on non-finite values too: the reference is the oracle.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from pynorm._dtypes import round_to, rounded
from pynorm.reference import _common
from pynorm.reference import layer_norm as ln
from pynorm.reference import rms_norm as rms
from pynorm.reference.casting import CASTINGS

from .helpers import DTYPES, dtype

LN_CONVENTIONS: list[dict[str, Any]] = [
    {"eps": 1e-5},
    {"eps": 0.0, "correction": 1},
    {"eps": 1e-3, "eps_mode": "std", "weight_offset": 1.0},
]
RMS_CONVENTIONS: list[dict[str, Any]] = [{"eps": 1e-6}, {"eps": 0.0, "weight_offset": 1.0}]


def _bits(a: Any) -> bytes:
    a = np.ascontiguousarray(a)
    if a.dtype == np.longdouble and np.finfo(np.longdouble).nmant == 63:  # x87: 6 of the 16 bytes are padding
        return a.view(np.uint8).reshape(-1, a.dtype.itemsize)[:, :10].tobytes()
    return a.tobytes()


def _data(dt: str) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 8)) * 3 + 1
    x[1] = 2.5  # a constant row (0/0 where eps = 0)
    x[2, 3] = np.nan
    x[3, 0] = np.inf
    w = 1 + 0.5 * rng.standard_normal(8)
    w[2] = -0.0
    b = 0.5 * rng.standard_normal(8)
    b[2] = -0.0
    d = dtype(dt)
    return x.astype(d), w.astype(d), b.astype(d)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("casting", CASTINGS)
def test_forward_for_gives_the_bits_of_forward(dt: str, casting: str) -> None:
    x, w, b = _data(dt)
    for op, params, convs in ((ln, (w, b), LN_CONVENTIONS), (rms, (w,), RMS_CONVENTIONS)):
        for conv, out in itertools.product(convs, (False, True)):
            opts = {**conv, "casting": casting}
            o1 = np.empty_like(x) if out else None
            o2 = np.empty_like(x) if out else None
            y1, c1 = op.forward(x, *params, out=o1, **opts)
            y2, c2 = op.forward_for(opts)(x, *params, out=o2)
            assert (y1 is o1) == out and (y2 is o2) == out
            assert _bits(y1) == _bits(y2), (op.__name__, conv)
            assert vars(c1).keys() == vars(c2).keys()
            for k, v in vars(c1).items():
                if isinstance(v, np.ndarray):
                    assert v.dtype == vars(c2)[k].dtype and _bits(v) == _bits(vars(c2)[k]), (op.__name__, conv, k)
                else:
                    assert v is vars(c2)[k] or v == vars(c2)[k], (op.__name__, conv, k)


def test_forward_for_takes_the_defaults_and_refuses_unknown_options() -> None:
    x, w, b = _data("float32")
    y1, _ = ln.forward(x, w, b, eps=1e-5)
    y2, c2 = ln.forward_for({"eps": 1e-5})(x, w, b)
    assert _bits(y1) == _bits(y2) and (c2.correction, c2.eps_mode, c2.casting) == (0, "var", "fp32")
    with pytest.raises(TypeError, match="unknown options"):
        ln.forward_for({"eps": 1e-5, "alpha": 2.0})
    with pytest.raises(TypeError, match="missing"):
        rms.forward_for({"weight_offset": 1.0})


@pytest.mark.parametrize("dt", DTYPES)
def test_rounded_is_round_to_under_the_ops_error_state(dt: str) -> None:
    v = np.array([1 / 3, -2.5e-8, 7e4, -7e4, 3.5e38, -1e39, 1e-310, np.nan, np.inf, -0.0, 65519.99, 1e300])
    for a in (v, v.astype(np.longdouble)):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            got = rounded(a, dtype(dt))
        assert got.dtype == dtype(dt) and _bits(got) == _bits(round_to(a, dt))


def _finite_rows_by_mask(v: np.ndarray, *sums: np.ndarray) -> np.ndarray:
    ok = np.logical_and.reduce([np.isfinite(s) for s in sums])
    return np.where(ok, v, np.nan)


def test_finite_rows_one_check_agrees_with_the_mask() -> None:
    big = np.finfo(np.float64).max
    v = np.arange(1.0, 5.0)
    cases = [
        (np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, -1.0, 2.0, 0.0])),  # all finite
        (np.array([big, 1.0, -big, 0.0]), np.array([big, 2.0, -big, 0.0])),  # finite sums whose sum overflows
        (np.array([np.inf, 1.0, 0.0, 0.0]), np.array([-np.inf, 1.0, 0.0, 0.0])),  # inf + -inf: NaN
        (np.array([1.0, np.nan, 0.0, 0.0]), np.array([1.0, 1.0, 0.0, -np.inf])),
    ]
    for s1, s2 in cases:
        for sums in ((s1,), (s1, s2), (s2, s1, s1)):
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # (the ops' _ieee)
                got = _common.finite_rows(v, *sums)
            assert np.array_equal(got, _finite_rows_by_mask(v, *sums), equal_nan=True)
            if all(np.isfinite(s).all() for s in sums):
                assert got is v  # (nothing to mask: v itself, as before the one check)
    col = v[:, None]  # per-row values as (R, 1) columns, as LayerNorm's backward passes them
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        got = _common.finite_rows(col, cases[2][0][:, None], cases[2][1][:, None])
    assert got.shape == (4, 1) and np.isnan(got[0, 0]) and np.array_equal(got[1:, 0], v[1:])


def test_the_ops_leave_the_error_state_as_they_found_it() -> None:
    x = np.full((2, 4), 3.0, np.float32)  # constant rows: 0/0 with eps = 0, which must not warn
    before = np.geterr()
    with np.errstate(all="raise"):
        y, ctx = ln.forward(x, None, None, eps=0.0)
        ln.backward(np.ones_like(x), ctx)
        yr, _ = rms.forward_for({"eps": 0.0})(np.zeros_like(x), None)
        assert np.geterr()["divide"] == "raise"
    assert np.geterr() == before
    assert np.isnan(y).all() and np.isnan(yr).all()
