"""``python -m fused_preact``: the main job (see fused_preact.experiments.main_job)."""

import sys

from fused_preact.experiments.main_job import main

if __name__ == "__main__":
    sys.exit(main())
