"""``pynorm.optim`` over layers and blocks, parameters updated in place between forward and backward, a layer's
parameter gradients under ``check_grads``, and the BLAS threads of the blocks' training."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm import layers
from pynorm.blocks import Linear, SequenceModel, sort_task, train_step
from pynorm.blocks import train as train_mod
from pynorm.errors import ArgumentError, PynormWarning
from pynorm.optim import SGD, Adam, AdamW, cosine_schedule
from pynorm.testing import check_grads


class _Params:
    """A model of one parameter vector whose gradients the test sets: what ``named_parameters`` walks."""

    xp = np

    def __init__(self, p: np.ndarray) -> None:
        self.params = {"p": p.copy()}
        self.grads = {"p": np.zeros_like(p)}

    def named_parameters(self, prefix: str = "") -> Any:
        yield f"{prefix}p", self, "p"


P0 = np.array([0.5, -1.0, 2.0, 0.0])
GRADS = [np.array([0.1, -0.2, 0.3, 0.05]), np.array([-0.3, 0.1, 0.2, 0.0]), np.array([0.2, 0.2, -0.1, 0.4])]


def _run(opt: Any) -> np.ndarray:
    m = _Params(P0)
    for g in GRADS:
        m.grads["p"] = g.copy()
        opt.step(m)
    return m.params["p"]


def test_sgd_momentum_nesterov_and_decay_by_their_formulas() -> None:
    lr, mu, wd = 0.1, 0.9, 0.01
    for nesterov in (False, True):
        p, b = P0.copy(), None
        for g in GRADS:
            g = g + wd * p
            b = g.copy() if b is None else mu * b + g
            p = p - lr * (g + mu * b if nesterov else b)
        got = _run(SGD(lr, mu, nesterov=nesterov, weight_decay=wd))
        np.testing.assert_allclose(got, p, rtol=1e-15, atol=1e-15)


def test_adamw_decouples_the_decay_from_the_moments() -> None:
    lr, wd, (b1, b2), eps = 0.01, 0.1, (0.9, 0.999), 1e-8
    p, m, v = P0.copy(), np.zeros(4), np.zeros(4)
    for t, g in enumerate(GRADS, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        p = p - lr * wd * p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    np.testing.assert_allclose(_run(AdamW(lr, weight_decay=wd)), p, rtol=1e-12)
    # weight_decay=0 is Adam; a decay filter that refuses the parameter too
    np.testing.assert_array_equal(_run(AdamW(lr, weight_decay=0.0)), _run(Adam(lr)))
    np.testing.assert_array_equal(_run(AdamW(lr, weight_decay=wd, decay=lambda n, p: p.ndim >= 2)), _run(Adam(lr)))


def test_against_pytorch_optimizers() -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is an optional test dependency")
    for ours, theirs in (
        (AdamW(0.01, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
        (SGD(0.1, 0.9, nesterov=True, weight_decay=0.01),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ):  # fmt: skip
        t = torch.tensor(P0, requires_grad=True)
        opt = theirs([t])
        for g in GRADS:
            t.grad = torch.tensor(g)
            opt.step()
        np.testing.assert_allclose(_run(ours), t.detach().numpy(), rtol=1e-12)


def test_the_schedule_hook_and_warmup() -> None:
    opt = SGD(1.0, schedule=lambda t: 0.5**t, warmup=2)
    assert [opt.lr_at(t) for t in (1, 2, 3)] == [0.25, 0.25, 0.125]
    got = _run(SGD(1.0, schedule=lambda t: 0.5**t))
    np.testing.assert_allclose(got, P0 - sum(0.5**t * g for t, g in enumerate(GRADS, 1)), rtol=1e-15)
    cos = cosine_schedule(5, final=0.2)
    assert cos(1) == 1.0 and math.isclose(cos(3), 0.6) and math.isclose(cos(5), 0.2) and math.isclose(cos(9), 0.2)
    with pytest.raises(ArgumentError, match=r"schedule\(1\)"):
        SGD(1.0, schedule=lambda t: float("nan")).lr_at(1)


def test_errors_name_the_argument() -> None:
    for make, word in (
        (lambda: Adam(-1.0), "lr"), (lambda: Adam(betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda: SGD(momentum=1.5), "momentum"), (lambda: SGD(nesterov=True), "nesterov"),
        (lambda: AdamW(weight_decay=-1), "weight_decay"), (lambda: Adam(warmup=-1), "warmup"),
        (lambda: Adam(schedule=3), "schedule"), (lambda: cosine_schedule(0), "total"),
    ):  # fmt: skip
        with pytest.raises(ArgumentError, match=word):
            make()
    with pytest.raises(ArgumentError, match="named_parameters"):
        Adam().step(object())


@pytest.mark.parametrize("opt", [Adam(0.05), AdamW(0.05), SGD(0.5, 0.5)], ids=["Adam", "AdamW", "SGD"])
def test_one_interface_trains_a_layer_and_a_module(opt: Any) -> None:
    rng = np.random.default_rng(0)
    ln = layers.RMSNorm(8, dtype=np.float64)
    lin = Linear(8, 8, rng=1, dtype=np.float64)
    x = rng.standard_normal((16, 8))
    target = 3.0 * x / np.sqrt((x * x).mean(-1, keepdims=True))
    first = last = 0.0
    for i in range(60):
        h, ch = ln.forward(x)
        y, cl = lin.forward(h)
        loss = float(((y - target) ** 2).mean())
        first, last = (loss, loss) if i == 0 else (first, loss)
        ln.zero_grad()
        lin.zero_grad()
        ln.backward(lin.backward(2 * (y - target) / y.size, cl), ch)
        for model in (ln, lin):
            upd = opt.step(model)
            assert set(upd) == {n for n, _, _ in model.named_parameters()}
    assert last < 0.5 * first


def _grad_layers() -> list[Any]:
    return [layers.LayerNorm(6, dtype=np.float64), layers.RMSNorm(6, dtype=np.float64),
            layers.ScaleNorm(6, dtype=np.float64)]  # fmt: skip


@pytest.mark.parametrize("layer", _grad_layers(), ids=lambda la: type(la).__name__)
def test_in_place_updates_between_forward_and_backward_change_nothing(layer: Any) -> None:
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    for n in layer.params:
        layer.params[n][...] = rng.standard_normal(layer.params[n].shape)
    before = {n: p.copy() for n, p in layer.params.items()}
    _, ctx = layer.forward(x)
    _, ctx_ref = getattr(pynorm, f"{layer.spec.name}_forward")(x, *(before.get(p.name) for p in layer.spec.params))
    want = getattr(pynorm, f"{layer.spec.name}_backward")(dy, ctx_ref)
    for p in layer.params.values():
        p[...] = 7.0  # what an in-place optimizer step (or a careless gradient check) does
    layer.zero_grad()
    np.testing.assert_array_equal(layer.backward(dy, ctx), want.dx)
    for n in layer.params:
        np.testing.assert_array_equal(layer.grads[n], getattr(want, f"d{n}"))


@pytest.mark.parametrize("layer", _grad_layers(), ids=lambda la: type(la).__name__)
def test_check_grads_of_a_layers_parameters(layer: Any) -> None:
    """docs/training.md's recipe: the parameters as inputs, written into the layer in place."""
    rng = np.random.default_rng(2)
    names = list(layer.params)
    start = [1 + 0.3 * rng.standard_normal(layer.params[n].shape) for n in names]

    def forward(x: Any, *ps: Any) -> Any:
        for n, p in zip(names, ps, strict=True):
            layer.params[n][...] = p
        return layer.forward(x)

    def backward(dy: Any, ctx: Any) -> list[Any]:
        layer.zero_grad()
        return [layer.backward(dy, ctx), *(layer.grads[n].copy() for n in names)]

    report = check_grads(forward, backward, [rng.standard_normal((3, 6)), *start], names=["x", *names])
    assert report.passed, report

    def wrong(dy: Any, ctx: Any) -> list[Any]:
        g = backward(dy, ctx)
        return [g[0], *(1.001 * d for d in g[1:])]

    assert not check_grads(forward, wrong, [rng.standard_normal((3, 6)), *start]).passed


