"""CPU benchmark of the numba backend: ``python bench/bench_cpu.py [--quick] [--ops] [--small] [--out DIR]``.

The same as ``python -m pynorm bench``; the implementation (the cases read from the op specs, the worker
processes, the byte model behind the GB/s figures) is in :mod:`pynorm.bench`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pynorm.bench import main

if __name__ == "__main__":
    sys.exit(main())
