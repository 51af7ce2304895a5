"""``python -m tools.static_report``: see :mod:`tools.static_report.report`."""

import sys

from tools.static_report.report import main

if __name__ == "__main__":
    sys.exit(main())
