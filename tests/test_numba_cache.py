"""The numba backend's disk cache stays correct across its files (:mod:`pynorm.backends.numba._cache`).

numba revalidates a cached function against the file that defines it only (numba/numba#8359);
the backend's locator stamps every kernel with a hash of all its source files instead. These
tests copy the package to a temporary directory and run kernels in fresh processes: a kernel is
a cache hit when nothing changed, and recompiles -- with the new behaviour -- after a helper it
calls was edited in *another* file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("numba", reason="numba is not installed: the numba backend is unavailable")

import pynorm

# sum_blocks lives in _reduce.py and stores its float64 result through st_exact, defined in _storage.py
_SCRIPT = r"""
import json, os, tempfile, time, warnings
import numpy as np
# PYNORM_TEST_READONLY: directories to treat as read-only (root ignores permission bits; numba probes a cache
# directory by creating a temporary file in it)
_ro = [d for d in os.environ.get("PYNORM_TEST_READONLY", "").split(os.pathsep) if d]
_tf = tempfile.TemporaryFile
def _probe(*a, dir=None, **k):
    if dir is not None and any(os.path.abspath(str(dir)).startswith(d) for d in _ro):
        raise PermissionError(13, "read-only file system", str(dir))
    return _tf(*a, dir=dir, **k)
tempfile.TemporaryFile = _probe
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import pynorm
    from pynorm.backends.numba import _cache, _reduce
    # PYNORM_TEST_DTYPES: the dtypes of p to call with (one signature each; default float64), after the file
    # PYNORM_TEST_GO exists where it is set (processes started together)
    _go = os.environ.get("PYNORM_TEST_GO")
    while _go and not os.path.exists(_go):
        time.sleep(0.001)
    for _dt in os.environ.get("PYNORM_TEST_DTYPES", "float64").split(","):
        p = np.arange(12, dtype=_dt).reshape(3, 4)
        out = np.empty(4)
        _reduce.sum_blocks(p, out, 0, 1)  # every column: one tile
