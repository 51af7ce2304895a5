"""``python -m fused_preact.bench``: see :mod:`fused_preact.bench.run`."""

import sys

from fused_preact.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
