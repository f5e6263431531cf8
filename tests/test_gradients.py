"""Every op's hand-written backward against central finite differences (float64), on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pynorm.testing import check_grads

from .helpers import OPS, OpSpec, grad_check_setup, make_args


def _smooth(conv) -> bool:
    # h rounded to a narrower residual_dtype than float64 makes the forward a step function at that
    # dtype's resolution: finite differences in float64 would measure the rounding, not the gradient
    return conv.get("residual_dtype") in (None, "float64")


CASES = [(spec, conv) for spec in OPS.values() for conv in spec.conventions if _smooth(conv)]


@pytest.mark.parametrize("spec,conv", CASES, ids=[f"{s.name}-{c}" for s, c in CASES])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_grads_match_finite_differences(backend, spec: OpSpec, conv, affine):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 5))
    args = make_args(spec, x.shape, 1, np.float64, rng, options=conv)
    if not affine:
        args = spec.without_optional(args)
    fwd, bwd, inputs, names = grad_check_setup(backend, spec, x, args, axis=1, **conv)
    report = check_grads(fwd, bwd, inputs, names=names, full_jacobian=True)
    assert report.passed, str(report)
    assert report.jacobian_error is not None


@given(
    data=st.data(),
    ndim=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_grads_random_shapes(backend, data, ndim, seed):
    op = data.draw(st.sampled_from(sorted(o for o in OPS if o in backend.ops)))
    spec = OPS[op]
    rng = np.random.default_rng(seed)
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    k = data.draw(st.integers(1, min(3, ndim)))
    axis = data.draw(st.sampled_from([ndim - k, -k]))
    conv = data.draw(st.sampled_from([c for c in spec.conventions if _smooth(c)]))
    if conv.get("correction") == 1 and np.prod(shape[ndim - k :]) == 1:
        conv = {}
    x = rng.standard_normal(shape) * data.draw(st.sampled_from([1.0, 1e-3, 1e3]))
    args = make_args(spec, shape, axis, np.float64, rng, options=conv)
    fwd, bwd, inputs, names = grad_check_setup(backend, spec, x, args, axis=axis, **conv)
    report = check_grads(fwd, bwd, inputs, names=names, n_directions=3, full_jacobian=False)
    assert report.passed, str(report)


BROADCASTING = sorted(op for op, spec in OPS.items() if any(p.kind == "feature" for p in spec.spec.params))


@pytest.mark.parametrize("op", BROADCASTING)
def test_broadcast_parameter_gradient_is_reduced(backend, op):
    # a (H,) feature parameter used for a (2, H) normalized block: its gradient sums over the broadcast dim
    spec = OPS[op]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 3))
    args = make_args(spec, x.shape, 1, np.float64, rng)
    n_in = len(spec.spec.inputs)
    for i, p in enumerate(spec.spec.params):
        if p.kind == "feature":
            args[n_in + i] = args[n_in + i][0]  # (2, 3) -> (3,)
    fwd, bwd, inputs, names = grad_check_setup(backend, spec, x, args, axis=1)
    report = check_grads(fwd, bwd, inputs, names=names, full_jacobian=True)
    assert report.passed, str(report)
