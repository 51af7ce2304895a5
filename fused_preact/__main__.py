"""``python -m fused_preact``: the main job (see fused_preact.train)."""

import sys

from fused_preact.train import main

if __name__ == "__main__":
    sys.exit(main())
