"""Every op's hand-written backward against central finite differences (float64), on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pynorm.testing import check_grads

from .helpers import OPS, OpSpec, make_params

CASES = [(spec, conv) for spec in OPS.values() for conv in spec.conventions]


@pytest.mark.parametrize("spec,conv", CASES, ids=[f"{s.name}-{c}" for s, c in CASES])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_grads_match_finite_differences(backend, spec: OpSpec, conv, affine):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 5))
    params = make_params(spec, (2, 5), np.float64, rng) if affine else [None] * len(spec.params)
    report = check_grads(
        backend.forward(spec.forward, axis=1, **conv),
        backend.backward(spec.backward),
        [x, *params],
        names=["x", *spec.params],
        full_jacobian=True,
    )
    assert report.passed, str(report)
    assert report.jacobian_error is not None


@given(
    data=st.data(),
    ndim=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    op=st.sampled_from(sorted(OPS)),
)
def test_grads_random_shapes(backend, data, ndim, seed, op):
    spec = OPS[op]
    rng = np.random.default_rng(seed)
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    k = data.draw(st.integers(1, min(3, ndim)))
    axis = data.draw(st.sampled_from([ndim - k, -k]))
    conv = data.draw(st.sampled_from(spec.conventions))
    if conv.get("correction") == 1 and np.prod(shape[ndim - k :]) == 1:
        conv = {}
    x = rng.standard_normal(shape) * data.draw(st.sampled_from([1.0, 1e-3, 1e3]))
    params = make_params(spec, shape[ndim - k :], np.float64, rng)
    report = check_grads(
        backend.forward(spec.forward, axis=axis, **conv),
        backend.backward(spec.backward),
        [x, *params],
        names=["x", *spec.params],
        n_directions=3,
        full_jacobian=False,
    )
    assert report.passed, str(report)


@pytest.mark.parametrize("op", sorted(OPS))
def test_broadcast_parameter_gradient_is_reduced(backend, op):
    # a (H,) weight used for a (2, H) normalized block: its gradient sums over the broadcast dim
    spec = OPS[op]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 3))
    params = make_params(spec, (3,), np.float64, rng)
    report = check_grads(
        backend.forward(spec.forward, axis=1),
        backend.backward(spec.backward),
        [x, *params],
        names=["x", *spec.params],
        full_jacobian=True,
    )
    assert report.passed, str(report)