stats = _reduce.sum_blocks.stats
print("RESULT " + json.dumps({
    "file": pynorm.__file__,
    "out": out.tolist(),
    "hits": sum(stats.cache_hits.values()),
    "misses": sum(stats.cache_misses.values()),
    "caching": _cache.CACHING,
    "warnings": [str(w.message) for w in caught if "pynorm" in str(w.message)],
}))
"""


def _env(root: Path, cache: Path, **env_extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env.update({"PYTHONPATH": str(root), "NUMBA_CACHE_DIR": str(cache), **env_extra})
    return env


def _run(root: Path, cache: Path, **env_extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=_env(root, cache, **env_extra),
        timeout=600, cwd=root,
    )  # fmt: skip
    return _result(proc, root)


def _result(proc: Any, root: Path) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert Path(res["file"]).resolve().is_relative_to(root.resolve()), res["file"]  # the copy, not the install
    return res


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    shutil.copytree(Path(pynorm.__file__).parent, root / "pynorm", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_helper_edited_in_another_file_recompiles_the_kernel(package_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run(package_copy, cache)
    assert first["caching"] and first["misses"] == 1 and first["hits"] == 0
    assert first["out"] == [12.0, 15.0, 18.0, 21.0]
    again = _run(package_copy, cache)
    assert again["hits"] == 1 and again["misses"] == 0 and again["out"] == first["out"]

    # edit the float64 store of st_exact (_storage.py); _reduce.py, which defines sum_blocks, is untouched
    storage = package_copy / "pynorm" / "backends" / "numba" / "_storage.py"
    text = storage.read_text()
    old = "a[j] = np.float64(v)"
    assert text.count(old) == 1
    storage.write_text(text.replace(old, "a[j] = np.float64(v) + 1.0"))

    edited = _run(package_copy, cache)
    assert edited["misses"] == 1 and edited["hits"] == 0, "the kernel was loaded from a stale cache entry"
    assert edited["out"] == [13.0, 16.0, 19.0, 22.0]
    assert _run(package_copy, cache)["hits"] == 1


def test_without_the_locator_the_kernels_compile_uncached_with_one_warning(package_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    res = _run(package_copy, cache, NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator")
    assert not res["caching"] and res["out"] == [12.0, 15.0, 18.0, 21.0]
    assert len(res["warnings"]) == 1 and "cache=False" in res["warnings"][0]
    assert res["hits"] == 0
    assert not cache.exists() or not any(cache.rglob("*.nbi"))


def _corrupt(path: Path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "zeros":
        path.write_bytes(bytes(len(data)))
    elif kind == "flipped":
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF  # one byte of machine code or pickle: never loaded as it is
        path.write_bytes(bytes(b))
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        path.write_text("not a cache file \u00e9", encoding="latin-1")


@pytest.mark.parametrize(
    "target, kind",
    [
        ("nbi", "truncated"),
        ("nbi", "text"),
        ("nbi", "empty"),
        ("nbc", "zeros"),
        ("nbc", "flipped"),
        ("nbc", "truncated"),
    ],
)
def test_a_corrupt_cache_file_is_recompiled_with_one_warning(
    package_copy: Path, tmp_path: Path, target: str, kind: str
) -> None:
    """Every later process used to fail (EOFError, UnpicklingError...) on a corrupt index or data file: now the
    kernel recompiles with one warning, the entry is rewritten, and the next process loads it again."""
    cache = tmp_path / "cache"
    assert _run(package_copy, cache)["misses"] == 1
    files = sorted(cache.rglob(f"_reduce.sum_blocks-*.{target}"))
    assert files, sorted(p.name for p in cache.rglob("*"))
    for f in files:
        _corrupt(f, kind)
    broken = _run(package_copy, cache)
    assert broken["out"] == [12.0, 15.0, 18.0, 21.0] and broken["misses"] == 1
    assert len(broken["warnings"]) == 1 and "could not be read" in broken["warnings"][0], broken["warnings"]
    repaired = _run(package_copy, cache)
    assert repaired["hits"] == 1 and repaired["misses"] == 0 and not repaired["warnings"]


def test_with_nowhere_writable_the_kernels_compile_and_a_warm_cache_is_used(package_copy: Path, tmp_path: Path) -> None:
    """No writable cache directory (NUMBA_CACHE_DIR, the package's __pycache__ and HOME all read-only): every call
    still works, with one warning; a cache warmed earlier in that read-only directory is loaded."""
    cache = tmp_path / "cache"
    home = tmp_path / "home"
    home.mkdir()
    readonly = os.pathsep.join(str(p) for p in (cache, package_copy, home))
    cold = _run(package_copy, cache, PYNORM_TEST_READONLY=readonly, HOME=str(home))
    assert cold["out"] == [12.0, 15.0, 18.0, 21.0] and cold["misses"] == 1
    assert len(cold["warnings"]) == 1 and "no writable directory" in cold["warnings"][0], cold["warnings"]
    assert not any(cache.rglob("*.nbi"))
    assert _run(package_copy, cache)["misses"] == 1  # warm it, writable
    warm = _run(package_copy, cache, PYNORM_TEST_READONLY=readonly, HOME=str(home))
    assert warm["hits"] == 1 and warm["misses"] == 0 and not warm["warnings"]


# Processes saving entries of one function's cache at once: each waits at a barrier file, then saves its own keys.
_WRITER = r"""
import os, sys, time
from pynorm.backends.numba import _cache
f = _cache._CheckedCacheFile(sys.argv[1], "kernel-1.py311", "stamp")
who, n = sys.argv[2], int(sys.argv[3])
go = os.path.join(sys.argv[1], "go")
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(n):
    f.save(((f"float{who}", i), ("x86_64", "cpu")), (who, i, b"x" * 4096))
"""


def _race(tmp_path: Path, writers: int = 4, n: int = 60) -> tuple[int, list[str]]:
    """``writers`` processes save ``n`` entries each into one cache at once; the entries the index kept, and the
    entries that load anything other than their own data."""
    from pynorm.backends.numba import _cache

    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(w), str(n)]) for w in range(writers)]
    (tmp_path / "go").touch()
    assert all(p.wait(timeout=300) == 0 for p in procs)
    f = _cache._CheckedCacheFile(str(tmp_path), "kernel-1.py311", "stamp")
    index = f._load_index()
    keys = [((f"float{w}", i), ("x86_64", "cpu")) for w in range(writers) for i in range(n)]
    kept = [k for k in keys if k in index]
    wrong = [repr(k) for k in kept if f.load(k) != (k[0][0][len("float") :], k[0][1], b"x" * 4096)]
    return len(kept), wrong


def test_processes_compiling_into_one_cache_at_once_lose_no_entry_and_mix_none(tmp_path: Path) -> None:
    """numba's own save (read the index, write it, then the data; no lock) dropped entries when processes saved
    into one cache at once -- the pytest-xdist and dask workers -- and could name another signature's data file:
    every entry saved under the lock is kept and loads its own data."""
    kept, wrong = _race(tmp_path)
    assert (kept, wrong) == (4 * 60, [])


def test_an_entry_naming_another_signatures_data_is_a_miss(tmp_path: Path) -> None:
    from pynorm.backends.numba import _cache

    f = _cache._CheckedCacheFile(str(tmp_path), "kernel-1.py311", "stamp")
    a, b = (("float32",), ("cpu",)), (("float64",), ("cpu",))
    f.save(a, "code for float32")
    f.save(b, "code for float64")
    index = f._load_index()
    index[a], index[b] = index[b], index[a]  # what numba's race left: each key naming the other's file
    f._save_index(index)
    with pytest.raises(ValueError, match="another signature"):
        f.load(a)


def test_processes_compiling_one_kernel_at_once_leave_a_cache_serving_both(package_copy: Path, tmp_path: Path) -> None:
    """The real path: two processes compile their own signatures of one kernel at the same moment into one cache;
    a third process then loads both and compiles nothing, with no warning."""
    cache, go = tmp_path / "cache", tmp_path / "go"

    def start(dt: str) -> subprocess.Popen[str]:
        env = _env(package_copy, cache, PYNORM_TEST_DTYPES=dt, PYNORM_TEST_GO=str(go))
        pipe, cmd = subprocess.PIPE, [sys.executable, "-c", _SCRIPT]
        return subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, cwd=package_copy, env=env)

    procs = [start(dt) for dt in ("float64", "float32")]
    go.touch()
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        res = _result(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), package_copy)
        assert res["misses"] == 1 and not res["warnings"], res
    both = _run(package_copy, cache, PYNORM_TEST_DTYPES="float64,float32")
    assert both["hits"] == 2 and both["misses"] == 0 and not both["warnings"], both