def _tiny_model() -> SequenceModel:
    return SequenceModel(8, 6, 1, 16, 2, rng=0, dtype=np.float32)


def test_train_step_caps_the_blas_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="threadpoolctl is in the test extra")
    model = _tiny_model()
    seen: list[Any] = []
    forward = model.forward

    def spy(*a: Any, **k: Any) -> Any:
        seen.append([i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"])
        return forward(*a, **k)

    monkeypatch.setattr(model, "forward", spy)
    tokens, targets = sort_task(np.random.default_rng(0), 4, 6, 8)
    r = train_step(model, tokens, targets, Adam(1e-3))
    assert isinstance(r, train_mod.StepResult) and not r.skipped and np.isfinite(r.loss)
    if not seen[0]:
        pytest.skip("NumPy's BLAS is not visible to threadpoolctl here")
    assert all(n == 1 for n in seen[0]), seen
    train_step(model, tokens, targets, Adam(1e-3), blas_threads=None)
    outside = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    assert seen[1] == outside  # None: BLAS as it is


def test_without_threadpoolctl_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # (an import of it raises ImportError)
    monkeypatch.setattr(train_mod, "_controller", [])
    monkeypatch.setattr(train_mod, "_warned", [])
    for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(train_mod.os, "cpu_count", lambda: 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with train_mod.limit_blas_threads(1):
                pass
    msgs = [str(w.message) for w in caught if issubclass(w.category, PynormWarning)]
    assert len(msgs) == 1 and "threadpoolctl" in msgs[0] and "OPENBLAS_NUM_THREADS=1" in msgs[0]
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setattr(train_mod, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with train_mod.limit_blas_threads(1):
            pass
    assert not [w for w in caught if issubclass(w.category, PynormWarning)]
    with pytest.raises(ArgumentError, match="blas_threads"):
        train_mod.limit_blas_threads(0)
