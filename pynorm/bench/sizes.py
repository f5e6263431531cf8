"""The size sweep (``python -m pynorm bench --sizes``): pynorm against its peers from one token to a full batch.

Pipelines rarely call a norm on 64 MiB: a decode step is one to a few dozen rows, a microbatch kilobytes to a few
MiB. The sweep times every cell -- rows in :data:`ROWS` x hidden sizes in :data:`HIDDEN` (``--quick``:
:data:`QUICK_ROWS` x :data:`QUICK_HIDDEN`), float32, the ops of :data:`OPS`, forward and forward + backward --
for each library in a process of its own:

* ``pynorm``: the ``numba`` backend, its forward the result alone (``pynorm.layer_norm(...)``, no ctx: what an
  inference step calls, as the peers' forward runs without autograd), its forward + backward
  ``layer_norm_forward`` then ``layer_norm_backward``; the same through ``pynorm.plan`` (``pynorm:plan``); the
  process also times the same-size copy, ``np.copyto`` of ``x``: the floor of a call that reads and writes its
  rows once;
* ``torch``: PyTorch eager (``F.layer_norm``, ``F.rms_norm``, ``x + r`` then ``F.rms_norm``, ``F.group_norm``),
  autograd for the backward;
* ``torch_compile``: the same functions through ``torch.compile`` (inductor, ``dynamic=True``: one compilation per
  op and phase, not per shape);
* ``jax``: the ops written in ``jax.numpy`` under ``jax.jit`` (``value_and_grad`` for the backward), one
  compilation per shape;
* ``ort``: ONNX Runtime's ``LayerNormalization``, ``RMSNormalization``, ``Add`` + ``RMSNormalization`` and
  ``GroupNormalization`` (forward only: it has no backward), models built with ``onnx`` with symbolic row counts.

Every library's add + RMSNorm forward returns the sum ``h = x + r`` as well as ``y``, as pynorm's does: a pre-norm
block passes ``h`` on as the residual stream (before 2026-12-07 JAX's and ONNX Runtime's returned ``y`` alone,
which let ONNX Runtime's fused kernel skip writing ``h``: a row's output bytes halved).

A library that does not import is left out and said so. Timing: per cell, in each of ``rounds`` interleaved
rounds, every library's process takes one sample -- the median of the calls that fill :data:`SAMPLE_S` (at least
three), each call timed alone, the results of the last :data:`KEEP` calls kept alive (as a layer stack keeps its
outputs, so that an allocator cannot hand the same memory back at once); a cell's time is the median of its
rounds' samples. The forward + backward of pynorm and of eager PyTorch are a forward then a backward with an
upstream gradient of ones' shape (random, fixed); JAX's and compiled PyTorch's are one compiled function.

Results: ``sizes.json`` (every time, the load before and after), a table on stdout (microseconds, and the fastest
peer's time over pynorm's per cell), the geometric mean of that ratio over the sweep, and ``sizes.png`` (time
against bytes, log-log, one panel per op and phase, the copy as the floor) when matplotlib is installed.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["HIDDEN", "OPS", "PEERS", "ROWS", "run"]

ROWS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
HIDDEN = (1024, 4096, 8192)
QUICK_ROWS = (1, 16, 256, 2048)
QUICK_HIDDEN = (1024, 4096)
OPS = ("layer_norm", "rms_norm", "add_rms_norm", "group_norm")
PHASES = ("fwd", "fwdbwd")
#: the peer libraries, in the order of the table
PEERS = ("torch", "torch_compile", "jax", "ort")
LIBS = ("pynorm", *PEERS)
GROUPS = 32
EPS = 1e-5
SAMPLE_S = 0.02
KEEP = 3


# ---------------------------------------------------------------------------
# the calls of each library (in its worker process)


def _data(op: str, rows: int, h: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows * 7919 + h)
    d = {
        "x": rng.standard_normal((rows, h), dtype=np.float32),
        "w": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "b": (0.1 * rng.standard_normal(h)).astype(np.float32),
        "dy": rng.standard_normal((rows, h), dtype=np.float32),
    }
    if op == "add_rms_norm":
        d["r"] = rng.standard_normal((rows, h), dtype=np.float32)
    return d


def _args(op: str, d: dict[str, np.ndarray]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An op's arrays after ``x`` (its forward's positional order) and its options."""
    args = {"rms_norm": (d["w"],), "add_rms_norm": (d.get("r"), d["w"])}.get(op, (d["w"], d["b"]))
    return args, {"eps": EPS, **({"num_groups": GROUPS} if op == "group_norm" else {})}


