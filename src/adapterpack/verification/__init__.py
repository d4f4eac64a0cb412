"""Verification: every function of a package, driven the way real clients call it on random ids
and real text, on our numpy executor of the ML Program (or Core ML on macOS): exact against its
PyTorch reference holding the package's own weights, and its quality, those weights against the
float32 reference, on real text."""

__all__ = [
    "drives", "executor", "metrics", "own_weights", "package", "ranges", "reference", "reports",
    "runners", "texts",
]
