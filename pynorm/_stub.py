"""``python -m pynorm._stub``: rewrite ``pynorm/functional.pyi`` from the op specs (:func:`pynorm._api.stub`);
``--check``: exit 1 if it is not current."""

from __future__ import annotations

import sys
from pathlib import Path

from pynorm import _api

PATH = Path(_api.__file__).with_name("functional.pyi")


def main(argv: list[str]) -> int:
    text = _api.stub()
    if argv and argv[0] == "--check":
        return 0 if PATH.read_text() == text else 1
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