def _pynorm_calls(op: str, d: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    """``fwd``: the result alone (``pynorm.<op>``, what an inference step calls; the peers' forward is theirs
    without autograd); ``fwdbwd``: ``pynorm.<op>_forward`` (with its ctx), then its backward; then the same
    through a bound plan (:func:`_plan_calls`)."""
    import pynorm

    x, dy = d["x"], d["dy"]
    args, opts = _args(op, d)
    call, forward, backward = (getattr(pynorm, n) for n in (op, f"{op}_forward", f"{op}_backward"))

    def fwdbwd() -> Any:
        y, ctx = forward(x, *args, backend="numba", **opts)
        return y, backward(dy, ctx)

    return {"fwd": lambda: call(x, *args, backend="numba", **opts), "fwdbwd": fwdbwd, **_plan_calls(op, d)}


def _plan_calls(op: str, d: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    """The same calls through a bound plan (``pynorm.plan``): ``plan_fwd`` the outputs alone (a decode step's
    call), ``plan_fwdbwd`` the plan's forward (with its ctx) then its backward."""
    import pynorm

    x, dy = d["x"], d["dy"]
    args, opts = _args(op, d)
    p = pynorm.plan(op, x, *args, backend="numba", **opts)

    def fwdbwd() -> Any:
        y, ctx = p.forward(x, *args)
        return y, p.backward(dy, ctx)

    return {"plan_fwd": lambda: p(x, *args), "plan_fwdbwd": fwdbwd}


def _torch_fns(op: str, h: int) -> Callable[..., Any]:
    import torch
    import torch.nn.functional as F

    if op == "layer_norm":
        return lambda x, w, b, r: F.layer_norm(x, (h,), w, b, EPS)
    if op == "rms_norm":
        return lambda x, w, b, r: F.rms_norm(x, (h,), w, EPS)
    if op == "add_rms_norm":

        def add_rms(x: Any, w: Any, b: Any, r: Any) -> Any:
            hh = x + r
            return F.rms_norm(hh, (h,), w, EPS), hh

        return add_rms
    del torch
    return lambda x, w, b, r: F.group_norm(x, GROUPS, w, b, EPS)


def _torch_calls(op: str, d: dict[str, np.ndarray], compiled: bool) -> dict[str, Callable[[], Any]]:
    import torch

    h = d["x"].shape[1]
    t = {k: torch.from_numpy(v) for k, v in d.items()}
    leaves = {k: t[k].clone().requires_grad_(k != "dy") for k in t}
    fn = _torch_fns(op, h)
    if compiled:
        fn = torch.compile(fn, dynamic=True)

    def first(out: Any) -> Any:
        return out[0] if isinstance(out, tuple) else out

    def fwd() -> Any:
        with torch.no_grad():
            return fn(t["x"], t["w"], t["b"], t.get("r"))

    def fwdbwd() -> Any:
        for v in leaves.values():
            v.grad = None
        y = first(fn(leaves["x"], leaves["w"], leaves["b"], leaves.get("r")))
        y.backward(t["dy"])
        return y, leaves["x"].grad, leaves["w"].grad

    return {"fwd": fwd, "fwdbwd": fwdbwd}


def _jax_calls(op: str, d: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", False)
    h = d["x"].shape[1]
    a = {k: jnp.asarray(v) for k, v in d.items()}

    def norm(x: Any, w: Any, b: Any, r: Any) -> Any:
        if op == "layer_norm":
            m = x.mean(-1, keepdims=True)
            v = ((x - m) ** 2).mean(-1, keepdims=True)
            return (x - m) * jax.lax.rsqrt(v + EPS) * w + b
        if op in ("rms_norm", "add_rms_norm"):
            hh = x + r if op == "add_rms_norm" else x
            return hh * jax.lax.rsqrt((hh * hh).mean(-1, keepdims=True) + EPS) * w
        g = x.reshape(x.shape[0], GROUPS, h // GROUPS)
        m = g.mean(-1, keepdims=True)
        v = ((g - m) ** 2).mean(-1, keepdims=True)
        return ((g - m) * jax.lax.rsqrt(v + EPS)).reshape(x.shape) * w + b

    # add + RMSNorm's forward returns the sum too, as pynorm's and PyTorch's do (the next layer's residual stream)
    f = jax.jit((lambda x, w, b, r: (norm(x, w, b, r), x + r)) if op == "add_rms_norm" else norm)
    r = a.get("r", a["x"])

    def loss(x: Any, w: Any, b: Any, r: Any, dy: Any) -> Any:
        return (norm(x, w, b, r) * dy).sum()

    g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return {
        "fwd": lambda: jax.block_until_ready(f(a["x"], a["w"], a["b"], r)),
        "fwdbwd": lambda: jax.block_until_ready(g(a["x"], a["w"], a["b"], r, a["dy"])),
    }


_ORT_SESSIONS: dict[str, Any] = {}


def _ort_session(op: str, h: int, threads: int) -> Any:
    key = f"{op}:{h}"
    if key in _ORT_SESSIONS:
        return _ORT_SESSIONS[key]
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("x", f32, ["N", h]), helper.make_tensor_value_info("w", f32, [h])]
    if op == "layer_norm":
        inputs.append(helper.make_tensor_value_info("b", f32, [h]))
        nodes = [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1, epsilon=EPS)]
        opset = 17
    elif op in ("rms_norm", "add_rms_norm"):
        nodes = [helper.make_node("RMSNormalization", ["h" if op == "add_rms_norm" else "x", "w"], ["y"], axis=-1,
                                  epsilon=EPS)]  # fmt: skip
        if op == "add_rms_norm":
            inputs.append(helper.make_tensor_value_info("r", f32, ["N", h]))
            nodes.insert(0, helper.make_node("Add", ["x", "r"], ["h"]))
        opset = 23
    else:
        inputs.append(helper.make_tensor_value_info("b", f32, [h]))
        inputs[0] = helper.make_tensor_value_info("x", f32, ["N", h, 1])
        nodes = [helper.make_node("GroupNormalization", ["x", "w", "b"], ["y"], num_groups=GROUPS, epsilon=EPS)]
        opset = 21
    out_shape: list[str | int | None] = ["N", h, 1] if op == "group_norm" else ["N", h]
    outputs = [helper.make_tensor_value_info(n, f32, out_shape) for n in ("y", "h")[: 2 if op == "add_rms_norm" else 1]]
    graph = helper.make_graph(nodes, op, inputs, outputs)  # add + RMSNorm: the sum is an output, as pynorm's
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(onnx._serialize(model) if hasattr(onnx, "_serialize") else model.SerializeToString(),
                                so, providers=["CPUExecutionProvider"])  # fmt: skip
    _ORT_SESSIONS[key] = sess
    return sess


def _ort_calls(op: str, d: dict[str, np.ndarray], threads: int) -> dict[str, Callable[[], Any]]:
    h = d["x"].shape[1]
    sess = _ort_session(op, h, threads)
    feed = {"x": d["x"][..., None] if op == "group_norm" else d["x"], "w": d["w"]}
    if op in ("layer_norm", "group_norm"):
        feed["b"] = d["b"]
    if op == "add_rms_norm":
        feed["r"] = d["r"]
    return {"fwd": lambda: sess.run(None, feed)}


class _Worker:
    def __init__(self, lib: str, threads: int) -> None:
        self.lib, self.threads = lib, threads
        self.calls: dict[str, Callable[[], Any]] = {}
        self.kept: list[Any] = []

    def hello(self) -> dict[str, Any]:
        versions: dict[str, str] = {"numpy": np.__version__}
        try:
            if self.lib == "pynorm":
                import numba

                import pynorm

                pynorm.set_num_threads(self.threads)
                versions.update(numba=numba.__version__, pynorm=pynorm.__version__)
            elif self.lib in ("torch", "torch_compile"):
                import torch

                torch.set_num_threads(self.threads)
                versions["torch"] = torch.__version__
            elif self.lib == "jax":
                import jax

                versions["jax"] = jax.__version__
            else:
                import onnx
                import onnxruntime

                versions.update(onnxruntime=onnxruntime.__version__, onnx=onnx.__version__)
        except ImportError as e:
            return {"unavailable": str(e)}
        return {"versions": versions}

    def prepare(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.calls, self.kept = {}, []
        op, rows, h = cmd["op"], int(cmd["rows"]), int(cmd["h"])
        d = _data(op, rows, h)
        if self.lib == "pynorm":
            calls = _pynorm_calls(op, d)
            out = np.empty_like(d["x"])
            calls["copy"] = lambda: np.copyto(out, d["x"])
        elif self.lib in ("torch", "torch_compile"):
            calls = _torch_calls(op, d, self.lib == "torch_compile")
        elif self.lib == "jax":
            calls = _jax_calls(op, d)
        else:
            calls = _ort_calls(op, d, self.threads)
        t0 = time.perf_counter()
        for f in calls.values():
            f()
            f()  # compiled on the first call where the library compiles
        self.calls = calls
        return {"warm_s": time.perf_counter() - t0, "keys": sorted(calls)}

    def sample(self, key: str) -> float:
        f = self.calls[key]
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < SAMPLE_S and len(times) < 2000):
            t0 = time.perf_counter()
            r = f()
            times.append(time.perf_counter() - t0)
            self.kept.append(r)
            if len(self.kept) > KEEP:
                del self.kept[0]
        return statistics.median(times)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        c = cmd["cmd"]
        if c == "hello":
            return self.hello()
        if c == "prepare":
            return self.prepare(cmd)
        if c == "time":
            return {k: self.sample(k) for k in cmd["keys"] if k in self.calls}
        raise ValueError(f"unknown command {c!r}")


def worker_main(lib: str, threads: int) -> int:
    """A worker's loop: one JSON command per line on stdin, one JSON answer per line on the original stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the libraries print goes to stderr
    w = _Worker(lib, threads)
    for line in sys.stdin:
        try:
            ans = w.handle(json.loads(line))
        except Exception:
            ans = {"error": traceback.format_exc()}
        out.write(json.dumps(ans) + "\n")
        out.flush()
    return 0


# ---------------------------------------------------------------------------
# the parent: interleaved rounds over the libraries' processes


class _Proc:
    def __init__(self, lib: str, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if lib == "jax":
            env["XLA_FLAGS"] = (
                env.get("XLA_FLAGS", "") + f" --xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}"
            ).strip()
        self.lib = lib
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pynorm.bench.sizes", "--worker", lib, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.lib} worker ended")
        ans: dict[str, Any] = json.loads(line)
        return ans

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(timeout=60)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(
    out_dir: Path, threads: int = 2, quick: bool = False, rounds: int | None = None, ops: list[str] | None = None,
    peers: list[str] | None = None, rows: list[int] | None = None, hidden: list[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The sweep; writes ``sizes.json`` (and ``sizes.png``) into ``out_dir``, prints the table, returns the data."""
    ops = list(ops or OPS)
    libs = ["pynorm", *(peers if peers is not None else PEERS)]
    rows = list(rows or (QUICK_ROWS if quick else ROWS))
    hidden = list(hidden or (QUICK_HIDDEN if quick else HIDDEN))
    rounds = rounds or (3 if quick else 5)
    load_before = list(os.getloadavg())
    procs: dict[str, _Proc] = {}
    unavailable: dict[str, str] = {}
    versions: dict[str, Any] = {}
    for lib in libs:
        p = _Proc(lib, threads)
        hello = p.ask(cmd="hello")
        if "unavailable" in hello or "error" in hello:
            unavailable[lib] = hello.get("unavailable") or hello["error"].splitlines()[-1]
            p.close()
        else:
            procs[lib] = p
            versions[lib] = hello["versions"]
    cells: list[dict[str, Any]] = []
    try:
        for op in ops:
            for h in hidden:
                for r in rows:
                    _log(f"{op} {r}x{h}")
                    cell: dict[str, Any] = {"op": op, "rows": r, "hidden": h, "bytes": 4 * r * h, "t": {}, "errors": {}}
                    keys: dict[str, list[str]] = {}
                    for lib, p in procs.items():
                        ans = p.ask(cmd="prepare", op=op, rows=r, h=h)
                        if "error" in ans:
                            cell["errors"][lib] = ans["error"].strip().splitlines()[-1]
                        else:
                            keys[lib] = ans["keys"]
                    samples: dict[str, list[float]] = {}
                    for rnd in range(rounds):
                        order = list(keys) if rnd % 2 == 0 else list(reversed(keys))
                        for lib in order:
                            ans = procs[lib].ask(cmd="time", keys=keys[lib])
                            if "error" in ans:
                                cell["errors"][lib] = ans["error"].strip().splitlines()[-1]
                                continue
                            for k, v in ans.items():
                                name = "copy" if k == "copy" else f"{lib}:{k}"
                                samples.setdefault(name, []).append(v)
                    cell["t"] = {k: statistics.median(v) for k, v in samples.items()}
                    cells.append(cell)
    finally:
        for p in procs.values():
            p.close()
    data = {
        "meta": {
            "threads": threads, "float": "float32", "rounds": rounds, "cpu": _cpu(), "versions": versions,
            "unavailable": unavailable, "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
            "sample_s": SAMPLE_S, "keep": KEEP, "groups": GROUPS,
        },
        "cells": cells,
        "summary": summary(cells),
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sizes.json").write_text(json.dumps(data, indent=1))
    print(text(data))
    if chart(data, out_dir / "sizes.png"):
        _log(f"wrote {out_dir / 'sizes.png'}")
    _log(f"wrote {out_dir / 'sizes.json'}")
    return data


def _cpu() -> str:
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{model or 'unknown CPU'} ({isa}), {os.cpu_count()} cores"


def _best_peer(cell: dict[str, Any], phase: str) -> tuple[str, float] | None:
    peers = [(lib, cell["t"][f"{lib}:{phase}"]) for lib in PEERS if f"{lib}:{phase}" in cell["t"]]
    return min(peers, key=lambda e: e[1]) if peers else None


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase: the geometric mean over the cells of the fastest peer's time over pynorm's, and how many cells
    pynorm is at least as fast as that peer (and, for the forward + backward, as eager PyTorch); the same for
    pynorm's calls through a bound plan (``plan_fwd``, ``plan_fwdbwd``)."""
    out: dict[str, Any] = {}
    for phase in (*PHASES, *(f"plan_{p}" for p in PHASES)):
        mine_key, peer_phase = f"pynorm:{phase}", phase.removeprefix("plan_")
        ratios, wins, n, torch_wins, torch_n = [], 0, 0, 0, 0
        for c in cells:
            mine = c["t"].get(mine_key)
            best = _best_peer(c, peer_phase)
            if mine is None or best is None:
                continue
            ratios.append(best[1] / mine)
            n += 1
            wins += best[1] >= mine
            tt = c["t"].get(f"torch:{peer_phase}")
            if tt is not None:
                torch_n += 1
                torch_wins += tt >= mine
        if ratios:
            out[phase] = {
                "geomean_best_peer_over_pynorm": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
                "cells": n, "pynorm_at_least_as_fast_as_best_peer": wins,
                "pynorm_at_least_as_fast_as_torch": torch_wins, "cells_with_torch": torch_n,
            }  # fmt: skip
    return out


def text(data: dict[str, Any]) -> str:
    """The table: microseconds per call, and the fastest peer's time over pynorm's."""
    m = data["meta"]
    lines = [f"size sweep, float32, {m['threads']} threads, {m['cpu']}; median of {m['rounds']} interleaved rounds; "
             f"load {m['loadavg_before'][0]:.2f} before, {m['loadavg_after'][0]:.2f} after"]  # fmt: skip
    for lib, why in m["unavailable"].items():
        lines.append(f"  (no {lib}: {why})")
    libs = ["pynorm", "pynorm:plan", *PEERS]

    def key(lib: str, phase: str) -> str:
        return f"pynorm:plan_{phase}" if lib == "pynorm:plan" else f"{lib}:{phase}"

    for phase in PHASES:
        lines.append(f"\n{phase} (us; pynorm:plan: the call through pynorm.plan)")
        head = f"{'op':13s} {'rows x H':>11s} {'copy':>8s} " + " ".join(f"{lib:>13s}" for lib in libs)
        lines.append(head + "  best peer / pynorm, / pynorm:plan")
        for c in data["cells"]:
            t = c["t"]
            if f"pynorm:{phase}" not in t:
                continue
            vals = " ".join(
                f"{t[key(lib, phase)] * 1e6:13.1f}" if key(lib, phase) in t else f"{'-':>13s}" for lib in libs
            )
            best = _best_peer(c, phase)
            ratio = f"{best[1] / t[f'pynorm:{phase}']:6.2f} ({best[0]})" if best else ""
            if best and key("pynorm:plan", phase) in t:
                ratio += f" {best[1] / t[key('pynorm:plan', phase)]:6.2f}"
            copy = f"{t['copy'] * 1e6:8.1f}" if "copy" in t else f"{'-':>8s}"
            lines.append(f"{c['op']:13s} {c['rows']:>5d}x{c['hidden']:<5d} {copy} {vals}  {ratio}")
    for phase, s in data["summary"].items():
        lines.append(
            f"\n{phase}: geometric mean of best peer / pynorm {s['geomean_best_peer_over_pynorm']:.2f} over "
            f"{s['cells']} cells; pynorm at least as fast as the best peer in "
            f"{s['pynorm_at_least_as_fast_as_best_peer']}, as eager PyTorch in "
            f"{s['pynorm_at_least_as_fast_as_torch']} of {s['cells_with_torch']}"
        )
    return "\n".join(lines)


_STYLE: dict[str, dict[str, Any]] = {
    "copy": {"color": "grey", "ls": "--"}, "pynorm": {"color": "black", "lw": 2},
    "pynorm:plan": {"color": "black", "lw": 1, "ls": ":"},
}  # fmt: skip


def chart(data: dict[str, Any], path: Path) -> bool:
    """Time against bytes (log-log), one panel per op and phase, the copy as the floor; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = list(dict.fromkeys(c["op"] for c in data["cells"]))
    fig, axes = plt.subplots(len(PHASES), len(ops), figsize=(4.2 * len(ops), 7), squeeze=False)
    for j, op in enumerate(ops):
        cs = sorted((c for c in data["cells"] if c["op"] == op), key=lambda c: c["bytes"])
        for i, phase in enumerate(PHASES):
            ax = axes[i][j]
            for lib in ["copy", "pynorm", "pynorm:plan", *PEERS]:
                key = {"copy": "copy", "pynorm:plan": f"pynorm:plan_{phase}"}.get(lib, f"{lib}:{phase}")
                pts = [(c["bytes"], c["t"][key] * 1e6) for c in cs if key in c["t"]]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    style = _STYLE.get(lib, {})
                    ax.plot(xs, ys, marker=".", label=lib, **style)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{op} {phase}", fontsize=9)
            ax.set_xlabel("bytes of x")
            if j == 0:
                ax.set_ylabel("us per call")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"size sweep, float32, {data['meta']['threads']} threads, {data['meta']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], int(sys.argv[3])))
    print("usage: python -m pynorm bench --sizes [--quick] (this module's --worker LIB THREADS is the runner's)")
    sys.exit(2)
