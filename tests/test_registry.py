"""The backend registry: resolution order, errors, context isolation, plug-ins."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import numpy as np
import pytest

import pynorm
from pynorm import _registry
from pynorm.errors import ArrayTypeError, BackendUnavailableError, UnknownBackendError


def _numpy_backends():
    # the automatic choice for numpy input: available backends implementing the op, by priority
    return [
        b.name
        for b in pynorm.list_backends()
        if b.array_type == "numpy.ndarray" and b.available and {"rms_norm", "layer_norm"} <= set(b.ops)
    ]


def test_list_backends_reports_each_with_reason():
    infos = {b.name: b for b in pynorm.list_backends()}
    assert {"numpy", "numba", "cupy"} <= set(infos)
    assert infos["numpy"].available and infos["numpy"].reason is None
    for b in infos.values():
        assert b.available == (b.reason is None)
        if not b.available:
            assert isinstance(b.reason, str) and b.reason
    priorities = [b.priority for b in pynorm.list_backends()]
    assert priorities == sorted(priorities, reverse=True)


def test_list_ops_maps_ops_to_backends():
    ops = pynorm.list_ops()
    assert "numpy" in ops["layer_norm"] and "numpy" in ops["rms_norm"]


def test_explicit_backend_argument_wins():
    x = np.ones((2, 3), np.float32)
    with pynorm.use_backend(_numpy_backends()[0]):
        _, ctx = pynorm.rms_norm_forward(x, backend="numpy")
    assert ctx.backend == "numpy"


def test_use_backend_context_manager():
    x = np.ones((2, 3), np.float32)
    with pynorm.use_backend("numpy"):
        assert pynorm.rms_norm_forward(x)[1].backend == "numpy"
    assert pynorm.rms_norm_forward(x)[1].backend == _numpy_backends()[0]


def test_env_variable(monkeypatch):
    monkeypatch.setenv("PYNORM_BACKEND", "numpy")
    assert pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend == "numpy"
    monkeypatch.setenv("PYNORM_BACKEND", "nope")
    with pytest.raises(UnknownBackendError, match="nope"):
        pynorm.rms_norm(np.ones((2, 3), np.float32))  # (a call shape seen before: read on every call all the same)
    monkeypatch.delenv("PYNORM_BACKEND")
    assert pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend == _numpy_backends()[0]
    monkeypatch.setenv("PYNORM_BACKEND", "")  # (empty: unset)
    assert pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend == _numpy_backends()[0]


def test_env_variable_for_another_array_type_is_ignored(monkeypatch):
    monkeypatch.setenv("PYNORM_BACKEND", "cupy")
    assert pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend == _numpy_backends()[0]


def test_unknown_backend():
    with pytest.raises(UnknownBackendError, match="backend='tpu' is not a registered backend"):
        pynorm.layer_norm(np.ones((2, 3)), backend="tpu")
    with pytest.raises(UnknownBackendError):
        with pynorm.use_backend("tpu"):
            pass


def test_wrong_array_type_for_backend():
    with pytest.raises(ArrayTypeError, match="backend 'cupy' serves cupy.ndarray, but x is numpy.ndarray"):
        pynorm.layer_norm(np.ones((2, 3)), backend="cupy")


def test_unavailable_backend_is_a_clear_error_and_auto_falls_back():
    rec = _registry.Backend("broken", "numpy", "ndarray", 99, "pynorm.reference", lambda: "the test said so")
    _registry.register_backend(rec)
    try:
        with pytest.raises(BackendUnavailableError, match="backend 'broken' is unavailable: the test said so"):
            pynorm.layer_norm(np.ones((2, 3)), backend="broken")
        # priority 99 but unavailable: the automatic choice skips it
        assert pynorm.layer_norm_forward(np.ones((2, 3)))[1].backend != "broken"
        info = {b.name: b for b in pynorm.list_backends()}["broken"]
        assert not info.available and info.reason == "the test said so"
    finally:
        _registry._backends.pop("broken")
        _registry._availability.pop("broken", None)


def test_register_third_party_backend_takes_priority():
    rec = _registry.Backend("mine", "numpy", "ndarray", 100, "pynorm.reference")
    _registry.register_backend(rec)
    try:
        assert pynorm.layer_norm_forward(np.ones((2, 3)))[1].backend == "mine"
        assert "mine" in pynorm.list_ops()["layer_norm"]
        with pytest.raises(ValueError, match="already registered"):
            _registry.register_backend(rec)
    finally:
        _registry._backends.pop("mine")
        _registry._availability.pop("mine", None)
        _registry._modules.pop("mine", None)


def test_cached_resolution_follows_the_registry():
    """resolve() and op_module() memoize their answers: a replaced, added or removed backend must still be seen."""
    x = np.ones((2, 3))
    first = pynorm.layer_norm_forward(x)[1].backend
    assert pynorm.layer_norm_forward(x)[1].backend == first  # (now from the cache)
    rec = _registry.Backend("mine2", "numpy", "ndarray", 100, "pynorm.reference")
    _registry.register_backend(rec)
    try:
        assert pynorm.layer_norm_forward(x)[1].backend == "mine2"
        assert pynorm.layer_norm_forward(x, backend="mine2")[1].backend == "mine2"
        broken = _registry.Backend("mine2", "numpy", "ndarray", 100, "pynorm.reference", lambda: "replaced")
        _registry.register_backend(broken, replace=True)
        with pytest.raises(BackendUnavailableError, match="backend 'mine2' is unavailable: replaced"):
            pynorm.layer_norm_forward(x, backend="mine2")
        assert pynorm.layer_norm_forward(x)[1].backend == first
    finally:
        _registry._backends.pop("mine2")
        _registry._availability.pop("mine2", None)
        _registry._modules.pop("mine2", None)
    assert pynorm.layer_norm_forward(x)[1].backend == first
    with pytest.raises(UnknownBackendError):
        pynorm.layer_norm_forward(x, backend="mine2")


class _FakeArray:
    dtype = np.dtype(np.float32)
    shape = (2, 3)
    ndim = 2

    def reshape(self, *a):
        return self


def test_mixed_array_types():
    with pytest.raises(ArrayTypeError, match="cannot be mixed"):
        pynorm.layer_norm(np.ones((2, 3), np.float32), _FakeArray())
    with pytest.raises(ArrayTypeError, match="no available backend implements 'layer_norm'"):
        pynorm.layer_norm(_FakeArray())


def test_use_backend_is_thread_local():
    seen = {}
    started, release = threading.Event(), threading.Event()

    def other():
        started.wait()
        seen["other"] = pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with pynorm.use_backend("numpy"):
        started.set()
        release.wait()
        seen["main"] = pynorm.rms_norm_forward(np.ones((2, 3), np.float32))[1].backend
    t.join()
    assert seen == {"main": "numpy", "other": _numpy_backends()[0]}


def test_use_backend_is_task_local():
    async def run(name):
        if name:
            with pynorm.use_backend(name):
                await asyncio.sleep(0.01)
                return pynorm.rms_norm_forward(np.ones((2, 3)))[1].backend
        await asyncio.sleep(0.005)
        return pynorm.rms_norm_forward(np.ones((2, 3)))[1].backend

    async def main():
        return await asyncio.gather(run("numpy"), run(None))

    assert asyncio.run(main()) == ["numpy", _numpy_backends()[0]]


def test_entry_point_plugin(tmp_path, monkeypatch):
    dist = tmp_path / "pynorm_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pynorm-plugin-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pynorm.backends]\ndemo = pynorm_plugin_demo:BACKEND\n")
    (tmp_path / "pynorm_plugin_demo.py").write_text(
        "from pynorm import Backend\nBACKEND = Backend('demo', 'numpy', 'ndarray', -5, 'pynorm.reference')\n"
    )
    code = "import pynorm; print(pynorm.list_ops()['layer_norm'])"
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] += os.pathsep + os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "'demo'" in out.stdout


def test_import_is_lazy():
    code = (
        "import sys, pynorm; "
        "print(sorted(m for m in ('numba', 'cupy', 'ml_dtypes', 'importlib.metadata') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
