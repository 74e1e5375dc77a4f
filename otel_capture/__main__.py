"""``python -m otel_capture``: the ``otel-capture`` command, for an environment whose scripts are not on
``PATH``."""

from __future__ import annotations

import sys

from ._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
