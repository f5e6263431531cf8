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
import json, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import pynorm
    from pynorm.backends.numba import _cache, _reduce
p = np.arange(12, dtype=np.float64).reshape(3, 4)
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


def _run(root: Path, cache: Path, **env_extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    env.update({"PYTHONPATH": str(root), "NUMBA_CACHE_DIR": str(cache), **env_extra})
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=root
    )
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
