"""A fresh interpreter's answer to: which of the HEAVY modules does importing MODULE load? (``test_imports``)

python tests/loaded.py MODULE HEAVY...     # prints the loaded ones, comma-separated (nothing: none)
"""

from __future__ import annotations

import importlib
import sys


def main(module: str, *heavy: str) -> None:
    importlib.import_module(module)
    print(",".join(m for m in heavy if m in sys.modules))


if __name__ == "__main__":
    main(*sys.argv[1:])
