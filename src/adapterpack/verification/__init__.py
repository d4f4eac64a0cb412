"""Verification: every function of a package, driven the way real clients call it on random ids
and real text, on the runtime of its format (the numpy executor of an ML Program, ``formats.mlpackage.executor``, or Core ML on macOS; Core AI's runtime for an asset): exact against its
PyTorch reference holding the package's own weights, and its quality, those weights against the
float32 reference, on real text."""

__all__ = ["drives", "metrics", "own_weights", "package", "ranges", "reference", "reports", "runners", "texts"]
