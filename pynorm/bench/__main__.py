"""``python -m pynorm.bench``: the same as ``python -m pynorm bench`` (:func:`pynorm.bench.main`)."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
