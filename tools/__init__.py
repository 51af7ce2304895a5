"""Developer tools of the repository (not part of the installed ``fused_preact`` package): run them
from the repository root, e.g. ``python -m tools.static_report``."""
